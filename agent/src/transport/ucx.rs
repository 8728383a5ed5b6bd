//! A small safe layer over UCX's UCP API (`ucx-sys`): context, worker, endpoint, registered
//! memory, packed and unpacked remote keys. Every handle is released on drop, in dependency order
//! (each holds an `Rc` of what it needs); errors carry UCX's own status text.
//!
//! Threading: workers run in `UCS_THREAD_MODE_SINGLE`, and these types are `!Send`: each agent
//! drives its UCX objects from one thread. Over tcp and shared memory a put is not one-sided in
//! practice: the target's worker must keep progressing while the initiator waits.
#![allow(unsafe_code)]

use std::{
    ffi::{CStr, CString, c_void},
    ptr,
    rc::Rc,
};

use ucx_sys as sys;

/// A UCX call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{op}: {text} (UCX status {status})")]
pub struct UcxError {
    /// The UCX function.
    pub op: &'static str,
    /// UCX's status code.
    pub status: i8,
    /// `ucs_status_string(status)`.
    pub text: String,
}

fn status_text(status: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a pointer to a static, NUL-terminated string for any code.
    unsafe { CStr::from_ptr(sys::ucs_status_string(status)) }
        .to_string_lossy()
        .into_owned()
}

fn check(op: &'static str, status: sys::ucs_status_t) -> Result<(), UcxError> {
    if status == sys::ucs_status_t_UCS_OK {
        Ok(())
    } else {
        Err(UcxError {
            op,
            status,
            text: status_text(status),
        })
    }
}

/// How the agent moves host pools, and so which transports UCX may load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// RDMA where UCX finds an RDMA device (UCX chooses among the network transports it loaded
    /// but tcp; `UCX_TLS` from the environment narrows it), else the agent's tcp stream
    /// (`crate::transport::stream`): the default. Never a transport within the host
    /// ([`INTRA_NODE`]): peer agents are on other nodes (one agent per node serves both engines
    /// of a local pair, through `self`). What carried each peer's bytes is reported per peer.
    Auto,
    /// The agent's tcp stream (`crate::transport::stream`); UCX loads `self` alone (for both
    /// engines behind this agent).
    Tcp,
    /// Shared memory (posix, sysv) on one host only: peer agents on the same host (local runs,
    /// tests).
    Shm,
}

/// UCX's transports that are never loaded but with [`Transport::Shm`] ([`INTRA_NODE`]), or never
/// at all: UCX's tcp takes a put or get at any address of the process from anyone who reaches
/// its port (measured with 1.13 and 1.22; docs/security.md). Peers over tcp use the agent's
/// stream instead.
pub const NEVER: [&str; 1] = ["tcp"];

/// UCX's transports that reach another process on this host through its memory. A peer's
/// address and keys say which memory: a segment's directory and name, a `/proc/<pid>/fd/<fd>`
/// (measured with 1.13: a key naming any descriptor of any process the agent may open made it
/// map that file and WRITE into it), a System V segment id, a process to read, a GPU IPC handle.
/// So they are offered only with [`Transport::Shm`], whose keys are checked to name segments in
/// the pool directory (`transport::ucx_thread`); `sm`, `shm` and `mm` are UCX's names for groups
/// of them.
pub const INTRA_NODE: [&str; 12] = [
    "sm",
    "shm",
    "mm",
    "posix",
    "sysv",
    "cma",
    "knem",
    "xpmem",
    "cuda_ipc",
    "rocm_ipc",
    "ze_ipc",
    "gaudi_ipc",
];

/// The `UCX_TLS` for [`Transport::Auto`], from the environment's (`env`): that list without the
/// [`INTRA_NODE`] transports and tcp ([`NEVER`]), with `self`; or everything else when it is
/// unset, `all`, or a `^` list. `gpu_ipc`: whether this UCX may have GPU IPC transports to
/// exclude (1.13 has none, and warns about each name it does not know in an exclusion; `sm`
/// covers its shared-memory ones). A list left with `self` alone means no RDMA: the agent's
/// stream carries its peers.
pub fn auto_tls(env: Option<&str>, gpu_ipc: bool) -> String {
    let env = env.map(str::trim).unwrap_or("");
    let excluded = if gpu_ipc {
        "sm,tcp,cuda_ipc,rocm_ipc,ze_ipc,gaudi_ipc"
    } else {
        "sm,tcp"
    };
    if env.is_empty() || env == "all" {
        return format!("^{excluded}");
    }
    if let Some(rest) = env.strip_prefix('^') {
        return format!("^{rest},{excluded}");
    }
    let mut kept: Vec<&str> = env
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty() && !INTRA_NODE.contains(t) && !NEVER.contains(t))
        .collect();
    if kept.contains(&"all") {
        return format!("^{excluded}");
    }
    if !kept.contains(&"self") {
        kept.push("self");
    }
    kept.join(",")
}

