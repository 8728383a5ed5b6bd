//! GPU to GPU on one node: both engines' GPU pools are behind this agent, which opened their
//! regions through CUDA IPC handles ([`crate::memory::gpu_pool`]), so a put or get is a copy
//! between two device addresses of this process, queued on the copying GPU's agent stream
//! (contiguous blocks coalesced into one copy; the short ones of many moved by one kernel launch,
//! [`crate::memory::batch_copy`]) and complete when a fence after it passed. No
//! host memory and no network on the way.
//!
//! Every region is registered here with a random 16-byte token, which the engine's handshake
//! description carries as its key. A peer's description is accepted only when its address is
//! this backend's and every region's token, base and length name a region registered here: a
//! description from another agent, or one that claims more than an engine registered, is
//! refused, and every op is checked against both sides' regions as UCX's are. (That the regions
//! are the named peer engine's, not the caller's own or another pair's, the sessions check
//! first: `Shared::check_local_peer`.)
//!
//! An engine's event (its pool's one `gpu.event`; where it registered `gpu.events`, the prefill
//! session waits for the one a `KvReady` names before any op, and its regions carry none) is
//! polled from the host (`cuEventQuery`) until it has passed, and only then are the copies queued: the agent's streams never wait on an engine's event, so an engine whose
//! event never fires holds up only its own requests, until their deadline. Copies still queued
//! when an op fails (a deadline) keep the regions they touch, and so their memory, open until
//! their fence passes.
//!
//! One [`Gpu`] (context and stream) per device for every pool on it, opened once; each IPC handle
//! is opened once per agent, and a handle another engine registered is refused.
//!
//! Between agents (the peer's address is a KV stream's, `transport::stream`): where this agent
//! runs the stream (`--transport tcp`), every GPU region is also registered with it as device
//! memory, copied piece by piece between the GPU and the stream's record buffers (the staged
//! path, backend `StagedStream`); a put first waits for the engine's event of the regions it
//! reads, as the copies above do.
//!
//! Nothing here runs without a GPU: on machines without one, GPU pools are refused before any of
//! it is reached (`memory::gpu_pool`). Its checks are plain arithmetic, shared with the host
//! path's ([`within`]).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::{
    lock,
    memory::{
        batch_copy::{self, BatchCopy},
        cuda::{DeviceMemory, Fence, Gpu, IpcEvent, IpcHandle},
    },
    transport::{
        Admission, Backend, Observed, OpError, PutOp,
        stream::{self, Access, DeviceCopy, Stream},
    },
};

/// A GPU region's id in the stream's regions (which host pools' ids share).
const STREAM_ID: u64 = 1 << 62;

/// The stream's way into a GPU's memory: synchronous copies between it and the record buffer.
#[derive(Debug)]
struct GpuCopy(Gpu);

impl DeviceCopy for GpuCopy {
    #[allow(unsafe_code)]
    fn read(&self, at: u64, into: &mut [u8]) -> Result<(), String> {
        use cudarc::driver::result;
        self.0.bind().map_err(|e| e.to_string())?;
        // SAFETY: the stream checked `at..at+len` lies inside a region registered here, whose
        // opened allocation its registration keeps alive.
        unsafe { result::memcpy_dtoh_sync(into, at) }
            .map_err(crate::memory::cuda::driver("cuMemcpyDtoH"))
            .map_err(|e| e.to_string())
    }

    #[allow(unsafe_code)]
    fn write(&self, at: u64, from: &[u8]) -> Result<(), String> {
        use cudarc::driver::result;
        self.0.bind().map_err(|e| e.to_string())?;
        // SAFETY: as in `read`.
        unsafe { result::memcpy_htod_sync(at, from) }
            .map_err(crate::memory::cuda::driver("cuMemcpyHtoD"))
            .map_err(|e| e.to_string())
    }

    fn settle(&self) -> Result<(), String> {
        // A copy from pageable memory may return before it lands.
        self.0.bind().map_err(|e| e.to_string())?;
        self.0
            .context()
            .synchronize()
            .map_err(crate::memory::cuda::driver("cuCtxSynchronize"))
            .map_err(|e| e.to_string())
    }
}

/// Prefix of this backend's address (then the agent instance's 16 random bytes).
pub const ADDRESS_PREFIX: &[u8] = b"pdpair-cuda-ipc:";

