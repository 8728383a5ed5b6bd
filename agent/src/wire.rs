//! Side-channel framing: versioned, length-prefixed JSON frames over TCP.
//!
//! A frame is a 4-byte big-endian length `n` (1 ..= [`MAX_FRAME`]) followed by `n` bytes of UTF-8
//! JSON holding one [`crate::protocol::Message`]. A zero or oversized length, a truncated frame,
//! or JSON that is not a message is a protocol error: the reader returns it and the caller closes
//! the connection. Nothing on this path panics.
//!
//! Before a peer has authenticated, frames are at most [`MAX_PREAUTH_FRAME`] bytes and the whole
//! exchange runs under one [`Deadline`]. After authentication every frame is *sealed*: the body
//! is followed by a 32-byte HMAC-SHA256 tag over the frame's sequence number and body, with a key
//! per direction derived from the authentication (see `protocol::Session`), so a frame that was
//! changed, dropped, replayed, reordered or reflected is refused.

use std::{
    io::{self, Read, Write},
    net::TcpStream,
    time::{Duration, Instant},
};

use hmac::{Hmac, Mac};
use serde::{Serialize, de::DeserializeOwned};
use sha2::Sha256;

/// The largest frame accepted from an authenticated peer (completion frames carry one checksum
/// per block).
pub const MAX_FRAME: usize = 16 << 20;
/// The largest frame accepted before the peer has authenticated: the authentication messages
/// are a few hundred bytes.
pub const MAX_PREAUTH_FRAME: usize = 4 << 10;
/// Bytes of a sealed frame's tag.
pub const TAG_LEN: usize = 32;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The peer closed the connection between frames.
    #[error("connection closed")]
    Closed,
    /// I/O failed, or the connection ended inside a frame.
    #[error("side channel I/O: {0}")]
    Io(#[from] io::Error),
    /// The length prefix is zero or larger than [`MAX_FRAME`].
    #[error("frame length {0} is outside 1..={MAX_FRAME}")]
    BadLength(usize),
    /// The body is not a valid message.
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// A sealed frame's tag does not match: changed, replayed, reordered or forged.
    #[error("frame {0} failed authentication")]
    BadTag(u64),
}

impl FrameError {
    /// Whether the error is a read or write that ran out of time.
    pub fn timed_out(&self) -> bool {
        matches!(self, FrameError::Io(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
    }
}

/// Writes one frame.
pub fn write_frame<T: Serialize>(w: &mut impl Write, message: &T) -> Result<(), FrameError> {
    let body = serde_json::to_vec(message).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if body.is_empty() || body.len() > MAX_FRAME {
        return Err(FrameError::BadLength(body.len()));
    }
    let len = u32::try_from(body.len()).map_err(|_| FrameError::BadLength(body.len()))?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame of at most [`MAX_FRAME`] bytes.
pub fn read_frame<T: DeserializeOwned>(r: &mut impl Read) -> Result<T, FrameError> {
    read_frame_max(r, MAX_FRAME)
}

/// Reads one frame of at most `max` bytes (the length is checked before anything is
/// allocated).
pub fn read_frame_max<T: DeserializeOwned>(r: &mut impl Read, max: usize) -> Result<T, FrameError> {
    let body = read_body(r, max)?;
    serde_json::from_slice(&body).map_err(|e| FrameError::Malformed(e.to_string()))
}

fn read_body(r: &mut impl Read, max: usize) -> Result<Vec<u8>, FrameError> {
    read_body_by(r, max, |_| Ok(())).map(|(body, ())| body)
}

/// [`read_body`], with `admit` asked for room for the frame's length before a byte of its body is
/// read or allocated; what it returns (a charge) is held until the caller drops it.
fn read_body_by<G>(
    r: &mut impl Read,
    max: usize,
    admit: impl FnOnce(usize) -> Result<G, String>,
) -> Result<(Vec<u8>, G), FrameError> {
    let (n, admitted) = read_length(r, max, admit)?;
    let mut body = vec![0u8; n];
    r.read_exact(&mut body)?;
    Ok((body, admitted))
}

/// A frame's length prefix, checked against `max` (and [`MAX_FRAME`]), then `admit` asked for
/// room for it: before a byte of the body is read or allocated.
fn read_length<G>(
    r: &mut impl Read,
    max: usize,
    admit: impl FnOnce(usize) -> Result<G, String>,
) -> Result<(usize, G), FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let n = u32::from_be_bytes(len) as usize;
    if n == 0 || n > max.min(MAX_FRAME) {
        return Err(FrameError::BadLength(n));
    }
    let admitted = admit(n).map_err(|e| FrameError::Io(io::Error::new(io::ErrorKind::OutOfMemory, e)))?;
    Ok((n, admitted))
}

type HmacSha256 = Hmac<Sha256>;

fn tag(key: &[u8; 32], seq: u64, body: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length; new_from_slice cannot fail for HMAC.
    let mut m = HmacSha256::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    m.update(&seq.to_be_bytes());
    m.update(body);
    m
}

/// The sending half of a session: seals frames with one direction's key and a counter.
#[derive(Clone)]
pub struct Sealer {
    key: [u8; 32],
    seq: u64,
}

/// The receiving half of a session: opens the peer's sealed frames in order.
#[derive(Clone)]
pub struct Opener {
    key: [u8; 32],
    seq: u64,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sealer(seq {})", self.seq)
    }
}

impl std::fmt::Debug for Opener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Opener(seq {})", self.seq)
    }
}