/// `tls` without `self`, or `None` when nothing else is in it (for asking UCX whether anything
/// but `self` is there).
fn without_self(tls: &str) -> Option<String> {
    match tls.strip_prefix('^') {
        Some(rest) => Some(format!("^{rest},self")),
        None => {
            let rest: Vec<&str> = tls.split(',').filter(|t| *t != "self").collect();
            (!rest.is_empty()).then(|| rest.join(","))
        }
    }
}

/// Whether UCX, restricted as [`Transport::Auto`] restricts it, finds a network device (an RDMA
/// NIC: tcp is never loaded): a context without `self` starts only when it does.
pub fn network_available() -> bool {
    let Some(tls) = without_self(&Transport::Auto.tls()) else {
        return false;
    };
    // Without one, UCX logs `UCX ERROR no usable transports/devices` as the context fails to
    // start: the answer asked for here, not an error (it stood first in every agent's log on a
    // node without RDMA). Left out of UCX's log for this call, on this thread.
    without_no_devices_logged(|| Context::open(tls, None, false).is_ok())
}

thread_local! {
    /// Whether UCX's "no usable transports" error is left out of its log on this thread.
    static NO_DEVICES_QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `ucs_log_func_t` of UCX 1.13 to 1.22 (`ucs/debug/log_def.h`): file, line, function, level,
/// component, the message's format, and its `va_list` (pointer-sized as an argument, unread).
type LogHandler = unsafe extern "C" fn(
    *const libc::c_char,
    libc::c_uint,
    *const libc::c_char,
    libc::c_int,
    *const libc::c_void,
    *const libc::c_char,
    *mut libc::c_void,
) -> libc::c_int;

unsafe extern "C" {
    /// libucs: puts a handler in front of UCX's log handlers (the newest is asked first).
    fn ucs_log_push_handler(handler: LogHandler);
}

/// `UCS_LOG_FUNC_RC_STOP` and `UCS_LOG_FUNC_RC_CONTINUE`.
const LOG_STOP: libc::c_int = 0;
const LOG_CONTINUE: libc::c_int = 1;

/// Drops UCX's "no usable transports" message where [`NO_DEVICES_QUIET`] is set on the
/// logging thread; every other message goes on to UCX's own handlers.
unsafe extern "C" fn drop_no_devices(
    _file: *const libc::c_char,
    _line: libc::c_uint,
    _function: *const libc::c_char,
    _level: libc::c_int,
    _component: *const libc::c_void,
    format: *const libc::c_char,
    _args: *mut libc::c_void,
) -> libc::c_int {
    if !NO_DEVICES_QUIET.with(std::cell::Cell::get) || format.is_null() {
        return LOG_CONTINUE;
    }
    // SAFETY: UCX passes its message's NUL-terminated format string.
    let format = unsafe { CStr::from_ptr(format) }.to_bytes();
    if format.starts_with(b"no usable transports") {
        LOG_STOP
    } else {
        LOG_CONTINUE
    }
}

/// Puts the agent's filter in front of UCX's log handlers, once for the process: it passes
/// everything on but the one message [`without_no_devices_logged`] asks it to drop. UCX adds a
/// handler without a lock, so the agent does this before its first UCX context.
pub fn filter_log() {
    static PUSHED: std::sync::Once = std::sync::Once::new();
    // SAFETY: a handler of UCX's type, which lives for the process.
    PUSHED.call_once(|| unsafe { ucs_log_push_handler(drop_no_devices) });
}

/// Runs `f` with UCX's "no usable transports" error left out of its log on this thread.
fn without_no_devices_logged<T>(f: impl FnOnce() -> T) -> T {
    struct Quiet;
    impl Drop for Quiet {
        fn drop(&mut self) {
            NO_DEVICES_QUIET.with(|q| q.set(false));
        }
    }
    filter_log();
    NO_DEVICES_QUIET.with(|q| q.set(true));
    let _quiet = Quiet;
    f()
}

impl Transport {
    /// The `UCX_TLS` this restriction sets.
    fn tls(self) -> String {
        // `self` lets an endpoint reach its own worker.
        match self {
            Transport::Auto => auto_tls(
                std::env::var("UCX_TLS").ok().as_deref(),
                !version().starts_with("1.13."),
            ),
            Transport::Tcp => "self".into(),
            Transport::Shm => "posix,sysv,self".into(),
        }
    }

    /// The `--transport` value that selects this.
    pub fn as_arg(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
        }
    }

    /// Whether UCX's shared-memory transports may load (they limit the pool directory's length).
    fn may_use_shm(self) -> bool {
        matches!(self, Transport::Shm)
    }
}

