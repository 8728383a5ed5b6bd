//! Where an engine's KV blocks are in its registered pool memory.
//!
//! A pool is one or more memory regions, each holding a run of consecutive layers (one region
//! for all layers, one per layer as vLLM allocates its per-layer KV tensors, or anything between),
//! layer after layer. Inside a layer, [`KvArrangement::KvFirst`]: a K array then a V array of
//! `num_blocks` blocks each (vLLM's FlashAttention `[2, num_blocks, ...]`),
//! [`KvArrangement::BlocksFirst`]: block after block, each its K then its V (FlashInfer's
//! `[num_blocks, 2, ...]`), or [`KvArrangement::Latent`]: an MLA cache's one array of latent
//! vectors (`[num_blocks, block_size, head_dim]`, no V), or [`KvArrangement::Interleaved`]: each
//! head's each token's K then its V side by side (vLLM 0.33's `[blocks, heads, tokens, K|V]` views
//! of one allocation), with the distances from one layer and one block to the next as the engine
//! names them (layers outermost or blocks outermost). A block holds `kernel_block_size` tokens
//! of the engine's local KV heads, `HND` (head, token, dim) or `NHD` (token, head, dim).

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
    /// MLA: one array of blocks of latent vectors, no V (`[num_blocks, block_size, head_dim]`).
    Latent,
    /// Each head's each token's K then its V, side by side (vLLM 0.33's `[blocks, heads, tokens,
    /// K|V]`), blocks and layers [`Strides`] apart.
    Interleaved,
}

/// Where an [`KvArrangement::Interleaved`] region's blocks are: bytes from a layer's block 0 to
/// the next layer's, and from one block to the next. Both at least a block of K and V apart, one
/// grid inside the other (layers outermost: `layer >= num_blocks x block`; blocks outermost:
/// `block >= layers x layer`), so no two blocks overlap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strides {
    /// Bytes from one layer's block 0 to the next layer's.
    pub layer: u64,
    /// Bytes from one block to the next.
    pub block: u64,
}

use crate::checksum::block_checksum;

/// The most memory regions one pool may have (descriptors in one `RegisterPool` frame, keys in
/// one handshake).
pub const MAX_REGIONS: usize = 128;
/// The most layers a pool's geometry may have (the largest models have about 130); the
/// webhook admits no more.
pub const MAX_LAYERS: u32 = pdpair_api::rules::MAX_LAYERS as u32;
/// The most tensor-parallel ranks an engine may have (peers' claims are walked rank by rank);
/// the webhook admits no more.
pub const MAX_TENSOR_PARALLEL: u32 = pdpair_api::rules::MAX_TENSOR as u32;

/// A run of consecutive layers in one memory region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// The first layer the region holds.
    pub first_layer: u32,
    /// Layers it holds.
    pub layers: u32,
    /// How each of its layers is arranged.
    pub arrangement: KvArrangement,
    /// An `Interleaved` region's strides (`None` for the others, whose follow from the
    /// arrangement).
    pub strides: Option<Strides>,
}

/// Where one layer's blocks are: its region, the offsets of its K (or latent) array's and its V
/// array's block 0 in that region, and the distance from one block to the next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerAt {
    /// Index of the region in the pool's region list.
    pub region: u32,
    /// Offset of block 0 of the K (or MLA latent) array.
    pub k: u64,
    /// Offset of block 0 of the V array (absent for an MLA cache).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub v: Option<u64>,
    /// Bytes from one block to the next.
    pub block_stride: u64,
    /// Bytes from one head's one token's K (or V) to the next one's (absent: adjacent, a half
    /// token; `Interleaved`: twice that, K and V side by side).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<u64>,
}

/// The geometry of one engine's pool, in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolLayout {
    /// Layers.
    pub layers: u32,
    /// KV heads held by this engine (its tensor-parallel shard).
    pub local_heads: u32,
    /// Global index of the first local head.
    pub head_offset: u32,
    /// Elements per head (MLA: per latent vector).
    pub head_dim: u32,
    /// Bytes per element.
    pub element_bytes: u32,
    /// Tokens per (kernel) block.
    pub block_size: u32,
    /// Blocks per K (or V, or latent) array.
    pub num_blocks: u32,
    /// HND or NHD.
    pub layout: KvLayout,
    /// An MLA cache: one latent array per layer, no V.
    pub latent: bool,
    /// The memory regions, in layer order, covering every layer once.
    pub regions: Vec<Region>,
}

/// Why a pool's geometry or memory is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LayoutError(pub String);

