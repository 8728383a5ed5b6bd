//! The `PDPair` custom resource: a prefill pool and a decode pool that exchange KV cache.
//!
//! Integers are signed on purpose: a negative or zero value must reach the rule table, which names
//! the field and the value, instead of failing deserialisation with a type error.

use k8s_openapi::{api::core::v1::PodTemplateSpec, apimachinery::pkg::apis::meta::v1::Condition};
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{Duration, schema};

/// The desired state of a prefill/decode pair.
// Several printer columns share `type_ = ...`, which clippy mistakes for duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "pdpair.dev",
    version = "v1alpha1",
    kind = "PDPair",
    plural = "pdpairs",
    singular = "pdpair",
    shortname = "pdp",
    namespaced,
    status = "PDPairStatus",
    derive = "PartialEq",
    doc = "A prefill pool and a decode pool that exchange KV cache; admitted only when their KV geometries are compatible.",
    crates(kube_core = "::kube_core"),
    printcolumn(
        name = "Mode",
        type_ = "string",
        json_path = ".spec.transfer.mode",
        description = "KV transfer mode"
    ),
    printcolumn(
        name = "Prefill",
        type_ = "integer",
        json_path = ".spec.prefill.replicas",
        description = "Prefill replicas"
    ),
    printcolumn(
        name = "Decode",
        type_ = "integer",
        json_path = ".spec.decode.replicas",
        description = "Decode replicas"
    ),
    printcolumn(
        name = "Compatible",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"GeometryCompatible\")].status",
        description = "Whether the declared and observed KV geometries are compatible"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status",
        description = "Whether both pools are ready and KV transfers work"
    ),
    printcolumn(
        name = "Path",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"TransferPath\")].reason",
        description = "The worst path KV took (Rdma, SharedMemory, Local, CudaIpc, Tcp, Other), or PathNotAllowed"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct PDPairSpec {
    /// How KV moves from the prefill pool to the decode pool.
    #[serde(default)]
    pub transfer: TransferSpec,
    /// The prefill (P) pool: computes a request's KV cache and sends it to decode.
    pub prefill: PoolSpec,
    /// The decode (D) pool: receives KV cache from prefill and generates tokens.
    pub decode: PoolSpec,
}

/// KV transfer settings shared by both pools.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TransferSpec {
    /// Push: prefill WRITEs KV blocks into decode's memory. Pull: decode READs them from prefill.
    #[serde(default)]
    pub mode: TransferMode,
    /// KV checksum policy: Disabled, FailOpen (mismatches and unverified loads are logged) or
    /// FailClosed (they fail the request).
    #[serde(default)]
    pub checksum: ChecksumPolicy,
    /// How long an agent waits for a peer's handshake before failing the requests that wait on it.
    #[serde(default = "default_handshake_timeout")]
    pub handshake_timeout: Duration,
    /// How long prefill holds a request's KV blocks for decode without a heartbeat.
    #[serde(default = "default_lease_duration")]
    pub lease_duration: Duration,
    /// The engines' KV connector. `Pdpair`: both pools run vLLM with pdpair's connector (the
    /// `pdpair-vllm` package in the engine image); the operator renders vLLM's
    /// `--kv-transfer-config` for each pool's first container, replacing one the template has.
    /// `None` (the default): the templates configure their engines themselves.
    #[serde(default, skip_serializing_if = "Connector::is_none")]
    pub connector: Connector,
    /// The paths KV may take (Rdma, SharedMemory, Local, CudaIpc, Tcp, Other). Empty (the default):
    /// any. When set, a transfer that ran over another path (RDMA silently falling back to
    /// TCP, say) turns the `TransferPath` condition False with a Warning Event; transfers are
    /// not stopped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub require_path: Vec<crate::PathKind>,
    /// Whether every engine must hand its agent its KV cache in GPU memory, moved in place
    /// (PDEndpoint `poolMemory: Gpu`, the vLLM connector's direct path). When set, an engine that
    /// stages its KV through a host pool (its PDEndpoint's `spec.staging` says why) turns the
    /// `TransferPath` condition False (reason `StagingNotAllowed`; a Warning Event as it turns
    /// False), before any transfer; engines are not stopped. Default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub require_direct: bool,
}

