//! Every rule with a case that passes and one that fails, the vLLM push-fix cases, and properties.

use proptest::prelude::*;

use super::*;
use crate::{CacheDtype, ModelDtype, PoolSpec, Rollout, TransferSpec};

fn kv(block: i32, kernel: Option<i32>) -> KvGeometry {
    KvGeometry {
        engine: "vllm".into(),
        engine_version: None,
        model: "meta-llama/Llama-3.1-8B-Instruct".into(),
        dtype: ModelDtype::Bfloat16,
        cache_dtype: CacheDtype::Auto,
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        attention_backend: "FLASH_ATTN".into(),
        layout: KvLayout::Hnd,
        block_size: block,
        kernel_block_size: kernel,
        mla: false,
        hybrid: false,
        host_buffer: false,
    }
}

fn pool(kv: KvGeometry) -> PoolSpec {
    PoolSpec {
        replicas: 1,
        parallelism: Parallelism::default(),
        template: None,
        kv,
        rollout: None,
        template_error: None,
    }
}

fn pair(mode: TransferMode, prefill: PoolSpec, decode: PoolSpec) -> PDPairSpec {
    PDPairSpec {
        transfer: TransferSpec {
            mode,
            ..TransferSpec::default()
        },
        prefill,
        decode,
    }
}

fn push() -> PDPairSpec {
    pair(TransferMode::Push, pool(kv(16, None)), pool(kv(16, None)))
}

fn pull() -> PDPairSpec {
    pair(TransferMode::Pull, pool(kv(16, None)), pool(kv(16, None)))
}

/// The reasons of a spec's violations, in order.
fn reasons(spec: &PDPairSpec) -> Vec<Reason> {
    check(spec).violations.iter().map(|v| v.reason).collect()
}

/// Asserts the spec is rejected with exactly one violation of this reason and field, whose message
/// holds every `values` string.
#[track_caller]
fn rejects(spec: &PDPairSpec, reason: Reason, field: &str, values: &[&str]) {
    refused(check(spec), reason, field, values);
}

/// `verdict` refuses once for `reason`, at `field`, naming each of `values`.
#[track_caller]
fn refused(verdict: Verdict, reason: Reason, field: &str, values: &[&str]) {
    assert!(!verdict.allowed());
    let hits: Vec<&Violation> = verdict.violations.iter().filter(|v| v.reason == reason).collect();
    assert_eq!(hits.len(), 1, "expected one {reason}, got {verdict}");
    assert_eq!(hits[0].field, field, "{verdict}");
    for value in values {
        assert!(hits[0].message.contains(value), "{:?} lacks {value:?}", hits[0].message);
    }
}

#[track_caller]
fn admits(spec: &PDPairSpec) {
    let verdict = check(spec);
    assert!(verdict.allowed(), "{verdict}");
}

#[test]
fn baselines_are_admitted() {
    admits(&push());
    admits(&pull());
}

// --- vLLM's push fix (PR 59747) and the pull cases -------------------------------------------

#[test]
fn vllm_push_16_64_flash_attn_is_kernel_block_size_mismatch() {
    let spec = pair(TransferMode::Push, pool(kv(16, None)), pool(kv(64, None)));
    rejects(
        &spec,
        Reason::KernelBlockSizeMismatch,
        "spec.decode.kv.kernelBlockSize",
        &["16", "64"],
    );
}

#[test]
fn vllm_push_flashinfer_128_64_is_blocks_per_logical_mismatch() {
    let mut p = kv(128, Some(64));
    let mut d = kv(64, Some(64));
    p.attention_backend = "FLASHINFER".into();
    d.attention_backend = "FLASHINFER".into();
    let spec = pair(TransferMode::Push, pool(p), pool(d));
    assert_eq!(reasons(&spec), vec![Reason::KernelBlocksPerLogicalMismatch]);
    rejects(
        &spec,
        Reason::KernelBlocksPerLogicalMismatch,
        "spec.decode.kv.blockSize",
        &["has 2", "has 1", "128", "64"],
    );
}

#[test]
fn vllm_push_64_64_is_admitted() {
    admits(&pair(TransferMode::Push, pool(kv(64, None)), pool(kv(64, None))));
}

#[test]
fn vllm_pull_16_32_is_admitted() {
    admits(&pair(TransferMode::Pull, pool(kv(16, None)), pool(kv(32, None))));
}

