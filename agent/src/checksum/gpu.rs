//! The KV checksum as a CUDA kernel (compiled at run time with NVRTC), over a pool's blocks where
//! they are in device memory: only the sums come back to the host, one u64 per block. Same
//! definition as [`super::cpu`] and `pdpair_api::checksum`, bit for bit (`agent/tests/gpu.rs`
//! compares them on the same blocks; it needs a GPU and runs in `make gpu-check`).
//!
//! One CUDA block per (KV block, layer, head) sums `x * (2j + 1)` over its tokens' pieces with
//! 16-byte loads (8-byte where a half token is not a multiple of 16 bytes or an array is not
//! 16-byte aligned), reduces across the block with warp shuffles, multiplies by the head's `m`
//! and adds into its KV block's sum (wrapping: the sum is modulo 2^64 however it is grouped).
#![allow(unsafe_code)]

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use pdpair_api::KvLayout;

use crate::{
    layout::PoolLayout,
    memory::cuda::{CudaError, DeviceMemory, Gpu, compile, driver},
};

/// The kernels' CUDA source.
pub const SOURCE: &str = r#"
typedef unsigned long long u64;

__device__ __forceinline__ u64 block_sum(u64 acc, u64* warp_sums) {
    for (int s = 16; s > 0; s >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, s);
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    acc = 0;
    if (warp == 0) {
        if (lane < ((blockDim.x + 31u) >> 5)) acc = warp_sums[lane];
        for (int s = 16; s > 0; s >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, s);
    }
    return acc; // meaningful in thread 0
}

// ptrs: per (job, layer) the device addresses of the block's K (or latent) and V arrays, and the
// bytes from one head's token to the next (a half token; twice that with K and V side by side).
extern "C" __global__ void kv_checksum(
    const u64* __restrict__ ptrs, const u64* __restrict__ first_tokens, u64* __restrict__ out,
    unsigned layers, unsigned local_heads, unsigned first_head, unsigned global_first_head,
    unsigned block_size, unsigned half_bytes, unsigned nhd, unsigned latent, unsigned vec16,
    u64 num_tokens)
{
    __shared__ u64 warp_sums[32];
    const unsigned job = blockIdx.x, l = blockIdx.y, hh = blockIdx.z;
    const u64 h = first_head + hh;
    const u64 t0 = first_tokens[job];
    const u64 live = num_tokens > t0 ? (num_tokens - t0 < block_size ? num_tokens - t0 : block_size) : 0;
    const u64 ph = half_bytes / 8;
    const u64 P = latent ? ph : 2 * ph;
    const char* k = (const char*)ptrs[((u64)job * layers + l) * 3];
    const char* v = (const char*)ptrs[((u64)job * layers + l) * 3 + 1];
    const u64 unit = ptrs[((u64)job * layers + l) * 3 + 2];
    u64 acc = 0;
    // 32-bit index math (the host checks block_size * pieces fits): 64-bit division is slow.
    const unsigned per = vec16 ? (unsigned)(ph / 2) : (unsigned)ph;
    const unsigned n = (unsigned)live * per;
    for (unsigned idx = threadIdx.x; idx < n; idx += blockDim.x) {
        const u64 i = idx / per, q = idx % per;
        const u64 token = nhd ? (i * local_heads + h) : (h * block_size + i);
        const u64 t = t0 + i;
        if (vec16) {
            const u64 off = token * unit + 16 * q;
            const u64 j = t * P + 2 * q;
            const ulonglong2 x = *(const ulonglong2*)(k + off);
            acc += x.x * (2 * j + 1) + x.y * (2 * j + 3);
            if (!latent) {
                const ulonglong2 y = *(const ulonglong2*)(v + off);
                const u64 jv = j + ph;
                acc += y.x * (2 * jv + 1) + y.y * (2 * jv + 3);
            }
        } else {
            const u64 off = token * unit + 8 * q;
            const u64 j = t * P + q;
            acc += *(const u64*)(k + off) * (2 * j + 1);
            if (!latent) acc += *(const u64*)(v + off) * (2 * (j + ph) + 1);
        }
    }
    acc = block_sum(acc, warp_sums);
    if (threadIdx.x == 0) {
        const u64 m = 2 * ((u64)l * 65536 + global_first_head + hh) + 1;
        atomicAdd(&out[job], acc * m);
    }
}

