//! GPU memory through the CUDA driver API (cudarc, loaded at run time). The agent builds and runs
//! without CUDA: [`Gpu::open`] answers [`CudaError::NoDriver`] where libcuda is not on the loader
//! path, and nothing here is called before it succeeded (cudarc panics on a missing library).
//!
//! Pools that cross processes are allocated with `cuMemAlloc`: memory from the stream-ordered
//! allocator cannot be exported with `cuIpcGetMemHandle` (measured on an H200: INVALID_VALUE).
//! A handle from a peer is untrusted: the range it claims is checked against the allocation the
//! driver mapped ([`DeviceMemory::open_ipc`]).
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DriverError, result, sys};

/// A CUDA call failed, or CUDA is not there.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// libcuda is not on the loader path.
    #[error("no CUDA driver on this machine (libcuda was not found on the loader path)")]
    NoDriver,
    /// libnvrtc is not on the loader path.
    #[error("no NVRTC on this machine (libnvrtc was not found on the loader path)")]
    NoNvrtc,
    /// A driver call failed.
    #[error("{op}: {source}")]
    Driver {
        /// The driver function.
        op: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// NVRTC refused the kernel source.
    #[error("compiling the {kernel} kernel: {log}")]
    Compile {
        /// Which kernel.
        kernel: &'static str,
        /// NVRTC's log.
        log: String,
    },
    /// An argument does not fit (a range, a layout).
    #[error("{0}")]
    Invalid(String),
}

/// Maps a driver error to [`CudaError::Driver`] naming `op`.
pub(crate) fn driver(op: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver { op, source }
}

fn check(op: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Driver {
            op,
            source: DriverError(r),
        })
    }
}

/// Whether libcuda can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library (each call tries again; nothing is kept).
    unsafe { sys::is_culib_present() }
}

/// A GPU the driver shows this process, without opening a context on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Its number in this process (differs between containers).
    pub ordinal: usize,
    /// Its UUID, canonical (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as `nvidia-smi -L` prints it).
    pub uuid: String,
    /// Its name.
    pub name: String,
}

/// The GPUs this process sees (`cuDeviceGet`, `cuDeviceGetUuid`: no context is created, so no
/// GPU memory is taken). [`CudaError::NoDriver`] without libcuda.
pub fn devices() -> Result<Vec<DeviceInfo>, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    result::init().map_err(driver("cuInit"))?;
    let n = result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
    (0..n.max(0))
        .map(|i| {
            let dev = result::device::get(i).map_err(driver("cuDeviceGet"))?;
            let uuid = result::device::get_uuid(dev).map_err(driver("cuDeviceGetUuid"))?;
            let bytes: Vec<u8> = uuid.bytes.iter().map(|b| *b as u8).collect();
            Ok(DeviceInfo {
                ordinal: i as usize,
                uuid: canonical_uuid(&bytes),
                name: result::device::get_name(dev).unwrap_or_default(),
            })
        })
        .collect()
}

fn canonical_uuid(bytes: &[u8]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// A GPU UUID as an engine may write it (`GPU-` and dashes optional, any case: nvidia-smi and
/// torch print it differently), canonical; `Err` says what is wrong with it.
pub fn normalize_uuid(text: &str) -> Result<String, String> {
    let body = text.strip_prefix("GPU-").unwrap_or(text);
    let hex: String = body.chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "{:?} is not a GPU UUID (32 hex digits, as `nvidia-smi -L` prints it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)",
            crate::reason::peer_text(text)
        ));
    }
    let bytes: Vec<u8> = (0..16)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect();
    Ok(canonical_uuid(&bytes))
}

/// Compiles `source` with NVRTC for `gpu`'s architecture (NVRTC's default where it does not know
/// that one: the driver then JITs up from an older one) and loads it on `gpu`. `kernel` names it
/// in errors.
pub fn compile(gpu: &Gpu, source: &str, kernel: &'static str) -> Result<Arc<cudarc::driver::CudaModule>, CudaError> {
    use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
    // SAFETY: only tries to dlopen libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    gpu.bind()?;
    let own = gpu
        .context()
        .compute_capability()
        .ok()
        .map(|(major, minor)| vec![format!("--gpu-architecture=compute_{major}{minor}")]);
    let compile = |options: Vec<String>| {
        compile_ptx_with_opts(
            source,
            CompileOptions {
                name: Some(format!("pdpair_{kernel}.cu")),
                options,
                ..Default::default()
            },
        )
    };
    let ptx = own
        .and_then(|o| compile(o).ok())
        .map_or_else(|| compile(Vec::new()), Ok)
        .map_err(|e| CudaError::Compile {
            kernel,
            log: e.to_string(),
        })?;
    gpu.context().load_module(ptx).map_err(driver("cuModuleLoadData"))
}

