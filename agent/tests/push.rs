//! Two agents in one process (each with its own UCX context and worker, real Unix and TCP
//! sockets, real UCX over tcp or shared memory) and synthetic engines: the push path end to end.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use pdpair_agent::{
    engine_api::{AgentEvent, EngineRequest},
    synthetic::{EngineMemory, SyntheticEngine},
    transport::ucx::Transport,
};
use pdpair_api::{ChecksumPolicy, Role, TransferMode};

mod common;

use common::{ProcessAgent, Req, World, done, expect_kv, kv, kv_ready, reasons, request, spec};

/// Prefill engine "p0" at the agent `ps` and decode engine "d0" at `ds`, of `block`-token
/// blocks, checksums `checksum`.
fn p0_d0(w: &World, ps: &Path, ds: &Path, block: i32, checksum: ChecksumPolicy) -> (SyntheticEngine, SyntheticEngine) {
    let p = SyntheticEngine::register(ps, &w.dir, &spec(Role::Prefill, "p0", kv(block, None), b"k", checksum));
    let d = SyntheticEngine::register(ds, &w.dir, &spec(Role::Decode, "d0", kv(block, None), b"k", checksum));
    (p.expect("P"), d.expect("D"))
}

/// Completed transfers the `agent`th agent of `w` counted on a path of `kind` (UCX's host
/// backend, or the tcp stream for `Tcp`).
fn transfers_over(w: &World, agent: usize, kind: &str) -> u64 {
    let text = w.metrics.lock().expect("metrics")[agent].render();
    let path = match kind {
        "Tcp" => "Tcp/TcpStream".to_owned(),
        _ => format!("{kind}/UcxHost"),
    };
    pdpair_agent::loopback::transfer_paths(&text)
        .into_iter()
        .find_map(|(p, n)| (p == path).then_some(n))
        .unwrap_or(0)
}

fn push_64_64(transport: Transport, memory: EngineMemory) {
    push_64_64_over(
        transport,
        memory,
        match transport {
            // Auto offers UCX no transport within the host, nor tcp: without an RDMA device two
            // agents on one host use the tcp stream.
            Transport::Tcp | Transport::Auto => "Tcp",
            // One host: UCX 1.13 chooses sysv and posix shared memory here (cma is refused).
            Transport::Shm => "SharedMemory",
        },
    );
}

fn push_64_64_over(transport: Transport, memory: EngineMemory, kind: &str) {
    let w = World::new(&format!("{transport:?}-{memory:?}"));
    let (ps, ds) = (w.agent("p", transport, false), w.agent("d", transport, false));
    let mut p_spec = spec(Role::Prefill, "p0", kv(64, None), b"k", ChecksumPolicy::FailClosed);
    let mut d_spec = spec(Role::Decode, "d0", kv(64, None), b"k", ChecksumPolicy::FailClosed);
    (p_spec.memory, d_spec.memory) = (memory, memory);
    let mut p = SyntheticEngine::register(&ps, &w.dir, &p_spec).expect("P");
    let mut d = SyntheticEngine::register(&ds, &w.dir, &d_spec).expect("D");
    for i in 0..3u64 {
        // 150 tokens in 3 blocks of 64 (the last partial), checked byte by byte.
        let (event, bad) = request(
            &mut p,
            &mut d,
            Req {
                id: &format!("r{i}"),
                seed: 100 + i,
                p_first: 0,
                d_first: 0,
                tokens: 150,
                blocks: 3,
            },
        );
        assert!(done(&event), "{event:?}");
        assert!(
            matches!(&event, AgentEvent::RequestDone { checksum: Some(c), .. } if c == "Verified"),
            "{event:?}"
        );
        assert_eq!(bad, 0, "every received byte matches");
    }
    // A prefix-cache hit on D: it asks only from token 64; blocks pair by position.
    let (event, bad) = request(
        &mut p,
        &mut d,
        Req {
            id: "prefix",
            seed: 7,
            p_first: 0,
            d_first: 64,
            tokens: 150,
            blocks: 3,
        },
    );
    assert!(done(&event), "{event:?}");
    assert_eq!(bad, 0);
    // Prefill's agent moved the bytes and says over what; decode's (no endpoint) counts none.
    assert_eq!(transfers_over(&w, 0, kind), 4, "{transport:?}: 4 transfers over {kind}");
    let d_text = w.metrics.lock().expect("metrics")[1].render();
    assert!(!d_text.contains("pdpair_agent_transfer_paths_total{"), "{d_text}");
}

#[test]
fn a_burst_of_new_links_to_one_prefill_node_all_come_up_and_move_their_kv() {
    // A prefill agent closes, before reading a byte, a source's connections past
    // MAX_UNAUTHENTICATED_PER_SOURCE that have not authenticated yet. A decode engine asked for
    // the KV of more prefill engines of one node than that at once dialled them all at once:
    // the prefill agent reset those past its limit, and their requests failed with
    // HandshakeFailed. Its agent now keeps its dials to one host within that limit.
    let n = 3 * pdpair_agent::agent::MAX_UNAUTHENTICATED_PER_SOURCE as u32;
    let w = World::new("dial-burst");
    let (ps, ds) = (w.agent("p", Transport::Tcp, false), w.agent("d", Transport::Tcp, false));
    let mut d_spec = spec(Role::Decode, "d0", kv(64, None), b"k", ChecksumPolicy::FailClosed);
    d_spec.num_blocks = n;
    let mut d = SyntheticEngine::register(&ds, &w.dir, &d_spec).expect("D");
    let prompt = |i: u32| Some(pdpair_agent::synthetic::prompt(u64::from(i), 64));
    let mut prefills = Vec::new();
    for i in 0..n {
        let p_spec = spec(
            Role::Prefill,
            &format!("p{i}"),
            kv(64, None),
            b"k",
            ChecksumPolicy::FailClosed,
        );
        let mut p = SyntheticEngine::register(&ps, &w.dir, &p_spec).expect("P");
        // One block of 64 tokens, ready before decode asks: a link that comes up is served.
        p.fill(u64::from(i), &[1], 0, 64);
        common::kv_ready_of(&mut p, &format!("r{i}"), &[1], 64, prompt(i));
        prefills.push(p);
    }
    let blocks: Vec<u32> = (0..n).collect();
    d.clear(&blocks);
    // Asked at once, each into its own decode block: n new links to one prefill node.
    for (i, p) in (0..n).zip(&prefills) {
        common::expect_kv_of(&mut d, &format!("r{i}"), p.address.clone(), &[i], 64, prompt(i));
    }
    for _ in 0..n {
        let event = d.next_event().expect("D event");
        assert!(
            matches!(&event, AgentEvent::RequestDone { checksum: Some(c), .. } if c == "Verified"),
            "every request of the burst is served: {event:?}"
        );
    }
    for i in 0..n {
        assert_eq!(d.verify(u64::from(i), &[i], 0, 64), 0, "r{i}: every byte arrived");
    }
}