impl PoolLayout {
    /// The layout of tensor-parallel rank `rank` of an engine with this geometry (each rank
    /// registers as its own engine and holds a contiguous range of the KV heads; with more ranks
    /// than heads, ranks replicate heads; MLA KV is not sharded by head), in one region
    /// arranged `KvFirst` (MLA: `Latent`).
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
        let tp = u32::try_from(parallelism.tensor)
            .ok()
            .filter(|t| (1..=MAX_TENSOR_PARALLEL).contains(t))
            .ok_or_else(|| {
                LayoutError(format!(
                    "parallelism.tensor is {}; it must be 1..={MAX_TENSOR_PARALLEL}",
                    parallelism.tensor
                ))
            })?;
        if rank >= tp {
            return Err(LayoutError(format!(
                "tensor_rank {rank} is outside parallelism.tensor {tp}"
            )));
        }
        if parallelism.pipeline != 1 {
            return Err(LayoutError(format!(
                "parallelism.pipeline is {}; the node agent moves a tensor rank's whole pool of every layer, and a pipeline stage holds only its own layers: use 1",
                parallelism.pipeline
            )));
        }
        // Ranks split the heads evenly, or replicate each on as many ranks: otherwise some heads
        // are no rank's (8 heads over 3 ranks: 6 and 7), and their KV would never move.
        if !kv.mla && tp.max(heads) % tp.min(heads) != 0 {
            return Err(LayoutError(format!(
                "parallelism.tensor is {tp} and kv.kvHeads is {heads}: tensor ranks must split the KV heads evenly or replicate them evenly"
            )));
        }
        let (local_heads, head_offset) = if kv.mla {
            (heads, 0)
        } else if tp <= heads {
            (heads / tp, rank * (heads / tp))
        } else {
            // rank < tp <= MAX_TENSOR_PARALLEL and heads < tp here: the product fits u64, and
            // the quotient is below heads.
            (1, (u64::from(rank) * u64::from(heads) / u64::from(tp)) as u32)
        };
        let element_bytes = kv
            .resolved_cache_dtype()
            .element_bytes()
            .ok_or_else(|| LayoutError("cache dtype did not resolve".into()))?;
        let layers = positive("layers", kv.layers)?;
        if layers > MAX_LAYERS {
            return Err(LayoutError(format!(
                "kv.layers is {layers}; a pool has at most {MAX_LAYERS}"
            )));
        }
        Ok(PoolLayout {
            layers,
            local_heads,
            head_offset,
            head_dim: positive("headDim", kv.head_dim)?,
            element_bytes,
            block_size: positive("kernelBlockSize", kv.kernel_block_size())?,
            num_blocks,
            layout: kv.layout,
            latent: kv.mla,
            regions: vec![Region {
                first_layer: 0,
                layers,
                arrangement: default_arrangement(kv.mla),
                strides: None,
            }],
        })
    }

    /// The same layout in one region with K and V arranged as `arrangement` (`Interleaved`:
    /// dense, layers outermost).
    pub fn arranged(self, arrangement: KvArrangement) -> PoolLayout {
        let layers = self.layers;
        let strides = (arrangement == KvArrangement::Interleaved).then(|| self.dense_strides());
        PoolLayout {
            regions: vec![Region {
                first_layer: 0,
                layers,
                arrangement,
                strides,
            }],
            ..self
        }
    }

    /// The same layout in one `Interleaved` region with blocks outermost and nothing between
    /// them: a block's layers back to back (vLLM 0.33's `BL..` layouts).
    pub fn blocks_outermost(self) -> PoolLayout {
        let Strides { block, .. } = self.dense_strides();
        let layers = self.layers;
        PoolLayout {
            regions: vec![Region {
                first_layer: 0,
                layers,
                arrangement: KvArrangement::Interleaved,
                strides: Some(Strides {
                    layer: block,
                    block: block.saturating_mul(u64::from(layers)),
                }),
            }],
            ..self
        }
    }

    /// The engine API's `(layer_stride, block_stride)` of region `r`, where it is `Interleaved`.
    pub fn region_strides(&self, r: usize) -> Option<(u64, u64)> {
        self.regions.get(r)?.strides.map(|s| (s.layer, s.block))
    }

    /// An `Interleaved` region's strides where nothing lies between blocks, layers outermost
    /// (saturating: a geometry that overflows is refused by [`PoolLayout::pool_len_checked`]).
    fn dense_strides(&self) -> Strides {
        let block = self.block_len_checked().unwrap_or(u64::MAX).saturating_mul(2);
        Strides {
            layer: block.saturating_mul(u64::from(self.num_blocks)),
            block,
        }
    }

    /// The same layout split into regions of `(layers, arrangement)` in layer order (the
    /// engine API's `regions`; an absent arrangement is `KvFirst`, or `Latent` for MLA). The
    /// counts must add up to the layers; MLA caches are `Latent`, others not.
    pub fn with_regions(self, spec: &[(u32, Option<KvArrangement>)]) -> Result<PoolLayout, LayoutError> {
        let spec: Vec<RegionSpec> = spec
            .iter()
            .map(|(layers, arrangement)| RegionSpec {
                layers: *layers,
                arrangement: *arrangement,
                strides: None,
            })
            .collect();
        self.with_region_specs(&spec)
    }

    /// [`PoolLayout::with_regions`] with each region's strides where it names them (only
    /// `Interleaved` regions take them; absent: dense, layers outermost): they must keep every
    /// block apart and the region inside the address space.
    pub fn with_region_specs(self, spec: &[RegionSpec]) -> Result<PoolLayout, LayoutError> {
        if spec.is_empty() || spec.len() > MAX_REGIONS {
            return Err(LayoutError(format!(
                "regions has {} entries; a pool has 1..={MAX_REGIONS}",
                spec.len()
            )));
        }
        let mut regions = Vec::with_capacity(spec.len());
        let mut next = 0u32;
        for (i, r) in spec.iter().enumerate() {
            let layers = r.layers;
            if layers == 0 {
                return Err(LayoutError(format!(
                    "regions[{i}].layers is 0; a region holds at least 1"
                )));
            }
            let arrangement = r.arrangement.unwrap_or(default_arrangement(self.latent));
            check_arrangement(self.latent, arrangement, &format!("regions[{i}].kv_arrangement"))?;
            let strides = match (arrangement, r.strides) {
                (KvArrangement::Interleaved, given) => {
                    let dense = self.dense_strides();
                    let (layer, block) = given.unwrap_or((None, None));
                    let block = block.unwrap_or(dense.block);
                    let strides = Strides {
                        layer: layer.unwrap_or(block.saturating_mul(u64::from(self.num_blocks))),
                        block,
                    };
                    self.check_strides(strides, layers, &format!("regions[{i}]"))?;
                    Some(strides)
                }
                (_, None | Some((None, None))) => None,
                (other, Some(_)) => {
                    return Err(LayoutError(format!(
                        "regions[{i}] names strides for a {other:?} region; only Interleaved regions take them"
                    )));
                }
            };
            regions.push(Region {
                first_layer: next,
                layers,
                arrangement,
                strides,
            });
            next = next.saturating_add(layers);
        }
        if next != self.layers {
            return Err(LayoutError(format!(
                "regions hold {next} layers in all; the geometry has kv.layers {}",
                self.layers
            )));
        }
        Ok(PoolLayout { regions, ..self })
    }

    /// Checks an `Interleaved` region's strides: every block (its K and V, twice a block's
    /// length) apart from every other, one grid inside the other, and the region's length
    /// computable.
    fn check_strides(&self, s: Strides, layers: u32, field: &str) -> Result<(), LayoutError> {
        let chunk = self
            .block_len_checked()
            .and_then(|b| b.checked_mul(2))
            .ok_or_else(|| LayoutError("the geometry's block length overflows".into()))?;
        let (blocks, layers64) = (u64::from(self.num_blocks), u64::from(layers));
        // Layers outermost (or one layer, its layer stride unused), or blocks outermost. The
        // block stride is at least a block's either way, also where there is one block (peers
        // take no stride shorter than a block).
        let layers_outer =
            s.block >= chunk && (layers <= 1 || s.block.checked_mul(blocks).is_some_and(|n| s.layer >= n));
        let blocks_outer = s.layer >= chunk && s.layer.checked_mul(layers64).is_some_and(|n| s.block >= n);
        if !(layers_outer || blocks_outer) {
            return Err(LayoutError(format!(
                "{field}.layer_stride {} and {field}.block_stride {} make blocks of {chunk} bytes (K and V) overlap: \
                 layers outermost needs block_stride >= {chunk} and layer_stride >= num_blocks ({}) x block_stride; \
                 blocks outermost needs layer_stride >= {chunk} and block_stride >= layers ({layers}) x layer_stride",
                s.layer, s.block, self.num_blocks
            )));
        }
        Self::interleaved_len(s, layers, self.num_blocks, chunk)
            .filter(|l| *l <= isize::MAX as u64)
            .map(|_| ())
            .ok_or_else(|| {
                LayoutError(format!(
                    "{field}.layer_stride {} and {field}.block_stride {} over {layers} layers and {} blocks overflow the address space",
                    s.layer, s.block, self.num_blocks
                ))
            })
    }

    /// The bytes of an `Interleaved` region: its last layer's last block's end.
    fn interleaved_len(s: Strides, layers: u32, num_blocks: u32, chunk: u64) -> Option<u64> {
        u64::from(layers.checked_sub(1)?)
            .checked_mul(s.layer)?
            .checked_add(u64::from(num_blocks.checked_sub(1)?).checked_mul(s.block)?)?
            .checked_add(chunk)
    }

    /// K and V (2), or MLA's latent (1): the arrays per layer.
    pub fn halves(&self) -> u32 {
        if self.latent { 1 } else { 2 }
    }

    /// The arrays of a layer: `false` is K (or the latent), `true` is V (absent for MLA).
    pub fn arrays(&self) -> &'static [bool] {
        if self.latent { &[false] } else { &[false, true] }
    }

    /// The region holding `layer`, and the layer's index inside it.
    pub fn region_of(&self, layer: u32) -> (usize, u32) {
        let r = self
            .regions
            .partition_point(|r| r.first_layer + r.layers <= layer)
            .min(self.regions.len().saturating_sub(1));
        (r, layer.saturating_sub(self.regions[r].first_layer))
    }

    /// Bytes from one block of a layer's K (or V) to the next.
    pub fn block_stride(&self, layer: u32) -> usize {
        let region = &self.regions[self.region_of(layer).0];
        match (region.arrangement, region.strides) {
            (KvArrangement::Interleaved, Some(s)) => s.block as usize,
            (KvArrangement::BlocksFirst | KvArrangement::Interleaved, _) => 2 * self.block_len(),
            (KvArrangement::KvFirst | KvArrangement::Latent, _) => self.block_len(),
        }
    }

    /// Bytes from one head's one token's K (or V) in a layer's block to the next's: a half
    /// token, or (`Interleaved`, K and V side by side) two.
    pub fn unit(&self, layer: u32) -> usize {
        match self.regions[self.region_of(layer).0].arrangement {
            KvArrangement::Interleaved => 2 * self.half_token(),
            _ => self.half_token(),
        }
    }

    /// Bytes from the start of a layer's K (or V) block to its end: a block, or (`Interleaved`)
    /// a block and the other half's tokens between its own.
    pub fn block_span(&self, layer: u32) -> usize {
        (self.block_len() / self.half_token().max(1)).saturating_sub(1) * self.unit(layer) + self.half_token()
    }

    /// Bytes of one head's one token's K (or V, or latent).
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

    /// [`PoolLayout::pool_len`], or `None` when it overflows (or does not fit this machine's address
    /// space): such a geometry is refused at registration, before anything is sliced. Every
    /// region is smaller than the whole.
    pub fn pool_len_checked(&self) -> Option<usize> {
        let dense = self
            .block_len_checked()?
            .checked_mul(u64::from(self.num_blocks))?
            .checked_mul(u64::from(self.halves()))?
            .checked_mul(u64::from(self.layers))?;
        usize::try_from(dense).ok().filter(|l| *l <= isize::MAX as usize)?;
        let mut len = 0u64;
        for r in &self.regions {
            len = len.checked_add(self.region_len_checked(r)?)?;
        }
        usize::try_from(len).ok().filter(|l| *l <= isize::MAX as usize)
    }

    /// A region's bytes, or `None` when they overflow.
    fn region_len_checked(&self, r: &Region) -> Option<u64> {
        let block = self.block_len_checked()?;
        match (r.arrangement, r.strides) {
            (KvArrangement::Interleaved, Some(s)) => {
                Self::interleaved_len(s, r.layers, self.num_blocks, block.checked_mul(2)?)
            }
            _ => block
                .checked_mul(u64::from(self.num_blocks))?
                .checked_mul(u64::from(self.halves()))?
                .checked_mul(u64::from(r.layers)),
        }
    }

    /// Bytes of one K (or V) array.
    fn array_len(&self) -> usize {
        self.num_blocks as usize * self.block_len()
    }

    /// Bytes of one layer's arrays.
    fn layer_len(&self) -> usize {
        self.halves() as usize * self.array_len()
    }

    /// Bytes of the whole pool, all regions (callers check [`PoolLayout::pool_len_checked`] first).
    pub fn pool_len(&self) -> usize {
        self.region_lens().iter().sum()
    }

    /// Bytes of each region, in order (callers check [`PoolLayout::pool_len_checked`] first).
    pub fn region_lens(&self) -> Vec<usize> {
        self.regions
            .iter()
            .map(|r| self.region_len_checked(r).unwrap_or(u64::MAX) as usize)
            .collect()
    }

    /// Where each layer's blocks are.
    pub fn layer_offsets(&self) -> Vec<LayerAt> {
        (0..self.layers)
            .map(|l| {
                let (region, k) = self.block_offset(l, false, 0);
                LayerAt {
                    region: region as u32,
                    k: k as u64,
                    v: (!self.latent).then(|| self.block_offset(l, true, 0).1 as u64),
                    block_stride: self.block_stride(l) as u64,
                    unit: (self.unit(l) != self.half_token()).then(|| self.unit(l) as u64),
                }
            })
            .collect()
    }

    /// The region and the offset in it of a block of a layer's K (`v = false`, or the latent)
    /// or V array.
    pub fn block_offset(&self, layer: u32, v: bool, block: u32) -> (usize, usize) {
        let (r, local) = self.region_of(layer);
        if let (KvArrangement::Interleaved, Some(s)) = (self.regions[r].arrangement, self.regions[r].strides) {
            let at = u64::from(local) * s.layer + u64::from(block) * s.block + u64::from(v) * self.half_token() as u64;
            return (r, at as usize);
        }
        let layer_start = local as usize * self.layer_len();
        let at = match self.regions[r].arrangement {
            KvArrangement::KvFirst => {
                layer_start + usize::from(v) * self.array_len() + block as usize * self.block_len()
            }
            KvArrangement::BlocksFirst => {
                layer_start + block as usize * 2 * self.block_len() + usize::from(v) * self.block_len()
            }
            KvArrangement::Latent => layer_start + block as usize * self.block_len(),
            // Without strides (not made by `arranged` or `with_region_specs`): dense.
            KvArrangement::Interleaved => {
                layer_start + block as usize * 2 * self.block_len() + usize::from(v) * self.half_token()
            }
        };
        (r, at)
    }

    /// The bytes a layer's block occupies, as (region, offset, bytes): each array's block, or
    /// (`Interleaved`) its K and V together, one range.
    pub fn block_extents(&self, layer: u32, block: u32) -> Vec<(usize, usize, usize)> {
        if self.unit(layer) != self.half_token() {
            let (r, at) = self.block_offset(layer, false, block);
            return vec![(r, at, 2 * self.block_len())];
        }
        self.arrays()
            .iter()
            .map(|v| {
                let (r, at) = self.block_offset(layer, *v, block);
                (r, at, self.block_len())
            })
            .collect()
    }

    /// Offset of a token's K (or V) for a local head inside a layer's block.
    pub fn token_offset(&self, layer: u32, head: u32, token: u32) -> usize {
        let (h, t) = (head as usize, token as usize);
        let unit = self.unit(layer);
        match self.layout {
            KvLayout::Hnd => (h * self.block_size as usize + t) * unit,
            KvLayout::Nhd => (t * self.local_heads as usize + h) * unit,
        }
    }

    /// The checksum shape of this shard.
    pub fn shape(&self) -> Shape {
        Shape {
            layers: self.layers,
            heads: self.local_heads,
            head_dim: self.head_dim,
            element_bytes: self.element_bytes,
            latent: self.latent,
        }
    }

    /// The checksum of block `block` holding tokens from `first_token`, read from `memory` (one
    /// slice per region).
    pub fn checksum(&self, memory: &[&[u8]], block: u32, first_token: u64, num_tokens: u64) -> Option<u64> {
        self.checksum_heads(memory, block, first_token, num_tokens, 0, self.local_heads)
    }

    /// The checksum of `count` local heads from local head `first` of a block: what a decode
    /// rank holding just those heads computes over the same tokens.
    pub fn checksum_heads(
        &self,
        memory: &[&[u8]],
        block: u32,
        first_token: u64,
        num_tokens: u64,
        first: u32,
        count: u32,
    ) -> Option<u64> {
        let lens = self.region_lens();
        if block >= self.num_blocks
            || memory.len() != lens.len()
            || memory.iter().zip(&lens).any(|(m, l)| m.len() < *l)
            || first.checked_add(count)? > self.local_heads
        {
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
                let token = self.token_offset(l, first + h, i);
                let (r, k) = self.block_offset(l, false, block);
                let k = &memory[r][k + token..k + token + half];
                if self.latent {
                    return (k, &[][..]);
                }
                let (r, v) = self.block_offset(l, true, block);
                (k, &memory[r][v + token..v + token + half])
            },
        )
    }
}