/// One registered GPU region.
#[derive(Clone, Debug)]
struct Region {
    base: u64,
    len: u64,
    token: [u8; 16],
    gpu: Gpu,
    /// The engine's event, recorded after its writes: copies from the region wait for it.
    event: Option<Arc<IpcEvent>>,
    /// Keeps the opened allocation alive while an op uses it (its drop waits for the stream).
    _memory: Arc<DeviceMemory>,
}

#[derive(Debug, Default)]
struct Inner {
    next_id: u64,
    regions: HashMap<u64, Region>,
    /// Peer id -> the peer's region ids.
    peers: HashMap<u64, Vec<u64>>,
    /// Peer id -> the stream's peer, for peers behind another agent.
    staged: HashMap<u64, u64>,
    /// Every GPU opened, by canonical UUID.
    gpus: HashMap<String, Gpu>,
    /// The batch copy kernel on each GPU opened, by UUID (`None`: it did not load there, and
    /// copies go one by one).
    kernels: HashMap<String, Option<Arc<BatchCopy>>>,
    /// The stream's way into each GPU with a region registered, by UUID (one per GPU, so the
    /// stream settles each GPU once).
    copiers: HashMap<String, Arc<GpuCopy>>,
    /// Every IPC handle opened: the engine that registered it, on which GPU, and its memory
    /// while alive.
    opened: HashMap<[u8; 64], (String, String, std::sync::Weak<DeviceMemory>)>,
    /// Copies queued by ops that failed before their fence passed (on that GPU), with what they
    /// touch.
    parked: Vec<(Gpu, Fence, Vec<Region>)>,
}

/// The CUDA IPC backend (one per agent).
#[derive(Debug)]
pub struct CudaIpc {
    address: Vec<u8>,
    inner: Mutex<Inner>,
    /// The agent's KV stream, for GPU pools behind other agents.
    stream: std::sync::OnceLock<Stream>,
}

/// 16 bytes from the OS's random source (a token no peer can guess; all zero only if that
/// source fails, which then matches no handshake's key: connect compares whole tokens of
/// regions registered here, each drawn anew).
fn token() -> [u8; 16] {
    let mut t = [0u8; 16];
    if getrandom::fill(&mut t).is_err() {
        tracing::error!("the OS random source failed: a GPU region token is not random");
    }
    t
}

/// Whether `at..at+len` lies inside `base..base+size` (checked arithmetic).
pub fn within(at: u64, len: u64, base: u64, size: u64) -> bool {
    at >= base
        && at
            .checked_add(len)
            .is_some_and(|end| base.checked_add(size).is_some_and(|top| end <= top))
}

/// Copies `(dst, src, len)` with contiguous neighbours merged (ops in the order given).
pub fn coalesce(copies: impl IntoIterator<Item = (u64, u64, u64)>) -> Vec<(u64, u64, u64)> {
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for (dst, src, len) in copies {
        if let Some(last) = out.last_mut()
            && last.0 + last.2 == dst
            && last.1 + last.2 == src
        {
            last.2 += len;
            continue;
        }
        out.push((dst, src, len));
    }
    out
}

impl Default for CudaIpc {
    fn default() -> Self {
        CudaIpc::new()
    }
}

impl CudaIpc {
    /// A backend with a fresh random address.
    pub fn new() -> CudaIpc {
        let mut address = ADDRESS_PREFIX.to_vec();
        address.extend(token());
        CudaIpc {
            address,
            inner: Mutex::new(Inner {
                next_id: 1,
                ..Inner::default()
            }),
            stream: std::sync::OnceLock::new(),
        }
    }

    /// Moves GPU regions registered from now on to peers behind other agents over `stream`.
    pub fn use_stream(&self, stream: Stream) {
        let _ = self.stream.set(stream);
    }

    /// The stream's peer for `peer`, when it is behind another agent.
    fn staged_peer(&self, peer: u64) -> Option<(u64, &Stream)> {
        let id = *lock(&self.inner).staged.get(&peer)?;
        Some((id, self.stream.get()?))
    }

