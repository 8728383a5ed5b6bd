//! UCX's software RMA, held to registered shared memory.
//!
//! Where a put or get cannot go over a transport's own RMA (a remote key naming no memory
//! domain the endpoint reaches, a peer without RDMA lanes, a modified UCX), UCX sends it as an
//! active message and the target's UCX carries it out (`ucp_put_handler`, `ucp_get_req_handler`
//! in `rma_sw.c`, the atomics in `amo_sw.c`) at the address the sender names, checked against
//! nothing the target registered. Any peer that can reach the agent's worker (an insider of a
//! pair: the handshake gives it the address) wrote and read anywhere in the agent's process:
//! other pairs' pools, its keys (measured with UCX 1.13 and 1.22 over shared memory: a put with
//! an empty key landed in memory never registered, and a get read it).
//!
//! The agent needs them over shared memory (`--transport shm`) only: an engine's own memfd
//! registered as its pool is no segment UCX allocated, so a peer agent's puts and gets of it go
//! this way, and UCX 1.22's shared-memory transports have no get, so a peer's get of UCX's own
//! segment does too. Nowhere else (RDMA registers any memory; the tcp stream is the agent's own;
//! two engines behind one agent meet over `self`). A get's answer may be read from a region
//! after it was released: `ucx_thread` keeps such a region's addresses, as zeros. So before its first context the agent puts
//! a check in front of UCX's handlers: a software put or get is carried out only where its
//! whole range lies inside host memory a shared-memory context registered ([`admit`]), and their
//! completions (`GET_REP`, `CMPL`) only once a shared-memory context exists; every other
//! handler UCX registers for an RMA context but `WIREUP` (the software atomics, UCX 1.22's
//! rendezvous) is replaced by one that drops. Whatever is dropped is counted
//! ([`dropped_so_far`]). UCX registers its handlers when a worker opens its interfaces, from
//! its table `ucp_am_handlers` of the `ucp_am_handler_UCP_AM_ID_*` structures it exports; the
//! table's size, their layout and the messages' headers (the same in UCX 1.13 and 1.22:
//! `src/ucp/core/ucp_context.h`, `src/ucp/rma/rma.h`) are checked before anything is written,
//! and a UCX whose table or structures are missing or laid out otherwise is refused, naming
//! them. A software get's answer is sent after its handler returned (docs/security.md says
//! what that leaves open).
#![allow(unsafe_code)]

