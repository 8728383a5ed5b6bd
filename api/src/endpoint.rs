//! The `PDEndpoint` custom resource: one engine instance as its node agent sees it.
//!
//! The node agent creates one when an engine registers, owned by the engine's Pod so it goes away
//! with it; the agent writes `spec` (what the engine really runs) and `status` (what happened on
//! the wire). The operator only reads it and folds it into the PDPair's status.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{KvGeometry, Parallelism, Role, schema};

/// An engine instance registered with a node agent.
// Several printer columns share `type_ = ...`, which clippy mistakes for duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "pdpair.dev",
    version = "v1alpha1",
    kind = "PDEndpoint",
    plural = "pdendpoints",
    singular = "pdendpoint",
    shortname = "pde",
    namespaced,
    status = "PDEndpointStatus",
    derive = "PartialEq",
    doc = "One engine instance of a PDPair pool, as its node agent observes it.",
    crates(kube_core = "::kube_core"),
    printcolumn(
        name = "Pair",
        type_ = "string",
        json_path = ".spec.pdpair",
        description = "The PDPair"
    ),
    printcolumn(
        name = "Role",
        type_ = "string",
        json_path = ".spec.role",
        description = "prefill or decode"
    ),
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.node", description = "The node"),
    printcolumn(
        name = "Memory",
        type_ = "string",
        json_path = ".spec.poolMemory",
        description = "Where the engine's KV pool is: Gpu (its KV cache itself) or Host (staged)"
    ),
    printcolumn(
        name = "Path",
        type_ = "string",
        json_path = ".status.paths[0].kind",
        description = "The path transfers with the first peer took"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct PDEndpointSpec {
    /// Name of the PDPair (same namespace) the engine serves.
    pub pdpair: String,
    /// Which pool the engine belongs to.
    pub role: Role,
    /// The engine's Pod.
    pub pod: String,
    /// The node the engine runs on.
    pub node: String,
    /// The node agent's side-channel address (host:port) for this engine.
    pub address: String,
    /// The parallelism the engine actually runs with.
    pub parallelism: Parallelism,
    /// The KV geometry the engine actually runs with.
    pub kv: KvGeometry,
    /// Where the engine's KV pool is: `Gpu`, the engine's KV cache itself (GPU memory the agent
    /// opened), or `Host`, a host pool the engine copies its KV through (staging).
    #[serde(default)]
    pub pool_memory: PoolMemory,
    /// Why the engine stages its KV through a host pool, in its own words, where it said
    /// (the vLLM connector says why it did not take the direct path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging: Option<String>,
}

/// Where an engine's KV pool is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PoolMemory {
    /// Host memory: the engine copies its KV between its cache and the pool (or its cache is
    /// host memory).
    #[default]
    Host,
    /// GPU memory: the engine's KV cache, which the agent reads and writes in place.
    Gpu,
}

/// What the node agent observed for this engine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PDEndpointStatus {
    /// Handshakes, transfers, bytes and checksum results since the engine registered.
    #[serde(default, flatten)]
    pub counters: TransferCounters,
    /// The most recent handshake rejection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_rejection: Option<Rejection>,
    /// When a transfer last completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::time")]
    pub last_success: Option<Time>,
    /// The most recent failed transfer that says something about the transfer path (a
    /// transport, peer or checksum failure); routine engine-side outcomes (an expired lease, a
    /// deadline the engine let pass, a malformed request) are counted but not kept here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<Failure>,
    /// The path transfers with each peer took (the most recent peers, at most
    /// [`MAX_PATHS`]), in the order they were first used.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<crate::TransferPath>,
    /// When the agent last refreshed this status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::time")]
    pub last_heartbeat: Option<Time>,
}

/// The most peers whose paths an endpoint's status lists.
pub const MAX_PATHS: usize = 16;

/// Counters an agent reports per endpoint, and the operator sums per PDPair.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TransferCounters {
    /// Handshakes with peers that were accepted.
    #[serde(default)]
    pub handshakes_accepted: i64,
    /// Handshakes with peers that were rejected (authentication or geometry).
    #[serde(default)]
    pub handshakes_rejected: i64,
    /// KV transfers that completed.
    #[serde(default)]
    pub transfers_completed: i64,
    /// KV transfers that failed.
    #[serde(default)]
    pub transfers_failed: i64,
    /// KV bytes moved.
    #[serde(default)]
    pub bytes: i64,
    /// Loads whose checksums matched.
    #[serde(default)]
    pub checksums_verified: i64,
    /// Loads whose checksums did not match.
    #[serde(default)]
    pub checksums_mismatched: i64,
    /// Loads that could not be verified (block sizes that do not line up).
    #[serde(default)]
    pub checksums_unverified: i64,
}

impl TransferCounters {
    /// Adds another endpoint's counters (saturating: a counter never wraps negative).
    pub fn add(&mut self, other: &TransferCounters) {
        let pairs = [
            (&mut self.handshakes_accepted, other.handshakes_accepted),
            (&mut self.handshakes_rejected, other.handshakes_rejected),
            (&mut self.transfers_completed, other.transfers_completed),
            (&mut self.transfers_failed, other.transfers_failed),
            (&mut self.bytes, other.bytes),
            (&mut self.checksums_verified, other.checksums_verified),
            (&mut self.checksums_mismatched, other.checksums_mismatched),
            (&mut self.checksums_unverified, other.checksums_unverified),
        ];
        for (total, value) in pairs {
            *total = total.saturating_add(value);
        }
    }
}

/// A handshake rejection as the agent saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Rejection {
    /// When it happened.
    #[schemars(schema_with = "schema::time_required")]
    pub time: Time,
    /// The peer (its agent address or pod).
    pub peer: String,
    /// The rule-table reasons, or Unauthenticated.
    pub reasons: Vec<String>,
    /// The message.
    pub message: String,
}

/// A failed transfer as the agent saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Failure {
    /// When it happened.
    #[schemars(schema_with = "schema::time_required")]
    pub time: Time,
    /// Its reasons (TransportFailed, WriteFailed, PeerLost, ChecksumMismatch, ...).
    pub reasons: Vec<String>,
    /// The message.
    pub message: String,
}