    /// The GPU with this UUID (either spelling), opened once for every pool on it.
    pub fn gpu(&self, uuid: &str) -> Result<Gpu, String> {
        let canonical = crate::memory::cuda::normalize_uuid(uuid)?;
        let mut inner = lock(&self.inner);
        if let Some(g) = inner.gpus.get(&canonical) {
            return Ok(g.clone());
        }
        let g = crate::memory::cuda::open_by_uuid(&canonical).map_err(|e| e.to_string())?;
        inner.gpus.insert(canonical, g.clone());
        drop(inner);
        // Compiled once per GPU, when its first pool registers (not on a request's path).
        let kernel = match BatchCopy::new(&g) {
            Ok(k) => Some(Arc::new(k)),
            Err(e) => {
                tracing::warn!(error = %e, gpu = %g.uuid(), "no batch copy kernel: a request's copies go one by one");
                None
            }
        };
        lock(&self.inner).kernels.insert(g.uuid(), kernel);
        Ok(g)
    }

    /// Opens `handle` for `owner` (`pdpair/role/engine`), claiming `need` bytes from its start:
    /// the memory already open when `owner` opened it before (and it holds `need`), refused when
    /// another engine registered it.
    pub fn open_handle(
        &self,
        gpu: &Gpu,
        handle: &IpcHandle,
        need: usize,
        owner: &str,
    ) -> Result<Arc<DeviceMemory>, String> {
        let uuid = gpu.uuid();
        {
            let mut inner = lock(&self.inner);
            inner.opened.retain(|_, (_, _, m)| m.strong_count() > 0);
            if let Some((who, on, memory)) = inner.opened.get(&handle.0) {
                if who != owner {
                    return Err("this allocation is registered by another engine".into());
                }
                if *on != uuid {
                    return Err(format!("this allocation is open on GPU {on}, not {uuid}"));
                }
                if let Some(m) = memory.upgrade() {
                    return if m.len() >= need {
                        Ok(m)
                    } else {
                        Err(format!(
                            "this allocation is open for {} bytes; a region now claims {need}",
                            m.len()
                        ))
                    };
                }
            }
        }
        // Opened (and, when its claim fails, closed, which waits for the stream) without the lock.
        let m = Arc::new(DeviceMemory::open_ipc(gpu, handle, need).map_err(|e| e.to_string())?);
        let mut inner = lock(&self.inner);
        if inner
            .opened
            .get(&handle.0)
            .is_some_and(|(_, _, w)| w.strong_count() > 0)
        {
            drop(inner);
            return Err("this allocation is being registered by another registration".into());
        }
        inner
            .opened
            .insert(handle.0, (owner.to_owned(), uuid, Arc::downgrade(&m)));
        Ok(m)
    }

    /// Drops parked copies whose fence passed, each queried on its own GPU (and with them, maybe,
    /// the last hold on their memory, closed after the lock is released). A fence that cannot be
    /// queried has its stream synchronized and goes too.
    fn reap(&self) {
        let parked = std::mem::take(&mut lock(&self.inner).parked);
        let mut keep = Vec::new();
        let mut done = Vec::new();
        for (gpu, fence, regions) in parked {
            match gpu.bind().and_then(|()| fence.passed()) {
                Ok(false) => keep.push((gpu, fence, regions)),
                Ok(true) => done.push(regions),
                Err(_) => {
                    let _ = gpu.synchronize();
                    done.push(regions);
                }
            }
        }
        lock(&self.inner).parked.extend(keep);
        drop(done);
    }

    /// Registers `len` bytes at `base` (inside `memory`, opened on `gpu`); returns its id and
    /// its token. `event` is the engine's, waited for before copies read the region (`None`
    /// where the engine names an event per request: the session waits for that one).
    pub fn register(
        &self,
        gpu: &Gpu,
        memory: Arc<DeviceMemory>,
        base: u64,
        len: u64,
        event: Option<Arc<IpcEvent>>,
    ) -> Result<(u64, [u8; 16]), String> {
        if !within(base, len, memory.ptr(), memory.len() as u64) || len == 0 {
            return Err(format!(
                "a GPU region of {len} bytes at {base:#x} lies outside its allocation ({} bytes at {:#x})",
                memory.len(),
                memory.ptr()
            ));
        }
        let token = token();
        let mut inner = lock(&self.inner);
        let id = inner.next_id;
        inner.next_id += 1;
        if let Some(s) = self.stream.get() {
            let copier = inner
                .copiers
                .entry(gpu.uuid())
                .or_insert_with(|| Arc::new(GpuCopy(gpu.clone())))
                .clone();
            s.register_device(STREAM_ID | id, base, len, memory.clone(), copier);
        }
        inner.regions.insert(
            id,
            Region {
                base,
                len,
                token,
                gpu: gpu.clone(),
                event,
                _memory: memory,
            },
        );
        Ok((id, token))
    }

