//! The compatibility rule table: can a prefill pool and a decode pool exchange KV?
//!
//! Every rule has a stable [`Reason`]; a [`Violation`] names the field it is about (a path in the
//! PDPair, such as `spec.decode.kv.kernelBlockSize`) and a message with both values. Rules run in
//! two stages: per-pool rules for both pools, then, only when neither pool is structurally invalid
//! (block size, parallelism, shape), the rules between the pools. `docs/rules.md` explains each
//! rule with the vLLM behaviour behind it.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{ChecksumPolicy, KvGeometry, KvLayout, PDPairSpec, Parallelism, Role, TransferMode};

/// Tensor-parallel ranks of a pool, at most (the node agent's bound on its own and its peers').
pub const MAX_TENSOR: i32 = 1024;

/// KV layers of a geometry, at most (the node agent's bound).
pub const MAX_LAYERS: i32 = 1024;

/// Stable reason codes, one per rule. The names are API: they appear in admission responses,
/// Events, conditions, metrics and the agent's handshake rejections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Reason {
    /// replicas < 0.
    InvalidReplicas,
    /// blockSize or kernelBlockSize < 1, or blockSize not a multiple of kernelBlockSize.
    InvalidBlockSize,
    /// tensor, pipeline or data parallelism < 1.
    InvalidParallelism,
    /// layers, kvHeads or headDim < 1.
    InvalidShape,
    /// The checksum reads 8-byte pieces, and a token's K+V bytes are not a multiple of 8.
    ChecksumUnsupported,
    /// Pipeline parallelism the transfer mode cannot serve.
    PipelineUnsupported,
    /// The engines differ in something that identifies the KV (model, dtype, shape, backend...).
    IdentityMismatch,
    /// The larger tensor parallel size is not a multiple of the smaller.
    TensorParallelNotDivisible,
    /// Prefill has more tensor-parallel ranks than decode and than KV heads.
    TensorParallelDirection,
    /// Different KV layouts (non-MLA).
    LayoutMismatch,
    /// Different tensor parallel sizes without an HND layout on prefill.
    HeterogeneousTensorParallelLayout,
    /// Push with different kernel block sizes.
    KernelBlockSizeMismatch,
    /// Push with different kernel blocks per logical block.
    KernelBlocksPerLogicalMismatch,
    /// Pull where decode's kernel block size is not a multiple of prefill's.
    BlockSizeNotDivisible,
    /// Pull with different kernel block sizes and a host KV buffer.
    HeterogeneousBlockSizeWithHostBuffer,
    /// Pull with different kernel block sizes and prefill TP larger than decode TP.
    HeterogeneousBlockSizeWithPrefillTpGreater,
    /// `transfer.connector` names a connector the pool's engine cannot load.
    ConnectorUnsupported,
    /// `transfer.handshakeTimeout` or `transfer.leaseDuration` outside what the node agent
    /// takes (1 ms to 1 h): its engines could never register.
    InvalidTransfer,
    /// A pool's `rollout` that no Deployment takes: a negative count, or `maxSurge` and
    /// `maxUnavailable` both 0.
    InvalidRollout,
}

impl Reason {
    /// Every reason, in rule-table order.
    pub const ALL: [Reason; 19] = [
        Reason::InvalidReplicas,
        Reason::InvalidBlockSize,
        Reason::InvalidParallelism,
        Reason::InvalidShape,
        Reason::ChecksumUnsupported,
        Reason::PipelineUnsupported,
        Reason::IdentityMismatch,
        Reason::TensorParallelNotDivisible,
        Reason::TensorParallelDirection,
        Reason::LayoutMismatch,
        Reason::HeterogeneousTensorParallelLayout,
        Reason::KernelBlockSizeMismatch,
        Reason::KernelBlocksPerLogicalMismatch,
        Reason::BlockSizeNotDivisible,
        Reason::HeterogeneousBlockSizeWithHostBuffer,
        Reason::HeterogeneousBlockSizeWithPrefillTpGreater,
        Reason::ConnectorUnsupported,
        Reason::InvalidTransfer,
        Reason::InvalidRollout,
    ];