#[test]
fn vllm_pull_32_16_is_block_size_not_divisible() {
    let spec = pair(TransferMode::Pull, pool(kv(32, None)), pool(kv(16, None)));
    assert_eq!(reasons(&spec), vec![Reason::BlockSizeNotDivisible]);
    rejects(
        &spec,
        Reason::BlockSizeNotDivisible,
        "spec.decode.kv.kernelBlockSize",
        &["16", "32"],
    );
}

// --- per-pool rules ----------------------------------------------------------------------------

#[test]
fn transfer_durations_the_node_agent_refuses_are_rejected() {
    // The agent refuses an engine's registration with a handshake timeout or lease of 0 ms or
    // over an hour: admitted, such a pair's engines could never register.
    let mut spec = push();
    for ok in ["1ms", "5s", "1h"] {
        spec.transfer.handshake_timeout = ok.parse().expect("duration");
        spec.transfer.lease_duration = ok.parse().expect("duration");
        admits(&spec);
    }
    spec.transfer.handshake_timeout = "0s".parse().expect("duration");
    rejects(
        &spec,
        Reason::InvalidTransfer,
        "spec.transfer.handshakeTimeout",
        &["0s", "1ms to 1h"],
    );
    spec.transfer.handshake_timeout = "0.5ms".parse().expect("duration");
    rejects(
        &spec,
        Reason::InvalidTransfer,
        "spec.transfer.handshakeTimeout",
        &["0.5ms"],
    );
    spec.transfer.handshake_timeout = "5s".parse().expect("duration");
    spec.transfer.lease_duration = "1h0.001s".parse().expect("duration");
    rejects(
        &spec,
        Reason::InvalidTransfer,
        "spec.transfer.leaseDuration",
        &["1h0.001s"],
    );
}

#[test]
fn invalid_replicas() {
    // Refused at admission only, as a rollout is: a negative one stored from before the CRD's
    // schema bounded it leaves both pools running where the API server refuses the Deployment,
    // rather than the KV rules planning none (pruning both).
    let mut spec = push();
    spec.decode.replicas = 0;
    assert!(check_admission(&spec).allowed());
    spec.decode.replicas = -1;
    refused(
        check_admission(&spec),
        Reason::InvalidReplicas,
        "spec.decode.replicas",
        &["-1"],
    );
    admits(&spec);
}

#[test]
fn invalid_rollout() {
    // Refused at admission only: the KV rules (which plan the pools) say nothing of it, so a
    // stored one (the webhook skipped) leaves both pools running where the API server refuses
    // the Deployment, rather than planning none.
    let admission = |spec: &PDPairSpec| check_admission(spec).violations;
    let mut spec = push();
    // One pod at a time, none above replicas: what nodes with no GPU to spare need.
    spec.decode.rollout = Some(Rollout {
        max_surge: Some(0),
        max_unavailable: Some(1),
    });
    assert_eq!(admission(&spec), []);
    spec.decode.rollout = Some(Rollout {
        max_surge: Some(0),
        max_unavailable: Some(0),
    });
    assert_eq!(admission(&spec).len(), 1);
    refused(
        check_admission(&spec),
        Reason::InvalidRollout,
        "spec.decode.rollout.maxUnavailable",
        &["both 0"],
    );
    admits(&spec);
    spec.decode.rollout = Some(Rollout {
        max_surge: Some(-2),
        max_unavailable: None,
    });
    assert_eq!(admission(&spec).len(), 1);
    refused(
        check_admission(&spec),
        Reason::InvalidRollout,
        "spec.decode.rollout.maxSurge",
        &["-2"],
    );
    admits(&spec);
    spec.decode.rollout = Some(Rollout::default());
    assert_eq!(admission(&spec), []);
    // Both admission's, after the KV rules' violations.
    spec.decode.replicas = -1;
    spec.decode.rollout = Some(Rollout {
        max_surge: Some(0),
        max_unavailable: Some(0),
    });
    let reasons: Vec<Reason> = admission(&spec).iter().map(|v| v.reason).collect();
    assert_eq!(reasons, [Reason::InvalidReplicas, Reason::InvalidRollout]);
    spec.decode.kv.block_size = 0;
    let reasons: Vec<Reason> = admission(&spec).iter().map(|v| v.reason).collect();
    assert_eq!(
        reasons,
        [
            Reason::InvalidBlockSize,
            Reason::InvalidReplicas,
            Reason::InvalidRollout
        ],
        "the KV rules' first: GeometryCompatible's reason, as the webhook's"
    );
}

