//! The push protocol's side channel: messages, mutual authentication, sessions and the
//! handshake. `docs/protocol.md` is the specification; this module is its implementation.
//!
//! Order on every connection, initiated by the decode (D) agent towards the prefill (P) agent:
//! 1. authentication: `Hello` (D: version, PDPair, nonce) -> `Challenge` (P: nonce, proof) ->
//!    `Proof` (D) -> `AuthOk` (P). Proofs are HMAC-SHA256 over both fresh nonces with the pair's
//!    secret and a role label, so the secret never crosses the wire, a replayed answer fails, and a
//!    proof cannot be reflected. Either side that fails the other sends `Reject{Unauthenticated}`
//!    and closes **before** any geometry, address or memory key is sent. These frames are at most
//!    [`wire::MAX_PREAUTH_FRAME`] bytes, and nothing the unauthenticated side says (its reasons
//!    are parsed into the closed [`Reason`] set; its text is dropped) reaches a metric, a status or
//!    an engine;
//! 2. session: both sides derive one key per direction with HKDF-SHA256 from the secret, both
//!    nonces, the PDPair and the direction ([`Session`]); every later frame is sealed
//!    ([`wire::write_sealed`]), so a relay that forwarded the proofs cannot change, drop, replay
//!    or inject a frame;
//! 3. handshake: `Handshake` (D) -> `Handshake` (P), sealed. Each side checks the pair with the
//!    rule table (`pdpair_api::check_pools`) and the peer's memory description against its own
//!    geometry before using anything in the peer's message; a failure is a `Reject` naming the
//!    reasons, then close.

use std::io::{Read, Write};

use hmac::{Hmac, Mac};
use pdpair_api::{
    ChecksumPolicy, KvGeometry, Parallelism, Role, TransferMode, Verdict, check_pools, checksum::BlockSums, rules::Pool,
};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

pub use crate::reason::Reason;
use crate::{
    layout::{LayerAt, MAX_REGIONS, PoolLayout},
    reason,
    wire::{self, FrameError, Opener, Sealer, hex_bytes},
};

/// The protocol version this agent speaks (2: sealed frames after authentication; 3: `Release`
/// also cancels; 4: memory in several regions, MLA's latent arrays; 5: KV stream addresses; 6:
/// the KV stream sealed; 9: prompt digests in `Register`; 10: `memory.layers[].unit`, K and V
/// side by side; see `docs/protocol.md`).
pub const PROTOCOL_VERSION: u16 = 10;
/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// The most bytes of a UCX worker address or packed remote key accepted from a peer.
pub const MAX_UCX_BLOB: usize = 8 << 10;

/// Bytes of a sealed `Handshake` frame, at most: the largest, 128 regions each with a UCX key
/// of [`MAX_UCX_BLOB`] bytes in hex and a worker address as large, is under 2.2 MiB. (A prefill
/// agent charges it to the pair's budget for frames being read, and holds a bounded number of
/// connections in their handshake: `agent::MAX_HANDSHAKING`.)
pub const MAX_HANDSHAKE_FRAME: usize = 4 << 20;

/// One side-channel message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum Message {
    /// D -> P, first: who we are and a fresh nonce.
    Hello {
        /// Protocol version.
        version: u16,
        /// `namespace/name` of the PDPair whose secret is used.
        pdpair: String,
        /// D's nonce.
        #[serde(with = "hex_bytes")]
        nonce: Vec<u8>,
    },
    /// P -> D: P's nonce and its proof of the secret.
    Challenge {
        /// Protocol version.
        version: u16,
        /// P's nonce.
        #[serde(with = "hex_bytes")]
        nonce: Vec<u8>,
        /// HMAC(secret, "pdpair/1 prefill" | pdpair | D nonce | P nonce).
        #[serde(with = "hex_bytes")]
        proof: Vec<u8>,
    },
    /// D -> P: D's proof of the secret.
    Proof {
        /// HMAC(secret, "pdpair/1 decode" | pdpair | D nonce | P nonce).
        #[serde(with = "hex_bytes")]
        proof: Vec<u8>,
    },
    /// P -> D: authenticated.
    AuthOk,
    /// Both ways, after authentication: the engine's geometry and memory.
    Handshake(Box<PeerInfo>),
    /// D -> P: a request's destination blocks.
    Register(Registration),
    /// P -> D: the request's blocks were written and flushed.
    Complete {
        /// Request id.
        request: String,
        /// Checksums of P's blocks that were written, by absolute token position.
        sums: Option<BlockSums>,
        /// Bytes written.
        bytes: u64,
    },
    /// P -> D: the request cannot be served.
    Failed {
        /// Request id.
        request: String,
        /// Stable reason.
        reason: Reason,
        /// Detail.
        message: String,
    },
    /// P -> D, pull mode: the request's KV is ready to be read from these blocks.
    Ready {
        /// Request id.
        request: String,
        /// P's block ids, in token order.
        blocks: Vec<u32>,
        /// Absolute position of the first token P's first block holds.
        first_token: u64,
        /// The request's token count.
        num_tokens: u64,
        /// Checksums of P's blocks, by absolute token position.
        sums: Option<BlockSums>,
    },
    /// D -> P, pull mode: D has read the request's KV; P may reuse the blocks.
    Released {
        /// Request id.
        request: String,
        /// Bytes read.
        bytes: u64,
    },
    /// D -> P: decode needs nothing of this request (answered by `ReleaseDone`).
    Release {
        /// Request id.
        request: String,
        /// D's engine's prompt digest: a release counts only for the request whose prompt it
        /// is (or neither gives one), or whose release token it names.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prompt: Option<crate::engine_api::PromptDigest>,
        /// The request's release token, from D's engine (`engine_api::ReleaseToken`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<crate::engine_api::ReleaseToken>,
    },
    /// D -> P: hold this ready request's blocks one more lease (decode's engine queues it).
    Renew {
        /// Request id.
        request: String,
        /// D's engine's prompt digest: only the request of that prompt is held longer.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prompt: Option<crate::engine_api::PromptDigest>,
    },
    /// P -> D: the released request's blocks are free (or will be at once when its KV is ready).
    ReleaseDone {
        /// Request id.
        request: String,
    },
    /// Either way: the connection is refused; then the sender closes.
    Reject {
        /// Stable reasons.
        reasons: Vec<Reason>,
        /// Detail.
        message: String,
    },
    /// Either way: liveness and lease renewal.
    Ping {
        /// Sequence number.
        seq: u64,
    },
    /// Answer to `Ping`.
    Pong {
        /// The ping's sequence number.
        seq: u64,
    },
}