impl std::str::FromStr for Transport {
    type Err = String;

    fn from_str(s: &str) -> Result<Transport, String> {
        match s {
            "auto" => Ok(Transport::Auto),
            "tcp" => Ok(Transport::Tcp),
            "shm" => Ok(Transport::Shm),
            _ => Err(format!("transport {s:?}: expected auto, tcp or shm")),
        }
    }
}

/// The version of the UCX library loaded (not the one built against).
pub fn version() -> String {
    // SAFETY: returns a pointer to a static NUL-terminated string.
    unsafe { CStr::from_ptr(sys::ucp_get_version_string()) }
        .to_string_lossy()
        .into_owned()
}

/// A kind of memory UCX may register (`ucs_memory_type_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryType {
    /// Host memory.
    Host,
    /// CUDA device memory.
    Cuda,
    /// CUDA managed memory.
    CudaManaged,
    /// ROCm device memory.
    Rocm,
    /// ROCm managed memory.
    RocmManaged,
}

impl MemoryType {
    /// Every type, in UCX's order.
    pub const ALL: [MemoryType; 5] = [
        MemoryType::Host,
        MemoryType::Cuda,
        MemoryType::CudaManaged,
        MemoryType::Rocm,
        MemoryType::RocmManaged,
    ];

    fn ucs(self) -> sys::ucs_memory_type_t {
        match self {
            MemoryType::Host => sys::ucs_memory_type_UCS_MEMORY_TYPE_HOST,
            MemoryType::Cuda => sys::ucs_memory_type_UCS_MEMORY_TYPE_CUDA,
            MemoryType::CudaManaged => sys::ucs_memory_type_UCS_MEMORY_TYPE_CUDA_MANAGED,
            MemoryType::Rocm => sys::ucs_memory_type_UCS_MEMORY_TYPE_ROCM,
            MemoryType::RocmManaged => sys::ucs_memory_type_UCS_MEMORY_TYPE_ROCM_MANAGED,
        }
    }

    /// The name in the engine API and in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryType::Host => "host",
            MemoryType::Cuda => "cuda",
            MemoryType::CudaManaged => "cuda-managed",
            MemoryType::Rocm => "rocm",
            MemoryType::RocmManaged => "rocm-managed",
        }
    }
}

struct ContextInner {
    handle: sys::ucp_context_h,
    /// Whether it may use shared memory, where peers' software puts and gets of the host memory
    /// it registers are carried out ([`software_rma`]).
    shared_memory: bool,
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: the context was created by ucp_init_version and every dependent handle (which
        // holds an Rc of this) has been dropped.
        unsafe { sys::ucp_cleanup(self.handle) }
    }
}

/// Settings that keep UCX out of the process's own memory management. UCX hooks `mmap` and
/// `munmap` and, where a cache subscribes, takes that cache's lock in every call: its memory-type
/// cache (active wherever a GPU memory module loads, as UCX 1.22's cuda module does) and its
/// registration cache. With the thousands of threads an agent may run (three per link), the
/// stacks those threads map and unmap queued on those locks: a decode engine holding 1024
/// prefill links (within its bound) took its agent over 15 minutes instead of 3 s (measured with
/// UCX 1.22). The agent needs neither cache: it maps every region it moves once, saying its
/// memory type (`ucp_mem_map`), and names that mapping in every put and get.
const QUIET_MEMORY_HOOKS: [(&str, &str); 2] = [("MEMTYPE_CACHE", "n"), ("RCACHE_ENABLE", "n")];

/// A UCP configuration: the environment's, with the agent's settings over it.
struct Config(*mut sys::ucp_config_t);

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_config_read and is released once.
        unsafe { sys::ucp_config_release(self.0) };
    }
}

