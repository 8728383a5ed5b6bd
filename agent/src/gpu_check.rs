//! `pdpair-agent gpu-check`: what `make gpu-check` measures on a machine with an NVIDIA GPU, and
//! checks while it measures. Built on a machine without CUDA (cudarc loads libcuda and libnvrtc
//! at run time) and carried there: nothing is built on the GPU machine.
//!
//! Rows: the device-to-device copy ceiling; the checksum kernel beside a plain read of the same
//! bytes, its sums compared with the CPU checksum of every block; a push through a CUDA IPC
//! handle from a second process (the prefill side) into this one's pool, coalesced, block by
//! block, and block by block to scattered blocks in one launch of the batch copy kernel, for a
//! 4096-token prompt of 16-token blocks, the last verified by checksum on the receiving GPU.
//! Then requests through the agent (`pdpair-agent run` as a child process, GPU pools of two
//! synthetic GPU engines registered by IPC handle): 1 GiB of blocks with checksums off and with
//! FailClosed (both sides' GPU checksums), a 4096-token prompt, and the same prompt with both
//! pools shared as VMM allocations (`ShareGpuMemory`, 20 MiB each, as torch's
//! `expandable_segments` maps them), each from `KvReady` to decode's `RequestDone`, every byte
//! read back and checked, the path from the agent's metrics.
//! Last, the same between two agents (`--transport tcp` both, the engines on one GPU but behind
//! different agents): GPU KV staged through each agent's host buffers over the KV stream
//! (`Tcp/StagedStream` expected).
#![allow(unsafe_code)] // a checksum launch's `prepare` and a batch copy, over memory the check holds

use std::{
    io::{BufRead, Write},
    process::{Command, Stdio},
};

use pdpair_api::{CacheDtype, KvGeometry, KvLayout, ModelDtype, Parallelism};
use serde::Serialize;

use crate::{
    checksum::gpu::{Blocks, GpuChecksum},
    layout::PoolLayout,
    memory::{
        batch_copy::{self, BatchCopy},
        cuda::{CudaError, DeviceMemory, Gpu, IpcHandle},
    },
};

/// Arguments of `pdpair-agent gpu-check`.
#[derive(Clone, Debug, clap::Args)]
pub struct GpuCheckArgs {
    /// MiB for the copy and checksum rows.
    #[arg(long, default_value_t = 1024)]
    pub mib: usize,
    /// Repetitions of each timed step (the best is reported).
    #[arg(long, default_value_t = 5)]
    pub repeat: u32,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Output format.
    #[arg(short = 'o', long = "output", default_value = "text", value_parser = ["text", "json"])]
    pub output: String,
    /// Also write the report as JSON to this file.
    #[arg(long = "json-file", value_name = "FILE")]
    pub json_file: Option<std::path::PathBuf>,
    /// The prefill side of the IPC row (reads `<handle hex> <bytes>` on stdin).
    #[arg(long = "ipc-child", hide = true)]
    pub ipc_child: bool,
}

/// One measured row.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// What was measured.
    pub what: String,
    /// GB/s (10^9 bytes per second), where it is a rate.
    pub gbps: Option<f64>,
    /// Milliseconds, best of the repetitions.
    pub ms: Option<f64>,
    /// What was checked, and the outcome.
    pub check: String,
    /// The path the bytes took.
    pub path: String,
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The GPU's name.
    pub gpu: String,
    /// Its UUID.
    pub uuid: String,
    /// The rows.
    pub rows: Vec<Row>,
    /// Whether every check passed.
    pub ok: bool,
}

/// The 8B-class geometry the rows use: 32 layers, 8 KV heads of 128, bf16, 16-token blocks, HND.
pub fn geometry() -> KvGeometry {
    KvGeometry {
        engine: "vllm".into(),
        engine_version: None,
        model: "8b-class".into(),
        dtype: ModelDtype::Bfloat16,
        cache_dtype: CacheDtype::Auto,
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        attention_backend: "FLASH_ATTN".into(),
        layout: KvLayout::Hnd,
        block_size: 16,
        kernel_block_size: None,
        mla: false,
        hybrid: false,
        host_buffer: false,
    }
}