#[test]
fn push_64_64_over_tcp_moves_every_byte_verified() {
    push_64_64(Transport::Tcp, EngineMemory::Agent);
}

#[test]
fn push_64_64_over_shared_memory_moves_every_byte_verified() {
    push_64_64(Transport::Shm, EngineMemory::Agent);
}

#[test]
fn push_64_64_on_the_transports_ucx_chooses_moves_every_byte_verified() {
    push_64_64(Transport::Auto, EngineMemory::Agent);
}

#[test]
fn push_64_64_into_engine_files_moves_every_byte_verified() {
    push_64_64(Transport::Shm, EngineMemory::Engine);
    push_64_64(Transport::Tcp, EngineMemory::Engine);
}

/// The files in the pool directory, by name.
fn pool_files(w: &World) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(w.pools())
        .expect("pool dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn an_agent_allocated_pool_is_a_private_file_in_the_pool_dir_until_its_engine_closes() {
    use std::os::unix::fs::PermissionsExt;
    // Shared memory: UCX's segment, a file in the pool dir (peer agents on the host find it
    // there), readable by the agent's user alone; the engine maps the descriptor it was passed.
    let w = World::new("pool-shm");
    let s = w.agent("a", Transport::Shm, false);
    let before = pool_files(&w);
    let d = SyntheticEngine::register(
        &s,
        &w.dir,
        &spec(Role::Decode, "d0", kv(64, None), b"k", ChecksumPolicy::Disabled),
    )
    .expect("registered");
    let added: Vec<String> = pool_files(&w).into_iter().filter(|n| !before.contains(n)).collect();
    assert_eq!(added.len(), 1, "one new file in the pool dir: {added:?}");
    assert!(added[0].starts_with("ucx_shm_posix_"), "{added:?}");
    let file = w.pools().join(&added[0]);
    let meta = std::fs::metadata(&file).expect("pool file");
    assert!(meta.len() >= d.layout.pool_len() as u64, "sized for the pool");
    assert_eq!(meta.permissions().mode() & 0o077, 0, "no access for group or others");
    drop(d);
    let start = Instant::now();
    while file.exists() {
        assert!(start.elapsed() < Duration::from_secs(5), "the file outlived its engine");
        std::thread::sleep(Duration::from_millis(10));
    }
    // tcp alone: a sealed memfd, no file anywhere.
    let w = World::new("pool-tcp");
    let s = w.agent("a", Transport::Tcp, false);
    let before = pool_files(&w);
    let d = SyntheticEngine::register(
        &s,
        &w.dir,
        &spec(Role::Decode, "d0", kv(64, None), b"k", ChecksumPolicy::Disabled),
    )
    .expect("registered");
    assert_eq!(pool_files(&w), before, "no pool file");
    assert!(d.pool_file(0).metadata().expect("fd").len() >= d.layout.pool_len() as u64);
}

#[test]
fn push_16_64_is_rejected_at_the_handshake_and_decode_keeps_serving() {
    let w = World::new("reject");
    let (good_s, bad_s, ds) = (
        w.agent("p-good", Transport::Tcp, false),
        w.agent("p-bad", Transport::Tcp, false),
        w.agent("d", Transport::Tcp, false),
    );
    let mut good = SyntheticEngine::register(
        &good_s,
        &w.dir,
        &spec(Role::Prefill, "good", kv(64, None), b"k", ChecksumPolicy::FailClosed),
    )
    .expect("P");
    let mut bad = SyntheticEngine::register(
        &bad_s,
        &w.dir,
        &spec(Role::Prefill, "bad", kv(16, None), b"k", ChecksumPolicy::FailClosed),
    )
    .expect("P16");
    let mut d = SyntheticEngine::register(
        &ds,
        &w.dir,
        &spec(Role::Decode, "d0", kv(64, None), b"k", ChecksumPolicy::FailClosed),
    )
    .expect("D");
    for i in 0..3 {
        let started = Instant::now();
        d.send(&EngineRequest::ExpectKv {
            request: format!("bad{i}"),
            prefill: bad.address.clone(),
            blocks: vec![1],
            num_tokens: 10,
            first_token: 0,
            prompt: None,
            event: None,
        })
        .expect("ExpectKv");
        let event = d.next_event().expect("event");
        let took = started.elapsed();
        assert_eq!(reasons(&event), vec!["KernelBlockSizeMismatch".to_owned()], "{event:?}");
        assert!(took < Duration::from_secs(1), "rejections are immediate, took {took:?}");
        // Meanwhile the compatible prefill keeps being served by the same decode.
        let (event, wrong) = request(
            &mut good,
            &mut d,
            Req {
                id: &format!("ok{i}"),
                seed: i,
                p_first: 0,
                d_first: 0,
                tokens: 100,
                blocks: 2,
            },
        );
        assert!(done(&event), "{event:?}");
        assert_eq!(wrong, 0);
    }
    // The incompatible prefill's own engine hears nothing for requests that never reached it;
    // its KvReady times out on its lease, and it says so.
    bad.send(&EngineRequest::KvReady {
        release_token: None,
        request: "orphan".into(),
        blocks: vec![0],
        num_tokens: 10,
        first_token: 0,
        prompt: None,
        event: None,
    })
    .expect("KvReady");
    let event = bad.next_event().expect("lease event");
    assert_eq!(reasons(&event), vec!["LeaseExpired".to_owned()]);
}

