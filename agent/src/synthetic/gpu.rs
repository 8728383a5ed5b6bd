//! The synthetic engine with its KV pool in GPU memory, as vLLM's would be: each region its own
//! `cuMemAlloc` allocation (the first one with the region at an offset, as a torch tensor inside a
//! caching-allocator block), shared with the agent by CUDA IPC handle, or ([`Sharing::Vmm`]) every
//! region in one range of VMM allocations, as torch's `expandable_segments` maps its memory,
//! shared as file descriptors (`ShareGpuMemory`); and an interprocess event recorded after each
//! fill, with the next of [`EVENTS`] more (`gpu.events`, the one a `KvReady` names: [`GpuEngine::event`]),
//! or without them ([`GpuEngine::register_with`]). Its bytes are the host synthetic engine's ([`super::fill_into`]),
//! written and read through host copies, so decode checks every byte independently of the
//! checksums. Needs a GPU, and an agent in another process (a process cannot open its own IPC
//! handles).

use std::{os::unix::net::UnixStream, path::Path};

use crate::{
    engine_api::{AgentEvent, EngineRequest, GpuPool, GpuRegion},
    layout::PoolLayout,
    memory::cuda::{DeviceMemory, Gpu, IpcEvent, PinnedBuffer},
    synthetic::{EngineSpec, SyntheticEngine},
    wire::{self, FrameError},
};

/// Bytes before the first region inside its allocation (a tensor at an offset in a block).
pub const FIRST_OFFSET: usize = 4096;

/// The events a `KvReady` may name (`gpu.events`), where the engine registers them.
pub const EVENTS: usize = 4;

/// How the engine shares its pool's GPU memory with the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// One `cuMemAlloc` allocation per region, each by CUDA IPC handle.
    Ipc,
    /// Every region in one range of VMM allocations of about `chunk` bytes each (region 0 at
    /// [`FIRST_OFFSET`], the others right after it, so regions straddle allocations), shared as
    /// file descriptors.
    Vmm {
        /// Bytes per allocation (rounded up to the GPU's granularity).
        chunk: usize,
    },
}

/// A registered GPU engine.
#[derive(Debug)]
pub struct GpuEngine {
    stream: UnixStream,
    /// Its pool layout.
    pub layout: PoolLayout,
    gpu: Gpu,
    /// The allocations; region `r` starts at `offsets[r]` in `memory[of[r]]`.
    memory: Vec<DeviceMemory>,
    of: Vec<usize>,
    offsets: Vec<usize>,
    event: IpcEvent,
    /// `gpu.events`, and the one the last fill recorded.
    ring: Vec<IpcEvent>,
    last: Option<u32>,
    /// What [`GpuEngine::busy`] copies within, and what [`GpuEngine::stale_writes`] writes.
    scratch: Option<DeviceMemory>,
    marker: Option<DeviceMemory>,
    /// What the last fill is still copying from (page-locked: the copies run after the fill
    /// returns, as a forward pass's writes would).
    staging: Vec<PinnedBuffer>,
    /// Side-channel address the agent gave it.
    pub address: String,
}

impl GpuEngine {
    /// Allocates the pool on `gpu`, and registers it with the agent at `socket` as a GPU pool
    /// shared by CUDA IPC handles.
    pub fn register(socket: &Path, spec: &EngineSpec, gpu: &Gpu) -> Result<GpuEngine, String> {
        GpuEngine::register_sharing(socket, spec, gpu, Sharing::Ipc)
    }

    /// Allocates the pool on `gpu`, and registers it with the agent at `socket` as a GPU pool
    /// shared as `sharing` says.
    pub fn register_sharing(
        socket: &Path,
        spec: &EngineSpec,
        gpu: &Gpu,
        sharing: Sharing,
    ) -> Result<GpuEngine, String> {
        GpuEngine::register_with(socket, spec, gpu, sharing, EVENTS)
    }