impl Sealer {
    /// A sealer starting at sequence number 0.
    pub fn new(key: [u8; 32]) -> Sealer {
        Sealer { key, seq: 0 }
    }
}

impl Opener {
    /// An opener expecting sequence number 0 first.
    pub fn new(key: [u8; 32]) -> Opener {
        Opener { key, seq: 0 }
    }
}

/// Writes one sealed frame: length, body, then the tag over (sequence number, body).
pub fn write_sealed<T: Serialize>(w: &mut impl Write, sealer: &mut Sealer, message: &T) -> Result<(), FrameError> {
    let buf = seal(sealer, message)?;
    w.write_all(&buf)?;
    w.flush()?;
    Ok(())
}

/// One sealed frame's bytes, as [`write_sealed`] writes them (the sealer counts it as sent).
pub fn seal<T: Serialize>(sealer: &mut Sealer, message: &T) -> Result<Vec<u8>, FrameError> {
    seal_if(sealer, message, |_| true).map(|frame| frame.unwrap_or_default())
}

/// [`seal`], only when `fits` the frame's length: `None` otherwise, the sealer untouched (the
/// next frame sealed is still the one the peer expects).
pub fn seal_if<T: Serialize>(
    sealer: &mut Sealer,
    message: &T,
    fits: impl FnOnce(usize) -> bool,
) -> Result<Option<Vec<u8>>, FrameError> {
    let mut body = serde_json::to_vec(message).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if body.is_empty() || body.len() + TAG_LEN > MAX_FRAME {
        return Err(FrameError::BadLength(body.len()));
    }
    if !fits(4 + body.len() + TAG_LEN) {
        return Ok(None);
    }
    let t = tag(&sealer.key, sealer.seq, &body).finalize().into_bytes();
    sealer.seq += 1;
    let len = u32::try_from(body.len() + TAG_LEN).map_err(|_| FrameError::BadLength(body.len()))?;
    let mut buf = Vec::with_capacity(4 + body.len() + TAG_LEN);
    buf.extend_from_slice(&len.to_be_bytes());
    buf.append(&mut body);
    buf.extend_from_slice(&t);
    Ok(Some(buf))
}

/// Reads one sealed frame of at most `max` bytes; the tag is checked (in constant time) before
/// the body is parsed.
pub fn read_sealed<T: DeserializeOwned>(r: &mut impl Read, opener: &mut Opener, max: usize) -> Result<T, FrameError> {
    read_sealed_by(r, opener, max, |_| Ok(())).map(|(m, _)| m)
}