fn layout_for(bytes: usize) -> Result<PoolLayout, CudaError> {
    let one = PoolLayout::new(&geometry(), &Parallelism::default(), 1, 0).map_err(|e| CudaError::Invalid(e.0))?;
    let per_block = one.pool_len();
    let blocks = u32::try_from((bytes / per_block).max(1)).unwrap_or(u32::MAX);
    PoolLayout::new(&geometry(), &Parallelism::default(), blocks, 0).map_err(|e| CudaError::Invalid(e.0))
}

/// Deterministic bytes (xorshift over u64 words), for checks and tests.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn gbps(bytes: usize, ms: f64) -> f64 {
    bytes as f64 / (ms / 1e3) / 1e9
}

fn best(repeat: u32, mut step: impl FnMut() -> Result<f32, CudaError>) -> Result<f64, CudaError> {
    let mut best = f64::MAX;
    for _ in 0..repeat.max(1) {
        best = best.min(f64::from(step()?));
    }
    Ok(best)
}

/// Runs the check (or, with `--ipc-child`, the prefill side of the IPC row).
pub fn run(args: &GpuCheckArgs, out: &mut dyn Write) -> Result<bool, CudaError> {
    let gpu = Gpu::open(args.gpu)?;
    if args.ipc_child {
        ipc_child(&gpu, args.repeat)?;
        return Ok(true);
    }
    let bytes = args.mib << 20;
    let mut rows = Vec::new();
    let mut ok = true;
    let (name, uuid) = (gpu.name(), gpu.uuid());
    // Each row is told (stderr) and the JSON file rewritten as it is made: a run cut short (the
    // script's time limit on a phase that hangs) keeps the rows measured before.
    let mut push = |r: Result<Row, CudaError>, what: &str| {
        let row = match r {
            Ok(row) => row,
            Err(e) => Row {
                what: what.into(),
                gbps: None,
                ms: None,
                check: format!("FAILED: {e}"),
                path: String::new(),
            },
        };
        ok &= !row.check.starts_with("FAILED");
        eprintln!(
            "gpu-check row: {} | {} GB/s | {} ms | {} | {}",
            row.what,
            row.gbps.map_or("-".into(), |g| format!("{g:.0}")),
            row.ms.map_or("-".into(), |m| format!("{m:.3}")),
            row.check,
            row.path
        );
        rows.push(row);
        if let Some(path) = &args.json_file {
            let so_far = Report {
                gpu: name.clone(),
                uuid: uuid.clone(),
                rows: rows.clone(),
                ok: false, // not done yet
            };
            if let Ok(json) = serde_json::to_vec_pretty(&so_far) {
                let _ = std::fs::write(path, json);
            }
        }
    };
    push(copy_ceiling(&gpu, bytes, args.repeat), "device-to-device copy");
    let sums = GpuChecksum::new(&gpu);
    match &sums {
        Ok(k) => {
            for row in checksum_rows(&gpu, k, bytes, args.repeat) {
                push(row, "checksum kernel");
            }
        }
        Err(e) => push(Err(CudaError::Invalid(e.to_string())), "checksum kernel"),
    }
    if let Ok(k) = &sums {
        for row in ipc_rows(&gpu, args.gpu, k, args.repeat) {
            push(row, "CUDA IPC push");
        }
    }
    for row in agent_rows(&gpu, args.repeat) {
        push(row, "through the agent");
    }
    let report = Report {
        gpu: name,
        uuid,
        rows,
        ok,
    };
    let written = if args.output == "json" {
        serde_json::to_writer_pretty(&mut *out, &report).map_err(std::io::Error::other)
    } else {
        write_table(&report, out)
    };
    written.map_err(|e| CudaError::Invalid(format!("writing the report: {e}")))?;
    if let Some(path) = &args.json_file {
        let json = serde_json::to_vec_pretty(&report).map_err(|e| CudaError::Invalid(e.to_string()))?;
        std::fs::write(path, json).map_err(|e| CudaError::Invalid(format!("{}: {e}", path.display())))?;
    }
    Ok(report.ok)
}

