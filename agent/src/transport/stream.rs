//! KV over plain TCP, placed by the receiver: the backend for `--transport tcp`, and for `auto`
//! where UCX finds no RDMA device.
//!
//! UCX's own tcp transport is never loaded: it takes a put or get at any address of the
//! process from anyone who reaches its port (measured with 1.13 and 1.22: an unregistered
//! address, a key from another context, a worker id changed; docs/security.md). Here the side
//! whose memory is reached (push: decode's agent; pull: prefill's) does every write and read
//! itself, into and from memory it admitted for that one side-channel link, after checking it.
//!
//! - **Admission.** After the side channel authenticated a peer, the agent whose memory the
//!   peer reaches calls [`Stream::admit`] with the session's stream key (`protocol::Session`:
//!   HKDF from the pairing secret and both nonces; never on the wire), the engine's regions and
//!   what the peer may do there (write or read). The admission lives with the link; dropping it
//!   closes its connection.
//! - **Connection.** The peer dials the address in the handshake (`pdpair-tcp:` and `ip:port`).
//!   The listener sends a 32-byte nonce; the dialler answers with the admission's id
//!   (HMAC(key, "pdpair/stream id"), 16 bytes), its lane, a nonce of its own and a proof,
//!   HMAC(key, "pdpair/stream proof" | both nonces | lane). The listener checks the proof in constant time and
//!   answers with its own (HMAC(key, "pdpair/stream accept" | both nonces)), which the dialler
//!   checks before it sends anything more. A stranger and a replayed proof are refused before
//!   a byte of memory is touched; so is a listener that cannot prove the key.
//! - **Lanes.** The dialler's answer names a lane (0..[`MAX_LANES`], covered by its proof): an
//!   admission holds one connection per lane, and a newer proven one replaces its lane's (only
//!   the link's peer holds the key, and a connection whose other end vanished without a word
//!   would otherwise hold the lane forever). A put or get of at least [`MIN_LANE_BYTES`] a lane
//!   is split into contiguous parts, one per lane, each on its own connection and thread, so
//!   sealing, opening and copying use as many cores as there are lanes (the stream's lanes,
//!   `--stream-lanes`); each lane's flush covers its own writes, and the op is done when every
//!   lane's is; once one lane fails the others stop, and the op's failure is the first one's.
//!   Lanes past 0 are dialled when first used; a share whose lane cannot be dialled (the peer's
//!   cap on connections waiting for their proof, when many links dial at once) goes over lane 0.
//!   The dialler dials a lane again, within the op's deadline, when an op finds its connection
//!   gone (an earlier op timed out, the peer closed it).
//! - **Ops.** 24-byte headers (op, 7 zero bytes, address, length, big-endian): `PUT` and its
//!   bytes, `GET` (answered with its bytes), `FLUSH` (answered once every earlier put is in
//!   memory). Every range must lie inside one admitted region and match the admitted access;
//!   anything else is answered with an error and the connection closes. Each op must also lie in
//!   an open [`Windows`] range: the blocks of a request the link was asked for (push) or lent
//!   (pull) and that has not ended for the engine or the link. Outside them a write's bytes are
//!   dropped and the next flush says so; a read is answered with a refusal and no bytes. Every
//!   piece of an op is checked again as it is copied, under the windows' lock, so a window
//!   closed while the op runs takes (or gives) nothing more of it (lanes copy side by side; a
//!   close waits for the copies under way).
//!
//! - **Records.** After the proof every byte either way is sealed (AES-256-GCM; per-connection,
//!   per-direction keys from the stream key and the greeting's nonce; nonces a counter; see
//!   [`seal`]): someone on the path between two agents reads no KV, and a byte changed,
//!   dropped, replayed or reordered fails its record, which closes the connection before its
//!   bytes land (each record is opened in a buffer, then copied into place; into host memory
//!   with streaming stores, `memory::stream_copy`: the engine reads those bytes; the agent at
//!   most once more, for the request's checksums, after the whole request landed).
//! - **Staging.** A region may be memory this process cannot dereference (a GPU pool between
//!   agents, `transport::cuda_ipc`): it is registered with a [`DeviceCopy`], and every piece
//!   of an op on it is copied between the device and the record buffer through that (the
//!   buffer is the staging buffer, 256 KiB a piece, so device copies and the network overlap
//!   piece by piece); the windows and range checks are the same. A piece written into such a
//!   region under the windows' lock has landed before the lock goes ([`DeviceCopy::settle`], so
//!   nothing lands after a close), and a get's writes have landed before it returns.
#![allow(unsafe_code)]

use std::{
    collections::HashMap,
    io::{self, Read, Write},
    net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use self::seal::{Conn, Side};
use crate::{
    lock,
    transport::{Observed, OpError, PutOp},
};

/// What a stream address starts with (then `ip:port`).
pub const ADDRESS_PREFIX: &str = "pdpair-tcp:";
/// The first bytes each side sends.
const MAGIC: &[u8; 16] = b"PDPAIR-STREAM/3\n";
/// The dialler's answer to the greeting: magic, admission id, lane, its nonce, its proof.
const ANSWER_LEN: usize = 16 + 16 + 1 + 32 + 32;
/// Connections one admission holds at most, one per lane.
pub const MAX_LANES: usize = 8;
/// Lanes a stream dials by default.
pub const DEFAULT_LANES: usize = 4;
/// The least an op moves per lane: smaller ops use fewer lanes (one below twice this).
pub const MIN_LANE_BYTES: u64 = 4 << 20;
/// Unproven connections from one source address, at most (more from it are closed unread)...
pub const MAX_UNPROVEN_FROM: usize = 8;
/// ...and connections that have not proved an admission yet, at most (when all are taken, one
/// from a source holding fewer takes the place of the oldest of the source holding the most,
/// [`crate::unproven`])...
pub const MAX_UNPROVEN: usize = 64;
/// ...each for at most this long.
pub const PROOF_WITHIN: Duration = Duration::from_secs(5);
/// How long an answer may wait for a peer that does not read it.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);
/// Longest error text on the wire.
const MAX_ERROR: usize = 300;
/// A get's window: requests sent before their answers are read.
const GET_WINDOW_BYTES: u64 = 8 << 20;
const GET_WINDOW_OPS: usize = 512;

const OP_PUT: u8 = 1;
const OP_GET: u8 = 2;
const OP_FLUSH: u8 = 3;
const OK: u8 = 0;
/// Refused, and the connection closes.
const REFUSED: u8 = 1;
/// Refused, and the connection stays (a write dropped outside the windows, a read refused
/// there): the answer's framing is intact.
const DECLINED: u8 = 2;

/// What an admitted peer may do in the regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Write (push: prefill into decode's blocks).
    Write,
    /// Read (pull: decode from prefill's blocks).
    Read,
}

/// Copies between memory the stream cannot dereference (a GPU's) and its host buffers.
pub trait DeviceCopy: Send + Sync {
    /// Copies `into.len()` bytes from device address `at` into `into`, there on return.
    fn read(&self, at: u64, into: &mut [u8]) -> Result<(), String>;
    /// Copies `from` to device address `at` (it may land later: [`DeviceCopy::settle`]).
    fn write(&self, at: u64, from: &[u8]) -> Result<(), String>;
    /// Returns once every earlier write has landed where the engine reads it.
    fn settle(&self) -> Result<(), String>;
}

/// Memory the stream may move: a registered region, what keeps it mapped, and how its bytes
/// are reached (`None`: host memory of this process, copied directly).
#[derive(Clone)]
struct Region {
    base: u64,
    len: u64,
    _keep: Arc<dyn Send + Sync>,
    device: Option<Arc<dyn DeviceCopy>>,
}

