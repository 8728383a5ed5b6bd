//! `pdpair-agent bench-put`: UCX put bandwidth over shared memory into a target that is merely
//! registered (an engine's file: puts emulated over active messages) and into one UCX allocated
//! (an agent-allocated pool: the writer maps it and copies once). One thread drives both UCP
//! contexts, progressing the target while it waits, so the two differ only in the target memory.

use std::time::Instant;

use crate::transport::ucx::{Context, MemRegion, Transport, Worker};

/// Bandwidth into one kind of target.
#[derive(Clone, Debug, PartialEq)]
pub struct PutBandwidth {
    /// `registered` or `allocated`.
    pub target: &'static str,
    /// Bytes written per round.
    pub bytes: usize,
    /// Bytes per put.
    pub put_bytes: usize,
    /// The first round (pays the target's page faults), GB/s.
    pub first_gb_per_s: f64,
    /// The best later round, GB/s.
    pub best_gb_per_s: f64,
}

/// Writes `mib` MiB in puts of `put_kib` KiB, `rounds` times, into each kind of target.
pub fn put_bandwidth(mib: usize, put_kib: usize, rounds: u32) -> Result<Vec<PutBandwidth>, String> {
    let dir = std::env::temp_dir().join(format!("pdpair-bench-put-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let result = ["registered", "allocated"]
        .into_iter()
        .map(|target| one(target, &dir, mib.max(8) << 20, put_kib.max(1) << 10, rounds.max(2)))
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn one(
    target: &'static str,
    dir: &std::path::Path,
    len: usize,
    put: usize,
    rounds: u32,
) -> Result<PutBandwidth, String> {
    let e = |e: crate::transport::ucx::UcxError| e.to_string();
    let writer = Context::new(Transport::Shm, Some(dir)).map_err(e)?;
    let owner = Context::new(Transport::Shm, Some(dir)).map_err(e)?;
    let (ww, wo) = (Worker::new(&writer).map_err(e)?, Worker::new(&owner).map_err(e)?);
    let mut heap = vec![0u8; if target == "registered" { len } else { 0 }];
    let region: MemRegion = if target == "registered" {
        // SAFETY: `heap` outlives `region` (dropped first, below).
        #[allow(unsafe_code)]
        unsafe { owner.map(heap.as_mut_ptr(), len) }.map_err(e)?
    } else {
        owner.allocate(len).map_err(e)?
    };
    let ep = ww.connect(&wo.address().map_err(e)?).map_err(e)?;
    let rkey = ep.unpack_rkey(&region.packed_rkey().map_err(e)?).map_err(e)?;
    let source: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let mut times = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        for off in (0..len).step_by(put) {
            let chunk = &source[off..(off + put).min(len)];
            // SAFETY: `source` lives until after the flush; the range lies inside `region`.
            #[allow(unsafe_code)]
            let posted = unsafe { ep.put(chunk, region.addr() + off as u64, &rkey, None) }.map_err(e)?;
            if let Some(req) = posted {
                ep.wait(req, || {
                    wo.progress();
                })
                .map_err(e)?;
            }
        }
        ep.flush(|| {
            wo.progress();
        })
        .map_err(e)?;
        times.push(t.elapsed().as_secs_f64());
    }
    drop(rkey);
    ep.close(|| {
        wo.progress();
    })
    .map_err(e)?;
    drop(region);
    drop(heap);
    let gb = len as f64 / 1e9;
    Ok(PutBandwidth {
        target,
        bytes: len,
        put_bytes: put,
        first_gb_per_s: gb / times[0],
        best_gb_per_s: gb / times[1..].iter().copied().fold(f64::MAX, f64::min),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn measures_both_targets() {
        let r = super::put_bandwidth(16, 4096, 2).expect("runs");
        assert_eq!(
            r.iter().map(|b| b.target).collect::<Vec<_>>(),
            ["registered", "allocated"]
        );
        assert!(
            r.iter().all(|b| b.first_gb_per_s > 0.0 && b.best_gb_per_s > 0.0),
            "{r:?}"
        );
    }
}
