//! Process settings the data path needs that can only be set before the process starts.
//!
//! Over shared memory a WRITE is a `memcpy` into the peer's mapped segment (UCX's posix put), and
//! KV transfers are memory-bound: hundreds of MiB that are not in any cache. glibc's `memcpy`
//! switches to non-temporal stores (no read-for-ownership of the destination, no cache
//! pollution) only above about 3/4 of the L3 per thread, and UCX 1.13 replaces it with its own
//! `rep movsb` copy for a size range it picks; the agent's puts are 32 KiB to tens of MiB, below
//! both. Measured here (2026-12-01, `pdpair-agent bench-put --mib 512 --put-kib 8192`, allocated
//! target): 6.15 GB/s as is, 8.46 with glibc's threshold at 1 MiB, 9.79 with UCX's builtin copy
//! off as well; the loopback push (16 requests of 512 MiB) went from 5.2-5.5 to 8.0-8.4 GB/s
//! beside `ucx_perftest` at 9.2-9.5 (docs/benchmarks.md). Both settings are read when glibc and
//! UCX load, so `pdpair-agent run` re-executes itself once with them in its environment, leaving
//! any value the user set alone.

use std::ffi::OsString;

/// Set once the agent has re-executed itself with the settings (and so never loops).
pub const MARKER: &str = "PDPAIR_AGENT_TUNED";

/// glibc's tunable: non-temporal stores from 1 MiB.
pub const GLIBC_NT_THRESHOLD: &str = "glibc.cpu.x86_non_temporal_threshold=0x100000";

/// UCX's builtin memcpy never used (glibc's instead).
pub const UCX_BUILTIN_MEMCPY_MIN: &str = "inf";

/// The environment changes the agent wants on top of `current` (a lookup of its environment):
/// `(name, value)` pairs, empty when it already runs with them.
pub fn wanted(current: impl Fn(&str) -> Option<OsString>) -> Vec<(&'static str, OsString)> {
    if current(MARKER).is_some() {
        return Vec::new();
    }
    let mut out = vec![(MARKER, OsString::from("1"))];
    match current("GLIBC_TUNABLES") {
        // The user's own x86_non_temporal_threshold wins.
        Some(v) if v.to_string_lossy().contains("x86_non_temporal_threshold") => {}
        Some(v) if !v.is_empty() => {
            let mut joined = v;
            joined.push(":");
            joined.push(GLIBC_NT_THRESHOLD);
            out.push(("GLIBC_TUNABLES", joined));
        }
        _ => out.push(("GLIBC_TUNABLES", OsString::from(GLIBC_NT_THRESHOLD))),
    }
    if current("UCX_BUILTIN_MEMCPY_MIN").is_none() {
        out.push(("UCX_BUILTIN_MEMCPY_MIN", OsString::from(UCX_BUILTIN_MEMCPY_MIN)));
    }
    out
}

/// Re-executes this process (`/proc/self/exe`, same arguments) with [`wanted`]'s settings, once.
/// Returns only when nothing was needed or the exec failed (the agent then runs as it is, and
/// says so). Call it first thing in `main`, before any thread exists.
pub fn reexec_tuned() {
    let changes = wanted(|k| std::env::var_os(k));
    if changes.is_empty() {
        return;
    }
    use std::os::unix::process::CommandExt;
    let err = std::process::Command::new("/proc/self/exe")
        .arg0(std::env::args_os().next().unwrap_or_else(|| "pdpair-agent".into()))
        .args(std::env::args_os().skip(1))
        .envs(changes)
        .exec();
    eprintln!("pdpair-agent: could not re-execute with the copy settings (running without them): {err}");
}

/// Raises the soft limit on open file descriptors to the hard one: an engine's GPU pool may be
/// shared as thousands of VMM allocations, one descriptor each (`ShareGpuMemory`, up to
/// `memory::cuda::MAX_VMM_CHUNKS` per engine), held until its registration maps them. Returns
/// the soft limit now in force.
#[allow(unsafe_code)]
pub fn raise_fd_limit() -> std::io::Result<u64> {
    // SAFETY: a zeroed rlimit is a valid out-value.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: a valid rlimit; only the soft limit changes, up to the hard one.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(limit.rlim_cur as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(unsafe_code)]
    fn the_file_descriptor_limit_is_raised_to_the_hard_one() {
        let now = raise_fd_limit().expect("raised");
        // SAFETY: a zeroed rlimit is a valid out-value; out-pointer.
        let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
        assert_eq!((limit.rlim_cur, now), (limit.rlim_max, limit.rlim_max as u64));
    }

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect();
        move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.into())
    }

    #[test]
    fn a_fresh_environment_gets_both_settings_and_the_marker() {
        let w = wanted(env(&[]));
        assert_eq!(
            w,
            [
                (MARKER, "1".into()),
                ("GLIBC_TUNABLES", GLIBC_NT_THRESHOLD.into()),
                ("UCX_BUILTIN_MEMCPY_MIN", "inf".into())
            ]
        );
    }

    #[test]
    fn once_tuned_nothing_more_happens_and_the_users_values_are_kept() {
        assert!(wanted(env(&[(MARKER, "1")])).is_empty(), "no second exec");
        let w = wanted(env(&[
            ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"),
            ("UCX_BUILTIN_MEMCPY_MIN", "4k"),
        ]));
        assert_eq!(
            w,
            [
                (MARKER, "1".into()),
                (
                    "GLIBC_TUNABLES",
                    format!("glibc.malloc.arena_max=2:{GLIBC_NT_THRESHOLD}").into()
                )
            ]
        );
        let own = wanted(env(&[(
            "GLIBC_TUNABLES",
            "glibc.cpu.x86_non_temporal_threshold=0x4000",
        )]));
        assert!(own.iter().all(|(k, _)| *k != "GLIBC_TUNABLES"), "{own:?}");
    }
}
