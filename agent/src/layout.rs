//! Where an engine's KV blocks are in its registered pool memory.
//!
//! One region per engine, layer after layer. Inside a layer, [`KvArrangement::KvFirst`]: a K array
//! then a V array of `num_blocks` blocks each (vLLM's FlashAttention `[2, num_blocks, ...]`), or
//! [`KvArrangement::BlocksFirst`]: block after block, each its K then its V (FlashInfer's
//! `[num_blocks, 2, ...]`). A block holds `kernel_block_size` tokens of the engine's local KV heads,
//! `HND` (head, token, dim) or `NHD` (token, head, dim).

use pdpair_api::{KvGeometry, KvLayout, Parallelism, checksum::Shape};
use serde::{Deserialize, Serialize};

/// Where a layer's K and V blocks are relative to each other (the engine API's
/// `kv_arrangement`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvArrangement {
    /// A K array of all blocks, then a V array (FlashAttention's `[2, num_blocks, ...]`).
    #[default]
    KvFirst,
    /// Block after block, each its K then its V (FlashInfer's `[num_blocks, 2, ...]`).
    BlocksFirst,
}

use crate::checksum::block_checksum;

/// The geometry of one engine's pool, in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolLayout {
    /// Layers.
    pub layers: u32,
    /// KV heads held by this engine (its tensor-parallel shard).
    pub local_heads: u32,
    /// Global index of the first local head.
    pub head_offset: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element.
    pub element_bytes: u32,
    /// Tokens per (kernel) block.
    pub block_size: u32,
    /// Blocks per K (or V) array.
    pub num_blocks: u32,
    /// HND or NHD.
    pub layout: KvLayout,
    /// K and V arrays, or K and V per block.
    pub arrangement: KvArrangement,
}

/// Why a pool's geometry or memory is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LayoutError(pub String);

impl PoolLayout {
    /// The layout of tensor-parallel rank `rank` of an engine with this geometry (each rank
    /// registers as its own engine and holds a contiguous range of the KV heads; with more ranks
    /// than heads, ranks replicate heads; MLA KV is not sharded by head).
    pub fn new(
        kv: &KvGeometry,
        parallelism: &Parallelism,
        num_blocks: u32,
        rank: u32,
    ) -> Result<PoolLayout, LayoutError> {
        let positive = |name: &str, v: i32| {
            u32::try_from(v)
                .ok()
                .filter(|v| *v > 0)
                .ok_or_else(|| LayoutError(format!("kv.{name} is {v}; it must be at least 1")))
        };
        let heads = positive("kvHeads", kv.kv_heads)?;
        let tp = u32::try_from(parallelism.tensor).ok().filter(|t| *t > 0).unwrap_or(1);
        if rank >= tp {
            return Err(LayoutError(format!(
                "tensor_rank {rank} is outside parallelism.tensor {tp}"
            )));
        }
        let (local_heads, head_offset) = if kv.mla {
            (heads, 0)
        } else if tp <= heads {
            (heads / tp, rank * (heads / tp))
        } else {
            (1, rank * heads / tp)
        };
        let element_bytes = kv
            .resolved_cache_dtype()
            .element_bytes()
            .ok_or_else(|| LayoutError("cache dtype did not resolve".into()))?;
        Ok(PoolLayout {
            layers: positive("layers", kv.layers)?,
            local_heads,
            head_offset,
            head_dim: positive("headDim", kv.head_dim)?,
            element_bytes,
            block_size: positive("kernelBlockSize", kv.kernel_block_size())?,
            num_blocks,
            layout: kv.layout,
            arrangement: KvArrangement::KvFirst,
        })
    }

    /// The same layout with K and V arranged as `arrangement`.
    pub fn arranged(self, arrangement: KvArrangement) -> PoolLayout {
        PoolLayout { arrangement, ..self }
    }

    /// Bytes from one block of a layer's K (or V) to the next.
    pub fn block_stride(&self) -> usize {
        match self.arrangement {
            KvArrangement::KvFirst => self.block_len(),
            KvArrangement::BlocksFirst => 2 * self.block_len(),
        }
    }

    /// Bytes of one head's one token's K (or V).
    pub fn half_token(&self) -> usize {
        self.head_dim as usize * self.element_bytes as usize
    }