/// [`read_sealed`], with `admit` asked for room for the frame's length first ([`read_body_by`]);
/// its charge comes back with the message, held while the caller wants.
pub fn read_sealed_by<T: DeserializeOwned, G>(
    r: &mut impl Read,
    opener: &mut Opener,
    max: usize,
    mut admit: impl FnMut(usize) -> Result<G, String>,
) -> Result<(T, (G, Option<G>)), FrameError> {
    let (frame, admitted) = read_body_by(r, max, &mut admit)?;
    if frame.len() <= TAG_LEN {
        return Err(FrameError::BadLength(frame.len()));
    }
    let (body, t) = frame.split_at(frame.len() - TAG_LEN);
    tag(&opener.key, opener.seq, body)
        .verify_slice(t)
        .map_err(|_| FrameError::BadTag(opener.seq))?;
    opener.seq += 1;
    // Decoding holds every value at once: counted first (object keys too), keeping none, and
    // charged besides the frame (strings copied out of it, and [`VALUE_COST`] per value); the
    // frame and that at most four times the bound on a frame's length in all (a frame of 8M
    // zeros took 16 times its length; the largest a peer sends, a pull `Ready` with checksums of
    // `agent::MAX_REQUEST_BLOCKS` blocks, fits).
    let values = json_values(body).map_err(|e| FrameError::Malformed(e.to_string()))?;
    let cost = values.saturating_mul(VALUE_COST).saturating_add(frame.len());
    let bound = MAX_DECODE_COST.min(4 * max);
    if cost.saturating_add(frame.len()) > bound {
        return Err(FrameError::Malformed(format!(
            "the frame holds {values} JSON values in {} bytes; at most {} bytes and values at {VALUE_COST} each",
            frame.len(),
            bound
        )));
    }
    let more = Some(admit(cost).map_err(|e| FrameError::Io(io::Error::new(io::ErrorKind::OutOfMemory, e)))?);
    serde_json::from_slice(body)
        .map(|m| (m, (admitted, more)))
        .map_err(|e| FrameError::Malformed(e.to_string()))
}

/// A TCP stream under one deadline for a whole exchange: every read and write gets only the
/// time left, so a peer that trickles one byte per timeout still runs out of time.
#[derive(Debug)]
pub struct Deadline<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl<'a> Deadline<'a> {
    /// `stream` until `within` from now.
    pub fn new(stream: &'a TcpStream, within: Duration) -> Deadline<'a> {
        Deadline {
            stream,
            until: Instant::now() + within,
        }
    }

    /// When it runs out.
    pub fn until(&self) -> Instant {
        self.until
    }

    fn left(&self) -> io::Result<Duration> {
        time_left(self.until, "handshake deadline passed")
    }
}

/// What is left of `until` for the next system call, or a `TimedOut` error saying `passed`
/// once less than a millisecond is.
fn time_left(until: Instant, passed: &str) -> io::Result<Duration> {
    let left = until.saturating_duration_since(Instant::now());
    if left < Duration::from_millis(1) {
        return Err(io::Error::new(io::ErrorKind::TimedOut, passed));
    }
    Ok(left)
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        (&mut &*self.stream).read(buf)
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        (&mut &*self.stream).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        (&mut &*self.stream).flush()
    }
}

/// Asks the kernel for a send buffer of `bytes` on `stream` (`SO_SNDBUF`: fixed, no autotuning
/// past it; Linux keeps twice the value).
#[allow(unsafe_code)]
pub fn set_send_buffer(stream: &std::net::TcpStream, bytes: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let value = libc::c_int::try_from(bytes).map_err(|_| io::Error::other("send buffer past c_int"))?;
    // SAFETY: a valid socket descriptor, and a c_int of the size given.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            std::ptr::addr_of!(value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `stream`'s kernel send buffer (`SO_SNDBUF`), in bytes.
#[cfg(test)]
#[allow(unsafe_code)]
pub fn send_buffer(stream: &std::net::TcpStream) -> usize {
    use std::os::fd::AsRawFd;
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a valid socket, and a c_int of the size given.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            std::ptr::addr_of_mut!(value).cast(),
            &mut len,
        )
    };
    assert_eq!(rc, 0, "SO_SNDBUF: {}", io::Error::last_os_error());
    usize::try_from(value).unwrap_or(0)
}