/// What a peer says about itself and its engine in the handshake.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// Agent identity (node/pod), for logs and rejections.
    pub agent: String,
    /// Protocol version.
    pub version: u16,
    /// `namespace/name` of the PDPair.
    pub pdpair: String,
    /// The engine's role.
    pub role: Role,
    /// Engine instance id.
    pub engine: String,
    /// Transfer mode the engine runs.
    pub mode: TransferMode,
    /// Checksum policy.
    pub checksum: ChecksumPolicy,
    /// The engine's parallelism.
    pub parallelism: Parallelism,
    /// The engine's KV geometry.
    pub kv: KvGeometry,
    /// The engine's tensor-parallel rank.
    #[serde(default)]
    pub tensor_rank: u32,
    /// The UCX worker address.
    #[serde(with = "hex_bytes")]
    pub worker_address: Vec<u8>,
    /// The registered KV memory.
    pub memory: MemoryDesc,
    /// A GPU pool's KV stream (`pdpair-tcp:ip:port`), where its agent runs one: peers behind
    /// another agent move its KV over that, staged through host buffers (`worker_address` is
    /// then the agent's CUDA IPC address, for peers behind the same agent). Empty otherwise.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub stream_address: String,
}

impl PeerInfo {
    /// Where a peer of `local`'s moves KV with it: the address of its backend the two share
    /// (a GPU pool behind another agent: its KV stream; otherwise its worker address).
    pub fn address_for(&self, local: &PeerInfo) -> Vec<u8> {
        if self.gpu_behind_another_agent(local) && !self.stream_address.is_empty() {
            self.stream_address.clone().into_bytes()
        } else {
            self.worker_address.clone()
        }
    }

    /// Whether this is a GPU pool that `local`'s pool does not reach through the same agent's
    /// CUDA IPC (their addresses differ: a GPU pool behind another agent, or a host pool).
    pub fn gpu_behind_another_agent(&self, local: &PeerInfo) -> bool {
        self.memory.kind == MemoryKind::Cuda
            && (local.memory.kind != MemoryKind::Cuda || self.worker_address != local.worker_address)
    }

    /// The KV stream this pool is reached on, where its agent runs one: a GPU pool's
    /// `stream_address`, a host pool's worker address when that is a stream's.
    pub fn kv_stream(&self) -> Option<&[u8]> {
        match self.memory.kind {
            MemoryKind::Cuda => (!self.stream_address.is_empty()).then_some(self.stream_address.as_bytes()),
            MemoryKind::Host => {
                crate::transport::stream::is_stream_address(&self.worker_address).then_some(&self.worker_address[..])
            }
        }
    }
}

/// One registered memory region of a peer's pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDesc {
    /// Remote address of the region's first byte.
    pub base: u64,
    /// Region length in bytes.
    pub len: u64,
    /// UCX packed remote key of the region.
    #[serde(with = "hex_bytes")]
    pub rkey: Vec<u8>,
}

/// Registered KV memory: one or more regions, and per layer where in them its K block array and
/// V block array (or MLA's one latent array) are.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryDesc {
    /// What memory the pool is (absent: host).
    #[serde(default, skip_serializing_if = "MemoryKind::is_host")]
    pub kind: MemoryKind,
    /// The pool's regions.
    pub regions: Vec<RegionDesc>,
    /// Blocks per K (or V) array.
    pub num_blocks: u32,
    /// Bytes of one block of one layer's K (or V).
    pub block_len: u64,
    /// Per layer: its region, its arrays' offsets in it, its block stride.
    pub layers: Vec<LayerAt>,
}

/// What memory a pool is, and so which backend moves it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemoryKind {
    /// Host memory (UCX; a region's key is a packed UCX remote key).
    #[default]
    Host,
    /// GPU memory behind this agent (CUDA IPC; a region's key is its 16-byte token).
    Cuda,
}

impl MemoryKind {
    /// Whether it is host memory (the default).
    pub fn is_host(&self) -> bool {
        *self == MemoryKind::Host
    }

    /// Its name in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryKind::Host => "host",
            MemoryKind::Cuda => "GPU",
        }
    }
}

/// Bytes of a GPU region's token.
pub const CUDA_TOKEN_LEN: usize = 16;

impl MemoryDesc {
    /// The description of a pool laid out as `layout`, its regions registered at `regions`
    /// (address, packed key), in the layout's region order.
    pub fn of(layout: &PoolLayout, regions: Vec<(u64, Vec<u8>)>) -> MemoryDesc {
        MemoryDesc {
            kind: MemoryKind::Host,
            regions: regions
                .into_iter()
                .zip(layout.region_lens())
                .map(|((base, rkey), len)| RegionDesc {
                    base,
                    len: len as u64,
                    rkey,
                })
                .collect(),
            num_blocks: layout.num_blocks,
            block_len: layout.block_len() as u64,
            layers: layout.layer_offsets(),
        }
    }

