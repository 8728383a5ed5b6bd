//! Many device-to-device copies as one kernel launch (compiled at run time with NVRTC).
//!
//! A request's copies are as many as its blocks times layers times K and V where neither side's
//! blocks lie in order (a real engine's free list hands them out scattered), and one per head's
//! token where one side keeps K and V side by side and the other in arrays. Queued one by one,
//! each costs the driver microseconds, far more than its bytes take. So copies shorter than
//! [`SHORT`] are cut into pieces of at most [`PIECE`] bytes and moved by one launch of
//! `copy_pieces` reading a table of them; longer copies (coalesced runs of blocks) still go to
//! `cuMemcpyAsync`, one call each. Where there are fewer than [`MIN_PIECES`] pieces, copies are
//! queued one by one as before (a launch and its table cost about what a few copies do).
//!
//! The launch runs on the GPU whose stream queues it, so every range must be memory of that GPU
//! (the caller decides: `transport::cuda_ipc` launches only where every region an op touches is
//! on it; between two GPUs `cuMemcpyAsync` finds the way). What reaches the table was checked by
//! the caller to lie in memory it holds until the stream has passed the launch; the kernel
//! touches only the table's ranges. The table goes up from pageable host memory, which CUDA
//! starts only once the stream has passed what was queued on it before (the agent's own copies,
//! which never wait for an engine).
#![allow(unsafe_code)]

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use crate::memory::cuda::{CudaError, Gpu, compile, driver};

/// The kernel's CUDA source.
pub const SOURCE: &str = r#"
typedef unsigned long long u64;

// table: per piece its destination, source and length in bytes. A warp moves a piece at a time
// (a piece may be a few hundred bytes: a CUDA block per piece would leave most threads idle): in
// 16-byte words where both addresses and the length are multiples of 16, in 8-byte words where
// they are of 8, else byte by byte.
extern "C" __global__ void copy_pieces(const u64* __restrict__ table, u64 pieces) {
    const u64 per_block = blockDim.x / 32;
    const u64 warps = (u64)gridDim.x * per_block;
    const u64 lane = threadIdx.x & 31u;
    for (u64 p = (u64)blockIdx.x * per_block + threadIdx.x / 32; p < pieces; p += warps) {
        const u64 dst = table[3 * p], src = table[3 * p + 1], len = table[3 * p + 2];
        const u64 all = dst | src | len;
        if ((all & 15) == 0) {
            ulonglong2* d = (ulonglong2*)dst;
            const ulonglong2* s = (const ulonglong2*)src;
            for (u64 i = lane; i < len / 16; i += 32) d[i] = s[i];
        } else if ((all & 7) == 0) {
            u64* d = (u64*)dst;
            const u64* s = (const u64*)src;
            for (u64 i = lane; i < len / 8; i += 32) d[i] = s[i];
        } else {
            unsigned char* d = (unsigned char*)dst;
            const unsigned char* s = (const unsigned char*)src;
            for (u64 i = lane; i < len; i += 32) d[i] = s[i];
        }
    }
}
"#;

/// Copies at least this long go to `cuMemcpyAsync`, one call each (a 16-token block of a layer's
/// K of an 8B-class model is 64 KiB; a coalesced run of blocks is megabytes).
pub const SHORT: u64 = 256 << 10;
/// The longest piece of the table (a longer copy is cut at multiples of it from its start, which
/// keeps its pieces as aligned as it is): short enough that a launch's pieces spread over the
/// GPU's multiprocessors.
pub const PIECE: u64 = 64 << 10;
/// Fewer pieces than this go one copy each.
pub const MIN_PIECES: usize = 8;
/// Threads per CUDA block (whole warps: a warp takes a piece).
const THREADS: u32 = 256;
/// CUDA blocks per launch at most (each warp then takes pieces all the grid's warps apart).
const MAX_GRID: u64 = 16384;

/// `(dst, src, len)` copies, split: `engine` one `cuMemcpyAsync` each, `table` the kernel's
/// pieces (three u64 each: destination, source, length).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Split {
    /// Copies for the copy engine, in the order given.
    pub engine: Vec<(u64, u64, u64)>,
    /// The kernel's table.
    pub table: Vec<u64>,
}

impl Split {
    /// Pieces in the table.
    pub fn pieces(&self) -> usize {
        self.table.len() / 3
    }
}