fn write_table(report: &Report, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "GPU: {} ({})", report.gpu, report.uuid)?;
    writeln!(out, "| what | GB/s | ms | check | path |")?;
    writeln!(out, "| --- | --- | --- | --- | --- |")?;
    for r in &report.rows {
        let g = r.gbps.map_or("-".into(), |g| format!("{g:.0}"));
        let ms = r.ms.map_or("-".into(), |m| format!("{m:.3}"));
        writeln!(out, "| {} | {g} | {ms} | {} | {} |", r.what, r.check, r.path)?;
    }
    writeln!(out, "all checks passed: {}", report.ok)
}

fn copy_ceiling(gpu: &Gpu, bytes: usize, repeat: u32) -> Result<Row, CudaError> {
    let src = DeviceMemory::alloc(gpu, bytes)?;
    let dst = DeviceMemory::alloc(gpu, bytes)?;
    let probe = pattern(1 << 20, 7);
    src.write(bytes - probe.len(), &probe)?;
    let ms = best(repeat, || gpu.time_ms(|| gpu.copy(&dst, 0, &src, 0, bytes)))?;
    let mut back = vec![0u8; probe.len()];
    dst.read(bytes - probe.len(), &mut back)?;
    Ok(Row {
        what: format!(
            "device-to-device copy, {} MiB (bytes copied, read+write is twice)",
            bytes >> 20
        ),
        gbps: Some(gbps(bytes, ms)),
        ms: Some(ms),
        check: if back == probe {
            "the last MiB arrived".into()
        } else {
            "FAILED: the last MiB differs".into()
        },
        path: "one GPU".into(),
    })
}

fn checksum_rows(gpu: &Gpu, k: &GpuChecksum, bytes: usize, repeat: u32) -> Vec<Result<Row, CudaError>> {
    let run = || -> Result<Vec<Row>, CudaError> {
        let layout = layout_for(bytes)?;
        let len = layout.pool_len();
        let host = pattern(len, 11);
        let pool = DeviceMemory::alloc(gpu, len)?;
        pool.write(0, &host)?;
        let blocks: Vec<u32> = (0..layout.num_blocks).collect();
        let tokens = u64::from(layout.num_blocks) * u64::from(layout.block_size);
        let which = Blocks::whole(&layout, &blocks);
        let gpu_sums = k.sums(&layout, &[&pool], &which)?;
        let memory = [host.as_slice()];
        let cpu: Vec<Option<u64>> = blocks
            .iter()
            .map(|b| layout.checksum(&memory, *b, u64::from(*b) * u64::from(layout.block_size), tokens))
            .collect();
        let equal = gpu_sums.iter().zip(&cpu).filter(|(g, c)| Some(**g) == **c).count();
        // The kernel alone (its tables uploaded once, as for one request), beside the read.
        // SAFETY: the pool outlives the launch (collected below).
        let mut launch = unsafe { k.prepare(&layout, &[pool.ptr()], &which) }?;
        let sum_ms = best(repeat, || gpu.time_ms(|| k.launch(&mut launch)))?;
        let again = k.collect(&launch)?;
        let mut read = k.prepare_read(&pool, 4096)?;
        let read_ms = best(repeat, || gpu.time_ms(|| k.launch_read(&mut read)))?;
        k.collect_read(&read)?;
        let check = if equal == blocks.len() && again == gpu_sums {
            format!("{equal}/{} blocks bit-identical to the CPU checksum", blocks.len())
        } else {
            format!("FAILED: {equal}/{} blocks equal the CPU checksum", blocks.len())
        };
        Ok(vec![
            Row {
                what: format!("checksum kernel, {} MiB in 16-token blocks", len >> 20),
                gbps: Some(gbps(len, sum_ms)),
                ms: Some(sum_ms),
                check,
                path: "in place, sums to host".into(),
            },
            Row {
                what: format!("plain read of the same {} MiB", len >> 20),
                gbps: Some(gbps(len, read_ms)),
                ms: Some(read_ms),
                check: format!("checksum/read = {:.2}", read_ms / sum_ms),
                path: "in place".into(),
            },
        ])
    };
    match run() {
        Ok(rows) => rows.into_iter().map(Ok).collect(),
        Err(e) => vec![Err(e)],
    }
}

