//! The KV stream's records: after the proof, every byte either way is AES-256-GCM, one key per
//! direction and connection, nonces a per-direction counter.
//!
//! Keys: HKDF-SHA256 (salt: the listener's greeting nonce, fresh per connection; ikm: the
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

/// One connection with its two keys and a buffer of one record.
pub struct Conn {
    pub sock: TcpStream,
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

impl Conn {
    /// `sock` after the proof of `stream_key`'s admission, against the greeting's `nonce`.
    pub fn new(sock: TcpStream, stream_key: &[u8; 32], nonce: &[u8], side: Side) -> Conn {
        let other = match side {
            Side::Dialler => Side::Listener,
            Side::Listener => Side::Dialler,
        };
        Conn {
            sock,
            tx: Key::derive(stream_key, nonce, side),
            rx: Key::derive(stream_key, nonce, other),
            buf: vec![0u8; CHUNK + TAG],
        }
    }

    /// Seals `plain` (at most [`CHUNK`] bytes) into the buffer; the record's length on the wire.
    fn seal(&mut self, plain: &[u8]) -> io::Result<usize> {
        let n = plain.len();
        debug_assert!(n <= CHUNK);
        self.buf[..n].copy_from_slice(plain);
        let nonce = self.tx.nonce()?;
        let tag: Tag = self
            .tx
            .key
            .seal_in_place_separate_tag(nonce, Aad::empty(), &mut self.buf[..n])
            .map_err(|_| io::Error::other("sealing a record failed"))?;
        self.buf[n..n + TAG].copy_from_slice(tag.as_ref());
        Ok(n + TAG)
    }

    /// Sends `plain` as one record.
    pub fn send(&mut self, plain: &[u8]) -> io::Result<()> {
        let n = self.seal(plain)?;
        self.sock.write_all(&self.buf[..n])
    }

    /// Sends `head` as one record and `body` in records of [`CHUNK`] bytes, the first with the
    /// head in one system call where the socket takes it; `each` runs before every socket write
    /// (the caller's deadline).
    pub fn send_with(
        &mut self,
        head: &[u8],
        body: &[u8],
        mut each: impl FnMut(&TcpStream) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut head_record = [0u8; 64 + TAG];
        let h = head.len();
        head_record[..h].copy_from_slice(head);
        let nonce = self.tx.nonce()?;
        let tag = self
            .tx
            .key
            .seal_in_place_separate_tag(nonce, Aad::empty(), &mut head_record[..h])
            .map_err(|_| io::Error::other("sealing a record failed"))?;
        head_record[h..h + TAG].copy_from_slice(tag.as_ref());
        let mut chunks = body.chunks(CHUNK);
        let first = chunks.next().unwrap_or(&[]);
        let n = if first.is_empty() { 0 } else { self.seal(first)? };
        each(&self.sock)?;
        write_both(&mut self.sock, &head_record[..h + TAG], &self.buf[..n])?;
        for chunk in chunks {
            let n = self.seal(chunk)?;
            each(&self.sock)?;
            self.sock.write_all(&self.buf[..n])?;
        }
        Ok(())
    }

    /// Sends each of `small` (at most 64 bytes each) as a record, in one write.
    pub fn send_small(&mut self, small: &[&[u8]]) -> io::Result<()> {
        let mut out = Vec::with_capacity(small.iter().map(|r| r.len() + TAG).sum());
        for r in small {
            debug_assert!(r.len() <= 64);
            let at = out.len();
            out.extend_from_slice(r);
            let nonce = self.tx.nonce()?;
            let tag = self
                .tx
                .key
                .seal_in_place_separate_tag(nonce, Aad::empty(), &mut out[at..])
                .map_err(|_| io::Error::other("sealing a record failed"))?;
            out.extend_from_slice(tag.as_ref());
        }
        self.sock.write_all(&out)
    }

    /// Receives one record of `len` bytes (at most [`CHUNK`]), by `deadline` when one is set;
    /// its plaintext, only once it opened.
    pub fn recv(&mut self, len: usize, deadline: Option<Instant>) -> io::Result<&[u8]> {
        debug_assert!(len <= CHUNK);
        read_full(&mut self.sock, &mut self.buf[..len + TAG], deadline)?;
        let nonce = self.rx.nonce()?;
        let (data, tag) = self.buf[..len + TAG].split_at_mut(len);
        let tag = Tag::try_from(&tag[..]).map_err(|_| forged())?;
        self.rx
            .key
            .open_in_place_separate_tag(nonce, Aad::empty(), tag, data, 0..)
            .map_err(|_| forged())?;
        Ok(&self.buf[..len])
    }

    /// Receives `into.len()` bytes in records of [`CHUNK`], each copied into `into` only once it
    /// opened (nothing unauthenticated lands); `into: None` drops them after they opened.
    pub fn recv_into(&mut self, into: Option<&mut [u8]>, len: u64, deadline: Option<Instant>) -> io::Result<()> {
        let mut done = 0u64;
        let mut into = into;
        while done < len {
            let n = (len - done).min(CHUNK as u64) as usize;
            let plain = self.recv(n, deadline)?;
            if let Some(into) = into.as_deref_mut() {
                // `done + n <= len == into.len()`.
                into[done as usize..done as usize + n].copy_from_slice(plain);
            }
            done += n as u64;
        }
        Ok(())
    }
}

/// `read_exact` that keeps to `deadline` (when set) however the peer paces its bytes.
pub fn read_full(c: &mut TcpStream, mut into: &mut [u8], deadline: Option<Instant>) -> io::Result<()> {
    while !into.is_empty() {
        if let Some(deadline) = deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the deadline passed"));
            }
            c.set_read_timeout(Some(left))?;
        }
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

/// Writes `head` then `body` with as few system calls as the socket allows (one, usually: a
/// header alone would be a packet of its own with `TCP_NODELAY`).
pub fn write_both(c: &mut TcpStream, head: &[u8], body: &[u8]) -> io::Result<()> {
    let (mut head, mut body) = (head, body);
    while !head.is_empty() {
        let n = match c.write_vectored(&[io::IoSlice::new(head), io::IoSlice::new(body)]) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let from_head = n.min(head.len());
        head = &head[from_head..];
        body = &body[n - from_head..];
    }
    c.write_all(body)
}