    /// The PascalCase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::InvalidReplicas => "InvalidReplicas",
            Reason::InvalidBlockSize => "InvalidBlockSize",
            Reason::InvalidParallelism => "InvalidParallelism",
            Reason::InvalidShape => "InvalidShape",
            Reason::ChecksumUnsupported => "ChecksumUnsupported",
            Reason::PipelineUnsupported => "PipelineUnsupported",
            Reason::IdentityMismatch => "IdentityMismatch",
            Reason::TensorParallelNotDivisible => "TensorParallelNotDivisible",
            Reason::TensorParallelDirection => "TensorParallelDirection",
            Reason::LayoutMismatch => "LayoutMismatch",
            Reason::HeterogeneousTensorParallelLayout => "HeterogeneousTensorParallelLayout",
            Reason::KernelBlockSizeMismatch => "KernelBlockSizeMismatch",
            Reason::KernelBlocksPerLogicalMismatch => "KernelBlocksPerLogicalMismatch",
            Reason::BlockSizeNotDivisible => "BlockSizeNotDivisible",
            Reason::HeterogeneousBlockSizeWithHostBuffer => "HeterogeneousBlockSizeWithHostBuffer",
            Reason::HeterogeneousBlockSizeWithPrefillTpGreater => "HeterogeneousBlockSizeWithPrefillTpGreater",
            Reason::ConnectorUnsupported => "ConnectorUnsupported",
            Reason::InvalidTransfer => "InvalidTransfer",
            Reason::InvalidRollout => "InvalidRollout",
        }
    }

    /// Whether this reason marks a pool as structurally invalid, which stops the pair rules.
    pub fn is_structural(self) -> bool {
        matches!(
            self,
            Reason::InvalidBlockSize | Reason::InvalidParallelism | Reason::InvalidShape
        )
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One broken rule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// Stable reason code.
    pub reason: Reason,
    /// Path of the field the rule is about, e.g. `spec.decode.kv.kernelBlockSize`.
    pub field: String,
    /// What is wrong, naming both values.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.reason, self.field, self.message)
    }
}

/// The outcome of the rule table: allowed exactly when there are no violations.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    /// Every broken rule, in rule-table order (prefill's pool rules, decode's, then the pair's).
    pub violations: Vec<Violation>,
}

impl Verdict {
    /// Whether the pools may exchange KV.
    pub fn allowed(&self) -> bool {
        self.violations.is_empty()
    }

    /// Whether any violation has this reason.
    pub fn has(&self, reason: Reason) -> bool {
        self.violations.iter().any(|v| v.reason == reason)
    }

    /// The distinct reasons, in order of first appearance.
    pub fn reasons(&self) -> Vec<Reason> {
        let mut out: Vec<Reason> = Vec::new();
        for v in &self.violations {
            if !out.contains(&v.reason) {
                out.push(v.reason);
            }
        }
        out
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.allowed() {
            return f.write_str("compatible");
        }
        for (i, v) in self.violations.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{v}")?;
        }
        Ok(())
    }
}

/// What the rules need to know about one engine: its parallelism and KV geometry.
#[derive(Clone, Copy, Debug)]
pub struct Pool<'a> {
    /// Tensor, pipeline and data parallel sizes.
    pub parallelism: &'a Parallelism,
    /// The KV geometry.
    pub kv: &'a KvGeometry,
}

/// The shortest and longest `transfer.handshakeTimeout` and `transfer.leaseDuration` (the node
/// agent refuses an engine's registration outside them).
pub const TRANSFER_DURATIONS: std::ops::RangeInclusive<std::time::Duration> =
    std::time::Duration::from_millis(1)..=std::time::Duration::from_secs(3600);

