//! The KV stream's records: after the proof, every byte either way is AES-256-GCM, one key per
//! direction and connection, nonces a per-direction counter.
//!
//! Keys: HKDF-SHA256 (salt: both sides' nonces, fresh per connection; ikm: the
//! session's stream key; info: `pdpair/stream seal` and the direction), so no two connections
//! share a key, and a record replayed, dropped, reordered or moved to the other direction fails
//! to open. A record is its ciphertext and a 16-byte tag; its length is known to both sides
//! from the framing (a header's length, a status's text length), never read from the record.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, Tag, UnboundKey};

/// A record's tag.
pub const TAG: usize = 16;
/// The longest record's plaintext: a PUT's or GET's bytes go in records of this size (the last
/// one shorter).
pub const CHUNK: usize = 256 << 10;

/// Which side of the connection we are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Dialler,
    Listener,
}

struct Key {
    key: LessSafeKey,
    seq: u64,
}

impl Key {
    fn derive(stream_key: &[u8; 32], nonce: &[u8], from: Side) -> Key {
        let info: &[u8] = match from {
            Side::Dialler => b"pdpair/stream seal dialler",
            Side::Listener => b"pdpair/stream seal listener",
        };
        let mut k = [0u8; 32];
        hkdf::Hkdf::<sha2::Sha256>::new(Some(nonce), stream_key)
            .expand(info, &mut k)
            .unwrap_or_else(|_| unreachable!("32 bytes is a valid HKDF-SHA256 length"));
        let key = UnboundKey::new(&AES_256_GCM, &k).unwrap_or_else(|_| unreachable!("AES-256 takes 32-byte keys"));
        Key {
            key: LessSafeKey::new(key),
            seq: 0,
        }
    }

    fn nonce(&mut self) -> io::Result<Nonce> {
        let mut n = [0u8; NONCE_LEN];
        n[4..].copy_from_slice(&self.seq.to_be_bytes());
        self.seq = self
            .seq
            .checked_add(1)
            .ok_or_else(|| io::Error::other("the stream's record counter ran out"))?;
        Ok(Nonce::assume_unique_for_key(n))
    }
}

/// One connection with its two keys and a buffer of one record. Every socket call keeps to
/// `deadline` when one is set (the dialler's op), however the peer paces its bytes.
pub struct Conn {
    pub sock: TcpStream,
    pub deadline: Option<Instant>,
    tx: Key,
    rx: Key,
    buf: Vec<u8>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Conn({:?}, sent {}, received {})",
            self.sock.peer_addr().ok(),
            self.tx.seq,
            self.rx.seq
        )
    }
}

/// A record that did not open: changed, dropped, replayed or reordered on the way.
pub fn forged() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        "a record failed its authentication (changed on the way)",
    )
}

fn seal_into(tx: &mut Key, buf: &mut [u8], n: usize) -> io::Result<usize> {
    let nonce = tx.nonce()?;
    let tag: Tag = tx
        .key
        .seal_in_place_separate_tag(nonce, Aad::empty(), &mut buf[..n])
        .map_err(|_| io::Error::other("sealing a record failed"))?;
    buf[n..n + TAG].copy_from_slice(tag.as_ref());
    Ok(n + TAG)
}

impl Conn {
    /// `sock` after the proof of `stream_key`'s admission; `salt`: both sides' nonces.
    pub fn new(sock: TcpStream, stream_key: &[u8; 32], salt: &[u8], side: Side) -> Conn {
        let other = match side {
            Side::Dialler => Side::Listener,
            Side::Listener => Side::Dialler,
        };
        Conn {
            sock,
            deadline: None,
            tx: Key::derive(stream_key, salt, side),
            rx: Key::derive(stream_key, salt, other),
            buf: vec![0u8; CHUNK + TAG],
        }
    }

    /// Sends each of `small` (at most 64 bytes each) as a record, in one write.
    pub fn send_small(&mut self, small: &[&[u8]]) -> io::Result<()> {
        let mut out = Vec::with_capacity(small.iter().map(|r| r.len() + TAG).sum());
        for r in small {
            if r.len() > 64 {
                return Err(io::Error::other("a small record over 64 bytes"));
            }
            let at = out.len();
            out.extend_from_slice(r);
            out.extend_from_slice(&[0u8; TAG]);
            seal_into(&mut self.tx, &mut out[at..], r.len())?;
        }
        write_full(&mut self.sock, &[&out], self.deadline)
    }

    /// Sends `head` (at most 64 bytes) as one record and then `len` bytes in records of
    /// [`CHUNK`], the first with the head in one system call where the socket takes it. `fill`
    /// writes each record's plaintext (its offset in the `len` bytes, and the bytes to fill)
    /// just before it is sealed; its error ends the op there.
    pub fn send_op(
        &mut self,
        head: &[u8],
        len: u64,
        mut fill: impl FnMut(u64, &mut [u8]) -> io::Result<()>,
    ) -> io::Result<()> {
        if head.len() > 64 {
            return Err(io::Error::other("a header over 64 bytes"));
        }
        let mut head_record = [0u8; 64 + TAG];
        let h = head.len();
        head_record[..h].copy_from_slice(head);
        let mut done = 0u64;
        let mut first = true;
        loop {
            let n = (len - done).min(CHUNK as u64) as usize;
            if n > 0 {
                fill(done, &mut self.buf[..n])?;
            }
            // The header is sealed once the first piece is filled: a fill that fails leaves no
            // sealed record unsent (the next record sealed is the one the peer expects, and
            // it reads the refusal, not a record that fails its authentication).
            let head_part: &[u8] = if first {
                first = false;
                let sealed = seal_into(&mut self.tx, &mut head_record, h)?;
                &head_record[..sealed]
            } else {
                &[]
            };
            let body = if n > 0 {
                seal_into(&mut self.tx, &mut self.buf, n)?
            } else {
                0
            };
            write_full(&mut self.sock, &[head_part, &self.buf[..body]], self.deadline)?;
            done += n as u64;
            if done >= len {
                return Ok(());
            }
        }
    }

