//! The engine API: what an engine and its node's agent say over the agent's Unix socket
//! (default `/var/run/pdpair/agent.sock`). Frames are the side channel's: a 4-byte big-endian
//! length, then one JSON message. `docs/engine-api.md` is the specification.

use pdpair_api::{ChecksumPolicy, KvGeometry, Parallelism, Role, TransferMode};
use serde::{Deserialize, Serialize};

/// Default socket path.
pub const DEFAULT_SOCKET: &str = "/var/run/pdpair/agent.sock";
/// The engine API version this agent speaks; `RegisterPool.api_version` must be it.
pub const API_VERSION: u16 = 5;

/// Engine -> agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum EngineRequest {
    /// What this agent can do: answered by [`AgentEvent::Capabilities`]. May come before
    /// `RegisterPool` (at most once; the next message must then be `RegisterPool`) or at any
    /// time after it, so an engine learns whether its GPU pool would be accepted before it
    /// registers one.
    Capabilities,
    /// GPU memory for a GPU pool, shared as VMM allocations (`cuMemCreate` memory, as torch's
    /// `expandable_segments` and other VMM allocators make): this frame carries one POSIX file
    /// descriptor per allocation (`cuMemExportToShareableHandle`; `SCM_RIGHTS`, in order, at most
    /// 128 a frame), and `sizes` says how many bytes of each to map. Only before `RegisterPool`
    /// (after an optional `Capabilities`), as many frames as it takes, at most
    /// [`crate::memory::cuda::MAX_VMM_CHUNKS`] allocations in all. The agent maps them end to end,
    /// in the order shared, into one range; a `gpu.regions` entry without `ipc_handle` lies in it,
    /// `offset` bytes from its start. Unlike an IPC handle, a descriptor is the sender's: the
    /// memory is the registering engine's own, and it works across PID namespaces.
    ShareGpuMemory {
        /// Bytes of each allocation whose descriptor this frame carries, in order.
        sizes: Vec<u64>,
    },
    /// First message on a connection (after an optional `Capabilities` and any
    /// `ShareGpuMemory`): the engine's KV pool.
    RegisterPool(Box<PoolRegistration>),
    /// Decode: KV for this request will come from the prefill engine at `prefill`.
    ExpectKv {
        /// Request id, shared with the prefill engine.
        request: String,
        /// The prefill engine's side-channel address (from its registration).
        prefill: String,
        /// This engine's block ids for the request, in token order.
        blocks: Vec<u32>,
        /// The request's token count.
        num_tokens: u64,
        /// Absolute position of the first token the first block holds (after a prefix-cache hit,
        /// D already has the earlier blocks).
        first_token: u64,
        /// The request's prompt digest ([`PromptDigest`]); absent: none, and the other side's
        /// engine must give none either.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prompt: Option<PromptDigest>,
        /// A GPU pool registered with `gpu.events`: which of them the engine recorded after
        /// its work queued before this request (kernels that may still touch blocks it now gives
        /// to the request); the agent lets nothing write them before it passed. Absent: the
        /// engine waited for that work itself.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event: Option<u32>,
    },
    /// Decode: like `ExpectKv`, from several prefill engines at once: the tensor-parallel ranks
    /// of a prefill pool with more ranks than decode's, each holding part of this decode rank's
    /// KV heads. The request is done when every one of them has written its heads.
    ExpectKvFrom {
        /// Request id.
        request: String,
        /// The prefill engines' side-channel addresses.
        prefills: Vec<String>,
        /// This engine's block ids for the request, in token order.
        blocks: Vec<u32>,
        /// The request's token count.
        num_tokens: u64,
        /// Absolute position of the first token the first block holds.
        first_token: u64,
        /// The request's prompt digest ([`PromptDigest`]); absent: none, and the other side's
        /// engine must give none either.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prompt: Option<PromptDigest>,
        /// As `ExpectKv`'s.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event: Option<u32>,
    },
    /// Decode: this engine needs nothing of `request` from the prefill engine at `prefill`
    /// (a full local prefix hit, or an abort before it asked): prefill frees the request's
    /// blocks at once; neither side counts a failure. Answered by `Released` (or, when prefill
    /// cannot be reached, `RequestFailed`).
    Release {
        /// Request id, shared with the prefill engine.
        request: String,
        /// The prefill engine's side-channel address.
        prefill: String,
        /// More prefill engines released at once (the other ranks of a prefill pool): one
        /// request of the name may be expected at a time, so a release of each rank on its own
        /// was refused after the first. Answered once, when all confirmed.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        prefills: Vec<String>,
        /// The request's prompt digest ([`PromptDigest`]): prefill counts the release only for
        /// the request whose prompt it is (absent: only for one that has none), or whose
        /// `release_token` it names.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prompt: Option<PromptDigest>,
        /// The request's [`ReleaseToken`], from its params, when prefill made one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        release_token: Option<ReleaseToken>,
    },
    /// Decode: this engine queues `request` (it has no blocks for it yet): the prefill engine
    /// at `prefill` holds the request's blocks one more lease from now (at most
    /// `MAX_HOLD_LEASES` leases after its KvReady). Best effort and unanswered: renew more often
    /// than the lease.
    Renew {
        /// Request id, shared with the prefill engine.
        request: String,
        /// The prefill engine's side-channel address.
        prefill: String,
        /// More prefill ranks to renew it at, so a request's every rank goes in one frame (a
        /// frame per rank had a client's params naming 1024 ranks cost decode's engine 1024
        /// frames per queued request and renewal, sent inside its step). With `prefill`, at
        /// most [`MAX_RENEW_PREFILLS`] distinct ones are taken. An agent from before it
        /// ignores it; an engine sends it only where `Capabilities` says `renew_prefills`.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        prefills: Vec<String>,
        /// The request's prompt digest ([`PromptDigest`]): prefill renews only the request
        /// whose prompt it is (absent: only one that has none).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prompt: Option<PromptDigest>,
    },
    /// Decode: like `ExpectKv`, naming every tensor-parallel rank of the prefill pool: the agent
    /// learns each one's rank in its handshake and asks those that hold this decode rank's KV
    /// heads (`protocol::prefill_sources`), so engines need not know the rule.
    ExpectKvFromPool {
        /// Request id, shared with the prefill engines.
        request: String,
        /// The side-channel addresses of the prefill pool's ranks (any order).
        prefill_ranks: Vec<String>,
        /// This engine's block ids for the request, in token order.
        blocks: Vec<u32>,
        /// The request's token count.
        num_tokens: u64,
        /// Absolute position of the first token the first block holds.
        first_token: u64,
        /// The request's prompt digest ([`PromptDigest`]); absent: none, and the other side's
        /// engine must give none either.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prompt: Option<PromptDigest>,
        /// A GPU pool registered with `gpu.events`: which of them the engine recorded after
        /// its work queued before this request (kernels that may still touch blocks it now gives
        /// to the request); the agent lets nothing write them before it passed. Absent: the
        /// engine waited for that work itself.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event: Option<u32>,
    },
    /// Either role: the engine gives up `request` (decode aborted it, or prefill gave up).
    /// Answered by exactly one `Cancelled`, once nothing writes into the request's blocks any
    /// more (decode: every prefill that may be writing has stopped; prefill: its transfers
    /// ended): the engine may reuse the blocks at once. A request with no open promise is
    /// answered at once; a second `Cancel` of the same request gets no second answer.
    Cancel {
        /// Request id.
        request: String,
    },
    /// Prefill: this request's KV is computed and may be sent.
    KvReady {
        /// Request id.
        request: String,
        /// This engine's block ids, in token order.
        blocks: Vec<u32>,
        /// The request's token count.
        num_tokens: u64,
        /// Absolute position of the first token the first block holds.
        first_token: u64,
        /// The request's prompt digest ([`PromptDigest`]); absent: none, and the other side's
        /// engine must give none either.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prompt: Option<PromptDigest>,
        /// A GPU pool registered with `gpu.events`: which of them the engine recorded after this
        /// request's writes (its index); the agent waits for that one before it reads the
        /// request's blocks. Required with `gpu.events`, refused without.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event: Option<u32>,
        /// A secret the engine made for this request and hands only to its decode (in the
        /// request's params): a decode `Release` naming it counts for the request whatever
        /// prompt it names ([`ReleaseToken`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        release_token: Option<ReleaseToken>,
    },
}