/// One GPU: its primary context and a stream of the agent's own for copies and kernels.
#[derive(Debug, Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl Gpu {
    /// Opens GPU `ordinal` (of those this process sees) and binds its context to this thread.
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("cuDevicePrimaryCtxRetain"))?;
        let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        Ok(Gpu { ctx, stream })
    }

    /// How many GPUs this process sees (0 without a driver).
    pub fn count() -> usize {
        if !driver_present() {
            return 0;
        }
        CudaContext::device_count().map_or(0, |n| usize::try_from(n).unwrap_or(0))
    }

    /// Its number in this process.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|e| format!("(unnamed: {e})"))
    }

    /// The device's UUID as hex (the same GPU whatever its number in a container).
    pub fn uuid(&self) -> String {
        match self.ctx.uuid() {
            Ok(u) => u.bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect(),
            Err(e) => format!("(no uuid: {e})"),
        }
    }

    /// Binds the context to the calling thread (the raw driver calls below need it current).
    pub fn bind(&self) -> Result<(), CudaError> {
        // Directly, not cudarc's bind_to_thread: that first returns (and clears) an error some
        // earlier call on this context recorded, failing an unrelated operation (or a drop,
        // which then leaks what it should release).
        // SAFETY: a live context, retained by `ctx`.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx.cu_ctx()) })
    }

    /// The agent's stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Queues a device-to-device copy of `len` bytes on the agent's stream.
    ///
    /// # Safety
    /// Both ranges must lie in live device memory of this context (or mapped into it through IPC)
    /// until the stream has passed the copy.
    pub unsafe fn copy_async(&self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the caller guarantees the ranges; the stream is ours.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.stream.cu_stream())
        })
    }

    /// Queues a copy of `len` bytes from `src` at `src_at` into `dst` at `dst_at`, both ranges
    /// checked against their memory. Memory waits for its queued copies before it is freed.
    pub fn copy(
        &self,
        dst: &DeviceMemory,
        dst_at: usize,
        src: &DeviceMemory,
        src_at: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        dst.range(dst_at, len)?;
        src.range(src_at, len)?;
        // SAFETY: both ranges lie in live device memory, which synchronizes before it is freed.
        unsafe { self.copy_async(dst.ptr + dst_at as u64, src.ptr + src_at as u64, len) }
    }

    /// Queues a copy of `len` bytes between any two device addresses this process can reach
    /// (its own memory or memory opened through IPC, on this GPU or another: unified addressing)
    /// on the agent's stream.
    ///
    /// # Safety
    /// Both ranges must stay live device memory until the stream has passed the copy.
    pub unsafe fn copy_any_async(&self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the caller guarantees the ranges; the stream is ours.
        check("cuMemcpyAsync", unsafe {
            sys::cuMemcpyAsync(dst, src, len, self.stream.cu_stream())
        })
    }

    /// Queues a copy of `src` to device address `dst` on this stream, without waiting for it
    /// (what an engine's forward pass is to the agent: writes still running when it says so).
    ///
    /// # Safety
    /// `dst..dst+src.len()` must be live device memory, and `src` must stay alive and unchanged
    /// until the stream has passed the copy.
    pub unsafe fn upload_async(&self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the caller guarantees both sides.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), self.stream.cu_stream())
        })
    }

    /// A marker after everything queued on the agent's stream so far; [`Fence::passed`] says
    /// when the stream reached it.
    pub fn fence(&self) -> Result<Fence, CudaError> {
        let event = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(driver("cuEventCreate"))?;
        event.record(&self.stream).map_err(driver("cuEventRecord"))?;
        Ok(Fence(event))
    }

    /// Waits until everything queued on the agent's stream is done.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(driver("cuStreamSynchronize"))
    }

    /// Milliseconds the work queued by `work` takes on the agent's stream, between two events.
    pub fn time_ms(&self, work: impl FnOnce() -> Result<(), CudaError>) -> Result<f32, CudaError> {
        let start = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("cuEventCreate"))?;
        let end = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("cuEventCreate"))?;
        start.record(&self.stream).map_err(driver("cuEventRecord"))?;
        work()?;
        end.record(&self.stream).map_err(driver("cuEventRecord"))?;
        end.synchronize().map_err(driver("cuEventSynchronize"))?;
        start.elapsed_ms(&end).map_err(driver("cuEventElapsedTime"))
    }
}