/// Which KV connector the engines load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Connector {
    /// The templates configure their engines themselves.
    #[default]
    None,
    /// vLLM with pdpair's connector (`pdpair_vllm.PdpairConnector`).
    Pdpair,
}

impl Connector {
    /// Whether this is [`Connector::None`].
    pub fn is_none(&self) -> bool {
        *self == Connector::None
    }
}

fn default_handshake_timeout() -> Duration {
    "5s".parse().expect("a valid literal duration")
}

fn default_lease_duration() -> Duration {
    "30s".parse().expect("a valid literal duration")
}

impl Default for TransferSpec {
    fn default() -> Self {
        TransferSpec {
            mode: TransferMode::default(),
            checksum: ChecksumPolicy::default(),
            handshake_timeout: default_handshake_timeout(),
            lease_duration: default_lease_duration(),
            connector: Connector::None,
            require_path: Vec::new(),
            require_direct: false,
        }
    }
}

/// Direction of the KV transfer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum TransferMode {
    /// Prefill writes into decode (RDMA WRITE).
    #[default]
    Push,
    /// Decode reads from prefill (RDMA READ).
    Pull,
}

/// What to do with KV checksums.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum ChecksumPolicy {
    /// No checksums are computed.
    #[default]
    Disabled,
    /// Checksums are compared; mismatched and unverified loads are logged and counted.
    FailOpen,
    /// Checksums are compared; mismatched and unverified loads fail the request.
    FailClosed,
}

/// One engine pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", from = "StoredPoolSpec")]
pub struct PoolSpec {
    /// Number of engine instances in the pool.
    #[serde(default = "one")]
    #[schemars(range(min = 0))]
    pub replicas: i32,
    /// How each engine instance is parallelised.
    #[serde(default)]
    pub parallelism: Parallelism,
    /// The engine's pod template. When set, the operator runs the pool as a Deployment; when absent
    /// the pool is bring-your-own: pods labelled pdpair.dev/name and pdpair.dev/role join it. The
    /// template is a core/v1 PodTemplateSpec; it is checked when the Deployment is applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::pod_template")]
    pub template: Option<PodTemplateSpec>,
    /// The KV cache geometry the engine runs with.
    pub kv: KvGeometry,
    /// How the pool's Deployment replaces its pods when the template changes (with a
    /// template only). Absent: Kubernetes' defaults (a quarter of the replicas, at least one
    /// pod, made above `replicas`; a quarter rounded down unavailable), which with fewer than 4
    /// replicas make a new pod before any old one goes: on nodes with no GPU to spare it stays
    /// Pending and the rollout stalls. There set `maxSurge: 0` and `maxUnavailable: 1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<Rollout>,
    /// Why the stored `template` is not a pod template (`template` is then `None`): the CRD
    /// keeps templates whole and unchecked, so one stored past the webhook (a namespace opted
    /// out, the webhook down with `failurePolicy: Ignore`) may not parse. Read as the object's
    /// own fault, not one that fails a whole list of PDPairs. Never serialised.
    #[serde(skip)]
    #[schemars(skip)]
    pub template_error: Option<String>,
}

impl PDPairSpec {
    /// Each pool whose stored `template` is not a pod template: the field
    /// (`spec.prefill.template`) and what is wrong in it (see [`PoolSpec::template_error`]).
    pub fn template_errors(&self) -> Vec<(String, String)> {
        [(Role::Prefill, &self.prefill), (Role::Decode, &self.decode)]
            .into_iter()
            .filter_map(|(role, pool)| {
                let why = pool.template_error.as_ref()?;
                Some((format!("spec.{role}.template"), why.clone()))
            })
            .collect()
    }
}