impl Config {
    /// The settings of a context on `tls` with its pool in `pool_dir` (see [`Context::new`]).
    fn read(tls: String, pool_dir: Option<&std::path::Path>) -> Result<Config, UcxError> {
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: out-pointer to a config handle; null prefix and file mean defaults plus env.
        check("ucp_config_read", unsafe {
            sys::ucp_config_read(ptr::null(), ptr::null(), &mut config)
        })?;
        let config = Config(config);
        let mut settings: Vec<(&str, String)> = vec![("TLS", tls)];
        settings.extend(QUIET_MEMORY_HOOKS.iter().map(|(n, v)| (*n, (*v).to_owned())));
        if let Some(dir) = pool_dir {
            settings.extend([
                ("ALLOC_PRIO", "md:posix".to_owned()),
                ("DIR", dir.to_string_lossy().into_owned()),
                // Keep the file's name while it is allocated (not an unlinked file reached
                // through /proc/<pid>/fd), so the agent can open it and hand the engine its
                // descriptor (engines never see the directory). UCX derives a segment's path
                // from its own setting, so every context on a host needs the same dir.
                ("USE_PROC_LINK", "n".to_owned()),
            ]);
        }
        let modify = |name: &str, value: &str| match (CString::new(name), CString::new(value)) {
            // SAFETY: config is valid; both strings are NUL-terminated.
            (Ok(n), Ok(v)) => check("ucp_config_modify", unsafe {
                sys::ucp_config_modify(config.0, n.as_ptr(), v.as_ptr())
            }),
            _ => check("ucp_config_modify", sys::ucs_status_t_UCS_ERR_INVALID_PARAM),
        };
        for (name, value) in settings {
            // UCX 1.13 takes a transport's setting by its bare name ("DIR") and ignores the
            // prefixed one; later UCX refuses a bare name several components have ("DIR" is also
            // PROTO_INFO_DIR in 1.22) and takes the POSIX_ one.
            let modified = modify(name, &value).or_else(|e| match name {
                "DIR" | "USE_PROC_LINK" => modify(&format!("POSIX_{name}"), &value),
                _ => Err(e),
            });
            modified.map_err(|e| UcxError {
                text: format!("{} ({name})", e.text),
                ..e
            })?;
        }
        Ok(config)
    }
}

/// A UCP context with RMA.
#[derive(Clone)]
pub struct Context(Rc<ContextInner>);

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ucx::Context")
    }
}

/// The longest pool directory UCX 1.13 can use: its shared-memory transport packs the directory
/// into the worker address behind a 6-bit length (with 9 more bytes), and a longer one aborts the
/// process in `ucp_worker_get_address` (measured: 54 bytes work, 55 abort).
pub const MAX_POOL_DIR: usize = 54;

impl Context {
    /// A context limited to `transport`. With `pool_dir`, memory this context allocates
    /// ([`Context::allocate`]) comes from UCX's POSIX shared-memory allocator as a named file in
    /// that directory, which the agent opens to hand its engine a descriptor.
    pub fn new(transport: Transport, pool_dir: Option<&std::path::Path>) -> Result<Context, UcxError> {
        if let Some(dir) = pool_dir.filter(|d| transport.may_use_shm() && d.as_os_str().len() > MAX_POOL_DIR) {
            return Err(UcxError {
                op: "ucp_config_modify",
                status: sys::ucs_status_t_UCS_ERR_INVALID_PARAM,
                text: format!(
                    "the pool directory {} is {} bytes long; UCX's shared-memory transport takes at most {MAX_POOL_DIR}",
                    dir.display(),
                    dir.as_os_str().len()
                ),
            });
        }
        Context::open(transport.tls(), pool_dir, transport.may_use_shm())
    }

    /// A context on the transports `tls` (`UCX_TLS`'s syntax), `shared_memory` among them.
    fn open(tls: String, pool_dir: Option<&std::path::Path>, shared_memory: bool) -> Result<Context, UcxError> {
        software_rma::turn_off().map_err(|text| UcxError {
            op: "ucp_init",
            status: sys::ucs_status_t_UCS_ERR_UNSUPPORTED,
            text,
        })?;
        let config = Config::read(tls, pool_dir)?;
        // SAFETY: zeroed params are valid; only the fields named in field_mask are read.
        let mut params: sys::ucp_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(sys::ucp_params_field_UCP_PARAM_FIELD_FEATURES);
        params.features = u64::from(sys::ucp_feature_UCP_FEATURE_RMA);
        let mut context: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: params and config are valid for the call; context is an out-pointer.
        let status =
            unsafe { sys::ucp_init_version(sys::UCP_API_MAJOR, sys::UCP_API_MINOR, &params, config.0, &mut context) };
        drop(config);
        check("ucp_init", status)?;
        if shared_memory {
            software_rma::shared_memory_context();
        }
        Ok(Context(Rc::new(ContextInner {
            handle: context,
            shared_memory,
        })))
    }

    /// The memory types this context can register and move (`ucp_context_query`): host memory
    /// always; GPU memory only where the loaded UCX has that GPU's module (Debian's 1.13 has
    /// none). Unknown bits are left out.
    pub fn memory_types(&self) -> Vec<MemoryType> {
        // SAFETY: zeroed attrs are valid; only masked fields are written.
        let mut attr: sys::ucp_context_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = u64::from(sys::ucp_context_attr_field_UCP_ATTR_FIELD_MEMORY_TYPES);
        // SAFETY: a live context; attr is an out-pointer.
        if check("ucp_context_query", unsafe {
            sys::ucp_context_query(self.0.handle, &mut attr)
        })
        .is_err()
        {
            return vec![MemoryType::Host];
        }
        MemoryType::ALL
            .into_iter()
            .filter(|t| attr.memory_types & (1u64 << t.ucs()) != 0)
            .collect()
    }