/// Page-locked host memory (`cuMemHostAlloc`): copies from it are DMA transfers that run after
/// the call returns. Freed on drop.
#[derive(Debug)]
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
    gpu: Gpu,
}

// SAFETY: plain host memory owned by this value.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// `len` bytes (at least 1).
    pub fn alloc(gpu: &Gpu, len: usize) -> Result<PinnedBuffer, CudaError> {
        gpu.bind()?;
        // SAFETY: a plain allocation in the bound context.
        let ptr = unsafe { result::malloc_host(len.max(1), 0) }.map_err(driver("cuMemHostAlloc"))?;
        Ok(PinnedBuffer {
            ptr: ptr.cast(),
            len,
            gpu: gpu.clone(),
        })
    }

    /// Its bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes allocated above, owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Its bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // Copies from it may still be queued.
            let _ = self.gpu.synchronize();
            // SAFETY: allocated by malloc_host, freed once.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// See [`Gpu::fence`].
#[derive(Debug)]
pub struct Fence(cudarc::driver::CudaEvent);

impl Fence {
    /// Whether the stream passed the fence (`cuEventQuery`), without blocking.
    pub fn passed(&self) -> Result<bool, CudaError> {
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.0.cu_event()) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|()| false),
        }
    }
}

/// An engine's interprocess event (`cuIpcOpenEventHandle`), destroyed on drop.
#[derive(Debug)]
pub struct IpcEvent(sys::CUevent, Gpu);

// SAFETY: a CUevent is a driver handle usable from any thread with its context bound (every use
// binds `.1`'s context first).
unsafe impl Send for IpcEvent {}
// SAFETY: as above; the driver serializes calls on one event.
unsafe impl Sync for IpcEvent {}

impl IpcEvent {
    /// Whether the work the event's latest record follows is done (`cuEventQuery`), without
    /// blocking: the agent polls an engine's event from the host instead of making its own
    /// streams wait on it, so an engine whose event never fires stalls only its own requests.
    pub fn passed(&self) -> Result<bool, CudaError> {
        self.1.bind()?;
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|()| false),
        }
    }

    /// Opens an engine's event on `gpu` from its handle.
    pub fn open(gpu: &Gpu, handle: &IpcHandle) -> Result<IpcEvent, CudaError> {
        gpu.bind()?;
        let raw = sys::CUipcEventHandle {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: out-pointer; the driver validates the handle's bytes.
        check("cuIpcOpenEventHandle", unsafe {
            sys::cuIpcOpenEventHandle(&mut event, raw)
        })?;
        Ok(IpcEvent(event, gpu.clone()))
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        if self.1.bind().is_ok() {
            // SAFETY: opened here, destroyed once.
            let _ = unsafe { sys::cuEventDestroy_v2(self.0) };
        }
    }
}

impl IpcEvent {
    /// A new event on `gpu` made with `CU_EVENT_INTERPROCESS` (what an engine makes for
    /// `gpu.event`; the GPU tests use it), and the handle another process opens it by.
    pub fn create(gpu: &Gpu) -> Result<(IpcEvent, IpcHandle), CudaError> {
        gpu.bind()?;
        let flags =
            sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32 | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: out-pointer, in the bound context.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut event, flags) })?;
        let event = IpcEvent(event, gpu.clone());
        // SAFETY: zeroed handle bytes are a valid out-value; the event is live.
        let mut raw: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        check("cuIpcGetEventHandle", unsafe {
            sys::cuIpcGetEventHandle(&mut raw, event.0)
        })?;
        Ok((event, IpcHandle(raw.reserved.map(|b| b as u8))))
    }

    /// Records the event on `gpu`'s agent stream (an engine records it on its own stream).
    pub fn record(&self, gpu: &Gpu) -> Result<(), CudaError> {
        gpu.bind()?;
        // SAFETY: a live event and a live stream.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.0, gpu.stream.cu_stream())
        })
    }
}

/// Opens the GPU with this UUID (either spelling, see [`normalize_uuid`]), whatever its number
/// in this process.
pub fn open_by_uuid(uuid: &str) -> Result<Gpu, CudaError> {
    let want = normalize_uuid(uuid).map_err(CudaError::Invalid)?;
    let list = devices()?;
    let found = list.iter().find(|d| d.uuid == want).ok_or_else(|| {
        CudaError::Invalid(format!(
            "no GPU {want} here (this agent sees {})",
            if list.is_empty() {
                "none".to_owned()
            } else {
                list.iter().map(|d| d.uuid.as_str()).collect::<Vec<_>>().join(", ")
            }
        ))
    })?;
    Gpu::open(found.ordinal)
}

