//! What can be checked without a GPU: the launch tables (every address inside its region, bad
//! arguments refused naming them), and the kernel's arithmetic, through a host model that walks
//! the tables exactly as `kv_checksum` does (same index math, same 16- or 8-byte steps) and must
//! equal the CPU checksum. The kernel itself runs in `agent/tests/gpu.rs` (`make gpu-check`).

use pdpair_api::{CacheDtype, KvGeometry, KvLayout, ModelDtype, Parallelism};
use proptest::prelude::*;

use super::*;
use crate::gpu_check::pattern;
use crate::layout::KvArrangement;

/// Fake device addresses: region r lives at (r + 1) << 40.
fn bases(n: usize) -> Vec<u64> {
    (0..n).map(|r| (r as u64 + 1) << 40).collect()
}

fn read_u64(memory: &[Vec<u8>], addr: u64) -> u64 {
    let r = (addr >> 40) as usize - 1;
    let at = (addr & ((1 << 40) - 1)) as usize;
    u64::from_le_bytes(memory[r][at..at + 8].try_into().expect("8 bytes"))
}

/// `kv_checksum` on the host: one (job, layer, head) at a time, the same loop as the kernel.
fn model(layout: &PoolLayout, memory: &[Vec<u8>], which: &Blocks<'_>) -> Vec<u64> {
    let (ptrs, first_tokens, vec16) = plan(layout, &bases(memory.len()), which).expect("plan");
    let mut out = vec![0u64; which.blocks.len()];
    let half = layout.half_token() as u64;
    let ph = half / 8;
    let p_tok = if layout.latent { ph } else { 2 * ph };
    let per = if vec16 == 1 { ph / 2 } else { ph };
    for (job, sum) in out.iter_mut().enumerate() {
        for l in 0..u64::from(layout.layers) {
            for hh in 0..u64::from(which.count) {
                let h = u64::from(which.first) + hh;
                let t0 = first_tokens[job];
                let live = which.num_tokens.saturating_sub(t0).min(u64::from(layout.block_size));
                let k = ptrs[(job * layout.layers as usize + l as usize) * 3];
                let v = ptrs[(job * layout.layers as usize + l as usize) * 3 + 1];
                let unit = ptrs[(job * layout.layers as usize + l as usize) * 3 + 2];
                let mut acc = 0u64;
                for idx in 0..live * per {
                    let (i, q) = (idx / per, idx % per);
                    let token = if layout.layout == KvLayout::Nhd {
                        i * u64::from(layout.local_heads) + h
                    } else {
                        h * u64::from(layout.block_size) + i
                    };
                    let t = t0 + i;
                    let w = |j: u64| j.wrapping_mul(2).wrapping_add(1);
                    if vec16 == 1 {
                        let off = token * unit + 16 * q;
                        let j = t * p_tok + 2 * q;
                        let (x0, x1) = (read_u64(memory, k + off), read_u64(memory, k + off + 8));
                        acc = acc
                            .wrapping_add(x0.wrapping_mul(w(j)))
                            .wrapping_add(x1.wrapping_mul(w(j + 1)));
                        if !layout.latent {
                            let (y0, y1) = (read_u64(memory, v + off), read_u64(memory, v + off + 8));
                            let jv = j + ph;
                            acc = acc
                                .wrapping_add(y0.wrapping_mul(w(jv)))
                                .wrapping_add(y1.wrapping_mul(w(jv + 1)));
                        }
                    } else {
                        let off = token * unit + 8 * q;
                        let j = t * p_tok + q;
                        acc = acc.wrapping_add(read_u64(memory, k + off).wrapping_mul(w(j)));
                        if !layout.latent {
                            acc = acc.wrapping_add(read_u64(memory, v + off).wrapping_mul(w(j + ph)));
                        }
                    }
                }
                let m = pdpair_api::checksum::head_multiplier(l as u32, layout.head_offset + which.first + hh as u32);
                *sum = sum.wrapping_add(acc.wrapping_mul(m));
            }
        }
    }
    out
}