use std::{
    ffi::{CString, c_uint, c_void},
    ptr,
    sync::{
        OnceLock, RwLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use ucx_sys as sys;

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

/// What the agent lets through of each message.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Rule {
    /// `ucp_put_hdr_t` (address, endpoint id, memory type: 20 bytes), then the bytes to write.
    Put,
    /// `ucp_get_req_hdr_t` (address, length, request and endpoint ids, memory type: 36 bytes).
    Get,
    /// An answer (`GET_REP`, `CMPL`), where a shared-memory context exists (the agent's own
    /// software puts and gets wait for them; elsewhere it sends none). UCX takes the sender's
    /// word for which request or endpoint it answers: a peer running a modified UCX can
    /// misuse that (docs/security.md).
    Answer,
}

/// The messages checked, by their `UCP_AM_ID_*` names. Every other one UCX would register for
/// the agent's contexts but `WIREUP` (which connects workers) is dropped: the software atomics,
/// and in UCX 1.22 the rendezvous messages (`RNDV_RTS`, `RNDV_RTR`, ...), which it registers
/// for RMA too and which write and read at an address the sender names as well (UCX 1.22's
/// RMA rendezvous, `rma_rndv.c`; the agent's own puts and gets never take it: it is for GPU
/// memory, which the agent does not register with UCX).
const HANDLERS: [(&str, Rule); 4] = [
    ("PUT", Rule::Put),
    ("GET_REQ", Rule::Get),
    ("GET_REP", Rule::Answer),
    ("CMPL", Rule::Answer),
];

/// The features a handler UCX registers for the agent's contexts has one of: RMA (theirs), and
/// the atomics (not theirs: dropped all the same).
const REACHABLE: u32 =
    sys::ucp_feature_UCP_FEATURE_RMA | sys::ucp_feature_UCP_FEATURE_AMO32 | sys::ucp_feature_UCP_FEATURE_AMO64;

/// The most entries `ucp_am_handlers` is taken to have (`UCP_AM_ID_LAST`: 29 in UCX 1.22).
const MAX_TABLE: usize = 256;

/// `sizeof(ucp_put_hdr_t)`: two `uint64_t` and a `ucs_memory_type_t` (an `int`), packed.
const PUT_HEADER: usize = 20;
/// `sizeof(ucp_get_req_hdr_t)`: address, length, `ucp_request_hdr_t` (two `uint64_t`), memory type.
const GET_HEADER: usize = 36;
/// `UCS_MEMORY_TYPE_HOST`.
const HOST: u32 = 0;

/// UCX's own handlers, `cb` and `proxy_cb` of each of [`HANDLERS`], called once a message passes.
static ORIGINAL: OnceLock<[(Option<Callback>, Option<Callback>); 4]> = OnceLock::new();
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// Host memory shared-memory contexts registered, one entry per region.
static ADMITTED: RwLock<Vec<Admitted>> = RwLock::new(Vec::new());
/// Whether a shared-memory context was made in this process.
static SHARED_MEMORY: AtomicBool = AtomicBool::new(false);

/// A range [`admit`]ted, and whether a software get was let through to it: UCX sends a get's
/// answer after its handler returned, reading the memory as the peer drains it (a peer that
/// stops draining leaves it pending for as long as it likes), and gives no sign once it is sent.
#[derive(Debug)]
struct Admitted {
    addr: u64,
    len: u64,
    read: AtomicBool,
}

impl Admitted {
    fn new(addr: u64, len: u64) -> Admitted {
        Admitted {
            addr,
            len,
            read: AtomicBool::new(false),
        }
    }
}

/// Software RMA messages peers sent this process, dropped.
pub fn dropped_so_far() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// A shared-memory context was made: answers to software puts and gets go through.
pub(super) fn shared_memory_context() {
    SHARED_MEMORY.store(true, Ordering::Release);
}

/// Software puts and gets may reach `len` bytes at `addr` (host memory a shared-memory context
/// registered) until [`withdraw`].
pub(super) fn admit(addr: u64, len: u64) {
    ADMITTED
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .push(Admitted::new(addr, len));
}

/// Ends one [`admit`] of the same range (before UCX unregisters it), once no software put or
/// get is being carried out. True when it was the range's last admission and a peer's
/// software get was let through to it meanwhile: UCX may still be reading that get's answer
/// from it, at any later time, so its addresses must stay mapped (with zeros:
/// `ucx_thread`'s `Unmap`).
pub(super) fn withdraw(addr: u64, len: u64) -> bool {
    let mut admitted = ADMITTED.write().unwrap_or_else(|e| e.into_inner());
    let Some(i) = admitted.iter().position(|r| (r.addr, r.len) == (addr, len)) else {
        return false;
    };
    let read = admitted.swap_remove(i).read.into_inner();
    match admitted.iter().find(|r| (r.addr, r.len) == (addr, len)) {
        // Another admission of the range keeps it mapped: the last one answers for both.
        Some(other) => {
            other.read.fetch_or(read, Ordering::Relaxed);
            false
        }
        None => read,
    }
}

/// The one of the `admitted` ranges that `len` bytes at `addr` lie inside (an empty range:
/// none).
fn inside(admitted: &[Admitted], addr: u64, len: u64) -> Option<&Admitted> {
    let end = addr.checked_add(len).filter(|_| len > 0)?;
    admitted
        .iter()
        .find(|r| addr >= r.addr && r.addr.checked_add(r.len).is_some_and(|limit| end <= limit))
}

fn u64_at(data: &[u8], at: usize) -> Option<u64> {
    data.get(at..at + 8)
        .map(|b| u64::from_ne_bytes(b.try_into().expect("8 bytes")))
}

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    data.get(at..at + 4)
        .map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes")))
}

/// Whether a message passes its rule: a put's or a get's whole range in `admitted` host memory
/// (a get's range marked read: see [`Admitted`]).
fn passes(rule: Rule, data: &[u8], admitted: &[Admitted]) -> bool {
    match rule {
        Rule::Put => {
            data.len() >= PUT_HEADER
                && u32_at(data, 16) == Some(HOST)
                && u64_at(data, 0)
                    .is_some_and(|addr| inside(admitted, addr, (data.len() - PUT_HEADER) as u64).is_some())
        }
        Rule::Get => {
            let range = match (u64_at(data, 0), u64_at(data, 8)) {
                (Some(addr), Some(len)) if data.len() >= GET_HEADER && u32_at(data, 32) == Some(HOST) => {
                    inside(admitted, addr, len)
                }
                _ => None,
            };
            range.inspect(|r| r.read.store(true, Ordering::Relaxed)).is_some()
        }
        Rule::Answer => SHARED_MEMORY.load(Ordering::Acquire),
    }
}