    /// Registers `len` bytes at `addr` for remote access.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid (mapped, not freed) until the returned region is dropped,
    /// and remote peers may write it at any time while it is registered.
    pub unsafe fn map(&self, addr: *mut u8, len: usize) -> Result<MemRegion, UcxError> {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.map_typed(addr, len, MemoryType::Host) }
    }

    /// Registers `len` bytes of `memory` at `addr`. GPU memory is refused, naming the type and
    /// the UCX, when this context cannot move it: UCX without the GPU's module would register
    /// device addresses as host memory, and a put would then read them with the CPU.
    ///
    /// # Safety
    /// As [`Context::map`]; `memory` must be what `addr` is.
    pub unsafe fn map_typed(&self, addr: *mut u8, len: usize, memory: MemoryType) -> Result<MemRegion, UcxError> {
        if memory != MemoryType::Host && !self.memory_types().contains(&memory) {
            return Err(UcxError {
                op: "ucp_mem_map",
                status: sys::ucs_status_t_UCS_ERR_UNSUPPORTED,
                text: format!(
                    "UCX {} cannot move {} memory (its memory types: {}); register a host pool, or run a UCX built with that GPU's module",
                    version(),
                    memory.as_str(),
                    self.memory_types()
                        .iter()
                        .map(|t| t.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
        // SAFETY: zeroed params are valid; only masked fields are read.
        let mut params: sys::ucp_mem_map_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(
            sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
        );
        params.address = addr.cast();
        params.length = len;
        params.memory_type = memory.ucs();
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: the caller guarantees the range; memh is an out-pointer.
        check("ucp_mem_map", unsafe {
            sys::ucp_mem_map(self.0.handle, &params, &mut memh)
        })?;
        Ok(MemRegion::admitted(
            MemRegion {
                context: self.clone(),
                memh,
                addr: addr as u64,
                len,
                admitted: false,
            },
            memory == MemoryType::Host,
        ))
    }
}

impl Context {
    /// Allocates `len` bytes through UCX (`UCP_MEM_MAP_ALLOCATE`) and registers them. Over shared
    /// memory UCX takes them from its own shared segments, which a peer on the host maps and
    /// writes directly (one copy), where registered user memory gets emulated puts (two copies and
    /// the target's progress). The memory is zeroed by the kernel and freed on drop.
    pub fn allocate(&self, len: usize) -> Result<MemRegion, UcxError> {
        // SAFETY: zeroed params are valid; only masked fields are read.
        let mut params: sys::ucp_mem_map_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(
            sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_FLAGS,
        );
        params.address = ptr::null_mut();
        params.length = len;
        params.flags = sys::UCP_MEM_MAP_ALLOCATE;
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: UCX allocates; memh is an out-pointer.
        check("ucp_mem_map(ALLOCATE)", unsafe {
            sys::ucp_mem_map(self.0.handle, &params, &mut memh)
        })?;
        // SAFETY: zeroed attrs are valid; only masked fields are written.
        let mut attr: sys::ucp_mem_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = u64::from(
            sys::ucp_mem_attr_field_UCP_MEM_ATTR_FIELD_ADDRESS | sys::ucp_mem_attr_field_UCP_MEM_ATTR_FIELD_LENGTH,
        );
        let mut region = MemRegion {
            context: self.clone(),
            memh,
            addr: 0,
            len: 0,
            admitted: false,
        };
        // SAFETY: memh is valid (owned by `region`, which unmaps it on every path).
        check("ucp_mem_query", unsafe { sys::ucp_mem_query(memh, &mut attr) })?;
        region.addr = attr.address as u64;
        region.len = attr.length;
        // Admitted: UCX 1.22's shared-memory transports have no get, so a peer's get of UCX's
        // own segment (pull) is a software one too (measured: every pull over shm stalled
        // without it).
        Ok(MemRegion::admitted(region, true))
    }
}

/// Registered memory. Unregistered on drop.
pub struct MemRegion {
    context: Context,
    memh: sys::ucp_mem_h,
    addr: u64,
    len: usize,
    /// Whether peers' software puts and gets may reach it ([`software_rma::admit`]).
    admitted: bool,
}

impl std::fmt::Debug for MemRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemRegion")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .finish()
    }
}

impl MemRegion {
    /// `region`, admitted to peers' software puts and gets where it is `host` memory of a
    /// shared-memory context.
    fn admitted(mut region: MemRegion, host: bool) -> MemRegion {
        if host && region.context.0.shared_memory {
            software_rma::admit(region.addr, region.len as u64);
            region.admitted = true;
        }
        region
    }

    /// The region's address, as peers address it.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The packed remote key a peer needs to write this region.
    pub fn packed_rkey(&self) -> Result<Vec<u8>, UcxError> {
        let mut buf: *mut c_void = ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: context and memh are valid; buf and size are out-pointers.
        check("ucp_rkey_pack", unsafe {
            sys::ucp_rkey_pack(self.context.0.handle, self.memh, &mut buf, &mut size)
        })?;
        // SAFETY: UCX returned `size` readable bytes at `buf`, released right after copying.
        let bytes = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) }.to_vec();
        // SAFETY: buf came from ucp_rkey_pack.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(bytes)
    }
}