// A plain read of n16 16-byte words (the ceiling the checksum is compared with): their xor-sum,
// so the loads are not optimised away.
extern "C" __global__ void read_words(const ulonglong2* __restrict__ p, u64 n16, u64* __restrict__ out) {
    __shared__ u64 warp_sums[32];
    u64 acc = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (u64)gridDim.x * blockDim.x) {
        const ulonglong2 x = p[i];
        acc += x.x ^ x.y;
    }
    acc = block_sum(acc, warp_sums);
    if (threadIdx.x == 0) atomicAdd(out, acc);
}
"#;

/// Threads per CUDA block.
const THREADS: u32 = 256;

/// The checksum kernels, loaded on one GPU.
#[derive(Debug, Clone)]
pub struct GpuChecksum {
    gpu: Gpu,
    checksum: CudaFunction,
    read: CudaFunction,
}

/// One checksum launch with its tables on the device ([`GpuChecksum::prepare`]).
#[derive(Debug)]
pub struct Launch {
    ptrs: CudaSlice<u64>,
    first_tokens: CudaSlice<u64>,
    out: CudaSlice<u64>,
    jobs: u32,
    layers: u32,
    heads: u32,
    /// layers, local heads, first local head, first global head, block size, half-token bytes,
    /// NHD, latent, 16-byte steps: kv_checksum's unsigned parameters, in order.
    params: [u32; 9],
    num_tokens: u64,
}

/// A plain read prepared on the device ([`GpuChecksum::prepare_read`]).
#[derive(Debug)]
pub struct ReadLaunch {
    ptr: u64,
    n16: u64,
    grid: u32,
    out: CudaSlice<u64>,
}

/// Which blocks to sum: the `j`th of `blocks` holds tokens from `first_token + j * block_size`,
/// and local heads `first..first + count` are summed (a decode rank's share of a prefill rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocks<'a> {
    /// Pool block indices, in token order.
    pub blocks: &'a [u32],
    /// The first block's first token.
    pub first_token: u64,
    /// The request's token count (later tokens count as zero).
    pub num_tokens: u64,
    /// First local head.
    pub first: u32,
    /// Local heads.
    pub count: u32,
}

impl<'a> Blocks<'a> {
    /// Every head of `blocks` of a pool, the `j`th holding tokens from `j * block_size`, all
    /// of them filled.
    pub fn whole(layout: &PoolLayout, blocks: &'a [u32]) -> Blocks<'a> {
        Blocks {
            blocks,
            first_token: 0,
            num_tokens: blocks.len() as u64 * u64::from(layout.block_size),
            first: 0,
            count: layout.local_heads,
        }
    }
}

impl GpuChecksum {
    /// Compiles and loads the kernels on `gpu`.
    pub fn new(gpu: &Gpu) -> Result<GpuChecksum, CudaError> {
        let module = compile(gpu, SOURCE, "checksum")?;
        Ok(GpuChecksum {
            gpu: gpu.clone(),
            checksum: module
                .load_function("kv_checksum")
                .map_err(driver("cuModuleGetFunction"))?,
            read: module
                .load_function("read_words")
                .map_err(driver("cuModuleGetFunction"))?,
        })
    }

    /// The checksums of `which` blocks of a pool laid out as `layout` whose regions start at
    /// device addresses `bases` (one per region, each at least its region's length), one per
    /// block: what [`PoolLayout::checksum_heads`] computes over host memory.
    ///
    /// # Safety
    /// Each `bases[r]..+region_lens()[r]` must be live device memory mapped in this GPU's
    /// context until this returns.
    pub unsafe fn block_sums(
        &self,
        layout: &PoolLayout,
        bases: &[u64],
        which: &Blocks<'_>,
    ) -> Result<Vec<u64>, CudaError> {
        // SAFETY: passed on from the caller.
        let mut launch = unsafe { self.prepare(layout, bases, which) }?;
        self.launch(&mut launch)?;
        self.collect(&launch)
    }

