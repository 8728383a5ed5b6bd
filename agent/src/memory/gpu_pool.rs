//! An engine's KV pool in GPU memory, as the agent holds it: each region inside an allocation the
//! engine shared by CUDA IPC handle (`RegisterPool.gpu`), opened here on the GPU the registration
//! names by UUID, each allocation checked to hold what the regions claim
//! ([`DeviceMemory::open_ipc`]), and every region registered with the agent's CUDA IPC backend
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
}

impl DevicePool {
    /// Opens the engine's regions (the registration's `gpu`, already checked field by field) and
    /// registers them with `backend`; all or none. `owner` names the engine
    /// (`pdpair/role/engine`): an allocation another engine registered is refused.
    pub fn open(backend: &Arc<CudaIpc>, layout: &PoolLayout, req: &GpuPool, owner: &str) -> Result<DevicePool, String> {
        let gpu = backend
            .gpu(&req.device_uuid)
            .map_err(|e| format!("gpu.device_uuid: {e}"))?;
        let lens = layout.region_lens();
        if req.regions.len() != lens.len() {
            return Err(format!(
                "gpu.regions has {} entries; the pool has {} regions",
                req.regions.len(),
                lens.len()
            ));
        }
        // One opening per distinct allocation (torch may place several layers' tensors in one),
        // claiming as much of it as its regions reach.
        let mut handles: Vec<(IpcHandle, u64)> = Vec::new();
        let mut which = Vec::with_capacity(lens.len());
        for (i, (r, len)) in req.regions.iter().zip(&lens).enumerate() {
            let handle = IpcHandle::from_hex(&r.ipc_handle).map_err(|e| format!("gpu.regions[{i}].ipc_handle: {e}"))?;
            let end = r
                .offset
                .checked_add(*len as u64)
                .ok_or_else(|| format!("gpu.regions[{i}].offset {} wraps", r.offset))?;
            match handles.iter().position(|(h, _)| *h == handle) {
                Some(at) => {
                    handles[at].1 = handles[at].1.max(end);
                    which.push(at);
                }
                None => {
                    which.push(handles.len());
                    handles.push((handle, end));
                }
            }
        }
        let memory = handles
            .iter()
            .enumerate()
            .map(|(at, (h, need))| {
                let need = usize::try_from(*need).map_err(|_| format!("a GPU region reaches {need} bytes"))?;
                backend.open_handle(&gpu, h, need, owner).map_err(|e| {
                    let first = which.iter().position(|w| *w == at).unwrap_or(0);
                    format!("gpu.regions[{first}].ipc_handle: {e}")
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let event = match &req.event {
            Some(hex) => {
                let h = IpcHandle::from_hex(hex).map_err(|e| format!("gpu.event: {e}"))?;
                Some(Arc::new(
                    IpcEvent::open(&gpu, &h).map_err(|e| format!("gpu.event: {e}"))?,
                ))
            }
            None => None,
        };
        let mut pool = DevicePool {
            gpu: gpu.clone(),
            regions: Vec::with_capacity(lens.len()),
            backend: backend.clone(),
            _memory: memory.clone(),
            checksum: Mutex::new(None),
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

    /// The checksums of `which` blocks, computed on the GPU over the pool in place; `None` when
    /// they cannot be (the kernel did not compile, a launch failed, the engine's event did not
    /// fire by `engine_deadline`: logged), which a request counts as unverified, never as a
    /// match. With `engine_deadline` (prefill) the engine's event is waited for first: the
    /// engine's writes may still be running when its `KvReady` arrives.
    #[allow(unsafe_code)]
    pub fn sums(
        &self,
        layout: &PoolLayout,
        which: &Blocks<'_>,
        engine_deadline: Option<std::time::Instant>,
    ) -> Option<Vec<u64>> {
        if let Some(deadline) = engine_deadline {
            let ids: Vec<u64> = self.regions.iter().map(|r| r.id).collect();
            if let Err(e) = self.backend.wait_engine(&ids, deadline) {
                tracing::warn!(error = %e, "no GPU checksum");
                return None;
            }
        }
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