    /// Forgets a region: ops naming it fail from now on (one in flight holds its memory until
    /// it is done).
    pub fn unregister(&self, id: u64) {
        if let Some(s) = self.stream.get() {
            s.forget(STREAM_ID | id);
        }
        let gone = {
            let mut inner = lock(&self.inner);
            let gone = inner.regions.remove(&id);
            for regions in inner.peers.values_mut() {
                regions.retain(|r| *r != id);
            }
            gone
        };
        // Its memory may close here (that waits for its stream): not under the lock.
        drop(gone);
        self.reap();
    }

    /// Copies `ops` (`from_local`: local -> peer, else peer -> local), checked, coalesced, on the
    /// agent stream of the local regions' GPU; waits for the engine events of the regions read.
    #[allow(unsafe_code)]
    fn copy(
        &self,
        peer: u64,
        locals: &[u64],
        ops: &[PutOp],
        from_local: bool,
        corrupt: bool,
        within_: Duration,
    ) -> Result<u64, OpError> {
        let deadline = Instant::now() + within_;
        // Resolve and check under the lock; copy outside it with the regions (and their memory)
        // held by this call.
        let (mine, theirs) = {
            let inner = lock(&self.inner);
            let theirs: Vec<Region> = inner
                .peers
                .get(&peer)
                .ok_or_else(|| OpError::Failed(format!("unknown GPU peer {peer}")))?
                .iter()
                .filter_map(|id| inner.regions.get(id).cloned())
                .collect();
            let mine = locals
                .iter()
                .map(|id| {
                    inner.regions.get(id).cloned().ok_or_else(|| {
                        OpError::Failed(format!("GPU region {id} is no longer registered (its engine closed)"))
                    })
                })
                .collect::<Result<Vec<Region>, OpError>>()?;
            (mine, theirs)
        };
        let find = |set: &[Region], at: u64, len: u64, what: &str| -> Result<usize, OpError> {
            set.iter().position(|r| within(at, len, r.base, r.len)).ok_or_else(|| {
                OpError::Failed(format!(
                    "{what} range {at:#x}+{len} lies outside the registered GPU regions"
                ))
            })
        };
        let mut copies = Vec::with_capacity(ops.len());
        // The regions the copies read (ours for a put, the peer's for a get), by index.
        let mut read = vec![false; if from_local { mine.len() } else { theirs.len() }];
        // The GPUs the copies touch, by ordinal in this process (the batch kernel runs only
        // where that is the copying GPU alone).
        let mut gpus: Vec<usize> = Vec::new();
        for op in ops {
            let l = find(&mine, op.local, op.len, "local")?;
            let r = find(&theirs, op.remote, op.len, "remote")?;
            for g in [mine[l].gpu.ordinal(), theirs[r].gpu.ordinal()] {
                if !gpus.contains(&g) {
                    gpus.push(g);
                }
            }
            if from_local {
                copies.push((op.remote, op.local, op.len));
                read[l] = true;
            } else {
                copies.push((op.local, op.remote, op.len));
                read[r] = true;
            }
        }
        let sources = if from_local { &mine } else { &theirs };
        let Some(gpu) = mine.first().map(|r| r.gpu.clone()) else {
            return if ops.is_empty() {
                Ok(0)
            } else {
                Err(OpError::Failed("no local GPU region named".into()))
            };
        };
        // Fences are queried with the GPU's context current on this thread.
        gpu.bind().map_err(|e| OpError::Failed(e.to_string()))?;
        self.reap();
        // The engine's writes first: its events, polled from the host until the deadline.
        for (region, _) in sources.iter().zip(&read).filter(|(_, r)| **r) {
            if let Some(event) = &region.event {
                wait_passed(event, deadline).map_err(|e| match e {
                    Waited::Late => OpError::Timeout(format!(
                        "the engine's event had not fired by the deadline (peer {peer}); nothing was copied"
                    )),
                    Waited::Failed(e) => OpError::Failed(e),
                })?;
            }
        }
        let merged = coalesce(copies);
        // A kernel on this GPU cannot reach another GPU's memory without peer access (never
        // enabled here): copies that touch two GPUs go one by one, as `cuMemcpyAsync` finds the
        // way between them.
        let kernel = if gpus == [gpu.ordinal()] {
            lock(&self.inner).kernels.get(&gpu.uuid()).cloned().flatten()
        } else {
            None
        };
        // SAFETY: every range was checked inside regions registered here, whose opened
        // allocations `mine` and `theirs` hold until the copies' fence passed (here, or parked
        // below).
        let queued = unsafe { batch_copy::queue(&gpu, kernel.as_deref(), &merged) }
            .map(|(bytes, _)| bytes)
            .map_err(|e| OpError::Failed(e.to_string()));
        let bytes = *queued.as_ref().unwrap_or(&0);
        let fence = match gpu.fence() {
            Ok(f) => f,
            Err(e) => {
                // No fence to watch: wait for the stream itself before the memory can go.
                let _ = gpu.synchronize();
                return Err(OpError::Failed(e.to_string()));
            }
        };
        let outcome = queued.and_then(|_| {
            poll_until(deadline, || fence.passed()).map_err(|e| match e {
                Waited::Late => OpError::Timeout(format!(
                    "GPU copies to peer {peer} ({bytes} bytes) not done by the deadline"
                )),
                Waited::Failed(e) => OpError::Failed(e),
            })
        });
        if let Err(e) = outcome {
            // Copies may still be queued: their regions stay open until the fence passes.
            let mut held = mine;
            held.extend(theirs);
            lock(&self.inner).parked.push((gpu, fence, held));
            return Err(e);
        }
        if corrupt && let Some((dst, _, _)) = merged.first() {
            flip_byte(&gpu, *dst).map_err(|e| OpError::Failed(e.to_string()))?;
        }
        Ok(bytes)
    }