/// Checks a whole PDPair spec: its transfer durations, the pools' connector, then [`check_pools`].
pub fn check(spec: &PDPairSpec) -> Verdict {
    let mut out = Rules::default();
    for (field, d) in [
        ("handshakeTimeout", &spec.transfer.handshake_timeout),
        ("leaseDuration", &spec.transfer.lease_duration),
    ] {
        if !TRANSFER_DURATIONS.contains(&d.get()) {
            out.0.push(Violation {
                reason: Reason::InvalidTransfer,
                field: format!("spec.transfer.{field}"),
                message: format!(
                    "transfer.{field} is {}; it must be 1ms to 1h (the node agent refuses its engines' registrations otherwise)",
                    d.as_str()
                ),
            });
        }
    }
    for (role, pool) in [(Role::Prefill, &spec.prefill), (Role::Decode, &spec.decode)] {
        if spec.transfer.connector == crate::Connector::Pdpair && pool.kv.engine != "vllm" {
            let msg = format!(
                "transfer.connector Pdpair is vLLM's connector; {role} kv.engine is {:?}, not \"vllm\"",
                pool.kv.engine
            );
            out.push(Reason::ConnectorUnsupported, role, "kv.engine", msg);
        }
    }
    let prefill = Pool {
        parallelism: &spec.prefill.parallelism,
        kv: &spec.prefill.kv,
    };
    let decode = Pool {
        parallelism: &spec.decode.parallelism,
        kv: &spec.decode.kv,
    };
    out.pools(
        spec.transfer.mode,
        spec.transfer.checksum,
        spec.transfer.connector,
        prefill,
        decode,
    );
    Verdict { violations: out.0 }
}

/// Checks what admission checks beyond [`check`]: the pools' `replicas` and `rollout`, which say
/// nothing about the KV (a stored one the API server refuses in the pool's Deployment turns
/// `PoolsApplied` False with both pools left running, where [`check`] failing plans no
/// Deployment at all).
pub fn check_admission(spec: &PDPairSpec) -> Verdict {
    let mut verdict = check(spec);
    let mut out = Rules::default();
    for (role, pool) in [(Role::Prefill, &spec.prefill), (Role::Decode, &spec.decode)] {
        if pool.replicas < 0 {
            let msg = format!("{role} replicas is {}; it must be 0 or more", pool.replicas);
            out.push(Reason::InvalidReplicas, role, "replicas", msg);
        }
        if let Some(r) = &pool.rollout {
            for (field, value) in [("maxSurge", r.max_surge), ("maxUnavailable", r.max_unavailable)] {
                if let Some(v) = value.filter(|v| *v < 0) {
                    let msg = format!("{role} rollout.{field} is {v}; it must be 0 or more");
                    out.push(Reason::InvalidRollout, role, &format!("rollout.{field}"), msg);
                }
            }
            if r.max_surge == Some(0) && r.max_unavailable == Some(0) {
                let msg = format!(
                    "{role} rollout.maxSurge and rollout.maxUnavailable are both 0: no pod could be replaced (set maxUnavailable 1 to replace one at a time with no pod above replicas)"
                );
                out.push(Reason::InvalidRollout, role, "rollout.maxUnavailable", msg);
            }
        }
    }
    verdict.violations.extend(out.0);
    verdict
}

/// Checks whether a prefill engine and a decode engine can exchange KV with this mode and
/// checksum policy. The node agent calls this at the handshake with the peers' real geometry.
pub fn check_pools(mode: TransferMode, checksum: ChecksumPolicy, prefill: Pool<'_>, decode: Pool<'_>) -> Verdict {
    let mut out = Rules::default();
    // The engines behind an agent speak its engine API (pdpair's connector or another client).
    out.pools(mode, checksum, crate::Connector::None, prefill, decode);
    Verdict { violations: out.0 }
}

#[derive(Default)]
struct Rules(Vec<Violation>);

impl Rules {
    fn push(&mut self, reason: Reason, role: Role, field: &str, message: String) {
        self.0.push(Violation {
            reason,
            field: format!("spec.{role}.{field}"),
            message,
        });
    }

    fn pools(
        &mut self,
        mode: TransferMode,
        checksum: ChecksumPolicy,
        connector: crate::Connector,
        prefill: Pool<'_>,
        decode: Pool<'_>,
    ) {
        let before = self.0.len();
        self.pool(mode, checksum, connector, Role::Prefill, prefill);
        self.pool(mode, checksum, connector, Role::Decode, decode);
        if self.0[before..].iter().any(|v| v.reason.is_structural()) {
            return;
        }
        self.identity(prefill.kv, decode.kv);
        self.parallel(prefill, decode);
        match mode {
            TransferMode::Push => self.push_blocks(prefill.kv, decode.kv),
            TransferMode::Pull => self.pull_blocks(prefill, decode),
        }
    }