/// One region as an engine names it: its layers, arrangement and (`Interleaved`) the layer and
/// block strides it gives (absent: dense, layers outermost).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionSpec {
    /// Layers it holds.
    pub layers: u32,
    /// Its arrangement (absent: the geometry's default).
    pub arrangement: Option<KvArrangement>,
    /// (layer stride, block stride) in bytes, either absent.
    pub strides: Option<(Option<u64>, Option<u64>)>,
}

/// `KvFirst`, or `Latent` for an MLA cache.
pub fn default_arrangement(latent: bool) -> KvArrangement {
    if latent {
        KvArrangement::Latent
    } else {
        KvArrangement::KvFirst
    }
}

/// An MLA cache is `Latent`; any other is not.
pub fn check_arrangement(latent: bool, arrangement: KvArrangement, field: &str) -> Result<(), LayoutError> {
    match (latent, arrangement) {
        (true, KvArrangement::Latent)
        | (false, KvArrangement::KvFirst | KvArrangement::BlocksFirst | KvArrangement::Interleaved) => Ok(()),
        (true, other) => Err(LayoutError(format!(
            "{field} is {other:?}; kv.mla is true, so the cache is one latent array per layer: Latent"
        ))),
        (false, KvArrangement::Latent) => Err(LayoutError(format!(
            "{field} is Latent, but kv.mla is false: K and V are KvFirst, BlocksFirst or Interleaved"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use pdpair_api::checksum::reference_block;

    use super::*;

    /// A geometry of `heads` KV heads (one layer of blocks of 4 tokens, HND).
    fn of_heads(heads: i32) -> pdpair_api::KvGeometry {
        pdpair_api::KvGeometry {
            engine: "vllm".into(),
            engine_version: None,
            model: "m".into(),
            dtype: pdpair_api::ModelDtype::Bfloat16,
            cache_dtype: pdpair_api::CacheDtype::Auto,
            layers: 1,
            kv_heads: heads,
            head_dim: 4,
            attention_backend: "FLASH_ATTN".into(),
            layout: KvLayout::Hnd,
            block_size: 4,
            kernel_block_size: None,
            mla: false,
            hybrid: false,
            host_buffer: false,
        }
    }

    fn par(tensor: i32) -> pdpair_api::Parallelism {
        pdpair_api::Parallelism {
            tensor,
            pipeline: 1,
            data: 1,
        }
    }

    #[test]
    fn every_head_is_as_many_ranks_exactly_where_the_rules_admit_the_split() {
        for heads in 1..=16 {
            let kv = of_heads(heads);
            for tp in 1..=32 {
                let layouts: Result<Vec<PoolLayout>, _> =
                    (0..tp as u32).map(|r| PoolLayout::new(&kv, &par(tp), 1, r)).collect();
                let pool = pdpair_api::rules::Pool {
                    parallelism: &par(tp),
                    kv: &kv,
                };
                let admitted = pdpair_api::check_pools(
                    pdpair_api::TransferMode::Pull,
                    pdpair_api::ChecksumPolicy::Disabled,
                    pool,
                    pool,
                )
                .allowed();
                assert_eq!(layouts.is_ok(), admitted, "{heads} heads over {tp} ranks");
                let Ok(layouts) = layouts else { continue };
                let mut held = vec![0; heads as usize];
                for l in layouts {
                    for h in l.head_offset..l.head_offset + l.local_heads {
                        held[h as usize] += 1;
                    }
                }
                let each = (tp / heads).max(1);
                assert!(
                    held.iter().all(|n| *n == each),
                    "{heads} heads over {tp} ranks: ranks per head {held:?}"
                );
            }
        }
        let mut pp = par(1);
        pp.pipeline = 2;
        let e = PoolLayout::new(&of_heads(8), &pp, 1, 0).expect_err("pipeline stages are refused");
        assert!(e.0.contains("parallelism.pipeline is 2"), "{e}");
    }

    #[test]
    fn tensor_ranks_hold_contiguous_head_ranges() {
        let mut kv = of_heads(8);
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
        kv.mla = false;
        // The most ranks, the last one: its head offset computed without overflow.
        kv.kv_heads = 512;
        assert_eq!(at(&kv, 1024, 1023), (511, 1));
        // Beyond the bounds, or none: refused naming the field and the value (a peer claiming
        // 2^31 ranks would otherwise have the agent walk them all).
        for (tp, layers) in [(0, 1), (-1, 1), (1025, 1), (i32::MAX, 1), (1, 1025)] {
            kv.layers = layers;
            let e = PoolLayout::new(&kv, &par(tp), 1, 0).expect_err("refused");
            let named = if layers > 1024 {
                format!("kv.layers is {layers}")
            } else {
                format!("parallelism.tensor is {tp}")
            };
            assert!(e.0.contains(&named), "{e}");
        }
    }

    fn small(latent: bool) -> PoolLayout {
        PoolLayout {
            layers: 3,
            local_heads: 2,
            head_offset: 0,
            head_dim: 4,
            element_bytes: 2,
            block_size: 4,
            num_blocks: 5,
            layout: KvLayout::Hnd,
            latent,
            regions: vec![Region {
                first_layer: 0,
                layers: 3,
                arrangement: default_arrangement(latent),
                strides: None,
            }],
        }
    }

    /// Every region split and arrangement partitions each region into every layer's arrays'
    /// blocks, and `layer_offsets` (what the handshake tells peers) finds each block.
    #[test]
    fn regions_partition_into_every_layers_blocks() {
        use KvArrangement::*;
        type Spec = Vec<(u32, Option<KvArrangement>)>;
        let cases: Vec<(bool, Spec)> = vec![
            (false, vec![(3, Some(KvFirst))]),
            (false, vec![(3, Some(BlocksFirst))]),
            (false, vec![(1, None), (1, None), (1, None)]),
            (false, vec![(2, Some(BlocksFirst)), (1, Some(KvFirst))]),
            (true, vec![(3, None)]),
            (true, vec![(1, Some(Latent)), (2, None)]),
        ];
        for (latent, spec) in cases {
            let pool = small(latent).with_regions(&spec).expect("valid regions");
            let lens = pool.region_lens();
            assert_eq!(lens.iter().sum::<usize>(), pool.pool_len(), "{spec:?}");
            let mut seen: Vec<Vec<bool>> = lens.iter().map(|l| vec![false; *l]).collect();
            let at = pool.layer_offsets();
            for l in 0..3 {
                for v in pool.arrays() {
                    for b in 0..5 {
                        let (r, off) = pool.block_offset(l, *v, b);
                        let layer = at[l as usize];
                        let array = if *v { layer.v.expect("a V array") } else { layer.k };
                        assert_eq!(
                            (r, off),
                            (
                                layer.region as usize,
                                (array + u64::from(b) * layer.block_stride) as usize
                            ),
                            "{spec:?}"
                        );
                        for byte in &mut seen[r][off..off + pool.block_len()] {
                            assert!(!*byte, "{spec:?}: blocks overlap");
                            *byte = true;
                        }
                    }
                }
            }
            assert!(
                seen.iter().flatten().all(|b| *b),
                "{spec:?}: every byte belongs to a block"
            );
            assert_eq!(at.iter().all(|l| l.v.is_none()), latent, "MLA has no V array");
        }
        let fi = small(false).arranged(BlocksFirst);
        assert_eq!(
            fi.block_offset(1, true, 2),
            (0, 2 * 5 * 64 + 2 * 2 * 64 + 64),
            "FlashInfer's [N, 2, ...]"
        );
        let per_layer = small(false).with_regions(&[(1, None); 3]).expect("valid");
        assert_eq!(
            per_layer.block_offset(2, true, 1),
            (2, 5 * 64 + 64),
            "layer 2 is region 2's only layer"
        );
        let mla = small(true);
        assert_eq!(mla.pool_len(), 3 * 5 * 64, "MLA: one array per layer");
        assert_eq!(mla.block_offset(1, false, 2), (0, 5 * 64 + 2 * 64));
    }

    /// K and V side by side (vLLM 0.33): each head's each token's K then its V, at the strides
    /// the engine names, blocks outermost or layers outermost, every byte of the region one
    /// block's at most.
    #[test]
    fn side_by_side_regions_place_each_heads_token_k_then_v() {
        use KvArrangement::*;
        let chunk = 128u64; // 4 tokens x 2 heads x 8 bytes, K and V
        let spec = |layer, block| RegionSpec {
            layers: 3,
            arrangement: Some(Interleaved),
            strides: Some((layer, block)),
        };
        for (nhd, layer, block) in [
            (false, chunk, 3 * chunk + 32), // blocks outermost, 32 bytes between
            (true, 5 * chunk, chunk),       // layers outermost, dense
            (false, 6 * chunk, chunk + 16), // layers outermost, gaps
        ] {
            let layout = PoolLayout {
                layout: if nhd { KvLayout::Nhd } else { KvLayout::Hnd },
                ..small(false)
            }
            .with_region_specs(&[spec(Some(layer), Some(block))])
            .expect("valid strides");
            let len = layout.region_lens()[0];
            assert_eq!(
                len as u64,
                2 * layer + 4 * block + chunk,
                "ends at the last block's end"
            );
            assert_eq!(layout.pool_len(), len);
            let mut seen = vec![false; len];
            for l in 0..3u32 {
                assert_eq!(layout.unit(l), 16);
                assert_eq!(layout.block_span(l), 7 * 16 + 8);
                for b in 0..5u32 {
                    for h in 0..2u32 {
                        for t in 0..4u32 {
                            let i = if nhd { t * 2 + h } else { h * 4 + t };
                            let want = u64::from(l) * layer + u64::from(b) * block + u64::from(i) * 16;
                            for (v, off) in [(false, 0), (true, 8)] {
                                let (r, at) = layout.block_offset(l, v, b);
                                let at = at + layout.token_offset(l, h, t);
                                assert_eq!(
                                    (r, at as u64),
                                    (0, want + off),
                                    "layer {l} block {b} head {h} token {t}"
                                );
                                for byte in &mut seen[at..at + 8] {
                                    assert!(!*byte, "blocks overlap");
                                    *byte = true;
                                }
                            }
                        }
                    }
                }
                let at = layout.layer_offsets()[l as usize];
                assert_eq!(
                    (at.k, at.v, at.block_stride, at.unit),
                    (u64::from(l) * layer, Some(u64::from(l) * layer + 8), block, Some(16))
                );
            }
        }
        // Dense, as one kv_arrangement names it: the pool's size is K and V's.
        let dense = small(false).arranged(Interleaved);
        assert_eq!(dense.pool_len(), small(false).pool_len());
        assert_eq!(dense.block_offset(2, true, 3), (0, 2 * 5 * 128 + 3 * 128 + 8));
        // Blocks outermost, dense: a block's 3 layers back to back, the pool no larger.
        let outer = small(false).blocks_outermost();
        assert_eq!(outer.region_strides(0), Some((chunk, 3 * chunk)));
        assert_eq!(outer.pool_len(), small(false).pool_len());
        assert_eq!(outer.block_offset(2, true, 3), (0, 3 * 3 * 128 + 2 * 128 + 8));
        assert_eq!(small(false).region_strides(0), None, "KvFirst has none");
        // Strides that overlap blocks, or overflow, or on another arrangement: refused by name.
        let refused = |s: RegionSpec| small(false).with_region_specs(&[s]).expect_err("refused").0;
        let e = refused(spec(Some(2 * chunk), Some(chunk)));
        assert!(
            e.contains("regions[0].layer_stride 256 and regions[0].block_stride 128 make blocks of 128 bytes"),
            "{e}"
        );
        assert!(refused(spec(Some(chunk), Some(chunk - 8))).contains("overlap"));
        assert!(refused(spec(Some(u64::MAX / 2), Some(chunk))).contains("overflow the address space"));
        let e = refused(RegionSpec {
            arrangement: Some(KvFirst),
            strides: Some((None, Some(chunk))),
            ..spec(None, None)
        });
        assert!(
            e.contains("regions[0] names strides for a KvFirst region; only Interleaved"),
            "{e}"
        );
        // One layer: its layer stride is never used.
        let one = PoolLayout {
            layers: 1,
            ..small(false)
        }
        .with_region_specs(&[RegionSpec {
            layers: 1,
            ..spec(Some(0), Some(chunk))
        }])
        .expect("one layer");
        assert_eq!(one.region_lens(), vec![5 * 128]);
        // One block: its stride still at least a block's (peers take none shorter).
        let one_block = PoolLayout {
            num_blocks: 1,
            ..small(false)
        };
        let e = one_block
            .with_region_specs(&[spec(Some(chunk), Some(0))])
            .expect_err("refused")
            .0;
        assert!(e.contains("block_stride 0"), "{e}");
    }

    #[test]
    fn bad_regions_are_refused_naming_the_field() {
        use KvArrangement::*;
        let refused =
            |latent, spec: &[(u32, Option<KvArrangement>)]| small(latent).with_regions(spec).expect_err("refused").0;
        assert!(refused(false, &[]).contains("regions has 0 entries"));
        assert!(refused(false, &[(2, None)]).contains("regions hold 2 layers in all; the geometry has kv.layers 3"));
        assert!(refused(false, &[(3, None), (1, None)]).contains("regions hold 4 layers"));
        assert!(refused(false, &[(3, None), (0, None)]).contains("regions[1].layers is 0"));
        assert!(refused(false, &[(1, None), (2, Some(Latent))]).contains("regions[1].kv_arrangement is Latent"));
        assert!(refused(true, &[(3, Some(KvFirst))]).contains("regions[0].kv_arrangement is KvFirst; kv.mla is true"));
        assert!(refused(false, &vec![(1, None); MAX_REGIONS + 1]).contains("a pool has 1..=128"));
        assert!(
            refused(false, &[(u32::MAX, None), (4, None)]).contains("layers in all"),
            "a wrapping sum is refused"
        );
    }

    #[test]
    fn engine_layouts_checksum_like_the_canonical_dump() {
        use KvArrangement::*;
        for (latent, layout, spec) in [
            (false, KvLayout::Hnd, vec![(2, Some(KvFirst))]),
            (false, KvLayout::Nhd, vec![(2, Some(KvFirst))]),
            (false, KvLayout::Hnd, vec![(2, Some(BlocksFirst))]),
            (false, KvLayout::Nhd, vec![(1, Some(BlocksFirst)), (1, Some(KvFirst))]),
            (false, KvLayout::Hnd, vec![(2, Some(Interleaved))]),
            (false, KvLayout::Nhd, vec![(1, Some(Interleaved)), (1, Some(KvFirst))]),
            (true, KvLayout::Nhd, vec![(2, None)]),
            (true, KvLayout::Hnd, vec![(1, None), (1, None)]),
        ] {
            let pool = PoolLayout {
                layers: 2,
                local_heads: 3,
                head_dim: 4,
                num_blocks: 3,
                layout,
                ..small(latent)
            }
            .with_regions(&spec)
            .expect("valid");
            let regions: Vec<Vec<u8>> = pool
                .region_lens()
                .iter()
                .enumerate()
                .map(|(r, len)| (0..*len).map(|i| (i * 31 + 7 + r * 101) as u8).collect())
                .collect();
            let memory: Vec<&[u8]> = regions.iter().map(Vec::as_slice).collect();
            // Build the canonical dump of block 1 from the engine memory.
            let half = pool.half_token();
            let mut canonical = Vec::new();
            for l in 0..2 {
                for h in 0..3 {
                    for i in 0..4 {
                        for v in pool.arrays() {
                            let (r, at) = pool.block_offset(l, *v, 1);
                            let at = at + pool.token_offset(l, h, i);
                            canonical.extend_from_slice(&memory[r][at..at + half]);
                        }
                    }
                }
            }
            let reference = reference_block(&pool.shape(), &canonical, 4, 8, 11).expect("valid");
            assert_eq!(pool.checksum(&memory, 1, 8, 11), Some(reference), "{layout:?} {spec:?}");
            assert_eq!(
                pool.checksum(&memory[..memory.len() - 1], 1, 8, 11),
                None,
                "a region missing"
            );
        }
    }
}
