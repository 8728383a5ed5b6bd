//! Real UCX over loopback transports: two contexts (as two agents would have), a registered
//! target buffer, a put, a flush, and the bytes checked.

use super::*;

fn put_roundtrip(transport: Transport, len: usize) {
    let a = Context::new(transport, None).expect("context A");
    let b = Context::new(transport, None).expect("context B");
    let wa = Worker::new(&a).expect("worker A");
    let wb = Worker::new(&b).expect("worker B");
    let mut target = vec![0u8; len];
    // SAFETY: `target` outlives `region` (dropped first, at the end of this function).
    let region = unsafe { b.map(target.as_mut_ptr(), target.len()) }.expect("map target");
    let rkey_bytes = region.packed_rkey().expect("pack rkey");
    let ep = wa.connect(&wb.address().expect("B's address")).expect("connect A->B");
    let rkey = ep.unpack_rkey(&rkey_bytes).expect("unpack");
    let source: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    // Two puts: the second half lands after the first, at an offset.
    let half = len / 2;
    for (range, offset) in [(0..half, 0u64), (half..len, half as u64)] {
        // SAFETY: `source` lives until after the flush below; the range lies inside `region`.
        if let Some(req) = unsafe { ep.put(&source[range], region.addr() + offset, &rkey, None) }.expect("post put") {
            ep.wait(req, || {
                wb.progress();
            })
            .expect("put completes");
        }
    }
    ep.flush(|| {
        wb.progress();
    })
    .expect("flush");
    drop(rkey);
    ep.close(|| {
        wb.progress();
    })
    .expect("close");
    drop(region);
    assert!(target == source, "{transport:?}: the target holds what was put");
}

#[test]
fn no_transport_loads_ucx_tcp_so_no_worker_reaches_another_over_it() {
    // UCX's tcp takes puts at any address of the process from anyone reaching its port
    // (docs/security.md): with it loaded, these workers would connect over the loopback.
    for transport in [Transport::Tcp, Transport::Auto] {
        let a = Context::new(transport, None).expect("context A");
        let b = Context::new(transport, None).expect("context B");
        let wa = Worker::new(&a).expect("worker A");
        let wb = Worker::new(&b).expect("worker B");
        let e = wa
            .connect(&wb.address().expect("B's address"))
            .map(|ep| ep.print_info())
            .expect_err("no transport reaches another worker on this host without RDMA");
        assert_eq!(e.op, "ucp_ep_create", "{transport:?}: {e}");
    }
    assert!(!network_available(), "this machine has no RDMA device");
}

#[test]
fn put_over_shared_memory() {
    put_roundtrip(Transport::Shm, 1 << 20);
}

#[test]
fn errors_carry_ucx_status_text() {
    let e = check("ucp_test", sys::ucs_status_t_UCS_ERR_NO_MEMORY).expect_err("an error");
    assert_eq!(e.op, "ucp_test");
    assert!(e.to_string().starts_with("ucp_test: Out of memory"), "{e}");
    assert!(check("ok", sys::ucs_status_t_UCS_OK).is_ok());
}

#[test]
fn get_over_shared_memory() {
    {
        let transport = Transport::Shm;
        let a = Context::new(transport, None).expect("context A");
        let b = Context::new(transport, None).expect("context B");
        let wa = Worker::new(&a).expect("worker A");
        let wb = Worker::new(&b).expect("worker B");
        let mut source: Vec<u8> = (0..(256 << 10)).map(|i| (i * 13 + 1) as u8).collect();
        // SAFETY: `source` outlives `region` (dropped first below).
        let region = unsafe { b.map(source.as_mut_ptr(), source.len()) }.expect("map source");
        let ep = wa.connect(&wb.address().expect("B's address")).expect("connect");
        let rkey = ep.unpack_rkey(&region.packed_rkey().expect("pack")).expect("unpack");
        let mut target = vec![0u8; source.len()];
        // SAFETY: `target` lives until after the wait; the range lies inside `region`.
        if let Some(req) =
            unsafe { ep.get(target.as_mut_ptr(), target.len(), region.addr(), &rkey, None) }.expect("post get")
        {
            ep.wait(req, || {
                wb.progress();
            })
            .expect("get completes");
        }
        drop(rkey);
        ep.close(|| {
            wb.progress();
        })
        .expect("close");
        drop(region);
        assert!(target == source, "{transport:?}: the get brought the source's bytes");
    }
}

