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
    printcolumn(
        name = "Rank",
        type_ = "integer",
        json_path = ".spec.tensorRank",
        description = "The engine's tensor-parallel rank"
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
    #[schemars(length(max = 253))]
    pub pdpair: String,
    /// Which pool the engine belongs to.
    pub role: Role,
    /// The engine's Pod.
    #[schemars(length(max = 253))]
    pub pod: String,
    /// The node the engine runs on.
    #[schemars(length(max = 253))]
    pub node: String,
    /// The node agent's side-channel address (host:port) for this engine.
    #[schemars(length(max = MAX_ADDRESS))]
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
    #[schemars(length(max = MAX_TEXT))]
    pub staging: Option<String>,
    /// The engine's tensor-parallel rank (0 to `parallelism.tensor` - 1): each rank of an engine
    /// registers on its own, so the operator can tell an engine with some ranks unregistered.
    /// Absent from agents before 2026-12-07.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor_rank: Option<i32>,
    /// The engine instance the rank is one of, as the engine names it: every tensor-parallel
    /// rank of one engine in its Pod names the same, and no other engine of the Pod does (vLLM's
    /// data-parallel ranks are engines of their own). Absent from engines and agents before
    /// 2026-12-07: the Pod's ranks are then counted together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_INSTANCE))]
    pub instance: Option<String>,
    /// How many engines the engine's Pod runs, as the engine says (vLLM: the ranks of an MoE
    /// model's data-parallel group it starts in the Pod, `data_parallel_size_local`), at most
    /// `parallelism.data`, so the operator tells a Pod missing a whole engine. Absent where the
    /// engine does not say (a dense model's data-parallel ranks are engines of data parallelism
    /// 1 each), and from engines and agents before 2026-12-08: a Pod's engines are then not
    /// counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = MAX_POD_ENGINES))]
    pub pod_engines: Option<i32>,
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
    /// Earlier rejections by other peers than `lastRejection`'s, none resolved: each peer's
    /// latest, the most recent [`MAX_EARLIER`], oldest first. A rejection by one peer is not
    /// hidden by a later one by another. Absent from agents before 2026-12-07.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_EARLIER))]
    pub earlier_rejections: Vec<Rejection>,
    /// Earlier failures with other peers than `lastFailure`'s (or with none named), none
    /// resolved: each peer's latest, the most recent [`MAX_EARLIER`], oldest first. A failure
    /// with one peer is not hidden by a later one with another. Absent from agents before
    /// 2026-12-07.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_EARLIER))]
    pub earlier_failures: Vec<Failure>,
    /// The path transfers with each peer took (the most recent peers, at most
    /// [`MAX_PATHS`]), in the order they were first used.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_PATHS))]
    pub paths: Vec<crate::TransferPath>,
    /// When the agent last refreshed this status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::time")]
    pub last_heartbeat: Option<Time>,
    /// When the engine registered with its agent (its current registration: an engine that
    /// registers again under the same name, after a restart, keeps its PDEndpoint). Absent from
    /// agents before 2026-12-07.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::time")]
    pub registered: Option<Time>,
}

/// The most peers whose paths an endpoint's status lists.
pub const MAX_PATHS: usize = 16;
/// The most earlier rejections, and earlier failures, an endpoint's status lists.
pub const MAX_EARLIER: usize = 8;

/// The most characters of a message or other free text in a PDEndpoint (the CRD's `maxLength`:
/// the API server refuses more). PDEndpoints are written by node agents, whose credentials may
/// be a compromised node's, and the operator folds their text into PDPair status: unbounded, two
/// endpoints of 700 KB each pushed a PDPair's status past what etcd stores.
pub const MAX_TEXT: usize = 4096;
/// The most characters of an engine instance's name in a PDEndpoint (an engine name's bound).
pub const MAX_INSTANCE: usize = 253;
/// The most engines a PDEndpoint says its Pod runs (`spec.podEngines`).
pub const MAX_POD_ENGINES: i32 = 1024;
/// The most characters of an engine's side-channel address in a PDEndpoint.
pub const MAX_ADDRESS: usize = 256;
/// The most characters of a peer's name in a PDEndpoint (`engine@agent`).
pub const MAX_PEER: usize = 1024;
/// The most reasons a rejection or failure lists, and characters of each.
pub const MAX_REASONS: usize = 64;
/// Characters of one reason.
pub const MAX_REASON: usize = 64;

impl PDEndpointSpec {
    /// The spec cut to what the CRD takes (an engine's words are cut; names a node agent took
    /// from the API server or checked at registration are within it already).
    pub fn bounded(mut self) -> Self {
        self.address = clamp_text(&self.address, MAX_ADDRESS);
        self.staging = self.staging.map(|s| clamp_text(&s, MAX_TEXT));
        self.instance = self.instance.map(|s| clamp_text(&s, MAX_INSTANCE));
        self
    }
}