#[test]
fn a_foreign_prefill_is_unauthenticated_and_learns_nothing() {
    let w = World::new("foreign");
    let (fs, ds) = (
        w.agent("p-foreign", Transport::Tcp, false),
        w.agent("d", Transport::Tcp, false),
    );
    let foreign = SyntheticEngine::register(
        &fs,
        &w.dir,
        &spec(
            Role::Prefill,
            "f",
            kv(64, None),
            b"stranger",
            ChecksumPolicy::FailClosed,
        ),
    )
    .expect("P");
    let mut d = SyntheticEngine::register(
        &ds,
        &w.dir,
        &spec(Role::Decode, "d0", kv(64, None), b"k", ChecksumPolicy::FailClosed),
    )
    .expect("D");
    d.send(&EngineRequest::ExpectKv {
        request: "x".into(),
        prefill: foreign.address.clone(),
        blocks: vec![1],
        num_tokens: 10,
        first_token: 0,
        prompt: None,
        event: None,
    })
    .expect("send");
    assert_eq!(
        reasons(&d.next_event().expect("event")),
        vec!["Unauthenticated".to_owned()]
    );
    // Remembered: the next request fails at once without a new connection.
    d.send(&EngineRequest::ExpectKv {
        request: "y".into(),
        prefill: foreign.address.clone(),
        blocks: vec![1],
        num_tokens: 10,
        first_token: 0,
        prompt: None,
        event: None,
    })
    .expect("send");
    let event = d.next_event().expect("event");
    assert_eq!(reasons(&event), vec!["Unauthenticated".to_owned()]);
    assert!(
        matches!(&event, AgentEvent::RequestFailed { message, .. } if message.contains("remembered")),
        "{event:?}"
    );
}

fn corrupt(policy: ChecksumPolicy) -> (AgentEvent, u64) {
    let w = World::new(&format!("corrupt-{policy:?}"));
    let (ps, ds) = (w.agent("p", Transport::Tcp, true), w.agent("d", Transport::Tcp, false));
    let mut p =
        SyntheticEngine::register(&ps, &w.dir, &spec(Role::Prefill, "p0", kv(64, None), b"k", policy)).expect("P");
    let mut d =
        SyntheticEngine::register(&ds, &w.dir, &spec(Role::Decode, "d0", kv(64, None), b"k", policy)).expect("D");
    request(
        &mut p,
        &mut d,
        Req {
            id: "r",
            seed: 5,
            p_first: 0,
            d_first: 0,
            tokens: 128,
            blocks: 2,
        },
    )
}

#[test]
fn a_corrupted_byte_fails_the_request_under_fail_closed() {
    let (event, bad) = corrupt(ChecksumPolicy::FailClosed);
    assert_eq!(reasons(&event), vec!["ChecksumMismatch".to_owned()], "{event:?}");
    assert!(bad > 0, "the byte check sees it too");
}

#[test]
fn a_corrupted_byte_is_logged_and_accepted_under_fail_open() {
    let (event, bad) = corrupt(ChecksumPolicy::FailOpen);
    assert!(
        matches!(&event, AgentEvent::RequestDone { checksum: Some(c), .. } if c == "Mismatched"),
        "{event:?}"
    );
    assert!(bad > 0);
}

#[test]
fn a_request_for_an_unknown_prefill_fails_within_its_deadline() {
    let w = World::new("deadline");
    let ds = w.agent("d", Transport::Tcp, false);
    let mut d = SyntheticEngine::register(
        &ds,
        &w.dir,
        &spec(Role::Decode, "d0", kv(64, None), b"k", ChecksumPolicy::Disabled),
    )
    .expect("D");
    // Nobody listens there: the connection is refused at once.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .to_string();
    d.send(&EngineRequest::ExpectKv {
        request: "z".into(),
        prefill: dead,
        blocks: vec![1],
        num_tokens: 10,
        first_token: 0,
        prompt: None,
        event: None,
    })
    .expect("send");
    let event = d.next_event().expect("event");
    assert_eq!(reasons(&event), vec!["HandshakeFailed".to_owned()], "{event:?}");
    let _ = Path::new("unused");
}

#[test]
fn registration_with_too_little_memory_is_refused_with_the_sizes() {
    let w = World::new("register");
    let s = w.agent("a", Transport::Tcp, false);
    let mut bad = spec(Role::Decode, "d0", kv(64, None), b"k", ChecksumPolicy::Disabled);
    bad.pairing_key = Vec::new();
    let e = SyntheticEngine::register(&s, &w.dir, &bad).expect_err("refused");
    assert!(e.contains("pairing_key"), "{e}");
    // An engine name past a Kubernetes name's bound: names are kept in the agent's side-channel
    // claims record (bounded: 17 names of 60 KiB made it unreadable at restart) and logs.
    let long = spec(
        Role::Decode,
        &"e".repeat(254),
        kv(64, None),
        b"k",
        ChecksumPolicy::Disabled,
    );
    let e = SyntheticEngine::register(&s, &w.dir, &long).expect_err("refused");
    assert!(e.contains("engine is 254 bytes; 1..=253 are accepted"), "{e}");
    // An engine memfd smaller than the layout: refused, naming both sizes.
    let good = spec(Role::Decode, "d1", kv(64, None), b"k", ChecksumPolicy::Disabled);
    let message = register_raw(
        &s,
        &good,
        Some(pdpair_agent::memory::pool::sealed_memfd(4096).expect("memfd")),
        None,
    );
    // 2 layers x K,V x 16 blocks x (64 tokens x 2 heads x 16 x 2 bytes).
    let need = 2 * 2 * 16 * 64 * 2 * 16 * 2;
    assert!(
        message.contains("holds 4096 bytes") && message.contains(&format!("needs {need}")),
        "{message}"
    );
}

