//! The pdpair-agent command line. Logic lives in the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pdpair_agent::cli;

#[derive(Debug, Parser)]
#[command(name = "pdpair-agent", version, about = "pdpair node agent")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the engine API and the push protocol (the DaemonSet process).
    Run(cli::RunArgs),
    /// Run a prefill/decode scenario on this machine with real agents, sockets and UCX.
    Loopback(cli::LoopbackArgs),
    /// Print the KV checksum of each block of a dump in the canonical layout, one per line.
    Checksum(cli::ChecksumArgs),
    /// Measure the checksum's GB/s on one core beside a plain read of the same bytes.
    BenchChecksum(cli::BenchChecksumArgs),
    /// Measure UCX put GB/s over shared memory into registered and into UCX-allocated memory.
    BenchPut(cli::BenchPutArgs),
    /// On a machine with an NVIDIA GPU: measure copies, the checksum kernel and CUDA IPC pushes,
    /// checking each (`make gpu-check`). Exits 1 when a check fails, 2 without a GPU.
    GpuCheck(pdpair_agent::gpu_check::GpuCheckArgs),
    /// One request of the synthetic engine (for checking other engines' clients against it).
    #[command(hide = true)]
    SyntheticEngine(cli::SyntheticEngineArgs),
    /// The synthetic engine as a Pod's engine (clusters without a GPU; configured by the
    /// operator's environment).
    #[command(hide = true)]
    TestEngine(pdpair_agent::test_engine::TestEngineArgs),
    /// Try a peer's UCX worker address (on stdin) in this sealed-off process: what the agent
    /// runs before its own worker sees the address.
    #[command(hide = true)]
    UcxProbe(cli::UcxProbeArgs),
}

/// Ends the probe without running UCX's (or anything's) teardown, which could reach the peer.
#[allow(unsafe_code)]
fn exit_now(code: i32) -> ! {
    // SAFETY: _exit ends the process at once; nothing after it runs.
    unsafe { libc::_exit(code) }
}

/// UCX's tcp transport writes to sockets without MSG_NOSIGNAL: a peer agent that dies mid-transfer
/// would kill this process with SIGPIPE. Ignored, the write fails with EPIPE instead, and the side
/// channel reports the peer lost.
#[allow(unsafe_code)]
fn ignore_sigpipe() {
    // SAFETY: setting a signal's disposition to SIG_IGN at startup, before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Run(_)) {
        pdpair_agent::tuning::reexec_tuned();
    }
    ignore_sigpipe();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    if matches!(cli.command, Command::Run(_)) {
        match pdpair_agent::tuning::raise_fd_limit() {
            Ok(n) => tracing::debug!(open_files = n, "file descriptor limit"),
            Err(e) => tracing::warn!(error = %e, "cannot raise the file descriptor limit"),
        }
    }
    let stdout = std::io::stdout();
    let result = match cli.command {
        Command::Run(args) => cli::run(&args),
        Command::Loopback(args) => cli::loopback(&args, &mut stdout.lock()),
        Command::Checksum(args) => cli::checksum(&args, &mut stdout.lock()),
        Command::BenchChecksum(args) => cli::bench_checksum(&args, &mut stdout.lock()),
        Command::BenchPut(args) => cli::bench_put(&args, &mut stdout.lock()),
        Command::SyntheticEngine(args) => cli::synthetic_engine(&args, &mut stdout.lock()),
        Command::TestEngine(args) => pdpair_agent::test_engine::run(&args, &mut stdout.lock()),
        // Nothing above starts a thread, so the probe may still enter a user namespace.
        Command::UcxProbe(args) => exit_now(cli::ucx_probe(&args)),
        Command::GpuCheck(args) => {
            return match pdpair_agent::gpu_check::run(&args, &mut stdout.lock()) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::from(1),
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            };
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