    /// Checks a peer's description against the geometry it claims (`kv`, `parallelism`, its
    /// rank): the block length and layer count it implies, a V array exactly when the cache is
    /// not MLA, every block of every array inside its region (checked arithmetic), at most
    /// [`MAX_REGIONS`] regions, and keys UCX can parse. Nothing in a peer's description is used
    /// before this passes.
    pub fn check(&self, kv: &KvGeometry, parallelism: &Parallelism, rank: u32) -> Result<(), String> {
        let layout = PoolLayout::new(kv, parallelism, self.num_blocks, rank).map_err(|e| e.0)?;
        if self.num_blocks == 0 {
            return Err("memory.num_blocks is 0".into());
        }
        let block_len = layout
            .block_len_checked()
            .ok_or("the geometry's block length overflows")?;
        if self.block_len != block_len {
            return Err(format!(
                "memory.block_len is {}; the geometry's block is {block_len} bytes",
                self.block_len
            ));
        }
        if self.regions.is_empty() || self.regions.len() > MAX_REGIONS {
            return Err(format!(
                "memory.regions has {} entries; a pool has 1..={MAX_REGIONS}",
                self.regions.len()
            ));
        }
        for (i, r) in self.regions.iter().enumerate() {
            if r.len == 0 || r.base.checked_add(r.len).is_none() {
                return Err(format!(
                    "memory.regions[{i}] at {:#x} of {} bytes is empty or overflows",
                    r.base, r.len
                ));
            }
            match self.kind {
                MemoryKind::Host => check_rkey(&r.rkey).map_err(|e| format!("memory.regions[{i}].rkey {e}"))?,
                MemoryKind::Cuda if r.rkey.len() != CUDA_TOKEN_LEN => {
                    return Err(format!(
                        "memory.regions[{i}].rkey is {} bytes; a GPU region's token is {CUDA_TOKEN_LEN}",
                        r.rkey.len()
                    ));
                }
                MemoryKind::Cuda => {}
            }
        }
        // Regions are separate memory: overlapping ones describe nothing real (and would make an
        // op's region ambiguous).
        let mut by_base: Vec<(usize, &RegionDesc)> = self.regions.iter().enumerate().collect();
        by_base.sort_by_key(|(_, r)| r.base);
        for pair in by_base.windows(2) {
            let ((i, a), (j, b)) = (pair[0], pair[1]);
            if a.base + a.len > b.base {
                return Err(format!(
                    "memory.regions[{i}] ({:#x}+{}) overlaps memory.regions[{j}] ({:#x})",
                    a.base, a.len, b.base
                ));
            }
        }
        if self.layers.len() != layout.layers as usize {
            return Err(format!(
                "memory.layers has {} entries; the geometry has {} layers",
                self.layers.len(),
                layout.layers
            ));
        }
        for (i, l) in self.layers.iter().enumerate() {
            let Some(region) = self.regions.get(l.region as usize) else {
                return Err(format!(
                    "memory.layers[{i}].region is {}; there are {} regions",
                    l.region,
                    self.regions.len()
                ));
            };
            if l.block_stride < self.block_len {
                return Err(format!(
                    "memory.layers[{i}].block_stride {} is less than memory.block_len {}",
                    l.block_stride, self.block_len
                ));
            }
            // A block's span: its (head, token) pieces `unit` apart (K and V side by side:
            // twice a half token), each a half token.
            let half = layout.half_token() as u64;
            let unit = l.unit.unwrap_or(half);
            if unit != half && unit != 2 * half {
                return Err(format!(
                    "memory.layers[{i}].unit is {unit}; a head's token is {half} bytes apart from the next, or {} with K and V side by side",
                    2 * half
                ));
            }
            let span = (self.block_len / half.max(1) - 1)
                .checked_mul(unit)
                .and_then(|s| s.checked_add(half))
                .ok_or_else(|| format!("memory.layers[{i}]'s block span overflows"))?;
            // The end of an array's last block, from the array's offset.
            let array_end = u64::from(self.num_blocks - 1)
                .checked_mul(l.block_stride)
                .and_then(|o| o.checked_add(span))
                .ok_or_else(|| format!("memory.num_blocks x memory.layers[{i}].block_stride overflows"))?;
            let v = match (l.v, layout.latent) {
                (Some(v), false) => Some(v),
                (None, true) => None,
                (Some(_), true) => return Err(format!("memory.layers[{i}] has a V array; kv.mla is true")),
                (None, false) => return Err(format!("memory.layers[{i}] has no V array; kv.mla is false")),
            };
            for (what, offset) in [("K", Some(l.k)), ("V", v)] {
                let Some(offset) = offset else { continue };
                if offset.checked_add(array_end).is_none_or(|end| end > region.len) {
                    return Err(format!(
                        "memory.layers[{i}] {what} array at offset {offset} ends past memory.regions[{}].len {}",
                        l.region, region.len
                    ));
                }
            }
        }
        Ok(())
    }

    /// The remote address of a block of a layer's K (`v = false`) or V array (a description
    /// that passed [`MemoryDesc::check`]; `None` for a layer or array it lacks).
    pub fn block(&self, layer: u32, v: bool, block: u32) -> Option<u64> {
        let l = self.layers.get(layer as usize)?;
        let array = if v { l.v? } else { l.k };
        Some(self.regions.get(l.region as usize)?.base + array + u64::from(block) * l.block_stride)
    }

    /// The regions as the UCX thread connects to them: (packed key, (address, bytes)).
    pub fn keys(&self) -> Vec<(Vec<u8>, (u64, u64))> {
        self.regions.iter().map(|r| (r.rkey.clone(), (r.base, r.len))).collect()
    }
}

/// Checks a packed UCX remote key's structure before UCX parses it: UCX packs a 64-bit map of
/// memory domains, a memory-type byte, then per domain in the map a length byte and that many
/// bytes; since 1.12 it may append the memory's system device (one byte) and that device's
/// distances (3 bytes each; 1.22 appends the device byte alone for host memory). The key must
/// hold exactly that (an empty or truncated key would make UCX read past it).
pub fn check_rkey(rkey: &[u8]) -> Result<(), String> {
    if rkey.len() < 9 || rkey.len() > MAX_UCX_BLOB {
        return Err(format!("is {} bytes; a UCX key is 9..={MAX_UCX_BLOB}", rkey.len()));
    }
    let mut map = [0u8; 8];
    map.copy_from_slice(&rkey[..8]);
    let domains = u64::from_le_bytes(map).count_ones();
    if domains == 0 {
        return Err("names no memory domain".into());
    }
    let mut at = 9usize;
    for _ in 0..domains {
        let Some(n) = rkey.get(at) else {
            return Err(format!("ends after {} of its {domains} domains", at));
        };
        at += 1 + usize::from(*n);
    }
    match rkey.len().checked_sub(at) {
        // Nothing more, or a system device and whole distances.
        Some(0) => Ok(()),
        // (1.22's host keys end in device 255, "unknown". UCX reads none of this through
        // `ucp_ep_rkey_unpack`, which passes no length; were it to, device bytes would index
        // its table of 255 devices, so 255 would need refusing there.)
        Some(rest) if (rest - 1) % 3 == 0 => Ok(()),
        _ => Err(format!(
            "is {} bytes; its {domains} domains take {at}, and what follows is not a device byte and 3-byte distances",
            rkey.len()
        )),
    }
}