/// What a request's KV was computed from: 32 bytes an engine derives from the request's tokens
/// (and whatever else its KV depends on: adapters, images, a cache salt), hex on the wire. The
/// agents compare decode's with prefill's before any KV moves (`Failed{PromptMismatch}`), so a
/// client cannot hand decode the KV of another prompt (docs/engine-api.md says how the vLLM
/// connector derives it; the agent only compares).
#[derive(Clone, PartialEq, Eq)]
pub struct PromptDigest(pub [u8; PromptDigest::LEN]);

impl PromptDigest {
    /// Bytes of a digest.
    pub const LEN: usize = 32;
}

impl std::fmt::Debug for PromptDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PromptDigest({})", crate::wire::hex_bytes::encode(&self.0))
    }
}

impl Serialize for PromptDigest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        crate::wire::hex_bytes::serialize(&self.0, s)
    }
}

impl<'de> Deserialize<'de> for PromptDigest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<PromptDigest, D::Error> {
        hex_32(d, "a prompt digest").map(PromptDigest)
    }
}

/// 32 bytes, hex, of `what`.
fn hex_32<'de, D: serde::Deserializer<'de>>(d: D, what: &str) -> Result<[u8; 32], D::Error> {
    let bytes = crate::wire::hex_bytes::deserialize(d)?;
    let len = bytes.len();
    bytes
        .try_into()
        .map_err(|_| serde::de::Error::custom(format!("{what} is 32 bytes, not {len}")))
}

/// A secret of 32 random bytes a prefill engine makes for a request it offers
/// (`KvReady.release_token`) and hands only to the request's decode, in the request's params
/// (hex on the wire). A decode `Release` naming it counts for the request whatever prompt it
/// names: vLLM's frontend that rejects a request before its engine takes it hands the connector
/// a stand-in of another prompt to end, and prefill then held the request's blocks to its lease.
/// Another decode of the pair, which never saw the params, cannot end the request with it.
#[derive(Clone, PartialEq, Eq)]
pub struct ReleaseToken(pub [u8; 32]);

impl ReleaseToken {
    /// Whether `other` is this token, compared in constant time.
    pub fn matches(&self, other: &ReleaseToken) -> bool {
        self.0.iter().zip(other.0).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

impl std::fmt::Debug for ReleaseToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A secret: never in logs.
        f.write_str("ReleaseToken(..)")
    }
}

impl Serialize for ReleaseToken {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        crate::wire::hex_bytes::serialize(&self.0, s)
    }
}

impl<'de> Deserialize<'de> for ReleaseToken {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ReleaseToken, D::Error> {
        hex_32(d, "a release token").map(ReleaseToken)
    }
}

/// Whether a decode `Release` of `prompt` and `token` counts for a ready request of prompt
/// `ready` and token `ready_token`: its prompt, or its token.
pub fn release_counts(
    prompt: Option<&PromptDigest>,
    token: Option<&ReleaseToken>,
    ready: Option<&PromptDigest>,
    ready_token: Option<&ReleaseToken>,
) -> bool {
    check_prompt(prompt, ready).is_ok() || matches!((token, ready_token), (Some(t), Some(r)) if t.matches(r))
}

/// Whether decode's and prefill's prompt digests let KV move between them: equal, or neither
/// given (engines that do not derive one). One without the other is refused: an engine that
/// binds its KV to its prompt must not have that skipped by a peer that does not.
pub fn check_prompt(decode: Option<&PromptDigest>, prefill: Option<&PromptDigest>) -> Result<(), String> {
    match (decode, prefill) {
        (None, None) => Ok(()),
        (Some(d), Some(p)) if d == p => Ok(()),
        // Neither digest in the message: prefill's would let whoever reads decode's logs test a
        // guessed prompt against it.
        (Some(_), Some(_)) => Err("decode's prompt is not the one prefill computed the KV of".into()),
        (Some(_), None) => Err("decode gave a prompt digest and prefill gave none".into()),
        (None, Some(_)) => Err("prefill gave a prompt digest and decode gave none".into()),
    }
}

/// Bytes of a request id, at most (engines' and peers'): ids are kept while their requests
/// live, and a frame may carry megabytes. vLLM's are tens of bytes.
pub const MAX_REQUEST_ID: usize = 512;

impl EngineRequest {
    /// The request it is about, for those about one.
    pub fn request_id(&self) -> Option<&str> {
        match self {
            EngineRequest::ExpectKv { request, .. }
            | EngineRequest::ExpectKvFrom { request, .. }
            | EngineRequest::Release { request, .. }
            | EngineRequest::Renew { request, .. }
            | EngineRequest::ExpectKvFromPool { request, .. }
            | EngineRequest::Cancel { request }
            | EngineRequest::KvReady { request, .. } => Some(request),
            EngineRequest::Capabilities | EngineRequest::ShareGpuMemory { .. } | EngineRequest::RegisterPool(_) => None,
        }
    }
}

/// The most prefill ranks one `Renew` renews a request at (its `prefill` and `prefills`,
/// distinct), as many as a request's `ExpectKvFromPool` may name.
pub const MAX_RENEW_PREFILLS: usize = 1024;

/// A request id longer than [`MAX_REQUEST_ID`] is refused, saying so.
pub fn check_request_id(request: &str) -> Result<(), String> {
    if request.len() > MAX_REQUEST_ID {
        return Err(format!(
            "request ids are at most {MAX_REQUEST_ID} bytes; this one has {}",
            request.len()
        ));
    }
    Ok(())
}