/// Bytes in `stream`'s kernel send queue: written, not yet acknowledged by the peer.
#[cfg(test)]
#[allow(unsafe_code)]
pub fn send_queued(stream: &std::net::TcpStream) -> usize {
    use std::os::fd::AsRawFd;
    let mut value: libc::c_int = 0;
    // SAFETY: a valid socket, and a c_int for the answer.
    let rc = unsafe { libc::ioctl(stream.as_raw_fd(), libc::TIOCOUTQ, std::ptr::addr_of_mut!(value)) };
    assert_eq!(rc, 0, "TIOCOUTQ: {}", io::Error::last_os_error());
    usize::try_from(value).unwrap_or(0)
}

/// The most file descriptors one frame carries (a pool's regions).
pub const MAX_FDS: usize = crate::layout::MAX_REGIONS;

/// Writes one frame on a Unix socket, with `fds` attached (`SCM_RIGHTS`, in order, at most
/// [`MAX_FDS`]) to its first byte; with none, a plain frame.
#[allow(unsafe_code)]
pub fn write_frame_fds<T: Serialize>(
    stream: &std::os::unix::net::UnixStream,
    message: &T,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> Result<(), FrameError> {
    use std::os::fd::AsRawFd;
    if fds.len() > MAX_FDS {
        return Err(FrameError::Malformed(format!(
            "{} file descriptors; a frame carries at most {MAX_FDS}",
            fds.len()
        )));
    }
    if fds.is_empty() {
        return write_frame(&mut &*stream, message);
    }
    let mut buf = Vec::new();
    write_frame(&mut buf, message)?;
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = vec![0u8; control_space(fds.len())];
    let msg = msghdr(&mut iov, &mut control);
    // SAFETY: the control buffer is CMSG_SPACE bytes for `fds.len()` ints, as the CMSG macros
    // require, so the first header and its payload fit in it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN((fds.len() * std::mem::size_of::<libc::c_int>()) as u32) as _;
        let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
        for (i, fd) in fds.iter().enumerate() {
            std::ptr::write_unaligned(data.add(i), fd.as_raw_fd());
        }
    }
    // SAFETY: a valid socket and message.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(io::Error::last_os_error().into());
    }
    let sent = sent as usize;
    if sent < buf.len() {
        // The descriptor went with the first bytes; the rest is plain data.
        (&mut &*stream).write_all(&buf[sent..])?;
    }
    Ok(())
}

/// Bytes of a control buffer with room for `fds` descriptors.
#[allow(unsafe_code)]
fn control_space(fds: usize) -> usize {
    // SAFETY: CMSG_SPACE only computes a size.
    unsafe { libc::CMSG_SPACE((fds * std::mem::size_of::<libc::c_int>()) as u32) as usize }
}

/// A message header over one buffer and a control buffer; both must outlive its use.
#[allow(unsafe_code)]
fn msghdr(iov: &mut libc::iovec, control: &mut [u8]) -> libc::msghdr {
    // SAFETY: a zeroed msghdr is valid; only the fields set here are read.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    msg
}

/// Reads one frame of at most `max` bytes from a Unix socket, with the file descriptors that came
/// with its first bytes (in order). More than [`MAX_FDS`] is an error (the kernel truncates the
/// control message; what arrived is closed).
pub fn read_frame_fds<T: DeserializeOwned>(
    stream: &std::os::unix::net::UnixStream,
    max: usize,
) -> Result<(T, Vec<std::os::fd::OwnedFd>), FrameError> {
    read_frame_fds_by(stream, max, None)
}

/// A Unix stream whose every read keeps to `until` (when set): its read timeout is what is left.
struct UnixDeadline<'a> {
    stream: &'a std::os::unix::net::UnixStream,
    until: Option<Instant>,
}

impl UnixDeadline<'_> {
    fn bound(&self) -> io::Result<()> {
        if let Some(until) = self.until {
            self.stream
                .set_read_timeout(Some(time_left(until, "the deadline passed")?))?;
        }
        Ok(())
    }
}

impl Read for UnixDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.bound()?;
        (&mut &*self.stream).read(buf)
    }
}