impl MemRegion {
    /// Ends its admission to peers' software puts and gets now (the first call; [`Drop`] makes
    /// it otherwise). True when a peer's software get was let through to it since: UCX may
    /// still be reading that get's answer from it at any later time (see
    /// [`software_rma::withdraw`]), so its addresses must stay mapped.
    pub fn withdraw(&mut self) -> bool {
        std::mem::take(&mut self.admitted) && software_rma::withdraw(self.addr, self.len as u64)
    }
}

impl Drop for MemRegion {
    fn drop(&mut self) {
        self.withdraw();
        // SAFETY: memh was mapped in this context, which is still alive (we hold an Rc).
        let _ = unsafe { sys::ucp_mem_unmap(self.context.0.handle, self.memh) };
    }
}

struct WorkerInner {
    handle: sys::ucp_worker_h,
    _context: Context,
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        // SAFETY: every endpoint (which holds an Rc of this) has been closed.
        unsafe { sys::ucp_worker_destroy(self.handle) }
    }
}

/// A UCP worker (single-threaded).
#[derive(Clone)]
pub struct Worker(Rc<WorkerInner>);

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ucx::Worker")
    }
}

impl Worker {
    /// A worker on `context`.
    pub fn new(context: &Context) -> Result<Worker, UcxError> {
        // SAFETY: zeroed params are valid; only masked fields are read.
        let mut params: sys::ucp_worker_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(sys::ucp_worker_params_field_UCP_WORKER_PARAM_FIELD_THREAD_MODE);
        params.thread_mode = sys::ucs_thread_mode_t_UCS_THREAD_MODE_SINGLE;
        let mut handle: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: context is valid; handle is an out-pointer.
        check("ucp_worker_create", unsafe {
            sys::ucp_worker_create(context.0.handle, &params, &mut handle)
        })?;
        Ok(Worker(Rc::new(WorkerInner {
            handle,
            _context: context.clone(),
        })))
    }

    /// The worker's address, for peers to connect to.
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: worker is valid; out-pointers.
        check("ucp_worker_get_address", unsafe {
            sys::ucp_worker_get_address(self.0.handle, &mut addr, &mut len)
        })?;
        // SAFETY: UCX returned `len` readable bytes; released right after copying.
        let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) }.to_vec();
        // SAFETY: addr came from ucp_worker_get_address on this worker.
        unsafe { sys::ucp_worker_release_address(self.0.handle, addr) };
        Ok(bytes)
    }

    /// Progresses communication once; returns whether anything happened.
    pub fn progress(&self) -> bool {
        // SAFETY: the worker is valid and used from one thread.
        unsafe { sys::ucp_worker_progress(self.0.handle) != 0 }
    }

    /// Connects to a peer's worker address. Error mode NONE: UCX 1.13's PEER mode disables
    /// shared-memory transports, so dead peers are detected on the side channel instead.
    pub fn connect(&self, remote: &[u8]) -> Result<Endpoint, UcxError> {
        // SAFETY: zeroed params are valid; only masked fields are read.
        let mut params: sys::ucp_ep_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(
            sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        );
        params.address = remote.as_ptr().cast();
        params.err_mode = sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_NONE;
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: the address bytes outlive the call (UCX copies what it needs).
        check("ucp_ep_create", unsafe {
            sys::ucp_ep_create(self.0.handle, &params, &mut ep)
        })?;
        Ok(Endpoint {
            handle: ep,
            closed: false,
            worker: self.clone(),
        })
    }

    /// Waits for a request (or an immediate status) to finish, progressing this worker and
    /// calling `also` each round (to progress a peer in the same thread, or a side channel).
    fn wait(&self, op: &'static str, req: sys::ucs_status_ptr_t, mut also: impl FnMut()) -> Result<(), UcxError> {
        if req.is_null() {
            return Ok(());
        }
        if sys::ucs_ptr_is_err(req) {
            return check(op, sys::ucs_ptr_status(req));
        }
        let mut quiet = 0u32;
        loop {
            // Yield only after a run of empty polls (see ucx_thread): a yield is a system call.
            if self.progress() {
                quiet = 0;
            } else {
                quiet = quiet.saturating_add(1);
                if quiet >= crate::transport::ucx_thread::QUIET_POLLS_BEFORE_YIELD {
                    std::thread::yield_now();
                }
            }
            also();
            // SAFETY: req is a live request handle from this worker.
            let status = unsafe { sys::ucp_request_check_status(req) };
            if status != sys::ucs_status_t_UCS_INPROGRESS {
                // SAFETY: the request completed; we own it.
                unsafe { sys::ucp_request_free(req) };
                return check(op, status);
            }
        }
    }
}

