//! Side-channel framing: versioned, length-prefixed JSON frames over TCP.
//!
//! A frame is a 4-byte big-endian length `n` (1 ..= [`MAX_FRAME`]) followed by `n` bytes of UTF-8
//! JSON holding one [`crate::protocol::Message`]. A zero or oversized length, a truncated frame,
//! or JSON that is not a message is a protocol error: the reader returns it and the caller closes
//! the connection. Nothing on this path panics.

use std::io::{self, Read, Write};

use serde::{Serialize, de::DeserializeOwned};

/// The largest frame accepted (completion frames carry one checksum per block).
pub const MAX_FRAME: usize = 16 << 20;

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

/// Reads one frame.
pub fn read_frame<T: DeserializeOwned>(r: &mut impl Read) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let n = u32::from_be_bytes(len) as usize;
    if n == 0 || n > MAX_FRAME {
        return Err(FrameError::BadLength(n));
    }
    let mut body = vec![0u8; n];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| FrameError::Malformed(e.to_string()))
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
    }
}