/// Checks a message of `HANDLERS[I]` and hands it to UCX's handler (`PROXY`: its counting
/// proxy, which UCX installs with another argument, and only where the handler has one) or
/// drops it: UCX frees it either way.
unsafe extern "C" fn checked<const I: usize, const PROXY: bool>(
    arg: *mut c_void,
    data: *mut c_void,
    length: usize,
    flags: c_uint,
) -> sys::ucs_status_t {
    // SAFETY: UCX hands a handler `length` readable bytes at `data`.
    let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) };
    let original = ORIGINAL.get().and_then(|o| if PROXY { o[I].1 } else { o[I].0 });
    // Held until UCX's handler is done: a region is withdrawn (and then unmapped) only after.
    let admitted = ADMITTED.read().unwrap_or_else(|e| e.into_inner());
    match original {
        // SAFETY: UCX's own handler, called as UCX would have called it.
        Some(handler) if passes(HANDLERS[I].1, bytes, &admitted) => unsafe { handler(arg, data, length, flags) },
        _ => {
            if DROPPED.fetch_add(1, Ordering::Relaxed) == 0 {
                tracing::warn!(
                    message = HANDLERS[I].0,
                    length,
                    "a UCX peer sent a software put, get or atomic outside the shared memory this agent registered \
                     (UCX carries those out at any address in the process); dropped \
                     (pdpair_agent_ucx_software_rma_dropped_total counts them)"
                );
            }
            sys::ucs_status_t_UCS_OK
        }
    }
}

/// [`checked`] of each of [`HANDLERS`]: (`cb`, `proxy_cb`).
const CHECKED: [(Callback, Callback); 4] = [
    (checked::<0, false>, checked::<0, true>),
    (checked::<1, false>, checked::<1, true>),
    (checked::<2, false>, checked::<2, true>),
    (checked::<3, false>, checked::<3, true>),
];

/// Takes the place of every other handler UCX would register for the agent's contexts but
/// `WIREUP`: the message is consumed (UCX frees it), counted, and nothing else happens.
unsafe extern "C" fn never(_: *mut c_void, _: *mut c_void, length: usize, _: c_uint) -> sys::ucs_status_t {
    if DROPPED.fetch_add(1, Ordering::Relaxed) == 0 {
        tracing::warn!(
            length,
            "a UCX peer sent a message this agent never sends (a software atomic, a rendezvous: UCX carries those out \
             at any address in the process); dropped (pdpair_agent_ucx_software_rma_dropped_total counts them)"
        );
    }
    sys::ucs_status_t_UCS_OK
}

/// `RTLD_DL_SYMENT` (glibc's `dlfcn.h`): `dladdr1` gives the symbol's ELF entry.
const RTLD_DL_SYMENT: libc::c_int = 1;

/// The entries of UCX's table of handlers: its symbol's size, over a pointer's.
fn table() -> Result<&'static [*mut Handler], String> {
    let at = symbol("ucp_am_handlers").ok_or("it exports no ucp_am_handlers")?;
    // SAFETY: zeroed Dl_info is valid; dladdr1 fills it and points `entry` at the symbol's ELF
    // entry, which lives as long as the library (never unloaded: the agent links it).
    let (mut info, mut entry): (libc::Dl_info, *mut libc::Elf64_Sym) = (unsafe { std::mem::zeroed() }, ptr::null_mut());
    let found =
        unsafe { libc::dladdr1(at, &mut info, (&raw mut entry).cast(), RTLD_DL_SYMENT) } != 0 && !entry.is_null();
    // SAFETY: dladdr1 set `entry` to a valid symbol entry (checked non-null).
    let size = if found { unsafe { (*entry).st_size } } else { 0 } as usize;
    let n = size / std::mem::size_of::<*mut Handler>();
    if n == 0 || n > MAX_TABLE || !size.is_multiple_of(std::mem::size_of::<*mut Handler>()) {
        return Err(format!("its ucp_am_handlers is {size} bytes, not a table of handlers"));
    }
    // SAFETY: `n` pointers at the table's address, within its symbol's size.
    Ok(unsafe { std::slice::from_raw_parts(at.cast::<*mut Handler>(), n) })
}

