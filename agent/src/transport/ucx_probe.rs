//! A peer's UCX worker address, tried first in a throwaway process.
//!
//! UCX parses a worker address without a length and trusts what it says (devices, their
//! bandwidth and latency, IP addresses, segment ids): a hostile one with a valid header aborts or
//! crashes the process that connects to it (measured with UCX 1.13 and 1.22: docs/security.md).
//! So before the agent's own worker sees a peer's address, [`Prober::probe`] has a child process
//! (`pdpair-agent ucx-probe`, [`serve`]) build a UCX worker the way the agent's is built and
//! connect it to that address. The crash points (unpacking the address, choosing lanes) come
//! before anything reaches the peer; what would reach it is cut off: the child runs in mount
//! and IPC namespaces of its own from before UCX starts, with an empty scratch directory (made
//! for it in the pool directory, removed after it) mounted over the pool directory (so its own
//! segments land there and no peer's segment can be opened), and in a network namespace of its
//! own, with empty file systems over `/dev/shm` and `/proc`, from after its worker exists (so its
//! devices are the agent's, but it can dial nothing and open no process's files). Without
//! CAP_SYS_ADMIN (the DaemonSet drops it) it first enters a user namespace of its own, with no
//! user mapped (mapping root needs CAP_SETFCAP): files keep their owners, and it makes no file
//! of its own except in the scratch directory.
//! A child that dies of a signal means the address is refused; one that returns, whatever UCX
//! said, means UCX survives it. An address that passed is remembered (by its SHA-256), so each
//! peer is probed once.
//!
//! Not covered: an RDMA NIC is not behind a network namespace, so on a node with verbs the child
//! could send UCX's wireup message to the peer; and a crash that depends on more than the
//! address (timing, the heap) may not happen in the child.
#![allow(unsafe_code)]

use std::{
    collections::{HashSet, VecDeque},
    ffi::CString,
    io::{Read, Write},
    os::unix::process::ExitStatusExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{Condvar, Mutex},
    time::{Duration, Instant},
};

use sha2::{Digest, Sha256};

use crate::{
    lock,
    transport::ucx::{Context, Transport, Worker},
};

/// How long a probe may take (a UCX context and worker in a fresh process; a debug build on a
/// busy 2-core machine takes well under a second).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// Probes running at once (handshakes beyond wait for a slot, within their timeout).
pub const MAX_PROBES: usize = 4;
/// Addresses remembered as probed.
pub const REMEMBERED: usize = 4096;
/// Exit status of a probe that could not isolate itself (it connects nothing then).
pub const EXIT_NOT_ISOLATED: i32 = 3;
/// Exit status of a probe whose input or UCX setup failed.
pub const EXIT_SETUP: i32 = 2;
/// The scratch directories' prefix, in the pool directory.
pub const SCRATCH_PREFIX: &str = ".ucx-probe-";

static SCRATCH_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Digests of addresses that passed, and the order they came in (the oldest go first).
type Remembered = (HashSet<[u8; 32]>, VecDeque<[u8; 32]>);

/// Runs probes of peers' worker addresses (see the module).
#[derive(Debug)]
pub struct Prober {
    exe: PathBuf,
    transport: Transport,
    pool_dir: PathBuf,
    running: Mutex<usize>,
    freed: Condvar,
    passed: Mutex<Remembered>,
}

/// What a probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// UCX survived the address (connected or refused it).
    Survived,
    /// This address passed before.
    Remembered,
}

impl Prober {
    /// Probes with `exe` (the agent's binary: `exe ucx-probe ...` must run [`serve`]), building
    /// workers like the agent's (`transport`, `pool_dir`).
    pub fn new(exe: PathBuf, transport: Transport, pool_dir: &Path) -> Prober {
        Prober {
            exe,
            transport,
            pool_dir: pool_dir.to_path_buf(),
            running: Mutex::new(0),
            freed: Condvar::new(),
            passed: Mutex::new((HashSet::new(), VecDeque::new())),
        }
    }