/// Checks a peer's worker address before a backend parses it: present and bounded. (UCX's address
/// format is internal, and UCX trusts the rest: docs/security.md, "A hostile UCX worker address".)
pub fn check_worker_address(address: &[u8]) -> Result<(), String> {
    if address.len() < 8 || address.len() > MAX_UCX_BLOB {
        return Err(format!(
            "worker_address is {} bytes; a UCX worker address is 8..={MAX_UCX_BLOB}",
            address.len()
        ));
    }
    Ok(())
}

/// Checks a UCX worker address (a host pool's peer) like [`check_worker_address`], and its
/// format: the first byte's low 4 bits are 0 (v1) or 1 (v2). UCX aborts the process on any other
/// (an assertion that stays in release builds: measured with 1.13 and 1.22).
pub fn check_ucx_address(address: &[u8]) -> Result<(), String> {
    check_worker_address(address)?;
    let format = address[0] & 0x0f;
    if format > 1 {
        return Err(format!(
            "worker_address has format {format} (its first byte is {:#04x}); UCX addresses are format 0 or 1",
            address[0]
        ));
    }
    Ok(())
}

/// D's registration of one request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Request id, shared by D's and P's engines.
    pub request: String,
    /// D's block ids, in token order.
    pub blocks: Vec<u32>,
    /// The request's token count.
    pub num_tokens: u64,
    /// Absolute position of the first token D's first block holds.
    pub first_token: u64,
    /// D's engine's prompt digest: P serves the request only when its engine gave the same
    /// (`Failed{PromptMismatch}`; neither: no check).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<crate::engine_api::PromptDigest>,
}

/// Why a connection ended before it was usable.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// Framing or I/O.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// Authentication failed (either side).
    #[error("Unauthenticated: {0}")]
    Unauthenticated(String),
    /// The peer or we rejected the pair.
    #[error("rejected [{}]: {message}", reason::names(reasons).join(", "))]
    Rejected {
        /// Stable reasons.
        reasons: Vec<Reason>,
        /// Detail.
        message: String,
    },
    /// The peer broke the protocol.
    #[error("protocol: {0}")]
    Protocol(String),
}

impl HandshakeError {
    /// The stable reasons for a request that waited on this connection.
    pub fn reasons(&self) -> Vec<Reason> {
        match self {
            HandshakeError::Unauthenticated(_) => vec![Reason::Unauthenticated],
            HandshakeError::Rejected { reasons, .. } => reasons.clone(),
            HandshakeError::Frame(FrameError::BadTag(_)) => vec![Reason::ProtocolError],
            HandshakeError::Frame(_) => vec![Reason::HandshakeFailed],
            HandshakeError::Protocol(_) => vec![Reason::ProtocolError],
        }
    }
}

/// An authenticated session: the sealing key of our direction and the opening key of the
/// peer's, each HKDF-SHA256(salt = D nonce | P nonce, secret, "pdpair/2 session" | PDPair |
/// direction).
#[derive(Debug)]
pub struct Session {
    /// Seals what we send.
    pub sealer: Sealer,
    /// Opens what the peer sends.
    pub opener: Opener,
    /// The same on both sides, never on the wire: what the peer proves to a backend it dials
    /// whose memory it reaches through the agent (the tcp stream, `transport::stream`).
    pub stream_key: [u8; 32],
}

fn session_key(secret: &[u8], pdpair: &str, d_nonce: &[u8], p_nonce: &[u8], direction: &str) -> [u8; 32] {
    let salt = [d_nonce, p_nonce].concat();
    let hk = hkdf::Hkdf::<Sha256>::new(Some(&salt), secret);
    let mut info = Vec::new();
    for part in [b"pdpair/2 session".as_slice(), pdpair.as_bytes(), direction.as_bytes()] {
        info.extend_from_slice(&(part.len() as u64).to_be_bytes());
        info.extend_from_slice(part);
    }
    let mut key = [0u8; 32];
    // 32 bytes is far below HKDF-SHA256's 8160-byte limit: expand cannot fail.
    hk.expand(&info, &mut key)
        .unwrap_or_else(|_| unreachable!("32 bytes is a valid HKDF-SHA256 output length"));
    key
}

impl Session {
    /// The session of `role`'s side.
    pub fn derive(role: Role, secret: &[u8], pdpair: &str, d_nonce: &[u8], p_nonce: &[u8]) -> Session {
        let d_to_p = session_key(secret, pdpair, d_nonce, p_nonce, "decode->prefill");
        let p_to_d = session_key(secret, pdpair, d_nonce, p_nonce, "prefill->decode");
        let (send, recv) = match role {
            Role::Decode => (d_to_p, p_to_d),
            Role::Prefill => (p_to_d, d_to_p),
        };
        Session {
            sealer: Sealer::new(send),
            opener: Opener::new(recv),
            stream_key: session_key(secret, pdpair, d_nonce, p_nonce, "stream"),
        }
    }

    /// Sends one sealed message.
    pub fn send(&mut self, w: &mut impl Write, m: &Message) -> Result<(), FrameError> {
        wire::write_sealed(w, &mut self.sealer, m)
    }

    /// Reads one sealed message.
    pub fn recv(&mut self, r: &mut impl Read) -> Result<Message, FrameError> {
        wire::read_sealed(r, &mut self.opener, wire::MAX_FRAME)
    }