    /// Waits (polling from the host, until `deadline`) for the engine's event of every region
    /// in `ids` that has one: what the checksum of a prefill pool waits for before reading it.
    pub fn wait_engine(&self, ids: &[u64], deadline: Instant) -> Result<(), String> {
        let events: Vec<Arc<IpcEvent>> = {
            let inner = lock(&self.inner);
            ids.iter()
                .filter_map(|id| inner.regions.get(id).and_then(|r| r.event.clone()))
                .collect()
        };
        for event in events {
            wait_event(&event, deadline)?;
        }
        Ok(())
    }
}

/// Waits (polling from the host) until `event` passed, or fails at `deadline`, saying so.
pub fn wait_event(event: &IpcEvent, deadline: Instant) -> Result<(), String> {
    wait_passed(event, deadline).map_err(|e| match e {
        Waited::Late => "the engine's event had not fired by the deadline".to_owned(),
        Waited::Failed(e) => e,
    })
}

enum Waited {
    Late,
    Failed(String),
}

/// Polls `event` until it passed or `deadline` passes.
fn wait_passed(event: &IpcEvent, deadline: Instant) -> Result<(), Waited> {
    poll_until(deadline, || event.passed())
}

/// Polls `passed` (an event's or a fence's query) until it says so or `deadline` passes.
fn poll_until(
    deadline: Instant,
    passed: impl Fn() -> Result<bool, crate::memory::cuda::CudaError>,
) -> Result<(), Waited> {
    loop {
        match passed() {
            Ok(true) => return Ok(()),
            Ok(false) if Instant::now() >= deadline => return Err(Waited::Late),
            Ok(false) => std::thread::sleep(Duration::from_micros(20)),
            Err(e) => return Err(Waited::Failed(e.to_string())),
        }
    }
}

/// Fault injection: flips the byte at device address `at` (a copied range, still held).
#[allow(unsafe_code)]
fn flip_byte(gpu: &Gpu, at: u64) -> Result<(), crate::memory::cuda::CudaError> {
    use cudarc::driver::result;
    gpu.bind()?;
    let mut b = [0u8; 1];
    // SAFETY: `at` is the first byte of a copy just checked and completed.
    unsafe { result::memcpy_dtoh_sync(&mut b, at) }.map_err(crate::memory::cuda::driver("cuMemcpyDtoH"))?;
    b[0] ^= 0xff;
    // SAFETY: as above.
    unsafe { result::memcpy_htod_sync(at, &b) }.map_err(crate::memory::cuda::driver("cuMemcpyHtoD"))?;
    // A copy from pageable memory may return before it lands, on a stream ours does not wait for.
    gpu.context()
        .synchronize()
        .map_err(crate::memory::cuda::driver("cuCtxSynchronize"))
}