/// An engine's KV pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolRegistration {
    /// The engine API version the engine speaks ([`API_VERSION`]); another (or none) is refused.
    #[serde(default)]
    pub api_version: u16,
    /// `namespace/name` of the PDPair.
    pub pdpair: String,
    /// The engine's role.
    pub role: Role,
    /// Engine instance id (unique on the node).
    pub engine: String,
    /// The engine's Pod, when it runs in Kubernetes.
    #[serde(default)]
    pub pod: Option<String>,
    /// Transfer mode. Absent: the PDPair's (when the agent can read it); present: must match it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<TransferMode>,
    /// Checksum policy (absent: the PDPair's; present: must match it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<ChecksumPolicy>,
    /// How long to wait for a peer's handshake, in milliseconds (absent: the PDPair's
    /// `handshakeTimeout`; present: must match it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handshake_timeout_ms: Option<u64>,
    /// How long prefill holds a request's blocks for decode, in milliseconds (absent: the
    /// PDPair's `leaseDuration`; present: must match it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// The engine's parallelism.
    pub parallelism: Parallelism,
    /// The engine's KV geometry.
    pub kv: KvGeometry,
    /// The PDPair's pairing secret (the file at `PDPAIR_PAIRING_KEY_FILE`), hex.
    pub pairing_key: String,
    /// The engine brings its own pool: the `RegisterPool` frame carries one memfd per region
    /// (`SCM_RIGHTS`, in region order), each sealed against shrinking (`F_SEAL_SHRINK`) and
    /// holding its whole region. False: the agent allocates the regions and passes their
    /// descriptors with `Registered`.
    #[serde(default)]
    pub memory_fd: bool,
    /// No longer accepted (a path is opened by the agent, as root, wherever it points): a
    /// registration that names one is refused. Pass a sealed memfd with `memory_fd` instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_path: Option<String>,
    /// Blocks per K (or V) array.
    pub num_blocks: u32,
    /// The engine's tensor-parallel rank (each rank registers as its own engine).
    #[serde(default)]
    pub tensor_rank: u32,
    /// The engine instance this rank is one of: every tensor-parallel rank of one engine in its
    /// Pod names the same, and no other engine of the Pod does (the vLLM connector: `<pod>-<engine_id>`,
    /// each data-parallel rank its own). Published in the PDEndpoint (`spec.instance`), so the
    /// operator tells which engine of a Pod is short of a rank. At most [`MAX_ENGINE_NAME`]
    /// bytes, no control characters. Absent: the Pod's ranks are counted together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// How many engines the engine's Pod runs (vLLM: the ranks of an MoE model's data-parallel
    /// group in the Pod, `data_parallel_size_local`): 1 to [`pdpair_api::MAX_POD_ENGINES`], and
    /// no more than `parallelism.data`. Published in the PDEndpoint (`spec.podEngines`), so the operator
    /// tells a Pod missing a whole engine (with `instance`). Absent: not counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_engines: Option<u32>,
    /// Where each layer's K and V blocks are in a one-region pool (absent: `KvFirst`, a K array
    /// then a V array, or `Latent` for an MLA cache; `BlocksFirst`: each block's K then its V, as
    /// FlashInfer lays out its cache). With `regions`, each region says its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_arrangement: Option<crate::layout::KvArrangement>,
    /// The pool's memory regions, in layer order (absent or empty: one region of every layer):
    /// vLLM's per-layer KV tensors are one region each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub regions: Vec<RegionRequest>,
    /// The pool is GPU memory the engine shares (absent: host memory, `memory_fd` or the
    /// agent's). Only where `Capabilities` lists `cuda` in `pool_memory`; otherwise refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuPool>,
    /// Why the engine registers a host pool and stages its KV through it (its KV cache is on a
    /// GPU the agent does not take, say), in its own words: published in its PDEndpoint
    /// (`spec.staging`). At most [`MAX_STAGING`] bytes; not with `gpu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging: Option<String>,
    /// Prefill: the side-channel address this engine had before, when it registers again with
    /// its restarted agent: the agent listens there again where it can (its own host, a
    /// side-channel port: of `--side-channel-ports` where set, else of the kernel's ephemeral
    /// range; free), so the addresses decode engines were handed stay
    /// good; else at a new one (`Registered.address` says which).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<std::net::SocketAddr>,
}

/// Bytes of one frame an engine sends before it registers, at most (its `Capabilities`,
/// `ShareGpuMemory` and `RegisterPool`: the largest registration, 128 GPU regions with their IPC
/// handles and names at their Kubernetes bounds, is under 40 KiB). A longer one is refused from
/// its length, before a byte of it is read: 64 unregistered connections may hold 4 MiB in all,
/// not the 1 GiB of 16 MiB frames.
pub const MAX_REGISTRATION_FRAME: usize = 64 << 10;

/// Bytes of one frame a registered engine of `num_blocks` blocks may send, at most: every block
/// id of its pool (a request's blocks are distinct and in the pool; 12 bytes each: ten digits and
/// `, `), 1024 prefill addresses, its request id and the rest, and never over
/// [`crate::wire::MAX_FRAME`]. A longer one ends the connection (it names no request to refuse).
pub fn max_request_frame(num_blocks: u32) -> usize {
    (128usize << 10)
        .saturating_add(12usize.saturating_mul(num_blocks as usize))
        .min(crate::wire::MAX_FRAME)
}

/// Decodes a frame an engine sent before it registered, naming what is wrong: a `RegisterPool`
/// that does not decode is refused naming the field and why (`kv.dtype: unknown variant ...`),
/// so `RegistrationFailed` tells the engine what to fix instead of the connection just closing.
pub fn decode_before_registration(frame: serde_json::Value) -> Result<EngineRequest, String> {
    if frame.get("type").and_then(serde_json::Value::as_str) == Some("RegisterPool") {
        return serde_path_to_error::deserialize::<_, PoolRegistration>(&frame)
            .map(|reg| EngineRequest::RegisterPool(Box::new(reg)))
            .map_err(|e| {
                let path = e.path().to_string();
                crate::reason::peer_text(&match path.as_str() {
                    "." => format!("RegisterPool: {}", e.inner()),
                    _ => format!("RegisterPool field {path}: {}", e.inner()),
                })
            });
    }
    serde_json::from_value(frame).map_err(|e| crate::reason::peer_text(&format!("malformed message: {e}")))
}

/// JSON values (numbers, strings, arrays, objects...) one frame of a registered engine of
/// `num_blocks` blocks may hold, at most: every block id of its pool, and room for the rest (1024
/// prefill addresses, a prompt digest, the fields). Decoding holds each value of a frame at once
/// (32 bytes or so, serde's buffer for an internally tagged enum): a frame of 8M zeros in a
/// field no message has, 16 MiB of text, took over 500 MiB of the agent's memory to decode. And
/// never more than [`crate::frame_budget::MAX_VALUES`] (786432), what the agent's room for
/// engines' frames holds: `num_blocks` is the engine's to choose.
pub fn max_request_values(num_blocks: u32) -> usize {
    (num_blocks as usize)
        .saturating_add(16384)
        .min(crate::frame_budget::MAX_VALUES)
}

/// Decodes a registered engine's frame of at most `max_values` JSON values
/// ([`max_request_values`]), counted first in one pass that keeps none of them; `room` is given
/// the bytes decoding will hold at most ([`crate::frame_budget::cost`]) and what it returns is
/// held while the frame decodes. Err: the request it names,
/// when it names one as a string, and what is wrong (cut and escaped).
pub fn decode_request<G>(
    frame: &[u8],
    max_values: usize,
    room: impl FnOnce(usize) -> Result<G, String>,
) -> Result<EngineRequest, (Option<String>, String)> {
    let head = scan::head(frame).map_err(|e| (None, crate::reason::peer_text(&format!("malformed message: {e}"))))?;
    let kind = head.kind.as_deref().unwrap_or("message");
    if head.values > max_values {
        let why = format!(
            "{kind} holds {} JSON values; at most {max_values} (every block of the pool, and room for the rest)",
            head.values
        );
        return Err((head.request, why));
    }
    let _room = room(crate::frame_budget::cost(frame.len(), head.values)).map_err(|why| (head.request.clone(), why))?;
    serde_json::from_slice(frame).map_err(|e| {
        (
            head.request.clone(),
            crate::reason::peer_text(&format!("malformed {kind}: {e}")),
        )
    })
}

