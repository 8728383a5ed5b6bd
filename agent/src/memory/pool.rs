//! An engine's KV pool memory as the agent holds it: memory the agent allocates on the engine's
//! behalf, or a sealed memfd the engine made. Either way the engine gets (or gave) a file
//! descriptor over the engine socket (`SCM_RIGHTS`), never a path.
//!
//! Who allocates matters on one host. UCX writes into memory its POSIX shared-memory allocator
//! made by mapping the segment and copying once; into memory merely registered (an engine's
//! memfd) it emulates a put over shared memory with two copies and needs the target's worker to
//! progress (docs/benchmarks.md measured about 2x). So agent-allocated pools come from UCX, as
//! named files in the pool directory (where peer agents on the host find them); UCX cannot seal
//! those, so every mapping of one is guarded against truncation ([`crate::guard`]). Where UCX
//! cannot allocate such a file (transports without shared memory, such as tcp alone), the agent
//! makes a memfd sealed against shrinking and growing instead.

use std::{
    fs::File,
    os::{
        fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::net::UnixStream,
    },
    path::{Path, PathBuf},
};

use crate::{memory::guard::Guard, transport::ucx_thread::UcxHandle};

/// Prefix of the files UCX's POSIX allocator makes (its shared-memory segments and pools).
pub const UCX_SEGMENT_PREFIX: &str = "ucx_shm_posix_";
/// Prefix of the plain pool files earlier agent versions made when UCX could not allocate.
pub const AGENT_POOL_PREFIX: &str = "pdpair-pool-";

/// How the pool's memory came to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The engine's sealed memfd.
    EngineMemfd,
    /// Allocated by UCX for the engine: peers on the host write it with one copy.
    Ucx,
    /// A sealed memfd the agent made for the engine.
    AgentMemfd,
}

/// A pool: the agent's own mapping (for reading, and keeping the pages alive while the agent
/// holds the engine), its UCX registration, and the descriptor the engine maps.
#[derive(Debug)]
pub struct Pool {
    /// Shared with the UCX thread, which keeps it mapped while UCX may still read or write the
    /// region (after a force-closed endpoint; see `transport::ucx_thread::Orphan`).
    map: std::sync::Arc<memmap2::MmapRaw>,
    /// The registered address: peers address the pool from it, and local ops must lie in
    /// `base..base+len` (for UCX-allocated pools this is UCX's mapping, not `map`).
    pub base: u64,
    /// UCX region id.
    pub region: u64,
    /// Packed remote key.
    pub rkey: Vec<u8>,
    /// The pool's file (a UCX segment's path; memfds have none).
    pub path: Option<PathBuf>,
    /// The descriptor handed to the engine.
    fd: OwnedFd,
    /// Where it came from.
    pub origin: Origin,
    /// Truncation guards over the agent's mappings of an unsealable file.
    _guards: Vec<Guard>,
}

/// Whether `file` lives on hugetlbfs (a memfd made with `MFD_HUGETLB`).
#[allow(unsafe_code)]
fn on_hugetlbfs(file: &File) -> bool {
    const HUGETLBFS_MAGIC: libc::c_long = 0x9584_58f6;
    let mut fs = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: a valid descriptor and a buffer of the size fstatfs writes; read only on success.
    let got = unsafe { libc::fstatfs(std::os::fd::AsRawFd::as_raw_fd(file), fs.as_mut_ptr()) };
    // SAFETY: fstatfs filled it (it returned 0).
    got == 0 && unsafe { fs.assume_init() }.f_type as libc::c_long == HUGETLBFS_MAGIC
}

/// Seals a pool memfd carries, or must carry when an engine made it.
pub const REQUIRED_SEALS: libc::c_int = libc::F_SEAL_SHRINK;

