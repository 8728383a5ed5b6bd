//! What an agent says it can do (`Capabilities`), and GPU pool registrations checked field by
//! field: malformed ones are refused naming the field, and without a CUDA driver (CI) every GPU
//! pool is refused saying so, and the agent keeps serving. A real agent in this process, real
//! UCX (Debian's 1.13: host memory only); the GPU list is the machine's real CUDA driver's. GPU
//! pools that are served are tested in `gpu.rs` (`make gpu-check`).

use std::os::unix::net::UnixStream;

use pdpair_agent::{
    engine_api::{AgentEvent, EngineRequest, GpuPool, GpuRegion, PoolRegistration},
    memory::cuda,
    synthetic::SyntheticEngine,
    transport::ucx::{self, Transport},
    wire,
};
use pdpair_api::{ChecksumPolicy, Role};

mod common;

use common::{World, kv, spec};

fn connect(socket: &std::path::Path) -> UnixStream {
    let s = UnixStream::connect(socket).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("timeout");
    s
}

fn ask(s: &mut UnixStream, what: &EngineRequest) -> AgentEvent {
    wire::write_frame(s, what).expect("send");
    wire::read_frame::<AgentEvent>(s).expect("an answer")
}

fn host_registration() -> PoolRegistration {
    SyntheticEngine::registration(
        &spec(Role::Prefill, "p0", kv(64, None), b"k", ChecksumPolicy::FailClosed),
        None,
        false,
    )
}

/// A well-formed GPU pool for the one-region registration above.
fn gpu_pool() -> GpuPool {
    GpuPool {
        device_uuid: "GPU-5f1c2a3b-0d4e-4f60-8a9b-0c1d2e3f4a5b".into(),
        regions: vec![GpuRegion {
            ipc_handle: Some("ab".repeat(64)),
            offset: 4096,
        }],
        event: Some("cd".repeat(64)),
        events: Vec::new(),
    }
}

#[test]
fn capabilities_say_what_ucx_and_the_driver_allow_and_registration_follows_on_the_same_connection() {
    let w = World::new("caps");
    let socket = w.agent("a", Transport::Auto, false);
    let mut s = connect(&socket);
    let AgentEvent::Capabilities {
        api_version,
        agent,
        ucx_version,
        ucx_memory_types,
        gpus,
        pool_memory,
        gpu_pools_refused,
        gpu_between_agents,
        gpu_sharing,
        gpu_events,
        renew_prefills,
    } = ask(&mut s, &EngineRequest::Capabilities)
    else {
        panic!("not Capabilities");
    };
    println!("UCX {ucx_version}: {ucx_memory_types:?}; GPUs {gpus:?}; refused: {gpu_pools_refused:?}");
    assert_eq!(api_version, pdpair_agent::engine_api::API_VERSION);
    assert_eq!(agent, "a");
    assert!(gpu_events, "this agent waits for the event a KvReady or ExpectKv names");
    assert!(renew_prefills, "this agent takes a Renew's every rank in one frame");
    assert_eq!(ucx_version, ucx::version());
    // What this UCX reports, from its own context.
    let types = ucx::Context::new(Transport::Auto, None)
        .expect("context")
        .memory_types();
    assert_eq!(
        ucx_memory_types,
        types.iter().map(|t| t.as_str().to_owned()).collect::<Vec<_>>()
    );
    assert!(ucx_memory_types.contains(&"host".to_owned()));
    // No RDMA device here: `auto` runs the KV stream, over which GPU pools reach other agents.
    assert!(
        gpu_between_agents,
        "an agent on the KV stream moves GPU KV to other agents"
    );
    assert_eq!(gpus.len(), cuda::devices().map(|d| d.len()).unwrap_or(0));
    if cuda::devices().is_ok_and(|d| !d.is_empty()) {
        assert_eq!(pool_memory, vec!["host".to_owned(), "cuda".to_owned()]);
        assert_eq!(gpu_pools_refused, None);
        assert_eq!(gpu_sharing, vec!["ipc_handle".to_owned(), "vmm_fd".to_owned()]);
    } else {
        assert_eq!(pool_memory, vec!["host".to_owned()]);
        assert!(gpu_sharing.is_empty(), "{gpu_sharing:?}");
        let why = gpu_pools_refused.expect("GPU pools are refused, saying why");
        if !cuda::driver_present() {
            assert!(why.contains("no CUDA driver"), "{why}");
        }
    }
    // The same connection then registers.
    let answer = ask(&mut s, &EngineRequest::RegisterPool(Box::new(host_registration())));
    assert!(matches!(answer, AgentEvent::Registered { .. }), "{answer:?}");
    // And may ask again.
    let again = ask(&mut s, &EngineRequest::Capabilities);
    assert!(matches!(again, AgentEvent::Capabilities { .. }), "{again:?}");
    // Twice before registering is refused.
    let mut t = connect(&socket);
    assert!(matches!(
        ask(&mut t, &EngineRequest::Capabilities),
        AgentEvent::Capabilities { .. }
    ));
    let second = ask(&mut t, &EngineRequest::Capabilities);
    assert!(
        matches!(&second, AgentEvent::RegistrationFailed { message, .. } if message.contains("must be RegisterPool")),
        "{second:?}"
    );
    // An agent on UCX (shared memory here; RDMA between nodes) moves no GPU KV to other agents.
    let ucx = w.agent("b", Transport::Shm, false);
    let answer = ask(&mut connect(&ucx), &EngineRequest::Capabilities);
    assert!(
        matches!(
            answer,
            AgentEvent::Capabilities {
                gpu_between_agents: false,
                ..
            }
        ),
        "{answer:?}"
    );
}