/// One pass over a frame that keeps none of its values: its `type`, its `request` and how many
/// values it holds.
mod scan {
    use std::{cell::Cell, fmt};

    use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

    use crate::wire::Count;

    #[derive(Debug, Default)]
    pub struct Head {
        pub kind: Option<String>,
        pub request: Option<String>,
        pub values: usize,
    }

    pub fn head(frame: &[u8]) -> Result<Head, serde_json::Error> {
        let values = Cell::new(0);
        let mut d = serde_json::Deserializer::from_slice(frame);
        let (kind, request) = d.deserialize_map(Top(&values))?;
        d.end()?;
        Ok(Head {
            kind,
            request,
            values: values.get(),
        })
    }

    /// A top-level key: the two read, or another.
    enum Key {
        Type,
        Request,
        Other,
    }

    impl<'de> de::Deserialize<'de> for Key {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
            struct V;
            impl Visitor<'_> for V {
                type Value = Key;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a field name")
                }
                fn visit_str<E>(self, k: &str) -> Result<Key, E> {
                    Ok(match k {
                        "type" => Key::Type,
                        "request" => Key::Request,
                        _ => Key::Other,
                    })
                }
            }
            d.deserialize_identifier(V)
        }
    }

    /// A string kept (and counted); any other value only counted.
    struct Text<'a>(Count<'a>);

    impl<'de> DeserializeSeed<'de> for Text<'_> {
        type Value = Option<String>;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Text<'_> {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_str<E>(self, s: &str) -> Result<Option<String>, E> {
            self.0.one();
            Ok(Some(s.to_owned()))
        }
        fn visit_bool<E>(self, _: bool) -> Result<Option<String>, E> {
            self.0.one();
            Ok(None)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Option<String>, E> {
            self.0.one();
            Ok(None)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Option<String>, E> {
            self.0.one();
            Ok(None)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Option<String>, E> {
            self.0.one();
            Ok(None)
        }
        fn visit_unit<E>(self) -> Result<Option<String>, E> {
            self.0.one();
            Ok(None)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Option<String>, A::Error> {
            self.0.visit_seq(seq).map(|()| None)
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Option<String>, A::Error> {
            self.0.visit_map(map).map(|()| None)
        }
    }

    /// The frame's object: its `type` and `request` where they are strings (the last of each,
    /// as serde takes them), everything counted.
    struct Top<'a>(&'a Cell<usize>);

    impl<'de> Visitor<'de> for Top<'_> {
        type Value = (Option<String>, Option<String>);
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let count = Count(self.0);
            count.one();
            let (mut kind, mut request) = (None, None);
            while let Some(key) = map.next_key::<Key>()? {
                match key {
                    Key::Type => kind = map.next_value_seed(Text(count))?,
                    Key::Request => request = map.next_value_seed(Text(count))?,
                    Key::Other => map.next_value_seed(count)?,
                }
            }
            Ok((kind, request))
        }
    }
}

/// Checks one `ShareGpuMemory` frame before its descriptors are kept: one size per descriptor,
/// at least one, and at most [`crate::memory::cuda::MAX_VMM_CHUNKS`] allocations with the
/// `before` shared already (each size is checked against the GPU's granularity when mapped).
pub fn check_share(sizes: &[u64], fds: usize, before: usize) -> Result<(), String> {
    if sizes.len() != fds || fds == 0 {
        return Err(format!(
            "ShareGpuMemory names {} sizes and carried {fds} file descriptors (one per size, at least one)",
            sizes.len()
        ));
    }
    let max = crate::memory::cuda::MAX_VMM_CHUNKS;
    if before + fds > max {
        return Err(format!(
            "ShareGpuMemory: {} GPU allocations shared in all; at most {max}",
            before + fds
        ));
    }
    Ok(())
}

/// The longest `staging` a registration may give.
pub const MAX_STAGING: usize = 1024;

/// The longest `engine` a registration may give (a Kubernetes object name's bound): names are
/// kept in the side-channel claims record, whose size is bounded, and in every log line.
pub const MAX_ENGINE_NAME: usize = 253;

/// `name` where it is within [`MAX_ENGINE_NAME`] bytes, else its start and a hash of the whole
/// (names that differ past the cut stay apart), as the vLLM connector names its ranks.
pub fn engine_name_within(name: String) -> String {
    use sha2::Digest;
    if name.len() <= MAX_ENGINE_NAME {
        return name;
    }
    let digest = sha2::Sha256::digest(name.as_bytes());
    let tail: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let mut cut = MAX_ENGINE_NAME - tail.len() - 1;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}-{tail}", &name[..cut])
}

/// The longest `pdpair` a registration may give: `namespace/name`, each a DNS label.
pub const MAX_PDPAIR_NAME: usize = 63 + 1 + 63;

/// A pool in GPU memory: each region lies in a CUDA allocation the engine shares by IPC handle,
/// or in the VMM allocations it shared with `ShareGpuMemory`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPool {
    /// The GPU's UUID (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` as `nvidia-smi -L` prints it,
    /// or torch's spelling without `GPU-`): device numbers differ between the engine's container
    /// and the agent's.
    pub device_uuid: String,
    /// One per region of the pool, in order.
    pub regions: Vec<GpuRegion>,
    /// An interprocess CUDA event (`cuIpcGetEventHandle` of an event made with
    /// `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`, hex of its 64 bytes) the engine
    /// records on the stream that wrote the KV before each `KvReady` (prefill): copies and
    /// checksums start only after the event's latest record has passed. Absent (and no
    /// `events`): the engine synchronizes its stream before each `KvReady`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<String>,
    /// At most [`MAX_ENGINE_EVENTS`] such events (only with `event`). A prefill engine records
    /// the next after each request's writes and names it in that `KvReady`: the agent waits for
    /// that one, not for `event`, whose latest record may follow later requests' work (a prefill
    /// engine records again after every forward pass: waiting for its latest record held a
    /// request back by the passes after its own). An agent from before them ignores them and
    /// waits for `event`, so an engine records both. A decode engine records the next before
    /// new receives and names it in their `ExpectKv`: nothing writes their blocks before it
    /// passed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<String>,
}

/// The most events a GPU pool registers (`gpu.events`).
pub const MAX_ENGINE_EVENTS: usize = 64;

/// Where one region of a GPU pool is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRegion {
    /// `cuIpcGetMemHandle` of the allocation that holds the region (`cudaMalloc` memory, as
    /// torch's caching allocator makes; not the stream-ordered allocator's), hex of its 64 bytes.
    /// Absent: the region lies in the VMM memory shared with `ShareGpuMemory`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipc_handle: Option<String>,
    /// Bytes from the start of that allocation to the region (torch's storage offset); without
    /// `ipc_handle`, from the start of the shared VMM memory (its allocations end to end).
    #[serde(default)]
    pub offset: u64,
}