impl Region {
    /// Copies from `at` (checked by the caller to lie in this region) into `into`.
    fn read(&self, at: u64, into: &mut [u8]) -> Result<(), String> {
        match &self.device {
            Some(d) => d.read(at, into),
            None => {
                // SAFETY: the caller checked the range lies inside this region, which `_keep`
                // keeps mapped; a raw copy, as the engine may touch the memory at any time.
                unsafe { std::ptr::copy_nonoverlapping(at as *const u8, into.as_mut_ptr(), into.len()) };
                Ok(())
            }
        }
    }

    /// Copies `from` to `at` (checked by the caller to lie in this region).
    fn write(&self, at: u64, from: &[u8]) -> Result<(), String> {
        match &self.device {
            Some(d) => d.write(at, from),
            None => {
                // SAFETY: as in `read`. The engine reads these bytes (this process at most for
                // the request's checksums, once all of it landed): they bypass the cache, where
                // the record buffers stay.
                unsafe { crate::memory::stream_copy::copy_streaming(at as *mut u8, from) };
                Ok(())
            }
        }
    }
}

/// Waits for the writes into the devices of `regions` to land, each device once (host writes
/// are done when they return).
fn settle(regions: &[Region]) -> Result<(), String> {
    let mut settled: Vec<*const ()> = Vec::new();
    for device in regions.iter().filter_map(|r| r.device.as_ref()) {
        let at = Arc::as_ptr(device).cast::<()>();
        if !settled.contains(&at) {
            settled.push(at);
            device.settle()?;
        }
    }
    Ok(())
}

/// A checked op list's peer, its local regions (held while it runs) and each op's region index.
type Prepared = (Arc<PeerConn>, Vec<Region>, Vec<usize>);

/// The region of `regions` that holds `at..at+len`.
fn region_of(regions: &[Region], at: u64, len: u64) -> Option<&Region> {
    regions.iter().find(|r| inside(at, len, r.base, r.len))
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}+{}", self.base, self.len)
    }
}

#[derive(Debug)]
struct Admitted {
    key: [u8; 32],
    regions: Vec<Region>,
    access: Access,
    /// Where the peer may write or read now.
    windows: Arc<Windows>,
    /// The connection that proved it last on each lane (its serial number), to close with the
    /// admission or when a newer one proves it on that lane.
    conns: HashMap<u8, (u64, TcpStream)>,
}

/// The byte ranges an admission's peer may reach at the moment: the blocks of the requests the
/// link was asked for (push: from just before the registration is sent) or lent (pull: from
/// just before the `Ready` is sent), until the request ends for the engine or the link (the
/// blocks may then go to another request). A write inside the admitted regions but outside
/// every window is dropped (its bytes read and discarded) and reported at the next flush; a
/// read there is refused without a byte; the connection stays.
#[derive(Debug, Default)]
pub struct Windows {
    /// Copies hold it shared (lanes copy side by side), opening and closing exclusively.
    open: std::sync::RwLock<HashMap<String, Window>>,
}

/// One request's window: byte ranges, or blocks of a pool's arrays (as many bytes as the
/// request's block ids, however many layers: a request of many blocks over many layers as
/// ranges took a range per block, layer and half, gigabytes for an engine's chosen geometry).
#[derive(Debug)]
enum Window {
    Ranges(Vec<(u64, u64)>),
    Blocks {
        arrays: std::sync::Arc<Arrays>,
        blocks: Vec<u32>,
    },
}

/// Where a pool's blocks are: arrays of `num_blocks` periods of `stride` bytes from `base`,
/// each period holding the block's pieces (`(offset, bytes)` in the period: K, V or both), in
/// order of `base`, none overlapping another. One per layer and K/V (K and V of a layer in one
/// when they alternate block by block).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrays(Vec<Array>);

/// See [`Arrays`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Array {
    base: u64,
    stride: u64,
    num_blocks: u32,
    pieces: Vec<(u64, u64)>,
}

impl Arrays {
    /// From pieces `(address of block 0's piece, address of block 1's piece, bytes)`, one per
    /// layer and K/V, of a pool of `num_blocks` blocks; `None` where they do not make arrays
    /// that stay apart (a block's piece past its period, arrays that overlap): open such a
    /// window as ranges.
    pub fn of(pieces: &[(u64, u64, u64)], num_blocks: u32) -> Option<Arrays> {
        let mut arrays: Vec<Array> = Vec::new();
        for &(first, second, len) in pieces {
            let stride = second.checked_sub(first)?;
            if len == 0 || len > stride || num_blocks < 2 {
                return None;
            }
            // The other half of the same layer when they alternate in one period.
            if let Some(a) = arrays
                .iter_mut()
                .find(|a| a.stride == stride && first.abs_diff(a.base) < stride)
            {
                let start = a.base.min(first);
                let shift = a.base - start;
                a.pieces.iter_mut().for_each(|p| p.0 += shift);
                a.pieces.push((first - start, len));
                a.base = start;
                a.pieces.sort_unstable();
                let ends_in_period = a.pieces.iter().all(|p| p.0 + p.1 <= stride);
                let apart = a.pieces.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0);
                if !ends_in_period || !apart {
                    return None;
                }
            } else {
                arrays.push(Array {
                    base: first,
                    stride,
                    num_blocks,
                    pieces: vec![(0, len)],
                });
            }
        }
        arrays.sort_unstable_by_key(|a| a.base);
        let end = |a: &Array| {
            a.stride
                .checked_mul(u64::from(a.num_blocks))
                .and_then(|n| a.base.checked_add(n))
        };
        for w in arrays.windows(2) {
            if end(&w[0])? > w[1].base {
                return None;
            }
        }
        if let Some(last) = arrays.last() {
            end(last)?;
        }
        Some(Arrays(arrays))
    }

    /// Whether `at..at+len` lies wholly in pieces of `blocks` (sorted).
    fn covers(&self, blocks: &[u32], at: u64, len: u64) -> bool {
        let Some(end) = at.checked_add(len) else { return false };
        let mut cur = at;
        while cur < end {
            let i = self.0.partition_point(|a| a.base <= cur);
            let Some(a) = i.checked_sub(1).map(|i| &self.0[i]) else {
                return false;
            };
            let off = cur - a.base;
            let block = off / a.stride;
            let within = off % a.stride;
            if block >= u64::from(a.num_blocks) || blocks.binary_search(&(block as u32)).is_err() {
                return false;
            }
            // Pieces that touch within a period count as one.
            let Some(mut piece_end) = a
                .pieces
                .iter()
                .find(|p| p.0 <= within && within < p.0 + p.1)
                .map(|p| p.0 + p.1)
            else {
                return false;
            };
            while let Some(next) = a.pieces.iter().find(|p| p.0 == piece_end) {
                piece_end = next.0 + next.1;
            }
            let next = a.base + block * a.stride + piece_end;
            if next <= cur {
                return false;
            }
            cur = next;
        }
        true
    }
}

impl Windows {
    /// Opens `request`'s window over `blocks` of `arrays`, replacing one it had: it holds the
    /// block ids, nothing per layer.
    pub fn allow_blocks(&self, request: &str, arrays: std::sync::Arc<Arrays>, mut blocks: Vec<u32>) {
        blocks.sort_unstable();
        blocks.dedup();
        blocks.shrink_to_fit();
        write_lock(&self.open).insert(request.to_owned(), Window::Blocks { arrays, blocks });
    }

    /// Opens `request`'s window over `ranges` (address, bytes; merged here), replacing one it
    /// had.
    pub fn allow(&self, request: &str, mut ranges: Vec<(u64, u64)>) {
        ranges.retain(|r| r.1 > 0);
        ranges.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
        for (at, len) in ranges {
            match merged.last_mut() {
                Some(last) if last.0.checked_add(last.1).is_some_and(|end| end >= at) => {
                    let end = at.saturating_add(len).max(last.0 + last.1);
                    last.1 = end - last.0;
                }
                _ => merged.push((at, len)),
            }
        }
        merged.shrink_to_fit();
        write_lock(&self.open).insert(request.to_owned(), Window::Ranges(merged));
    }