    /// Rules about one pool alone (bounds: [`MAX_TENSOR`], [`MAX_LAYERS`]).
    fn pool(
        &mut self,
        mode: TransferMode,
        checksum: ChecksumPolicy,
        connector: crate::Connector,
        role: Role,
        pool: Pool<'_>,
    ) {
        let kv = pool.kv;
        let at_least_one = |name: &str, value: i32| format!("{role} {name} is {value}; it must be at least 1");
        if kv.block_size < 1 {
            self.push(
                Reason::InvalidBlockSize,
                role,
                "kv.blockSize",
                at_least_one("kv.blockSize", kv.block_size),
            );
        }
        if let Some(k) = kv.kernel_block_size.filter(|k| *k < 1) {
            self.push(
                Reason::InvalidBlockSize,
                role,
                "kv.kernelBlockSize",
                at_least_one("kv.kernelBlockSize", k),
            );
        }
        let kernel = kv.kernel_block_size();
        if kv.block_size >= 1 && kernel >= 1 && kv.block_size % kernel != 0 {
            let msg = format!(
                "{role} kv.blockSize {} is not a multiple of kv.kernelBlockSize {kernel}: a logical block must hold whole kernel blocks",
                kv.block_size
            );
            self.push(Reason::InvalidBlockSize, role, "kv.blockSize", msg);
        }
        let p = pool.parallelism;
        for (name, value) in [("tensor", p.tensor), ("pipeline", p.pipeline), ("data", p.data)] {
            if value < 1 {
                let field = format!("parallelism.{name}");
                self.push(Reason::InvalidParallelism, role, &field, at_least_one(&field, value));
            }
        }
        if p.tensor > MAX_TENSOR {
            let msg = format!(
                "{role} parallelism.tensor is {}; at most {MAX_TENSOR} (the node agent refuses more)",
                p.tensor
            );
            self.push(Reason::InvalidParallelism, role, "parallelism.tensor", msg);
        }
        // Tensor ranks split the KV heads evenly, or (more ranks than heads) replicate each head
        // on as many ranks (vLLM's QKVParallelLinear asserts either at startup; the node agent
        // lays ranks' heads out so). MLA KV is not split by head.
        let (tp, heads) = (p.tensor, kv.kv_heads);
        if !kv.mla && (1..=MAX_TENSOR).contains(&tp) && heads >= 1 && tp.max(heads) % tp.min(heads) != 0 {
            let msg = format!(
                "{role} parallelism.tensor is {tp} and kv.kvHeads is {heads}: tensor ranks must split the KV heads evenly (heads a multiple of ranks) or replicate them evenly (ranks a multiple of heads)"
            );
            self.push(Reason::InvalidParallelism, role, "parallelism.tensor", msg);
        }
        // An invalid shape (any InvalidShape) is not looked at further: ChecksumUnsupported
        // below would only add noise to it.
        let mut shape_ok = true;
        if kv.layers > MAX_LAYERS {
            shape_ok = false;
            let msg = format!(
                "{role} kv.layers is {}; at most {MAX_LAYERS} (the node agent refuses more)",
                kv.layers
            );
            self.push(Reason::InvalidShape, role, "kv.layers", msg);
        }
        for (name, value) in [
            ("layers", kv.layers),
            ("kvHeads", kv.kv_heads),
            ("headDim", kv.head_dim),
        ] {
            if value < 1 {
                shape_ok = false;
                let field = format!("kv.{name}");
                self.push(Reason::InvalidShape, role, &field, at_least_one(&field, value));
            }
        }
        if shape_ok && checksum != ChecksumPolicy::Disabled {
            let dtype = kv.resolved_cache_dtype();
            let bytes = dtype.element_bytes().unwrap_or(1);
            // K and V per token, or an MLA cache's one latent vector.
            let (arrays, what, take) = if kv.mla {
                (1, "latent", "takes")
            } else {
                (2, "K and V", "take")
            };
            let row = arrays * i64::from(kv.head_dim) * i64::from(bytes);
            if row % 8 != 0 {
                let msg = format!(
                    "checksum {checksum:?} reads 8-byte pieces, but a {role} token's {what} {take} {arrays} x headDim {} x {bytes} bytes ({}) = {row} bytes, not a multiple of 8",
                    kv.head_dim,
                    dtype.as_str()
                );
                self.push(Reason::ChecksumUnsupported, role, "kv.headDim", msg);
            }
        }
        if p.pipeline > 1 {
            match (mode, role) {
                (TransferMode::Push, Role::Decode) => {
                    let msg = format!(
                        "decode parallelism.pipeline is {}, but push cannot write into a pipeline-parallel decode engine; use 1, or mode Pull",
                        p.pipeline
                    );
                    self.push(Reason::PipelineUnsupported, role, "parallelism.pipeline", msg);
                }
                (TransferMode::Pull, _) if kv.hybrid => {
                    let msg = format!(
                        "{role} parallelism.pipeline is {} with kv.hybrid true, but pull cannot use the hybrid KV cache manager with pipeline parallelism",
                        p.pipeline
                    );
                    self.push(Reason::PipelineUnsupported, role, "parallelism.pipeline", msg);
                }
                _ if connector == crate::Connector::Pdpair => {
                    let msg = format!(
                        "{role} parallelism.pipeline is {}, but pdpair's connector (transfer.connector Pdpair) runs no pipeline-parallel engine: each stage holds only its layers' KV, and the node agent moves a tensor rank's whole pool; use 1",
                        p.pipeline
                    );
                    self.push(Reason::PipelineUnsupported, role, "parallelism.pipeline", msg);
                }
                _ => {}
            }
        }
    }