/// What the prefill-side child reports.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
struct ChildReport {
    /// Whether the coalesced and the per-block copies landed whole (checked by the child).
    coalesced_check: String,
    per_block_check: String,
    coalesced_ms: f64,
    per_block_ms: f64,
    copies: usize,
    /// The same copies to scattered blocks, by the batch copy kernel.
    batch_ms: f64,
    batch_pieces: usize,
    bytes: usize,
    sums: Vec<u64>,
    refused_overclaim: String,
}

/// This process owns decode's pool (exported through IPC); a child process (prefill) opens it,
/// writes its own pool's blocks into it, and reports its checksums; they are checked here, on
/// the receiving GPU, without copying KV to the host.
fn ipc_rows(gpu: &Gpu, gpu_ordinal: usize, k: &GpuChecksum, repeat: u32) -> Vec<Result<Row, CudaError>> {
    let run = || -> Result<Vec<Row>, CudaError> {
        let layout = prompt_layout()?;
        let len = layout.pool_len();
        let pool = DeviceMemory::alloc(gpu, len)?;
        let handle = pool.ipc_handle()?;
        let exe = std::env::current_exe().map_err(|e| CudaError::Invalid(format!("own executable: {e}")))?;
        let mut child = Command::new(exe)
            .args([
                "gpu-check",
                "--ipc-child",
                "--repeat",
                &repeat.to_string(),
                "--gpu",
                &gpu_ordinal.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| CudaError::Invalid(format!("starting the prefill process: {e}")))?;
        if let Some(mut stdin) = child.stdin.take() {
            writeln!(stdin, "{} {len}", handle.to_hex()).map_err(|e| CudaError::Invalid(e.to_string()))?;
        }
        let mut line = String::new();
        if let Some(stdout) = child.stdout.take() {
            std::io::BufReader::new(stdout)
                .read_line(&mut line)
                .map_err(|e| CudaError::Invalid(e.to_string()))?;
        }
        let status = child.wait().map_err(|e| CudaError::Invalid(e.to_string()))?;
        let report: ChildReport = serde_json::from_str(line.trim())
            .map_err(|e| CudaError::Invalid(format!("the prefill process ({status}) said {line:?}: {e}")))?;
        // The last copies (the batch's) left prefill's block j in decode's block scattered(j).
        let blocks: Vec<u32> = (0..layout.num_blocks)
            .map(|b| scattered(b, layout.num_blocks))
            .collect();
        let which = Blocks::whole(&layout, &blocks);
        let received = k.sums(&layout, &[&pool], &which)?;
        let verified = received == report.sums;
        let check = if verified {
            format!(
                "{} scattered blocks verified on the receiving GPU; batch overhead {:.1}% of the coalesced copy",
                received.len(),
                (report.batch_ms / report.coalesced_ms - 1.0) * 100.0
            )
        } else {
            "FAILED: decode's checksums differ from prefill's".into()
        };
        let overhead = report.per_block_ms / report.coalesced_ms - 1.0;
        Ok(vec![
            Row {
                what: format!("IPC push, 4096-token prompt ({} MiB), coalesced", report.bytes >> 20),
                gbps: Some(gbps(report.bytes, report.coalesced_ms)),
                ms: Some(report.coalesced_ms),
                check: format!("{} in prefill's process", report.coalesced_check),
                path: "CudaIpc (two processes, one GPU)".into(),
            },
            Row {
                what: format!(
                    "IPC push, same prompt to scattered blocks, {} copies as {} pieces of one launch",
                    report.copies, report.batch_pieces
                ),
                gbps: Some(gbps(report.bytes, report.batch_ms)),
                ms: Some(report.batch_ms),
                check,
                path: "CudaIpc, batch copy kernel (two processes, one GPU)".into(),
            },
            Row {
                what: format!("IPC push, same prompt, {} copies of one block", report.copies),
                gbps: Some(gbps(report.bytes, report.per_block_ms)),
                ms: Some(report.per_block_ms),
                // A failed check leads its row (the report's verdict reads the row's start).
                check: if report.per_block_check.starts_with("FAILED") {
                    format!("{} in prefill's process", report.per_block_check)
                } else {
                    format!(
                        "per-block overhead {:.1}% of the coalesced copy; {} in prefill's process",
                        overhead * 100.0,
                        report.per_block_check
                    )
                },
                path: "CudaIpc (two processes, one GPU)".into(),
            },
            Row {
                what: "IPC handle claiming more than its allocation".into(),
                gbps: None,
                ms: None,
                check: if report.refused_overclaim.starts_with("refused") {
                    report.refused_overclaim
                } else {
                    format!("FAILED: {}", report.refused_overclaim)
                },
                path: String::new(),
            },
        ])
    };
    match run() {
        Ok(rows) => rows.into_iter().map(Ok).collect(),
        Err(e) => vec![Err(e)],
    }
}

/// Where prefill's block `b` of `n` lands in decode's pool in the batch row: scattered, as a
/// real engine's free list hands blocks out (a bijection wherever `n` is not a multiple of the
/// prime 97, as the prompt's 256 blocks are not).
fn scattered(b: u32, n: u32) -> u32 {
    ((u64::from(b) * 97 + 13) % u64::from(n.max(1))) as u32
}

/// A pool holding one 4096-token prompt of 16-token blocks (256 blocks, 512 MiB).
fn prompt_layout() -> Result<PoolLayout, CudaError> {
    PoolLayout::new(&geometry(), &Parallelism::default(), 4096 / 16, 0).map_err(|e| CudaError::Invalid(e.0))
}

/// The prefill side: opens decode's pool from the handle on stdin, writes its own blocks into
/// it (one copy, then one copy per layer, K/V and block), reports the times and its checksums
/// on stdout as one JSON line.
fn ipc_child(gpu: &Gpu, repeat: u32) -> Result<(), CudaError> {
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .map_err(|e| CudaError::Invalid(e.to_string()))?;
    let mut words = line.split_whitespace();
    let handle = IpcHandle::from_hex(words.next().unwrap_or(""))?;
    let len: usize = words
        .next()
        .and_then(|w| w.parse().ok())
        .ok_or_else(|| CudaError::Invalid(format!("expected '<handle> <bytes>', got {line:?}")))?;
    // A peer that claims more than it allocated is refused.
    // (Only the range check's refusal counts: a handle that did not open at all proves nothing.)
    let refused_overclaim = match DeviceMemory::open_ipc(gpu, &handle, len + (2 << 20)) {
        Err(e @ CudaError::Invalid(_)) => format!("refused: {e}"),
        Err(e) => format!("the handle did not open: {e}"),
        Ok(_) => "accepted a claim 2 MiB past the allocation".into(),
    };
    let layout = prompt_layout()?;
    if len != layout.pool_len() {
        return Err(CudaError::Invalid(format!(
            "decode's pool is {len} bytes, the prompt's layout {}",
            layout.pool_len()
        )));
    }
    let remote = DeviceMemory::open_ipc(gpu, &handle, len)?;
    let source = DeviceMemory::alloc(gpu, len)?;
    source.write(0, &pattern(len, 23))?;
    let k = GpuChecksum::new(gpu)?;
    let blocks: Vec<u32> = (0..layout.num_blocks).collect();
    let which = Blocks::whole(&layout, &blocks);
    let sums = k.sums(&layout, &[&source], &which)?;
    // What the copies left in decode's pool, checked on this GPU (this process opened it).
    let landed = |what: &str| -> Result<String, CudaError> {
        gpu.synchronize()?;
        Ok(if k.sums(&layout, &[&remote], &which)? == sums {
            format!("{what}: verified")
        } else {
            format!("FAILED: {what}: decode's checksums differ from prefill's")
        })
    };
    remote.write(0, &vec![0u8; len])?;
    let coalesced_ms = best(repeat, || gpu.time_ms(|| gpu.copy(&remote, 0, &source, 0, len)))?;
    let coalesced_check = landed("coalesced")?;
    remote.write(0, &vec![0u8; len])?;
    let block_len = layout.block_len();
    let mut copies = 0usize;
    let per_block_ms = best(repeat, || {
        copies = 0;
        gpu.time_ms(|| {
            for l in 0..layout.layers {
                for v in [false, true] {
                    for b in 0..layout.num_blocks {
                        let (_, at) = layout.block_offset(l, v, b);
                        gpu.copy(&remote, at, &source, at, block_len)?;
                        copies += 1;
                    }
                }
            }
            Ok(())
        })
    })?;
    let per_block_check = landed("block by block")?;
    // The same copies, each block to a scattered place (so none merge), by one launch; decode's
    // pool zeroed first, so what its checksums see is this launch's.
    remote.write(0, &vec![0u8; len])?;
    let batch = BatchCopy::new(gpu)?;
    let mut table = Vec::new();
    for l in 0..layout.layers {
        for v in [false, true] {
            for b in 0..layout.num_blocks {
                let (_, from) = layout.block_offset(l, v, b);
                let (_, to) = layout.block_offset(l, v, scattered(b, layout.num_blocks));
                table.push((remote.ptr() + to as u64, source.ptr() + from as u64, block_len as u64));
            }
        }
    }
    let split = batch_copy::split(&table, true);
    let batch_ms = best(repeat, || {
        // SAFETY: every range lies in `remote` or `source` (block offsets of the layout both
        // pools were checked to hold), both held past the timing's synchronize.
        gpu.time_ms(|| unsafe { batch.queue(&split) }.map(|_| ()))
    })?;
    gpu.synchronize()?;
    let report = ChildReport {
        coalesced_check,
        per_block_check,
        coalesced_ms,
        per_block_ms,
        copies,
        batch_ms,
        batch_pieces: split.pieces(),
        bytes: len,
        sums,
        refused_overclaim,
    };
    println!(
        "{}",
        serde_json::to_string(&report).map_err(|e| CudaError::Invalid(e.to_string()))?
    );
    Ok(())
}

/// The agent process of the through-the-agent rows: killed when dropped.
struct AgentProcess(std::process::Child, std::net::SocketAddr, std::path::PathBuf);

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        // Its warnings and errors go to the report (all that comes back from the GPU machine).
        let log = std::fs::read_to_string(self.2.join("agent.log")).unwrap_or_default();
        for line in log
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR") || l.contains("panicked"))
            .take(40)
        {
            eprintln!("agent {}: {line}", self.2.display());
        }
        let _ = std::fs::remove_dir_all(&self.2);
    }
}

