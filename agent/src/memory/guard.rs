//! Surviving a pool file that shrinks under us.
//!
//! Pools the agent maps are shared with an engine (and, for UCX's shared-memory segments, with
//! peer agents on the host). Memory the agent allocates as a memfd is sealed against shrinking,
//! and an engine's own pool must come sealed; but a UCX segment is a plain file on a memory file
//! system and cannot be sealed, so an engine holding its descriptor can truncate it. Any access
//! to a truncated page raises `SIGBUS`, which would kill the agent (and every agent that mapped
//! the segment) with the KV of every engine on the node.
//!
//! So the agent registers each such mapping here, and a `SIGBUS` handler that finds the faulting
//! address inside one replaces the faulting page with an anonymous zero page (`mmap MAP_FIXED`)
//! and returns: the access is retried and reads zeros. The transfer that touched it
//! then fails its checksum, the agent counts the fault ([`faults`]) and keeps serving. A fault
//! anywhere else restores the default action and is re-raised (a real bug still crashes).
//!
//! The handler only reads fixed atomic slots and calls `mmap`, both async-signal-safe.

use std::sync::{
    Once,
    atomic::{AtomicU64, Ordering},
};

/// Guarded ranges at once.
const SLOTS: usize = 1024;

static STARTS: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];
static ENDS: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];
static FAULTS: AtomicU64 = AtomicU64::new(0);
static INSTALL: Once = Once::new();
/// The kernel's page size (read before the handler is installed: 16 or 64 KiB on some arm64
/// kernels, where a 4 KiB `MAP_FIXED` fails and the fault killed the agent after all).
static PAGE: AtomicU64 = AtomicU64::new(4096);

/// A guarded range; unguarded when dropped (before the mapping goes).
#[derive(Debug)]
pub struct Guard(Option<usize>);

/// Guards `addr..addr+len` (a mapping of a file that another process may truncate). Installs
/// the handler the first time. With every slot taken the range is not guarded (logged).
pub fn guard(addr: u64, len: u64) -> Guard {
    INSTALL.call_once(install);
    let Some(end) = addr.checked_add(len) else {
        return Guard(None);
    };
    for i in 0..SLOTS {
        // Claim a free slot by its end (0 = free), then publish the start.
        if ENDS[i]
            .compare_exchange(0, end, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            STARTS[i].store(addr, Ordering::SeqCst);
            return Guard(Some(i));
        }
    }
    tracing::warn!(
        addr,
        len,
        "every SIGBUS guard slot is taken; this mapping is not guarded"
    );
    Guard(None)
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            STARTS[i].store(0, Ordering::SeqCst);
            ENDS[i].store(0, Ordering::SeqCst);
        }
    }
}

/// How many faults on guarded mappings the handler absorbed since the process started.
pub fn faults() -> u64 {
    FAULTS.load(Ordering::Relaxed)
}

#[allow(unsafe_code)]
fn install() {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if let Ok(page) = u64::try_from(page)
        && page.is_power_of_two()
    {
        PAGE.store(page, Ordering::SeqCst);
    }
    // SAFETY: a zeroed sigaction with our handler, SA_SIGINFO, and an empty mask is valid;
    // sigaction only reads it.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) != 0 {
            tracing::warn!("cannot install the SIGBUS handler: a truncated pool would kill the agent");
        }
    }
}

#[allow(unsafe_code)]
extern "C" fn on_sigbus(_signal: libc::c_int, info: *mut libc::siginfo_t, _context: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as u64;
    for i in 0..SLOTS {
        let (start, end) = (STARTS[i].load(Ordering::SeqCst), ENDS[i].load(Ordering::SeqCst));
        if start != 0 && start <= addr && addr < end {
            // Just the faulting page: it certainly belongs to the truncated file's mapping (the
            // kernel raised SIGBUS for it), while a guarded range's end may not be where that
            // mapping ends. Later pages fault (and are replaced) one by one.
            let size = PAGE.load(Ordering::Relaxed);
            let page = addr & !(size - 1);
            // SAFETY: replaces one page of a file mapping this process registered as guarded
            // with a private zero page; mmap is async-signal-safe.
            let replaced = unsafe {
                libc::mmap(
                    page as *mut libc::c_void,
                    size as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if replaced != libc::MAP_FAILED {
                FAULTS.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }
    // Not ours: the default action, re-raised when the faulting access is retried.
    // SAFETY: signal() with SIG_DFL is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGBUS, libc::SIG_DFL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(unsafe_code)]
    fn a_truncated_guarded_mapping_reads_zeros_instead_of_killing_the_process() {
        let path = std::env::temp_dir().join(format!("pdpair-guard-{}", std::process::id()));
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("file");
        file.set_len(1 << 20).expect("size");
        let map = memmap2::MmapOptions::new().map_raw(&file).expect("map");
        // SAFETY: the mapping holds 1 MiB.
        unsafe { map.as_mut_ptr().write_bytes(7, 1 << 20) };
        let _guard = guard(map.as_ptr() as u64, 1 << 20);
        let before = faults();
        // Another process would do this through its descriptor.
        file.set_len(0).expect("truncate");
        // SAFETY: the mapping is still 1 MiB of address space; its pages are gone, and the
        // handler replaces them with zero pages on the first touch.
        let last = unsafe { map.as_ptr().add((1 << 20) - 1).read_volatile() };
        assert_eq!(last, 0);
        assert!(faults() > before);
        let _ = std::fs::remove_file(&path);
    }
}