fn kv(heads: i32, head_dim: i32, dtype: CacheDtype, nhd: bool, mla: bool) -> KvGeometry {
    KvGeometry {
        engine: "vllm".into(),
        engine_version: None,
        model: "m".into(),
        dtype: ModelDtype::Bfloat16,
        cache_dtype: dtype,
        layers: 3,
        kv_heads: heads,
        head_dim,
        attention_backend: "FLASH_ATTN".into(),
        layout: if nhd { KvLayout::Nhd } else { KvLayout::Hnd },
        block_size: 4,
        kernel_block_size: None,
        mla,
        hybrid: false,
        host_buffer: false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The kernel's walk equals the CPU checksum on the same blocks: HND and NHD, 16- and
    /// 8-byte steps, MLA, KV-first, blocks-first and K|V side by side (layers or blocks
    /// outermost), one region or one per layer, a rank's heads and a head subset, any first
    /// token and token count.
    #[test]
    fn the_kernels_walk_equals_the_cpu_checksum(
        seed in any::<u64>(),
        (heads, tp, rank) in prop::sample::select(vec![(2, 1, 0), (4, 2, 1), (8, 4, 3)]),
        (head_dim, dtype) in prop::sample::select(vec![
            (8, CacheDtype::Auto), (4, CacheDtype::Auto), (16, CacheDtype::Fp8), (8, CacheDtype::Fp8),
        ]),
        nhd in any::<bool>(),
        mla in any::<bool>(),
        arrangement in 0u8..4,
        per_layer in any::<bool>(),
        first_token in 0u64..12,
        extra in 0u64..20,
        subset in any::<bool>(),
    ) {
        let geometry = kv(heads, head_dim, dtype, nhd, mla);
        let parallelism = Parallelism { tensor: tp, ..Parallelism::default() };
        let mut layout = PoolLayout::new(&geometry, &parallelism, 6, rank).expect("layout");
        match arrangement {
            _ if mla => {}
            1 => layout = layout.arranged(KvArrangement::BlocksFirst),
            2 => layout = layout.arranged(KvArrangement::Interleaved),
            // vLLM 0.33's blocks-outermost [blocks, layers, heads, tokens, K|V].
            3 => layout = layout.blocks_outermost(),
            _ => {}
        }
        if per_layer && !matches!(arrangement, 2 | 3) {
            layout = layout.with_regions(&[(1, None), (1, None), (1, None)]).expect("regions");
        }
        prop_assume!(layout.half_token().is_multiple_of(8));
        let memory: Vec<Vec<u8>> = layout
            .region_lens()
            .iter()
            .enumerate()
            .map(|(r, len)| pattern(*len, seed ^ r as u64))
            .collect();
        let (first, count) = if subset && layout.local_heads > 1 { (1, layout.local_heads - 1) } else { (0, layout.local_heads) };
        let blocks = [4u32, 1, 5];
        let which = Blocks { blocks: &blocks, first_token, num_tokens: first_token + extra, first, count };
        let host: Vec<&[u8]> = memory.iter().map(Vec::as_slice).collect();
        let cpu: Vec<u64> = blocks
            .iter()
            .enumerate()
            .map(|(j, b)| {
                let t = first_token + j as u64 * u64::from(layout.block_size);
                layout.checksum_heads(&host, *b, t, which.num_tokens, first, count).expect("cpu")
            })
            .collect();
        prop_assert_eq!(model(&layout, &memory, &which), cpu);
    }
}

fn small() -> PoolLayout {
    PoolLayout::new(&kv(2, 8, CacheDtype::Auto, false, false), &Parallelism::default(), 6, 0).expect("layout")
}

#[test]
fn the_tables_point_inside_each_region_and_16_byte_steps_need_alignment() {
    let layout = small();
    let which = Blocks {
        blocks: &[0, 5],
        first_token: 32,
        num_tokens: 40,
        first: 0,
        count: 2,
    };
    let base = bases(1);
    let (ptrs, firsts, vec16) = plan(&layout, &base, &which).expect("plan");
    assert_eq!(firsts, [32, 36]);
    assert_eq!(ptrs.len(), 2 * 3 * 3);
    let (_, v_at) = layout.block_offset(2, true, 5);
    assert_eq!(ptrs[(3 + 2) * 3 + 1], base[0] + v_at as u64, "block 5, layer 2, V");
    assert_eq!(
        ptrs[(3 + 2) * 3 + 2],
        layout.half_token() as u64,
        "dense arrays: a half token apart"
    );
    assert_eq!(vec16, 1, "16-byte halves at aligned addresses");
    let (_, _, vec16) = plan(&layout, &[base[0] + 8], &which).expect("plan");
    assert_eq!(vec16, 0, "an 8-byte-aligned region steps by 8 bytes");
}

#[test]
fn bad_arguments_are_refused_naming_them() {
    let layout = small();
    let ok = Blocks {
        blocks: &[0],
        first_token: 0,
        num_tokens: 4,
        first: 0,
        count: 2,
    };
    let err = |which: &Blocks<'_>, bases: &[u64]| plan(&layout, bases, which).expect_err("refused").to_string();
    assert!(
        err(
            &Blocks {
                blocks: &[6],
                ..ok.clone()
            },
            &bases(1)
        )
        .contains("block 6 of a pool of 6 blocks")
    );
    assert!(err(&Blocks { first: 1, ..ok.clone() }, &bases(1)).contains("heads 1..+2 of a pool with 2 local heads"));
    assert!(err(&ok, &bases(2)).contains("2 region addresses for a pool of 1 regions"));
    assert!(err(&ok, &[u64::MAX - 7]).contains("wraps"));
    assert!(
        err(&ok, &[(1 << 40) + 4]).contains("not 8-byte aligned"),
        "a misaligned load would poison the context"
    );
    let odd =
        PoolLayout::new(&kv(2, 2, CacheDtype::Auto, false, false), &Parallelism::default(), 6, 0).expect("layout");
    let e = plan(&odd, &bases(1), &ok).expect_err("refused").to_string();
    assert!(e.contains("half token of 4 bytes"), "{e}");
}