    /// One IdentityMismatch per differing identity field.
    fn identity(&mut self, p: &KvGeometry, d: &KvGeometry) {
        let quoted = |s: &str| format!("{s:?}");
        let mut pairs: Vec<(&str, String, String)> = vec![
            ("engine", quoted(&p.engine), quoted(&d.engine)),
            ("model", quoted(&p.model), quoted(&d.model)),
            ("dtype", p.dtype.as_str().into(), d.dtype.as_str().into()),
            ("cacheDtype", resolved_dtype_text(p), resolved_dtype_text(d)),
            ("layers", p.layers.to_string(), d.layers.to_string()),
            ("kvHeads", p.kv_heads.to_string(), d.kv_heads.to_string()),
            ("headDim", p.head_dim.to_string(), d.head_dim.to_string()),
            (
                "attentionBackend",
                quoted(&p.attention_backend),
                quoted(&d.attention_backend),
            ),
            ("mla", p.mla.to_string(), d.mla.to_string()),
            ("hybrid", p.hybrid.to_string(), d.hybrid.to_string()),
        ];
        if let (Some(pv), Some(dv)) = (&p.engine_version, &d.engine_version) {
            pairs.insert(1, ("engineVersion", quoted(pv), quoted(dv)));
        }
        // cacheDtype compares the resolved dtypes, not the text.
        let same_cache = p.resolved_cache_dtype() == d.resolved_cache_dtype();
        for (field, pv, dv) in pairs {
            let differs = if field == "cacheDtype" { !same_cache } else { pv != dv };
            if differs {
                let msg =
                    format!("prefill kv.{field} is {pv} but decode kv.{field} is {dv}; both engines must agree on it");
                self.push(Reason::IdentityMismatch, Role::Decode, &format!("kv.{field}"), msg);
            }
        }
    }

    /// Tensor parallelism and layout rules.
    fn parallel(&mut self, p: Pool<'_>, d: Pool<'_>) {
        let (ptp, dtp) = (p.parallelism.tensor, d.parallelism.tensor);
        let mla = p.kv.mla && d.kv.mla;
        let heads = p.kv.kv_heads;
        if ptp.max(dtp) % ptp.min(dtp) != 0 {
            let msg = format!(
                "prefill parallelism.tensor is {ptp} and decode parallelism.tensor is {dtp}; the larger must be a multiple of the smaller"
            );
            self.push(
                Reason::TensorParallelNotDivisible,
                Role::Decode,
                "parallelism.tensor",
                msg,
            );
        }
        if ptp > dtp && !mla && ptp > heads {
            let msg = format!(
                "prefill parallelism.tensor {ptp} is larger than decode's {dtp} and than kv.kvHeads {heads}: prefill replicates KV heads, which cannot be split onto decode's ranks"
            );
            self.push(
                Reason::TensorParallelDirection,
                Role::Prefill,
                "parallelism.tensor",
                msg,
            );
        }
        // One latent vector per token (MLA with one KV head) is laid out the same either way.
        if !(mla && heads == 1) && p.kv.layout != d.kv.layout {
            let msg = format!(
                "prefill kv.layout is {} but decode kv.layout is {}; KV of several heads must use one layout on both sides",
                p.kv.layout.as_str(),
                d.kv.layout.as_str()
            );
            self.push(Reason::LayoutMismatch, Role::Decode, "kv.layout", msg);
        }
        if ptp != dtp && !mla && ptp <= heads && p.kv.layout != KvLayout::Hnd {
            let msg = format!(
                "prefill parallelism.tensor {ptp} differs from decode's {dtp}, which needs the block-contiguous HND layout on prefill, but prefill kv.layout is {}",
                p.kv.layout.as_str()
            );
            self.push(
                Reason::HeterogeneousTensorParallelLayout,
                Role::Prefill,
                "kv.layout",
                msg,
            );
        }
    }