    /// [`GpuEngine::register_sharing`] with `events` events a `KvReady` names (0: only the
    /// one `gpu.event`, as engines from before them).
    pub fn register_with(
        socket: &Path,
        spec: &EngineSpec,
        gpu: &Gpu,
        sharing: Sharing,
        events: usize,
    ) -> Result<GpuEngine, String> {
        use std::os::fd::AsFd;
        let mut reg = SyntheticEngine::registration(spec, None, false);
        let layout = reg.layout().map_err(|e| e.to_string())?;
        let lens = layout.region_lens();
        let (memory, of, offsets, descriptors) = match sharing {
            Sharing::Ipc => {
                let offsets: Vec<usize> = (0..lens.len()).map(|r| if r == 0 { FIRST_OFFSET } else { 0 }).collect();
                let memory = lens
                    .iter()
                    .zip(&offsets)
                    .map(|(len, off)| DeviceMemory::alloc(gpu, len + off))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| e.to_string())?;
                (memory, (0..lens.len()).collect::<Vec<_>>(), offsets, Vec::new())
            }
            Sharing::Vmm { chunk } => {
                let offsets: Vec<usize> = lens
                    .iter()
                    .scan(FIRST_OFFSET, |at, len| {
                        let here = *at;
                        *at += len;
                        Some(here)
                    })
                    .collect();
                let total = FIRST_OFFSET + lens.iter().sum::<usize>();
                let (memory, fds) = DeviceMemory::alloc_vmm(gpu, total, chunk).map_err(|e| e.to_string())?;
                (vec![memory], vec![0; lens.len()], offsets, fds)
            }
        };
        let (event, event_handle) = IpcEvent::create(gpu).map_err(|e| e.to_string())?;
        let (ring, ring_handles): (Vec<IpcEvent>, Vec<String>) = (0..events)
            .map(|_| IpcEvent::create(gpu).map(|(e, h)| (e, h.to_hex())))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?
            .into_iter()
            .unzip();
        let regions = of
            .iter()
            .zip(&offsets)
            .map(|(m, off)| {
                let ipc_handle = match sharing {
                    Sharing::Ipc => Some(memory[*m].ipc_handle()?.to_hex()),
                    Sharing::Vmm { .. } => None,
                };
                Ok(GpuRegion {
                    ipc_handle,
                    offset: *off as u64,
                })
            })
            .collect::<Result<Vec<_>, crate::memory::cuda::CudaError>>()
            .map_err(|e| e.to_string())?;
        reg.gpu = Some(GpuPool {
            device_uuid: gpu.uuid(),
            regions,
            event: Some(event_handle.to_hex()),
            events: ring_handles,
        });
        let mut stream = UnixStream::connect(socket).map_err(|e| format!("connecting to {}: {e}", socket.display()))?;
        for batch in descriptors.chunks(wire::MAX_FDS) {
            let fds: Vec<_> = batch.iter().map(|(fd, _)| fd.as_fd()).collect();
            let sizes = batch.iter().map(|(_, size)| *size).collect();
            wire::write_frame_fds(&stream, &EngineRequest::ShareGpuMemory { sizes }, &fds)
                .map_err(|e| e.to_string())?;
        }
        // The agent holds what it imported; this process keeps its own mappings.
        drop(descriptors);
        wire::write_frame(&mut stream, &EngineRequest::RegisterPool(Box::new(reg))).map_err(|e| e.to_string())?;
        match wire::read_frame::<AgentEvent>(&mut stream).map_err(|e| e.to_string())? {
            AgentEvent::Registered {
                address, region_lens, ..
            } => {
                let says: Vec<usize> = region_lens.iter().map(|l| *l as usize).collect();
                if says != lens {
                    return Err(format!(
                        "the agent says regions of {says:?} bytes; the layout has {lens:?}"
                    ));
                }
                Ok(GpuEngine {
                    stream,
                    layout,
                    gpu: gpu.clone(),
                    memory,
                    of,
                    offsets,
                    event,
                    ring,
                    last: None,
                    scratch: None,
                    marker: None,
                    staging: Vec::new(),
                    address,
                })
            }
            AgentEvent::RegistrationFailed { message, .. } => Err(message),
            other => Err(format!("unexpected answer to RegisterPool: {other:?}")),
        }
    }

    fn download(&self) -> Result<Vec<Vec<u8>>, String> {
        // `read` synchronizes the engine's stream first (a fill still copying).
        self.layout
            .region_lens()
            .iter()
            .enumerate()
            .map(|(r, len)| {
                let mut host = vec![0u8; *len];
                self.memory[self.of[r]]
                    .read(self.offsets[r], &mut host)
                    .map(|()| host)
                    .map_err(|e| e.to_string())
            })
            .collect()
    }

    fn upload(&self, host: &[Vec<u8>]) -> Result<(), String> {
        for (r, bytes) in host.iter().enumerate() {
            self.memory[self.of[r]]
                .write(self.offsets[r], bytes)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Prefill: queues the request's KV into its blocks on the GPU (DMA from page-locked memory)
    /// and records the engine's event after it, without waiting, as a forward pass leaves its
    /// writes running when the engine sends `KvReady`: the agent must wait for the event before
    /// it reads them.
    #[allow(unsafe_code)]
    pub fn fill(&mut self, seed: u64, blocks: &[u32], first_token: u64, num_tokens: u64) -> Result<(), String> {
        self.gpu.synchronize().map_err(|e| e.to_string())?;
        let lens = self.layout.region_lens();
        if self.staging.len() != lens.len() {
            self.staging = lens
                .iter()
                .map(|len| PinnedBuffer::alloc(&self.gpu, *len))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| e.to_string())?;
        }
        for (r, buffer) in self.staging.iter_mut().enumerate() {
            self.memory[self.of[r]]
                .read(self.offsets[r], buffer.as_mut_slice())
                .map_err(|e| e.to_string())?;
        }
        let mut maps: Vec<&mut [u8]> = self.staging.iter_mut().map(|b| b.as_mut_slice()).collect();
        super::fill_into(&self.layout, &mut maps, seed, blocks, first_token, num_tokens);
        for (r, buffer) in self.staging.iter().enumerate() {
            self.memory[self.of[r]]
                .range(self.offsets[r], buffer.as_slice().len())
                .map_err(|e| e.to_string())?;
            // SAFETY: the range was checked in live memory this engine holds; the buffer stays in
            // `self.staging`, unchanged, until the next fill (which synchronizes first) or its
            // drop (which synchronizes too).
            unsafe {
                self.gpu.upload_async(
                    self.memory[self.of[r]].ptr() + self.offsets[r] as u64,
                    buffer.as_slice(),
                )
            }
            .map_err(|e| e.to_string())?;
        }
        self.record()
    }

    /// Records the engine's event, and the next of `gpu.events`, after what is queued.
    fn record(&mut self) -> Result<(), String> {
        self.event.record(&self.gpu).map_err(|e| e.to_string())?;
        if !self.ring.is_empty() {
            let next = self.last.map_or(0, |l| (l as usize + 1) % self.ring.len());
            self.ring[next].record(&self.gpu).map_err(|e| e.to_string())?;
            self.last = Some(next as u32);
        }
        Ok(())
    }

    /// Prefill: queues `copies` device copies of `bytes` within scratch memory of its own (the
    /// next forward pass: work after the last fill's, on the same stream, touching none of the
    /// pool) and records its events after them, without waiting.
    pub fn busy(&mut self, bytes: usize, copies: u32) -> Result<(), String> {
        self.queue_busy(bytes, copies)?;
        self.record()
    }

    /// Decode: work queued before a receive that still writes the pool, as a finished request's
    /// kernels may still run when the engine gives its blocks to a new one: [`GpuEngine::busy`]'s
    /// copies, then `0xee` over every region; the engine's events recorded after it, without
    /// waiting ([`GpuEngine::event`] names the one for the `ExpectKv`).
    pub fn stale_writes(&mut self, bytes: usize, copies: u32) -> Result<(), String> {
        let lens = self.layout.region_lens();
        let most = lens.iter().copied().max().unwrap_or(0);
        if self.marker.as_ref().is_none_or(|m| m.len() < most) {
            let marker = DeviceMemory::alloc(&self.gpu, most).map_err(|e| e.to_string())?;
            marker.write(0, &vec![0xee; most]).map_err(|e| e.to_string())?;
            self.marker = Some(marker);
        }
        self.queue_busy(bytes, copies)?;
        if let Some(marker) = &self.marker {
            for (r, len) in lens.iter().enumerate() {
                self.gpu
                    .copy(&self.memory[self.of[r]], self.offsets[r], marker, 0, *len)
                    .map_err(|e| e.to_string())?;
            }
        }
        self.record()
    }

    fn queue_busy(&mut self, bytes: usize, copies: u32) -> Result<(), String> {
        if self.scratch.as_ref().is_none_or(|s| s.len() < 2 * bytes) {
            self.scratch = Some(DeviceMemory::alloc(&self.gpu, 2 * bytes).map_err(|e| e.to_string())?);
        }
        if let Some(scratch) = &self.scratch {
            for i in 0..copies {
                let (from, to) = if i % 2 == 0 { (0, bytes) } else { (bytes, 0) };
                self.gpu
                    .copy(scratch, to, scratch, from, bytes)
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }

    /// Whether the engine's work queued so far is done (its one event's latest record passed).
    pub fn idle(&self) -> Result<bool, String> {
        self.event.passed().map_err(|e| e.to_string())
    }

    /// The event of `gpu.events` recorded last (by a fill, for its `KvReady`; by
    /// [`GpuEngine::stale_writes`], for an `ExpectKv`); `None` without them.
    pub fn event(&self) -> Option<u32> {
        self.last
    }

    /// Decode: zeroes the whole pool.
    pub fn clear(&mut self) -> Result<(), String> {
        let zero: Vec<Vec<u8>> = self.layout.region_lens().iter().map(|l| vec![0u8; *l]).collect();
        self.upload(&zero)
    }

    /// Decode: counts the received tokens whose bytes differ from what prefill computed.
    pub fn verify(&self, seed: u64, blocks: &[u32], first_token: u64, num_tokens: u64) -> Result<u64, String> {
        let host = self.download()?;
        let maps: Vec<&[u8]> = host.iter().map(|m| &m[..]).collect();
        Ok(super::verify_in(
            &self.layout,
            &maps,
            seed,
            blocks,
            first_token,
            num_tokens,
        ))
    }

    /// Sends one request.
    pub fn send(&mut self, request: &EngineRequest) -> Result<(), FrameError> {
        wire::write_frame(&mut self.stream, request)
    }

    /// Waits for the next event.
    pub fn next_event(&mut self) -> Result<AgentEvent, FrameError> {
        wire::read_frame(&mut self.stream)
    }

    /// Waits at most `within` for each event from now on.
    pub fn wait_events_for(&self, within: std::time::Duration) -> std::io::Result<()> {
        self.stream.set_read_timeout(Some(within))
    }
}
