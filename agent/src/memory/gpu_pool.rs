//! An engine's KV pool in GPU memory, as the agent holds it: each region inside an allocation the
//! engine shared by CUDA IPC handle (`RegisterPool.gpu`), or inside the VMM allocations it shared
//! as file descriptors (`ShareGpuMemory`), opened here on the GPU the registration names by UUID,
//! each allocation checked to hold what the regions claim ([`DeviceMemory::open_ipc`],
//! [`DeviceMemory::import_vmm`]), and every region registered with the agent's CUDA IPC backend
//! ([`crate::transport::cuda_ipc`]). Checksums run on that GPU, in place ([`crate::checksum::gpu`]).
//!
//! Needs a GPU: on machines without a CUDA driver the registration is refused before anything
//! here runs.

use std::sync::{Arc, Mutex};

use crate::{
    checksum::gpu::{Blocks, GpuChecksum},
    engine_api::GpuPool,
    layout::PoolLayout,
    memory::cuda::{DeviceMemory, Gpu, IpcEvent, IpcHandle},
    transport::cuda_ipc::CudaIpc,
};

/// One region of a GPU pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRegion {
    /// The backend's id for it.
    pub id: u64,
    /// Its device address in this process.
    pub base: u64,
    /// Bytes.
    pub len: u64,
    /// The token its handshake description carries as its key.
    pub token: [u8; 16],
}

/// A GPU pool, registered with the backend until dropped.
#[derive(Debug)]
pub struct DevicePool {
    /// The GPU, as this process numbers it.
    pub gpu: Gpu,
    /// The regions, in the layout's order.
    pub regions: Vec<DeviceRegion>,
    backend: Arc<CudaIpc>,
    /// The opened allocations (also held by the backend's regions).
    _memory: Vec<Arc<DeviceMemory>>,
    /// The checksum kernels, once they compiled and loaded (a failure is retried next time).
    checksum: Mutex<Option<GpuChecksum>>,
    /// The engine's events a `KvReady` or an `ExpectKv` names (`gpu.events`); empty: its one
    /// `gpu.event`, if any, is its regions' (waited for by the backend before it reads them).
    ring: Vec<Arc<IpcEvent>>,
}

impl DevicePool {
    /// Opens the engine's regions (the registration's `gpu`, already checked field by field) and
    /// registers them with `backend`; all or none. `owner` names the engine
    /// (`pdpair/role/engine`): an allocation another engine registered by IPC handle is refused.
    /// `shared`: the VMM allocations the engine passed with `ShareGpuMemory` (descriptor, bytes),
    /// which the regions without `ipc_handle` lie in.
    pub fn open(
        backend: &Arc<CudaIpc>,
        layout: &PoolLayout,
        req: &GpuPool,
        owner: &str,
        shared: &[(std::os::fd::OwnedFd, u64)],
    ) -> Result<DevicePool, String> {
        let gpu = backend
            .gpu(&req.device_uuid)
            .map_err(|e| format!("gpu.device_uuid: {e}"))?;
        let lens = layout.region_lens();
        let sizes: Vec<u64> = shared.iter().map(|(_, s)| *s).collect();
        let which = openings(req, &lens, &sizes)?;
        let memory = which
            .openings
            .iter()
            .enumerate()
            .map(|(at, opening)| match opening {
                Opening::Ipc(h, need) => {
                    let need = usize::try_from(*need).map_err(|_| format!("a GPU region reaches {need} bytes"))?;
                    backend.open_handle(&gpu, h, need, owner).map_err(|e| {
                        let first = which.of_region.iter().position(|w| *w == at).unwrap_or(0);
                        format!("gpu.regions[{first}].ipc_handle: {e}")
                    })
                }
                Opening::Vmm => {
                    use std::os::fd::AsFd;
                    let chunks: Vec<_> = shared.iter().map(|(fd, size)| (fd.as_fd(), *size)).collect();
                    crate::memory::cuda::DeviceMemory::import_vmm(&gpu, &chunks)
                        .map(Arc::new)
                        .map_err(|e| format!("the GPU memory shared with ShareGpuMemory: {e}"))
                }
            })
            .collect::<Result<Vec<_>, String>>()?;
        let which = which.of_region;
        let open_event = |hex: &str, field: String| -> Result<Arc<IpcEvent>, String> {
            let h = IpcHandle::from_hex(hex).map_err(|e| format!("{field}: {e}"))?;
            Ok(Arc::new(IpcEvent::open(&gpu, &h).map_err(|e| format!("{field}: {e}"))?))
        };
        let ring = req
            .events
            .iter()
            .enumerate()
            .map(|(i, hex)| open_event(hex, format!("gpu.events[{i}]")))
            .collect::<Result<Vec<_>, String>>()?;
        // With events a request names, `event` is for agents from before them (not opened).
        let event = match &req.event {
            Some(hex) if ring.is_empty() => Some(open_event(hex, "gpu.event".into())?),
            _ => None,
        };
        let mut pool = DevicePool {
            gpu: gpu.clone(),
            regions: Vec::with_capacity(lens.len()),
            backend: backend.clone(),
            _memory: memory.clone(),
            checksum: Mutex::new(None),
            ring,
        };
        for (i, (r, len)) in req.regions.iter().zip(&lens).enumerate() {
            let mem = &memory[which[i]];
            let base = mem.ptr() + r.offset;
            // On an error `pool` drops, unregistering the regions registered so far.
            let (id, token) = backend
                .register(&gpu, mem.clone(), base, *len as u64, event.clone())
                .map_err(|e| format!("gpu.regions[{i}]: {e}"))?;
            pool.regions.push(DeviceRegion {
                id,
                base,
                len: *len as u64,
                token,
            });
        }
        Ok(pool)
    }