    /// Checks `which` against the layout and uploads the launch's tables (the per-request part
    /// of the work that is not the kernel).
    ///
    /// # Safety
    /// As [`GpuChecksum::block_sums`], until the last [`GpuChecksum::collect`] of the launch.
    pub unsafe fn prepare(&self, layout: &PoolLayout, bases: &[u64], which: &Blocks<'_>) -> Result<Launch, CudaError> {
        let (ptrs, first_tokens, vec16) = plan(layout, bases, which)?;
        let jobs = u32::try_from(which.blocks.len())
            .ok()
            .filter(|j| *j <= 0x7fff_ffff)
            .ok_or_else(|| CudaError::Invalid(format!("{} blocks in one launch", which.blocks.len())))?;
        self.gpu.bind()?;
        let stream = self.gpu.stream();
        // Empty tables cannot be uploaded; an empty launch has nothing to sum.
        let upload = |v: &[u64]| stream.clone_htod(if v.is_empty() { &[0u64][..] } else { v });
        Ok(Launch {
            ptrs: upload(&ptrs).map_err(driver("cuMemcpyHtoD"))?,
            first_tokens: upload(&first_tokens).map_err(driver("cuMemcpyHtoD"))?,
            out: stream
                .alloc_zeros::<u64>(which.blocks.len().max(1))
                .map_err(driver("cuMemAlloc"))?,
            jobs,
            layers: layout.layers,
            heads: which.count,
            params: [
                layout.layers,
                layout.local_heads,
                which.first,
                layout.head_offset + which.first,
                layout.block_size,
                layout.half_token() as u32,
                u32::from(layout.layout == KvLayout::Nhd),
                u32::from(layout.latent),
                vec16,
            ],
            num_tokens: which.num_tokens,
        })
    }