#[test]
fn gpu_pools_are_refused_naming_the_field_or_the_reason_and_the_agent_keeps_serving() {
    let w = World::new("caps-gpu");
    let socket = w.agent("a", Transport::Tcp, false);
    let with = |f: &dyn Fn(&mut PoolRegistration, &mut GpuPool)| {
        let mut reg = host_registration();
        let mut gpu = gpu_pool();
        f(&mut reg, &mut gpu);
        reg.gpu = Some(gpu);
        reg
    };
    // Where a GPU is, a well-formed pool gets as far as opening its (made-up) handle.
    let well_formed = if cuda::driver_present() {
        "gpu."
    } else {
        "GPU pools are not accepted"
    };
    let cases: Vec<(&str, PoolRegistration)> = vec![
        (well_formed, with(&|_, _| {})),
        ("gpu.device_uuid", with(&|_, g| g.device_uuid = "GPU-0".into())),
        (
            "gpu.regions has 2 entries; the pool has 1",
            with(&|_, g| g.regions.push(g.regions[0].clone())),
        ),
        ("gpu.regions has 0 entries", with(&|_, g| g.regions.clear())),
        (
            "gpu.regions[0].ipc_handle",
            with(&|_, g| g.regions[0].ipc_handle = Some("ab".repeat(63))),
        ),
        (
            "gpu.regions[0].ipc_handle",
            with(&|_, g| g.regions[0].ipc_handle = Some("zz".repeat(64))),
        ),
        ("gpu.regions[0].offset", with(&|_, g| g.regions[0].offset = u64::MAX)),
        ("gpu.event", with(&|_, g| g.event = Some("00".into()))),
        (
            "gpu.events[1]",
            with(&|_, g| g.events = vec!["ef".repeat(64), "0".into()]),
        ),
        (
            "gpu.events has 65 entries; at most 64",
            with(&|_, g| g.events = vec!["ef".repeat(64); 65]),
        ),
        (
            "gpu.events without gpu.event",
            with(&|_, g| (g.event, g.events) = (None, vec!["ef".repeat(64)])),
        ),
        ("gpu and memory_fd are both set", with(&|r, _| r.memory_fd = true)),
    ];
    for (expected, reg) in cases {
        let mut s = connect(&socket);
        let answer = ask(&mut s, &EngineRequest::RegisterPool(Box::new(reg)));
        assert!(
            matches!(&answer, AgentEvent::RegistrationFailed { message, .. } if message.contains(expected)),
            "{expected}: {answer:?}"
        );
        if expected == "GPU pools are not accepted" && !cuda::driver_present() {
            assert!(format!("{answer:?}").contains("no CUDA driver"), "{answer:?}");
        }
    }
    // Nothing half-registered: a host pool still registers.
    let mut s = connect(&socket);
    let answer = ask(&mut s, &EngineRequest::RegisterPool(Box::new(host_registration())));
    assert!(matches!(answer, AgentEvent::Registered { .. }), "{answer:?}");
}