impl PDEndpointStatus {
    /// The rejections that may still stand: the last, then the earlier ones, newest first.
    pub fn rejections(&self) -> impl Iterator<Item = &Rejection> {
        self.last_rejection.iter().chain(self.earlier_rejections.iter().rev())
    }

    /// The failures that may still stand: the last, then the earlier ones, newest first.
    pub fn failures(&self) -> impl Iterator<Item = &Failure> {
        self.last_failure.iter().chain(self.earlier_failures.iter().rev())
    }

    /// The status cut to what the CRD takes: an agent's status that the API server refused
    /// would leave the endpoint's last one standing.
    pub fn bounded(mut self) -> Self {
        let reasons = |r: Vec<String>| {
            r.into_iter()
                .take(MAX_REASONS)
                .map(|r| clamp_text(&r, MAX_REASON))
                .collect()
        };
        let rejection = |r: Rejection| Rejection {
            peer: clamp_text(&r.peer, MAX_PEER),
            reasons: reasons(r.reasons),
            message: clamp_text(&r.message, MAX_TEXT),
            ..r
        };
        let failure = |f: Failure| Failure {
            reasons: reasons(f.reasons),
            message: clamp_text(&f.message, MAX_TEXT),
            peer: f.peer.map(|p| clamp_text(&p, MAX_PEER)),
            ..f
        };
        self.last_rejection = self.last_rejection.map(rejection);
        self.last_failure = self.last_failure.map(failure);
        let earlier = std::mem::take(&mut self.earlier_rejections);
        self.earlier_rejections = most_recent(earlier).into_iter().map(rejection).collect();
        let earlier = std::mem::take(&mut self.earlier_failures);
        self.earlier_failures = most_recent(earlier).into_iter().map(failure).collect();
        self.paths.truncate(MAX_PATHS);
        for p in &mut self.paths {
            p.peer = clamp_text(&p.peer, MAX_PEER);
            p.lanes.truncate(crate::path::MAX_PATH_LANES);
            for lane in &mut p.lanes {
                *lane = clamp_text(lane, crate::path::MAX_LANE_NAME);
            }
            p.ucx_version = clamp_text(&p.ucx_version, crate::path::MAX_LANE_NAME);
        }
        self
    }
}

/// The most recent [`MAX_EARLIER`] of `news`, oldest first (as `earlierRejections` and
/// `earlierFailures` list them).
pub fn most_recent<T>(mut news: Vec<T>) -> Vec<T> {
    let over = news.len().saturating_sub(MAX_EARLIER);
    news.drain(..over);
    news
}

/// `text` cut to at most `max` characters (the last three `...` where it was cut).
pub fn clamp_text(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(max.saturating_sub(3)).collect();
    out.push_str(&"..."[..max.min(3)]);
    out
}

/// Counters an agent reports per endpoint, and the operator sums per PDPair.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TransferCounters {
    /// Handshakes with peers that were accepted.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub handshakes_accepted: i64,
    /// Handshakes with peers that were rejected (authentication or geometry).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub handshakes_rejected: i64,
    /// KV transfers that completed.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub transfers_completed: i64,
    /// KV transfers that failed.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub transfers_failed: i64,
    /// KV bytes moved.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub bytes: i64,
    /// Loads whose checksums matched.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub checksums_verified: i64,
    /// Loads whose checksums did not match.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub checksums_mismatched: i64,
    /// Loads that could not be verified (block sizes that do not line up).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub checksums_unverified: i64,
}

impl TransferCounters {
    /// Adds another endpoint's counters (saturating: a counter never wraps negative; a negative
    /// one, which the CRD refuses and an agent never writes, adds nothing rather than lower the
    /// totals).
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
            *total = total.saturating_add(value.max(0));
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
    #[schemars(length(max = MAX_PEER))]
    pub peer: String,
    /// The rule-table reasons, or Unauthenticated.
    #[schemars(length(max = MAX_REASONS), inner(length(max = MAX_REASON)))]
    pub reasons: Vec<String>,
    /// The message.
    #[schemars(length(max = MAX_TEXT))]
    pub message: String,
    /// When a transfer with this same peer (its address) completed after the rejection, where
    /// one did: it no longer stands. Agents before it leave it out. (A decode agent names a
    /// prefill by its side-channel address, which later transfers share; a prefill agent names
    /// the decode's connection, which a rejection closes.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::time")]
    pub resolved: Option<Time>,
}