/// [`PoolSpec`] as stored: the template as any JSON, parsed after.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
struct StoredPoolSpec {
    /// Number of engine instances in the pool.
    #[serde(default = "one")]
    #[schemars(range(min = 0))]
    replicas: i32,
    /// How each engine instance is parallelised.
    #[serde(default)]
    parallelism: Parallelism,
    /// The engine's pod template. When set, the operator runs the pool as a Deployment; when absent
    /// the pool is bring-your-own: pods labelled pdpair.dev/name and pdpair.dev/role join it. The
    /// template is a core/v1 PodTemplateSpec; it is checked when the Deployment is applied.
    #[serde(default)]
    #[schemars(schema_with = "schema::pod_template")]
    template: Option<serde_json::Value>,
    /// The KV cache geometry the engine runs with.
    kv: KvGeometry,
    /// How the pool's Deployment replaces its pods when the template changes (with a
    /// template only). Absent: Kubernetes' defaults (a quarter of the replicas, at least one
    /// pod, made above `replicas`; a quarter rounded down unavailable), which with fewer than 4
    /// replicas make a new pod before any old one goes: on nodes with no GPU to spare it stays
    /// Pending and the rollout stalls. There set `maxSurge: 0` and `maxUnavailable: 1`.
    #[serde(default)]
    rollout: Option<Rollout>,
}

/// How a pool's Deployment replaces its pods (its `RollingUpdate` strategy), in pods.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Rollout {
    /// Pods made above `replicas` while the old ones are replaced (the Deployment's
    /// `maxSurge`); absent: Kubernetes' default, a quarter of the replicas rounded up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_surge: Option<i32>,
    /// Pods that may be unavailable while they are replaced (the Deployment's
    /// `maxUnavailable`); absent: Kubernetes' default, a quarter of the replicas rounded down.
    /// Not 0 where `maxSurge` is 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_unavailable: Option<i32>,
}

impl From<StoredPoolSpec> for PoolSpec {
    fn from(s: StoredPoolSpec) -> PoolSpec {
        let (template, template_error) = match s.template {
            None | Some(serde_json::Value::Null) => (None, None),
            Some(value) => match serde_path_to_error::deserialize::<_, PodTemplateSpec>(value) {
                Ok(t) => (Some(t), None),
                Err(e) => (None, Some(format!("{}: {}", e.path(), e.inner()))),
            },
        };
        PoolSpec {
            replicas: s.replicas,
            parallelism: s.parallelism,
            template,
            kv: s.kv,
            rollout: s.rollout,
            template_error,
        }
    }
}

fn one() -> i32 {
    1
}

/// Parallelism of one engine instance.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Parallelism {
    /// Tensor parallel size (GPUs that shard each layer, and the KV heads).
    #[serde(default = "one")]
    pub tensor: i32,
    /// Pipeline parallel size (GPUs that split the layers).
    #[serde(default = "one")]
    pub pipeline: i32,
    /// Data parallel size (independent replicas inside one engine).
    #[serde(default = "one")]
    pub data: i32,
}

impl Default for Parallelism {
    fn default() -> Self {
        Parallelism {
            tensor: 1,
            pipeline: 1,
            data: 1,
        }
    }
}

/// The most characters of a geometry's engine, engine version and attention backend (the CRDs'
/// `maxLength`; the agent refuses an engine's registration past them, naming the field).
pub const MAX_KV_NAME: usize = 253;
/// The most characters of a geometry's model (a name, or a path).
pub const MAX_MODEL: usize = 1024;