    /// How many events a `KvReady` or an `ExpectKv` may name (`gpu.events`; 0: none).
    pub fn events(&self) -> usize {
        self.ring.len()
    }

    /// Waits (polling from the host, until `deadline`) for the engine's work a `KvReady` or an
    /// `ExpectKv` that named `event` follows: that event of `gpu.events`, or without one the
    /// pool's `gpu.event` (where it registered one). The caller checked `event` against
    /// [`DevicePool::events`].
    pub fn wait_written(&self, event: Option<u32>, deadline: std::time::Instant) -> Result<(), String> {
        match event.and_then(|e| self.ring.get(e as usize)) {
            Some(e) => crate::transport::cuda_ipc::wait_event(e, deadline),
            None => {
                let ids: Vec<u64> = self.regions.iter().map(|r| r.id).collect();
                self.backend.wait_engine(&ids, deadline)
            }
        }
    }

    /// The checksums of `which` blocks, computed on the GPU over the pool in place; `None` when
    /// they cannot be (the kernel did not compile, a launch failed: logged), which a request
    /// counts as unverified, never as a match. On prefill the caller waited for the engine's
    /// writes first ([`DevicePool::wait_written`]).
    #[allow(unsafe_code)]
    pub fn sums(&self, layout: &PoolLayout, which: &Blocks<'_>) -> Option<Vec<u64>> {
        let mut cached = self.checksum.lock().unwrap_or_else(|e| e.into_inner());
        if cached.is_none() {
            match GpuChecksum::new(&self.gpu) {
                Ok(k) => *cached = Some(k),
                Err(e) => {
                    tracing::warn!(error = %e, "the GPU checksum kernel is not available");
                    return None;
                }
            }
        }
        let kernel = cached.as_ref()?;
        let bases: Vec<u64> = self.regions.iter().map(|r| r.base).collect();
        // SAFETY: every base is a registered region of an allocation this pool holds open.
        match unsafe { kernel.block_sums(layout, &bases, which) } {
            Ok(sums) => Some(sums),
            Err(e) => {
                tracing::warn!(error = %e, "GPU checksum failed");
                None
            }
        }
    }
}

/// How a GPU pool's memory is opened: one opening per distinct IPC allocation (torch may place
/// several layers' tensors in one; its bytes claimed as far as its regions reach), and one for all
/// the shared VMM memory.
#[derive(Debug, PartialEq, Eq)]
enum Opening {
    Ipc(IpcHandle, u64),
    Vmm,
}

/// The openings a registration needs, and which one each region lies in.
#[derive(Debug)]
struct Openings {
    openings: Vec<Opening>,
    of_region: Vec<usize>,
}