/// `n` descriptors to attach to a frame (memfds: what they are is the driver's to check when a
/// GPU pool maps them; everything here is refused before that).
#[allow(unsafe_code)]
fn descriptors(n: usize) -> Vec<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    (0..n)
        .map(|_| {
            // SAFETY: memfd_create with a static name; the new descriptor is owned here.
            let fd = unsafe { libc::memfd_create(c"vmm".as_ptr(), libc::MFD_CLOEXEC) };
            assert!(fd >= 0, "memfd_create");
            // SAFETY: as above.
            unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }
        })
        .collect()
}

/// Sends `ShareGpuMemory` frames (each `sizes` with one descriptor per size, or `fds` of them)
/// and then `then`; the agent's answer.
fn share_then(socket: &std::path::Path, frames: &[(Vec<u64>, usize)], then: Option<EngineRequest>) -> AgentEvent {
    use std::os::fd::AsFd;
    let mut s = connect(socket);
    for (sizes, fds) in frames {
        let fds = descriptors(*fds);
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        // The agent may already have refused and closed: its answer says why.
        if wire::write_frame_fds(&s, &EngineRequest::ShareGpuMemory { sizes: sizes.clone() }, &borrowed).is_err() {
            break;
        }
    }
    if let Some(then) = then {
        let _ = wire::write_frame(&mut s, &then);
    }
    wire::read_frame::<AgentEvent>(&mut s).expect("an answer")
}

#[test]
fn gpu_memory_shared_as_descriptors_is_checked_against_the_registration_and_refused_naming_why() {
    let w = World::new("caps-vmm");
    let socket = w.agent("a", Transport::Tcp, false);
    let mb2 = 2u64 << 20;
    let vmm_pool = |regions: usize| {
        let mut reg = host_registration();
        let mut gpu = gpu_pool();
        gpu.regions = (0..regions)
            .map(|_| GpuRegion {
                ipc_handle: None,
                offset: 0,
            })
            .collect();
        reg.gpu = Some(gpu);
        EngineRequest::RegisterPool(Box::new(reg))
    };
    let refused = |answer: AgentEvent, expected: &str| {
        assert!(
            matches!(&answer, AgentEvent::RegistrationFailed { message, .. } if message.contains(expected)),
            "{expected}: {answer:?}"
        );
    };
    // One size per descriptor.
    refused(
        share_then(&socket, &[(vec![mb2, mb2], 1)], Some(vmm_pool(1))),
        "ShareGpuMemory names 2 sizes and carried 1 file descriptors",
    );
    refused(
        share_then(&socket, &[(vec![], 0)], Some(vmm_pool(1))),
        "names 0 sizes and carried 0 file descriptors",
    );
    // Shared memory for a registration that is not a GPU pool, or that no region lies in.
    refused(
        share_then(
            &socket,
            &[(vec![mb2; 3], 3)],
            Some(EngineRequest::RegisterPool(Box::new(host_registration()))),
        ),
        "3 GPU allocations were shared (ShareGpuMemory), but the registration is not a GPU pool",
    );
    let mut all_ipc = host_registration();
    all_ipc.gpu = Some(gpu_pool());
    refused(
        share_then(
            &socket,
            &[(vec![mb2], 1)],
            Some(EngineRequest::RegisterPool(Box::new(all_ipc))),
        ),
        "every gpu.regions entry names an ipc_handle",
    );
    // A region without a handle needs shared memory to lie in.
    refused(
        share_then(&socket, &[], Some(vmm_pool(1))),
        "gpu.regions[0] has no ipc_handle, and no GPU memory was shared",
    );
    // Only before the registration.
    refused(
        share_then(&socket, &[(vec![mb2], 1)], Some(EngineRequest::Capabilities)),
        "must be RegisterPool (after at most one Capabilities and any ShareGpuMemory)",
    );
    // Well-formed, over several frames: as far as this agent goes (without a GPU, the driver's
    // refusal; with one, the memfds are not the driver's exports).
    let answer = share_then(&socket, &[(vec![mb2; 128], 128), (vec![mb2; 2], 2)], Some(vmm_pool(1)));
    if cuda::devices().is_ok_and(|d| !d.is_empty()) {
        refused(answer, "shared GPU allocation 0");
    } else {
        refused(answer, "gpu: GPU pools are not accepted: ");
    }
    // Nothing half-registered, no descriptor kept: a host pool still registers.
    let mut s = connect(&socket);
    let answer = ask(&mut s, &EngineRequest::RegisterPool(Box::new(host_registration())));
    assert!(matches!(answer, AgentEvent::Registered { .. }), "{answer:?}");
}