/// A connection to a peer worker. Closed (flushed) on drop.
pub struct Endpoint {
    handle: sys::ucp_ep_h,
    closed: bool,
    worker: Worker,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ucx::Endpoint")
    }
}

/// A peer's memory key, unpacked on an endpoint.
pub struct RemoteKey {
    handle: sys::ucp_rkey_h,
}

impl std::fmt::Debug for RemoteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ucx::RemoteKey")
    }
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: rkey came from ucp_ep_rkey_unpack.
        unsafe { sys::ucp_rkey_destroy(self.handle) }
    }
}

impl RemoteKey {
    /// Where the peer's `remote_addr` appears in this process, when UCX mapped the peer's memory
    /// here (shared memory it allocated: puts are then plain copies); `None` otherwise.
    pub fn local_ptr(&self, remote_addr: u64) -> Option<u64> {
        let mut local: *mut c_void = ptr::null_mut();
        // SAFETY: a live rkey; `local` is an out-pointer.
        let status = unsafe { sys::ucp_rkey_ptr(self.handle, remote_addr, &mut local) };
        (status == sys::ucs_status_t_UCS_OK && !local.is_null()).then_some(local as u64)
    }
}

impl Endpoint {
    /// UCX's description of this endpoint (`ucp_ep_print_info`): its lanes, the transport and
    /// device of each, and what each carries. Empty when it cannot be captured.
    pub fn print_info(&self) -> String {
        let mut buf: *mut std::ffi::c_char = ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: out-pointers; the stream is closed below, after which buf holds size bytes.
        let stream = unsafe { libc::open_memstream(&mut buf, &mut size) };
        if stream.is_null() {
            return String::new();
        }
        // SAFETY: a live endpoint and an open stream (libc's FILE is the one UCX writes to).
        unsafe { sys::ucp_ep_print_info(self.handle, stream.cast()) };
        // SAFETY: the stream came from open_memstream and is closed once.
        unsafe { libc::fclose(stream) };
        if buf.is_null() {
            return String::new();
        }
        // SAFETY: after fclose, buf holds size bytes and a NUL; it was malloc'd by libc.
        let text = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) };
        let text = String::from_utf8_lossy(text).into_owned();
        // SAFETY: as above; freed once.
        unsafe { libc::free(buf.cast()) };
        text
    }

    /// Unpacks a peer's packed remote key for this endpoint.
    pub fn unpack_rkey(&self, packed: &[u8]) -> Result<RemoteKey, UcxError> {
        let mut handle: sys::ucp_rkey_h = ptr::null_mut();
        // SAFETY: packed bytes are readable for the call; handle is an out-pointer.
        check("ucp_ep_rkey_unpack", unsafe {
            sys::ucp_ep_rkey_unpack(self.handle, packed.as_ptr().cast(), &mut handle)
        })?;
        Ok(RemoteKey { handle })
    }

    /// Posts an RDMA WRITE of `local` to `remote_addr` in the peer's registered memory, and
    /// returns a request to wait on (or `None` when UCX completed it at once).
    ///
    /// # Safety
    /// `local` must stay valid until the put completes (see [`Endpoint::flush`]), and
    /// `remote_addr..+local.len()` must lie inside the region `rkey` covers.
    /// `registered`, when given, is the local region holding `local`: UCX then uses that
    /// registration instead of registering the buffer again.
    pub unsafe fn put(
        &self,
        local: &[u8],
        remote_addr: u64,
        rkey: &RemoteKey,
        registered: Option<&MemRegion>,
    ) -> Result<Option<Request>, UcxError> {
        let params = rma_params(registered);
        // SAFETY: the caller guarantees the buffer and range.
        let req = unsafe {
            sys::ucp_put_nbx(
                self.handle,
                local.as_ptr().cast(),
                local.len(),
                remote_addr,
                rkey.handle,
                &params,
            )
        };
        posted("ucp_put_nbx", req)
    }

    /// Posts an RDMA READ of `len` bytes from the peer's `remote_addr` into `local`, and returns a
    /// request to wait on (or `None` when UCX completed it at once). A completed get has its data
    /// in `local`.
    ///
    /// # Safety
    /// `local..local+len` must be writable and stay valid until the get completes, and the remote
    /// range must lie inside the region `rkey` covers.
    pub unsafe fn get(
        &self,
        local: *mut u8,
        len: usize,
        remote_addr: u64,
        rkey: &RemoteKey,
        registered: Option<&MemRegion>,
    ) -> Result<Option<Request>, UcxError> {
        let params = rma_params(registered);
        // SAFETY: the caller guarantees the buffer and range.
        let req = unsafe { sys::ucp_get_nbx(self.handle, local.cast(), len, remote_addr, rkey.handle, &params) };
        posted("ucp_get_nbx", req)
    }

    /// Posts a flush of every operation posted on this endpoint (remote completion), without
    /// waiting: `None` when it completed at once.
    pub fn flush_nb(&self) -> Result<Option<Request>, UcxError> {
        // SAFETY: zeroed request params with an empty attribute mask are valid.
        let params: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        // SAFETY: the endpoint is valid.
        let req = unsafe { sys::ucp_ep_flush_nbx(self.handle, &params) };
        posted("ucp_ep_flush_nbx", req)
    }

    /// Waits for a posted put or get.
    pub fn wait(&self, req: Request, also: impl FnMut()) -> Result<(), UcxError> {
        let raw = req.0;
        std::mem::forget(req);
        self.worker.wait("ucp_put_nbx/ucp_get_nbx", raw, also)
    }

    /// Completes every operation posted on this endpoint (remote completion), progressing this
    /// worker and calling `also` each round.
    pub fn flush(&self, also: impl FnMut()) -> Result<(), UcxError> {
        // SAFETY: zeroed request params with an empty attribute mask are valid.
        let params: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        // SAFETY: the endpoint is valid.
        let req = unsafe { sys::ucp_ep_flush_nbx(self.handle, &params) };
        self.worker.wait("ucp_ep_flush_nbx", req, also)
    }

    /// Closes the endpoint, progressing `also` meanwhile (the peer may need to progress).
    pub fn close(mut self, also: impl FnMut()) -> Result<(), UcxError> {
        self.closed = true;
        self.close_inner(also)
    }

    fn close_inner(&self, also: impl FnMut()) -> Result<(), UcxError> {
        // SAFETY: zeroed request params; flags 0 = flush before closing.
        let params: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        // SAFETY: the endpoint is valid and closed exactly once.
        let req = unsafe { sys::ucp_ep_close_nbx(self.handle, &params) };
        self.worker.wait("ucp_ep_close_nbx", req, also)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        // Force-close: a graceful close needs the peer to progress, which drop cannot arrange.
        // SAFETY: zeroed params with the FORCE flag; the endpoint is closed exactly once.
        let mut params: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        params.op_attr_mask = sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
        params.flags = sys::ucp_ep_close_flags_t_UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: as above.
        let req = unsafe { sys::ucp_ep_close_nbx(self.handle, &params) };
        let _ = self.worker.wait("ucp_ep_close_nbx", req, || {});
    }
}