    /// Whether UCX survives connecting to `address`, found in a child process; `Err` names why
    /// not (a signal, the probe's own failure, its timeout).
    pub fn probe(&self, address: &[u8]) -> Result<Verdict, String> {
        let digest: [u8; 32] = Sha256::digest(address).into();
        if lock(&self.passed).0.contains(&digest) {
            return Ok(Verdict::Remembered);
        }
        let deadline = Instant::now() + PROBE_TIMEOUT;
        {
            let mut running = lock(&self.running);
            while *running >= MAX_PROBES {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err("no UCX probe slot came free in time".into());
                }
                running = self
                    .freed
                    .wait_timeout(running, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            *running += 1;
        }
        let result = self.run(address, deadline);
        *lock(&self.running) -= 1;
        self.freed.notify_one();
        result?;
        let mut passed = lock(&self.passed);
        if passed.0.insert(digest) {
            passed.1.push_back(digest);
            if passed.1.len() > REMEMBERED
                && let Some(old) = passed.1.pop_front()
            {
                passed.0.remove(&old);
            }
        }
        Ok(Verdict::Survived)
    }

    fn run(&self, address: &[u8], deadline: Instant) -> Result<(), String> {
        let scratch = self.pool_dir.join(format!(
            "{SCRATCH_PREFIX}{}-{}",
            std::process::id(),
            SCRATCH_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir(&scratch).map_err(|e| format!("the UCX probe's scratch {}: {e}", scratch.display()))?;
        let result = self.run_in(address, deadline, &scratch);
        let _ = std::fs::remove_dir_all(&scratch);
        result
    }

    fn run_in(&self, address: &[u8], deadline: Instant, scratch: &Path) -> Result<(), String> {
        let mut child = Command::new(&self.exe)
            .arg("ucx-probe")
            .arg("--transport")
            .arg(self.transport.as_arg())
            .arg("--pool-dir")
            .arg(&self.pool_dir)
            .arg("--scratch")
            .arg(scratch)
            // The child moves no memory, so it needs none of UCX's memory hooks, whose set-up
            // (UCX 1.22 tests its mmap hooks at load) took 0.4 s of each probe's 0.42 here.
            .env("UCX_MEM_EVENTS", "n")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the UCX probe {}: {e}", self.exe.display()))?;
        // The address fits a pipe's buffer (at most MAX_UCX_BLOB bytes), so this does not block.
        let wrote = child.stdin.take().map(|mut s| s.write_all(address));
        // Drained as it comes (UCX may log more than a pipe holds), keeping the tail.
        // Without a thread for it (`Err`): the probe's message is lost, not the agent's thread.
        let drain = child.stderr.take().map(|mut s| {
            std::thread::Builder::new().name("ucx-probe-log".into()).spawn(move || {
                let mut tail = Vec::new();
                let mut chunk = [0u8; 4096];
                while let Ok(n) = s.read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    tail.extend_from_slice(&chunk[..n]);
                    let excess = tail.len().saturating_sub(4096);
                    tail.drain(..excess);
                }
                String::from_utf8_lossy(&tail).into_owned()
            })
        });
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("the UCX probe took over {}s", PROBE_TIMEOUT.as_secs()));
                }
                Err(e) => return Err(format!("waiting for the UCX probe: {e}")),
            }
        };
        if let Some(signal) = status.signal() {
            return Err(format!(
                "UCX crashed on it in a probe (signal {signal}, {})",
                signal_name(signal)
            ));
        }
        if status.code() == Some(0) {
            if let Some(Err(e)) = wrote {
                return Err(format!("writing to the UCX probe: {e}"));
            }
            return Ok(());
        }
        // The probe's own message (its last line), never UCX's text about the peer's bytes.
        let text = drain.and_then(|d| d.ok()?.join().ok()).unwrap_or_default();
        let line = text
            .lines()
            .rev()
            .find(|l| l.starts_with("ucx-probe: "))
            .unwrap_or("ucx-probe: no message")
            .chars()
            .take(300)
            .collect::<String>();
        Err(format!("the UCX probe failed (exit {:?}): {line}", status.code()))
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGABRT => "SIGABRT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        libc::SIGKILL => "SIGKILL",
        _ => "a signal",
    }
}

/// Why [`serve`] did not connect.
#[derive(Debug)]
pub struct ProbeError {
    /// [`EXIT_NOT_ISOLATED`] or [`EXIT_SETUP`].
    pub code: i32,
    /// What went wrong (printed after `ucx-probe: `).
    pub message: String,
}

fn not_isolated(what: &str) -> ProbeError {
    ProbeError {
        code: EXIT_NOT_ISOLATED,
        message: format!(
            "cannot isolate the probe: {what}: {} (the agent needs user namespaces, or CAP_SYS_ADMIN)",
            std::io::Error::last_os_error()
        ),
    }
}

fn setup(message: String) -> ProbeError {
    ProbeError {
        code: EXIT_SETUP,
        message,
    }
}