impl GpuPool {
    /// Checks the fields against a pool of `regions` regions and the `shared` VMM allocations
    /// (`ShareGpuMemory`), naming the field and value that is wrong: a UUID, for each region a
    /// well-formed 64-byte handle or shared memory to lie in, offsets that do not wrap, shared
    /// memory only where a region lies in it, a well-formed event handle, and no `memory_fd`
    /// beside it.
    pub fn check(&self, regions: usize, memory_fd: bool, shared: usize) -> Result<(), String> {
        if memory_fd {
            return Err("gpu and memory_fd are both set: a GPU pool's regions are CUDA IPC handles, not memfds".into());
        }
        crate::memory::cuda::normalize_uuid(&self.device_uuid).map_err(|e| format!("gpu.device_uuid: {e}"))?;
        if self.regions.len() != regions {
            return Err(format!(
                "gpu.regions has {} entries; the pool has {regions} regions (one per region, in order)",
                self.regions.len()
            ));
        }
        for (i, r) in self.regions.iter().enumerate() {
            match &r.ipc_handle {
                Some(h) => {
                    crate::memory::cuda::IpcHandle::from_hex(h)
                        .map_err(|e| format!("gpu.regions[{i}].ipc_handle: {e}"))?;
                }
                None if shared == 0 => {
                    return Err(format!(
                        "gpu.regions[{i}] has no ipc_handle, and no GPU memory was shared (ShareGpuMemory) for it to lie in"
                    ));
                }
                None => {}
            }
            if r.offset > i64::MAX as u64 {
                return Err(format!("gpu.regions[{i}].offset {} is out of range", r.offset));
            }
        }
        if shared > 0 && self.regions.iter().all(|r| r.ipc_handle.is_some()) {
            return Err(format!(
                "{shared} GPU allocations were shared (ShareGpuMemory), but every gpu.regions entry names an ipc_handle"
            ));
        }
        if let Some(event) = &self.event {
            crate::memory::cuda::IpcHandle::from_hex(event).map_err(|e| format!("gpu.event: {e}"))?;
        }
        if !self.events.is_empty() && self.event.is_none() {
            return Err(
                "gpu.events without gpu.event: an agent from before gpu.events waits only for gpu.event, and would read the pool without waiting for the engine's writes"
                    .into(),
            );
        }
        if self.events.len() > MAX_ENGINE_EVENTS {
            return Err(format!(
                "gpu.events has {} entries; at most {MAX_ENGINE_EVENTS}",
                self.events.len()
            ));
        }
        for (i, event) in self.events.iter().enumerate() {
            crate::memory::cuda::IpcHandle::from_hex(event).map_err(|e| format!("gpu.events[{i}]: {e}"))?;
        }
        Ok(())
    }
}

/// A GPU the agent sees.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// Canonical UUID (`GPU-...`).
    pub uuid: String,
    /// Name.
    pub name: String,
}

/// One memory region of a pool: the next `layers` layers, arranged as `kv_arrangement`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionRequest {
    /// Layers the region holds (the layers after the previous region's).
    pub layers: u32,
    /// How they are arranged (absent: `KvFirst`, or `Latent` for an MLA cache).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_arrangement: Option<crate::layout::KvArrangement>,
    /// `Interleaved` only: bytes from one layer's block 0 to the next layer's (absent:
    /// `num_blocks x block_stride`, layers outermost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_stride: Option<u64>,
    /// `Interleaved` only: bytes from one block to the next (absent: a block's K and V, dense).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_stride: Option<u64>,
}

impl PoolRegistration {
    /// Checks `address`: only a prefill engine has one.
    pub fn check_address(&self) -> Result<(), String> {
        match (self.address, self.role) {
            (Some(a), Role::Decode) => Err(format!(
                "address is {a}, but a decode engine has no side-channel address (prefill engines listen; decode engines dial)"
            )),
            _ => Ok(()),
        }
    }

    /// Checks `engine`, `pdpair` and `instance`: not empty, and no longer than their bounds
    /// (`instance` without control characters); `pod_engines` within its bounds; and the
    /// geometry's names no longer than the PDEndpoint the agent publishes for the engine takes
    /// (the API server refuses more).
    pub fn check_names(&self) -> Result<(), String> {
        for (field, value, max) in [
            ("engine", Some(&self.engine), MAX_ENGINE_NAME),
            ("pdpair", Some(&self.pdpair), MAX_PDPAIR_NAME),
            ("instance", self.instance.as_ref(), MAX_ENGINE_NAME),
        ] {
            if let Some(value) = value
                && (value.is_empty() || value.len() > max)
            {
                return Err(format!("{field} is {} bytes; 1..={max} are accepted", value.len()));
            }
        }
        // Published as it is (spec.instance): no control characters for a terminal to act on.
        if let Some(c) = self.instance.iter().flat_map(|i| i.chars()).find(|c| c.is_control()) {
            return Err(format!("instance holds the control character {:?}", c));
        }
        if let Some(n) = self.pod_engines {
            // The engines of a Pod are some of the engine's data-parallel ranks.
            let max = pdpair_api::MAX_POD_ENGINES.min(self.parallelism.data.max(1));
            if !i32::try_from(n).is_ok_and(|n| (1..=max).contains(&n)) {
                return Err(format!(
                    "pod_engines is {n}; 1..={max} are accepted (parallelism.data is {})",
                    self.parallelism.data
                ));
            }
        }
        let kv = &self.kv;
        for (field, value, max) in [
            ("kv.engine", Some(&kv.engine), pdpair_api::MAX_KV_NAME),
            ("kv.engineVersion", kv.engine_version.as_ref(), pdpair_api::MAX_KV_NAME),
            ("kv.model", Some(&kv.model), pdpair_api::MAX_MODEL),
            (
                "kv.attentionBackend",
                Some(&kv.attention_backend),
                pdpair_api::MAX_KV_NAME,
            ),
        ] {
            let chars = value.map_or(0, |v| v.chars().count());
            if chars > max {
                return Err(format!("{field} is {chars} characters; at most {max}"));
            }
        }
        Ok(())
    }

    /// Checks `staging`: short, and only for a host pool.
    pub fn check_staging(&self) -> Result<(), String> {
        match &self.staging {
            Some(s) if s.len() > MAX_STAGING => Err(format!("staging is {} bytes; at most {MAX_STAGING}", s.len())),
            Some(_) if self.gpu.is_some() => Err(
                "staging and gpu are both set: a GPU pool is the engine's KV cache itself, nothing is staged".into(),
            ),
            _ => Ok(()),
        }
    }

    /// The pool's layout: its geometry, split into the regions it names.
    pub fn layout(&self) -> Result<crate::layout::PoolLayout, crate::layout::LayoutError> {
        let layout = crate::layout::PoolLayout::new(&self.kv, &self.parallelism, self.num_blocks, self.tensor_rank)?;
        if self.regions.is_empty() {
            let arrangement = self
                .kv_arrangement
                .unwrap_or(crate::layout::default_arrangement(layout.latent));
            crate::layout::check_arrangement(layout.latent, arrangement, "kv_arrangement")?;
            return Ok(layout.arranged(arrangement));
        }
        if self.kv_arrangement.is_some() {
            return Err(crate::layout::LayoutError(
                "kv_arrangement and regions are both set: with regions, each region names its kv_arrangement".into(),
            ));
        }
        let spec: Vec<_> = self
            .regions
            .iter()
            .map(|r| crate::layout::RegionSpec {
                layers: r.layers,
                arrangement: r.kv_arrangement,
                strides: (r.layer_stride.is_some() || r.block_stride.is_some())
                    .then_some((r.layer_stride, r.block_stride)),
            })
            .collect();
        layout.with_region_specs(&spec)
    }
}

