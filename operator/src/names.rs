//! Names shared by the controller, the webhook, Events and docs: labels, annotations, condition
//! types and reasons. Condition reasons and Event reasons come from here so they never drift.

/// Field manager for every server-side apply the operator makes.
pub const MANAGER: &str = "pdpair-operator";
/// Label carrying the PDPair name on Deployments and pods.
pub const LABEL_NAME: &str = "pdpair.dev/name";
/// Label carrying the role (prefill or decode) on Deployments and pods.
pub const LABEL_ROLE: &str = "pdpair.dev/role";
/// Pod template annotation holding a hash of the pool's geometry: a change rolls the pods.
pub const ANNOTATION_GEOMETRY: &str = "pdpair.dev/geometry-hash";
/// Where the node agent's socket directory is, on the node and in the engine.
pub const AGENT_SOCKET_DIR: &str = "/var/run/pdpair";
/// The agent's socket, as engines see it.
pub const AGENT_SOCKET: &str = "/var/run/pdpair/agent.sock";
/// Where the pairing secret is mounted in the engine.
pub const PAIRING_DIR: &str = "/var/run/pdpair-pairing";
/// The key inside the pairing Secret.
pub const PAIRING_KEY: &str = "key";
/// The PDPair's UID inside the pairing Secret, beside its key: an engine whose `PDPAIR_UID`
/// differs holds a key of an earlier PDPair of the same name.
pub const PAIRING_UID: &str = "pdpair-uid";
/// Path of the pairing key file in the engine.
pub const PAIRING_KEY_FILE: &str = "/var/run/pdpair-pairing/key";
/// Length of the pairing key, in bytes.
pub const PAIRING_KEY_LEN: usize = 32;
/// The name of the ValidatingWebhookConfiguration.
pub const WEBHOOK_CONFIG: &str = "pdpair-validating-webhook";
/// The webhook's name inside it.
pub const WEBHOOK_NAME: &str = "validate.pdpairs.pdpair.dev";
/// The webhook's path, appended to the base URL.
pub const WEBHOOK_PATH: &str = "/validate/pdpairs";
/// The Lease that elects the reconciling replica.
pub const LEASE_NAME: &str = "pdpair-operator";

/// Name of a pool's Deployment.
pub fn deployment_name(pair: &str, role: pdpair_api::Role) -> String {
    format!("{pair}-{role}")
}

/// Name of a pair's pairing Secret: its name and its uid, so a PDPair deleted and made again
/// under its name never finds its predecessor's Secret (one the garbage collector has not
/// deleted yet, or one `kubectl delete --cascade=orphan` left for good) in place of its own.
pub fn secret_name(pair: &str, uid: &str) -> String {
    format!("{pair}-pairing-{uid}")
}

/// The name operators before [`secret_name`] gave a pair's pairing Secret.
pub fn legacy_secret_name(pair: &str) -> String {
    format!("{pair}-pairing")
}

/// Condition types on a PDPair.
pub mod conditions {
    /// The declared geometry passes the rule table, and so do the engines' observed geometries.
    pub const GEOMETRY_COMPATIBLE: &str = "GeometryCompatible";
    /// The prefill pool has its replicas ready.
    pub const PREFILL_READY: &str = "PrefillReady";
    /// The decode pool has its replicas ready.
    pub const DECODE_READY: &str = "DecodeReady";
    /// Node agents report no rejected handshakes and no failed transfers.
    pub const TRANSFER_READY: &str = "TransferReady";
    /// The path the agents that moved KV report (RDMA, shared memory, TCP...), and whether
    /// `spec.transfer.requirePath` allows it.
    pub const TRANSFER_PATH: &str = "TransferPath";
    /// The API server took the pools' Deployments as the spec plans them (checked with a dry
    /// run of both before either is applied).
    pub const POOLS_APPLIED: &str = "PoolsApplied";
    /// All of the above.
    pub const READY: &str = "Ready";
}

/// PascalCase reasons for conditions and Events (rule-table reasons come from pdpair-api).
pub mod reasons {
    /// The admission webhook denied a PDPair.
    pub const REJECTED: &str = "Rejected";
    /// Geometry passes the rule table.
    pub const COMPATIBLE: &str = "Compatible";
    /// An engine runs another geometry than its pool declares.
    pub const OBSERVED_GEOMETRY_MISMATCH: &str = "ObservedGeometryMismatch";
    /// Every desired pod is Ready.
    pub const PODS_READY: &str = "PodsReady";
    /// Some desired pod is not Ready.
    pub const PODS_NOT_READY: &str = "PodsNotReady";
    /// No engine has registered with a node agent.
    pub const NO_ENDPOINTS: &str = "NoEndpoints";
    /// Agents report a rejected handshake.
    pub const HANDSHAKE_REJECTED: &str = "HandshakeRejected";
    /// Agents report a failed transfer.
    pub const TRANSFER_FAILED: &str = "TransferFailed";
    /// Agents report only successes.
    pub const HEALTHY: &str = "Healthy";
    /// Ready: everything is.
    pub const READY: &str = "Ready";
    /// Ready is False because geometry is incompatible.
    pub const GEOMETRY_INCOMPATIBLE: &str = "GeometryIncompatible";
    /// Ready is False because the prefill pool is not ready.
    pub const PREFILL_NOT_READY: &str = "PrefillNotReady";
    /// Ready is False because the decode pool is not ready.
    pub const DECODE_NOT_READY: &str = "DecodeNotReady";
    /// Ready is False because, with pdpair's connector, a pool has no engine registered with a
    /// node agent (or none heard of lately).
    pub const NOT_REGISTERED: &str = "EnginesNotRegistered";
    /// Ready is False because transfers fail.
    pub const TRANSFER_NOT_READY: &str = "TransferNotReady";
    /// No agent has reported the path of a completed transfer.
    pub const NO_TRANSFERS: &str = "NoTransfers";
    /// A transfer took a path `spec.transfer.requirePath` does not allow (also Ready's reason).
    pub const PATH_NOT_ALLOWED: &str = "PathNotAllowed";
    /// An engine stages its KV through host memory while `spec.transfer.requireDirect` is set
    /// (also Ready's reason).
    pub const STAGING_NOT_ALLOWED: &str = "StagingNotAllowed";
    /// The pools' Deployments are as the spec plans them.
    pub const APPLIED: &str = "Applied";
    /// The API server refused a pool's Deployment (also Ready's reason): neither was applied.
    pub const APPLY_FAILED: &str = "ApplyFailed";
    // TransferPath True carries the worst path class seen as its reason (Rdma, SharedMemory,
    // Local, Tcp, Other: `pdpair_api::PathKind::as_str`).
}