impl Backend for CudaIpc {
    fn kind(&self) -> pdpair_api::Backend {
        pdpair_api::Backend::CudaIpc
    }

    fn address(&self) -> Vec<u8> {
        self.address.clone()
    }

    fn connect(
        &self,
        address: Vec<u8>,
        remotes: Vec<(Vec<u8>, (u64, u64))>,
        key: &[u8; 32],
        by: Instant,
    ) -> Result<u64, String> {
        if address != self.address {
            let Some(s) = self.stream.get().filter(|_| stream::is_stream_address(&address)) else {
                return Err(
                    "the peer's GPU pool is behind another agent: GPU pools move between agents only over their KV streams (--transport tcp on both)"
                        .into(),
                );
            };
            let via = s.connect_by(&address, remotes.into_iter().map(|(_, r)| r).collect(), key, by)?;
            let mut inner = lock(&self.inner);
            let id = inner.next_id;
            inner.next_id += 1;
            inner.staged.insert(id, via);
            return Ok(id);
        }
        let mut inner = lock(&self.inner);
        let mut ids = Vec::with_capacity(remotes.len());
        for (i, (token, (base, len))) in remotes.iter().enumerate() {
            let found = inner
                .regions
                .iter()
                .find(|(_, r)| r.token.as_slice() == token.as_slice())
                .filter(|(_, r)| r.base == *base && r.len == *len)
                .map(|(id, _)| *id)
                .ok_or_else(|| {
                    format!("the peer's region {i} ({base:#x}+{len}) is not a GPU region registered with this agent")
                })?;
            ids.push(found);
        }
        let id = inner.next_id;
        inner.next_id += 1;
        inner.peers.insert(id, ids);
        Ok(id)
    }

    fn admit(&self, key: &[u8; 32], regions: &[u64], access: Access) -> Result<Admission, String> {
        match self.stream.get() {
            Some(s) => {
                let ids: Vec<u64> = regions.iter().map(|r| STREAM_ID | r).collect();
                Ok(Admission::stream(s.admit(key, &ids, access)?))
            }
            None => Ok(Admission::default()),
        }
    }

    fn disconnect(&self, peer: u64) {
        let staged = {
            let mut inner = lock(&self.inner);
            inner.peers.remove(&peer);
            inner.staged.remove(&peer)
        };
        if let (Some(via), Some(s)) = (staged, self.stream.get()) {
            s.disconnect(via);
        }
    }

    fn put(
        &self,
        peer: u64,
        regions: Vec<u64>,
        ops: Vec<PutOp>,
        corrupt: bool,
        within: Duration,
    ) -> Result<u64, OpError> {
        if let Some((via, s)) = self.staged_peer(peer) {
            // The engine's writes first, as for the copies here.
            let deadline = Instant::now() + within;
            self.wait_engine(&regions, deadline).map_err(OpError::Timeout)?;
            let ids: Vec<u64> = regions.iter().map(|r| STREAM_ID | r).collect();
            return s.put(
                via,
                &ids,
                &ops,
                corrupt,
                deadline.saturating_duration_since(Instant::now()),
            );
        }
        self.copy(peer, &regions, &ops, true, corrupt, within)
    }

    fn get(&self, peer: u64, regions: Vec<u64>, ops: Vec<PutOp>, within: Duration) -> Result<u64, OpError> {
        if let Some((via, s)) = self.staged_peer(peer) {
            let ids: Vec<u64> = regions.iter().map(|r| STREAM_ID | r).collect();
            return s.get(via, &ids, &ops, within);
        }
        self.copy(peer, &regions, &ops, false, false, within)
    }

    fn observe(&self, peer: u64) -> Result<Observed, String> {
        if let Some((via, s)) = self.staged_peer(peer) {
            return s.observe(via).map(|o| Observed {
                backend: pdpair_api::Backend::StagedStream,
                ..o
            });
        }
        let inner = lock(&self.inner);
        let ids = inner
            .peers
            .get(&peer)
            .ok_or_else(|| format!("unknown GPU peer {peer}"))?;
        let mut lanes: Vec<String> = ids
            .iter()
            .filter_map(|id| inner.regions.get(id))
            .map(|r| format!("cuda-ipc/{}", r.gpu.uuid()))
            .collect();
        lanes.sort();
        lanes.dedup();
        Ok(Observed {
            kind: pdpair_api::PathKind::CudaIpc,
            backend: pdpair_api::Backend::CudaIpc,
            lanes,
            emulated: false,
            version: crate::memory::cuda::driver_version(),
        })
    }