/// Agent -> engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum AgentEvent {
    /// The answer to `Capabilities`.
    Capabilities {
        /// The engine API version this agent speaks.
        api_version: u16,
        /// Agent identity.
        agent: String,
        /// The UCX the agent loaded.
        ucx_version: String,
        /// The memory types that UCX registers and moves (`host`, `cuda`, ...): `cuda` only
        /// where it has its CUDA module.
        ucx_memory_types: Vec<String>,
        /// The GPUs the agent's CUDA driver shows it (empty without one).
        gpus: Vec<GpuInfo>,
        /// The pool memory `RegisterPool` accepts: `host` (a memfd or the agent's memory), and
        /// `cuda` where GPU pools are served.
        pool_memory: Vec<String>,
        /// Why GPU pools are not accepted, when they are not.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gpu_pools_refused: Option<String>,
        /// Whether a GPU pool here reaches engines behind other agents: where this agent runs a
        /// KV stream (GPU KV staged through host memory); not where it moves KV over UCX (RDMA
        /// carries host pools only in this version), so an engine whose peers are on other nodes
        /// registers a host pool there.
        #[serde(default)]
        gpu_between_agents: bool,
        /// How a GPU pool's memory may be shared, where GPU pools are accepted: `ipc_handle`
        /// (`gpu.regions[].ipc_handle`, `cudaMalloc` memory) and `vmm_fd` (`ShareGpuMemory`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        gpu_sharing: Vec<String>,
        /// Whether a GPU pool's `gpu.events` are taken, and the `event` a `KvReady` or an
        /// `ExpectKv` names waited for. An agent from before them answers without this field and
        /// ignores both: an engine must then not rely on them (a decode engine synchronizes
        /// before new receives; a prefill's `gpu.event` is still waited for).
        #[serde(default)]
        gpu_events: bool,
        /// Whether a `Renew` takes `prefills` (every rank of a request in one frame). An agent
        /// from before it answers without this field: an engine then sends a `Renew` per rank.
        #[serde(default)]
        renew_prefills: bool,
    },
    /// The pool is registered; peers reach this engine at `address`.
    Registered {
        /// Side-channel address (prefill engines listen); empty for decode engines, which
        /// connect out.
        address: String,
        /// Agent identity.
        agent: String,
        /// Bytes of the pool, all regions. When the agent allocated it (`memory_fd` was false),
        /// this frame carries one descriptor per region (`SCM_RIGHTS`, in order): the engine maps
        /// each, whole, shared.
        memory_len: u64,
        /// Bytes of each region, in order.
        #[serde(default)]
        region_lens: Vec<u64>,
        /// The settings the engine runs under (its own, or the PDPair's where it left them
        /// out): how long a peer's handshake may take and how long prefill holds KV, in
        /// milliseconds. Together they bound how long the agent's transfers of a request may
        /// run, which an engine that loses its agent connection waits out before it reuses
        /// memory the agent writes in place.
        #[serde(default)]
        handshake_timeout_ms: u64,
        /// See `handshake_timeout_ms`.
        #[serde(default)]
        lease_ms: u64,
        /// The longest a prefill engine's request's blocks are held after its `KvReady`,
        /// renewals included, in milliseconds (the lease, `MAX_HOLD_LEASES` + 1 times: a `Renew`
        /// is taken up to `MAX_HOLD_LEASES` leases after the `KvReady`, and holds one lease
        /// more). A decode engine that queues a request longer than that has nothing left to
        /// renew. 0 from agents before it.
        #[serde(default)]
        hold_ms: u64,
    },
    /// The registration was refused; the agent closes the connection.
    RegistrationFailed {
        /// Why.
        message: String,
        /// The refusal is one of the agent's bounds on what it holds at once (engines
        /// registered, GPU memory descriptors of registrations in progress), which frees as
        /// other engines go or finish registering: the same registration may succeed later,
        /// and an engine should try it again then rather than take the refusal as final (the
        /// vLLM connector's direct path staged through host memory for good). Absent (false)
        /// for a refusal of what the registration says, which trying again does not mend.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        busy: bool,
    },
    /// Prefill: the request's WRITEs were posted.
    TransferStarted {
        /// Request id.
        request: String,
    },
    /// The request's KV moved (decode: received and verified per policy; prefill: written).
    RequestDone {
        /// Request id.
        request: String,
        /// Bytes moved.
        bytes: u64,
        /// Checksum outcome on decode: Verified, Mismatched (FailOpen), Unverified (FailOpen),
        /// or absent when checksums are Disabled.
        checksum: Option<String>,
        /// Prefill: microseconds from posting the WRITEs to their flush.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        transfer_us: Option<u64>,
    },
    /// The request was released: decode needed nothing (decode: prefill confirmed it;
    /// prefill: its blocks are free). Not a failure.
    Released {
        /// Request id.
        request: String,
    },
    /// The answer to `Cancel`: nothing writes into the request's blocks any more (and, on
    /// prefill, nothing reads them). It replaces the request's `RequestDone`/`RequestFailed`
    /// when it was still open.
    Cancelled {
        /// Request id.
        request: String,
    },
    /// The request failed; nothing more will happen for it.
    RequestFailed {
        /// Request id.
        request: String,
        /// Stable reasons: rule-table reasons, Unauthenticated, PeerLost, DeadlineExceeded,
        /// LeaseExpired, ChecksumMismatch, ChecksumUnverified, TokenRangeNotCovered, ...
        reasons: Vec<String>,
        /// Detail.
        message: String,
    },
}

/// An engine's transfer settings, resolved: from the registration, checked against (or filled
/// from) the PDPair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Transfer mode.
    pub mode: TransferMode,
    /// Checksum policy.
    pub checksum: ChecksumPolicy,
    /// Milliseconds to wait for a peer's handshake.
    pub handshake_timeout_ms: u64,
    /// Milliseconds prefill holds a request's blocks.
    pub lease_ms: u64,
}