/// The driver's version, as `major.minor`.
pub fn driver_version() -> String {
    let mut v = 0i32;
    // SAFETY: an out-pointer.
    if driver_present() && unsafe { sys::cuDriverGetVersion(&mut v) } == sys::CUresult::CUDA_SUCCESS {
        format!("CUDA {}.{}", v / 1000, (v % 1000) / 10)
    } else {
        "CUDA (unknown)".into()
    }
}

/// An IPC handle for device memory (`cuIpcGetMemHandle`): 64 opaque bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

impl std::fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IpcHandle(..)")
    }
}

impl IpcHandle {
    /// As hex, for a command line or a text channel.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// From 128 hex digits.
    pub fn from_hex(s: &str) -> Result<IpcHandle, CudaError> {
        let s = s.trim();
        if s.len() != 128 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(CudaError::Invalid(format!(
                "an IPC handle is 128 hex digits; got {} characters",
                s.len()
            )));
        }
        let mut out = [0u8; 64];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
                .map_err(|e| CudaError::Invalid(format!("IPC handle: {e}")))?;
        }
        Ok(IpcHandle(out))
    }
}

/// Device memory: allocated here (`cuMemAlloc`, exportable by IPC handle), a peer's opened from
/// its IPC handle, or VMM allocations (`cuMemCreate`) mapped end to end into one reserved range
/// (an engine's, imported from the file descriptors it passed, or made here to share that way).
/// Freed, closed or unmapped on drop.
#[derive(Debug)]
pub struct DeviceMemory {
    gpu: Gpu,
    ptr: u64,
    len: usize,
    kind: Kind,
}

/// How a [`DeviceMemory`] came to be, which decides how it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Kind {
    Allocated,
    Opened,
    /// VMM allocations of these sizes mapped end to end into a reserved range of `len` bytes
    /// (each allocation's handle was released once mapped: the mapping holds it).
    Mapped(Vec<usize>),
}

/// The most VMM allocations one [`DeviceMemory::import_vmm`] maps.
pub const MAX_VMM_CHUNKS: usize = 8192;

/// The allocation properties of memory on `gpu` shareable by POSIX file descriptor.
fn vmm_prop(gpu: &Gpu) -> sys::CUmemAllocationProp {
    // SAFETY: a zeroed CUmemAllocationProp is valid (no handle types, no flags).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = gpu.ordinal() as std::ffi::c_int;
    prop
}

/// The granularity VMM allocations and mappings on `gpu` are made in.
fn vmm_granularity(gpu: &Gpu) -> Result<usize, CudaError> {
    let prop = vmm_prop(gpu);
    let mut granularity = 0usize;
    // SAFETY: out-pointer and a valid property struct.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(granularity.max(1))
}

/// Checks the sizes an engine claims for the VMM allocations it shares before anything is
/// mapped: 1..=[`MAX_VMM_CHUNKS`] of them, each a positive multiple of `granularity`, adding up
/// without overflow; the total. A claim larger than the allocation itself is refused by the
/// driver when it is mapped.
pub fn check_vmm_sizes(sizes: &[u64], granularity: u64) -> Result<u64, String> {
    if sizes.is_empty() || sizes.len() > MAX_VMM_CHUNKS {
        return Err(format!(
            "{} VMM allocations shared; 1..={MAX_VMM_CHUNKS} are taken",
            sizes.len()
        ));
    }
    let mut total = 0u64;
    for (i, size) in sizes.iter().enumerate() {
        if *size == 0 || granularity == 0 || size % granularity != 0 {
            return Err(format!(
                "shared GPU allocation {i} claims {size} bytes, not a positive multiple of the GPU's VMM granularity ({granularity} bytes)"
            ));
        }
        total = total
            .checked_add(*size)
            .filter(|t| *t <= i64::MAX as u64)
            .ok_or_else(|| format!("the shared GPU allocations' sizes overflow at allocation {i} ({size} bytes)"))?;
    }
    Ok(total)
}