    /// Closes `request`'s window (nothing more of it is written).
    pub fn close(&self, request: &str) {
        write_lock(&self.open).remove(request);
    }

    /// Whether `at..at+len` lies inside one open window's range.
    fn contains(&self, at: u64, len: u64) -> bool {
        Self::holds(&read_lock(&self.open), at, len)
    }

    /// Copies `plain` to `at` in `region` (the caller checked the range lies in it) if the
    /// range lies inside one open window, under the windows' lock: once [`Windows::close`]
    /// returned, nothing more lands in what it closed. A copy into device memory has landed
    /// before the lock goes (a copy from pageable memory may land after it returns).
    /// `Ok(false)`: outside every window.
    fn copy_into(&self, region: &Region, at: u64, plain: &[u8]) -> Result<bool, String> {
        let open = read_lock(&self.open);
        if !Self::holds(&open, at, plain.len() as u64) {
            return Ok(false);
        }
        region.write(at, plain)?;
        if let Some(device) = &region.device {
            device.settle()?;
        }
        Ok(true)
    }

    /// Copies from `at` in `region` into `into` if the range lies inside one open window, under
    /// the windows' lock (see [`Windows::copy_into`]).
    fn copy_from(&self, region: &Region, at: u64, into: &mut [u8]) -> Result<bool, String> {
        let open = read_lock(&self.open);
        if !Self::holds(&open, at, into.len() as u64) {
            return Ok(false);
        }
        region.read(at, into).map(|()| true)
    }

    fn holds(open: &HashMap<String, Window>, at: u64, len: u64) -> bool {
        open.values().any(|window| match window {
            Window::Ranges(ranges) => {
                // The last range starting at or before `at`.
                let i = ranges.partition_point(|r| r.0 <= at);
                i > 0 && inside(at, len, ranges[i - 1].0, ranges[i - 1].1)
            }
            Window::Blocks { arrays, blocks } => arrays.covers(blocks, at, len),
        })
    }

    /// The requests with an open window.
    pub fn requests(&self) -> Vec<String> {
        read_lock(&self.open).keys().cloned().collect()
    }
}

/// A read lock, poisoned or not (a copy that panicked left the windows as they were).
fn read_lock<T>(l: &std::sync::RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

/// A write lock, poisoned or not.
fn write_lock<T>(l: &std::sync::RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

/// One lane of a peer's stream.
#[derive(Debug, Default)]
struct Lane {
    /// Its connection, dialled when first used; `None` once an op closed it: the next op on
    /// the lane dials again.
    conn: Mutex<Option<Conn>>,
    /// A handle on its socket, outside `conn`'s lock: a disconnect shuts down the socket an op
    /// is still using (a dead peer's op ends then, not at its deadline).
    sock: Mutex<Option<TcpStream>>,
}

#[derive(Debug)]
struct PeerConn {
    lanes: Vec<Lane>,
    /// Set by a disconnect: no lane is dialled again.
    gone: std::sync::atomic::AtomicBool,
    at: SocketAddr,
    key: [u8; 32],
    remotes: Vec<(u64, u64)>,
    lane: String,
}

#[derive(Debug, Default)]
struct Inner {
    regions: Mutex<HashMap<u64, Region>>,
    admitted: Mutex<HashMap<[u8; 16], Admitted>>,
    peers: Mutex<HashMap<u64, Arc<PeerConn>>>,
    next_peer: AtomicU64,
    next_conn: AtomicU64,
}

/// The stream backend: a listener and the connections this agent dialled.
#[derive(Debug, Clone)]
pub struct Stream {
    inner: Arc<Inner>,
    address: Vec<u8>,
    local: SocketAddr,
    /// Lanes each peer's ops are split over (1..=[`MAX_LANES`]).
    lanes: usize,
}

/// An admission (see the module docs): revoked, and its connection closed, when dropped.
#[derive(Debug)]
pub struct Admission {
    inner: Weak<Inner>,
    id: [u8; 16],
    /// Where its peer may write (push) or read (pull) now.
    pub windows: Arc<Windows>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade()
            && let Some(a) = lock(&inner.admitted).remove(&self.id)
        {
            for (_, c) in a.conns.values() {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
    }
}

type HmacSha256 = Hmac<Sha256>;

/// HMAC-SHA256 over `parts`, each length-prefixed.
fn mac(key: &[u8; 32], parts: &[&[u8]]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    for p in parts {
        m.update(&(p.len() as u64).to_be_bytes());
        m.update(p);
    }
    m
}

fn hmac(key: &[u8; 32], parts: &[&[u8]]) -> [u8; 32] {
    mac(key, parts).finalize().into_bytes().into()
}

/// The id an admission of `key` is found by.
fn admission_id(key: &[u8; 32]) -> [u8; 16] {
    let mut id = [0u8; 16];
    id.copy_from_slice(&hmac(key, &[b"pdpair/stream id"])[..16]);
    id
}

/// The dialler's proof of the key, over both sides' nonces.
fn proof_mac(key: &[u8; 32], theirs: &[u8], ours: &[u8], lane: u8) -> HmacSha256 {
    mac(key, &[b"pdpair/stream proof", theirs, ours, &[lane]])
}

fn proof(key: &[u8; 32], theirs: &[u8], ours: &[u8], lane: u8) -> [u8; 32] {
    proof_mac(key, theirs, ours, lane).finalize().into_bytes().into()
}

/// The listener's proof of the key (its acceptance), over both nonces.
fn accept_mac(key: &[u8; 32], theirs: &[u8], ours: &[u8]) -> HmacSha256 {
    mac(key, &[b"pdpair/stream accept", theirs, ours])
}

/// Whether `at..at+len` lies inside `base..base+len` (no wrap on either).
fn inside(at: u64, len: u64, base: u64, region: u64) -> bool {
    match (at.checked_add(len), base.checked_add(region)) {
        (Some(end), Some(region_end)) => at >= base && end <= region_end,
        _ => false,
    }
}

/// Parses a stream address: the prefix, then a socket address.
pub fn parse_address(address: &[u8]) -> Result<SocketAddr, String> {
    let text = std::str::from_utf8(address).map_err(|_| "the stream address is not UTF-8".to_owned())?;
    let rest = text
        .strip_prefix(ADDRESS_PREFIX)
        .ok_or_else(|| format!("the stream address does not start with {ADDRESS_PREFIX:?}"))?;
    rest.parse().map_err(|_| {
        format!(
            "the stream address {:?} names no ip:port",
            crate::reason::peer_text(rest)
        )
    })
}

/// Whether `address` is meant as a stream address (its prefix).
pub fn is_stream_address(address: &[u8]) -> bool {
    address.starts_with(ADDRESS_PREFIX.as_bytes())
}

fn status_frame(status: u8, msg: &str) -> (Vec<u8>, &[u8]) {
    let mut text = msg.as_bytes();
    if text.len() > MAX_ERROR {
        text = &text[..MAX_ERROR];
    }
    let mut head = vec![status];
    head.extend_from_slice(&(text.len() as u16).to_be_bytes());
    (head, text)
}

/// Refuses a connection before its proof (in the clear: there are no keys yet), then closes.
fn refuse_plain(c: &mut TcpStream, msg: &str) {
    let (mut frame, text) = status_frame(REFUSED, msg);
    frame.extend_from_slice(text);
    let _ = c.write_all(&frame);
}

/// Refuses, then closes the connection.
fn send_error(c: &mut Conn, msg: &str) {
    let _ = send_refusal(c, REFUSED, msg);
}

/// Refuses one op and keeps the connection (when the refusal went out whole).
fn send_declined(c: &mut Conn, msg: &str) -> Result<(), String> {
    send_refusal(c, DECLINED, msg).map_err(|e| e.to_string())
}

/// A status record (status, text length), then the text's record when there is text.
fn send_refusal(c: &mut Conn, status: u8, msg: &str) -> io::Result<()> {
    let (head, text) = status_frame(status, msg);
    c.send_op(&head, text.len() as u64, |at, into| {
        into.copy_from_slice(&text[at as usize..at as usize + into.len()]);
        Ok(())
    })
}

/// What the peer refused, and whether it keeps the connection.
#[derive(Debug)]
struct Refusal {
    why: String,
    kept: bool,
}

/// Reads a status record (and its text); the refusal when it is one.
fn read_status(c: &mut Conn) -> io::Result<Result<(), Refusal>> {
    let head = c.recv(3)?;
    let (status, n) = (head[0], usize::from(u16::from_be_bytes([head[1], head[2]])));
    match status {
        OK if n == 0 => Ok(Ok(())),
        REFUSED | DECLINED if n <= MAX_ERROR => {
            let text = if n > 0 { c.recv(n)?.to_vec() } else { Vec::new() };
            Ok(Err(Refusal {
                why: crate::reason::peer_text(&String::from_utf8_lossy(&text)),
                kept: status == DECLINED,
            }))
        }
        _ => Ok(Err(Refusal {
            why: format!("the peer answered with status {status} and length {n}"),
            kept: false,
        })),
    }
}

/// Reads the proof's answer (in the clear); the refusal's text when it is one.
fn read_plain_status(c: &mut TcpStream, deadline: Instant) -> io::Result<Result<(), String>> {
    let mut head = [0u8; 3];
    seal::read_full(c, &mut head[..1], Some(deadline))?;
    match head[0] {
        OK => Ok(Ok(())),
        REFUSED => {
            seal::read_full(c, &mut head[1..], Some(deadline))?;
            let n = usize::from(u16::from_be_bytes([head[1], head[2]])).min(MAX_ERROR);
            let mut text = vec![0u8; n];
            seal::read_full(c, &mut text, Some(deadline))?;
            Ok(Err(crate::reason::peer_text(&String::from_utf8_lossy(&text))))
        }
        other => Ok(Err(format!("the peer answered with status {other}"))),
    }
}

fn header(op: u8, addr: u64, len: u64) -> [u8; 24] {
    let mut h = [0u8; 24];
    h[0] = op;
    h[8..16].copy_from_slice(&addr.to_be_bytes());
    h[16..24].copy_from_slice(&len.to_be_bytes());
    h
}

/// What a dial says when the listener closed the connection before greeting it or answering
/// its proof: the listener turns away a source's connections past its places for unproven ones
/// ([`MAX_UNPROVEN_FROM`]), and closes the oldest of the source holding the most when all are
/// taken, which many links between two agents dialling at once can fill.
const TURNED_AWAY: &str = "turned this connection away";

/// Dials the stream at `at` and proves `key`'s admission there on `lane`, by `deadline`.
fn dial(at: SocketAddr, key: &[u8; 32], lane: u8, deadline: Instant) -> Result<Conn, String> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(format!("no time was left to dial the KV stream at {at}"));
    }
    let mut c = TcpStream::connect_timeout(&at, left).map_err(|e| format!("dialling the KV stream at {at}: {e}"))?;
    let _ = c.set_nodelay(true);
    let mut hello = [0u8; 48];
    seal::read_full(&mut c, &mut hello, Some(deadline)).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => {
            format!("the KV stream at {at} {TURNED_AWAY} before its greeting: {e}")
        }
        _ => format!("the KV stream at {at} sent no greeting: {e}"),
    })?;
    if &hello[..16] != MAGIC {
        return Err(format!("the KV stream at {at} is not a pdpair stream"));
    }
    let mut ours = [0u8; 32];
    getrandom::fill(&mut ours).map_err(|e| format!("a nonce for the KV stream: {e}"))?;
    let mut answer = Vec::with_capacity(ANSWER_LEN);
    answer.extend_from_slice(MAGIC);
    answer.extend_from_slice(&admission_id(key));
    answer.push(lane);
    answer.extend_from_slice(&ours);
    answer.extend_from_slice(&proof(key, &hello[16..], &ours, lane));
    seal::write_full(&mut c, &[&answer], Some(deadline)).map_err(|e| format!("the KV stream at {at}: {e}"))?;
    match read_plain_status(&mut c, deadline) {
        Ok(Ok(())) => {}
        Ok(Err(why)) => return Err(format!("the KV stream at {at} refused this agent: {why}")),
        // Closed while its proof was looked at: the listener made room for another source's
        // connection (its unproven places all taken), as when turned away before its greeting.
        Err(e) if matches!(e.kind(), io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset) => {
            return Err(format!(
                "the KV stream at {at} {TURNED_AWAY} before answering its proof: {e}"
            ));
        }
        Err(e) => return Err(format!("the KV stream at {at} closed: {e}")),
    }
    // The listener proves the key too: someone on the path who answers in its place (with a
    // nonce of an earlier connection, say) gets no further.
    let mut accepted = [0u8; 32];
    seal::read_full(&mut c, &mut accepted, Some(deadline))
        .map_err(|e| format!("the KV stream at {at} did not prove the key: {e}"))?;
    if accept_mac(key, &hello[16..], &ours).verify_slice(&accepted).is_err() {
        return Err(format!("the KV stream at {at} did not prove the key (not our peer)"));
    }
    let salt = [&hello[16..], &ours[..]].concat();
    Ok(Conn::new(c, key, &salt, Side::Dialler))
}