/// The KV cache geometry an engine runs with. Both pools must agree on it, as the rule table says.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KvGeometry {
    /// Serving engine, for example vllm.
    #[schemars(length(max = MAX_KV_NAME))]
    pub engine: String,
    /// Engine version; compared only when both pools set it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_KV_NAME))]
    pub engine_version: Option<String>,
    /// Model name, for example meta-llama/Llama-3.1-8B-Instruct.
    #[schemars(length(max = MAX_MODEL))]
    pub model: String,
    /// Model (activation) dtype.
    pub dtype: ModelDtype,
    /// KV cache dtype; auto means the model dtype.
    #[serde(default)]
    pub cache_dtype: CacheDtype,
    /// Number of attention layers holding KV cache.
    pub layers: i32,
    /// Number of KV heads of the model (before tensor-parallel sharding).
    pub kv_heads: i32,
    /// Size of one attention head, in elements.
    pub head_dim: i32,
    /// Attention backend, for example FLASH_ATTN or FLASHINFER; it chooses the kernel block size.
    #[schemars(length(max = MAX_KV_NAME))]
    pub attention_backend: String,
    /// Memory layout of a KV block: HND (heads, tokens, dim: block-contiguous per head) or NHD.
    pub layout: KvLayout,
    /// Logical block size in tokens (the engine's --block-size).
    pub block_size: i32,
    /// Physical (kernel) block size in tokens, chosen by the attention backend; defaults to blockSize.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_block_size: Option<i32>,
    /// Multi-head latent attention (KV not sharded by head).
    #[serde(default)]
    pub mla: bool,
    /// The engine runs the hybrid KV cache manager.
    #[serde(default)]
    pub hybrid: bool,
    /// KV is staged in a host (CPU) buffer for transfers.
    #[serde(default)]
    pub host_buffer: bool,
}

impl KvGeometry {
    /// The physical block size: `kernelBlockSize`, or `blockSize` when unset.
    pub fn kernel_block_size(&self) -> i32 {
        self.kernel_block_size.unwrap_or(self.block_size)
    }

    /// The KV cache dtype with `auto` resolved to the model dtype.
    pub fn resolved_cache_dtype(&self) -> CacheDtype {
        match self.cache_dtype {
            CacheDtype::Auto => self.dtype.into(),
            other => other,
        }
    }
}

/// Model dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ModelDtype {
    /// bfloat16 (2 bytes).
    Bfloat16,
    /// float16 (2 bytes).
    Float16,
    /// float32 (4 bytes).
    Float32,
}

/// KV cache dtype.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CacheDtype {
    /// The model dtype.
    #[default]
    Auto,
    /// bfloat16 (2 bytes).
    Bfloat16,
    /// float16 (2 bytes).
    Float16,
    /// float32 (4 bytes).
    Float32,
    /// fp8, the engine's default 8-bit format (1 byte).
    Fp8,
    /// fp8 e4m3 (1 byte).
    Fp8E4m3,
    /// fp8 e5m2 (1 byte).
    Fp8E5m2,
}

impl From<ModelDtype> for CacheDtype {
    fn from(d: ModelDtype) -> Self {
        match d {
            ModelDtype::Bfloat16 => CacheDtype::Bfloat16,
            ModelDtype::Float16 => CacheDtype::Float16,
            ModelDtype::Float32 => CacheDtype::Float32,
        }
    }
}

impl CacheDtype {
    /// Bytes per element; `None` for `auto`, which must be resolved first.
    pub fn element_bytes(self) -> Option<u32> {
        match self {
            CacheDtype::Auto => None,
            CacheDtype::Fp8 | CacheDtype::Fp8E4m3 | CacheDtype::Fp8E5m2 => Some(1),
            CacheDtype::Bfloat16 | CacheDtype::Float16 => Some(2),
            CacheDtype::Float32 => Some(4),
        }
    }

    /// The name as written in a manifest.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheDtype::Auto => "auto",
            CacheDtype::Bfloat16 => "bfloat16",
            CacheDtype::Float16 => "float16",
            CacheDtype::Float32 => "float32",
            CacheDtype::Fp8 => "fp8",
            CacheDtype::Fp8E4m3 => "fp8_e4m3",
            CacheDtype::Fp8E5m2 => "fp8_e5m2",
        }
    }
}

impl ModelDtype {
    /// The name as written in a manifest.
    pub fn as_str(self) -> &'static str {
        CacheDtype::from(self).as_str()
    }
}