#[test]
fn invalid_block_size() {
    let mut spec = push();
    spec.prefill.kv = kv(32, Some(16));
    spec.decode.kv = kv(32, Some(16));
    admits(&spec);
    spec.prefill.kv.block_size = 0;
    rejects(&spec, Reason::InvalidBlockSize, "spec.prefill.kv.blockSize", &["0"]);
    spec.prefill.kv = kv(32, Some(0));
    rejects(
        &spec,
        Reason::InvalidBlockSize,
        "spec.prefill.kv.kernelBlockSize",
        &["0"],
    );
    spec.prefill.kv = kv(48, Some(32));
    rejects(
        &spec,
        Reason::InvalidBlockSize,
        "spec.prefill.kv.blockSize",
        &["48", "32"],
    );
}

#[test]
fn invalid_parallelism() {
    for (name, set) in [
        ("tensor", (|p: &mut Parallelism| p.tensor = 0) as fn(&mut Parallelism)),
        ("pipeline", |p| p.pipeline = 0),
        ("data", |p| p.data = -2),
    ] {
        let mut spec = pull();
        set(&mut spec.decode.parallelism);
        rejects(
            &spec,
            Reason::InvalidParallelism,
            &format!("spec.decode.parallelism.{name}"),
            &["is"],
        );
    }
    let mut spec = pull();
    spec.decode.parallelism.data = 4;
    admits(&spec);
}

#[test]
fn tensor_ranks_that_split_kv_heads_unevenly_are_invalid_parallelism() {
    // 8 KV heads: 1, 2, 4, 8 ranks split them; 16 and 32 replicate each head on 2 and 4 ranks.
    for tp in [1, 2, 4, 8, 16, 32] {
        let mut spec = pull();
        (spec.prefill.parallelism.tensor, spec.decode.parallelism.tensor) = (tp, tp);
        admits(&spec);
    }
    // 3 ranks cannot split 8 heads (vLLM refuses it at startup; the agent would leave heads
    // 6 and 7 to no rank), and 12 ranks cannot replicate them evenly.
    for tp in [3, 6, 12] {
        let mut spec = pull();
        spec.prefill.parallelism.tensor = tp;
        rejects(
            &spec,
            Reason::InvalidParallelism,
            "spec.prefill.parallelism.tensor",
            &[&tp.to_string(), "kv.kvHeads is 8", "evenly"],
        );
        assert_eq!(
            reasons(&spec),
            vec![Reason::InvalidParallelism],
            "structural: nothing more"
        );
    }
    // MLA KV is not split by head.
    let mut spec = pull();
    for side in [&mut spec.prefill, &mut spec.decode] {
        side.kv.mla = true;
        side.kv.kv_heads = 3;
        side.parallelism.tensor = 2;
    }
    admits(&spec);
}

#[test]
fn invalid_shape() {
    for (name, set) in [
        ("layers", (|k: &mut KvGeometry| k.layers = 0) as fn(&mut KvGeometry)),
        ("kvHeads", |k| k.kv_heads = 0),
        ("headDim", |k| k.head_dim = -1),
    ] {
        let mut spec = push();
        set(&mut spec.prefill.kv);
        rejects(
            &spec,
            Reason::InvalidShape,
            &format!("spec.prefill.kv.{name}"),
            &["must be at least 1"],
        );
    }
}

#[test]
fn more_tensor_ranks_or_layers_than_the_node_agent_takes_are_refused() {
    // Admitted on paper, refused by every agent at registration.
    let mut spec = push();
    (spec.prefill.parallelism.tensor, spec.decode.parallelism.tensor) = (MAX_TENSOR, MAX_TENSOR);
    (spec.prefill.kv.layers, spec.decode.kv.layers) = (MAX_LAYERS, MAX_LAYERS);
    (spec.prefill.kv.kv_heads, spec.decode.kv.kv_heads) = (MAX_TENSOR, MAX_TENSOR);
    admits(&spec);
    spec.decode.parallelism.tensor = MAX_TENSOR + 1;
    rejects(
        &spec,
        Reason::InvalidParallelism,
        "spec.decode.parallelism.tensor",
        &["is 1025; at most 1024"],
    );
    let mut spec = push();
    spec.prefill.kv.layers = MAX_LAYERS + 1;
    rejects(
        &spec,
        Reason::InvalidShape,
        "spec.prefill.kv.layers",
        &["is 1025; at most 1024"],
    );
}