impl Stream {
    /// Listens on `host` (an ephemeral port); ops to peers go over [`DEFAULT_LANES`] lanes.
    pub fn start(host: IpAddr) -> Result<Stream, String> {
        Stream::with_lanes(host, DEFAULT_LANES)
    }

    /// Listens on `host` (an ephemeral port); ops to peers go over `lanes` lanes
    /// (1..=[`MAX_LANES`]).
    pub fn with_lanes(host: IpAddr, lanes: usize) -> Result<Stream, String> {
        if !(1..=MAX_LANES).contains(&lanes) {
            return Err(format!("the KV stream takes 1..={MAX_LANES} lanes, not {lanes}"));
        }
        let listener = TcpListener::bind((host, 0)).map_err(|e| format!("binding the KV stream on {host}: {e}"))?;
        let local = listener
            .local_addr()
            .map_err(|e| format!("the KV stream's address: {e}"))?;
        let inner = Arc::new(Inner::default());
        let weak = Arc::downgrade(&inner);
        // Connections that have not proved an admission yet.
        let unproven = crate::unproven::Budget::new(MAX_UNPROVEN, MAX_UNPROVEN_FROM);
        thread::Builder::new()
            .name("kv-stream".into())
            .spawn(move || accept_loop(listener, weak, &unproven))
            .map_err(|e| format!("starting the KV stream's thread: {e}"))?;
        Ok(Stream {
            inner,
            address: format!("{ADDRESS_PREFIX}{local}").into_bytes(),
            local,
            lanes,
        })
    }

    /// The address peers dial (`pdpair-tcp:ip:port`).
    pub fn address(&self) -> Vec<u8> {
        self.address.clone()
    }

    /// Makes a registered region (id `id`, `base..base+len`, mapped while `keep` lives) movable.
    pub fn register(&self, id: u64, base: u64, len: u64, keep: Arc<dyn Send + Sync>) {
        self.insert(id, base, len, keep, None);
    }

    fn insert(&self, id: u64, base: u64, len: u64, keep: Arc<dyn Send + Sync>, device: Option<Arc<dyn DeviceCopy>>) {
        lock(&self.inner.regions).insert(
            id,
            Region {
                base,
                len,
                _keep: keep,
                device,
            },
        );
    }