#[test]
fn a_peer_maps_memory_ucx_allocated_but_not_memory_merely_registered() {
    // What makes agent-allocated pools fast on one host: UCX maps the peer's allocated segment
    // into this process (puts are one copy), while registered memory gets emulated puts.
    let dir = std::env::temp_dir().join(format!("pdpair-ucx-rkey-ptr-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let a = Context::new(Transport::Shm, Some(&dir)).expect("context A");
    let b = Context::new(Transport::Shm, Some(&dir)).expect("context B");
    let wa = Worker::new(&a).expect("worker A");
    let wb = Worker::new(&b).expect("worker B");
    let ep = wa.connect(&wb.address().expect("B's address")).expect("connect");
    let allocated = b.allocate(1 << 16).expect("allocate");
    assert!(allocated.len() >= 1 << 16 && allocated.addr() != 0);
    let mut heap = vec![0u8; 1 << 16];
    // SAFETY: `heap` outlives `registered` (dropped first below).
    let registered = unsafe { b.map(heap.as_mut_ptr(), heap.len()) }.expect("map");
    let rkey = ep.unpack_rkey(&allocated.packed_rkey().expect("pack")).expect("unpack");
    let local = rkey
        .local_ptr(allocated.addr())
        .expect("the allocated segment is mapped here");
    assert_ne!(local, allocated.addr(), "at this process's own address for it");
    let rkey2 = ep
        .unpack_rkey(&registered.packed_rkey().expect("pack"))
        .expect("unpack");
    assert_eq!(
        rkey2.local_ptr(registered.addr()),
        None,
        "registered memory is not mapped here"
    );
    drop((rkey, rkey2));
    ep.close(|| {
        wb.progress();
    })
    .expect("close");
    drop((registered, allocated));
    drop(heap);
    drop((wa, wb, a, b));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_pool_dir_too_long_for_shared_memory_is_refused_naming_it_instead_of_aborting() {
    let long = std::env::temp_dir().join("p".repeat(MAX_POOL_DIR));
    std::fs::create_dir_all(&long).expect("dir");
    // Without the check UCX aborts the whole process when the worker packs its address.
    let err = Context::new(Transport::Shm, Some(&long))
        .and_then(|c| Worker::new(&c).map(|_| ()))
        .expect_err("refused");
    assert!(err.text.contains(&long.display().to_string()), "{}", err.text);
    // Short enough, it works (up to the limit itself); tcp does not pack the directory at all.
    let base = std::env::temp_dir().join("pdpair-ucx-dir-");
    let at_limit = std::path::PathBuf::from(format!(
        "{}{}",
        base.display(),
        "x".repeat(MAX_POOL_DIR.saturating_sub(base.as_os_str().len()))
    ));
    assert_eq!(at_limit.as_os_str().len(), MAX_POOL_DIR, "{}", at_limit.display());
    std::fs::create_dir_all(&at_limit).expect("dir");
    Context::new(Transport::Shm, Some(&at_limit))
        .and_then(|c| Worker::new(&c).and_then(|w| w.address()).map(|_| ()))
        .expect("a dir of the limit's length works");
    let _ = std::fs::remove_dir(&at_limit);
    let ok = std::env::temp_dir().join("pdpair-ucx-dir-ok");
    std::fs::create_dir_all(&ok).expect("dir");
    Context::new(Transport::Shm, Some(&ok))
        .and_then(|c| Worker::new(&c).map(|_| ()))
        .expect("a short dir works");
    Context::new(Transport::Tcp, Some(&long))
        .and_then(|c| Worker::new(&c).map(|_| ()))
        .expect("the stream's UCX (self alone) ignores the dir");
    let _ = std::fs::remove_dir(&long);
}

#[test]
fn an_endpoint_reports_the_lanes_ucx_chose_for_it() {
    use crate::transport::lanes::Lanes;
    use pdpair_api::PathKind;
    let dir = std::env::temp_dir().join(format!("pdpair-lanes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    for transport in [Transport::Shm, Transport::Tcp, Transport::Auto] {
        let a = Context::new(transport, Some(&dir)).expect("context A");
        let wa = Worker::new(&a).expect("worker A");
        if transport == Transport::Shm {
            let b = Context::new(transport, Some(&dir)).expect("context B");
            let wb = Worker::new(&b).expect("worker B");
            let ep = wa.connect(&wb.address().expect("B's address")).expect("connect A->B");
            let text = ep.print_info();
            let lanes = Lanes::parse(&text);
            assert_eq!(lanes.kind(), PathKind::SharedMemory, "{text}");
            assert!(!lanes.carrying().1, "{text}");
            ep.close(|| {
                wb.progress();
            })
            .expect("close");
        }
        // An endpoint to its own worker (both engines behind one agent) goes through `self`.
        let own = wa.connect(&wa.address().expect("A's address")).expect("connect A->A");
        let text = own.print_info();
        assert_eq!(Lanes::parse(&text).kind(), PathKind::Local, "{transport:?}:\n{text}");
        own.close(|| {}).expect("close");
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(version().starts_with("1."), "{}", version());
    // hack/ucx-compat.sh says which UCX these tests must have loaded.
    if let Ok(want) = std::env::var("PDPAIR_EXPECT_UCX") {
        assert!(
            version().starts_with(&format!("{want}.")),
            "loaded UCX {}, not {want}",
            version()
        );
    }
}

#[test]
fn transports_parse_from_their_names_and_refuse_others_naming_them() {
    for (name, t) in [
        ("auto", Transport::Auto),
        ("tcp", Transport::Tcp),
        ("shm", Transport::Shm),
    ] {
        assert_eq!(name.parse::<Transport>(), Ok(t));
    }
    // Auto narrows the environment's UCX_TLS to transports that leave the host.
    let excluded = "sm,tcp,cuda_ipc,rocm_ipc,ze_ipc,gaudi_ipc";
    assert_eq!(auto_tls(None, false), "^sm,tcp", "1.13 has no GPU IPC to exclude");
    for (env, want) in [
        (None, format!("^{excluded}")),
        (Some("all"), format!("^{excluded}")),
        (Some("^ud"), format!("^ud,{excluded}")),
        (Some("rc,sm"), "rc,self".to_owned()),
        (Some("rc, posix ,self,cma"), "rc,self".to_owned()),
        (Some("rc,tcp,cuda_copy,cuda_ipc"), "rc,cuda_copy,self".to_owned()),
        (Some("rc,all"), format!("^{excluded}")),
        // Nothing but transports within the host or tcp: no RDMA, the stream carries peers.
        (Some("tcp"), "self".to_owned()),
        (Some("posix,sysv,self"), "self".to_owned()),
    ] {
        assert_eq!(auto_tls(env, true), want, "{env:?}");
    }
    assert_eq!(without_self("^sm,tcp").as_deref(), Some("^sm,tcp,self"));
    assert_eq!(without_self("rc,self").as_deref(), Some("rc"));
    assert_eq!(without_self("self"), None);
    let e = "ib".parse::<Transport>().expect_err("refused");
    assert!(e.contains("\"ib\""), "{e}");
}

#[test]
fn gpu_memory_is_refused_where_this_ucx_cannot_move_it() {
    // Debian's UCX 1.13 (what CI and the image load) has no GPU modules: it reports host memory
    // only, and would register a device address as host memory if asked.
    let c = Context::new(Transport::Auto, None).expect("context");
    let types = c.memory_types();
    println!("UCX {} memory types: {types:?}", version());
    assert!(types.contains(&MemoryType::Host), "{types:?}");
    let absent: Vec<MemoryType> = MemoryType::ALL.into_iter().filter(|t| !types.contains(t)).collect();
    assert!(!absent.is_empty(), "this UCX claims every memory type: {types:?}");
    let mut memory = vec![0u8; 4096];
    for t in absent {
        // SAFETY: `memory` outlives any region (none is made: each call is refused).
        let e = unsafe { c.map_typed(memory.as_mut_ptr(), memory.len(), t) }.expect_err("refused");
        assert!(
            e.to_string().contains(&format!("cannot move {} memory", t.as_str())) && e.to_string().contains(&version()),
            "{e}"
        );
    }
    // SAFETY: as above; this one is registered and dropped before `memory`.
    let host = unsafe { c.map_typed(memory.as_mut_ptr(), memory.len(), MemoryType::Host) }.expect("host memory maps");
    drop(host);
}

/// Every setting of `config` as UCX prints it (`UCX_NAME=value` lines).
fn printed(config: &Config) -> String {
    let (mut buf, mut len): (*mut libc::c_char, libc::size_t) = (ptr::null_mut(), 0);
    // SAFETY: open_memstream writes the buffer's address and length through these pointers; the
    // stream is closed (which sets them) before they are read, and the buffer freed after.
    #[allow(unsafe_code)]
    unsafe {
        let stream = libc::open_memstream(&mut buf, &mut len);
        assert!(!stream.is_null(), "open_memstream");
        sys::ucp_config_print(
            config.0,
            stream.cast(),
            ptr::null(),
            // Hidden ones too: UCX 1.13 hides MEMTYPE_CACHE.
            sys::ucs_config_print_flags_t_UCS_CONFIG_PRINT_CONFIG
                | sys::ucs_config_print_flags_t_UCS_CONFIG_PRINT_HIDDEN,
        );
        libc::fclose(stream);
        let text = String::from_utf8_lossy(std::slice::from_raw_parts(buf.cast::<u8>(), len)).into_owned();
        libc::free(buf.cast());
        text
    }
}

#[test]
fn contexts_keep_ucx_memory_caches_off() {
    // With these caches on (UCX's default is "try"), UCX's mmap/munmap hooks take their locks in
    // every call the process makes: thousands of link threads' stacks queued there for minutes
    // (UCX 1.22). Set over the environment's, so `UCX_MEMTYPE_CACHE=y` there changes nothing.
    unsafe extern "C" {
        // UCX's process-wide settings (libucs), where MEMTYPE_CACHE lives.
        fn ucs_global_opts_get_value(name: *const libc::c_char, value: *mut libc::c_char, max: usize) -> i32;
    }
    for transport in [Transport::Shm, Transport::Auto] {
        let text = printed(&Config::read(transport.tls(), None).expect("config"));
        assert!(
            text.lines().any(|l| l == "UCX_RCACHE_ENABLE=n"),
            "{transport:?}: no UCX_RCACHE_ENABLE=n in\n{text}"
        );
        let mut value = [0 as libc::c_char; 32];
        // SAFETY: a NUL-terminated name and a buffer of the length given.
        #[allow(unsafe_code)]
        let status = unsafe { ucs_global_opts_get_value(c"MEMTYPE_CACHE".as_ptr(), value.as_mut_ptr(), value.len()) };
        assert_eq!(status, 0, "MEMTYPE_CACHE is one of UCX's global settings");
        // SAFETY: UCX wrote a NUL-terminated string into the buffer.
        #[allow(unsafe_code)]
        let value = unsafe { CStr::from_ptr(value.as_ptr()) }.to_string_lossy().into_owned();
        assert_eq!(value, "n", "{transport:?}: UCX_MEMTYPE_CACHE");
    }
    // And a context opens with them.
    put_roundtrip(Transport::Shm, 1 << 20);
}