/// The child's side (`pdpair-agent ucx-probe`): reads a worker address from `input`, isolates
/// itself, builds a worker like the agent's (its segments in `scratch`, an empty directory,
/// mounted over `pool_dir`) and connects it to that address; returns what UCX said, or an error
/// when it could not get that far. Must run before the process has threads (entering a user
/// namespace needs that). The caller exits at once after it (`_exit`: no UCX teardown).
pub fn serve(
    transport: Transport,
    pool_dir: &Path,
    scratch: &Path,
    input: &mut dyn Read,
) -> Result<String, ProbeError> {
    let mut address = Vec::new();
    input
        .take(crate::protocol::MAX_UCX_BLOB as u64 + 1)
        .read_to_end(&mut address)
        .map_err(|e| setup(format!("reading the address: {e}")))?;
    crate::protocol::check_ucx_address(&address).map_err(setup)?;
    // Nothing of the agent's (its sockets, segments, pools: UCX opens them without
    // close-on-exec) stays open in here, where UCX parses a hostile address.
    // SAFETY: closes descriptors 3 and up of this single-threaded process; none is in use here.
    if unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) } != 0 {
        return Err(setup(format!(
            "closing the agent's descriptors: {}",
            std::io::Error::last_os_error()
        )));
    }
    // Mount and IPC namespaces of our own, before UCX starts: its segments (files in the
    // scratch directory, System V segments) are then ours alone.
    // SAFETY: unshare changes only this (single-threaded) process's namespaces.
    if unsafe { libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWIPC) } != 0 {
        enter_user_namespace()?;
        // SAFETY: as above, now with CAP_SYS_ADMIN in our own user namespace.
        if unsafe { libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWIPC) } != 0 {
            return Err(not_isolated("unshare(mount, IPC)"));
        }
    }
    mount_private_root()?;
    for dir in [pool_dir, scratch] {
        if !dir.is_dir() {
            return Err(setup(format!("{} is not a directory", dir.display())));
        }
    }
    if std::fs::read_dir(scratch)
        .map(|mut d| d.next().is_some())
        .unwrap_or(true)
    {
        return Err(setup(format!(
            "the scratch directory {} is not empty",
            scratch.display()
        )));
    }
    bind(scratch, pool_dir)?;
    let context = Context::new(transport, Some(pool_dir)).map_err(|e| setup(format!("UCX context: {e}")))?;
    let worker = Worker::new(&context).map_err(|e| setup(format!("UCX worker: {e}")))?;
    // Now that the worker has its devices: no network to dial, no process's files to open.
    // SAFETY: unshare changes the calling thread's network namespace, the thread that connects.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(not_isolated("unshare(network)"));
    }
    if Path::new("/dev/shm").is_dir() {
        mount_tmpfs(Path::new("/dev/shm"))?;
    }
    mount_tmpfs(Path::new("/proc"))?;
    let said = match worker.connect(&address) {
        Ok(endpoint) => {
            std::mem::forget(endpoint);
            "UCX took the address".to_owned()
        }
        Err(e) => format!("UCX refused the address: {e}"),
    };
    // Nothing is torn down (the process ends right after): whatever UCX made stays where a
    // crash would leave it, in the scratch directory, which the agent removes.
    std::mem::forget(worker);
    std::mem::forget(context);
    Ok(said)
}

/// A user namespace of our own, which gives this process the capabilities to make the other
/// namespaces. No user is mapped in it (mapping root needs CAP_SETFCAP): the process keeps its
/// user for files outside, so it can still make its segments in the scratch directory.
fn enter_user_namespace() -> Result<(), ProbeError> {
    // SAFETY: single-threaded (see `serve`); changes only this process.
    if unsafe { libc::unshare(libc::CLONE_NEWUSER) } != 0 {
        return Err(not_isolated("unshare(user)"));
    }
    Ok(())
}

fn bind(from: &Path, onto: &Path) -> Result<(), ProbeError> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(|e| setup(format!("{}: {e}", p.display())));
    let (source, target) = (c(from)?, c(onto)?);
    // SAFETY: valid NUL-terminated paths; a bind mount reads no type or data.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(not_isolated(&format!(
            "mounting {} over {}",
            from.display(),
            onto.display()
        )));
    }
    Ok(())
}

fn mount_private_root() -> Result<(), ProbeError> {
    let root = CString::new("/").map_err(|e| setup(e.to_string()))?;
    // SAFETY: valid NUL-terminated path; null source, type and data are allowed for a
    // propagation change.
    let rc = unsafe {
        libc::mount(
            std::ptr::null(),
            root.as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(not_isolated("making mounts private"));
    }
    Ok(())
}

fn mount_tmpfs(dir: &Path) -> Result<(), ProbeError> {
    use std::os::unix::ffi::OsStrExt;
    let target = CString::new(dir.as_os_str().as_bytes()).map_err(|e| setup(format!("{}: {e}", dir.display())))?;
    let fstype = CString::new("tmpfs").map_err(|e| setup(e.to_string()))?;
    // SAFETY: valid NUL-terminated strings; no data.
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(not_isolated(&format!("an empty file system over {}", dir.display())));
    }
    Ok(())
}