#[test]
fn structural_violations_stop_the_pair_rules() {
    // Decode differs in model and block size, but prefill is structurally invalid: only the
    // structural violation is reported.
    let mut spec = pair(TransferMode::Push, pool(kv(16, None)), pool(kv(64, None)));
    spec.decode.kv.model = "other".into();
    spec.prefill.kv.layers = 0;
    assert_eq!(reasons(&spec), vec![Reason::InvalidShape]);
}

#[test]
fn checksum_unsupported() {
    let mut spec = push();
    spec.transfer.checksum = ChecksumPolicy::FailClosed;
    // 2 * 128 * 2 bytes = 512: fine.
    admits(&spec);
    // fp8 with headDim 2: 2 * 2 * 1 = 4 bytes per token, not a multiple of 8.
    for k in [&mut spec.prefill.kv, &mut spec.decode.kv] {
        k.head_dim = 2;
        k.cache_dtype = CacheDtype::Fp8E4m3;
    }
    let verdict = check(&spec);
    assert_eq!(verdict.reasons(), vec![Reason::ChecksumUnsupported]);
    assert_eq!(verdict.violations.len(), 2, "{verdict}");
    // Not looked at on an invalid shape: too few layers, or more than the agent takes.
    for layers in [0, MAX_LAYERS + 1] {
        let mut bad = spec.clone();
        bad.prefill.kv.layers = layers;
        let verdict = check(&bad);
        assert!(
            !verdict
                .violations
                .iter()
                .any(|v| v.reason == Reason::ChecksumUnsupported && v.field.starts_with("spec.prefill")),
            "layers {layers}: {verdict}"
        );
    }
    assert!(verdict.violations[0].message.contains("headDim 2") && verdict.violations[0].message.contains("= 4 bytes"));
    // MLA's one latent vector per token: headDim 4 of fp16 is 8 bytes, fine; headDim 6 is 12
    // (as K and V it would have been 24, and passed).
    let mut mla = spec.clone();
    for k in [&mut mla.prefill.kv, &mut mla.decode.kv] {
        (k.mla, k.kv_heads, k.cache_dtype) = (true, 1, CacheDtype::Auto);
        k.dtype = ModelDtype::Float16;
        k.head_dim = 4;
    }
    admits(&mla);
    for k in [&mut mla.prefill.kv, &mut mla.decode.kv] {
        k.head_dim = 6;
    }
    let verdict = check(&mla);
    assert_eq!(verdict.reasons(), vec![Reason::ChecksumUnsupported], "{verdict}");
    assert!(
        verdict.violations[0]
            .message
            .contains("latent takes 1 x headDim 6 x 2 bytes")
            && verdict.violations[0].message.contains("= 12 bytes"),
        "{verdict}"
    );
    // Disabled: not evaluated.
    spec.transfer.checksum = ChecksumPolicy::Disabled;
    admits(&spec);
    // auto resolves to float32 (4 bytes): 2 * 3 * 4 = 24, a multiple of 8.
    spec.transfer.checksum = ChecksumPolicy::FailOpen;
    for k in [&mut spec.prefill.kv, &mut spec.decode.kv] {
        k.head_dim = 3;
        k.dtype = ModelDtype::Float32;
        k.cache_dtype = CacheDtype::Auto;
    }
    admits(&spec);
}

#[test]
fn checksum_not_evaluated_on_invalid_shape() {
    let mut spec = push();
    spec.transfer.checksum = ChecksumPolicy::FailClosed;
    spec.prefill.kv.head_dim = 0;
    assert_eq!(reasons(&spec), vec![Reason::InvalidShape]);
}