    /// Bytes of one block of one layer's K (or V).
    pub fn block_len(&self) -> usize {
        self.block_size as usize * self.local_heads as usize * self.half_token()
    }

    /// [`PoolLayout::block_len`], or `None` when it overflows 64 bits.
    pub fn block_len_checked(&self) -> Option<u64> {
        u64::from(self.block_size)
            .checked_mul(u64::from(self.local_heads))?
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(u64::from(self.element_bytes))
    }

    /// [`PoolLayout::region_len`], or `None` when it overflows (or does not fit this machine's
    /// address space): such a geometry is refused at registration, before anything is sliced.
    pub fn region_len_checked(&self) -> Option<usize> {
        let len = self
            .block_len_checked()?
            .checked_mul(u64::from(self.num_blocks))?
            .checked_mul(2)?
            .checked_mul(u64::from(self.layers))?;
        usize::try_from(len).ok().filter(|l| *l <= isize::MAX as usize)
    }

    /// Bytes of one K (or V) array.
    fn array_len(&self) -> usize {
        self.num_blocks as usize * self.block_len()
    }

    /// Bytes of the whole pool (callers check [`PoolLayout::region_len_checked`] first).
    pub fn region_len(&self) -> usize {
        2 * self.layers as usize * self.array_len()
    }

    /// Offsets of each layer's block 0 of K and of V (blocks follow at [`PoolLayout::block_stride`]).
    pub fn layer_offsets(&self) -> Vec<(u64, u64)> {
        (0..self.layers)
            .map(|l| {
                (
                    self.block_offset(l, false, 0) as u64,
                    self.block_offset(l, true, 0) as u64,
                )
            })
            .collect()
    }

    /// Offset of a block of a layer's K (`v = false`) or V array.
    pub fn block_offset(&self, layer: u32, v: bool, block: u32) -> usize {
        let layer_start = 2 * layer as usize * self.array_len();
        match self.arrangement {
            KvArrangement::KvFirst => {
                layer_start + usize::from(v) * self.array_len() + block as usize * self.block_len()
            }
            KvArrangement::BlocksFirst => {
                layer_start + block as usize * 2 * self.block_len() + usize::from(v) * self.block_len()
            }
        }
    }

    /// Offset of a token's K (or V) for a local head inside a block.
    pub fn token_offset(&self, head: u32, token: u32) -> usize {
        let (h, t) = (head as usize, token as usize);
        match self.layout {
            KvLayout::Hnd => (h * self.block_size as usize + t) * self.half_token(),
            KvLayout::Nhd => (t * self.local_heads as usize + h) * self.half_token(),
        }
    }

    /// The checksum shape of this shard.
    pub fn shape(&self) -> Shape {
        Shape {
            layers: self.layers,
            heads: self.local_heads,
            head_dim: self.head_dim,
            element_bytes: self.element_bytes,
        }
    }

    /// The checksum of block `block` holding tokens from `first_token`, read from `memory`.
    pub fn checksum(&self, memory: &[u8], block: u32, first_token: u64, num_tokens: u64) -> Option<u64> {
        self.checksum_heads(memory, block, first_token, num_tokens, 0, self.local_heads)
    }