/// Resolves a registration's transfer settings. With the PDPair's `transfer` (`pair`, named for
/// messages), each absent field takes the PDPair's value and a present one must equal it; without
/// it (the agent cannot read the API) every field is required. `Err` names the field and values.
pub fn resolve(reg: &PoolRegistration, pair: Option<(&str, &pdpair_api::TransferSpec)>) -> Result<Settings, String> {
    if reg.api_version != API_VERSION {
        return Err(format!(
            "api_version {} is not spoken here: this agent speaks engine API version {API_VERSION}{}",
            reg.api_version,
            if reg.api_version == 0 {
                " (the registration names none)"
            } else {
                ""
            }
        ));
    }
    fn pick<T: PartialEq + std::fmt::Debug + Copy>(
        field: &str,
        given: Option<T>,
        pair: Option<(&str, T)>,
    ) -> Result<T, String> {
        match (given, pair) {
            (Some(v), Some((name, p))) if v != p => Err(format!(
                "{field}: the registration says {v:?}, PDPair {name} says {p:?}"
            )),
            (Some(v), _) => Ok(v),
            (None, Some((_, p))) => Ok(p),
            (None, None) => Err(format!(
                "{field} is required: the agent cannot read the PDPair to fill it in"
            )),
        }
    }
    let ms = |d: &pdpair_api::Duration| u64::try_from(d.get().as_millis()).unwrap_or(u64::MAX);
    let settings = Settings {
        mode: pick("mode", reg.mode, pair.map(|(n, t)| (n, t.mode)))?,
        checksum: pick("checksum", reg.checksum, pair.map(|(n, t)| (n, t.checksum)))?,
        handshake_timeout_ms: pick(
            "handshake_timeout_ms",
            reg.handshake_timeout_ms,
            pair.map(|(n, t)| (n, ms(&t.handshake_timeout))),
        )?,
        lease_ms: pick("lease_ms", reg.lease_ms, pair.map(|(n, t)| (n, ms(&t.lease_duration))))?,
    };
    for (field, v) in [
        ("handshake_timeout_ms", settings.handshake_timeout_ms),
        ("lease_ms", settings.lease_ms),
    ] {
        if v == 0 || v > 3_600_000 {
            return Err(format!("{field} is {v}; it must be 1..=3600000"));
        }
    }
    Ok(settings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_frames_an_engine_needs_fit_their_bounds() {
        // A registration at every bound: 128 regions, each a GPU allocation with its IPC
        // handle, 64 events, names as long as Kubernetes allows, a staging note at its bound.
        let name = "n".repeat(253);
        let mut r = reg();
        r.pdpair = format!("{}/{name}", "s".repeat(63));
        (r.engine, r.pod) = (name.clone(), Some(name.clone()));
        r.kv.model = "m".repeat(1024);
        r.pairing_key = "6b".repeat(64);
        r.regions = (0..crate::layout::MAX_REGIONS)
            .map(|_| RegionRequest {
                layers: u32::MAX,
                kv_arrangement: Some(crate::layout::KvArrangement::BlocksFirst),
                layer_stride: Some(u64::MAX),
                block_stride: Some(u64::MAX),
            })
            .collect();
        r.gpu = Some(GpuPool {
            device_uuid: "GPU-5f1c2a3b-0d4e-4f60-8a9b-0c1d2e3f4a5b".into(),
            regions: (0..crate::layout::MAX_REGIONS)
                .map(|_| GpuRegion {
                    ipc_handle: Some("ab".repeat(64)),
                    offset: u64::MAX,
                })
                .collect(),
            event: Some("cd".repeat(64)),
            events: vec!["ef".repeat(64); MAX_ENGINE_EVENTS],
        });
        r.address = Some(
            "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535"
                .parse()
                .expect("address"),
        );
        let frame = serde_json::to_vec(&EngineRequest::RegisterPool(Box::new(r))).expect("json");
        assert!(frame.len() < 56 << 10, "{} bytes", frame.len());
        assert!(frame.len() < MAX_REGISTRATION_FRAME);
        // A request naming every block of a pool (the largest ids), 1024 prefill addresses,
        // spaced as Python's json.dumps spaces them.
        for num_blocks in [1u32, 64, 1 << 20] {
            let request = serde_json::json!({
                "type": "ExpectKvFromPool",
                "request": "r".repeat(MAX_REQUEST_ID),
                "prefill_ranks": vec!["[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535"; 1024],
                "blocks": vec![num_blocks - 1; num_blocks as usize],
                "num_tokens": u64::MAX,
                "first_token": u64::MAX,
                "prompt": "ab".repeat(32),
            });
            let text = serde_json::to_string(&request)
                .expect("json")
                .replace(',', ", ")
                .replace(':', ": ");
            assert!(
                text.len() <= max_request_frame(num_blocks),
                "{num_blocks}: {} bytes",
                text.len()
            );
        }
        assert_eq!(max_request_frame(u32::MAX), crate::wire::MAX_FRAME);
    }

    fn reg() -> PoolRegistration {
        serde_json::from_value(serde_json::json!({
            "api_version": API_VERSION,
            "pdpair": "team-a/x", "role": "decode", "engine": "e",
            "parallelism": {}, "kv": {"engine": "vllm", "model": "m", "dtype": "bfloat16", "layers": 2,
                "kvHeads": 2, "headDim": 16, "attentionBackend": "FLASH_ATTN", "layout": "HND", "blockSize": 16},
            "pairing_key": "6b", "num_blocks": 4
        }))
        .expect("registration")
    }

    fn transfer() -> pdpair_api::TransferSpec {
        serde_json::from_value(serde_json::json!({"mode": "Push", "checksum": "FailClosed", "handshakeTimeout": "5s", "leaseDuration": "30s"}))
            .expect("transfer")
    }

    #[test]
    fn a_long_engine_name_is_cut_with_a_hash_of_the_whole() {
        assert_eq!(engine_name_within("pod-12".into()), "pod-12");
        let long = format!("{}-1", "p".repeat(253));
        let (a, b) = (engine_name_within(long.clone()), engine_name_within(format!("{long}2")));
        assert!(a.len() <= MAX_ENGINE_NAME && a.starts_with("ppp") && a != b, "{a} {b}");
        assert!(engine_name_within("é".repeat(200)).len() <= MAX_ENGINE_NAME);
    }

    #[test]
    fn engine_and_pdpair_names_are_bounded() {
        let mut r = reg();
        assert_eq!(r.check_names(), Ok(()));
        r.engine = "e".repeat(MAX_ENGINE_NAME);
        assert_eq!(r.check_names(), Ok(()));
        r.engine = "e".repeat(MAX_ENGINE_NAME + 1);
        assert_eq!(r.check_names(), Err("engine is 254 bytes; 1..=253 are accepted".into()));
        r.engine = String::new();
        assert_eq!(r.check_names(), Err("engine is 0 bytes; 1..=253 are accepted".into()));
        r.engine = "e".into();
        r.pdpair = format!("{}/{}", "n".repeat(63), "p".repeat(64));
        assert_eq!(r.check_names(), Err("pdpair is 128 bytes; 1..=127 are accepted".into()));
        r.pdpair = "team-a/tiny".into();
        r.kv.model = "m".repeat(pdpair_api::MAX_MODEL);
        assert_eq!(r.check_names(), Ok(()));
        r.kv.model.push('m');
        assert_eq!(r.check_names(), Err("kv.model is 1025 characters; at most 1024".into()));
        r.kv.model = "m".into();
        r.kv.engine_version = Some("v".repeat(254));
        assert_eq!(
            r.check_names(),
            Err("kv.engineVersion is 254 characters; at most 253".into())
        );
        r.kv.engine_version = None;
        // The engine instance, where given (the PDEndpoint takes 253 characters).
        r.instance = Some("i".repeat(MAX_ENGINE_NAME));
        assert_eq!(r.check_names(), Ok(()));
        r.instance = Some("i".repeat(MAX_ENGINE_NAME + 1));
        assert_eq!(
            r.check_names(),
            Err("instance is 254 bytes; 1..=253 are accepted".into())
        );
        r.instance = Some(String::new());
        assert_eq!(r.check_names(), Err("instance is 0 bytes; 1..=253 are accepted".into()));
        r.instance = Some("pod-e_dp0\u{1b}[31m".into());
        assert_eq!(
            r.check_names(),
            Err("instance holds the control character '\\u{1b}'".into())
        );
        r.instance = None;
        // The engines its Pod runs: some of its data-parallel ranks, published as an int32.
        r.parallelism.data = 4;
        for (n, ok) in [(1, true), (4, true), (0, false), (5, false), (u32::MAX, false)] {
            r.pod_engines = Some(n);
            let want = match ok {
                true => Ok(()),
                false => Err(format!(
                    "pod_engines is {n}; 1..=4 are accepted (parallelism.data is 4)"
                )),
            };
            assert_eq!(r.check_names(), want, "{n}");
        }
        r.parallelism.data = 1;
        r.pod_engines = Some(2);
        assert_eq!(
            r.check_names(),
            Err("pod_engines is 2; 1..=1 are accepted (parallelism.data is 1)".into())
        );
        r.parallelism.data = 5000;
        r.pod_engines = Some(1025);
        assert_eq!(
            r.check_names(),
            Err("pod_engines is 1025; 1..=1024 are accepted (parallelism.data is 5000)".into())
        );
    }

    #[test]
    fn a_staging_reason_is_short_and_only_for_a_host_pool() {
        let mut r = reg();
        assert_eq!(r.check_staging(), Ok(()), "none given");
        r.staging = Some("the KV cache is in cpu memory".into());
        assert_eq!(r.check_staging(), Ok(()));
        r.staging = Some("x".repeat(MAX_STAGING + 1));
        assert_eq!(
            r.check_staging(),
            Err(format!("staging is {} bytes; at most {MAX_STAGING}", MAX_STAGING + 1))
        );
        r.staging = Some("why".into());
        r.gpu = Some(GpuPool {
            device_uuid: "GPU-0".into(),
            regions: Vec::new(),
            event: None,
            events: Vec::new(),
        });
        assert!(
            r.check_staging()
                .is_err_and(|e| e.starts_with("staging and gpu are both set"))
        );
    }

    #[test]
    fn the_pdpair_fills_what_the_engine_leaves_out_and_a_disagreement_names_the_field() {
        let t = transfer();
        let filled = resolve(&reg(), Some(("team-a/x", &t))).expect("filled");
        assert_eq!(
            filled,
            Settings {
                mode: TransferMode::Push,
                checksum: ChecksumPolicy::FailClosed,
                handshake_timeout_ms: 5000,
                lease_ms: 30_000
            }
        );
        let mut r = reg();
        r.mode = Some(TransferMode::Pull);
        let e = resolve(&r, Some(("team-a/x", &t))).expect_err("disagrees");
        assert!(
            e.starts_with("mode:") && e.contains("Pull") && e.contains("Push") && e.contains("team-a/x"),
            "{e}"
        );
        let mut r = reg();
        r.lease_ms = Some(1000);
        let e = resolve(&r, Some(("team-a/x", &t))).expect_err("disagrees");
        assert!(e.starts_with("lease_ms:") && e.contains("30000"), "{e}");
        // Agreeing values are fine.
        let mut r = reg();
        r.checksum = Some(ChecksumPolicy::FailClosed);
        assert!(resolve(&r, Some(("team-a/x", &t))).is_ok());
    }

    #[test]
    fn without_the_pdpair_every_setting_is_required_and_versions_must_match() {
        let e = resolve(&reg(), None).expect_err("required");
        assert!(e.contains("mode is required"), "{e}");
        let mut r = reg();
        (r.mode, r.checksum, r.handshake_timeout_ms, r.lease_ms) = (
            Some(TransferMode::Pull),
            Some(ChecksumPolicy::Disabled),
            Some(100),
            Some(0),
        );
        let e = resolve(&r, None).expect_err("zero lease");
        assert!(e.contains("lease_ms is 0"), "{e}");
        r.lease_ms = Some(200);
        assert_eq!(resolve(&r, None).expect("given").lease_ms, 200);
        r.api_version = 1;
        let e = resolve(&r, None).expect_err("old version");
        assert!(
            e.contains("api_version 1") && e.contains(&API_VERSION.to_string()),
            "{e}"
        );
        r.api_version = 0;
        assert!(resolve(&r, None).expect_err("none").contains("names none"));
    }

    /// Decoding with no room asked for (the budget's own tests are in `frame_budget`).
    fn free(_cost: usize) -> Result<(), String> {
        Ok(())
    }

    #[test]
    fn a_frame_is_decoded_only_within_its_values_and_a_refusal_names_its_request() {
        let cancel = |pad: usize, tail: &str| {
            format!(r#"{{"type":"Cancel","pad":[{}]{tail}}}"#, vec!["0"; pad].join(",")).into_bytes()
        };
        // The object, type, request, pad and its elements: counted whatever the fields' order.
        let within = cancel(6, r#","request":"r""#);
        assert_eq!(
            decode_request(&within, 10, free),
            Ok(EngineRequest::Cancel { request: "r".into() })
        );
        let (request, e) = decode_request(&within, 9, free).expect_err("over");
        assert_eq!(request.as_deref(), Some("r"), "found after the values it counted");
        assert!(e.contains("Cancel holds 10 JSON values; at most 9"), "{e}");
        let max = max_request_values(1000);
        let (request, e) = decode_request(&cancel(max, r#","request":"big""#), max, free).expect_err("over");
        assert_eq!(request.as_deref(), Some("big"));
        assert!(e.contains(&format!("at most {max}")), "{e}");
        // Every request of a pool of 1000 blocks naming each of them, with 1024 prefills.
        let every = serde_json::to_vec(&EngineRequest::ExpectKvFrom {
            request: "all".into(),
            prefills: (0..1024)
                .map(|i| format!("10.0.{}.{}:40000", i / 256, i % 256))
                .collect(),
            blocks: (0..1000).collect(),
            num_tokens: 16000,
            first_token: 0,
            prompt: Some(PromptDigest([7; 32])),
            event: None,
        })
        .expect("json");
        assert!(decode_request(&every, max, free).is_ok());
        // Not JSON, not an object, trailing bytes: no request named.
        for bad in [&b"{"[..], b"[1]", b"{\"type\":\"Cancel\",\"request\":\"r\"} x"] {
            let (request, e) = decode_request(bad, max, free).expect_err("malformed");
            assert!(request.is_none() && e.contains("malformed"), "{e}");
        }
    }

    #[test]
    fn a_prompt_digest_is_32_bytes_of_hex_and_a_wrong_one_is_refused_naming_it() {
        let frame = |prompt: &str| {
            serde_json::json!({"type": "ExpectKv", "request": "r", "prefill": "a:1", "blocks": [1],
                "num_tokens": 16, "first_token": 0, "prompt": prompt})
        };
        let good = "ab".repeat(32);
        let frame = |prompt: &str| serde_json::to_vec(&frame(prompt)).expect("json");
        match decode_request(&frame(&good), 100, free) {
            Ok(EngineRequest::ExpectKv { prompt: Some(p), .. }) => assert_eq!(p, PromptDigest([0xab; 32])),
            other => panic!("{other:?}"),
        }
        for (bad, why) in [("ab".repeat(31), "32 bytes, not 31"), ("zz".repeat(32), "invalid hex")] {
            let (request, e) = decode_request(&frame(&bad), 100, free).expect_err("refused");
            assert_eq!(request.as_deref(), Some("r"));
            assert!(e.contains(why), "{e}");
        }
        let (a, b) = (PromptDigest([1; 32]), PromptDigest([2; 32]));
        assert_eq!(check_prompt(None, None), Ok(()));
        assert_eq!(check_prompt(Some(&a), Some(&a)), Ok(()));
        let differ = check_prompt(Some(&a), Some(&b)).expect_err("differ");
        assert!(differ.contains("not the one") && !differ.contains("0202"), "{differ}");
        assert!(check_prompt(Some(&a), None).is_err() && check_prompt(None, Some(&b)).is_err());
    }
}