#[test]
fn a_connection_that_shares_gpu_memory_and_never_registers_is_closed() {
    use std::io::Read;
    use std::os::fd::AsFd;
    let w = World::new("caps-stall");
    let socket = w.agent("a", Transport::Tcp, false);
    let limit = pdpair_agent::agent::REGISTER_WITHIN;
    let started = std::time::Instant::now();
    let mut s = connect(&socket);
    let share = |s: &UnixStream, n: usize| {
        let fds = descriptors(n);
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        let frame = EngineRequest::ShareGpuMemory {
            sizes: vec![2 << 20; n],
        };
        wire::write_frame_fds(s, &frame, &borrowed).expect("shared");
    };
    share(&s, 4);
    // It holds descriptors and drips more well inside each read's time, then trickles a frame
    // a byte at a time, but never registers: the agent lets it go once the registration's time
    // is up, counted from the start, however the bytes are paced (and gives the descriptors
    // back).
    std::thread::sleep(limit / 3);
    share(&s, 1);
    std::thread::sleep(limit / 3);
    let mut trickle = s.try_clone().expect("clone");
    std::thread::spawn(move || {
        use std::io::Write;
        let frame: Vec<u8> = [&64u32.to_be_bytes()[..], &[b' '; 64][..]].concat();
        for b in frame {
            if trickle.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
    });
    s.set_read_timeout(Some(limit)).expect("timeout");
    let answer = wire::read_frame::<AgentEvent>(&mut s).expect("answered, not timed out");
    assert!(
        matches!(&answer, AgentEvent::RegistrationFailed { message, .. } if message.contains("no registration within")),
        "{answer:?}"
    );
    let mut buf = [0u8; 16];
    let n = s.read(&mut buf).expect("closed, not timed out");
    assert_eq!(n, 0, "then closed");
    let took = started.elapsed();
    assert!(
        took >= limit - std::time::Duration::from_secs(1) && took < limit + std::time::Duration::from_secs(5),
        "closed at the limit from the start, not before nor after the last frame's: {took:?}"
    );
}

#[test]
fn connections_that_do_not_register_are_bounded_and_the_agent_keeps_serving() {
    use std::io::Read;
    let w = World::new("caps-many");
    let socket = w.agent("a", Transport::Tcp, false);
    // As many as may be registering at once, each served (its Capabilities answered), then
    // saying nothing...
    let idle: Vec<UnixStream> = (0..pdpair_agent::agent::MAX_UNREGISTERED)
        .map(|i| {
            let mut s = connect(&socket);
            let answer = ask(&mut s, &EngineRequest::Capabilities);
            assert!(
                matches!(answer, AgentEvent::Capabilities { .. }),
                "connection {i}: {answer:?}"
            );
            s
        })
        .collect();
    // ...one more is closed at once, unanswered: its write finds the socket closed, or its read
    // does (closed, or reset as it sent what no one read).
    let mut probe = connect(&socket);
    let closed = |e: &std::io::Error| {
        matches!(
            e.kind(),
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
        )
    };
    match wire::write_frame(&mut probe, &EngineRequest::Capabilities) {
        Err(wire::FrameError::Io(e)) if closed(&e) => {}
        Err(e) => panic!("send: {e:?}"),
        Ok(()) => {
            let mut buf = [0u8; 16];
            match probe.read(&mut buf) {
                Ok(0) => {}
                Err(e) if closed(&e) => {}
                other => panic!(
                    "one past the bound is closed without an answer: {other:?} {:?}",
                    String::from_utf8_lossy(&buf)
                ),
            }
        }
    }
    // Once they go, engines register again.
    drop(idle);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let mut s = connect(&socket);
        let answer = wire::write_frame(&mut s, &EngineRequest::RegisterPool(Box::new(host_registration())))
            .map_err(|e| e.to_string())
            .and_then(|()| wire::read_frame::<AgentEvent>(&mut s).map_err(|e| e.to_string()));
        match answer {
            Ok(AgentEvent::Registered { .. }) => break,
            other if std::time::Instant::now() > deadline => panic!("no registration: {other:?}"),
            _ => std::thread::sleep(std::time::Duration::from_millis(100)),
        }
    }
}