    /// Makes a region of device memory movable (`base..base+len` in `device`'s addresses, valid
    /// while `keep` lives): every byte is copied through `device`, never dereferenced here.
    pub fn register_device(
        &self,
        id: u64,
        base: u64,
        len: u64,
        keep: Arc<dyn Send + Sync>,
        device: Arc<dyn DeviceCopy>,
    ) {
        self.insert(id, base, len, keep, Some(device));
    }

    /// Forgets a region: new ops on it fail (a connection already holding it keeps the mapping
    /// alive until it ends).
    pub fn forget(&self, id: u64) {
        lock(&self.inner.regions).remove(&id);
    }

    fn resolve(&self, ids: &[u64]) -> Result<Vec<Region>, String> {
        let regions = lock(&self.inner.regions);
        ids.iter()
            .map(|id| regions.get(id).cloned().ok_or_else(|| format!("unknown region {id}")))
            .collect()
    }

    /// Lets the one peer that holds `key` reach `regions` with `access` (see the module docs).
    pub fn admit(&self, key: &[u8; 32], regions: &[u64], access: Access) -> Result<Admission, String> {
        let regions = self.resolve(regions)?;
        let id = admission_id(key);
        let mut admitted = lock(&self.inner.admitted);
        if admitted.contains_key(&id) {
            return Err("this stream key is already admitted".into());
        }
        let windows = Arc::new(Windows::default());
        admitted.insert(
            id,
            Admitted {
                key: *key,
                regions,
                access,
                windows: windows.clone(),
                conns: HashMap::new(),
            },
        );
        Ok(Admission {
            inner: Arc::downgrade(&self.inner),
            id,
            windows,
        })
    }

    /// Dials the peer at `address` and proves `key`'s admission there; `remotes` are the peer's
    /// regions (address, bytes) every op's remote side must lie in.
    pub fn connect(&self, address: &[u8], remotes: Vec<(u64, u64)>, key: &[u8; 32]) -> Result<u64, String> {
        self.connect_by(address, remotes, key, Instant::now() + PROOF_WITHIN)
    }

    /// [`Stream::connect`], done or failed by `by` (and within [`PROOF_WITHIN`], which the
    /// peer's listener allows a dialler to prove itself).
    pub fn connect_by(
        &self,
        address: &[u8],
        remotes: Vec<(u64, u64)>,
        key: &[u8; 32],
        by: Instant,
    ) -> Result<u64, String> {
        let peer = PeerConn {
            lanes: (0..self.lanes).map(|_| Lane::default()).collect(),
            gone: std::sync::atomic::AtomicBool::new(false),
            at: parse_address(address)?,
            key: *key,
            remotes,
            lane: format!("tcp-stream/{}", self.local.ip()),
        };
        // Lane 0 now (the peer is checked at connect); the others when an op first uses them.
        // The listener may turn it away while its places for unproven connections from this
        // address are taken (other links dialling at once): dialled again, a little later each
        // time, until `by` (the others fall back to lane 0; lane 0 has nothing to fall back to).
        let mut wait = Duration::from_millis(20);
        let c = loop {
            match peer.dial_lane(0, by) {
                Err(e) if e.contains(TURNED_AWAY) && Instant::now() + 2 * wait < by => {
                    let mut jitter = [0u8; 2];
                    let _ = getrandom::fill(&mut jitter);
                    let spread = u64::from(u16::from_le_bytes(jitter)) % (wait.as_millis() as u64 + 1);
                    std::thread::sleep(wait + Duration::from_millis(spread));
                    wait = (wait * 2).min(Duration::from_millis(500));
                }
                dialled => break dialled?,
            }
        };
        *lock(&peer.lanes[0].conn) = Some(c);
        let id = self.inner.next_peer.fetch_add(1, Ordering::Relaxed) + 1;
        lock(&self.inner.peers).insert(id, Arc::new(peer));
        Ok(id)
    }

    /// Drops a peer's connection.
    pub fn disconnect(&self, peer: u64) {
        // Out of the map first: an op still running on a lane holds that lane's lock, and
        // every other peer's ops need the map meanwhile.
        let removed = lock(&self.inner.peers).remove(&peer);
        if let Some(p) = removed {
            // No lane is dialled again; then the sockets ops may still be using are shut
            // down (their locks are held until they end).
            p.gone.store(true, Ordering::SeqCst);
            for lane in &p.lanes {
                if let Some(s) = lock(&lane.sock).take() {
                    let _ = s.shutdown(Shutdown::Both);
                }
            }
            for lane in &p.lanes {
                if let Some(c) = lock(&lane.conn).take() {
                    let _ = c.sock.shutdown(Shutdown::Both);
                }
            }
        }
    }

