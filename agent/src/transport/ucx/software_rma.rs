//! UCX's software RMA, turned off before any worker exists.
//!
//! Where a put or get cannot go over a transport's own RMA (a remote key naming no memory
//! domain the endpoint reaches, a peer without RDMA lanes, a modified UCX), UCX sends it as an
//! active message and the target's UCX carries it out (`ucp_put_handler`, `ucp_get_req_handler`
//! in `rma_sw.c`, the atomics in `amo_sw.c`) at the address the sender names, checked against
//! nothing the target registered. Any peer that can reach the agent's worker (an insider of a
//! pair: the handshake gives it the address) wrote and read anywhere in the agent's process:
//! other pairs' pools, its keys (measured with UCX 1.13 and 1.22 over shared memory: a put with
//! an empty key landed in memory never registered). Their completions (`GET_REP`, `CMPL`,
//! `ATOMIC_REP`) take the sender's word for which request or endpoint they complete.
//!
//! No pdpair agent sends them: its RMA goes over lanes that reach the peer's registered memory
//! (shared memory, RDMA), or over the agent's own KV stream. So before its first context the
//! agent points every one of those handlers at [`dropped`], which counts the message and takes
//! nothing from it. UCX registers its handlers when a worker opens its interfaces, from the
//! `ucp_am_handler_UCP_AM_ID_*` structures it exports; their layout is checked before anything
//! is written (the same in UCX 1.13 and 1.22, `src/ucp/core/ucp_context.h`), and a UCX whose
//! structures are missing or laid out otherwise is refused, naming them.
#![allow(unsafe_code)]

use std::{
    ffi::{CString, c_uint, c_void},
    sync::{
        OnceLock,
        atomic::{AtomicU64, Ordering},
    },
};

use ucx_sys as sys;

/// The active messages of UCX's software RMA and atomics (`UCP_AM_ID_*`).
const HANDLERS: [&str; 6] = ["PUT", "GET_REQ", "GET_REP", "CMPL", "ATOMIC_REQ", "ATOMIC_REP"];

/// How many entries of UCX's table of handlers (`ucp_am_handlers`, `UCP_AM_ID_LAST` of them:
/// under 40 in 1.13 and 1.22) are searched for each structure.
const TABLE: usize = 64;

/// `uct_am_callback_t`.
type Callback = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_uint) -> sys::ucs_status_t;

/// `ucp_am_handler_t` of UCX 1.13 to 1.22.
#[repr(C)]
struct Handler {
    features: u64,
    cb: Option<Callback>,
    tracer: *const c_void,
    flags: u32,
    proxy_cb: Option<Callback>,
}

static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Software RMA messages peers sent this process, dropped.
pub fn dropped_so_far() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Takes the place of UCX's software put, get, atomic and completion handlers: the message is
/// consumed (UCX frees it) and nothing else happens.
unsafe extern "C" fn dropped(_: *mut c_void, _: *mut c_void, length: usize, _: c_uint) -> sys::ucs_status_t {
    if DROPPED.fetch_add(1, Ordering::Relaxed) == 0 {
        tracing::warn!(
            length,
            "a UCX peer sent a software put, get or atomic (which names any address in this process); dropped: \
             pdpair agents never send them (pdpair_agent_ucx_software_rma_dropped_total counts them)"
        );
    }
    sys::ucs_status_t_UCS_OK
}

/// Points UCX's software RMA handlers at [`dropped`], once per process, before any worker opens
/// (every context is made after it). An error names what this UCX lacks.
pub fn turn_off() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        // SAFETY: symbols of the loaded libucp, checked below before any is written.
        unsafe { replace_handlers() }
    })
    .clone()
}

/// The address of `name` in the process (libucp is loaded by then: the agent links it).
fn symbol(name: &str) -> Option<*mut c_void> {
    let c = CString::new(name).ok()?;
    // SAFETY: a NUL-terminated name; RTLD_DEFAULT searches the loaded objects.
    let at = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c.as_ptr()) };
    (!at.is_null()).then_some(at)
}

/// # Safety
/// Called once, before any UCX worker exists (UCX reads the handlers as a worker opens).
unsafe fn replace_handlers() -> Result<(), String> {
    let refuse = |what: String| {
        Err(format!(
            "UCX {} cannot have its software RMA turned off ({what}); with it any peer reaching this agent's UCX \
             worker writes and reads anywhere in the agent: use UCX 1.13 to 1.22",
            super::version()
        ))
    };
    let Some(table) = symbol("ucp_am_handlers") else {
        return refuse("it exports no ucp_am_handlers".into());
    };
    // SAFETY: `ucp_am_handlers` is an array of UCP_AM_ID_LAST pointers in libucp's data, followed
    // by more of its data: reading TABLE words of it reads mapped memory.
    let table: Vec<*mut Handler> = (0..TABLE)
        .map(|i| unsafe { table.cast::<*mut Handler>().add(i).read() })
        .collect();
    let known = u64::from(
        sys::ucp_feature_UCP_FEATURE_RMA | sys::ucp_feature_UCP_FEATURE_AMO32 | sys::ucp_feature_UCP_FEATURE_AMO64,
    );
    let mut found = Vec::with_capacity(HANDLERS.len());
    for id in HANDLERS {
        let name = format!("ucp_am_handler_UCP_AM_ID_{id}");
        let Some(at) = symbol(&name) else {
            return refuse(format!("it exports no {name}"));
        };
        let handler = at.cast::<Handler>();
        if !table.contains(&handler) {
            return refuse(format!("{name} is not in its ucp_am_handlers"));
        }
        // SAFETY: the structure libucp defines under that name; read in place.
        let (features, cb) = unsafe { ((*handler).features, (*handler).cb) };
        if features == 0 || features & !known != 0 || cb.is_none() {
            return refuse(format!(
                "{name} is not laid out as in UCX 1.13 to 1.22: features {features:#x}"
            ));
        }
        found.push(handler);
    }
    for handler in found {
        // SAFETY: checked above; no worker exists yet, so nothing reads them now.
        unsafe {
            (*handler).cb = Some(dropped);
            (*handler).proxy_cb = Some(dropped);
        }
    }
    Ok(())
}