/// Splits `copies` between the copy engine and the kernel's table (all to the engine when
/// `kernel` is false, or the table would have fewer than [`MIN_PIECES`] pieces). Empty copies
/// are dropped. Each copy's ranges must not wrap the address space (the callers checked them
/// inside memory first).
pub fn split(copies: &[(u64, u64, u64)], kernel: bool) -> Split {
    let short: u64 = copies
        .iter()
        .filter(|c| c.2 > 0 && c.2 < SHORT)
        .map(|c| c.2.div_ceil(PIECE))
        .sum();
    let mut out = Split::default();
    if !kernel || short < MIN_PIECES as u64 {
        out.engine = copies.iter().copied().filter(|c| c.2 > 0).collect();
        return out;
    }
    out.table.reserve(3 * short as usize);
    for &(dst, src, len) in copies {
        if len >= SHORT {
            out.engine.push((dst, src, len));
            continue;
        }
        let mut at = 0;
        while at < len {
            let n = PIECE.min(len - at);
            out.table.extend([dst + at, src + at, n]);
            at += n;
        }
    }
    out
}

/// The kernel, loaded on one GPU.
#[derive(Debug)]
pub struct BatchCopy {
    gpu: Gpu,
    function: CudaFunction,
}

impl BatchCopy {
    /// Compiles and loads the kernel on `gpu`.
    pub fn new(gpu: &Gpu) -> Result<BatchCopy, CudaError> {
        let module = compile(gpu, SOURCE, "batch copy")?;
        Ok(BatchCopy {
            gpu: gpu.clone(),
            function: module
                .load_function("copy_pieces")
                .map_err(driver("cuModuleGetFunction"))?,
        })
    }