/// A registration as JSON, `change` applied to it.
fn registration_json(change: impl FnOnce(&mut serde_json::Value)) -> serde_json::Value {
    let mut frame = serde_json::to_value(EngineRequest::RegisterPool(Box::new(host_registration()))).expect("json");
    change(&mut frame);
    frame
}

#[test]
fn a_registration_that_does_not_decode_is_refused_naming_the_field_and_the_agent_keeps_serving() {
    use std::io::{Read, Write};
    let w = World::new("caps-decode");
    let socket = w.agent("a", Transport::Tcp, false);
    let cases: Vec<(serde_json::Value, &str)> = vec![
        (
            registration_json(|f| f["role"] = "middle".into()),
            "RegisterPool field role: unknown variant `middle`",
        ),
        (
            registration_json(|f| f["num_blocks"] = (-1).into()),
            "RegisterPool field num_blocks: invalid value: integer `-1`",
        ),
        (
            registration_json(|f| f["num_blocks"] = (1u64 << 40).into()),
            "RegisterPool field num_blocks: invalid value: integer `1099511627776`",
        ),
        (
            registration_json(|f| f["kv"]["dtype"] = "float7".into()),
            "RegisterPool field kv.dtype: unknown variant `float7`",
        ),
        (
            registration_json(|f| f["regions"] = serde_json::json!([{"layers": 1, "kv_arrangement": "Sideways"}])),
            "RegisterPool field regions[0].kv_arrangement: unknown variant `Sideways`",
        ),
        (
            registration_json(|f| {
                f.as_object_mut().expect("object").remove("pairing_key");
            }),
            "RegisterPool: missing field `pairing_key`",
        ),
        (
            serde_json::json!({"type": "RegisterPools"}),
            "malformed message: unknown variant `RegisterPools`",
        ),
    ];
    for (frame, expected) in cases {
        let mut s = connect(&socket);
        let answer = ask_raw(&mut s, &frame);
        assert!(
            matches!(&answer, AgentEvent::RegistrationFailed { message, .. } if message.contains(expected)),
            "{expected}: {answer:?}"
        );
        let mut buf = [0u8; 1];
        assert_eq!(s.read(&mut buf).expect("closed"), 0, "{expected}: then closed");
    }
    // Not JSON at all.
    let mut s = connect(&socket);
    s.write_all(&[&5u32.to_be_bytes()[..], b"{{{{{"].concat())
        .expect("send");
    let answer = wire::read_frame::<AgentEvent>(&mut s).expect("an answer");
    assert!(
        matches!(&answer, AgentEvent::RegistrationFailed { message, .. } if message.starts_with("malformed frame:")),
        "{answer:?}"
    );
    // What the engine sent comes back cut and escaped.
    let mut s = connect(&socket);
    let answer = ask_raw(
        &mut s,
        &registration_json(|f| f["role"] = format!("\u{1b}[31m{}", "x".repeat(5000)).into()),
    );
    let AgentEvent::RegistrationFailed { message, .. } = answer else {
        panic!("{answer:?}");
    };
    assert!(
        message.chars().count() < 400 && !message.contains('\u{1b}'),
        "{message}"
    );
    let answer = ask(
        &mut connect(&socket),
        &EngineRequest::RegisterPool(Box::new(host_registration())),
    );
    assert!(matches!(answer, AgentEvent::Registered { .. }), "{answer:?}");
}

fn ask_raw(s: &mut UnixStream, frame: &serde_json::Value) -> AgentEvent {
    wire::write_frame(s, frame).expect("send");
    wire::read_frame::<AgentEvent>(s).expect("an answer")
}

