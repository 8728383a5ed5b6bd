//! The push protocol's side channel: messages, mutual authentication and the handshake.
//! `docs/protocol.md` is the specification; this module is its implementation.
//!
//! Order on every connection, initiated by the decode (D) agent towards the prefill (P) agent:
//! 1. authentication: `Hello` (D: version, PDPair, nonce) -> `Challenge` (P: nonce, proof) ->
//!    `Proof` (D) -> `AuthOk` (P). Proofs are HMAC-SHA256 over both fresh nonces with the pair's
//!    secret and a role label, so the secret never crosses the wire, a replayed answer fails, and a
//!    proof cannot be reflected. Either side that fails the other sends `Reject{Unauthenticated}`
//!    and closes **before** any geometry, address or memory key is sent;
//! 2. handshake: `Handshake` (D) -> `Handshake` (P). Each side checks the pair with the rule table
//!    (`pdpair_api::check_pools`) before using anything in the peer's message; a failure is a
//!    `Reject` naming the rule reasons, then close.

use std::io::{Read, Write};

use hmac::{Hmac, Mac};
use pdpair_api::{
    ChecksumPolicy, KvGeometry, Parallelism, Role, TransferMode, Verdict, check_pools, checksum::BlockSums, rules::Pool,
};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::wire::{self, FrameError, hex_bytes};

/// The protocol version this agent speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// The reason sent when authentication fails.
pub const UNAUTHENTICATED: &str = "Unauthenticated";
/// The reason sent when the rule table admits a pair this agent cannot serve yet.
pub const AGENT_UNSUPPORTED: &str = "AgentUnsupported";

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
        reason: String,
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
    /// Either way: the connection is refused; then the sender closes.
    Reject {
        /// Stable reasons: `Unauthenticated`, rule-table reasons, or protocol reasons.
        reasons: Vec<String>,
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
}

/// Registered KV memory: per layer a K block array and a V block array inside one region.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryDesc {
    /// Remote address of the region's first byte.
    pub base: u64,
    /// Region length in bytes.
    pub len: u64,
    /// UCX packed remote key of the region.
    #[serde(with = "hex_bytes")]
    pub rkey: Vec<u8>,
    /// Blocks per K (or V) array.
    pub num_blocks: u32,
    /// Bytes of one block of one layer's K (or V).
    pub block_len: u64,
    /// Distance between consecutive blocks.
    pub block_stride: u64,
    /// Offsets of each layer's K array and V array from `base`.
    pub layers: Vec<(u64, u64)>,
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
    /// The peer or we rejected the pair; reasons are stable codes.
    #[error("rejected [{}]: {message}", reasons.join(", "))]
    Rejected {
        /// Stable reasons.
        reasons: Vec<String>,
        /// Detail.
        message: String,
    },
    /// The peer broke the protocol.
    #[error("protocol: {0}")]
    Protocol(String),
}

impl HandshakeError {
    /// The stable reasons for a request that waited on this connection.
    pub fn reasons(&self) -> Vec<String> {
        match self {
            HandshakeError::Unauthenticated(_) => vec![UNAUTHENTICATED.into()],
            HandshakeError::Rejected { reasons, .. } => reasons.clone(),
            HandshakeError::Frame(_) => vec!["HandshakeFailed".into()],
            HandshakeError::Protocol(_) => vec!["ProtocolError".into()],
        }
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

fn reject(stream: &mut (impl Read + Write), reasons: Vec<String>, message: String) -> HandshakeError {
    let _ = wire::write_frame(
        stream,
        &Message::Reject {
            reasons: reasons.clone(),
            message: message.clone(),
        },
    );
    if reasons.iter().any(|r| r == UNAUTHENTICATED) {
        HandshakeError::Unauthenticated(message)
    } else {
        HandshakeError::Rejected { reasons, message }
    }
}

fn unexpected(what: &str, got: &Message) -> HandshakeError {
    match got {
        Message::Reject { reasons, message } if reasons.iter().any(|r| r == UNAUTHENTICATED) => {
            HandshakeError::Unauthenticated(message.clone())
        }
        Message::Reject { reasons, message } => HandshakeError::Rejected {
            reasons: reasons.clone(),
            message: message.clone(),
        },
        other => HandshakeError::Protocol(format!("expected {what}, got {}", kind(other))),
    }
}

fn kind(m: &Message) -> &'static str {
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
    }
}