    fn alive(&self, _within: Duration) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn ranges_are_checked_without_overflow() {
        assert!(within(100, 10, 100, 10));
        assert!(within(105, 5, 100, 10));
        assert!(!within(105, 6, 100, 10), "one past the end");
        assert!(!within(99, 2, 100, 10), "before the start");
        assert!(!within(u64::MAX - 1, 4, u64::MAX - 8, 8), "wraps");
        assert!(!within(0, 1, u64::MAX, 2), "the region wraps");
    }

    #[test]
    fn contiguous_copies_merge_and_others_do_not() {
        let merged = coalesce([
            (1000, 0, 10),
            (1010, 10, 10),
            (1020, 30, 10),
            (2000, 40, 10),
            (2010, 50, 5),
        ]);
        assert_eq!(merged, vec![(1000, 0, 20), (1020, 30, 10), (2000, 40, 15)]);
        assert!(coalesce([]).is_empty());
    }

    #[test]
    fn a_peer_from_another_agent_or_with_unknown_tokens_is_refused() {
        let b = CudaIpc::new();
        let e = b
            .connect(
                CudaIpc::new().address(),
                vec![(vec![0; 16], (0x1000, 64))],
                &[0; 32],
                soon(),
            )
            .expect_err("another agent");
        assert!(e.contains("behind another agent"), "{e}");
        let e = b
            .connect(b.address(), vec![(vec![7; 16], (0x1000, 64))], &[0; 32], soon())
            .expect_err("no such region");
        assert!(e.contains("is not a GPU region registered with this agent"), "{e}");
        let e = b
            .put(9, vec![], vec![], false, Duration::from_secs(1))
            .expect_err("no peer");
        assert!(e.to_string().contains("unknown GPU peer 9"), "{e}");
    }

    #[test]
    fn a_peer_behind_another_agent_goes_over_this_agents_stream_and_is_reported_staged() {
        let loopback = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
        let theirs = Stream::start(loopback).expect("the peer's stream");
        let mut memory = vec![0u8; 4096];
        let base = memory.as_mut_ptr() as u64;
        theirs.register(1, base, 4096, Arc::new(()));
        let key = [4u8; 32];
        let _admitted = theirs.admit(&key, &[1], Access::Write).expect("admitted");
        let remotes = vec![(vec![5; 16], (base, 4096))];
        // Without a stream of its own the agent refuses, naming the remedy.
        let b = CudaIpc::new();
        let e = b
            .connect(theirs.address(), remotes.clone(), &key, soon())
            .expect_err("no stream here");
        assert!(e.contains("only over their KV streams"), "{e}");
        b.use_stream(Stream::start(loopback).expect("our stream"));
        // A stranger's key is refused by the peer's stream.
        let e = b
            .connect(theirs.address(), remotes.clone(), &[9; 32], soon())
            .expect_err("a wrong key");
        assert!(e.contains("no admission has that id and proof"), "{e}");
        let peer = b.connect(theirs.address(), remotes, &key, soon()).expect("connected");
        let seen = b.observe(peer).expect("observed");
        assert_eq!(
            (seen.kind, seen.backend),
            (pdpair_api::PathKind::Tcp, pdpair_api::Backend::StagedStream)
        );
        assert!(
            seen.lanes.iter().all(|l| l.starts_with("tcp-stream/")),
            "{:?}",
            seen.lanes
        );
        // A region unknown here fails the op before anything is sent.
        let e = b
            .put(
                peer,
                vec![77],
                vec![PutOp {
                    local: 0x1000,
                    len: 8,
                    remote: base,
                }],
                false,
                Duration::from_secs(1),
            )
            .expect_err("no such local region");
        assert!(e.to_string().contains("unknown region"), "{e}");
        assert!(memory.iter().all(|b| *b == 0));
        b.disconnect(peer);
        assert!(b.observe(peer).is_err(), "forgotten");
    }
}