#[test]
fn an_engine_name_is_registered_once_per_agent_until_its_engine_goes() {
    let w = World::new("caps-name");
    let socket = w.agent("a", Transport::Tcp, false);
    let mut first = connect(&socket);
    let answer = ask(&mut first, &EngineRequest::RegisterPool(Box::new(host_registration())));
    assert!(matches!(answer, AgentEvent::Registered { .. }), "{answer:?}");
    // The same name again, even for the other role, while the first is registered: refused.
    let mut decode = host_registration();
    decode.role = Role::Decode;
    for reg in [host_registration(), decode] {
        let answer = ask(&mut connect(&socket), &EngineRequest::RegisterPool(Box::new(reg)));
        assert!(
            matches!(&answer, AgentEvent::RegistrationFailed { message, .. }
                if message.contains("engine \"p0\" of this PDPair is already registered at this agent")),
            "{answer:?}"
        );
    }
    // Another pair's engine of the same name is its own (a tenant cannot keep another's out).
    let mut other_pair = host_registration();
    other_pair.pdpair = "team-b/other".into();
    let mut other = connect(&socket);
    let answer = ask(&mut other, &EngineRequest::RegisterPool(Box::new(other_pair)));
    assert!(matches!(answer, AgentEvent::Registered { .. }), "{answer:?}");
    // Another name is fine, and once the first engine goes its name is free again.
    let mut other = host_registration();
    other.engine = "p1".into();
    let answer = ask(&mut connect(&socket), &EngineRequest::RegisterPool(Box::new(other)));
    assert!(matches!(answer, AgentEvent::Registered { .. }), "{answer:?}");
    drop(first);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match ask(
            &mut connect(&socket),
            &EngineRequest::RegisterPool(Box::new(host_registration())),
        ) {
            AgentEvent::Registered { .. } => break,
            other if std::time::Instant::now() > deadline => panic!("the name stayed taken: {other:?}"),
            _ => std::thread::sleep(std::time::Duration::from_millis(50)),
        }
    }
}

#[test]
fn frames_are_bounded_by_what_a_registration_and_a_pools_requests_need() {
    use pdpair_agent::engine_api::{MAX_REGISTRATION_FRAME, max_request_frame};
    use std::io::{Read, Write};
    let w = World::new("caps-frames");
    let socket = w.agent("a", Transport::Tcp, false);
    // Before registration (before the engine is attested): a frame past the bound is refused from
    // its length, naming it, before its body is read (64 connections could otherwise hold 16 MiB
    // each, and more again as parsed JSON).
    let mut s = connect(&socket);
    let n = MAX_REGISTRATION_FRAME + 1;
    s.write_all(&(n as u32).to_be_bytes()).expect("length");
    let answer = wire::read_frame::<AgentEvent>(&mut s).expect("an answer");
    assert!(
        matches!(&answer, AgentEvent::RegistrationFailed { message, .. }
            if message.contains(&format!("a frame of {n} bytes before registration; at most {MAX_REGISTRATION_FRAME}"))),
        "{answer:?}"
    );
    // A registered engine's frames: room for every block of its pool, no more.
    let reg = host_registration();
    let num_blocks = reg.num_blocks;
    let mut s = connect(&socket);
    let answer = ask(&mut s, &EngineRequest::RegisterPool(Box::new(reg)));
    assert!(matches!(answer, AgentEvent::Registered { .. }), "{answer:?}");
    let max = max_request_frame(num_blocks);
    assert!(max < 1 << 20, "a small pool's bound is small: {max}");
    // The largest request it needs is served (every block, padded to the bound with spaces)...
    let mut every = serde_json::to_vec(&EngineRequest::KvReady {
        release_token: None,
        request: "all".into(),
        blocks: (0..num_blocks).collect(),
        num_tokens: u64::from(num_blocks) * 64,
        first_token: 0,
        prompt: None,
        event: None,
    })
    .expect("json");
    every.resize(max, b' ');
    s.write_all(&(every.len() as u32).to_be_bytes()).expect("length");
    s.write_all(&every).expect("body");
    let again = ask(&mut s, &EngineRequest::Capabilities);
    assert!(matches!(again, AgentEvent::Capabilities { .. }), "{again:?}");
    // ...and one byte more ends the connection from its length.
    s.write_all(&((max + 1) as u32).to_be_bytes()).expect("length");
    let mut buf = [0u8; 1];
    assert_eq!(s.read(&mut buf).expect("closed"), 0, "closed");
    // The agent serves on.
    let answer = ask(&mut connect(&socket), &EngineRequest::Capabilities);
    assert!(matches!(answer, AgentEvent::Capabilities { .. }), "{answer:?}");
}