impl DeviceMemory {
    /// `len` bytes on `gpu`, zeroed.
    pub fn alloc(gpu: &Gpu, len: usize) -> Result<DeviceMemory, CudaError> {
        if len == 0 {
            return Err(CudaError::Invalid("cannot allocate 0 bytes of device memory".into()));
        }
        gpu.bind()?;
        // SAFETY: a plain allocation in the bound context.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(driver("cuMemAlloc"))?;
        let memory = DeviceMemory {
            gpu: gpu.clone(),
            ptr,
            len,
            kind: Kind::Allocated,
        };
        // SAFETY: the range is the allocation just made.
        unsafe { result::memset_d8_sync(ptr, 0, len) }.map_err(driver("cuMemsetD8"))?;
        // The memset runs on the legacy stream, which the agent's (non-blocking) stream does not
        // wait for: finish it before anything is queued there.
        gpu.ctx.synchronize().map_err(driver("cuCtxSynchronize"))?;
        Ok(memory)
    }

    /// A peer's memory from its IPC handle, of which the peer claims `len` bytes. The claim is
    /// checked: the handle must open an allocation that starts where it maps and holds at least
    /// `len` bytes, or the handle is closed again and refused.
    pub fn open_ipc(gpu: &Gpu, handle: &IpcHandle, len: usize) -> Result<DeviceMemory, CudaError> {
        gpu.bind()?;
        let raw = sys::CUipcMemHandle {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer; the driver validates the handle's bytes.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
            )
        })?;
        let memory = DeviceMemory {
            gpu: gpu.clone(),
            ptr,
            len,
            kind: Kind::Opened,
        };
        memory.check_claim()?;
        Ok(memory)
    }

    /// VMM allocations an engine shared as POSIX file descriptors (`cuMemExportToShareableHandle`
    /// of `cuMemCreate` memory), each claimed to hold `size` bytes, imported and mapped end to end
    /// into one reserved range on `gpu`, readable and writable there; all or none. Each claim is
    /// checked ([`check_vmm_sizes`]; the driver refuses to map more than an allocation holds),
    /// and each allocation must be on `gpu`. The descriptors may be closed afterwards.
    pub fn import_vmm(gpu: &Gpu, chunks: &[(std::os::fd::BorrowedFd<'_>, u64)]) -> Result<DeviceMemory, CudaError> {
        use std::os::fd::AsRawFd;
        gpu.bind()?;
        let sizes: Vec<u64> = chunks.iter().map(|(_, s)| *s).collect();
        let total = check_vmm_sizes(&sizes, vmm_granularity(gpu)? as u64).map_err(CudaError::Invalid)?;
        let total = usize::try_from(total).map_err(|_| CudaError::Invalid(format!("{total} bytes of GPU memory")))?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer; a fresh range anywhere.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, total, 0, 0, 0)
        })?;
        let mut mapped: Vec<usize> = Vec::with_capacity(chunks.len());
        let mut devices: Vec<Option<usize>> = Vec::with_capacity(chunks.len());
        let outcome = (|| {
            let mut at = 0usize;
            for (i, (fd, size)) in chunks.iter().enumerate() {
                let size = *size as usize;
                let mut handle: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: out-pointer; the driver checks the descriptor is one of its exports
                // (the value is the descriptor itself, as the POSIX handle type takes it).
                check("cuMemImportFromShareableHandle", unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut handle,
                        fd.as_raw_fd() as isize as *mut std::ffi::c_void,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                })
                .map_err(|e| CudaError::Invalid(format!("shared GPU allocation {i}: {e}")))?;
                // Where the driver says it is (its numbering for an imported handle may be the
                // exporter's: the mapped address is asked again below).
                let said = allocation_device(handle).ok();
                // SAFETY: `handle` was imported above; the mapping (if made) holds the allocation,
                // so the handle is released either way.
                let map = check("cuMemMap", unsafe {
                    sys::cuMemMap(ptr + at as u64, size, 0, handle, 0)
                })
                .map_err(|e| {
                    CudaError::Invalid(format!(
                        "shared GPU allocation {i} does not hold the {size} bytes claimed for it ({e})"
                    ))
                });
                // SAFETY: as above.
                unsafe { sys::cuMemRelease(handle) };
                map?;
                devices.push(said);
                mapped.push(size);
                at += size;
            }
            // The pool's GPU reads and writes it, and so may the GPUs that reach it as a peer
            // (an engine's pool on another GPU of the node is copied to or from on its own).
            let accesses: Vec<sys::CUmemAccessDesc> = std::iter::once(gpu.ordinal())
                .chain(peers_of(gpu))
                .map(|d| sys::CUmemAccessDesc {
                    location: sys::CUmemLocation {
                        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                        id: d as std::ffi::c_int,
                    },
                    flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                })
                .collect();
            // SAFETY: the whole range is mapped; one descriptor per device.
            check("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(ptr, total, accesses.as_ptr(), accesses.len())
            })?;
            // Each allocation must be on the pool's GPU, in this process's numbering.
            let mut start = ptr;
            for (i, (size, said)) in mapped.iter().zip(&devices).enumerate() {
                let on = pointer_device(start).ok().or(*said);
                if on != Some(gpu.ordinal()) {
                    return Err(CudaError::Invalid(format!(
                        "shared GPU allocation {i} is on GPU {} of this process, not on GPU {} (the pool's device_uuid)",
                        on.map_or_else(|| "(unknown)".to_owned(), |d| d.to_string()),
                        gpu.ordinal()
                    )));
                }
                start += *size as u64;
            }
            Ok(())
        })();
        if let Err(e) = outcome {
            // SAFETY: the allocations in `mapped` were mapped here from `ptr`, the range reserved
            // here.
            unsafe { unmap_and_free(ptr, &mapped, total) };
            return Err(e);
        }
        Ok(DeviceMemory {
            gpu: gpu.clone(),
            ptr,
            len: total,
            kind: Kind::Mapped(mapped),
        })
    }

    /// `len` bytes on `gpu` (rounded up to the VMM granularity) made of allocations of about
    /// `chunk` bytes each, shareable by POSIX file descriptor, mapped end to end and zeroed, as
    /// torch's `expandable_segments` maps its memory: the memory, and each allocation's exported
    /// descriptor with its size (what an engine passes to [`DeviceMemory::import_vmm`]).
    pub fn alloc_vmm(
        gpu: &Gpu,
        len: usize,
        chunk: usize,
    ) -> Result<(DeviceMemory, Vec<(std::os::fd::OwnedFd, u64)>), CudaError> {
        use std::os::fd::FromRawFd;
        gpu.bind()?;
        let g = vmm_granularity(gpu)?;
        let chunk = chunk.max(1).div_ceil(g) * g;
        let total = len.max(1).div_ceil(g) * g;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer; a fresh range anywhere.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, total, 0, 0, 0)
        })?;
        let prop = vmm_prop(gpu);
        let mut fds = Vec::new();
        let mut mapped: Vec<usize> = Vec::new();
        let outcome = (|| {
            let mut at = 0usize;
            while at < total {
                let size = chunk.min(total - at);
                let mut handle: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: out-pointer and a valid property struct.
                check("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) })?;
                let mut fd: std::ffi::c_int = -1;
                // SAFETY: the POSIX handle type writes an int; `handle` is live.
                let exported = check("cuMemExportToShareableHandle", unsafe {
                    sys::cuMemExportToShareableHandle(
                        (&raw mut fd).cast(),
                        handle,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        0,
                    )
                })
                // SAFETY: the range's next `size` bytes are reserved and unmapped.
                .and_then(|()| {
                    check("cuMemMap", unsafe {
                        sys::cuMemMap(ptr + at as u64, size, 0, handle, 0)
                    })
                });
                if fd >= 0 {
                    // SAFETY: the driver made this descriptor for us.
                    fds.push((unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }, size as u64));
                }
                // SAFETY: the mapping (if made) holds the allocation.
                unsafe { sys::cuMemRelease(handle) };
                exported?;
                mapped.push(size);
                at += size;
            }
            let access = sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the whole range is mapped.
            check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(ptr, total, &access, 1) })?;
            // SAFETY: the range is mapped and accessible.
            unsafe { result::memset_d8_sync(ptr, 0, total) }.map_err(driver("cuMemsetD8"))?;
            gpu.ctx.synchronize().map_err(driver("cuCtxSynchronize"))
        })();
        if let Err(e) = outcome {
            // SAFETY: the allocations in `mapped` were mapped here from `ptr`, the range reserved
            // here.
            unsafe { unmap_and_free(ptr, &mapped, total) };
            return Err(e);
        }
        Ok((
            DeviceMemory {
                gpu: gpu.clone(),
                ptr,
                len: total,
                kind: Kind::Mapped(mapped),
            },
            fds,
        ))
    }

    /// The allocation behind `ptr` starts at it and holds `len` bytes.
    fn check_claim(&self) -> Result<(), CudaError> {
        let (base, size) = address_range(self.ptr)?;
        if base != self.ptr || size < self.len {
            return Err(CudaError::Invalid(format!(
                "the handle maps {size} bytes at {base:#x}, not the {} bytes at {:#x} it was given for",
                self.len, self.ptr
            )));
        }
        Ok(())
    }

    /// Its device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: allocations are not).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// An IPC handle a process on this node can open.
    pub fn ipc_handle(&self) -> Result<IpcHandle, CudaError> {
        self.gpu.bind()?;
        // SAFETY: zeroed handle bytes are a valid out-value.
        let mut raw: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: ptr is a live cuMemAlloc allocation of this context.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut raw, self.ptr)
        })?;
        Ok(IpcHandle(raw.reserved.map(|b| b as u8)))
    }

    /// Copies `data` to `offset` (synchronously).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        self.range(offset, data.len())?;
        self.gpu.bind()?;
        // Work queued on the agent's stream may still read or write here.
        self.gpu.synchronize()?;
        // SAFETY: the range was checked against this allocation.
        unsafe { result::memcpy_htod_sync(self.ptr + offset as u64, data) }.map_err(driver("cuMemcpyHtoD"))?;
        // A pageable copy may return before its last transfer lands, on a stream the agent's
        // does not wait for.
        self.gpu.ctx.synchronize().map_err(driver("cuCtxSynchronize"))
    }

    /// Copies `out.len()` bytes from `offset` (synchronously).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), CudaError> {
        self.range(offset, out.len())?;
        self.gpu.bind()?;
        // Copies and kernels queued on the agent's stream come first.
        self.gpu.synchronize()?;
        // SAFETY: the range was checked against this allocation.
        unsafe { result::memcpy_dtoh_sync(out, self.ptr + offset as u64) }.map_err(driver("cuMemcpyDtoH"))
    }

    /// Whether `len` bytes at `offset` lie inside (an error naming them when not).
    pub fn range(&self, offset: usize, len: usize) -> Result<(), CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaError::Invalid(format!(
                "{len} bytes at offset {offset} lie outside the {} bytes of device memory",
                self.len
            ))),
        }
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.gpu.bind().is_err() {
            return;
        }
        // Copies and kernels queued on the agent's stream may still use this memory.
        let _ = self.gpu.synchronize();
        // SAFETY: ptr was allocated, opened or reserved and mapped here, exactly once, and is
        // released once.
        unsafe {
            match &self.kind {
                Kind::Opened => {
                    let _ = sys::cuIpcCloseMemHandle(self.ptr);
                }
                Kind::Allocated => {
                    let _ = result::free_sync(self.ptr);
                }
                Kind::Mapped(sizes) => unmap_and_free(self.ptr, sizes, self.len),
            }
        }
    }
}

