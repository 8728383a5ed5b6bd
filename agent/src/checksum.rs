//! KV checksums over a pool's blocks, as `pdpair_api::checksum` defines them: [`cpu`] computes
//! them over host memory, [`gpu`] on the GPU in place (bit-identical). A request's blocks are
//! checksummed on the host by several threads at once where there are cores and bytes enough
//! ([`threads_for`], [`each_on_threads`]).

pub mod cpu;
pub mod gpu;

pub use cpu::*;

/// Threads one request's host checksums use at most.
pub const MAX_THREADS: usize = 8;
/// The least a checksum thread reads: below it, starting a thread costs more than it saves.
pub const MIN_THREAD_BYTES: u64 = 16 << 20;

/// Threads for checksumming `bytes`: one per [`MIN_THREAD_BYTES`], at most the cores this
/// process may use (its cgroup's quota included) and [`MAX_THREADS`].
pub fn threads_for(bytes: u64) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cap = cores.min(MAX_THREADS) as u64;
    (bytes / MIN_THREAD_BYTES).clamp(1, cap) as usize
}

/// `f` of each of `items`, in order, on up to `threads` threads (contiguous shares, the first
/// on this thread); `None` if any is `None`. A thread that cannot be started leaves its share
/// to this one; one that panicked counts as `None`.
pub fn each_on_threads<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> Option<R> + Sync,
) -> Option<Vec<R>> {
    let all = |part: &[T]| part.iter().map(&f).collect::<Option<Vec<R>>>();
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
        let mut out = all(first)?;
        for t in started {
            out.extend(match t {
                Ok(handle) => handle.join().ok()??,
                Err(part) => all(part)?,
            });
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
    fn threads_follow_the_bytes_up_to_the_cap() {
        assert_eq!(threads_for(0), 1);
        assert_eq!(threads_for(MIN_THREAD_BYTES - 1), 1);
        let cap = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_THREADS);
        assert_eq!(threads_for(2 * MIN_THREAD_BYTES), 2.min(cap));
        assert_eq!(threads_for(u64::MAX), cap);
    }
}