/// Sends a registration with `fd` (announced as `memory_fd`) or `path`; returns the refusal.
fn register_raw(
    socket: &Path,
    spec: &pdpair_agent::synthetic::EngineSpec,
    fd: Option<std::fs::File>,
    path: Option<&Path>,
) -> String {
    use std::os::fd::AsFd;
    let stream = std::os::unix::net::UnixStream::connect(socket).expect("connect");
    let mut reg = SyntheticEngine::registration(spec, None, fd.is_some());
    reg.memory_path = path.map(|p| p.to_string_lossy().into_owned());
    let request = EngineRequest::RegisterPool(Box::new(reg));
    match &fd {
        Some(f) => pdpair_agent::wire::write_frame_fds(&stream, &request, &[f.as_fd()]),
        None => pdpair_agent::wire::write_frame(&mut &stream, &request),
    }
    .expect("send");
    match pdpair_agent::wire::read_frame::<AgentEvent>(&mut &stream).expect("answer") {
        AgentEvent::RegistrationFailed { message, .. } => message,
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_engine_pool_is_taken_only_as_a_sealed_memfd_never_a_path() {
    let w = World::new("register-fd");
    let s = w.agent("a", Transport::Tcp, false);
    let good = spec(Role::Decode, "d1", kv(64, None), b"k", ChecksumPolicy::Disabled);
    let need = 2 * 2 * 16 * 64 * 2 * 16 * 2;
    // A path (the agent would open it as root, wherever it points): refused, naming the field.
    let file = w.dir.join("pool.kv");
    std::fs::write(&file, vec![0u8; need]).expect("file");
    let message = register_raw(&s, &good, None, Some(&file));
    assert!(
        message.contains("memory_path") && message.contains("memfd"),
        "{message}"
    );
    // A plain file's descriptor, and a memfd without the shrink seal: refused (the engine
    // could truncate it under the agent).
    let plain = std::fs::File::options()
        .read(true)
        .write(true)
        .open(&file)
        .expect("open");
    let message = register_raw(&s, &good, Some(plain), None);
    assert!(message.contains("F_SEAL_SHRINK"), "{message}");
    #[allow(unsafe_code)]
    // SAFETY: memfd_create with a static name; the descriptor is owned by the File.
    let unsealed = unsafe {
        use std::os::fd::FromRawFd;
        std::fs::File::from_raw_fd(libc::memfd_create(c"x".as_ptr(), libc::MFD_ALLOW_SEALING))
    };
    unsealed.set_len(need as u64).expect("size");
    let message = register_raw(&s, &good, Some(unsealed), None);
    assert!(message.contains("F_SEAL_SHRINK"), "{message}");
    // A huge-page memfd: a hole the engine punches after registering would fault in a huge page
    // when the agent touches it, and with none free the agent dies of SIGBUS. Refused (checked
    // before its pages are counted: no huge pages need be free here).
    #[allow(unsafe_code)]
    // SAFETY: memfd_create with a static name; the descriptor is owned by the File.
    let huge = unsafe {
        use std::os::fd::FromRawFd;
        let fd = libc::memfd_create(c"x".as_ptr(), libc::MFD_HUGETLB | libc::MFD_ALLOW_SEALING);
        assert!(
            fd >= 0,
            "memfd_create(MFD_HUGETLB): {}",
            std::io::Error::last_os_error()
        );
        std::fs::File::from_raw_fd(fd)
    };
    huge.set_len((need as u64).next_multiple_of(2 << 20)).expect("size");
    #[allow(unsafe_code)]
    // SAFETY: a memfd made with MFD_ALLOW_SEALING.
    let sealed = unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&huge),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK,
        )
    };
    assert_eq!(sealed, 0, "seal");
    let message = register_raw(&s, &good, Some(huge), None);
    assert!(message.contains("huge-page memfd"), "{message}");
    // Sealed and long enough, but sparse: the agent would fault its pages in, charged to its own
    // memory cgroup (a sparse memfd of any size got it killed at its limit). Refused; the same
    // memfd allocated is taken.
    let sparse = pdpair_agent::memory::pool::sealed_memfd(need).expect("memfd");
    let message = register_raw(&s, &good, Some(sparse), None);
    assert!(
        message.contains(&format!(
            "has 0 of the {need} bytes the geometry needs backed by memory"
        )),
        "{message}"
    );
    // As many bytes allocated as the geometry needs, but past the ones it maps: the agent would
    // fault in every page it maps. Refused, naming what is backed of those it maps. (The memfd
    // allocated with fallocate below, never written, is taken.)
    let after = pdpair_agent::memory::pool::sealed_memfd(2 * need).expect("memfd");
    // SAFETY: fallocate within the memfd's size.
    #[allow(unsafe_code)]
    let rc = unsafe {
        libc::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&after),
            0,
            need as libc::off_t,
            need as libc::off_t,
        )
    };
    assert_eq!(rc, 0, "fallocate");
    let message = register_raw(&s, &good, Some(after), None);
    assert!(
        message.contains(&format!("has 0 of the {need} bytes the geometry needs (its first ones")),
        "{message}"
    );
    let backed = pdpair_agent::memory::pool::backed_memfd(need).expect("memfd");
    let stream = std::os::unix::net::UnixStream::connect(&s).expect("connect");
    let reg = SyntheticEngine::registration(&good, None, true);
    pdpair_agent::wire::write_frame_fds(
        &stream,
        &EngineRequest::RegisterPool(Box::new(reg)),
        &[std::os::fd::AsFd::as_fd(&backed)],
    )
    .expect("send");
    let answer = pdpair_agent::wire::read_frame::<AgentEvent>(&mut &stream).expect("answer");
    assert!(matches!(&answer, AgentEvent::Registered { .. }), "{answer:?}");
    drop(stream);
    // memory_fd announced without a descriptor.
    let stream = std::os::unix::net::UnixStream::connect(&s).expect("connect");
    let reg = SyntheticEngine::registration(&good, None, true);
    pdpair_agent::wire::write_frame(&mut &stream, &EngineRequest::RegisterPool(Box::new(reg))).expect("send");
    let answer = pdpair_agent::wire::read_frame::<AgentEvent>(&mut &stream).expect("answer");
    assert!(
        matches!(&answer, AgentEvent::RegistrationFailed { message, .. } if message.contains("carried 0 descriptors; the pool has 1 regions")),
        "{answer:?}"
    );
}