    /// Sends `plain` (at most [`CHUNK`] bytes) as one record.
    pub fn send(&mut self, plain: &[u8]) -> io::Result<()> {
        if plain.len() > CHUNK {
            return Err(io::Error::other("a record over the chunk size"));
        }
        let n = plain.len();
        self.buf[..n].copy_from_slice(plain);
        let n = seal_into(&mut self.tx, &mut self.buf, n)?;
        write_full(&mut self.sock, &[&self.buf[..n]], self.deadline)
    }

    /// Receives one record of `len` bytes (at most [`CHUNK`]); its plaintext, only once it
    /// opened.
    pub fn recv(&mut self, len: usize) -> io::Result<&[u8]> {
        if len > CHUNK {
            return Err(io::Error::other("a record over the chunk size"));
        }
        read_full(&mut self.sock, &mut self.buf[..len + TAG], self.deadline)?;
        let nonce = self.rx.nonce()?;
        let (data, tag) = self.buf[..len + TAG].split_at_mut(len);
        let tag = Tag::try_from(&tag[..]).map_err(|_| forged())?;
        self.rx
            .key
            .open_in_place_separate_tag(nonce, Aad::empty(), tag, data, 0..)
            .map_err(|_| forged())?;
        Ok(&self.buf[..len])
    }

    /// Receives `len` bytes in records of [`CHUNK`], handing each to `take` (its offset in the
    /// `len` bytes, its plaintext) only once it opened: nothing unauthenticated is handed on.
    pub fn recv_each(&mut self, len: u64, mut take: impl FnMut(u64, &[u8])) -> io::Result<()> {
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(CHUNK as u64) as usize;
            take(done, self.recv(n)?);
            done += n as u64;
        }
        Ok(())
    }
}

/// Before each system call: the time left of `deadline` as the socket's timeouts.
fn bound(c: &TcpStream, deadline: Option<Instant>) -> io::Result<()> {
    if let Some(deadline) = deadline {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the deadline passed"));
        }
        c.set_read_timeout(Some(left))?;
        c.set_write_timeout(Some(left))?;
    }
    Ok(())
}

/// `read_exact` that keeps to `deadline` (when set) however the peer paces its bytes.
pub fn read_full(c: &mut TcpStream, mut into: &mut [u8], deadline: Option<Instant>) -> io::Result<()> {
    while !into.is_empty() {
        bound(c, deadline)?;
        match c.read(into) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the stream",
                ));
            }
            Ok(n) => into = &mut into[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes `parts` in order with as few system calls as the socket allows (one, usually: a
/// header alone would be a packet of its own with `TCP_NODELAY`), each call kept to
/// `deadline` (when set) however the peer paces its reads.
pub fn write_full(c: &mut TcpStream, parts: &[&[u8]], deadline: Option<Instant>) -> io::Result<()> {
    let mut parts: Vec<&[u8]> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
    while !parts.is_empty() {
        bound(c, deadline)?;
        let slices: Vec<io::IoSlice<'_>> = parts.iter().map(|p| io::IoSlice::new(p)).collect();
        let mut n = match c.write_vectored(&slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        while n > 0 {
            let first = parts[0];
            if n >= first.len() {
                n -= first.len();
                parts.remove(0);
            } else {
                parts[0] = &first[n..];
                n = 0;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ends of one connection, sealed with one key.
    fn pair() -> (Conn, Conn) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let dialled = TcpStream::connect(listener.local_addr().expect("addr")).expect("dial");
        let (accepted, _) = listener.accept().expect("accept");
        let (key, salt) = ([9u8; 32], [4u8; 64]);
        (
            Conn::new(dialled, &key, &salt, Side::Dialler),
            Conn::new(accepted, &key, &salt, Side::Listener),
        )
    }

    #[test]
    fn an_op_whose_first_piece_cannot_be_filled_sends_nothing_and_the_next_record_opens() {
        // A read whose first copy fails (its blocks taken back between the window check and the
        // copy, or a device read error) is answered with a refusal: the refusal must open, not
        // fail authentication because a header sealed for the failed op was never sent.
        let (mut dialler, mut listener) = pair();
        let failed = listener.send_op(&[1, 0, 0], 100, |_, _| Err(io::Error::other("taken back")));
        assert!(failed.is_err());
        listener.send(b"refused").expect("the refusal");
        dialler.deadline = Some(Instant::now() + std::time::Duration::from_secs(5));
        assert_eq!(dialler.recv(7).expect("opens"), b"refused");
        // An op that fills sends its header and its bytes.
        listener
            .send_op(&[1, 0, 0], 3, |_, into| {
                into.copy_from_slice(b"abc");
                Ok(())
            })
            .expect("sent");
        assert_eq!(dialler.recv(3).expect("header"), &[1, 0, 0]);
        assert_eq!(dialler.recv(3).expect("body"), b"abc");
    }
}