/// Puts [`checked`] in front of UCX's software RMA handlers, once per process, before any
/// worker opens (every context is made after it). An error names what this UCX lacks.
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
            "UCX {} cannot have its software RMA checked ({what}); without it any peer reaching this agent's UCX \
             worker writes and reads anywhere in the agent: use UCX 1.13 to 1.22",
            super::version()
        ))
    };
    let table = match table() {
        Ok(t) => t,
        Err(what) => return refuse(what),
    };
    let known = u64::from(REACHABLE);
    let in_table = |name: &str| -> Result<*mut Handler, String> {
        let handler = symbol(name)
            .ok_or_else(|| format!("it exports no {name}"))?
            .cast::<Handler>();
        if !table.contains(&handler) {
            return Err(format!("{name} is not in its ucp_am_handlers"));
        }
        Ok(handler)
    };
    let wireup = match in_table("ucp_am_handler_UCP_AM_ID_WIREUP") {
        Ok(h) => h,
        Err(what) => return refuse(what),
    };
    let mut found = Vec::with_capacity(HANDLERS.len());
    for (id, _) in HANDLERS {
        let name = format!("ucp_am_handler_UCP_AM_ID_{id}");
        let handler = match in_table(&name) {
            Ok(h) => h,
            Err(what) => return refuse(what),
        };
        // SAFETY: the structure libucp defines under that name; read in place.
        let (features, cb) = unsafe { ((*handler).features, (*handler).cb) };
        if features == 0 || features & !known != 0 || cb.is_none() {
            return refuse(format!(
                "{name} is not laid out as in UCX 1.13 to 1.22: features {features:#x}"
            ));
        }
        found.push(handler);
    }
    // SAFETY: checked above; read before any is replaced.
    let original: Vec<_> = found.iter().map(|h| unsafe { ((**h).cb, (**h).proxy_cb) }).collect();
    let _ = ORIGINAL.set(original.clone().try_into().expect("one per handler"));
    for ((handler, (cb, proxy)), (_, had_proxy)) in found.iter().zip(CHECKED).zip(original) {
        // SAFETY: checked above; no worker exists yet, so nothing reads them now. A handler
        // without a proxy keeps none: UCX then calls `cb`, with the worker as its argument.
        unsafe {
            (**handler).cb = Some(cb);
            if had_proxy.is_some() {
                (**handler).proxy_cb = Some(proxy);
            }
        }
    }
    // Every other handler the agent's contexts would register, but WIREUP: dropped.
    for &handler in table {
        if handler.is_null() || handler == wireup || found.contains(&handler) {
            continue;
        }
        // SAFETY: an entry of UCX's table: a handler structure, laid out as those checked above.
        unsafe {
            if (*handler).features & known != 0 {
                (*handler).cb = Some(never);
                if (*handler).proxy_cb.is_some() {
                    (*handler).proxy_cb = Some(never);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A put of `n` bytes at `addr` as UCX sends it: `ucp_put_hdr_t`, then the bytes.
    fn put(addr: u64, n: usize, memory: u32) -> Vec<u8> {
        let mut m = addr.to_ne_bytes().to_vec();
        m.extend_from_slice(&7u64.to_ne_bytes());
        m.extend_from_slice(&memory.to_ne_bytes());
        m.resize(PUT_HEADER + n, 0xab);
        m
    }

    /// A get of `n` bytes at `addr`: `ucp_get_req_hdr_t`.
    fn get(addr: u64, n: u64, memory: u32) -> Vec<u8> {
        let mut m = addr.to_ne_bytes().to_vec();
        m.extend_from_slice(&n.to_ne_bytes());
        m.extend_from_slice(&[9; 16]);
        m.extend_from_slice(&memory.to_ne_bytes());
        m
    }

    #[test]
    fn a_software_put_or_get_passes_only_whole_inside_admitted_host_memory() {
        let admitted = [Admitted::new(0x1000, 0x1000), Admitted::new(0x8000, 0x100)];
        for (what, ok, m) in [
            ("a put filling a region", true, put(0x1000, 0x1000, HOST)),
            ("a put ending at a region's end", true, put(0x1f00, 0x100, HOST)),
            ("a put in the second region", true, put(0x8080, 0x80, HOST)),
            ("a put one byte past a region", false, put(0x1f00, 0x101, HOST)),
            ("a put one byte before a region", false, put(0xfff, 2, HOST)),
            ("a put spanning two regions", false, put(0x1800, 0x7000, HOST)),
            ("a put between regions", false, put(0x4000, 8, HOST)),
            ("a put of GPU memory", false, put(0x1000, 8, 1)),
            ("a put that wraps", false, put(u64::MAX - 4, 8, HOST)),
            ("an empty put", false, put(0x1000, 0, HOST)),
            (
                "a put shorter than its header",
                false,
                put(0x1000, 0, HOST)[..PUT_HEADER - 1].to_vec(),
            ),
            ("a get inside a region", true, get(0x1010, 0x20, HOST)),
            ("a get filling a region", true, get(0x8000, 0x100, HOST)),
            ("a get one byte past", false, get(0x8000, 0x101, HOST)),
            ("a get that wraps", false, get(0x8000, u64::MAX, HOST)),
            ("a get of none", false, get(0x8000, 0, HOST)),
            ("a get of GPU memory", false, get(0x1000, 8, 2)),
            (
                "a get shorter than its header",
                false,
                get(0x1000, 8, HOST)[..GET_HEADER - 1].to_vec(),
            ),
        ] {
            let rule = if what.contains("put") { Rule::Put } else { Rule::Get };
            assert_eq!(passes(rule, &m, &admitted), ok, "{what}");
        }
        assert!(!passes(Rule::Put, &put(0x1000, 8, HOST), &[]), "nothing admitted");
    }

    #[test]
    fn a_range_a_get_was_let_through_to_is_said_to_be_read_at_its_last_withdrawal() {
        let admitted = [Admitted::new(0x1000, 0x1000), Admitted::new(0x8000, 0x100)];
        assert!(passes(Rule::Put, &put(0x1000, 8, HOST), &admitted));
        assert!(!passes(Rule::Get, &get(0x8000, 0x101, HOST), &admitted));
        let read = |a: &[Admitted]| a.iter().map(|r| r.read.load(Ordering::Relaxed)).collect::<Vec<_>>();
        assert_eq!(read(&admitted), [false, false], "puts and refused gets read nothing");
        assert!(passes(Rule::Get, &get(0x8010, 0x10, HOST), &admitted));
        assert_eq!(read(&admitted), [false, true]);

        // Ranges no other test registers (tests share the process).
        let at = u64::MAX - (1 << 41);
        admit(at, 64);
        assert!(!withdraw(at, 64), "nothing read");
        admit(at, 64);
        admit(at, 64);
        let admitted = ADMITTED.read().expect("lock");
        assert!(passes(Rule::Get, &get(at + 8, 8, HOST), &admitted));
        drop(admitted);
        assert!(!withdraw(at, 64), "another admission keeps the range mapped");
        assert!(withdraw(at, 64), "the last one says it was read");
        assert!(!withdraw(at, 64), "nothing left");
    }

    #[test]
    fn every_handler_ucx_registers_for_the_agents_contexts_is_checked_or_dropped_but_wireup() {
        turn_off().expect("this UCX's handlers are laid out as expected");
        let table = table().expect("the table");
        let wireup = symbol("ucp_am_handler_UCP_AM_ID_WIREUP")
            .expect("wireup")
            .cast::<Handler>();
        let ours: Vec<Callback> = CHECKED
            .iter()
            .flat_map(|(a, b)| [*a, *b])
            .chain([never as Callback])
            .collect();
        let (mut checked, mut dropped) = (0, 0);
        for &h in table.iter().filter(|h| !h.is_null() && **h != wireup) {
            // SAFETY: entries of UCX's table.
            let (features, cb, proxy) = unsafe { ((*h).features, (*h).cb, (*h).proxy_cb) };
            if features & u64::from(REACHABLE) == 0 {
                continue;
            }
            let cb = cb.expect("a handler");
            assert!(
                ours.iter().any(|o| std::ptr::fn_addr_eq(*o, cb)),
                "a handler of features {features:#x} left as UCX has it"
            );
            if let Some(p) = proxy {
                assert!(
                    ours.iter().any(|o| std::ptr::fn_addr_eq(*o, p)),
                    "a proxy of features {features:#x} left"
                );
            }
            if std::ptr::fn_addr_eq(cb, never as Callback) {
                dropped += 1;
            } else {
                checked += 1;
            }
        }
        assert_eq!(checked, HANDLERS.len());
        // The atomics' two; in UCX 1.22 the five rendezvous messages too.
        let expected = if super::super::version().starts_with("1.13") {
            2
        } else {
            7
        };
        assert_eq!(dropped, expected, "UCX {}", super::super::version());
    }

    #[test]
    fn an_admitted_range_is_withdrawn_once_per_admission() {
        // Ranges no other test registers (tests share the process).
        let at = u64::MAX - (1 << 40);
        admit(at, 64);
        admit(at, 64);
        let now = || {
            ADMITTED
                .read()
                .expect("lock")
                .iter()
                .filter(|r| (r.addr, r.len) == (at, 64))
                .count()
        };
        assert_eq!(now(), 2);
        withdraw(at, 64);
        assert_eq!(now(), 1, "one admission stays");
        withdraw(at, 64);
        withdraw(at, 64);
        assert_eq!(now(), 0);
    }
}