/// D's side of authentication.
pub fn authenticate_decode(
    stream: &mut (impl Read + Write),
    pdpair: &str,
    secret: &[u8],
) -> Result<(), HandshakeError> {
    let d_nonce = nonce()?;
    wire::write_frame(
        stream,
        &Message::Hello {
            version: PROTOCOL_VERSION,
            pdpair: pdpair.into(),
            nonce: d_nonce.clone(),
        },
    )?;
    let (p_nonce, p_proof) = match wire::read_frame(stream)? {
        Message::Challenge { version, nonce, proof } if version == PROTOCOL_VERSION => (nonce, proof),
        Message::Challenge { version, .. } => {
            return Err(reject(
                stream,
                vec!["VersionMismatch".into()],
                format!("peer speaks version {version}, we speak {PROTOCOL_VERSION}"),
            ));
        }
        other => return Err(unexpected("Challenge", &other)),
    };
    if p_nonce.len() != NONCE_LEN
        || p_nonce == d_nonce
        || !verify(secret, Role::Prefill, pdpair, &d_nonce, &p_nonce, &p_proof)
    {
        return Err(reject(
            stream,
            vec![UNAUTHENTICATED.into()],
            "the prefill agent's proof does not match this PDPair's secret".into(),
        ));
    }
    wire::write_frame(
        stream,
        &Message::Proof {
            proof: proof(secret, Role::Decode, pdpair, &d_nonce, &p_nonce),
        },
    )?;
    match wire::read_frame(stream)? {
        Message::AuthOk => Ok(()),
        other => Err(unexpected("AuthOk", &other)),
    }
}