    /// [`Session::recv`] of a handshake, at most [`MAX_HANDSHAKE_FRAME`] bytes: no more than a
    /// handshake needs.
    pub fn recv_handshake(&mut self, r: &mut impl Read) -> Result<Message, FrameError> {
        self.recv_handshake_by(r, |_| Ok(())).map(|(m, _)| m)
    }

    /// [`Session::recv_handshake`], with `admit` asked for room for the frame's length before
    /// its body is read and for what decoding it holds past that ([`wire::read_sealed_by`]);
    /// the charges come back with the message.
    pub fn recv_handshake_by<G>(
        &mut self,
        r: &mut impl Read,
        admit: impl FnMut(usize) -> Result<G, String>,
    ) -> Result<(Message, (G, Option<G>)), FrameError> {
        wire::read_sealed_by(r, &mut self.opener, MAX_HANDSHAKE_FRAME, admit)
    }
}

type HmacSha256 = Hmac<Sha256>;

fn mac(secret: &[u8], label: &str, pdpair: &str, d_nonce: &[u8], p_nonce: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length; new_from_slice cannot fail for HMAC.
    let mut m = HmacSha256::new_from_slice(secret).unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    for part in [label.as_bytes(), pdpair.as_bytes(), d_nonce, p_nonce] {
        m.update(&(part.len() as u64).to_be_bytes());
        m.update(part);
    }
    m
}

fn proof(secret: &[u8], role: Role, pdpair: &str, d_nonce: &[u8], p_nonce: &[u8]) -> Vec<u8> {
    mac(secret, label(role), pdpair, d_nonce, p_nonce)
        .finalize()
        .into_bytes()
        .to_vec()
}

fn verify(secret: &[u8], role: Role, pdpair: &str, d_nonce: &[u8], p_nonce: &[u8], tag: &[u8]) -> bool {
    mac(secret, label(role), pdpair, d_nonce, p_nonce)
        .verify_slice(tag)
        .is_ok()
}

fn label(role: Role) -> &'static str {
    match role {
        Role::Prefill => "pdpair/1 prefill",
        Role::Decode => "pdpair/1 decode",
    }
}

/// A fresh random nonce. A failing OS random source fails the connection (a predictable nonce
/// would make answers replayable).
pub fn nonce() -> Result<Vec<u8>, HandshakeError> {
    let mut n = vec![0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| HandshakeError::Protocol(format!("the OS random source failed: {e}")))?;
    Ok(n)
}

/// Before authentication: a plain `Reject`, then the error.
fn reject_plain(stream: &mut (impl Read + Write), reasons: Vec<Reason>, message: String) -> HandshakeError {
    let _ = wire::write_frame(
        stream,
        &Message::Reject {
            reasons: reasons.clone(),
            message: message.clone(),
        },
    );
    rejected(reasons, message)
}

/// After authentication: a sealed `Reject`, then the error.
fn reject_sealed(
    stream: &mut (impl Read + Write),
    session: &mut Session,
    reasons: Vec<Reason>,
    message: String,
) -> HandshakeError {
    let _ = session.send(
        stream,
        &Message::Reject {
            reasons: reasons.clone(),
            message: message.clone(),
        },
    );
    rejected(reasons, message)
}

fn rejected(reasons: Vec<Reason>, message: String) -> HandshakeError {
    if reasons.contains(&Reason::Unauthenticated) {
        HandshakeError::Unauthenticated(message)
    } else {
        HandshakeError::Rejected { reasons, message }
    }
}

/// An unexpected frame before authentication: a peer's `Reject` keeps only its reasons, parsed
/// into the closed set (its text is the unauthenticated peer's choice, so it is dropped), and
/// only those a peer gives before authenticating (`Unauthenticated`, `VersionMismatch`): any
/// peer that answers the connection can send it, and a rule's reason from it (a forged
/// `KernelBlockSizeMismatch`) was remembered and published as the pair's diagnosis.
fn unexpected_preauth(what: &str, got: &Message) -> HandshakeError {
    match got {
        Message::Reject { reasons, .. } => {
            let reasons = reason::from_peer(reasons.iter().copied());
            if reasons.is_empty()
                || reasons
                    .iter()
                    .any(|r| !matches!(r, Reason::Unauthenticated | Reason::VersionMismatch))
            {
                return HandshakeError::Protocol(format!(
                    "the peer refused before authentication (while we waited for {what}) with reasons only an authenticated peer gives"
                ));
            }
            rejected(
                reasons,
                format!("the peer refused before authentication (while we waited for {what})"),
            )
        }
        other => HandshakeError::Protocol(format!("expected {what}, got {}", kind(other))),
    }
}

/// An unexpected frame from an authenticated peer: its `Reject` text is kept, escaped and cut.
fn unexpected(what: &str, got: &Message) -> HandshakeError {
    match got {
        Message::Reject { reasons, message } => {
            rejected(reason::from_peer(reasons.iter().copied()), reason::peer_text(message))
        }
        other => HandshakeError::Protocol(format!("expected {what}, got {}", kind(other))),
    }
}

/// The message's type name (for logs: never the peer's text).
pub fn kind(m: &Message) -> &'static str {
    match m {
        Message::Hello { .. } => "Hello",
        Message::Challenge { .. } => "Challenge",
        Message::Proof { .. } => "Proof",
        Message::AuthOk => "AuthOk",
        Message::Handshake(_) => "Handshake",
        Message::Register(_) => "Register",
        Message::Complete { .. } => "Complete",
        Message::Failed { .. } => "Failed",
        Message::Reject { .. } => "Reject",
        Message::Ping { .. } => "Ping",
        Message::Pong { .. } => "Pong",
        Message::Ready { .. } => "Ready",
        Message::Released { .. } => "Released",
        Message::Release { .. } => "Release",
        Message::ReleaseDone { .. } => "ReleaseDone",
        Message::Renew { .. } => "Renew",
    }
}

fn read_preauth(stream: &mut impl Read) -> Result<Message, FrameError> {
    wire::read_frame_max(stream, wire::MAX_PREAUTH_FRAME)
}

