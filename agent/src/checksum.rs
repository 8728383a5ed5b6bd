//! KV checksums over a pool's blocks, as `pdpair_api::checksum` defines them: [`cpu`] computes
//! them over host memory, [`gpu`] on the GPU in place (bit-identical). A request's blocks are
//! checksummed on the host by several threads at once where there are cores and bytes enough
//! ([`threads_for`], [`each_on_threads`]).

pub mod cpu;
pub mod gpu;

pub use cpu::*;

use std::sync::{
    OnceLock,
    atomic::{AtomicUsize, Ordering},
};

/// Threads one request's host checksums use at most.
pub const MAX_THREADS: usize = 8;
/// The least a checksum thread reads: below it, starting a thread costs more than it saves.
pub const MIN_THREAD_BYTES: u64 = 16 << 20;

/// The cores this process may use (its cgroup's quota included), read once.
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Extra checksum threads running now, across every request: together at most the cores, so
/// concurrent requests do not pile threads onto the transfers'.
static EXTRA: AtomicUsize = AtomicUsize::new(0);

/// A request's checksum threads: the caller's and those taken from the agent-wide budget,
/// given back when this drops.
#[derive(Debug)]
pub struct Threads(usize);

impl Threads {
    /// How many, the caller's included.
    pub fn count(&self) -> usize {
        self.0
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        EXTRA.fetch_sub(self.0 - 1, Ordering::Relaxed);
    }
}

/// Threads for checksumming `bytes`: one per [`MIN_THREAD_BYTES`], at most [`MAX_THREADS`], and
/// extra ones only while fewer than the cores run across all requests.
pub fn threads_for(bytes: u64) -> Threads {
    let cap = cores().min(MAX_THREADS) as u64;
    let want = (bytes / MIN_THREAD_BYTES).clamp(1, cap) as usize - 1;
    let mut got = 0;
    let _ = EXTRA.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |running| {
        got = want.min(cores().saturating_sub(running + 1));
        Some(running + got)
    });
    Threads(got + 1)
}

/// `f` of each of `items`, in order, on up to `threads` threads (contiguous shares, the first
/// on this thread); `None` if any is `None`. A thread that cannot be started leaves its share
/// to this one; a share that panicked counts as `None` (every thread is joined first).
pub fn each_on_threads<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> Option<R> + Sync,
) -> Option<Vec<R>> {
    let all = |part: &[T]| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            part.iter().map(&f).collect::<Option<Vec<R>>>()
        }))
        .ok()
        .flatten()
    };
    if threads <= 1 || items.len() < 2 {
        return all(items);
    }
    let share = items.len().div_ceil(threads);
    let mut parts = items.chunks(share);
    let first = parts.next().unwrap_or_default();
    std::thread::scope(|s| {
        let started: Vec<_> = parts
            .map(|part| {
                std::thread::Builder::new()
                    .name("checksum".into())
                    .spawn_scoped(s, || all(part))
                    .map_err(|_| part)
            })
            .collect();
        let mine = all(first);
        // Every thread joined before any result is looked at.
        let rest: Vec<Option<Vec<R>>> = started
            .into_iter()
            .map(|t| match t {
                Ok(handle) => handle.join().ok().flatten(),
                Err(part) => all(part),
            })
            .collect();
        let mut out = mine?;
        for r in rest {
            out.extend(r?);
        }
        Some(out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_keep_their_order_on_any_number_of_threads() {
        let items: Vec<u64> = (0..1000).collect();
        for threads in [0, 1, 2, 3, 7, 8, 999, 1000, 5000] {
            let out = each_on_threads(&items, threads, |x| Some(x * 3 + 1)).expect("all");
            assert_eq!(
                out,
                items.iter().map(|x| x * 3 + 1).collect::<Vec<_>>(),
                "{threads} threads"
            );
        }
        assert_eq!(each_on_threads(&[] as &[u64], 4, |x| Some(*x)), Some(vec![]));
    }

    #[test]
    fn one_missing_result_anywhere_is_none() {
        let items: Vec<u64> = (0..100).collect();
        for missing in [0, 49, 50, 99] {
            assert_eq!(
                each_on_threads(&items, 4, |x| (*x != missing).then_some(*x)),
                None,
                "item {missing} missing"
            );
        }
    }

    #[test]
    fn a_share_that_panics_is_none_and_every_thread_is_joined() {
        let items: Vec<u64> = (0..100).collect();
        for bad in [0, 10, 60, 99] {
            // A None in the first share and a panic in this or a later one: None, no panic here.
            let got = std::panic::catch_unwind(|| {
                each_on_threads(&items, 4, |x| {
                    assert!(*x != bad, "checksum of item {x} panicked");
                    (*x != 5 || bad == 0).then_some(*x)
                })
            });
            assert_eq!(got.ok(), Some(None), "item {bad} panicked");
        }
    }

    #[test]
    fn threads_follow_the_bytes_and_share_one_budget_of_cores() {
        // The only test that takes from the agent-wide budget (tests run in parallel).
        let cap = cores().min(MAX_THREADS);
        assert_eq!(threads_for(0).count(), 1);
        assert_eq!(threads_for(MIN_THREAD_BYTES - 1).count(), 1);
        assert_eq!(threads_for(2 * MIN_THREAD_BYTES).count(), 2.min(cap));
        let all = threads_for(u64::MAX);
        assert_eq!(all.count(), cap);
        // While those run, another request gets only what the cores leave.
        let next = threads_for(u64::MAX);
        assert_eq!(next.count(), (cores() - cap).min(MAX_THREADS - 1) + 1);
        drop(next);
        drop(all);
        assert_eq!(EXTRA.load(Ordering::Relaxed), 0, "every thread given back");
        assert_eq!(threads_for(u64::MAX).count(), cap);
    }
}