/// A registered engine's frame of at most `max` bytes: its length waited for as long as the
/// engine likes (it may be idle), then `admit` asked for room for that length, then its body read
/// within `body_within` (an engine that sends a length and trickles the rest holds that room only
/// so long). What `admit` returned comes back with the body.
pub fn read_engine_frame<G>(
    stream: &std::os::unix::net::UnixStream,
    max: usize,
    body_within: std::time::Duration,
    admit: impl FnOnce(usize) -> Result<G, String>,
) -> Result<(Vec<u8>, G), FrameError> {
    stream.set_read_timeout(None)?;
    let (n, admitted) = read_length(&mut &*stream, max, admit)?;
    let mut timed = UnixDeadline {
        stream,
        until: Some(Instant::now() + body_within),
    };
    let mut body = vec![0u8; n];
    timed.read_exact(&mut body)?;
    stream.set_read_timeout(None)?;
    Ok((body, admitted))
}

/// [`read_frame_fds`], every read done by `until` when set (a sender that trickles bytes runs out
/// of time however it paces them).
#[allow(unsafe_code)]
pub fn read_frame_fds_by<T: DeserializeOwned>(
    stream: &std::os::unix::net::UnixStream,
    max: usize,
    until: Option<Instant>,
) -> Result<(T, Vec<std::os::fd::OwnedFd>), FrameError> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let timed = UnixDeadline { stream, until };
    timed.bound()?;
    let mut len = [0u8; 4];
    let mut iov = libc::iovec {
        iov_base: len.as_mut_ptr().cast(),
        iov_len: len.len(),
    };
    // Room for MAX_FDS descriptors: a sender that attaches more loses them (closed), not us.
    let mut control = vec![0u8; control_space(MAX_FDS)];
    let mut msg = msghdr(&mut iov, &mut control);
    // SAFETY: a valid socket and message; MSG_CMSG_CLOEXEC marks received descriptors.
    let got = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(io::Error::last_os_error().into());
    }
    let mut fds: Vec<OwnedFd> = Vec::new();
    // SAFETY: the kernel filled `msg_controllen` bytes of well-formed control messages; each
    // SCM_RIGHTS payload is an array of ints, each a descriptor now owned by this process.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let bytes = (*cmsg).cmsg_len as usize - (data as usize - cmsg as usize);
                for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                    let fd = std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(FrameError::Malformed("too many file descriptors attached".into()));
    }
    // The rest of the frame is plain data: what recvmsg read, then the stream.
    let mut rest = len[..got as usize].chain(timed);
    let message = read_frame_max(&mut rest, max)?;
    Ok((message, fds))
}