impl Pool {
    /// Maps and registers the engine's memfd, which must be a regular memory file sealed
    /// against shrinking (`F_SEAL_SHRINK`) and hold at least `need` bytes.
    pub fn engine_memfd(ucx: &UcxHandle, fd: OwnedFd, need: usize) -> Result<Pool, String> {
        let seals = seals(fd.as_fd());
        if seals & REQUIRED_SEALS != REQUIRED_SEALS {
            return Err(format!(
                "the pool descriptor is not sealed against shrinking (F_SEAL_SHRINK; its seals are {seals:#x}): pass a memfd made with MFD_ALLOW_SEALING and sealed"
            ));
        }
        let file = File::from(fd);
        let meta = file.metadata().map_err(|e| format!("the pool descriptor: {e}"))?;
        if !meta.is_file() {
            return Err("the pool descriptor is not a regular memory file".into());
        }
        // A huge-page memfd (MFD_HUGETLB): a hole the engine punches after registering (sealing
        // against shrinking does not forbid it) faults in a new huge page when the agent touches
        // it, and with none free the agent dies of SIGBUS (a shared-memory memfd gives a page of
        // zeros instead).
        if on_hugetlbfs(&file) {
            return Err(
                "the pool descriptor is a huge-page memfd (MFD_HUGETLB), which the agent does not map: pass a memfd without MFD_HUGETLB".into(),
            );
        }
        if meta.len() < need as u64 {
            return Err(format!(
                "the pool descriptor holds {} bytes; the geometry needs {need}",
                meta.len()
            ));
        }
        // The engine's memory is the engine's to pay for: pages the agent faulted in would be
        // charged to the agent's memory cgroup (a sparse memfd of any size would get the agent
        // killed at its limit).
        let backed = std::os::unix::fs::MetadataExt::blocks(&meta).saturating_mul(512);
        if backed < need as u64 {
            return Err(format!(
                "the pool descriptor has {backed} of the {need} bytes the geometry needs backed by memory: write every page of them (or fallocate and then touch every page) before registering; the agent does not fault in an engine's memory"
            ));
        }
        // The first `need` bytes, the ones mapped: a memfd twice as long, allocated only past
        // them (or past its end, `FALLOC_FL_KEEP_SIZE`), passed the count above. The kernel
        // counts the pages of that range it holds (cachestat, Linux 6.5; where it has none, the
        // count above stands alone).
        let page = page_size();
        match pages_held(&file, need) {
            Ok(held) if held < need.div_ceil(page) as u64 => {
                return Err(format!(
                    "the pool descriptor has {} of the {need} bytes the geometry needs (its first ones, which the agent maps) backed by memory: allocate them (fallocate, or write every page) before registering; the agent does not fault in an engine's memory",
                    held.saturating_mul(page as u64)
                ));
            }
            Ok(_) => {}
            // No cachestat (before Linux 6.5, or a seccomp profile without it), or a file it does
            // not count (hugetlbfs): the allocated size above stands alone.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM | libc::EOPNOTSUPP)) => {
                tracing::debug!(error = %e, "cannot count an engine pool's pages (cachestat); took its allocated size");
            }
            Err(e) => return Err(format!("the pool descriptor: counting its pages: {e}")),
        }
        Pool::register_memfd(ucx, file, need, Origin::EngineMemfd)
    }

    /// Maps the first `need` bytes of a sealed memfd (at least that long) populated, and
    /// registers them. Only `need`: a larger file (an engine's sparse memfd of any size) is not
    /// faulted in by the agent.
    fn register_memfd(ucx: &UcxHandle, file: File, need: usize, origin: Origin) -> Result<Pool, String> {
        let map = std::sync::Arc::new(map_populated(&file, Some(need), "the pool memfd")?);
        let base = map.as_mut_ptr() as u64;
        let (region, rkey) = ucx.map(base, need as u64, Box::new(map.clone()))?;
        Ok(Pool {
            map,
            base,
            region,
            rkey,
            path: None,
            fd: OwnedFd::from(file),
            origin,
            _guards: Vec::new(),
        })
    }

    /// Allocates `need` bytes for an engine: through UCX when it makes a named file in `dir`,
    /// else as a sealed memfd.
    pub fn allocate(ucx: &UcxHandle, dir: &Path, need: usize) -> Result<Pool, String> {
        let pool = match ucx.allocate(need as u64) {
            Ok(a) => match mapping_path(a.addr).filter(|p| p.parent() == Some(dir)) {
                // UCX's mapping is guarded by the UCX thread, which holds it; ours here.
                Some(path) => open_no_follow(&path)
                    .and_then(|f| map_populated(&f, None, &path.to_string_lossy()).map(|map| (f, map)))
                    .map(|(f, map)| {
                        let guards = vec![crate::memory::guard::guard(map.as_ptr() as u64, map.len() as u64)];
                        Pool {
                            map: std::sync::Arc::new(map),
                            base: a.addr,
                            region: a.region,
                            rkey: a.rkey,
                            path: Some(path),
                            fd: OwnedFd::from(f),
                            origin: Origin::Ucx,
                            _guards: guards,
                        }
                    }),
                None => Err(format!("UCX allocated memory that is not a file in {}", dir.display())),
            }
            .inspect_err(|_| ucx.unmap(a.region)),
            Err(e) => Err(e),
        };
        match pool {
            Ok(pool) => Ok(pool),
            Err(why) => {
                tracing::debug!(reason = %why, "pool memory: a sealed memfd instead of UCX's allocator");
                let file = sealed_memfd(need)?;
                Pool::register_memfd(ucx, file, need, Origin::AgentMemfd)
            }
        }
    }

    /// What keeps the registered memory mapped for a backend that reaches it itself (the tcp
    /// stream): the agent's own mapping where the registration is that mapping; UCX's
    /// allocations (shared memory only) are kept by the UCX thread: `None`.
    pub fn keep(&self) -> Option<std::sync::Arc<dyn Send + Sync>> {
        (self.base == self.map.as_ptr() as u64).then(|| self.map.clone() as std::sync::Arc<dyn Send + Sync>)
    }

    /// The descriptor the engine maps (whole, shared).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The pool's bytes, through the agent's own mapping.
    pub fn memory(&self, len: usize) -> &[u8] {
        #[allow(unsafe_code)]
        // SAFETY: the mapping lives as long as `self` and holds at least `len` bytes (checked or
        // sized at creation); readers only look at blocks whose transfers completed (decode) or
        // that the engine marked ready (prefill). A truncated UCX segment cannot fault here:
        // its mappings are guarded (zero pages replace what went).
        unsafe {
            std::slice::from_raw_parts(self.map.as_ptr(), len.min(self.map.len()))
        }
    }

    /// Unregisters the pool; memory the agent allocated through UCX loses its file (the
    /// engine's and the agent's mappings stay valid until unmapped). Local ops on the region
    /// fail from now on.
    pub fn release(&self, ucx: &UcxHandle) {
        ucx.unmap(self.region);
    }
}