#[test]
fn pipeline_unsupported() {
    // Push: prefill may be pipeline parallel, decode may not.
    let mut spec = push();
    spec.prefill.parallelism.pipeline = 2;
    admits(&spec);
    spec.decode.parallelism.pipeline = 2;
    rejects(
        &spec,
        Reason::PipelineUnsupported,
        "spec.decode.parallelism.pipeline",
        &["2", "push"],
    );
    // Pull: pipeline is fine without hybrid, refused with it.
    let mut spec = pull();
    spec.decode.parallelism.pipeline = 4;
    admits(&spec);
    spec.prefill.kv.hybrid = true;
    spec.decode.kv.hybrid = true;
    rejects(
        &spec,
        Reason::PipelineUnsupported,
        "spec.decode.parallelism.pipeline",
        &["4", "hybrid"],
    );
    // pdpair's connector runs no pipeline-parallel engine, on either side, in either mode.
    for mode in [TransferMode::Push, TransferMode::Pull] {
        let mut spec = pair(mode, pool(kv(16, None)), pool(kv(16, None)));
        spec.transfer.connector = crate::Connector::Pdpair;
        spec.prefill.parallelism.pipeline = 2;
        rejects(
            &spec,
            Reason::PipelineUnsupported,
            "spec.prefill.parallelism.pipeline",
            &["2", "transfer.connector Pdpair"],
        );
        assert_eq!(reasons(&spec), vec![Reason::PipelineUnsupported], "{mode:?}");
    }
}

// --- pair rules --------------------------------------------------------------------------------

#[test]
fn identity_mismatch_one_per_field() {
    let mut spec = push();
    let d = &mut spec.decode.kv;
    d.engine = "sglang".into();
    d.model = "other/model".into();
    d.dtype = ModelDtype::Float16;
    d.layers = 40;
    d.kv_heads = 4;
    d.head_dim = 64;
    d.attention_backend = "FLASHINFER".into();
    d.mla = true;
    d.hybrid = true;
    let verdict = check(&spec);
    let fields: Vec<&str> = verdict
        .violations
        .iter()
        .filter(|v| v.reason == Reason::IdentityMismatch)
        .map(|v| v.field.as_str())
        .collect();
    // dtype differs, and so does the auto-resolved cache dtype.
    assert_eq!(
        fields,
        [
            "spec.decode.kv.engine",
            "spec.decode.kv.model",
            "spec.decode.kv.dtype",
            "spec.decode.kv.cacheDtype",
            "spec.decode.kv.layers",
            "spec.decode.kv.kvHeads",
            "spec.decode.kv.headDim",
            "spec.decode.kv.attentionBackend",
            "spec.decode.kv.mla",
            "spec.decode.kv.hybrid",
        ]
    );
    assert!(
        verdict.violations[1]
            .message
            .contains("\"meta-llama/Llama-3.1-8B-Instruct\"")
            && verdict.violations[1].message.contains("\"other/model\"")
    );
}

#[test]
fn identity_cache_dtype_compares_resolved_values() {
    let mut spec = push();
    spec.decode.kv.cache_dtype = CacheDtype::Bfloat16; // auto on prefill resolves to bfloat16
    admits(&spec);
    spec.decode.kv.cache_dtype = CacheDtype::Fp8;
    rejects(
        &spec,
        Reason::IdentityMismatch,
        "spec.decode.kv.cacheDtype",
        &["bfloat16 (auto)", "fp8"],
    );
}

#[test]
fn identity_engine_version_only_when_both_set() {
    let mut spec = push();
    spec.prefill.kv.engine_version = Some("0.11.0".into());
    admits(&spec);
    spec.decode.kv.engine_version = Some("0.11.0".into());
    admits(&spec);
    spec.decode.kv.engine_version = Some("0.12.0".into());
    rejects(
        &spec,
        Reason::IdentityMismatch,
        "spec.decode.kv.engineVersion",
        &["0.11.0", "0.12.0"],
    );
}

#[test]
fn tensor_parallel_not_divisible() {
    let mut spec = push();
    // 12 heads: 2, 3 and 4 ranks each split them evenly.
    spec.prefill.kv.kv_heads = 12;
    spec.decode.kv.kv_heads = 12;
    spec.prefill.parallelism.tensor = 2;
    spec.decode.parallelism.tensor = 4;
    admits(&spec);
    spec.prefill.parallelism.tensor = 3;
    rejects(
        &spec,
        Reason::TensorParallelNotDivisible,
        "spec.decode.parallelism.tensor",
        &["3", "4"],
    );
}