    /// Checks `ops` (local ranges in `regions`, remote ones in the peer's) and returns the peer,
    /// the regions (held while the op runs) and, for each op, the index of its local region.
    fn prepare(&self, peer: u64, regions: &[u64], ops: &[PutOp]) -> Result<Prepared, OpError> {
        let p = lock(&self.inner.peers)
            .get(&peer)
            .cloned()
            .ok_or_else(|| OpError::Failed(format!("unknown stream peer {peer}")))?;
        let local = self.resolve(regions).map_err(OpError::Failed)?;
        let mut within = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            if op.len == 0 {
                return Err(OpError::Failed(format!("op {i} moves no bytes")));
            }
            let Some(r) = local.iter().position(|r| inside(op.local, op.len, r.base, r.len)) else {
                return Err(OpError::Failed(format!(
                    "op {i}: local {:#x}+{} is outside the registered regions",
                    op.local, op.len
                )));
            };
            within.push(r);
            if !p.remotes.iter().any(|(b, l)| inside(op.remote, op.len, *b, *l)) {
                return Err(OpError::Failed(format!(
                    "op {i}: remote {:#x}+{} is outside the peer's regions",
                    op.remote, op.len
                )));
            }
        }
        Ok((p, local, within))
    }

    /// Writes `ops` into the peer's memory and waits until the peer has them in memory (each
    /// lane's part on its own connection: see [`split`]).
    pub fn put(
        &self,
        peer: u64,
        regions: &[u64],
        ops: &[PutOp],
        corrupt: bool,
        within: Duration,
    ) -> Result<u64, OpError> {
        let (p, held, at_region) = self.prepare(peer, regions, ops)?;
        let deadline = Instant::now() + within;
        across_lanes(&p, &split(ops, p.lanes.len()), deadline, |lane, parts, stop| {
            on_connection(&p, lane, true, deadline, |c| {
                let mut bytes = 0u64;
                for (i, from, op) in parts {
                    let source = &held[at_region[*i]];
                    c.send_op(&header(OP_PUT, op.remote, op.len), op.len, |at, into| {
                        if stop.load(Ordering::Relaxed) {
                            // Mid-write: this connection goes (the op has failed anyway).
                            return Err(io::Error::other(ANOTHER_LANE));
                        }
                        // `prepare` checked the range lies in the region, which `held` keeps mapped.
                        source.read(op.local + at, into).map_err(io::Error::other)?;
                        if corrupt && *i == 0 && from + at == 0 {
                            // Changed before it is sealed: it lands so (the checksums' test).
                            into[into.len() / 2] ^= 0xff;
                        }
                        Ok(())
                    })
                    .map_err(failure)?;
                    bytes += op.len;
                }
                c.send_op(&header(OP_FLUSH, 0, 0), 0, |_, _| Ok(())).map_err(failure)?;
                match read_status(c).map_err(failure)? {
                    Ok(()) => Ok(bytes),
                    // The peer dropped a write and kept the connection: framing is intact.
                    Err(r) if r.kept => Err(Kept(OpError::Failed(format!("the peer refused a write: {}", r.why)))),
                    // It refused and closes.
                    Err(r) => Err(OpError::Failed(format!("the peer refused a write: {}", r.why)).into()),
                }
            })
        })
    }

    /// Reads `ops` (`remote` the source, `local` the destination) from the peer's memory (each
    /// lane's part on its own connection: see [`split`]).
    pub fn get(&self, peer: u64, regions: &[u64], ops: &[PutOp], within: Duration) -> Result<u64, OpError> {
        let (p, held, at_region) = self.prepare(peer, regions, ops)?;
        let deadline = Instant::now() + within;
        across_lanes(&p, &split(ops, p.lanes.len()), deadline, |lane, parts, stop| {
            on_connection(&p, lane, false, deadline, |c| {
                let mut wrote_device = false;
                let read = Self::read_gets(c, parts, stop, &held, &at_region, &mut wrote_device);
                // On every exit, failed or not: a write into device memory may still be on its
                // way, and the caller may hand the blocks back as soon as this returns.
                let settled = if wrote_device { settle(&held) } else { Ok(()) };
                let bytes = read?;
                settled.map_err(|e| Kept(OpError::Failed(format!("device writes did not land: {e}"))))?;
                Ok(bytes)
            })
        })
    }

    /// One lane's part of [`Stream::get`] on its connection: the reads' answers placed into
    /// `held` (`wrote_device` set once any went to device memory, which the caller settles).
    fn read_gets(
        c: &mut Conn,
        parts: &[(usize, u64, PutOp)],
        stop: &std::sync::atomic::AtomicBool,
        held: &[Region],
        at_region: &[usize],
        wrote_device: &mut bool,
    ) -> Result<u64, Failure> {
        let mut bytes = 0u64;
        let mut next = 0;
        while next < parts.len() {
            if stop.load(Ordering::Relaxed) {
                // Between windows of reads: nothing is outstanding, the connection stays.
                return Err(Kept(OpError::Failed(ANOTHER_LANE.into())));
            }
            // Send a window of requests, then read their answers in order.
            let (mut end, mut window) = (next, 0u64);
            while end < parts.len()
                && end - next < GET_WINDOW_OPS
                && (end == next || window + parts[end].2.len <= GET_WINDOW_BYTES)
            {
                window += parts[end].2.len;
                end += 1;
            }
            let headers: Vec<[u8; 24]> = parts[next..end]
                .iter()
                .map(|(_, _, op)| header(OP_GET, op.remote, op.len))
                .collect();
            let records: Vec<&[u8]> = headers.iter().map(|h| &h[..]).collect();
            c.send_small(&records).map_err(failure)?;
            for (i, _, op) in &parts[next..end] {
                // Refused: the answers to the reads after it are still on their way, so
                // the connection goes either way (the next op dials again).
                if let Err(r) = read_status(c).map_err(failure)? {
                    return Err(OpError::Failed(format!("the peer refused a read: {}", r.why)).into());
                }
                let dest = &held[at_region[*i]];
                *wrote_device |= dest.device.is_some();
                let mut failed = None;
                c.recv_each(op.len, |at, plain| {
                    // `prepare` checked the range lies in the region, which `held` keeps
                    // mapped. After a failed copy the rest is read (framing) and dropped.
                    if failed.is_none() {
                        failed = dest.write(op.local + at, plain).err();
                    }
                })
                .map_err(failure)?;
                if let Some(e) = failed {
                    // The answers to the window's later reads are still on their way:
                    // the connection goes.
                    return Err(OpError::Failed(format!("placing a read in device memory: {e}")).into());
                }
                bytes += op.len;
            }
            next = end;
        }
        Ok(bytes)
    }

    /// The path to `peer`.
    pub fn observe(&self, peer: u64) -> Result<Observed, String> {
        let p = lock(&self.inner.peers)
            .get(&peer)
            .cloned()
            .ok_or_else(|| format!("unknown stream peer {peer}"))?;
        Ok(Observed {
            kind: pdpair_api::PathKind::Tcp,
            backend: pdpair_api::Backend::TcpStream,
            lanes: vec![p.lane.clone()],
            emulated: false,
            version: String::new(),
        })
    }
}

/// One lane's share of an op list: the op it comes from (its index), where in that op it
/// starts, and the bytes it moves.
type Part = (usize, u64, PutOp);

/// Splits `ops` into one contiguous share per lane, about the same bytes each (the lanes used:
/// one per [`MIN_LANE_BYTES`] of the total, at most `lanes`; one below twice that): each share
/// but the last is a whole number of records, so an op is cut where a share ends. The shares
/// keep the ops' order; an empty list is one empty share (a flush alone).
fn split(ops: &[PutOp], lanes: usize) -> Vec<Vec<Part>> {
    let total: u64 = ops.iter().map(|o| o.len).sum();
    let n = (total / MIN_LANE_BYTES).clamp(1, lanes.max(1) as u64) as usize;
    let record = seal::CHUNK as u64;
    let share = total.div_ceil(n as u64).div_ceil(record).max(1) * record;
    let mut out: Vec<Vec<Part>> = vec![Vec::new(); n];
    let (mut lane, mut filled) = (0, 0u64);
    for (i, op) in ops.iter().enumerate() {
        let mut from = 0u64;
        while from < op.len {
            let room = if lane + 1 == n { u64::MAX } else { share - filled };
            let take = (op.len - from).min(room);
            out[lane].push((
                i,
                from,
                PutOp {
                    local: op.local + from,
                    remote: op.remote + from,
                    len: take,
                },
            ));
            from += take;
            filled += take;
            if filled >= share && lane + 1 < n {
                lane += 1;
                filled = 0;
            }
        }
    }
    out.retain(|share| !share.is_empty());
    if out.is_empty() {
        out.push(Vec::new());
    }
    out
}

/// Why a lane stopped: another lane of its op failed first.
const ANOTHER_LANE: &str = "another lane of this op failed";

/// Runs `run(lane, share, stop)` for every share, each on a thread of its own but the first (on
/// this one), and sums their bytes. A lane that cannot be dialled (the peer's cap on connections
/// waiting for their proof, say) has its share run on lane 0 instead, after lane 0's own. Once a
/// lane fails, `stop` is set and the others stop at their next record (puts) or window of reads
/// (gets); the op's failure is the first lane's to fail.
fn across_lanes(
    p: &PeerConn,
    shares: &[Vec<Part>],
    deadline: Instant,
    run: impl Fn(usize, &[Part], &std::sync::atomic::AtomicBool) -> Result<u64, OpError> + Sync,
) -> Result<u64, OpError> {
    let stop = std::sync::atomic::AtomicBool::new(false);
    if let [only] = shares {
        return run(0, only, &stop);
    }
    let first_failed: Mutex<Option<usize>> = Mutex::new(None);
    let (run, stop_ref, first_ref) = (&run, &stop, &first_failed);
    // Runs one share on `on` (its own lane, or lane 0 for a lane that could not be dialled),
    // noting a failure.
    let attempt = move |share: usize, on: usize| {
        let r = run(on, &shares[share], stop_ref);
        if r.is_err() {
            stop_ref.store(true, Ordering::Relaxed);
            lock(first_ref).get_or_insert(share);
        }
        r
    };
    thread::scope(|s| {
        let spawned: Vec<_> = (1..shares.len())
            .map(|lane| {
                thread::Builder::new()
                    .name("kv-stream-lane".into())
                    .spawn_scoped(s, move || p.dialled(lane, deadline).then(|| attempt(lane, lane)))
                    .map_err(|_| lane)
            })
            .collect();
        let mut results: Vec<Option<Result<u64, OpError>>> = vec![Some(attempt(0, 0))];
        for handle in spawned {
            results.push(match handle {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| Some(Err(OpError::Failed("a lane's thread panicked".into())))),
                // No thread for it: lane 0 runs its share.
                Err(_) => None,
            });
        }
        // Shares whose lane could not be dialled (or had no thread) go over lane 0, in order.
        for (share, r) in results.iter_mut().enumerate() {
            if r.is_none() {
                *r = Some(attempt(share, 0));
            }
        }
        let results: Vec<Result<u64, OpError>> = results.into_iter().flatten().collect();
        if let Some(first) = *lock(&first_failed) {
            return Err(results[first]
                .clone()
                .err()
                .unwrap_or_else(|| OpError::Failed(ANOTHER_LANE.into())));
        }
        results.into_iter().try_fold(0u64, |sum, r| Ok(sum + r?))
    })
}