/// P's side of authentication; `secret_for` maps a PDPair (`namespace/name`) to its secret.
/// Returns the PDPair.
pub fn authenticate_prefill(
    stream: &mut (impl Read + Write),
    secret_for: impl Fn(&str) -> Option<Vec<u8>>,
) -> Result<String, HandshakeError> {
    let (pdpair, d_nonce) = match wire::read_frame(stream)? {
        Message::Hello { version, pdpair, nonce } if version == PROTOCOL_VERSION => (pdpair, nonce),
        Message::Hello { version, .. } => {
            return Err(reject(
                stream,
                vec!["VersionMismatch".into()],
                format!("peer speaks version {version}, we speak {PROTOCOL_VERSION}"),
            ));
        }
        other => return Err(unexpected("Hello", &other)),
    };
    let Some(secret) = secret_for(&pdpair).filter(|_| d_nonce.len() == NONCE_LEN) else {
        return Err(reject(
            stream,
            vec![UNAUTHENTICATED.into()],
            format!("no engine of PDPair {pdpair} is registered here"),
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
    match wire::read_frame(stream)? {
        Message::Proof { proof } if verify(&secret, Role::Decode, &pdpair, &d_nonce, &p_nonce, &proof) => {
            wire::write_frame(stream, &Message::AuthOk)?;
            Ok(pdpair)
        }
        Message::Proof { .. } => Err(reject(
            stream,
            vec![UNAUTHENTICATED.into()],
            "the decode agent's proof does not match this PDPair's secret".into(),
        )),
        other => Err(unexpected("Proof", &other)),
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

fn refuse(local: &PeerInfo, peer: &PeerInfo) -> Option<(Vec<String>, String)> {
    if peer.version != PROTOCOL_VERSION {
        return Some((
            vec!["VersionMismatch".into()],
            format!("peer speaks version {}, we speak {PROTOCOL_VERSION}", peer.version),
        ));
    }
    if peer.pdpair != local.pdpair {
        return Some((
            vec!["PairMismatch".into()],
            format!("peer serves PDPair {}, we serve {}", peer.pdpair, local.pdpair),
        ));
    }
    if peer.role == local.role {
        return Some((vec!["RoleMismatch".into()], format!("both engines are {}", local.role)));
    }
    if (peer.mode, peer.checksum) != (local.mode, local.checksum) {
        return Some((
            vec!["TransferSettingsMismatch".into()],
            format!(
                "peer runs {:?}/{:?}, we run {:?}/{:?}",
                peer.mode, peer.checksum, local.mode, local.checksum
            ),
        ));
    }
    let verdict = check_peer(local, peer);
    if !verdict.allowed() {
        return Some((
            verdict.reasons().iter().map(|r| r.as_str().to_owned()).collect(),
            verdict.to_string(),
        ));
    }
    // Compatible on paper, but beyond what this agent's transfer path does yet: say so at the
    // handshake instead of failing later.
    // Pull converts block sizes (decode reads several prefill blocks into one of its own) and
    // head ranges, not layouts.
    if local.mode == TransferMode::Pull && peer.kv.layout != local.kv.layout {
        return Some((
            vec![AGENT_UNSUPPORTED.into()],
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
pub fn head_map(prefill: &PeerInfo, decode: &PeerInfo) -> Result<HeadMap, (Vec<String>, String)> {
    let layout = |p: &PeerInfo| {
        crate::layout::PoolLayout::new(&p.kv, &p.parallelism, 1, p.tensor_rank)
            .map_err(|e| (vec!["InvalidRequest".to_owned()], e.to_string()))
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
            vec!["WrongTensorRank".into()],
            format!(
                "decode rank {} holds KV heads {d0}..{d1} and prefill rank {} holds {p0}..{p1}: neither contains the other; connect the ranks whose heads line up",
                decode.tensor_rank, prefill.tensor_rank
            ),
        ));
    };
    let partial = map.count != pl.local_heads || map.count != dl.local_heads;
    if partial && (prefill.kv.layout != pdpair_api::KvLayout::Hnd || decode.kv.layout != pdpair_api::KvLayout::Hnd) {
        return Err((
            vec![AGENT_UNSUPPORTED.into()],
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

fn heads_fit(local: &PeerInfo, peer: &PeerInfo) -> Option<(Vec<String>, String)> {
    let (p, d) = match local.role {
        Role::Prefill => (local, peer),
        Role::Decode => (peer, local),
    };
    head_map(p, d).err()
}

/// D's side of the handshake: send ours, then check P's before using any of it.
pub fn handshake_decode(stream: &mut (impl Read + Write), local: &PeerInfo) -> Result<PeerInfo, HandshakeError> {
    wire::write_frame(stream, &Message::Handshake(Box::new(local.clone())))?;
    let peer = match wire::read_frame(stream)? {
        Message::Handshake(peer) => *peer,
        other => return Err(unexpected("Handshake", &other)),
    };
    if let Some((reasons, message)) = refuse(local, &peer) {
        return Err(reject(stream, reasons, message));
    }
    Ok(peer)
}

/// P's side of the handshake: check D's before answering with ours.
pub fn handshake_prefill(stream: &mut (impl Read + Write), local: &PeerInfo) -> Result<PeerInfo, HandshakeError> {
    let peer = match wire::read_frame(stream)? {
        Message::Handshake(peer) => *peer,
        other => return Err(unexpected("Handshake", &other)),
    };
    if let Some((reasons, message)) = refuse(local, &peer) {
        return Err(reject(stream, reasons, message));
    }
    wire::write_frame(stream, &Message::Handshake(Box::new(local.clone())))?;
    Ok(peer)
}

#[cfg(test)]
mod tests;