/// D's side of authentication; returns the session.
pub fn authenticate_decode(
    stream: &mut (impl Read + Write),
    pdpair: &str,
    secret: &[u8],
) -> Result<Session, HandshakeError> {
    let d_nonce = nonce()?;
    wire::write_frame(
        stream,
        &Message::Hello {
            version: PROTOCOL_VERSION,
            pdpair: pdpair.into(),
            nonce: d_nonce.clone(),
        },
    )?;
    let (p_nonce, p_proof) = match read_preauth(stream)? {
        Message::Challenge { version, nonce, proof } if version == PROTOCOL_VERSION => (nonce, proof),
        Message::Challenge { version, .. } => {
            return Err(reject_plain(
                stream,
                vec![Reason::VersionMismatch],
                format!("peer speaks version {version}, we speak {PROTOCOL_VERSION}"),
            ));
        }
        other => return Err(unexpected_preauth("Challenge", &other)),
    };
    if p_nonce.len() != NONCE_LEN
        || p_nonce == d_nonce
        || !verify(secret, Role::Prefill, pdpair, &d_nonce, &p_nonce, &p_proof)
    {
        return Err(reject_plain(
            stream,
            vec![Reason::Unauthenticated],
            "the prefill agent's proof does not match this PDPair's secret".into(),
        ));
    }
    wire::write_frame(
        stream,
        &Message::Proof {
            proof: proof(secret, Role::Decode, pdpair, &d_nonce, &p_nonce),
        },
    )?;
    match read_preauth(stream)? {
        Message::AuthOk => Ok(Session::derive(Role::Decode, secret, pdpair, &d_nonce, &p_nonce)),
        other => Err(unexpected_preauth("AuthOk", &other)),
    }
}

/// P's side of authentication; `secret_for` maps a PDPair (`namespace/name`) to its secret.
/// Returns the PDPair and the session.
pub fn authenticate_prefill(
    stream: &mut (impl Read + Write),
    secret_for: impl Fn(&str) -> Option<Vec<u8>>,
) -> Result<(String, Session), HandshakeError> {
    authenticate_prefill_then(stream, secret_for, || true)
}

/// [`authenticate_prefill`], calling `proven` once the peer's proof is checked and before
/// `AuthOk` is sent: a listener gives back the connection's pre-auth slot there, so a
/// connection told `AuthOk` can no longer be shut down to make room for another, and counts
/// it as a link of its source. When `proven` says no (the source holds its links already), the
/// connection ends there, told nothing: a [`HandshakeError::Frame`] of kind `WouldBlock`.
pub fn authenticate_prefill_then(
    stream: &mut (impl Read + Write),
    secret_for: impl Fn(&str) -> Option<Vec<u8>>,
    proven: impl FnOnce() -> bool,
) -> Result<(String, Session), HandshakeError> {
    let (pdpair, d_nonce) = match read_preauth(stream)? {
        Message::Hello { version, pdpair, nonce } if version == PROTOCOL_VERSION => (pdpair, nonce),
        Message::Hello { version, .. } => {
            return Err(reject_plain(
                stream,
                vec![Reason::VersionMismatch],
                format!("peer speaks version {version}, we speak {PROTOCOL_VERSION}"),
            ));
        }
        other => return Err(unexpected_preauth("Hello", &other)),
    };
    let Some(secret) = secret_for(&pdpair).filter(|_| d_nonce.len() == NONCE_LEN) else {
        // The PDPair name is the unauthenticated peer's text: not echoed into our error.
        return Err(reject_plain(
            stream,
            vec![Reason::Unauthenticated],
            "the decode agent named a PDPair no engine here serves".into(),
        ));
    };
    let p_nonce = nonce()?;
    let p_proof = proof(&secret, Role::Prefill, &pdpair, &d_nonce, &p_nonce);
    wire::write_frame(
        stream,
        &Message::Challenge {
            version: PROTOCOL_VERSION,
            nonce: p_nonce.clone(),
            proof: p_proof,
        },
    )?;
    match read_preauth(stream)? {
        Message::Proof { proof } if verify(&secret, Role::Decode, &pdpair, &d_nonce, &p_nonce, &proof) => {
            if !proven() {
                return Err(FrameError::from(std::io::Error::new(
                    std::io::ErrorKind::WouldBlock,
                    "no place for another link of this source",
                ))
                .into());
            }
            wire::write_frame(stream, &Message::AuthOk)?;
            let session = Session::derive(Role::Prefill, &secret, &pdpair, &d_nonce, &p_nonce);
            Ok((pdpair, session))
        }
        Message::Proof { .. } => Err(reject_plain(
            stream,
            vec![Reason::Unauthenticated],
            "the decode agent's proof does not match this PDPair's secret".into(),
        )),
        other => Err(unexpected_preauth("Proof", &other)),
    }
}

/// The rule-table verdict on a local engine and a peer, with the prefill side first whichever
/// side is local. Transfer settings must match too.
pub fn check_peer(local: &PeerInfo, peer: &PeerInfo) -> Verdict {
    let (p, d) = match local.role {
        Role::Prefill => (local, peer),
        Role::Decode => (peer, local),
    };
    check_pools(
        local.mode,
        local.checksum,
        Pool {
            parallelism: &p.parallelism,
            kv: &p.kv,
        },
        Pool {
            parallelism: &d.parallelism,
            kv: &d.kv,
        },
    )
}