impl PeerConn {
    /// Dials `lane` and proves the admission there (by `deadline`, within [`PROOF_WITHIN`]),
    /// unless the link was dropped; its socket is noted for a disconnect.
    fn dial_lane(&self, lane: usize, deadline: Instant) -> Result<Conn, String> {
        if self.gone.load(Ordering::SeqCst) {
            return Err("the link to this peer was dropped".into());
        }
        let c = dial(
            self.at,
            &self.key,
            lane as u8,
            deadline.min(Instant::now() + PROOF_WITHIN),
        )?;
        *lock(&self.lanes[lane].sock) = c.sock.try_clone().ok();
        Ok(c)
    }

    /// Whether `lane` has a connection, dialling it first where it has none; a failed dial is
    /// logged, and the caller uses lane 0.
    fn dialled(&self, lane: usize, deadline: Instant) -> bool {
        let mut guard = lock(&self.lanes[lane].conn);
        if guard.is_some() {
            return true;
        }
        match self.dial_lane(lane, deadline) {
            Ok(c) => {
                *guard = Some(c);
                true
            }
            Err(e) => {
                tracing::debug!(peer = %self.at, lane, error = %e, "cannot dial a KV stream lane; its share goes over lane 0");
                false
            }
        }
    }
}

/// An op's failure: `Kept` when the connection's framing is intact (the peer refused at a
/// flush and goes on), `Closed` when it is in doubt and the connection must go.
enum Failure {
    Kept(OpError),
    Closed(OpError),
    /// The connection was gone when the op found it (the peer, or something on the path, had
    /// closed it: an idle connection dropped by a firewall, say): the op may run again once on
    /// a new one (puts and gets move the same bytes again).
    Lost(OpError),
}
use Failure::Kept;

/// An op's io error: `Lost` when the peer had closed the connection.
fn failure(e: io::Error) -> Failure {
    match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted => Failure::Lost(io_error(e)),
        _ => Failure::Closed(io_error(e)),
    }
}

impl From<OpError> for Failure {
    fn from(e: OpError) -> Failure {
        Failure::Closed(e)
    }
}

/// Runs `op` on `p`'s connection, dialling it again first when an earlier op closed it. A
/// failure that leaves the framing in doubt closes it (the peer may hold half a frame, or have
/// closed); `refusal`: first read the refusal a peer sends before it closes (a write into the
/// closed connection fails before its text is read). An op that found the connection lost
/// runs once more on a new one, time allowing.
fn on_connection(
    p: &PeerConn,
    lane: usize,
    refusal: bool,
    deadline: Instant,
    mut op: impl FnMut(&mut Conn) -> Result<u64, Failure>,
) -> Result<u64, OpError> {
    let mut guard = lock(&p.lanes[lane].conn);
    let mut again = true;
    loop {
        match run_once(p, lane, &mut guard, refusal, deadline, &mut op) {
            Err(Failure::Lost(_)) if std::mem::take(&mut again) && Instant::now() < deadline => {
                tracing::debug!(peer = %p.at, "the KV stream's connection was lost; dialling again");
            }
            Err(Failure::Lost(e) | Failure::Closed(e) | Failure::Kept(e)) => return Err(e),
            Ok(bytes) => return Ok(bytes),
        }
    }
}

fn run_once(
    p: &PeerConn,
    lane: usize,
    guard: &mut std::sync::MutexGuard<'_, Option<Conn>>,
    refusal: bool,
    deadline: Instant,
    op: &mut impl FnMut(&mut Conn) -> Result<u64, Failure>,
) -> Result<u64, Failure> {
    if guard.is_none() {
        if Instant::now() >= deadline {
            return Err(OpError::Timeout("the deadline passed before the stream was dialled again".into()).into());
        }
        let c = p
            .dial_lane(lane, deadline)
            .map_err(|e| OpError::Failed(format!("dialling the stream to this peer again: {e}")))?;
        **guard = Some(c);
    }
    let Some(c) = guard.as_mut() else {
        return Err(OpError::Failed("the stream to this peer is closed".into()).into());
    };
    c.deadline = Some(deadline);
    match op(c) {
        Ok(bytes) => Ok(bytes),
        Err(Failure::Kept(e)) => Err(Kept(e)),
        Err(mut failed) => {
            if let Some(mut c) = guard.take() {
                c.deadline = Some(Instant::now() + Duration::from_millis(500));
                // A refusal the peer sent before it closed is the answer (not a lost connection).
                if refusal
                    && let Failure::Closed(OpError::Failed(_)) | Failure::Lost(OpError::Failed(_)) = failed
                    && let Ok(Err(r)) = read_status(&mut c)
                {
                    failed = Failure::Closed(OpError::Failed(format!("the peer refused a write: {}", r.why)));
                }
                let _ = c.sock.shutdown(Shutdown::Both);
            }
            Err(failed)
        }
    }
}

fn io_error(e: io::Error) -> OpError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => OpError::Timeout(e.to_string()),
        _ => OpError::Failed(format!("the stream to the peer: {e}")),
    }
}

fn accept_loop(listener: TcpListener, inner: Weak<Inner>, unproven: &Arc<crate::unproven::Budget>) {
    for conn in listener.incoming() {
        let Some(strong) = inner.upgrade() else { return };
        let c = match conn {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, say: do not spin on it.
                tracing::warn!(error = %e, "the KV stream cannot accept");
                thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let Some(from) = c.peer_addr().ok().map(|a| crate::unproven::source(a.ip())) else {
            continue;
        };
        // Closed unread over the budget; when it is full, a source holding fewer takes the
        // place of the biggest one's oldest.
        let Ok((slot, _)) = unproven.admit(from, &c) else {
            drop(c);
            continue;
        };
        let held = strong.clone();
        let spawned = thread::Builder::new()
            .name("kv-stream-conn".into())
            .spawn(move || serve(c, held, slot));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start a KV stream connection's thread");
        }
    }
}

/// One dialled connection: proof, then ops until it ends.
fn serve(mut c: TcpStream, inner: Arc<Inner>, slot: crate::unproven::Slot) {
    let Some(p) = prove(&mut c, &inner, slot) else {
        return;
    };
    let mut conn = Conn::new(c, &p.key, &p.salt, Side::Listener);
    if let Err(why) = serve_ops(&mut conn, &p.regions, p.access, &p.windows) {
        tracing::info!(error = %why, "closed a KV stream connection");
        send_error(&mut conn, &why);
        linger(&mut conn.sock);
    }
    let _ = conn.sock.shutdown(Shutdown::Both);
    forget_conn(&inner, &p);
}

/// The proven connection `p` is over: its lane's entry goes (unless a newer one replaced it on
/// its lane already).
fn forget_conn(inner: &Inner, p: &Proven) {
    if let Some(a) = lock(&inner.admitted).get_mut(&p.id)
        && a.conns.get(&p.lane).is_some_and(|(s, _)| *s == p.serial)
    {
        a.conns.remove(&p.lane);
    }
}