#[test]
fn an_agent_holds_a_bounded_number_of_engines_and_takes_another_once_one_goes() {
    // Each registered engine holds threads, mappings and (prefill) a listener: a local process
    // registering small pools without end ran the agent out of them for every engine.
    use pdpair_agent::agent::MAX_ENGINES;
    let w = World::new("caps-engines");
    let socket = w.agent("a", Transport::Tcp, false);
    let register = |i: usize| {
        let mut reg = host_registration();
        (reg.role, reg.engine, reg.num_blocks) = (Role::Decode, format!("e{i}"), 1);
        let mut s = connect(&socket);
        let answer = ask(&mut s, &EngineRequest::RegisterPool(Box::new(reg)));
        (s, answer)
    };
    let mut held: Vec<UnixStream> = (0..MAX_ENGINES)
        .map(|i| {
            let (s, answer) = register(i);
            assert!(
                matches!(answer, AgentEvent::Registered { .. }),
                "engine {i}: {answer:?}"
            );
            s
        })
        .collect();
    // Said to be busy: the engine tries again later rather than take it as final.
    let (_, answer) = register(MAX_ENGINES);
    assert!(
        matches!(&answer, AgentEvent::RegistrationFailed { message, busy: true }
            if message.contains(&format!("this agent holds {MAX_ENGINES} registered engines"))),
        "{answer:?}"
    );
    // One goes: another registers (and only one: the rest still hold theirs).
    drop(held.remove(0));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let newcomer = loop {
        match register(MAX_ENGINES) {
            (s, AgentEvent::Registered { .. }) => break s,
            (_, other) if std::time::Instant::now() > deadline => panic!("no room after one went: {other:?}"),
            _ => std::thread::sleep(std::time::Duration::from_millis(50)),
        }
    };
    let (_, answer) = register(MAX_ENGINES + 1);
    assert!(
        matches!(answer, AgentEvent::RegistrationFailed { busy: true, .. }),
        "{answer:?}"
    );
    // A refusal of what the registration says is not busy: trying again does not mend it.
    let mut s = connect(&socket);
    let mut reg = host_registration();
    (reg.role, reg.engine, reg.num_blocks) = (Role::Decode, "zero".into(), 0);
    let answer = ask(&mut s, &EngineRequest::RegisterPool(Box::new(reg)));
    assert!(
        matches!(&answer, AgentEvent::RegistrationFailed { message, busy: false } if message.contains("num_blocks must be at least 1")),
        "{answer:?}"
    );
    drop((held, newcomer));
}

/// Whether `answer` fails `request` as `InvalidRequest`, its message containing `expected`.
fn invalid(answer: &AgentEvent, request: &str, expected: &str) -> bool {
    matches!(answer, AgentEvent::RequestFailed { request: r, reasons, message }
        if r == request && reasons == &["InvalidRequest".to_owned()] && message.contains(expected))
}