fn refuse(local: &PeerInfo, peer: &PeerInfo) -> Option<(Vec<Reason>, String)> {
    if peer.version != PROTOCOL_VERSION {
        return Some((
            vec![Reason::VersionMismatch],
            format!("peer speaks version {}, we speak {PROTOCOL_VERSION}", peer.version),
        ));
    }
    if peer.pdpair != local.pdpair {
        return Some((
            vec![Reason::PairMismatch],
            format!(
                "peer serves PDPair {}, we serve {}",
                reason::peer_text(&peer.pdpair),
                local.pdpair
            ),
        ));
    }
    if peer.role == local.role {
        return Some((vec![Reason::RoleMismatch], format!("both engines are {}", local.role)));
    }
    if (peer.mode, peer.checksum) != (local.mode, local.checksum) {
        return Some((
            vec![Reason::TransferSettingsMismatch],
            format!(
                "peer runs {:?}/{:?}, we run {:?}/{:?}",
                peer.mode, peer.checksum, local.mode, local.checksum
            ),
        ));
    }
    let verdict = check_peer(local, peer);
    if !verdict.allowed() {
        return Some((
            verdict.reasons().iter().map(|r| Reason::Rule(*r)).collect(),
            verdict.to_string(),
        ));
    }
    // Compatible on paper, but beyond what this agent's transfer path does yet: say so at the
    // handshake instead of failing later. The pool memory first: a peer's keys are checked by
    // its kind.
    use crate::transport::stream::{is_stream_address, parse_address};
    if peer.memory.kind == MemoryKind::Host
        && local.memory.kind == MemoryKind::Host
        && is_stream_address(&peer.worker_address) != is_stream_address(&local.worker_address)
    {
        let name = |a: &[u8]| if is_stream_address(a) { "the tcp stream" } else { "UCX" };
        return Some((
            vec![Reason::AgentUnsupported],
            format!(
                "the peer's agent moves KV over {} and ours over {}: run both agents with transports that meet (--transport tcp on both, or RDMA on both)",
                name(&peer.worker_address),
                name(&local.worker_address)
            ),
        ));
    }
    // A GPU pool meets a pool that is not behind the same agent's CUDA IPC (a GPU pool behind
    // another agent, or a host pool) over the agents' KV streams, staged through host memory:
    // both sides must run one.
    if peer.gpu_behind_another_agent(local) || local.gpu_behind_another_agent(peer) {
        let side = |p: &PeerInfo| match (p.memory.kind, p.kv_stream().is_some()) {
            (MemoryKind::Cuda, true) => "a GPU pool whose agent runs a KV stream",
            (MemoryKind::Cuda, false) => "a GPU pool whose agent runs no KV stream",
            (MemoryKind::Host, true) => "a host pool on a KV stream",
            (MemoryKind::Host, false) => "a host pool on UCX",
        };
        if peer.kv_stream().is_none() || local.kv_stream().is_none() {
            let what = if peer.memory.kind == local.memory.kind {
                "the engines' GPU pools are behind two agents".to_string()
            } else {
                format!(
                    "the peer's pool is {} memory and ours {}",
                    peer.memory.kind.as_str(),
                    local.memory.kind.as_str()
                )
            };
            return Some((
                vec![Reason::AgentUnsupported],
                format!(
                    "{what}: such pools move KV only over the agents' tcp streams (staged through host memory), and the peer has {} and we {}; run both agents with --transport tcp",
                    side(peer),
                    side(local)
                ),
            ));
        }
    }
    let address = match peer.memory.kind {
        MemoryKind::Host if is_stream_address(&peer.worker_address) => parse_address(&peer.worker_address).map(|_| ()),
        MemoryKind::Host => check_ucx_address(&peer.worker_address),
        _ if peer.gpu_behind_another_agent(local) => check_worker_address(&peer.worker_address).and_then(|()| {
            parse_address(peer.stream_address.as_bytes())
                .map(|_| ())
                .map_err(|e| format!("stream_address: {e}"))
        }),
        _ => check_worker_address(&peer.worker_address),
    };
    if let Err(e) = address.and_then(|()| peer.memory.check(&peer.kv, &peer.parallelism, peer.tensor_rank)) {
        return Some((vec![Reason::MemoryLayoutMismatch], format!("the peer's memory: {e}")));
    }
    // Pull converts block sizes (decode reads several prefill blocks into one of its own) and
    // head ranges, not layouts.
    if local.mode == TransferMode::Pull && peer.kv.layout != local.kv.layout {
        return Some((
            vec![Reason::AgentUnsupported],
            "pull needs one KV layout on both sides in this agent version".into(),
        ));
    }
    heads_fit(local, peer)
}

/// Which heads move between a prefill rank and a decode rank: prefill's local heads
/// `p_first..p_first+count` go to decode's local heads `d_first..d_first+count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadMap {
    /// First prefill-local head.
    pub p_first: u32,
    /// Heads moved.
    pub count: u32,
    /// First decode-local head.
    pub d_first: u32,
}

/// The heads a prefill rank writes into a decode rank. With unequal tensor parallelism one
/// side's head range must contain the other's: a decode rank takes part of one prefill rank's
/// heads, or gathers whole prefill ranks (one connection each).
pub fn head_map(prefill: &PeerInfo, decode: &PeerInfo) -> Result<HeadMap, (Vec<Reason>, String)> {
    let layout = |p: &PeerInfo| {
        crate::layout::PoolLayout::new(&p.kv, &p.parallelism, 1, p.tensor_rank)
            .map_err(|e| (vec![Reason::InvalidRequest], e.to_string()))
    };
    let (pl, dl) = (layout(prefill)?, layout(decode)?);
    let (p0, p1) = (pl.head_offset, pl.head_offset + pl.local_heads);
    let (d0, d1) = (dl.head_offset, dl.head_offset + dl.local_heads);
    let map = if d0 >= p0 && d1 <= p1 {
        HeadMap {
            p_first: d0 - p0,
            count: dl.local_heads,
            d_first: 0,
        }
    } else if p0 >= d0 && p1 <= d1 {
        HeadMap {
            p_first: 0,
            count: pl.local_heads,
            d_first: p0 - d0,
        }
    } else {
        return Err((
            vec![Reason::WrongTensorRank],
            format!(
                "decode rank {} holds KV heads {d0}..{d1} and prefill rank {} holds {p0}..{p1}: neither contains the other; connect the ranks whose heads line up",
                decode.tensor_rank, prefill.tensor_rank
            ),
        ));
    };
    let partial = map.count != pl.local_heads || map.count != dl.local_heads;
    if partial && (prefill.kv.layout != pdpair_api::KvLayout::Hnd || decode.kv.layout != pdpair_api::KvLayout::Hnd) {
        return Err((
            vec![Reason::AgentUnsupported],
            "moving part of a block's heads needs the HND layout on both sides".into(),
        ));
    }
    Ok(map)
}

