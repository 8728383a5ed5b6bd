//! An engine's KV pool memory as the agent holds it: a file the engine made (`memory_path`), or
//! memory the agent allocates on the engine's behalf and hands back as a file to map.
//!
//! Who allocates matters on one host. UCX writes into memory its POSIX shared-memory allocator
//! made by mapping the segment and copying once; into memory merely registered (an engine's
//! file) it emulates a put over shared memory with two copies and needs the target's worker to
//! progress (docs/benchmarks.md measured about 2x). So agent-allocated pools come from UCX, as
//! named files in the pool directory, which engines on the node also see. Where UCX cannot
//! allocate such a file (transports without shared memory, such as tcp alone), the agent makes a
//! plain file there instead.

use std::{
    fs::File,
    os::unix::{fs::MetadataExt, net::UnixStream},
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
};

use crate::ucx_thread::UcxHandle;

/// Prefix of the files UCX's POSIX allocator makes (its shared-memory segments and pools).
pub const UCX_SEGMENT_PREFIX: &str = "ucx_shm_posix_";
/// Prefix of the plain pool files the agent makes when UCX cannot allocate.
pub const AGENT_POOL_PREFIX: &str = "pdpair-pool-";

/// How the pool's memory came to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The engine's file (`memory_path`).
    EngineFile,
    /// Allocated by UCX for the engine: peers on the host write it with one copy.
    Ucx,
    /// A plain file the agent made for the engine.
    AgentFile,
}

/// A pool: the agent's own mapping (for reading, and keeping the pages alive while the agent
/// holds the engine) and its UCX registration.
#[derive(Debug)]
pub struct Pool {
    map: memmap2::MmapRaw,
    /// The registered address: peers address the pool from it, and local ops must lie in
    /// `base..base+len` (for UCX-allocated pools this is UCX's mapping, not `map`).
    pub base: u64,
    /// UCX region id.
    pub region: u64,
    /// Packed remote key.
    pub rkey: Vec<u8>,
    /// The file the engine maps.
    pub path: PathBuf,
    /// Where it came from.
    pub origin: Origin,
}

impl Pool {
    /// Maps and registers the engine's file, which must hold at least `need` bytes.
    pub fn engine_file(ucx: &UcxHandle, path: &str, need: usize) -> Result<Pool, String> {
        let file = File::options()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| format!("memory_path {path}: {e}"))?;
        let held = file.metadata().map_err(|e| format!("memory_path {path}: {e}"))?.len();
        if held < need as u64 {
            return Err(format!(
                "memory_path {path} holds {held} bytes; the geometry needs {need}"
            ));
        }
        Pool::register_file(ucx, &file, PathBuf::from(path), need, Origin::EngineFile)
    }

    /// Maps `file` (at least `need` bytes) populated and registers its first `need` bytes.
    fn register_file(ucx: &UcxHandle, file: &File, path: PathBuf, need: usize, origin: Origin) -> Result<Pool, String> {
        let map = map_populated(file, &path.to_string_lossy())?;
        let base = map.as_mut_ptr() as u64;
        let (region, rkey) = ucx.map(base, need as u64)?;
        Ok(Pool {
            map,
            base,
            region,
            rkey,
            path,
            origin,
        })
    }

    /// Allocates `need` bytes for an engine in `dir`: through UCX when it makes a named file
    /// there, else as a plain file. `owner` (the engine's uid and gid) gets the file when the
    /// agent runs as another user (UCX makes it mode 0600).
    pub fn allocate(ucx: &UcxHandle, dir: &Path, need: usize, owner: Option<(u32, u32)>) -> Result<Pool, String> {
        let pool = match ucx.allocate(need as u64) {
            Ok(a) => match mapping_path(a.addr).filter(|p| p.parent() == Some(dir)) {
                Some(path) => File::options()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(|e| format!("{}: {e}", path.display()))
                    .and_then(|f| map_populated(&f, &path.to_string_lossy()))
                    .map(|map| Pool {
                        map,
                        base: a.addr,
                        region: a.region,
                        rkey: a.rkey,
                        path,
                        origin: Origin::Ucx,
                    }),
                None => Err(format!("UCX allocated memory that is not a file in {}", dir.display())),
            }
            .inspect_err(|_| ucx.unmap(a.region)),
            Err(e) => Err(e),
        };
        let pool = match pool {
            Ok(pool) => pool,
            Err(why) => {
                tracing::debug!(reason = %why, "pool memory: a plain file instead of UCX's allocator");
                Pool::agent_file(ucx, dir, need)?
            }
        };
        if let Some((uid, gid)) = owner {
            chown_if_needed(&pool.path, uid, gid);
        }
        Ok(pool)
    }

    fn agent_file(ucx: &UcxHandle, dir: &Path, need: usize) -> Result<Pool, String> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = dir.join(format!(
            "{AGENT_POOL_PREFIX}{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| format!("pool directory: {}: {e}", path.display()))?;
        file.set_len(need as u64)
            .map_err(|e| format!("{}: {e}", path.display()))
            .and_then(|()| Pool::register_file(ucx, &file, path.clone(), need, Origin::AgentFile))
            .inspect_err(|_| {
                let _ = std::fs::remove_file(&path);
            })
    }

    /// The pool's bytes, through the agent's own mapping.
    pub fn memory(&self, len: usize) -> &[u8] {
        #[allow(unsafe_code)]
        // SAFETY: the mapping lives as long as `self` and holds at least `len` bytes (checked or
        // sized at creation); readers only look at blocks whose transfers completed (decode) or
        // that the engine marked ready (prefill).
        unsafe {
            std::slice::from_raw_parts(self.map.as_ptr(), len.min(self.map.len()))
        }
    }

    /// Unregisters the pool; memory the agent allocated loses its file (the engine's and the
    /// agent's mappings stay valid until unmapped). Local ops on the region fail from now on.
    pub fn release(&self, ucx: &UcxHandle) {
        ucx.unmap(self.region);
        if self.origin == Origin::AgentFile {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn map_populated(file: &File, what: &str) -> Result<memmap2::MmapRaw, String> {
    // Populate: fault the pool's pages in now, not inside the first transfer.
    memmap2::MmapOptions::new()
        .populate()
        .map_raw(file)
        .map_err(|e| format!("mapping {what}: {e}"))
}

/// The file behind this process's mapping at `addr`, from `/proc/self/maps`; `None` for
/// anonymous memory, System V segments, and deleted files.
pub fn mapping_path(addr: u64) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut fields = line.splitn(6, ' ');
        let (start, end) = fields.next()?.split_once('-')?;
        let (start, end) = (u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?);
        if !(start..end).contains(&addr) {
            return None;
        }
        let path = fields.nth(4)?.trim_start();
        (path.starts_with('/') && !path.ends_with(" (deleted)") && Path::new(path).is_file()).then(|| path.into())
    })
}