fn invalid(e: impl std::fmt::Display) -> CudaError {
    CudaError::Invalid(e.to_string())
}

/// Requests through a real agent between two GPU pools on this GPU (CUDA IPC), then between
/// two agents (`--transport tcp` both: the staged stream).
fn agent_rows(gpu: &Gpu, repeat: u32) -> Vec<Result<Row, CudaError>> {
    let mut rows = Vec::new();
    for staged in [false, true] {
        match agent_rows_inner(gpu, repeat, staged) {
            Ok(r) => rows.extend(r.into_iter().map(Ok)),
            Err(e) => rows.push(Err(e)),
        }
    }
    rows
}

/// Starts `pdpair-agent run` (`transport`) in `dir`: the process and its engine socket.
fn start_agent(
    dir: &std::path::Path,
    name: &str,
    transport: &str,
) -> Result<(AgentProcess, std::path::PathBuf), CudaError> {
    std::fs::create_dir_all(dir.join("pools")).map_err(invalid)?;
    let socket = dir.join("agent.sock");
    let admin = crate::loopback::free_admin_addr().map_err(invalid)?;
    let exe = std::env::current_exe().map_err(invalid)?;
    let log = std::fs::File::create(dir.join("agent.log")).map_err(invalid)?;
    let child = crate::loopback::run_command(&exe, name, transport, &socket, &dir.join("pools"))
        .stderr(log)
        .arg("--no-publish")
        .arg("--admin-bind")
        .arg(admin.to_string())
        .spawn()
        .map_err(|e| invalid(format!("starting the agent: {e}")))?;
    let agent = AgentProcess(child, admin, dir.to_path_buf());
    let start = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        if start.elapsed() > std::time::Duration::from_secs(10) {
            return Err(invalid("the agent did not open its socket in 10 s"));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Ok((agent, socket))
}

fn agent_rows_inner(gpu: &Gpu, repeat: u32, staged: bool) -> Result<Vec<Row>, CudaError> {
    use crate::synthetic::{
        EngineMemory, EngineSpec,
        gpu::{GpuEngine, Sharing},
    };
    use pdpair_api::{ChecksumPolicy, Role, TransferMode};

    let dir = std::env::temp_dir().join(format!("pdpair-gpu-check-{}-{staged}", std::process::id()));
    // Behind one agent both engines use its socket; staged, decode's agent is a second one.
    let (agent, socket) = start_agent(&dir.join("a"), "gpu-check", if staged { "tcp" } else { "auto" })?;
    let second = if staged {
        Some(start_agent(&dir.join("b"), "gpu-check-b", "tcp")?)
    } else {
        None
    };
    let d_socket = second.as_ref().map_or(socket.clone(), |(_, s)| s.clone());
    let spec = |role, name: &str, checksum, blocks| EngineSpec {
        pdpair: "gpu-check/pair".into(),
        role,
        engine: name.into(),
        mode: TransferMode::Push,
        checksum,
        handshake_timeout_ms: 5000,
        lease_ms: 30_000,
        parallelism: Parallelism::default(),
        kv: geometry(),
        pairing_key: b"gpu-check".to_vec(),
        num_blocks: blocks,
        tensor_rank: 0,
        memory: EngineMemory::Agent,
        arrangement: None,
        regions: Vec::new(),
    };
    // One 8B-class block over all layers is 2 MiB: 512 of them are 1 GiB, 256 a 4096-token prompt.
    let mut rows = Vec::new();
    // torch's expandable_segments maps 20 MiB allocations; so do the VMM rows' engines.
    let vmm = Sharing::Vmm { chunk: 20 << 20 };
    // The last field: decode's blocks scattered (none adjacent, as a real engine's free list hands
    // them out): no copies merge, and the batch copy kernel moves them.
    let scenarios: &[(&str, ChecksumPolicy, u32, Sharing, bool)] = if staged {
        &[
            (
                "1 GiB of blocks, checksums off",
                ChecksumPolicy::Disabled,
                512u32,
                Sharing::Ipc,
                false,
            ),
            (
                "4096-token prompt of 16-token blocks, FailClosed",
                ChecksumPolicy::FailClosed,
                256,
                Sharing::Ipc,
                false,
            ),
        ]
    } else {
        &[
            (
                "1 GiB of blocks, checksums off",
                ChecksumPolicy::Disabled,
                512u32,
                Sharing::Ipc,
                false,
            ),
            (
                "1 GiB of blocks, FailClosed (GPU checksums both sides)",
                ChecksumPolicy::FailClosed,
                512,
                Sharing::Ipc,
                false,
            ),
            (
                "4096-token prompt of 16-token blocks, FailClosed",
                ChecksumPolicy::FailClosed,
                256,
                Sharing::Ipc,
                false,
            ),
            (
                "4096-token prompt, both pools shared as VMM descriptors, FailClosed",
                ChecksumPolicy::FailClosed,
                256,
                vmm,
                false,
            ),
            (
                "4096-token prompt to scattered decode blocks, FailClosed",
                ChecksumPolicy::FailClosed,
                256,
                Sharing::Ipc,
                true,
            ),
        ]
    };
    for &(label, checksum, blocks, sharing, scatter) in scenarios {
        let tag = rows.len();
        let mut p = GpuEngine::register_sharing(
            &socket,
            &spec(Role::Prefill, &format!("p{tag}"), checksum, blocks),
            gpu,
            sharing,
        )
        .map_err(|e| invalid(format!("prefill registers: {e}")))?;
        let mut d = GpuEngine::register_sharing(
            &d_socket,
            &spec(Role::Decode, &format!("d{tag}"), checksum, blocks),
            gpu,
            sharing,
        )
        .map_err(|e| invalid(format!("decode registers: {e}")))?;
        for e in [&p, &d] {
            e.wait_events_for(std::time::Duration::from_secs(60)).map_err(invalid)?;
        }
        let all: Vec<u32> = (0..blocks).collect();
        let to: Vec<u32> = if scatter {
            all.iter().map(|b| scattered(*b, blocks)).collect()
        } else {
            all.clone()
        };
        let tokens = u64::from(blocks) * 16;
        d.clear().map_err(invalid)?;
        p.fill(7 + tag as u64, &all, 0, tokens).map_err(invalid)?;
        let bytes = p.layout.pool_len();
        let mut times = Vec::new();
        let mut outcome = String::new();
        // The first request dials and handshakes: a warm-up, not timed.
        for i in 0..=repeat.max(1) {
            let id = format!("r{tag}-{i}");
            d.send(&crate::engine_api::EngineRequest::ExpectKv {
                request: id.clone(),
                prefill: p.address.clone(),
                blocks: to.clone(),
                num_tokens: tokens,
                first_token: 0,
                prompt: Some(crate::synthetic::prompt(7 + tag as u64, tokens)),
                event: None,
            })
            .map_err(invalid)?;
            // Let decode's registration reach prefill, so the time is the transfer's.
            std::thread::sleep(std::time::Duration::from_millis(50));
            let t = std::time::Instant::now();
            p.send(&crate::engine_api::EngineRequest::KvReady {
                release_token: None,
                request: id.clone(),
                blocks: all.clone(),
                num_tokens: tokens,
                first_token: 0,
                prompt: Some(crate::synthetic::prompt(7 + tag as u64, tokens)),
                event: p.event(),
            })
            .map_err(invalid)?;
            let done = wait_done(&mut d, &id)?;
            let took = t.elapsed().as_secs_f64() * 1e3;
            wait_done(&mut p, &id)?;
            match done {
                crate::engine_api::AgentEvent::RequestDone { checksum, .. } => {
                    outcome = checksum.unwrap_or_else(|| "no checksum".into());
                    if i > 0 {
                        times.push(took);
                    }
                }
                other => return Err(invalid(format!("{label}: {other:?}"))),
            }
        }
        let bad = d.verify(7 + tag as u64, &to, 0, tokens).map_err(invalid)?;
        times.sort_by(f64::total_cmp);
        let best = times.first().copied().unwrap_or(f64::NAN);
        let p50 = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
        // Prefill's agent moves the bytes in push: its metrics name the path.
        let paths = crate::loopback::metrics(agent.1)
            .map(|m| crate::loopback::transfer_paths(&m))
            .unwrap_or_default();
        let check = if bad == 0 && (checksum == ChecksumPolicy::Disabled || outcome == "Verified") {
            format!("every byte read back and checked; checksum: {outcome}; p50 {p50:.3} ms")
        } else {
            format!("FAILED: {bad} tokens differ; checksum: {outcome}")
        };
        let through = if staged {
            "between two agents (staged stream)"
        } else {
            "through the agent"
        };
        rows.push(Row {
            what: format!("{through}: {label} ({} MiB)", bytes >> 20),
            gbps: Some(gbps(bytes, best)),
            ms: Some(best),
            check,
            path: paths
                .iter()
                .map(|(p, n)| format!("{p} x{n}"))
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    Ok(rows)
}

/// Reads `engine`'s events until `request`'s answer.
fn wait_done(
    engine: &mut crate::synthetic::gpu::GpuEngine,
    request: &str,
) -> Result<crate::engine_api::AgentEvent, CudaError> {
    use crate::engine_api::AgentEvent;
    loop {
        match engine.next_event().map_err(invalid)? {
            e @ (AgentEvent::RequestDone { .. } | AgentEvent::RequestFailed { .. } | AgentEvent::Cancelled { .. })
                if event_request(&e) == Some(request) =>
            {
                return Ok(e);
            }
            _ => {}
        }
    }
}

fn event_request(e: &crate::engine_api::AgentEvent) -> Option<&str> {
    use crate::engine_api::AgentEvent;
    match e {
        AgentEvent::RequestDone { request, .. }
        | AgentEvent::RequestFailed { request, .. }
        | AgentEvent::Cancelled { request } => Some(request),
        _ => None,
    }
}