    /// Push writes whole kernel blocks in place: no conversion, no re-pairing.
    fn push_blocks(&mut self, p: &KvGeometry, d: &KvGeometry) {
        let (pk, dk) = (p.kernel_block_size(), d.kernel_block_size());
        if pk != dk {
            let msg = format!(
                "push needs identical kernel block sizes, but prefill's kv.kernelBlockSize is {pk} and decode's is {dk}"
            );
            self.push(Reason::KernelBlockSizeMismatch, Role::Decode, "kv.kernelBlockSize", msg);
        }
        let (pn, dn) = (p.block_size / pk, d.block_size / dk);
        if pn != dn {
            let msg = format!(
                "push needs the same kernel blocks per logical block, but prefill has {pn} (blockSize {} / kernelBlockSize {pk}) and decode has {dn} (blockSize {} / kernelBlockSize {dk})",
                p.block_size, d.block_size
            );
            self.push(
                Reason::KernelBlocksPerLogicalMismatch,
                Role::Decode,
                "kv.blockSize",
                msg,
            );
        }
    }

    /// Pull reads prefill's blocks into decode's, which must be whole multiples of them.
    fn pull_blocks(&mut self, p: Pool<'_>, d: Pool<'_>) {
        let (pk, dk) = (p.kv.kernel_block_size(), d.kv.kernel_block_size());
        if dk % pk != 0 {
            let msg = format!(
                "pull needs decode's kernel block size to be a multiple of prefill's, but decode's kv.kernelBlockSize is {dk} and prefill's is {pk}"
            );
            self.push(Reason::BlockSizeNotDivisible, Role::Decode, "kv.kernelBlockSize", msg);
        }
        if pk == dk {
            return;
        }
        if p.kv.host_buffer || d.kv.host_buffer {
            let role = if p.kv.host_buffer { Role::Prefill } else { Role::Decode };
            let msg = format!(
                "kernel block sizes differ (prefill {pk}, decode {dk}), which pull cannot combine with a host KV buffer (prefill kv.hostBuffer {}, decode kv.hostBuffer {})",
                p.kv.host_buffer, d.kv.host_buffer
            );
            self.push(Reason::HeterogeneousBlockSizeWithHostBuffer, role, "kv.hostBuffer", msg);
        }
        let (ptp, dtp) = (p.parallelism.tensor, d.parallelism.tensor);
        if ptp > dtp && !(p.kv.mla && d.kv.mla) && ptp <= p.kv.kv_heads {
            let msg = format!(
                "kernel block sizes differ (prefill {pk}, decode {dk}), which pull cannot combine with head-sharded KV where prefill parallelism.tensor {ptp} is larger than decode's {dtp}"
            );
            self.push(
                Reason::HeterogeneousBlockSizeWithPrefillTpGreater,
                Role::Prefill,
                "parallelism.tensor",
                msg,
            );
        }
    }
}

fn resolved_dtype_text(kv: &KvGeometry) -> String {
    let resolved = kv.resolved_cache_dtype().as_str();
    if kv.cache_dtype == crate::CacheDtype::Auto {
        format!("{resolved} (auto)")
    } else {
        resolved.to_owned()
    }
}

#[cfg(test)]
mod tests;