/// Bytes as lower-case hex in JSON (worker addresses, packed keys, nonces, proofs).
pub mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Serialises bytes as hex.
    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&encode(bytes))
    }

    /// Deserialises hex into bytes.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        decode(&text).ok_or_else(|| serde::de::Error::custom("invalid hex"))
    }

    /// Hex-encodes.
    pub fn encode(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Hex-decodes; `None` on odd length or a non-hex digit.
    pub fn decode(text: &str) -> Option<Vec<u8>> {
        if !text.len().is_multiple_of(2) {
            return None;
        }
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct M {
        a: u32,
        #[serde(with = "hex_bytes")]
        b: Vec<u8>,
    }

    #[test]
    fn an_engine_frames_length_waits_as_long_as_the_engine_likes_and_its_body_only_so_long() {
        use std::os::unix::net::UnixStream;
        let (ours, mut theirs) = UnixStream::pair().expect("pair");
        // Idle past the body's time, then a whole frame: read.
        let sender = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            theirs.write_all(&3u32.to_be_bytes()).expect("length");
            theirs.write_all(b"{}x").expect("body");
            // A length, then a body that never comes: the room it was given is held so long.
            theirs.write_all(&100u32.to_be_bytes()).expect("length");
            theirs.write_all(b"{").expect("a byte");
            theirs
        });
        // Seconds for a body that comes at once; a moment for the one that never does.
        let (whole, within) = (std::time::Duration::from_secs(5), std::time::Duration::from_millis(200));
        let (body, admitted) = read_engine_frame(&ours, 16, whole, Ok::<usize, String>).expect("a frame");
        assert_eq!((body.as_slice(), admitted), (&b"{}x"[..], 3));
        // On a thread: without the body's deadline the read never ends.
        let (done, stalled) = std::sync::mpsc::channel();
        let reader = ours.try_clone().expect("clone");
        std::thread::spawn(move || {
            let _ = done.send(read_engine_frame(&reader, 1000, within, Ok::<usize, String>).map(drop));
        });
        let e = stalled
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("the stalled body ended within its time")
            .expect_err("the body stalls");
        assert!(e.timed_out(), "{e}");
        // Refused from its length, before its room is asked for.
        let mut theirs = sender.join().expect("sender");
        theirs.write_all(&17u32.to_be_bytes()).expect("length");
        let e = read_engine_frame(&ours, 16, within, |_| -> Result<(), String> { panic!("asked") });
        assert!(matches!(e, Err(FrameError::BadLength(17))), "{e:?}");
    }

    #[test]
    fn a_frame_that_does_not_fit_is_not_sealed_and_leaves_no_gap() {
        let mut sealer = Sealer::new([3; 32]);
        let refused = seal_if(&mut sealer, &"too big", |len| len < 10).expect("sealable");
        assert_eq!(refused, None);
        // The next frame is still the first the peer expects.
        let frame = seal_if(&mut sealer, &"fits", |_| true)
            .expect("sealable")
            .expect("sealed");
        let mut opener = Opener::new([3; 32]);
        let got: String = read_sealed(&mut &frame[..], &mut opener, MAX_FRAME).expect("verifies");
        assert_eq!(got, "fits");
    }

    #[test]
    fn round_trip_and_errors() {
        let mut buf = Vec::new();
        write_frame(
            &mut buf,
            &M {
                a: 7,
                b: vec![0, 255, 16],
            },
        )
        .expect("write");
        assert_eq!(&buf[..4], &(buf.len() as u32 - 4).to_be_bytes());
        let m: M = read_frame(&mut buf.as_slice()).expect("read");
        assert_eq!(
            m,
            M {
                a: 7,
                b: vec![0, 255, 16]
            }
        );
        // Truncated inside the body.
        assert!(matches!(
            read_frame::<M>(&mut &buf[..buf.len() - 1]),
            Err(FrameError::Io(_))
        ));
        // Clean close between frames.
        assert!(matches!(read_frame::<M>(&mut &[][..]), Err(FrameError::Closed)));
        // Zero and oversized lengths.
        assert!(matches!(
            read_frame::<M>(&mut &[0, 0, 0, 0][..]),
            Err(FrameError::BadLength(0))
        ));
        assert!(matches!(
            read_frame::<M>(&mut &[0xff, 0xff, 0xff, 0xff][..]),
            Err(FrameError::BadLength(_))
        ));
        // Garbage body.
        let mut bad = 3u32.to_be_bytes().to_vec();
        bad.extend_from_slice(b"{x}");
        assert!(matches!(
            read_frame::<M>(&mut bad.as_slice()),
            Err(FrameError::Malformed(_))
        ));
        assert_eq!(hex_bytes::decode("0g"), None);
        assert_eq!(hex_bytes::decode("abc"), None);
        // A frame over the pre-authentication limit is refused from its length alone.
        let mut big = Vec::new();
        write_frame(&mut big, &M { a: 1, b: vec![7; 4096] }).expect("write");
        assert!(matches!(
            read_frame_max::<M>(&mut big.as_slice(), MAX_PREAUTH_FRAME),
            Err(FrameError::BadLength(n)) if n > MAX_PREAUTH_FRAME
        ));
        assert!(read_frame::<M>(&mut big.as_slice()).is_ok());
    }

    fn sealed(messages: &[M]) -> Vec<u8> {
        let mut sealer = Sealer::new([7; 32]);
        let mut buf = Vec::new();
        for m in messages {
            write_sealed(&mut buf, &mut sealer, m).expect("seal");
        }
        buf
    }

    #[test]
    fn sealed_frames_open_in_order_and_any_change_is_refused() {
        let (one, two) = (M { a: 1, b: vec![1] }, M { a: 2, b: vec![2] });
        let buf = sealed(&[one, two]);
        let mut opener = Opener::new([7; 32]);
        let mut r = buf.as_slice();
        assert_eq!(read_sealed::<M>(&mut r, &mut opener, MAX_FRAME).expect("1").a, 1);
        assert_eq!(read_sealed::<M>(&mut r, &mut opener, MAX_FRAME).expect("2").a, 2);
        // Every single-byte change in the body or tag is caught.
        let one_frame = sealed(&[M { a: 1, b: vec![1] }]);
        for i in 4..one_frame.len() {
            let mut bad = one_frame.clone();
            bad[i] ^= 0x01;
            let got = read_sealed::<M>(&mut bad.as_slice(), &mut Opener::new([7; 32]), MAX_FRAME);
            assert!(matches!(got, Err(FrameError::BadTag(0))), "byte {i}: {got:?}");
        }
        // Another key, a replay of frame 0 as frame 1, and a reordering are refused.
        assert!(read_sealed::<M>(&mut one_frame.as_slice(), &mut Opener::new([8; 32]), MAX_FRAME).is_err());
        let mut opener = Opener::new([7; 32]);
        let replay = [one_frame.clone(), one_frame.clone()].concat();
        let mut r = replay.as_slice();
        assert!(read_sealed::<M>(&mut r, &mut opener, MAX_FRAME).is_ok());
        assert!(matches!(
            read_sealed::<M>(&mut r, &mut opener, MAX_FRAME),
            Err(FrameError::BadTag(1))
        ));
        let frame_two = &buf[one_frame.len()..];
        assert!(read_sealed::<M>(&mut &frame_two[..], &mut Opener::new([7; 32]), MAX_FRAME).is_err());
    }

    #[test]
    fn a_deadline_bounds_a_whole_exchange_not_each_read() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        // A peer that sends one byte every 50 ms: each read succeeds in time, the exchange not.
        let slow = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).expect("connect");
            let trickle = [&100u32.to_be_bytes()[..], &[b' '; 36]].concat();
            for byte in trickle {
                if s.write_all(&[byte]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let (conn, _) = listener.accept().expect("accept");
        let started = Instant::now();
        let got = read_frame::<M>(&mut Deadline::new(&conn, Duration::from_millis(300)));
        assert!(got.as_ref().is_err_and(FrameError::timed_out), "{got:?}");
        assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
        drop(conn);
        let _ = slow.join();
    }
}