/// A failed transfer as the agent saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Failure {
    /// When it happened.
    #[schemars(schema_with = "schema::time_required")]
    pub time: Time,
    /// Its reasons (TransportFailed, WriteFailed, PeerLost, ChecksumMismatch, ...).
    #[schemars(length(max = MAX_REASONS), inner(length(max = MAX_REASON)))]
    pub reasons: Vec<String>,
    /// The message.
    #[schemars(length(max = MAX_TEXT))]
    pub message: String,
    /// The peer it failed with (its address), where one did: a decode agent names the prefill.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_PEER))]
    pub peer: Option<String>,
    /// When a transfer with that same peer completed after the failure, where one did: it no
    /// longer stands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::time")]
    pub resolved: Option<Time>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_cut_to_its_bound_in_characters() {
        assert_eq!(clamp_text("short", 10), "short");
        assert_eq!(clamp_text("0123456789abc", 10), "0123456...");
        assert_eq!(clamp_text(&"é".repeat(20), 10).chars().count(), 10);
        assert_eq!(clamp_text("abcdef", 2), "..");
    }

    #[test]
    fn counters_add_up_and_a_negative_one_lowers_nothing() {
        let mut total = TransferCounters {
            bytes: 10,
            ..TransferCounters::default()
        };
        total.add(&TransferCounters {
            bytes: -1_000,
            transfers_completed: 2,
            ..TransferCounters::default()
        });
        assert_eq!(total.bytes, 10, "a negative count lowers nothing");
        total.add(&TransferCounters {
            bytes: i64::MAX,
            ..TransferCounters::default()
        });
        assert_eq!((total.bytes, total.transfers_completed), (i64::MAX, 2));
        let schema = serde_json::to_value(schemars::schema_for!(TransferCounters)).expect("schema");
        assert_eq!(schema["properties"]["bytes"]["minimum"], 0, "{schema}");
    }

    #[test]
    fn a_status_past_the_crds_bounds_is_cut_to_them() {
        let time = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        let long = "x".repeat(100_000);
        let path = crate::TransferPath {
            peer: long.clone(),
            kind: crate::PathKind::Tcp,
            backend: crate::Backend::TcpStream,
            lanes: vec![long.clone(); 100],
            emulated: false,
            ucx_version: long.clone(),
            since: time.clone(),
            last_used: None,
        };
        let status = PDEndpointStatus {
            last_rejection: Some(Rejection {
                time: time.clone(),
                peer: long.clone(),
                reasons: vec![long.clone(); 100],
                message: long.clone(),
                resolved: None,
            }),
            last_failure: Some(Failure {
                peer: Some(long.clone()),
                resolved: None,
                time: time.clone(),
                reasons: vec![long.clone(); 100],
                message: long.clone(),
            }),
            paths: vec![path; 40],
            earlier_rejections: (0..20)
                .map(|i| Rejection {
                    time: time.clone(),
                    peer: format!("{i}{long}"),
                    reasons: vec![long.clone(); 100],
                    message: long.clone(),
                    resolved: None,
                })
                .collect(),
            earlier_failures: (0..20)
                .map(|i| Failure {
                    peer: Some(format!("{i}{long}")),
                    resolved: None,
                    time: time.clone(),
                    reasons: vec![long.clone(); 100],
                    message: long.clone(),
                })
                .collect(),
            ..PDEndpointStatus::default()
        }
        .bounded();
        // The most recent earlier news (the lists are oldest first), each cut.
        let peers: Vec<_> = status
            .earlier_rejections
            .iter()
            .map(|r| r.peer[..2].to_owned())
            .collect();
        assert_eq!(peers, (12..20).map(|i| i.to_string()).collect::<Vec<_>>());
        assert!(
            status
                .earlier_rejections
                .iter()
                .all(|r| r.peer.len() == MAX_PEER && r.message.len() == MAX_TEXT && r.reasons.len() == MAX_REASONS)
        );
        let peers: Vec<_> = status
            .earlier_failures
            .iter()
            .map(|f| f.peer.as_deref().map(|p| p[..2].to_owned()))
            .collect();
        assert_eq!(peers, (12..20).map(|i| Some(i.to_string())).collect::<Vec<_>>());
        assert!(status.earlier_failures.iter().all(|f| f.message.len() == MAX_TEXT
            && f.reasons.len() == MAX_REASONS
            && f.peer.as_ref().is_some_and(|p| p.len() == MAX_PEER)));
        let r = status.last_rejection.expect("rejection");
        assert!(r.peer.len() == MAX_PEER && r.message.len() == MAX_TEXT);
        assert!(r.reasons.len() == MAX_REASONS && r.reasons.iter().all(|x| x.len() == MAX_REASON));
        let f = status.last_failure.expect("failure");
        assert!(f.message.len() == MAX_TEXT && f.reasons.len() == MAX_REASONS);
        assert_eq!(status.paths.len(), MAX_PATHS);
        for p in &status.paths {
            assert!(p.peer.len() == MAX_PEER && p.ucx_version.len() == crate::path::MAX_LANE_NAME);
            assert_eq!(p.lanes.len(), crate::path::MAX_PATH_LANES);
            assert!(p.lanes.iter().all(|l| l.len() == crate::path::MAX_LANE_NAME));
        }
        // Within the bounds: kept as it is.
        let small = PDEndpointStatus {
            last_failure: Some(Failure {
                time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
                reasons: vec!["PeerLost".into()],
                message: "gone".into(),
                peer: Some("10.0.0.2:7000".into()),
                resolved: None,
            }),
            ..PDEndpointStatus::default()
        };
        assert_eq!(small.clone().bounded(), small);
    }
}