/// Whether `addr..addr+len` is one mapping of one file (or System V segment) in this process,
/// from `/proc/self/maps`: contiguous runs of the same device and inode at consecutive file
/// offsets. Anonymous memory, holes, and a neighbouring mapping of something else do not count.
pub fn mapped(addr: u64, len: u64) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    let Some(end) = addr.checked_add(len) else { return false };
    // (next address, device, inode, file offset at that address) of the run so far.
    let mut run: Option<(u64, String, u64, u64)> = None;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(_perms), Some(offset), Some(dev), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let Some((s, e)) = range.split_once('-') else { continue };
        let (Ok(s), Ok(e), Ok(offset), Ok(inode)) = (
            u64::from_str_radix(s, 16),
            u64::from_str_radix(e, 16),
            u64::from_str_radix(offset, 16),
            inode.parse::<u64>(),
        ) else {
            continue;
        };
        run = match run {
            None if s <= addr && addr < e && inode != 0 => Some((e, dev.to_owned(), inode, offset + (e - s))),
            Some((next, d, i, o)) if s == next && d == dev && i == inode && o == offset => {
                Some((e, d, i, offset + (e - s)))
            }
            Some(_) => return false,
            None => None,
        };
        if let Some((next, ..)) = &run
            && *next >= end
        {
            return true;
        }
    }
    false
}

/// Bytes free for an unprivileged writer on the file system holding `dir` (`statvfs`).
#[allow(unsafe_code)]
pub fn available(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: zeroed statvfs is valid; statvfs writes into it and reads the C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
    (rc == 0).then(|| (st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// The uid and gid of the process at the other end of a Unix socket (`SO_PEERCRED`).
#[allow(unsafe_code)]
pub fn peer_owner(stream: &UnixStream) -> Option<(u32, u32)> {
    use std::os::fd::AsRawFd;
    // SAFETY: zeroed ucred is valid; getsockopt writes at most `len` bytes into it.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket fd, an out-buffer of `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some((cred.uid, cred.gid))
}

fn chown_if_needed(path: &Path, uid: u32, gid: u32) {
    let Ok(meta) = std::fs::metadata(path) else { return };
    if (meta.uid() != uid || meta.gid() != gid)
        && let Err(e) = std::os::unix::fs::chown(path, Some(uid), Some(gid))
    {
        tracing::warn!(path = %path.display(), uid, gid, error = %e, "cannot give the pool file to the engine's user");
    }
}

/// Removes pool files a previous run of the agent left in `dir` (a crashed agent cannot free
/// them): UCX's segments and the agent's pool files. Only for a directory this agent owns alone.
pub fn clean_dir(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with(UCX_SEGMENT_PREFIX) || name.starts_with(AGENT_POOL_PREFIX)
        })
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .count()
}

#[cfg(test)]
mod tests;