    /// Queues the kernel (its sums zeroed first) on the agent's stream.
    pub fn launch(&self, l: &mut Launch) -> Result<(), CudaError> {
        if l.jobs == 0 || l.layers == 0 || l.heads == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let stream = self.gpu.stream();
        stream.memset_zeros(&mut l.out).map_err(driver("cuMemsetD8Async"))?;
        let cfg = LaunchConfig {
            grid_dim: (l.jobs, l.layers, l.heads),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = stream.launch_builder(&self.checksum);
        args.arg(&l.ptrs).arg(&l.first_tokens).arg(&mut l.out);
        for p in &l.params {
            args.arg(p);
        }
        args.arg(&l.num_tokens);
        // SAFETY: the arguments match kv_checksum's signature (three tables, nine unsigned, one
        // u64); every address in the table was checked to lie in its region (plan), which the
        // caller of prepare keeps alive.
        unsafe { args.launch(cfg) }.map_err(driver("cuLaunchKernel"))?;
        Ok(())
    }

    /// Waits for the launch and returns its sums, one per block.
    pub fn collect(&self, l: &Launch) -> Result<Vec<u64>, CudaError> {
        if l.jobs == 0 {
            return Ok(Vec::new());
        }
        self.gpu.bind()?;
        let mut sums = self.gpu.stream().clone_dtoh(&l.out).map_err(driver("cuMemcpyDtoH"))?;
        sums.truncate(l.jobs as usize);
        Ok(sums)
    }

    /// [`GpuChecksum::block_sums`] over device memory this process holds or opened: one
    /// [`DeviceMemory`] per region, each at least its region's length.
    pub fn sums(
        &self,
        layout: &PoolLayout,
        regions: &[&DeviceMemory],
        which: &Blocks<'_>,
    ) -> Result<Vec<u64>, CudaError> {
        for (r, (memory, len)) in regions.iter().zip(layout.region_lens()).enumerate() {
            memory
                .range(0, len)
                .map_err(|e| CudaError::Invalid(format!("region {r}: {e}")))?;
        }
        let bases: Vec<u64> = regions.iter().map(|m| m.ptr()).collect();
        // SAFETY: each region lies in live device memory held by the caller for this call.
        unsafe { self.block_sums(layout, &bases, which) }
    }

    /// A plain read of all of `memory` (its length rounded down to 16 bytes) with 16-byte loads,
    /// in `grid` blocks: the ceiling the checksum is compared with. Its sum is allocated here;
    /// [`GpuChecksum::launch_read`] queues the read alone.
    pub fn prepare_read(&self, memory: &DeviceMemory, grid: u32) -> Result<ReadLaunch, CudaError> {
        self.gpu.bind()?;
        Ok(ReadLaunch {
            ptr: memory.ptr(),
            n16: (memory.len() / 16) as u64,
            grid: grid.max(1),
            out: self.gpu.stream().alloc_zeros::<u64>(1).map_err(driver("cuMemAlloc"))?,
        })
    }

    /// Queues the read.
    pub fn launch_read(&self, r: &mut ReadLaunch) -> Result<(), CudaError> {
        self.gpu.bind()?;
        let stream = self.gpu.stream();
        stream.memset_zeros(&mut r.out).map_err(driver("cuMemsetD8Async"))?;
        let cfg = LaunchConfig {
            grid_dim: (r.grid, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(&self.read);
        launch.arg(&r.ptr).arg(&r.n16).arg(&mut r.out);
        // SAFETY: matches read_words' signature; the memory was live at prepare_read and the
        // caller holds it (a DeviceMemory waits for queued work before it is freed).
        unsafe { launch.launch(cfg) }.map_err(driver("cuLaunchKernel"))?;
        Ok(())
    }

    /// Waits for the read and returns its sum.
    pub fn collect_read(&self, r: &ReadLaunch) -> Result<u64, CudaError> {
        self.gpu.bind()?;
        Ok(self.gpu.stream().clone_dtoh(&r.out).map_err(driver("cuMemcpyDtoH"))?[0])
    }

    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

/// The launch's tables, checked on the host before any address reaches the kernel: per (block,
/// layer) the K and V array addresses (each array's block inside its region) and the bytes from
/// one head's token to the next, per block its first token, and whether 16-byte loads are
/// aligned everywhere.
pub fn plan(layout: &PoolLayout, bases: &[u64], which: &Blocks<'_>) -> Result<(Vec<u64>, Vec<u64>, u32), CudaError> {
    let half = layout.half_token();
    if half == 0 || !half.is_multiple_of(8) {
        return Err(CudaError::Invalid(format!(
            "a half token of {half} bytes is not whole 8-byte pieces: the GPU checksum needs them (the CPU one does not)"
        )));
    }
    let lens = layout.region_lens();
    if bases.len() != lens.len() {
        return Err(CudaError::Invalid(format!(
            "{} region addresses for a pool of {} regions",
            bases.len(),
            lens.len()
        )));
    }
    if which
        .first
        .checked_add(which.count)
        .is_none_or(|e| e > layout.local_heads)
    {
        return Err(CudaError::Invalid(format!(
            "heads {}..+{} of a pool with {} local heads",
            which.first, which.count, layout.local_heads
        )));
    }
    // The kernel's grid: y is the layers, z the heads (at most 65535 each); its index math is
    // 32-bit over a block's tokens times pieces.
    if layout.layers > 65535 || which.count > 65535 {
        return Err(CudaError::Invalid(format!(
            "{} layers and {} heads: a launch takes at most 65535 of each",
            layout.layers, which.count
        )));
    }
    if u64::from(layout.block_size) * (half as u64 / 8) > u64::from(u32::MAX) {
        return Err(CudaError::Invalid(format!(
            "blocks of {} tokens of {half}-byte halves are too large for one CUDA block's index",
            layout.block_size
        )));
    }
    let mut ptrs = Vec::with_capacity(which.blocks.len() * layout.layers as usize * 3);
    let mut first_tokens = Vec::with_capacity(which.blocks.len());
    let mut aligned = half.is_multiple_of(16);
    for (j, &block) in which.blocks.iter().enumerate() {
        if block >= layout.num_blocks {
            return Err(CudaError::Invalid(format!(
                "block {block} of a pool of {} blocks",
                layout.num_blocks
            )));
        }
        first_tokens.push(which.first_token + j as u64 * u64::from(layout.block_size));
        for l in 0..layout.layers {
            let span = layout.block_span(l) as u64;
            for v in [false, true] {
                if v && layout.latent {
                    ptrs.push(0);
                    continue;
                }
                let (r, at) = layout.block_offset(l, v, block);
                if at as u64 + span > lens[r] as u64 {
                    return Err(CudaError::Invalid(format!(
                        "layer {l} block {block} runs past region {r}"
                    )));
                }
                let ptr = bases[r]
                    .checked_add(at as u64)
                    .ok_or_else(|| CudaError::Invalid(format!("region {r}'s address wraps")))?;
                // 8-byte loads need 8-byte alignment (a misaligned load poisons the context).
                if !ptr.is_multiple_of(8) {
                    return Err(CudaError::Invalid(format!(
                        "layer {l} block {block} is at {ptr:#x}, not 8-byte aligned"
                    )));
                }
                aligned &= ptr.is_multiple_of(16);
                ptrs.push(ptr);
            }
            ptrs.push(layout.unit(l) as u64);
        }
    }
    Ok((ptrs, first_tokens, u32::from(aligned)))
}

#[cfg(test)]
mod tests;