/// Bytes decoding one frame may hold, at most ([`read_sealed_by`]): four times the largest frame.
pub const MAX_DECODE_COST: usize = 4 * MAX_FRAME;

/// Bytes decoding holds per JSON value of a frame (an object's keys count as values), at most:
/// serde's buffer for an internally tagged enum holds each as 32 bytes (a map entry, key and
/// value, 64), in vectors grown by doubling (up to twice that). Counted at 32 with keys left
/// out, an insider's frame of 2^20 empty keys held 4 times what it was charged (from a review).
pub const VALUE_COST: usize = 64;

/// How many JSON values (numbers, strings, arrays, objects, each element and each object key
/// counted) `bytes` hold, in one pass that keeps none of them.
pub fn json_values(bytes: &[u8]) -> Result<usize, serde_json::Error> {
    use serde::de::Deserializer as _;
    let values = std::cell::Cell::new(0);
    let mut d = serde_json::Deserializer::from_slice(bytes);
    d.deserialize_any(Count(&values))?;
    d.end()?;
    Ok(values.get())
}

/// Counts a value and everything in it ([`json_values`]).
#[derive(Clone, Copy)]
pub(crate) struct Count<'a>(pub(crate) &'a std::cell::Cell<usize>);

impl Count<'_> {
    pub(crate) fn one(self) {
        self.0.set(self.0.get().saturating_add(1));
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Count<'_> {
    type Value = ();
    fn deserialize<D: serde::de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Count<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        self.one();
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        self.one();
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        self.one();
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        self.one();
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        self.one();
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        self.one();
        Ok(())
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.one();
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.one();
        while map.next_key::<serde::de::IgnoredAny>()?.is_some() {
            self.one(); // the key's place in serde's buffer
            map.next_value_seed(self)?;
        }
        Ok(())
    }
}