    /// The checksum of `count` local heads from local head `first` of a block: what a decode
    /// rank holding just those heads computes over the same tokens.
    pub fn checksum_heads(
        &self,
        memory: &[u8],
        block: u32,
        first_token: u64,
        num_tokens: u64,
        first: u32,
        count: u32,
    ) -> Option<u64> {
        if block >= self.num_blocks || memory.len() < self.region_len() || first + count > self.local_heads {
            return None;
        }
        let half = self.half_token();
        let shape = Shape {
            heads: count,
            ..self.shape()
        };
        block_checksum(
            &shape,
            self.head_offset + first,
            self.block_size,
            first_token,
            num_tokens,
            |l, h, i| {
                let k = self.block_offset(l, false, block) + self.token_offset(first + h, i);
                let v = self.block_offset(l, true, block) + self.token_offset(first + h, i);
                (&memory[k..k + half], &memory[v..v + half])
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use pdpair_api::checksum::reference_block;

    use super::*;

    #[test]
    fn tensor_ranks_hold_contiguous_head_ranges() {
        let mut kv = pdpair_api::KvGeometry {
            engine: "vllm".into(),
            engine_version: None,
            model: "m".into(),
            dtype: pdpair_api::ModelDtype::Bfloat16,
            cache_dtype: pdpair_api::CacheDtype::Auto,
            layers: 1,
            kv_heads: 8,
            head_dim: 4,
            attention_backend: "FLASH_ATTN".into(),
            layout: KvLayout::Hnd,
            block_size: 4,
            kernel_block_size: None,
            mla: false,
            hybrid: false,
            host_buffer: false,
        };
        let par = |t| pdpair_api::Parallelism {
            tensor: t,
            pipeline: 1,
            data: 1,
        };
        let at = |kv: &pdpair_api::KvGeometry, tp, rank| {
            let l = PoolLayout::new(kv, &par(tp), 1, rank).expect("valid");
            (l.head_offset, l.local_heads)
        };
        assert_eq!(at(&kv, 4, 3), (6, 2));
        assert_eq!(at(&kv, 16, 5), (2, 1), "more ranks than heads: ranks share heads");
        assert!(
            PoolLayout::new(&kv, &par(4), 1, 4).is_err(),
            "rank outside tensor parallelism"
        );
        kv.mla = true;
        assert_eq!(at(&kv, 4, 3), (0, 8), "MLA is not sharded by head");
    }

    /// The engine layout and the canonical layout give the same checksum for the same tokens.
    #[test]
    fn both_arrangements_partition_the_region_into_every_layers_k_and_v_blocks() {
        let base = PoolLayout {
            layers: 3,
            local_heads: 2,
            head_offset: 0,
            head_dim: 4,
            element_bytes: 2,
            block_size: 4,
            num_blocks: 5,
            layout: KvLayout::Hnd,
            arrangement: KvArrangement::KvFirst,
        };
        for arrangement in [KvArrangement::KvFirst, KvArrangement::BlocksFirst] {
            let pool = base.clone().arranged(arrangement);
            let mut seen = vec![false; pool.region_len()];
            for l in 0..3 {
                for v in [false, true] {
                    for b in 0..5 {
                        let at = pool.block_offset(l, v, b);
                        assert_eq!(
                            at,
                            pool.layer_offsets()[l as usize].0 as usize
                                + usize::from(v)
                                    * (pool.layer_offsets()[l as usize].1 - pool.layer_offsets()[l as usize].0)
                                        as usize
                                + b as usize * pool.block_stride()
                        );
                        for byte in &mut seen[at..at + pool.block_len()] {
                            assert!(!*byte, "{arrangement:?}: blocks overlap");
                            *byte = true;
                        }
                    }
                }
            }
            assert!(
                seen.iter().all(|b| *b),
                "{arrangement:?}: every byte belongs to a block"
            );
        }
        let fi = base.arranged(KvArrangement::BlocksFirst);
        assert_eq!(
            fi.block_offset(1, true, 2),
            2 * 5 * 64 + 2 * 2 * 64 + 64,
            "FlashInfer's [N, 2, ...]"
        );
    }

    #[test]
    fn engine_layouts_checksum_like_the_canonical_dump() {
        for (layout, arrangement) in [
            (KvLayout::Hnd, KvArrangement::KvFirst),
            (KvLayout::Nhd, KvArrangement::KvFirst),
            (KvLayout::Hnd, KvArrangement::BlocksFirst),
        ] {
            let pool = PoolLayout {
                layers: 2,
                local_heads: 3,
                head_offset: 0,
                head_dim: 4,
                element_bytes: 2,
                block_size: 4,
                num_blocks: 3,
                layout,
                arrangement,
            };
            let memory: Vec<u8> = (0..pool.region_len()).map(|i| (i * 31 + 7) as u8).collect();
            // Build the canonical dump of block 1 from the engine memory.
            let half = pool.half_token();
            let mut canonical = Vec::new();
            for l in 0..2 {
                for h in 0..3 {
                    for i in 0..4 {
                        let k = pool.block_offset(l, false, 1) + pool.token_offset(h, i);
                        let v = pool.block_offset(l, true, 1) + pool.token_offset(h, i);
                        canonical.extend_from_slice(&memory[k..k + half]);
                        canonical.extend_from_slice(&memory[v..v + half]);
                    }
                }
            }
            let reference = reference_block(&pool.shape(), &canonical, 4, 8, 11).expect("valid");
            assert_eq!(pool.checksum(&memory, 1, 8, 11), Some(reference), "{layout:?}");
        }
    }
}
