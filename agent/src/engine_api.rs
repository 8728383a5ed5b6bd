//! The engine API: what an engine and its node's agent say over the agent's Unix socket
//! (default `/var/run/pdpair/agent.sock`). Frames are the side channel's: a 4-byte big-endian
//! length, then one JSON message. `docs/engine-api.md` is the specification.

use pdpair_api::{ChecksumPolicy, KvGeometry, Parallelism, Role, TransferMode};
use serde::{Deserialize, Serialize};

/// Default socket path.
pub const DEFAULT_SOCKET: &str = "/var/run/pdpair/agent.sock";

/// Engine -> agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum EngineRequest {
    /// First message on a connection: the engine's KV pool.
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
    },
}

/// An engine's KV pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolRegistration {
    /// `namespace/name` of the PDPair.
    pub pdpair: String,
    /// The engine's role.
    pub role: Role,
    /// Engine instance id (unique on the node).
    pub engine: String,
    /// The engine's Pod, when it runs in Kubernetes.
    #[serde(default)]
    pub pod: Option<String>,
    /// Transfer mode.
    pub mode: TransferMode,
    /// Checksum policy.
    pub checksum: ChecksumPolicy,
    /// How long to wait for a peer's handshake, in milliseconds.
    pub handshake_timeout_ms: u64,
    /// How long prefill holds a request's blocks for decode, in milliseconds.
    pub lease_ms: u64,
    /// The engine's parallelism.
    pub parallelism: Parallelism,
    /// The engine's KV geometry.
    pub kv: KvGeometry,
    /// The PDPair's pairing secret (the file at `PDPAIR_PAIRING_KEY_FILE`), hex.
    pub pairing_key: String,
    /// The engine brings its own pool: the `RegisterPool` frame carries a memfd (`SCM_RIGHTS`)
    /// sealed against shrinking (`F_SEAL_SHRINK`) and holding the whole pool. False: the agent
    /// allocates the pool and passes its descriptor with `Registered`.
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
}

/// Agent -> engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum AgentEvent {
    /// The pool is registered; peers reach this engine at `address`.
    Registered {
        /// Side-channel address (prefill engines listen; decode engines connect out).
        address: String,
        /// Agent identity.
        agent: String,
        /// Bytes of the pool. When the agent allocated it (`memory_fd` was false), this frame
        /// carries its descriptor (`SCM_RIGHTS`): the engine maps it, whole, shared.
        memory_len: u64,
    },
    /// The registration was refused; the agent closes the connection.
    RegistrationFailed {
        /// Why.
        message: String,
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