/// The seals on a descriptor (`F_GET_SEALS`; 0 when it has none or cannot have any).
#[allow(unsafe_code)]
pub fn seals(fd: BorrowedFd<'_>) -> libc::c_int {
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on a valid descriptor.
    let s = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    s.max(0)
}

/// [`sealed_memfd`] with its pages allocated (`fallocate`), as an engine passes its own pool:
/// charged to the process that makes it.
#[allow(unsafe_code)]
pub fn backed_memfd(len: usize) -> Result<File, String> {
    use std::os::fd::AsRawFd;
    let file = sealed_memfd(len)?;
    let len = libc::off_t::try_from(len).map_err(|_| format!("a pool of {len} bytes"))?;
    // SAFETY: fallocate on a valid memfd, within its size (it is sealed against growing).
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc != 0 {
        return Err(format!(
            "allocating the pool memfd: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(file)
}

/// A memfd of `len` bytes, sealed against shrinking, growing and further sealing.
#[allow(unsafe_code)]
pub fn sealed_memfd(len: usize) -> Result<File, String> {
    use std::os::fd::AsRawFd;
    // SAFETY: a static C string; memfd_create returns a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(c"pdpair-pool".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor we own.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len as u64)
        .map_err(|e| format!("sizing the pool memfd: {e}"))?;
    // SAFETY: fcntl on a valid memfd.
    let rc = unsafe {
        libc::fcntl(
            file.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
    };
    if rc != 0 {
        return Err(format!("sealing the pool memfd: {}", std::io::Error::last_os_error()));
    }
    Ok(file)
}

/// Bytes per page, as the kernel counts a memory file's (4 KiB, or 16 or 64 KiB on some arm64
/// kernels).
#[allow(unsafe_code)]
pub fn page_size() -> usize {
    // SAFETY: sysconf takes a name and returns a value or -1.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

/// Pages of `file`'s first `len` bytes the kernel holds in memory (`cachestat`, Linux 6.5): a
/// page allocated with `fallocate` counts, one never allocated (a hole) does not, nor one
/// swapped out.
#[allow(unsafe_code)]
fn pages_held(file: &File, len: usize) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct CacheStat {
        cache: u64,
        dirty: u64,
        writeback: u64,
        evicted: u64,
        recently_evicted: u64,
    }
    // cachestat's number on every architecture of the generic syscall table and on x86_64.
    const SYS_CACHESTAT: libc::c_long = 451;
    let range = Range {
        off: 0,
        len: len as u64,
    };
    let mut stat = CacheStat::default();
    // SAFETY: a valid descriptor, a range and a result struct of the kernel's layout, no flags.
    let rc = unsafe { libc::syscall(SYS_CACHESTAT, file.as_raw_fd(), &raw const range, &raw mut stat, 0u32) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(stat.cache)
}

fn open_no_follow(path: &Path) -> Result<File, String> {
    use std::os::unix::fs::OpenOptionsExt;
    File::options()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Maps `len` bytes of `file` (all of it when `None`), faulting the pages in now, not inside the
/// first transfer.
fn map_populated(file: &File, len: Option<usize>, what: &str) -> Result<memmap2::MmapRaw, String> {
    let mut options = memmap2::MmapOptions::new();
    if let Some(len) = len {
        options.len(len);
    }
    options
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
pub fn available(dir: &Path) -> Option<u64> {
    statvfs(dir).map(|st| st.f_bavail.saturating_mul(st.f_frsize))
}

#[allow(unsafe_code)]
fn statvfs(dir: &Path) -> Option<libc::statvfs> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: zeroed statvfs is valid; statvfs writes into it and reads the C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
    (rc == 0).then_some(st)
}

/// This process's memory cgroup's limit and what it is charged for now, or `None` where it has
/// no limit (or none can be read). cgroup v2 (`memory.max`,
/// `memory.current`) or v1 (`memory.limit_in_bytes`, `memory.usage_in_bytes`), at the path
/// `/proc/self/cgroup` names or, in a cgroup namespace of the container's own, at the root.
pub fn memory_limit() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_memory(&text, |path| std::fs::read_to_string(path).ok())
}

/// [`memory_limit`] from a `/proc/self/cgroup` text, reading files with `read`: the limit and
/// what is in use.
pub fn cgroup_memory(cgroup: &str, read: impl Fn(&str) -> Option<String>) -> Option<(u64, u64)> {
    let number = |path: String| read(&path).and_then(|t| t.trim().parse::<u64>().ok());
    let mut places: Vec<(String, &str, &str)> = Vec::new();
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_end_matches('/');
        if controllers.is_empty() {
            for at in [format!("/sys/fs/cgroup{path}"), "/sys/fs/cgroup".to_owned()] {
                places.push((at, "memory.max", "memory.current"));
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            for at in [
                format!("/sys/fs/cgroup/memory{path}"),
                "/sys/fs/cgroup/memory".to_owned(),
            ] {
                places.push((at, "memory.limit_in_bytes", "memory.usage_in_bytes"));
            }
        }
    }
    places.into_iter().find_map(|(at, limit, usage)| {
        let raw = read(&format!("{at}/{limit}"))?;
        // v2 says `max`; v1 a number near 2^63 (rounded to a page).
        let limit = raw.trim().parse::<u64>().ok().filter(|l| *l < 1 << 62);
        let used = number(format!("{at}/{usage}"))?;
        Some((limit?, used))
    })
}

/// The process id at the other end of a Unix socket, as the kernel recorded it at connect
/// (`SO_PEERCRED`).
pub fn peer_pid(stream: &UnixStream) -> Option<i32> {
    peer_cred(stream).map(|c| c.pid)
}

/// The uid and gid of the process at the other end of a Unix socket (`SO_PEERCRED`).
pub fn peer_owner(stream: &UnixStream) -> Option<(u32, u32)> {
    peer_cred(stream).map(|c| (c.uid, c.gid))
}
#[allow(unsafe_code)]
fn peer_cred(stream: &UnixStream) -> Option<libc::ucred> {
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
    (rc == 0).then_some(cred)
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
            name.starts_with(UCX_SEGMENT_PREFIX)
                || name.starts_with(AGENT_POOL_PREFIX)
                || name.starts_with(crate::transport::ucx_probe::SCRATCH_PREFIX)
        })
        .filter(|e| {
            // A UCX probe's scratch directory, left by an agent that died during a probe.
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                std::fs::remove_dir_all(e.path()).is_ok()
            } else {
                std::fs::remove_file(e.path()).is_ok()
            }
        })
        .count()
}

#[cfg(test)]
mod tests;