/// The prefill ranks a decode rank takes its KV heads from: the prefill rank that holds all of
/// them, or, when several do (MLA, or more ranks than heads), the one at `decode_rank` modulo
/// their count; else every prefill rank holding part of them (the decode rank gathers). Decode
/// engines dial these (docs/engine-api.md), and a prefill agent counts by it how many decode
/// ranks will ask for a request's KV. Empty when either geometry is invalid.
pub fn prefill_sources(
    prefill_kv: &KvGeometry,
    prefill: &Parallelism,
    decode_kv: &KvGeometry,
    decode: &Parallelism,
    decode_rank: u32,
) -> Vec<u32> {
    use crate::layout::PoolLayout;
    let Ok(d) = PoolLayout::new(decode_kv, decode, 1, decode_rank) else {
        return Vec::new();
    };
    let t_p = u32::try_from(prefill.tensor).ok().filter(|t| *t > 0).unwrap_or(1);
    let ranks: Vec<(u32, u32, u32)> = (0..t_p)
        .filter_map(|r| {
            PoolLayout::new(prefill_kv, prefill, 1, r)
                .ok()
                .map(|p| (r, p.head_offset, p.head_offset + p.local_heads))
        })
        .collect();
    let (d0, d1) = (d.head_offset, d.head_offset + d.local_heads);
    let holders: Vec<u32> = ranks
        .iter()
        .filter(|(_, p0, p1)| *p0 <= d0 && d1 <= *p1)
        .map(|(r, _, _)| *r)
        .collect();
    if !holders.is_empty() {
        return vec![holders[decode_rank as usize % holders.len()]];
    }
    ranks
        .iter()
        .filter(|(_, p0, p1)| *p0 < d1 && d0 < *p1)
        .map(|(r, _, _)| *r)
        .collect()
}

/// How many decode ranks take KV from this prefill rank (see [`prefill_sources`]): a prefill
/// agent serves a ready request to that many registrations before it frees the blocks.
pub fn decode_ranks_served(prefill: &PeerInfo, decode: &PeerInfo) -> u32 {
    let t_d = u32::try_from(decode.parallelism.tensor)
        .ok()
        .filter(|t| *t > 0)
        .unwrap_or(1);
    let n = (0..t_d)
        .filter(|r| {
            prefill_sources(&prefill.kv, &prefill.parallelism, &decode.kv, &decode.parallelism, *r)
                .contains(&prefill.tensor_rank)
        })
        .count();
    u32::try_from(n).unwrap_or(u32::MAX).max(1)
}

fn heads_fit(local: &PeerInfo, peer: &PeerInfo) -> Option<(Vec<Reason>, String)> {
    let (p, d) = match local.role {
        Role::Prefill => (local, peer),
        Role::Decode => (peer, local),
    };
    head_map(p, d).err()
}

/// D's side of the handshake (sealed): send ours, then check P's before using any of it.
pub fn handshake_decode(
    stream: &mut (impl Read + Write),
    session: &mut Session,
    local: &PeerInfo,
) -> Result<PeerInfo, HandshakeError> {
    handshake_decode_by(stream, session, local, |_| Ok(())).map(|(peer, _)| peer)
}

/// [`handshake_decode`], with `admit` asked for room for P's handshake frame before its body is
/// read ([`Session::recv_handshake_by`]; its charges come back with P's handshake).
#[allow(clippy::type_complexity)]
pub fn handshake_decode_by<G>(
    stream: &mut (impl Read + Write),
    session: &mut Session,
    local: &PeerInfo,
    admit: impl FnMut(usize) -> Result<G, String>,
) -> Result<(PeerInfo, (G, Option<G>)), HandshakeError> {
    session.send(stream, &Message::Handshake(Box::new(local.clone())))?;
    let (peer, charged) = match session.recv_handshake_by(stream, admit)? {
        (Message::Handshake(peer), charged) => (*peer, charged),
        (other, _) => return Err(unexpected("Handshake", &other)),
    };
    if let Some((reasons, message)) = refuse(local, &peer) {
        return Err(reject_sealed(stream, session, reasons, message));
    }
    Ok((peer, charged))
}

/// P's side of the handshake (sealed): check D's before answering with ours.
pub fn handshake_prefill(
    stream: &mut (impl Read + Write),
    session: &mut Session,
    local: &PeerInfo,
) -> Result<PeerInfo, HandshakeError> {
    handshake_prefill_vetted(stream, session, local, |_| None, |_| Ok(())).map(|(peer, _)| peer)
}

/// [`handshake_prefill`], with `vet` asked too before P answers (the agent tries D's UCX address
/// in a probe there, so D's heartbeat clock does not start while P is still probing), and
/// `admit` asked for room for D's handshake frame before its body is read
/// ([`Session::recv_handshake_by`]; its charges come back with D's handshake, for the caller to
/// hold while it holds that).
#[allow(clippy::type_complexity)]
pub fn handshake_prefill_vetted<G>(
    stream: &mut (impl Read + Write),
    session: &mut Session,
    local: &PeerInfo,
    vet: impl FnOnce(&PeerInfo) -> Option<(Vec<Reason>, String)>,
    admit: impl FnMut(usize) -> Result<G, String>,
) -> Result<(PeerInfo, (G, Option<G>)), HandshakeError> {
    let (peer, charged) = match session.recv_handshake_by(stream, admit)? {
        (Message::Handshake(peer), charged) => (*peer, charged),
        (other, _) => return Err(unexpected("Handshake", &other)),
    };
    if let Some((reasons, message)) = refuse(local, &peer).or_else(|| vet(&peer)) {
        return Err(reject_sealed(stream, session, reasons, message));
    }
    session.send(stream, &Message::Handshake(Box::new(local.clone())))?;
    Ok((peer, charged))
}

#[cfg(test)]
mod tests;