#[test]
fn a_request_that_does_not_decode_is_refused_on_its_own_and_the_engine_stays_registered() {
    use std::io::Read;
    let w = World::new("caps-malformed");
    let socket = w.agent("a", Transport::Tcp, false);
    let mut s = connect(&socket);
    let answer = ask(&mut s, &EngineRequest::RegisterPool(Box::new(host_registration())));
    assert!(matches!(answer, AgentEvent::Registered { .. }), "{answer:?}");
    // Blocks that are not a list, a count that is negative: refused naming the request.
    for (frame, expected) in [
        (
            serde_json::json!({"type": "KvReady", "request": "bad", "blocks": "1,2", "num_tokens": 10, "first_token": 0}),
            "malformed KvReady: invalid type: string",
        ),
        (
            serde_json::json!({"type": "KvReady", "request": "worse", "blocks": [1], "num_tokens": -3, "first_token": 0}),
            "malformed KvReady: invalid value: integer `-3`",
        ),
        (
            serde_json::json!({"type": "Frobnicate", "request": "odd"}),
            "malformed Frobnicate: unknown variant `Frobnicate`",
        ),
    ] {
        let request = frame["request"].as_str().expect("named").to_owned();
        let answer = ask_raw(&mut s, &frame);
        assert!(invalid(&answer, &request, expected), "{expected}: {answer:?}");
    }
    // A request id past the bound is refused (ids are kept while their requests live).
    let long = "r".repeat(pdpair_agent::engine_api::MAX_REQUEST_ID + 1);
    let answer = ask(
        &mut s,
        &EngineRequest::KvReady {
            release_token: None,
            request: long.clone(),
            blocks: vec![1],
            num_tokens: 10,
            first_token: 0,
            prompt: None,
            event: None,
        },
    );
    assert!(
        matches!(&answer, AgentEvent::RequestFailed { request, message, .. }
            if *request == long && message.contains("request ids are at most 512 bytes; this one has 513")),
        "{answer:?}"
    );
    // An event of `gpu.events` named for a pool that registered none (a host pool) is refused,
    // naming it: the agent would otherwise read blocks without waiting for the writes it names.
    let answer = ask(
        &mut s,
        &EngineRequest::KvReady {
            release_token: None,
            request: "named".into(),
            blocks: vec![1],
            num_tokens: 10,
            first_token: 0,
            prompt: None,
            event: Some(0),
        },
    );
    assert!(
        invalid(&answer, "named", "KvReady.event 0: this pool registered no gpu.events"),
        "{answer:?}"
    );
    // So is one named in a decode's ExpectKv.
    let mut decode = host_registration();
    (decode.role, decode.engine) = (Role::Decode, "d-named".into());
    let mut ds = connect(&socket);
    let answer = ask(&mut ds, &EngineRequest::RegisterPool(Box::new(decode)));
    assert!(matches!(answer, AgentEvent::Registered { .. }), "{answer:?}");
    let answer = ask(
        &mut ds,
        &EngineRequest::ExpectKv {
            request: "named".into(),
            prefill: "127.0.0.1:9".into(),
            blocks: vec![1],
            num_tokens: 10,
            first_token: 0,
            prompt: None,
            event: Some(2),
        },
    );
    assert!(
        invalid(&answer, "named", "ExpectKv.event 2: this pool registered no gpu.events"),
        "{answer:?}"
    );
    // The connection still serves.
    let again = ask(&mut s, &EngineRequest::Capabilities);
    assert!(matches!(again, AgentEvent::Capabilities { .. }), "{again:?}");
    // A frame that names no request cannot be answered: the connection ends.
    wire::write_frame(&mut s, &serde_json::json!({"type": "KvReady", "blocks": []})).expect("send");
    let mut buf = [0u8; 1];
    assert_eq!(s.read(&mut buf).expect("closed"), 0, "closed");
}

#[test]
fn an_agent_finding_no_rdma_device_logs_no_ucx_error_for_asking() {
    // `--transport auto` asks UCX whether it has a network device by starting a context without
    // `self`; without one UCX's error for that stood first in every such agent's log. The agent
    // says what it does instead, and UCX's answer is not logged as an error.
    let w = World::new("auto-log");
    let socket = w.dir.join("auto.sock");
    let log = w.dir.join("auto.log");
    let file = std::fs::File::create(&log).expect("log file");
    let mut child = pdpair_agent::loopback::run_command(
        std::path::Path::new(env!("CARGO_BIN_EXE_pdpair-agent")),
        "auto",
        "auto",
        &socket,
        &w.pools(),
    )
    .arg("--no-publish")
    .env("RUST_LOG", "info")
    .stdout(file.try_clone().expect("log file"))
    .stderr(file)
    .spawn()
    .expect("agent process");
    let start = std::time::Instant::now();
    while UnixStream::connect(&socket).is_err() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "the agent never served"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(!text.contains("no usable transports"), "{text}");
    // Where UCX does find an RDMA device, the agent does not take the stream.
    if !pdpair_agent::transport::ucx::network_available() {
        assert!(text.contains("KV moves over this agent's tcp stream"), "{text}");
    }
}