/// Memory layout of a KV block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum KvLayout {
    /// Heads, then tokens, then head dim: each head's tokens are contiguous in a block.
    #[serde(rename = "HND")]
    Hnd,
    /// Tokens, then heads, then head dim.
    #[serde(rename = "NHD")]
    Nhd,
}

impl KvLayout {
    /// The name as written in a manifest.
    pub fn as_str(self) -> &'static str {
        match self {
            KvLayout::Hnd => "HND",
            KvLayout::Nhd => "NHD",
        }
    }
}

/// The two sides of a pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Computes KV cache.
    Prefill,
    /// Receives KV cache.
    Decode,
}

impl Role {
    /// Lower-case name, as used in labels, field paths and Deployment names.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The observed state of a PDPair, written by the operator.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PDPairStatus {
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// GeometryCompatible, PoolsApplied, PrefillReady, DecodeReady, TransferReady, TransferPath
    /// and Ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "schema::conditions")]
    pub conditions: Vec<Condition>,
    /// Replica counts of the prefill pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<PoolStatus>,
    /// Replica counts of the decode pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<PoolStatus>,
    /// Totals over the pair's PDEndpoints, as their node agents report them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<TransferStatus>,
}

/// Totals over a PDPair's engines.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TransferStatus {
    /// PDEndpoints (registered engine instances) of the pair.
    #[serde(default)]
    pub endpoints: i32,
    /// Sums of the endpoints' counters.
    #[serde(default, flatten)]
    pub counters: crate::TransferCounters,
}

/// Replica counts of one pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolStatus {
    /// Engine pods that belong to the pool.
    #[serde(default)]
    pub replicas: i32,
    /// Engine pods that are Ready.
    #[serde(default)]
    pub ready_replicas: i32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(name: &str, env_value: serde_json::Value) -> serde_json::Value {
        let kv = serde_json::json!({"engine": "vllm", "model": "m", "dtype": "bfloat16", "layers": 2,
            "kvHeads": 2, "headDim": 16, "attentionBackend": "FLASH_ATTN", "layout": "HND", "blockSize": 16});
        let template = serde_json::json!({"spec": {"containers": [
            {"name": "vllm", "image": "x", "env": [{"name": "PORT", "value": env_value}]}]}});
        serde_json::json!({
            "apiVersion": "pdpair.dev/v1alpha1", "kind": "PDPair",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"prefill": {"kv": kv, "template": template}, "decode": {"kv": kv}},
        })
    }

    #[test]
    fn a_stored_template_that_is_not_a_pod_template_is_the_objects_own_fault_not_the_lists() {
        // The CRD keeps templates whole and unchecked: one that does not parse must not fail a
        // list of PDPairs (the operator's watch reads them as one).
        let list = serde_json::json!({
            "apiVersion": "pdpair.dev/v1alpha1", "kind": "PDPairList", "metadata": {},
            "items": [stored("good", "8000".into()), stored("bad", 8000.into())],
        });
        let list: kube_core::ObjectList<PDPair> = serde_json::from_value(list).expect("the list parses");
        let [good, bad] = &list.items[..] else {
            panic!("two items")
        };
        assert!(good.spec.prefill.template.is_some() && good.spec.template_errors().is_empty());
        assert!(bad.spec.prefill.template.is_none(), "no template taken from it");
        let errors = bad.spec.template_errors();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].0, "spec.prefill.template");
        assert!(
            errors[0]
                .1
                .starts_with("spec.containers[0].env[0].value: invalid type: integer `8000`"),
            "{errors:?}"
        );
        // A pool without a template is bring-your-own, and no error.
        assert!(bad.spec.decode.template.is_none() && bad.spec.decode.template_error.is_none());
        // Serialised, the template is as parsed (the error is never written back).
        let out = serde_json::to_value(&good.spec).expect("json");
        assert_eq!(
            out["prefill"]["template"]["spec"]["containers"][0]["env"][0]["value"],
            "8000"
        );
        assert!(out["prefill"].get("templateError").is_none());
    }
}