#[test]
fn tensor_parallel_direction() {
    // P tp 4 > D tp 2, with 8 KV heads: P shards heads, fine.
    let mut spec = push();
    spec.prefill.parallelism.tensor = 4;
    spec.decode.parallelism.tensor = 2;
    admits(&spec);
    // 2 KV heads: P replicates them.
    spec.prefill.kv.kv_heads = 2;
    spec.decode.kv.kv_heads = 2;
    rejects(
        &spec,
        Reason::TensorParallelDirection,
        "spec.prefill.parallelism.tensor",
        &["4", "2"],
    );
    // MLA on both sides is not head-sharded.
    spec.prefill.kv.mla = true;
    spec.decode.kv.mla = true;
    admits(&spec);
    // MLA on one side only does not count as MLA (and is itself an identity mismatch).
    spec.decode.kv.mla = false;
    assert!(check(&spec).has(Reason::TensorParallelDirection));
}

#[test]
fn layout_mismatch() {
    let mut spec = push();
    spec.decode.kv.layout = KvLayout::Nhd;
    rejects(&spec, Reason::LayoutMismatch, "spec.decode.kv.layout", &["HND", "NHD"]);
    spec.prefill.kv.layout = KvLayout::Nhd;
    admits(&spec);
    spec.prefill.kv.layout = KvLayout::Hnd;
    spec.prefill.kv.mla = true;
    spec.decode.kv.mla = true;
    // MLA with several heads per token: the layouts still place them differently.
    rejects(&spec, Reason::LayoutMismatch, "spec.decode.kv.layout", &["HND", "NHD"]);
    // One latent vector per token (vLLM's MLA caches): HND and NHD are the same bytes.
    spec.prefill.kv.kv_heads = 1;
    spec.decode.kv.kv_heads = 1;
    admits(&spec);
}

#[test]
fn heterogeneous_tensor_parallel_layout() {
    let mut spec = push();
    spec.decode.parallelism.tensor = 2;
    admits(&spec); // HND on prefill
    spec.prefill.kv.layout = KvLayout::Nhd;
    spec.decode.kv.layout = KvLayout::Nhd;
    rejects(
        &spec,
        Reason::HeterogeneousTensorParallelLayout,
        "spec.prefill.kv.layout",
        &["1", "2", "NHD"],
    );
    spec.decode.parallelism.tensor = 1;
    admits(&spec); // same TP: any shared layout
}

#[test]
fn kernel_block_size_mismatch_push_only() {
    let spec = pair(TransferMode::Push, pool(kv(32, Some(16))), pool(kv(64, Some(32))));
    assert_eq!(reasons(&spec), vec![Reason::KernelBlockSizeMismatch]);
    admits(&pair(
        TransferMode::Push,
        pool(kv(32, Some(16))),
        pool(kv(32, Some(16))),
    ));
    admits(&pair(
        TransferMode::Pull,
        pool(kv(32, Some(16))),
        pool(kv(64, Some(32))),
    ));
}

#[test]
fn kernel_blocks_per_logical_mismatch_push_only() {
    let spec = pair(TransferMode::Push, pool(kv(32, Some(16))), pool(kv(16, Some(16))));
    rejects(
        &spec,
        Reason::KernelBlocksPerLogicalMismatch,
        "spec.decode.kv.blockSize",
        &["has 2", "has 1"],
    );
    admits(&pair(
        TransferMode::Pull,
        pool(kv(32, Some(16))),
        pool(kv(16, Some(16))),
    ));
}

#[test]
fn block_size_not_divisible_pull_only() {
    let spec = pair(TransferMode::Pull, pool(kv(48, None)), pool(kv(64, None)));
    rejects(
        &spec,
        Reason::BlockSizeNotDivisible,
        "spec.decode.kv.kernelBlockSize",
        &["64", "48"],
    );
    admits(&pair(TransferMode::Pull, pool(kv(16, None)), pool(kv(64, None))));
}

#[test]
fn heterogeneous_block_size_with_host_buffer() {
    let mut spec = pair(TransferMode::Pull, pool(kv(16, None)), pool(kv(32, None)));
    spec.decode.kv.host_buffer = true;
    rejects(
        &spec,
        Reason::HeterogeneousBlockSizeWithHostBuffer,
        "spec.decode.kv.hostBuffer",
        &["16", "32", "true"],
    );
    spec.prefill.kv.host_buffer = true;
    rejects(
        &spec,
        Reason::HeterogeneousBlockSizeWithHostBuffer,
        "spec.prefill.kv.hostBuffer",
        &["true"],
    );
    // Same kernel block size: a host buffer is fine.
    spec.decode.kv = kv(16, None);
    spec.decode.kv.host_buffer = true;
    admits(&spec);
}