#[test]
fn a_pool_the_agent_allocates_cannot_be_shrunk_by_its_engine_over_tcp() {
    // Without shared memory the agent makes a memfd sealed against shrinking and growing.
    let w = World::new("sealed");
    let s = w.agent("a", Transport::Tcp, false);
    let e = SyntheticEngine::register(
        &s,
        &w.dir,
        &spec(Role::Decode, "d0", kv(64, None), b"k", ChecksumPolicy::Disabled),
    )
    .expect("registered");
    let truncated = e.pool_file(0).set_len(0);
    assert!(truncated.is_err(), "the engine shrank its pool");
}

/// Whether a read ended because the peer closed (EOF or reset), not because it timed out.
fn closed(r: std::io::Result<usize>) -> bool {
    match r {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[test]
fn malformed_and_truncated_frames_close_the_connection_and_the_agent_keeps_serving() {
    use std::io::{Read, Write};
    let w = World::new("garbage");
    let (ps, ds) = (w.agent("p", Transport::Tcp, false), w.agent("d", Transport::Tcp, false));
    let (mut p, mut d) = p0_d0(&w, &ps, &ds, 16, ChecksumPolicy::FailClosed);
    let garbage: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        vec![0, 0, 0, 0],
        vec![0x7f, 0xff, 0xff, 0xff],
        [&40u32.to_be_bytes()[..], b"{\"type\":\"Hello\""].concat(),
        [&9u32.to_be_bytes()[..], b"not json!"].concat(),
    ];
    // The side channel.
    for bytes in &garbage {
        let mut s = std::net::TcpStream::connect(&p.address).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        s.write_all(bytes).expect("write");
        let _ = s.shutdown(std::net::Shutdown::Write);
        // The agent answers with at most a Reject frame, then closes (a reset when it closed
        // with our bytes unread).
        assert!(closed(s.read_to_end(&mut Vec::new())));
    }
    // The engine API socket.
    for bytes in &garbage {
        let mut s = std::os::unix::net::UnixStream::connect(&ps).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        s.write_all(bytes).expect("write");
        let _ = s.shutdown(std::net::Shutdown::Write);
        assert!(closed(s.read_to_end(&mut Vec::new())));
    }
    // Still serving.
    let (event, bad) = request(
        &mut p,
        &mut d,
        Req {
            id: "after",
            seed: 1,
            p_first: 0,
            d_first: 0,
            tokens: 40,
            blocks: 3,
        },
    );
    assert!(done(&event), "{event:?}");
    assert_eq!(bad, 0);
}

#[test]
fn kv_ready_and_registration_arriving_together_always_match() {
    // The prefill engine's KvReady and decode's Register reach the prefill agent on different
    // threads at about the same time; each must find the other whichever lands first. Many
    // back-to-back requests make the interleavings likely (a lost match would end in
    // DeadlineExceeded).
    let w = World::new("race");
    let (ps, ds) = (w.agent("p", Transport::Shm, false), w.agent("d", Transport::Shm, false));
    let (mut p, mut d) = p0_d0(&w, &ps, &ds, 16, ChecksumPolicy::Disabled);
    // Prefill's own events are read as a real engine would (unread, they would fill its socket).
    let mut events = p.events().expect("events");
    std::thread::spawn(move || while pdpair_agent::wire::read_frame::<AgentEvent>(&mut events).is_ok() {});
    for i in 0..200 {
        let id = format!("r{i}");
        // Alternate the order the two sides speak in.
        let ready = EngineRequest::KvReady {
            release_token: None,
            request: id.clone(),
            blocks: vec![0],
            num_tokens: 16,
            first_token: 0,
            prompt: None,
            event: None,
        };
        let expect = EngineRequest::ExpectKv {
            request: id.clone(),
            prefill: p.address.clone(),
            blocks: vec![1],
            num_tokens: 16,
            first_token: 0,
            prompt: None,
            event: None,
        };
        if i % 2 == 0 {
            p.send(&ready).expect("send");
            d.send(&expect).expect("send");
        } else {
            d.send(&expect).expect("send");
            p.send(&ready).expect("send");
        }
        let event = d.next_event().expect("event");
        assert!(done(&event), "request {i}: {event:?}");
    }
}

#[test]
fn a_decode_rank_gets_its_heads_from_the_prefill_rank_that_holds_them() {
    for mode in [TransferMode::Push, TransferMode::Pull] {
        decode_rank_takes_part_of_a_prefill_rank(mode);
    }
}

fn decode_rank_takes_part_of_a_prefill_rank(mode: TransferMode) {
    // 8 KV heads; prefill TP 2 rank 1 holds heads 4..8; decode TP 4 rank 3 holds heads 6..8: the
    // second half of prefill's heads, at a non-zero offset inside each prefill block.
    let w = World::new(&format!("ranks-{mode:?}"));
    let (ps, ds) = (w.agent("p", Transport::Shm, false), w.agent("d", Transport::Shm, false));
    let mut geometry = kv(16, None);
    geometry.kv_heads = 8;
    let mut p_spec = spec(Role::Prefill, "p1", geometry.clone(), b"k", ChecksumPolicy::FailClosed);
    p_spec.parallelism.tensor = 2;
    p_spec.tensor_rank = 1;
    let mut d_spec = spec(Role::Decode, "d3", geometry, b"k", ChecksumPolicy::FailClosed);
    d_spec.parallelism.tensor = 4;
    d_spec.tensor_rank = 3;
    (p_spec.mode, d_spec.mode) = (mode, mode);
    let mut p = SyntheticEngine::register(&ps, &w.dir, &p_spec).expect("P");
    let mut d = SyntheticEngine::register(&ds, &w.dir, &d_spec).expect("D");
    assert_eq!((p.layout.head_offset, p.layout.local_heads), (4, 4));
    assert_eq!((d.layout.head_offset, d.layout.local_heads), (6, 2));
    let (event, bad) = request(
        &mut p,
        &mut d,
        Req {
            id: "r",
            seed: 3,
            p_first: 0,
            d_first: 0,
            tokens: 40,
            blocks: 3,
        },
    );
    assert!(
        matches!(&event, AgentEvent::RequestDone { checksum: Some(c), .. } if c == "Verified"),
        "{mode:?}: {event:?}"
    );
    assert_eq!(bad, 0, "{mode:?}: decode holds exactly heads 6 and 7 of every token");
    // The side that moved the bytes (push: prefill's agent, pull: decode's) counts the path.
    let (mover, idle) = if mode == TransferMode::Push { (0, 1) } else { (1, 0) };
    assert_eq!(transfers_over(&w, mover, "SharedMemory"), 1, "{mode:?}");
    assert_eq!(transfers_over(&w, idle, "SharedMemory"), 0, "{mode:?}");
}

#[test]
fn a_decode_rank_gathers_its_heads_from_every_prefill_rank() {
    for mode in [TransferMode::Push, TransferMode::Pull] {
        decode_rank_gathers(mode);
    }
}

fn decode_rank_gathers(mode: TransferMode) {
    // 8 KV heads; prefill TP 2 (ranks hold heads 0..4 and 4..8, each on its own agent), decode
    // TP 1 (all 8). Each prefill rank writes (push) or decode reads (pull) its half of every
    // block; decode's whole-block checksums equal the sum of the ranks' partial ones.
    let w = World::new(&format!("gather-{mode:?}"));
    let (p0s, p1s, ds) = (
        w.agent("p0", Transport::Shm, false),
        w.agent("p1", Transport::Shm, false),
        w.agent("d", Transport::Shm, false),
    );
    let mut geometry = kv(16, None);
    geometry.kv_heads = 8;
    let rank = |r: u32| {
        let mut s = spec(
            Role::Prefill,
            &format!("p{r}"),
            geometry.clone(),
            b"k",
            ChecksumPolicy::FailClosed,
        );
        s.parallelism.tensor = 2;
        s.tensor_rank = r;
        s.mode = mode;
        s
    };
    let mut p0 = SyntheticEngine::register(&p0s, &w.dir, &rank(0)).expect("P0");
    let mut p1 = SyntheticEngine::register(&p1s, &w.dir, &rank(1)).expect("P1");
    let mut d_spec = spec(Role::Decode, "d0", geometry, b"k", ChecksumPolicy::FailClosed);
    d_spec.mode = mode;
    let mut d = SyntheticEngine::register(&ds, &w.dir, &d_spec).expect("D");
    for p in [&mut p0, &mut p1] {
        ready(p, "g", 9);
    }
    d.clear(&[5, 6, 7]);
    let both = vec![p0.address.clone(), p1.address.clone()];
    expect_from(&mut d, "g", &both);
    let event = d.next_event().expect("event");
    assert!(
        matches!(&event, AgentEvent::RequestDone { checksum: Some(c), .. } if c == "Verified"),
        "{mode:?}: {event:?}"
    );
    assert_eq!(
        d.verify(9, &[5, 6, 7], 0, 40),
        0,
        "{mode:?}: all 8 heads of every token arrived"
    );
    // One prefill rank never finishes its part: its lease ends and it says so, so the request
    // fails with the reason instead of hanging.
    ready(&mut p0, "h", 10);
    expect_from(&mut d, "h", &both);
    let event = d.next_event().expect("event");
    assert_eq!(reasons(&event), vec!["LeaseExpired".to_owned()], "{mode:?}: {event:?}");
    // A request naming one of the two ranks (a prefill's params made before its other rank
    // registered, or a client's): it ended done with heads 0..4 never written, and its
    // checksums verified (untouched heads add nothing). Refused, naming both counts.
    ready(&mut p1, "half", 11);
    d.clear(&[5, 6, 7]);
    d.send(&EngineRequest::ExpectKv {
        request: "half".into(),
        prefill: p1.address.clone(),
        blocks: vec![5, 6, 7],
        num_tokens: 40,
        first_token: 0,
        prompt: None,
        event: None,
    })
    .expect("ExpectKv");
    let event = d.next_event().expect("event");
    assert_eq!(
        reasons(&event),
        vec!["InvalidRequest".to_owned()],
        "{mode:?}: {event:?}"
    );
    assert!(format!("{event:?}").contains("names 1 prefill rank(s)"), "{event:?}");
}

/// A prefill rank of [`decode_rank_gathers`] fills blocks 0..3 (40 tokens of `seed`) and
/// offers them as `request`.
fn ready(p: &mut SyntheticEngine, request: &str, seed: u64) {
    p.fill(seed, &[0, 1, 2], 0, 40);
    p.send(&EngineRequest::KvReady {
        release_token: None,
        request: request.into(),
        blocks: vec![0, 1, 2],
        num_tokens: 40,
        first_token: 0,
        prompt: None,
        event: None,
    })
    .expect("KvReady");
}

/// Decode of [`decode_rank_gathers`] asks `prefills` for `request` into its blocks 5..8.
fn expect_from(d: &mut SyntheticEngine, request: &str, prefills: &[String]) {
    d.send(&EngineRequest::ExpectKvFrom {
        request: request.into(),
        prefills: prefills.to_vec(),
        blocks: vec![5, 6, 7],
        num_tokens: 40,
        first_token: 0,
        prompt: None,
        event: None,
    })
    .expect("ExpectKvFrom");
}

#[test]
fn a_stuck_prefill_is_lost_after_missed_heartbeats_not_at_the_deadline() {
    let mut w = World::new("heartbeat");
    // The in-process decode agent pings every 200 ms: 5 unanswered pings (1 s) lose the peer,
    // well before the request deadline (handshake 2 s + lease 3 s).
    w.heartbeat = Duration::from_millis(200);
    let (p_agent, ps) = ProcessAgent::start(&w, "p");
    let ds = w.agent("d", Transport::Tcp, false);
    let (mut p, mut d) = p0_d0(&w, &ps, &ds, 64, ChecksumPolicy::FailClosed);
    let req = |id| Req {
        id,
        seed: 1,
        p_first: 0,
        d_first: 0,
        tokens: 100,
        blocks: 2,
    };
    let (event, bad) = request(&mut p, &mut d, req("before"));
    assert!(done(&event) && bad == 0, "{event:?}");
    // Idle for several heartbeats: a live prefill answers every ping and stays connected.
    std::thread::sleep(Duration::from_millis(1500));
    let (event, bad) = request(&mut p, &mut d, req("idle"));
    assert!(done(&event) && bad == 0, "{event:?}");
    let text = w.metrics.lock().expect("metrics")[0].render();
    assert!(
        text.lines()
            .any(|l| l.ends_with("handshakes_total{outcome=\"accepted\"} 1")),
        "one handshake: the idle link was kept, not dropped and redialled:\n{text}"
    );
    // Now prefill's agent stops (alive, connection open, silent).
    p_agent.signal(libc::SIGSTOP);
    d.send(&EngineRequest::ExpectKv {
        request: "stuck".into(),
        prefill: p.address.clone(),
        blocks: vec![9, 10],
        num_tokens: 100,
        first_token: 0,
        prompt: None,
        event: None,
    })
    .expect("ExpectKv");
    let event = d.next_event().expect("event");
    assert_eq!(reasons(&event), vec!["PeerLost".to_owned()], "{event:?}");
    assert!(
        matches!(&event, AgentEvent::RequestFailed { message, .. } if message.contains("heartbeats unanswered")),
        "{event:?}"
    );
}

#[test]
fn an_engine_pausing_its_reading_while_a_deadline_passes_keeps_its_prefill_links() {
    // A decode engine may pause reading its events (up to the 10 s write timeout): a deadline
    // passing meanwhile has its answer wait on the engine's socket, and the engine's links
    // must live on (their heartbeats run on a thread of their own, which never waits there;
    // they ran on the engine's timer, which a review found could: here the answer waits on the
    // link's reader instead, and the link lived either way).
    let mut w = World::new("heartbeat-paused");
    w.heartbeat = Duration::from_millis(200); // a link is lost after 1 s without a Pong
    let (ps, ds) = (w.agent("p", Transport::Tcp, false), w.agent("d", Transport::Tcp, false));
    // Prefill holds what decode registers for 10 s: decode's own deadline (5 s) comes first,
    // on decode's timer.
    let mut p_spec = spec(Role::Prefill, "p0", kv(64, None), b"k", ChecksumPolicy::FailClosed);
    p_spec.lease_ms = 10_000;
    let mut p = SyntheticEngine::register(&ps, &w.dir, &p_spec).expect("P");
    let mut d = SyntheticEngine::register(
        &ds,
        &w.dir,
        &spec(Role::Decode, "d0", kv(64, None), b"k", ChecksumPolicy::FailClosed),
    )
    .expect("D");
    // Deadlines are 5 s (handshake 2 s + lease 3 s): "short" passes its deadline at 5 s, while
    // the engine reads nothing; "long" (at 9 s) is served once it reads again.
    let start = Instant::now();
    expect_kv(&mut d, "short", p.address.clone(), &[1, 2], 100);
    std::thread::sleep(Duration::from_secs(4));
    expect_kv(&mut d, "long", p.address.clone(), &[3, 4], 100);
    // The engine stops reading, and its agent's answers fill the socket (requests that do not
    // decode, each refused on its own): its writer waits.
    let mut flood = d.events().expect("socket");
    flood.set_write_timeout(Some(Duration::from_secs(8))).expect("timeout");
    let flooding = std::thread::spawn(move || {
        for i in 0..20_000 {
            let frame = serde_json::json!({"type": "ExpectKv", "request": format!("x{i}"), "blocks": "none"});
            if pdpair_agent::wire::write_frame(&mut flood, &frame).is_err() {
                return;
            }
        }
    });
    // Paused 2 s past "short"'s deadline: twice what loses a link that hears no Pong.
    std::thread::sleep((start + Duration::from_secs(7)).saturating_duration_since(Instant::now()));
    p.fill(7, &[5, 6], 0, 100);
    kv_ready(&mut p, "long", &[5, 6], 100);
    d.wait_events_for(Duration::from_secs(10)).expect("timeout");
    let long = loop {
        let e = d.next_event().expect("events until long's answer");
        if let AgentEvent::RequestDone { request, .. } | AgentEvent::RequestFailed { request, .. } = &e
            && request == "long"
        {
            break e;
        }
    };
    assert!(done(&long), "{long:?}");
    assert_eq!(d.verify(7, &[3, 4], 0, 100), 0, "long's KV landed");
    let _ = flooding.join();
}

#[test]
fn two_decode_ranks_take_their_heads_from_one_prefill_rank_and_prefill_hears_once() {
    for mode in [TransferMode::Push, TransferMode::Pull] {
        // 8 KV heads; prefill TP 2 rank 0 holds heads 0..4; decode TP 4 ranks 0 and 1 hold 0..2
        // and 2..4: both take their heads from that one prefill rank, registering separately.
        let w = World::new(&format!("two-consumers-{mode:?}"));
        let (ps, ds) = (w.agent("p", Transport::Shm, false), w.agent("d", Transport::Shm, false));
        let mut geometry = kv(16, None);
        geometry.kv_heads = 8;
        let mut p_spec = spec(Role::Prefill, "p0", geometry.clone(), b"k", ChecksumPolicy::FailClosed);
        // Two handshakes on one prefill rank, each with its UCX probe: 2 s was once too short
        // on a loaded 2-core machine (EAGAIN); nothing here waits for a deadline to pass.
        (p_spec.parallelism.tensor, p_spec.mode, p_spec.handshake_timeout_ms) = (2, mode, 10_000);
        let mut p = SyntheticEngine::register(&ps, &w.dir, &p_spec).expect("P");
        let mut d: Vec<SyntheticEngine> = (0..2)
            .map(|r| {
                let mut s = spec(
                    Role::Decode,
                    &format!("d{r}"),
                    geometry.clone(),
                    b"k",
                    ChecksumPolicy::FailClosed,
                );
                (s.parallelism.tensor, s.tensor_rank, s.mode, s.handshake_timeout_ms) = (4, r, mode, 10_000);
                SyntheticEngine::register(&ds, &w.dir, &s).expect("D rank")
            })
            .collect();
        p.fill(5, &[0, 1, 2], 0, 40);
        p.send(&EngineRequest::KvReady {
            release_token: None,
            request: "r".into(),
            blocks: vec![0, 1, 2],
            num_tokens: 40,
            first_token: 0,
            prompt: None,
            event: None,
        })
        .expect("KvReady");
        let mut bytes = 0;
        for rank in &mut d {
            rank.clear(&[4, 5, 6]);
            rank.send(&EngineRequest::ExpectKv {
                request: "r".into(),
                prefill: p.address.clone(),
                blocks: vec![4, 5, 6],
                num_tokens: 40,
                first_token: 0,
                prompt: None,
                event: None,
            })
            .expect("ExpectKv");
        }
        for rank in &mut d {
            let event = rank.next_event().expect("event");
            match &event {
                AgentEvent::RequestDone {
                    checksum: Some(c),
                    bytes: b,
                    ..
                } if c == "Verified" => bytes += b,
                _ => panic!("{mode:?}: {event:?}"),
            }
            assert_eq!(
                rank.verify(5, &[4, 5, 6], 0, 40),
                0,
                "{mode:?}: each rank holds its own heads"
            );
        }
        // Prefill's engine hears once, when both have been served: bytes summed.
        let finals: Vec<AgentEvent> = std::iter::from_fn(|| p.next_event().ok())
            .filter(|e| !matches!(e, AgentEvent::TransferStarted { .. }))
            .take(1)
            .collect();
        assert!(
            matches!(&finals[..], [AgentEvent::RequestDone { bytes: b, .. }] if *b == bytes),
            "{mode:?}: {finals:?} (decode ranks got {bytes} bytes)"
        );
        // Per decode rank: whole blocks (3 x 16 token slots) x 2 heads x 2 layers x 16 x 2 bytes
        // x K,V.
        assert_eq!(bytes, 2 * (48 * 2 * 2 * 16 * 2 * 2), "{mode:?}");
    }
}

#[test]
fn given_every_prefill_rank_the_agent_asks_the_ones_holding_its_heads() {
    // 8 KV heads, prefill TP 2 (ranks on one agent). Decode TP 4 rank 3 (heads 6..8) names both
    // prefill ranks and is served by rank 1 alone; decode TP 1 names both and gathers from both.
    let w = World::new("pool-ranks");
    let (ps, ds) = (w.agent("p", Transport::Shm, false), w.agent("d", Transport::Shm, false));
    let mut geometry = kv(16, None);
    geometry.kv_heads = 8;
    let rank = |role, name: &str, tp, r| {
        let mut s = spec(role, name, geometry.clone(), b"k", ChecksumPolicy::FailClosed);
        s.parallelism.tensor = tp;
        s.tensor_rank = r;
        s
    };
    let mut p0 = SyntheticEngine::register(&ps, &w.dir, &rank(Role::Prefill, "p0", 2, 0)).expect("P0");
    let mut p1 = SyntheticEngine::register(&ps, &w.dir, &rank(Role::Prefill, "p1", 2, 1)).expect("P1");
    let mut d3 = SyntheticEngine::register(&ds, &w.dir, &rank(Role::Decode, "d3", 4, 3)).expect("D3");
    let mut whole = SyntheticEngine::register(&ds, &w.dir, &rank(Role::Decode, "d", 1, 0)).expect("D");
    let ready = |p: &mut SyntheticEngine, id: &str| {
        p.fill(11, &[1, 2, 3], 0, 40);
        p.send(&EngineRequest::KvReady {
            release_token: None,
            request: id.into(),
            blocks: vec![1, 2, 3],
            num_tokens: 40,
            first_token: 0,
            prompt: None,
            event: None,
        })
        .expect("KvReady");
    };
    let ask = |d: &mut SyntheticEngine, id: &str, ranks: Vec<String>| {
        d.clear(&[4, 5, 6]);
        d.send(&EngineRequest::ExpectKvFromPool {
            request: id.into(),
            prefill_ranks: ranks,
            blocks: vec![4, 5, 6],
            num_tokens: 40,
            first_token: 0,
            prompt: None,
            event: None,
        })
        .expect("ExpectKvFromPool");
        let event = d.next_event().expect("event");
        (event, d.verify(11, &[4, 5, 6], 0, 40))
    };
    ready(&mut p1, "one");
    let (event, bad) = ask(&mut d3, "one", vec![p0.address.clone(), p1.address.clone()]);
    assert!(done(&event) && bad == 0, "{event:?}, {bad} bad");
    // (Prefill rank 1 serves decode ranks 2 and 3; only rank 3 runs here, so its engine hears
    // LeaseExpired later: that is the multi-rank rule, not this test's concern.)
    ready(&mut p0, "both");
    ready(&mut p1, "both");
    let (event, bad) = ask(&mut whole, "both", vec![p1.address.clone(), p0.address.clone()]);
    assert!(done(&event) && bad == 0, "{event:?}, {bad} bad");
    // A pool list missing the rank that holds the heads is refused naming it.
    let (event, _) = ask(&mut d3, "missing", vec![p0.address.clone()]);
    assert_eq!(reasons(&event), vec!["InvalidRequest".to_owned()], "{event:?}");
}