/// Plans the openings of `req`'s regions of `lens` bytes, with the `shared` VMM allocations of
/// these sizes, checking before anything is opened that each region lies inside what it names
/// (the shared memory's total; an IPC allocation is checked when opened), naming the region.
fn openings(req: &GpuPool, lens: &[usize], shared: &[u64]) -> Result<Openings, String> {
    if req.regions.len() != lens.len() {
        return Err(format!(
            "gpu.regions has {} entries; the pool has {} regions",
            req.regions.len(),
            lens.len()
        ));
    }
    let shared_total = shared.iter().try_fold(0u64, |t, s| t.checked_add(*s));
    let mut openings: Vec<Opening> = Vec::new();
    let mut of_region = Vec::with_capacity(lens.len());
    for (i, (r, len)) in req.regions.iter().zip(lens).enumerate() {
        let end = r
            .offset
            .checked_add(*len as u64)
            .ok_or_else(|| format!("gpu.regions[{i}].offset {} wraps", r.offset))?;
        let at = match &r.ipc_handle {
            Some(hex) => {
                let handle = IpcHandle::from_hex(hex).map_err(|e| format!("gpu.regions[{i}].ipc_handle: {e}"))?;
                match openings
                    .iter()
                    .position(|o| matches!(o, Opening::Ipc(h, _) if *h == handle))
                {
                    Some(at) => {
                        if let Opening::Ipc(_, need) = &mut openings[at] {
                            *need = (*need).max(end);
                        }
                        at
                    }
                    None => {
                        openings.push(Opening::Ipc(handle, end));
                        openings.len() - 1
                    }
                }
            }
            None => {
                let total = shared_total.filter(|t| *t > 0).ok_or_else(|| {
                    format!("gpu.regions[{i}] has no ipc_handle, and no GPU memory was shared (ShareGpuMemory) for it to lie in")
                })?;
                if end > total {
                    return Err(format!(
                        "gpu.regions[{i}]: {len} bytes at offset {} run past the {total} bytes of GPU memory shared with ShareGpuMemory",
                        r.offset
                    ));
                }
                match openings.iter().position(|o| *o == Opening::Vmm) {
                    Some(at) => at,
                    None => {
                        openings.push(Opening::Vmm);
                        openings.len() - 1
                    }
                }
            }
        };
        of_region.push(at);
    }
    Ok(Openings { openings, of_region })
}

impl DevicePool {
    /// Unregisters the regions: ops naming them fail from now on (the engine closed). The
    /// allocations stay open until the pool and any op still copying are gone.
    pub fn release(&self) {
        for r in &self.regions {
            self.backend.unregister(r.id);
        }
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine_api::GpuRegion;

    fn pool(regions: &[(Option<u8>, u64)]) -> GpuPool {
        GpuPool {
            device_uuid: "GPU-5f1c2a3b-0d4e-4f60-8a9b-0c1d2e3f4a5b".into(),
            regions: regions
                .iter()
                .map(|(h, offset)| GpuRegion {
                    ipc_handle: h.map(|b| IpcHandle([b; 64]).to_hex()),
                    offset: *offset,
                })
                .collect(),
            event: None,
            events: Vec::new(),
        }
    }

    #[test]
    fn regions_open_each_ipc_allocation_once_and_the_shared_memory_once() {
        // Regions 0 and 2 in one IPC allocation (claimed as far as region 2 reaches), 1 and 3 in
        // the shared VMM memory.
        let p = pool(&[(Some(1), 0), (None, 100), (Some(1), 500), (None, 900)]);
        let o = openings(&p, &[100, 100, 100, 100], &[512, 512]).expect("planned");
        assert_eq!(o.openings, vec![Opening::Ipc(IpcHandle([1; 64]), 600), Opening::Vmm]);
        assert_eq!(o.of_region, vec![0, 1, 0, 1]);
    }

    #[test]
    fn a_region_past_the_shared_memory_or_without_any_is_refused_before_anything_opens() {
        let e = openings(&pool(&[(None, 0), (None, 925)]), &[100, 100], &[512, 512]).expect_err("past the end");
        assert!(
            e.contains("gpu.regions[1]: 100 bytes at offset 925 run past the 1024 bytes"),
            "{e}"
        );
        // Exactly to the end is inside.
        assert!(openings(&pool(&[(None, 0), (None, 924)]), &[100, 100], &[512, 512]).is_ok());
        let e = openings(&pool(&[(Some(1), 0), (None, 0)]), &[100, 100], &[]).expect_err("nothing shared");
        assert!(
            e.contains("gpu.regions[1] has no ipc_handle, and no GPU memory was shared"),
            "{e}"
        );
        let e = openings(&pool(&[(None, u64::MAX - 10)]), &[100], &[512]).expect_err("wraps");
        assert!(e.contains("gpu.regions[0].offset 18446744073709551605 wraps"), "{e}");
        let e = openings(&pool(&[(None, 0)]), &[100, 100], &[512]).expect_err("count");
        assert!(e.contains("gpu.regions has 1 entries; the pool has 2 regions"), "{e}");
    }
}