/// Half-closes `c` and drops what the peer still sends (briefly), so the refusal sent before
/// reaches it: closing with unread bytes would reset the connection and lose it.
fn linger(c: &mut TcpStream) {
    let _ = c.shutdown(Shutdown::Write);
    let _ = c.set_read_timeout(Some(Duration::from_millis(500)));
    let mut sink = [0u8; 64 << 10];
    let until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < until {
        match c.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

/// A proven connection: its admission (id), its serial number, what the admission allows, and
/// what its records' keys come from.
struct Proven {
    id: [u8; 16],
    lane: u8,
    serial: u64,
    regions: Vec<Region>,
    access: Access,
    windows: Arc<Windows>,
    key: [u8; 32],
    /// Both sides' nonces.
    salt: Vec<u8>,
}

/// The connection's proof, checked; its pre-auth `slot` is given back once it is, before the
/// peer is told (a connection told it is accepted can no longer be shut down to make room).
fn prove(c: &mut TcpStream, inner: &Inner, slot: crate::unproven::Slot) -> Option<Proven> {
    let _ = c.set_nodelay(true);
    let deadline = Instant::now() + PROOF_WITHIN;
    c.set_write_timeout(Some(PROOF_WITHIN)).ok()?;
    let mut nonce = [0u8; 32];
    getrandom::fill(&mut nonce).ok()?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&nonce);
    c.write_all(&hello).ok()?;
    let mut answer = [0u8; ANSWER_LEN];
    seal::read_full(c, &mut answer, Some(deadline)).ok()?;
    if &answer[..16] != MAGIC {
        refuse_plain(c, "not a pdpair stream greeting");
        return None;
    }
    let mut id = [0u8; 16];
    id.copy_from_slice(&answer[16..32]);
    let lane = answer[32];
    let theirs = &answer[33..65];
    let mut admitted = lock(&inner.admitted);
    // One refusal for an unknown id and a wrong proof: ids cross in the clear, and a caller
    // without the key learns nothing from replaying one (not whether its admission still holds).
    const NOT_PROVEN: &str = "no admission has that id and proof";
    let verdict = match admitted.get_mut(&id) {
        None => {
            // The same work as a wrong proof: how long the refusal takes says nothing either.
            let _ = proof_mac(&[0; 32], &nonce, theirs, lane).verify_slice(&answer[65..97]);
            Err(NOT_PROVEN)
        }
        Some(a) => {
            if proof_mac(&a.key, &nonce, theirs, lane)
                .verify_slice(&answer[65..97])
                .is_err()
            {
                Err(NOT_PROVEN)
            } else if usize::from(lane) >= MAX_LANES {
                Err("the lane is past the ones an admission holds")
            } else {
                match c.try_clone() {
                    Ok(clone) => {
                        let serial = inner.next_conn.fetch_add(1, Ordering::Relaxed);
                        // The peer dialled this lane again: what it had there before is over.
                        if let Some((_, old)) = a.conns.insert(lane, (serial, clone)) {
                            let _ = old.shutdown(Shutdown::Both);
                        }
                        Ok(Proven {
                            id,
                            lane,
                            serial,
                            regions: a.regions.clone(),
                            access: a.access,
                            windows: a.windows.clone(),
                            key: a.key,
                            salt: [&nonce[..], theirs].concat(),
                        })
                    }
                    Err(_) => Err("cannot hold the connection"),
                }
            }
        }
    };
    drop(admitted);
    match verdict {
        Ok(p) => {
            drop(slot);
            // Proven: ops may pause as long as the link lives (its admission closes this), and
            // an answer may wait as long as the side channel's silence limit.
            let told = c.set_read_timeout(None).is_ok() && c.set_write_timeout(Some(ANSWER_WITHIN)).is_ok() && {
                let accepted: [u8; 32] = accept_mac(&p.key, &nonce, &answer[33..65])
                    .finalize()
                    .into_bytes()
                    .into();
                c.write_all(&[&[OK][..], &accepted].concat()).is_ok()
            };
            if !told {
                // Gone before it heard it was proven: its lane's entry (and socket) go too.
                forget_conn(inner, &p);
                return None;
            }
            Some(p)
        }
        Err(why) => {
            tracing::info!(peer = ?c.peer_addr().ok(), reason = why, "refused a KV stream connection");
            refuse_plain(c, why);
            None
        }
    }
}

/// Serves ops until the peer closes (`Ok`) or sends something refused (`Err`, answered).
fn serve_ops(c: &mut Conn, regions: &[Region], access: Access, windows: &Windows) -> Result<(), String> {
    // A write outside every open window since the last flush: the flush's answer.
    let mut dropped: Option<String> = None;
    // A write into device memory since the last flush: it has landed before the flush answers.
    let mut written = false;
    // The peer closing between ops ends the connection quietly; a record that does not open
    // (changed on the way) is refused.
    let ended = |e: io::Error| match e.kind() {
        io::ErrorKind::InvalidData => Err(e.to_string()),
        _ => Ok(()),
    };
    loop {
        let h: [u8; 24] = match c.recv(24) {
            Ok(h) => h.try_into().unwrap_or([0xff; 24]),
            Err(e) => return ended(e),
        };
        if h[1..8] != [0u8; 7] {
            return Err("a header's reserved bytes are not zero".into());
        }
        let addr = u64::from_be_bytes(h[8..16].try_into().unwrap_or_default());
        let len = u64::from_be_bytes(h[16..24].try_into().unwrap_or_default());
        let (op, wants) = match h[0] {
            OP_PUT => ("write", Access::Write),
            OP_GET => ("read", Access::Read),
            OP_FLUSH => {
                if addr != 0 || len != 0 {
                    return Err("a flush carries an address or length".into());
                }
                if std::mem::take(&mut written)
                    && let Err(e) = settle(regions)
                {
                    dropped.get_or_insert(format!("device writes did not land: {e}"));
                }
                match dropped.take() {
                    Some(why) => send_declined(c, &why)?,
                    None => c.send(&[OK, 0, 0]).map_err(|e| e.to_string())?,
                }
                continue;
            }
            other => return Err(format!("unknown op {other}")),
        };
        if access != wants {
            return Err(format!("this link may not {op} here"));
        }
        let Some(region) = region_of(regions, addr, len).filter(|_| len > 0) else {
            return Err(format!(
                "a {op} of {addr:#x}+{len} is outside the memory this link was admitted to"
            ));
        };
        // Every piece is checked against the windows as it is copied, under their lock: a
        // window closed while an op runs (its request ended, its blocks may go to another
        // request) takes nothing more of it.
        match wants {
            Access::Read if !windows.contains(addr, len) => {
                // Inside the engine's pool, but not in a block lent to this link now.
                send_declined(
                    c,
                    &format!("a read of {addr:#x}+{len} is outside every block lent to this link now"),
                )?;
            }
            Access::Read => {
                c.send_op(&[OK, 0, 0], len, |at, into| {
                    match windows.copy_from(region, addr + at, into) {
                        Ok(true) => Ok(()),
                        Ok(false) => Err(io::Error::other(format!(
                            "the blocks at {addr:#x}+{len} were taken back from this link while it read them"
                        ))),
                        Err(e) => Err(io::Error::other(format!("reading device memory at {addr:#x}: {e}"))),
                    }
                })
                .map_err(|e| e.to_string())?;
            }
            Access::Write => {
                // Outside every window of this link's requests (it ended, or was never asked
                // for), whole or from some piece on: the rest is read, authenticated and
                // dropped, and the flush says so.
                let mut lost = false;
                let mut failed = None;
                if let Err(e) = c.recv_each(len, |at, plain| {
                    if !lost && failed.is_none() {
                        match windows.copy_into(region, addr + at, plain) {
                            Ok(true) => {}
                            Ok(false) => lost = true,
                            Err(e) => failed = Some(e),
                        }
                    }
                }) {
                    return ended(e);
                }
                written |= region.device.is_some();
                if let Some(e) = failed {
                    dropped.get_or_insert(format!("a write of {addr:#x}+{len} did not reach device memory: {e}"));
                }
                if lost {
                    dropped.get_or_insert(format!(
                        "a write of {addr:#x}+{len} is outside every block this link was asked for now (dropped)"
                    ));
                }
            }
        }
    }
}

mod seal;

#[cfg(test)]
mod tests;