#[test]
fn heterogeneous_block_size_with_prefill_tp_greater() {
    let mut spec = pair(TransferMode::Pull, pool(kv(16, None)), pool(kv(32, None)));
    spec.prefill.parallelism.tensor = 2;
    rejects(
        &spec,
        Reason::HeterogeneousBlockSizeWithPrefillTpGreater,
        "spec.prefill.parallelism.tensor",
        &["2", "1"],
    );
    // Same kernel sizes: heterogeneous TP is fine (HND on prefill).
    spec.decode.kv = kv(16, None);
    admits(&spec);
    // MLA on both sides: not head-sharded.
    let mut spec = pair(TransferMode::Pull, pool(kv(16, None)), pool(kv(32, None)));
    spec.prefill.parallelism.tensor = 2;
    spec.prefill.kv.mla = true;
    spec.decode.kv.mla = true;
    admits(&spec);
}

#[test]
fn connector_unsupported() {
    let mut spec = push();
    spec.transfer.connector = crate::Connector::Pdpair;
    admits(&spec);
    spec.decode.kv.engine = "sglang".into();
    rejects(
        &spec,
        Reason::ConnectorUnsupported,
        "spec.decode.kv.engine",
        &["sglang", "vllm"],
    );
    spec.transfer.connector = crate::Connector::None;
    let verdict = check(&spec);
    assert!(
        !verdict
            .violations
            .iter()
            .any(|v| v.reason == Reason::ConnectorUnsupported),
        "without the connector any engine is fine: {verdict:?}"
    );
}

#[test]
fn check_pools_is_the_same_table() {
    let spec = pair(TransferMode::Push, pool(kv(16, None)), pool(kv(64, None)));
    let p = Pool {
        parallelism: &spec.prefill.parallelism,
        kv: &spec.prefill.kv,
    };
    let d = Pool {
        parallelism: &spec.decode.parallelism,
        kv: &spec.decode.kv,
    };
    assert_eq!(
        check_pools(TransferMode::Push, ChecksumPolicy::Disabled, p, d),
        check(&spec)
    );
}

#[test]
fn reason_names_are_stable() {
    for r in Reason::ALL {
        assert_eq!(
            serde_json::to_string(&r).expect("serialises"),
            format!("\"{}\"", r.as_str())
        );
        assert_eq!(serde_json::from_str::<Reason>(&format!("\"{r}\"")).expect("parses"), r);
    }
}

// --- properties ----------------------------------------------------------------------------------

fn any_kv() -> impl Strategy<Value = KvGeometry> {
    (
        (
            prop::sample::select(vec![1, 2, 4, 8, 16, 32, 64, 128, 256]),
            prop::sample::select(vec![1, 2, 4]),
        ),
        (
            -1..80i32,
            -1..16i32,
            prop::sample::select(vec![-1, 1, 2, 3, 64, 96, 128]),
        ),
        prop::sample::select(vec![
            CacheDtype::Auto,
            CacheDtype::Bfloat16,
            CacheDtype::Fp8,
            CacheDtype::Float32,
        ]),
        prop::sample::select(vec![ModelDtype::Bfloat16, ModelDtype::Float16, ModelDtype::Float32]),
        (
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        ),
    )
        .prop_map(
            |((kernel, per), (layers, heads, dim), cache, dtype, (nhd, mla, hybrid, host, explicit))| {
                let mut k = kv(kernel * per, explicit.then_some(kernel));
                k.layers = layers;
                k.kv_heads = heads;
                k.head_dim = dim;
                k.cache_dtype = cache;
                k.dtype = dtype;
                k.layout = if nhd { KvLayout::Nhd } else { KvLayout::Hnd };
                k.mla = mla;
                k.hybrid = hybrid;
                k.host_buffer = host;
                k
            },
        )
}

fn any_parallelism() -> impl Strategy<Value = Parallelism> {
    (-1..9i32, -1..4i32, -1..4i32).prop_map(|(tensor, pipeline, data)| Parallelism { tensor, pipeline, data })
}