/// Request parameters for a put or get, reusing the local buffer's registration when given.
fn rma_params(registered: Option<&MemRegion>) -> sys::ucp_request_param_t {
    // SAFETY: zeroed request params are valid; only the flagged attributes are read.
    let mut params: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
    if let Some(region) = registered {
        params.op_attr_mask = sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_MEMH;
        params.memh = region.memh;
    }
    params
}

/// What a `*_nbx` call returned: done at once (`None`), an error, or a request to wait on.
fn posted(op: &'static str, req: sys::ucs_status_ptr_t) -> Result<Option<Request>, UcxError> {
    if req.is_null() {
        Ok(None)
    } else if sys::ucs_ptr_is_err(req) {
        check(op, sys::ucs_ptr_status(req)).map(|()| None)
    } else {
        Ok(Some(Request(req)))
    }
}

/// An in-flight UCX request. Must be waited on with [`Endpoint::wait`].
#[derive(Debug)]
pub struct Request(sys::ucs_status_ptr_t);

impl Request {
    /// Whether the request finished: `None` while in progress, else its outcome (the request
    /// is freed when dropped).
    pub fn poll(&self) -> Option<Result<(), UcxError>> {
        // SAFETY: a live request handle we own.
        let status = unsafe { sys::ucp_request_check_status(self.0) };
        (status != sys::ucs_status_t_UCS_INPROGRESS).then(|| check("ucp request", status))
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // A request dropped unwaited is released to UCX, which completes it on its own.
        // SAFETY: the handle is a live request we own.
        unsafe { sys::ucp_request_free(self.0) }
    }
}

pub mod software_rma;

#[cfg(test)]
mod tests;