    /// The GPU it is loaded on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Queues `split` on the GPU's agent stream: the table (uploaded first: an upload from
    /// pageable memory waits for the stream) as one launch, then the engine's copies. Returns
    /// the bytes queued.
    ///
    /// # Safety
    /// Every range in `split` must lie in live device memory reachable from this GPU's context
    /// (its own, or opened through IPC) until the stream has passed what is queued here. (Where
    /// two destinations overlap, what those bytes end up holding is unspecified, as with copies
    /// on several streams; nothing outside the ranges is touched.)
    pub unsafe fn queue(&self, split: &Split) -> Result<u64, CudaError> {
        let mut bytes = 0u64;
        if !split.table.is_empty() {
            self.gpu.bind()?;
            let stream = self.gpu.stream();
            // Freed in stream order after the launch (cudarc's drop), so it may go at the end of
            // this call.
            let table = stream.clone_htod(&split.table).map_err(driver("cuMemcpyHtoDAsync"))?;
            let pieces = split.pieces() as u64;
            let cfg = LaunchConfig {
                grid_dim: (pieces.div_ceil(u64::from(THREADS / 32)).min(MAX_GRID) as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut args = stream.launch_builder(&self.function);
            args.arg(&table).arg(&pieces);
            // SAFETY: matches copy_pieces' signature (a table, a u64); every range in it is the
            // caller's to guarantee.
            unsafe { args.launch(cfg) }.map_err(driver("cuLaunchKernel"))?;
            bytes += split.table.chunks_exact(3).map(|p| p[2]).sum::<u64>();
        }
        for &(dst, src, len) in &split.engine {
            // SAFETY: the caller's guarantee.
            unsafe { self.gpu.copy_any_async(dst, src, len as usize) }?;
            bytes += len;
        }
        Ok(bytes)
    }
}

/// Queues `copies` on `gpu`'s agent stream: through `kernel` where there is one (and enough short
/// copies for it), else one `cuMemcpyAsync` each. Returns the bytes queued and the pieces the
/// kernel took.
///
/// # Safety
/// As [`BatchCopy::queue`].
pub unsafe fn queue(
    gpu: &Gpu,
    kernel: Option<&BatchCopy>,
    copies: &[(u64, u64, u64)],
) -> Result<(u64, usize), CudaError> {
    let split = split(copies, kernel.is_some());
    match kernel {
        // SAFETY: passed on from the caller.
        Some(k) => unsafe { k.queue(&split) }.map(|b| (b, split.pieces())),
        None => {
            let mut bytes = 0;
            for &(dst, src, len) in &split.engine {
                // SAFETY: passed on from the caller.
                unsafe { gpu.copy_any_async(dst, src, len as usize) }?;
                bytes += len;
            }
            Ok((bytes, 0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `parts` tile `copies` exactly (every byte of every copy once, source with its
    /// destination), where no two copies' destinations overlap.
    fn tiles(mut parts: Vec<(u64, u64, u64)>, copies: &[(u64, u64, u64)]) -> bool {
        parts.sort_unstable();
        let inside = parts.iter().all(|p| {
            copies
                .iter()
                .any(|c| c.0 <= p.0 && p.0 + p.2 <= c.0 + c.2 && p.1.wrapping_sub(c.1) == p.0 - c.0)
        });
        let apart = parts.windows(2).all(|w| w[0].0 + w[0].2 <= w[1].0);
        let sum = |v: &[(u64, u64, u64)]| v.iter().map(|c| c.2).sum::<u64>();
        inside && apart && sum(&parts) == sum(copies)
    }

    fn pieces(s: &Split) -> Vec<(u64, u64, u64)> {
        s.table.chunks_exact(3).map(|p| (p[0], p[1], p[2])).collect()
    }

    #[test]
    fn every_byte_goes_once_long_copies_to_the_engine_short_ones_to_the_table_in_aligned_pieces() {
        // Scattered 64 KiB blocks, 256-byte pieces, a 100-byte odd one, an empty one, and copies
        // at and past the engine's bound.
        let mut copies: Vec<(u64, u64, u64)> = (0..12u64).map(|i| ((i * 7 % 12) << 20, i << 20, 64 << 10)).collect();
        copies.extend((0..9u64).map(|i| ((1 << 30) + i * 512, (2 << 30) + i * 256, 256)));
        copies.push(((3 << 30) + 3, (4 << 30) + 5, 100));
        copies.push(((3 << 30) + 1000, (4 << 30) + 1000, 0));
        copies.push((5 << 30, 6 << 30, SHORT));
        copies.push((7 << 30, 8 << 30, SHORT - 16));
        let s = split(&copies, true);
        assert_eq!(s.engine, vec![(5 << 30, 6 << 30, SHORT)]);
        // Whole pieces of at most PIECE bytes, cut at multiples of PIECE from their copy's start.
        for (d, src, n) in pieces(&s) {
            assert!(n > 0 && n <= PIECE, "{n}");
            let c = copies
                .iter()
                .find(|c| c.0 <= d && d < c.0 + c.2)
                .expect("a piece of a copy");
            assert_eq!((d - c.0) % PIECE, 0, "cut at a multiple of PIECE from its copy's start");
            assert_eq!(src - c.1, d - c.0, "source and destination advance together");
            assert!(d - c.0 + n <= c.2, "inside its copy");
        }
        assert_eq!(s.pieces(), 12 + 9 + 1 + (SHORT - 16).div_ceil(PIECE) as usize);
        let mut all = pieces(&s);
        all.extend(&s.engine);
        assert!(tiles(all, &copies));
        // (The check itself: a piece dropped or doubled is caught.)
        let mut one_short = pieces(&s);
        one_short.pop();
        assert!(!tiles(one_short, &copies));
        let mut doubled = pieces(&s);
        doubled.push(doubled[0]);
        assert!(!tiles(doubled, &copies));
    }

    #[test]
    fn few_pieces_or_no_kernel_go_one_copy_each() {
        let few: Vec<(u64, u64, u64)> = (0..MIN_PIECES as u64 - 1)
            .map(|i| (i << 20, (i + 64) << 20, 4096))
            .collect();
        let s = split(&few, true);
        assert_eq!((s.engine.clone(), s.pieces()), (few.clone(), 0));
        let mut many = few.clone();
        many.push((1 << 40, 1 << 41, 4096));
        assert_eq!(split(&many, true).pieces(), MIN_PIECES);
        let s = split(&many, false);
        assert_eq!((s.pieces(), s.engine), (0, many));
        // Two copies just short of SHORT are MIN_PIECES pieces: the kernel's; at SHORT, the engine's.
        let near = SHORT - 16;
        assert_eq!(SHORT.div_ceil(PIECE) * 2, MIN_PIECES as u64);
        assert_eq!(
            split(&[(0, 1 << 30, near), (1 << 20, 1 << 31, near)], true).pieces(),
            MIN_PIECES
        );
        let at = [(0, 1 << 30, SHORT), (1 << 20, 1 << 31, SHORT)];
        assert_eq!(split(&at, true).engine, at.to_vec());
    }
}