fn any_mode() -> impl Strategy<Value = TransferMode> {
    prop::sample::select(vec![TransferMode::Push, TransferMode::Pull])
}

fn any_checksum() -> impl Strategy<Value = ChecksumPolicy> {
    prop::sample::select(vec![
        ChecksumPolicy::Disabled,
        ChecksumPolicy::FailOpen,
        ChecksumPolicy::FailClosed,
    ])
}

fn any_spec() -> impl Strategy<Value = PDPairSpec> {
    (
        any_mode(),
        any_checksum(),
        any_parallelism(),
        any_kv(),
        any_parallelism(),
        any_kv(),
    )
        .prop_map(|(mode, checksum, pp, pk, dp, dk)| PDPairSpec {
            transfer: TransferSpec {
                mode,
                checksum,
                ..TransferSpec::default()
            },
            prefill: PoolSpec {
                replicas: 1,
                parallelism: pp,
                template: None,
                kv: pk,
                rollout: None,
                template_error: None,
            },
            decode: PoolSpec {
                replicas: 1,
                parallelism: dp,
                template: None,
                kv: dk,
                rollout: None,
                template_error: None,
            },
        })
}

proptest! {
    /// A pool paired with an identical copy of itself is admitted whenever it is structurally
    /// valid, its pipeline setting is allowed, and its rows suit the checksum.
    #[test]
    fn identical_copy_is_admitted(mode in any_mode(), checksum in any_checksum(), par in any_parallelism(), geometry in any_kv()) {
        let p = pool(geometry);
        let spec = PDPairSpec {
            transfer: TransferSpec { mode, checksum, ..TransferSpec::default() },
            prefill: PoolSpec { parallelism: par.clone(), ..p.clone() },
            decode: PoolSpec { parallelism: par, ..p },
        };
        let verdict = check(&spec);
        let only_pool_rules = verdict.violations.iter().all(|v| matches!(
            v.reason,
            Reason::InvalidBlockSize | Reason::InvalidParallelism | Reason::InvalidShape | Reason::PipelineUnsupported | Reason::ChecksumUnsupported
        ));
        prop_assert!(only_pool_rules, "{}", verdict);
    }

    /// Allowed exactly when there are no violations; every violation names a field of the spec
    /// and carries a message.
    #[test]
    fn violations_are_well_formed(spec in any_spec()) {
        let verdict = check(&spec);
        prop_assert_eq!(verdict.allowed(), verdict.violations.is_empty());
        for v in &verdict.violations {
            prop_assert!(v.field.starts_with("spec.prefill.") || v.field.starts_with("spec.decode."), "{}", v);
            prop_assert!(!v.message.is_empty());
        }
    }

    /// A structurally invalid pool never gets a pair-rule violation.
    #[test]
    fn structural_stop(spec in any_spec()) {
        let verdict = check(&spec);
        if verdict.violations.iter().any(|v| v.reason.is_structural()) {
            for v in &verdict.violations {
                prop_assert!(v.reason.is_structural() || matches!(v.reason, Reason::ChecksumUnsupported | Reason::PipelineUnsupported), "{}", v);
            }
        }
    }

    /// Pull is never stricter than push about block sizes: a push-admitted pair without pipeline
    /// parallelism is pull-admitted too.
    #[test]
    fn push_admitted_implies_pull_admitted(spec in any_spec()) {
        let mut spec = spec;
        spec.transfer.mode = TransferMode::Push;
        spec.prefill.parallelism.pipeline = 1;
        spec.decode.parallelism.pipeline = 1;
        if check(&spec).allowed() {
            spec.transfer.mode = TransferMode::Pull;
            let verdict = check(&spec);
            prop_assert!(verdict.allowed(), "{}", verdict);
        }
    }

    /// Pull admits any decode kernel block size that is a multiple of prefill's (single TP, no
    /// host buffer), and refuses any that is not.
    #[test]
    fn pull_divisibility(pk in 1..128i32, dk in 1..512i32) {
        let spec = pair(TransferMode::Pull, pool(kv(pk, None)), pool(kv(dk, None)));
        prop_assert_eq!(check(&spec).allowed(), dk % pk == 0);
    }

    /// The verdict does not depend on anything but the geometry: checking twice gives the same.
    #[test]
    fn deterministic(spec in any_spec()) {
        prop_assert_eq!(check(&spec), check(&spec));
    }
}