/// The allocation holding device address `ptr`: (base, bytes).
pub fn address_range(ptr: u64) -> Result<(u64, usize), CudaError> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: out-pointers; the driver looks the address up.
    check("cuMemGetAddressRange", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
    })?;
    Ok((base, size))
}

/// The device (this process's ordinal) a VMM allocation is on.
fn allocation_device(handle: sys::CUmemGenericAllocationHandle) -> Result<usize, CudaError> {
    // SAFETY: a zeroed CUmemAllocationProp is a valid out-value.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    // SAFETY: out-pointer; `handle` is live.
    check("cuMemGetAllocationPropertiesFromHandle", unsafe {
        sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, handle)
    })?;
    if prop.location.type_ != sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE {
        return Err(CudaError::Invalid(format!(
            "a shared GPU allocation is not device memory (location {:?})",
            prop.location.type_
        )));
    }
    usize::try_from(prop.location.id)
        .map_err(|_| CudaError::Invalid(format!("a shared GPU allocation is on device {}", prop.location.id)))
}

/// The device (this process's ordinal) of the memory at device address `ptr`.
fn pointer_device(ptr: u64) -> Result<usize, CudaError> {
    let mut ordinal: std::ffi::c_int = -1;
    // SAFETY: out-pointer of the attribute's type (an int); the driver looks the address up.
    check("cuPointerGetAttribute(DEVICE_ORDINAL)", unsafe {
        sys::cuPointerGetAttribute(
            (&raw mut ordinal).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    })?;
    usize::try_from(ordinal).map_err(|_| CudaError::Invalid(format!("memory at {ptr:#x} is on device {ordinal}")))
}

/// The other GPUs of this process that can reach `gpu`'s memory as a peer.
fn peers_of(gpu: &Gpu) -> Vec<usize> {
    let Ok(n) = result::device::get_count() else {
        return Vec::new();
    };
    let Ok(own) = result::device::get(gpu.ordinal() as std::ffi::c_int) else {
        return Vec::new();
    };
    (0..n.max(0))
        .filter(|d| *d as usize != gpu.ordinal())
        .filter(|d| {
            let Ok(other) = result::device::get(*d) else {
                return false;
            };
            let mut can: std::ffi::c_int = 0;
            // SAFETY: out-pointer; two devices of this process.
            let asked = unsafe { sys::cuDeviceCanAccessPeer(&mut can, other, own) };
            asked == sys::CUresult::CUDA_SUCCESS && can == 1
        })
        .map(|d| d as usize)
        .collect()
}

/// Unmaps the allocations of `mapped` sizes mapped end to end from `ptr`, one by one, and frees
/// the `reserved` bytes reserved there.
///
/// # Safety
/// Those allocations must be mapped there and `ptr..ptr+reserved` reserved, by this process,
/// and nothing may use them any more.
unsafe fn unmap_and_free(ptr: u64, mapped: &[usize], reserved: usize) {
    let mut at = ptr;
    for size in mapped {
        // SAFETY: as the caller guarantees.
        let _ = unsafe { sys::cuMemUnmap(at, *size) };
        at += *size as u64;
    }
    // SAFETY: as the caller guarantees.
    let _ = unsafe { sys::cuMemAddressFree(ptr, reserved) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipc_handles_round_trip_through_hex_and_bad_hex_is_refused_naming_its_length() {
        let h = IpcHandle(std::array::from_fn(|i| i as u8 * 3));
        assert_eq!(IpcHandle::from_hex(&h.to_hex()).expect("parses"), h);
        let e = IpcHandle::from_hex("abc").expect_err("too short");
        assert!(e.to_string().contains("got 3 characters"), "{e}");
        assert!(IpcHandle::from_hex(&"zz".repeat(64)).is_err());
    }

    #[test]
    fn shared_vmm_sizes_are_checked_before_anything_is_mapped_naming_the_allocation() {
        let g = 2 << 20;
        assert_eq!(check_vmm_sizes(&[g, 3 * g, g], g), Ok(5 * g));
        let refused = |sizes: &[u64]| check_vmm_sizes(sizes, g).expect_err("refused");
        assert!(refused(&[]).contains("0 VMM allocations shared; 1..=8192"));
        assert!(refused(&vec![g; MAX_VMM_CHUNKS + 1]).contains("8193 VMM allocations"));
        let e = refused(&[g, 0]);
        assert!(e.contains("allocation 1 claims 0 bytes"), "{e}");
        let e = refused(&[g, g, g + 4096]);
        assert!(
            e.contains("allocation 2 claims 2101248 bytes") && e.contains("(2097152 bytes)"),
            "{e}"
        );
        let e = refused(&[g, u64::MAX - (u64::MAX % g)]);
        assert!(e.contains("overflow at allocation 1"), "{e}");
        assert!(check_vmm_sizes(&[g], 0).is_err());
    }

    #[test]
    fn gpu_uuids_are_taken_in_either_spelling_and_anything_else_is_refused_naming_it() {
        let canonical = "GPU-5f1c2a3b-0d4e-4f60-8a9b-0c1d2e3f4a5b";
        for spelling in [
            canonical,
            "5f1c2a3b-0d4e-4f60-8a9b-0c1d2e3f4a5b",
            "5F1C2A3B0D4E4F608A9B0C1D2E3F4A5B",
        ] {
            assert_eq!(normalize_uuid(spelling).as_deref(), Ok(canonical), "{spelling}");
        }
        for bad in [
            "",
            "GPU-",
            "GPU-5f1c2a3b",
            "GPU-5f1c2a3b-0d4e-4f60-8a9b-0c1d2e3f4a5z",
            &"a".repeat(40),
        ] {
            let e = normalize_uuid(bad).expect_err(bad);
            assert!(e.contains("is not a GPU UUID"), "{e}");
        }
    }

    #[test]
    fn without_a_driver_listing_gpus_says_so() {
        match devices() {
            Err(CudaError::NoDriver) => assert!(!driver_present()),
            Err(e) => assert!(driver_present(), "{e}"),
            Ok(list) => assert!(
                list.iter()
                    .all(|d| normalize_uuid(&d.uuid).as_deref() == Ok(d.uuid.as_str()))
            ),
        }
    }

    #[test]
    fn without_a_driver_opening_a_gpu_says_so_instead_of_panicking() {
        // On machines without libcuda (CI here) this is the path; with one, a GPU opens or the
        // driver's error is named.
        match Gpu::open(0) {
            Err(CudaError::NoDriver) => assert!(!driver_present()),
            Err(e) => assert!(driver_present(), "{e}"),
            Ok(g) => assert!(!g.name().is_empty()),
        }
    }
}
