//! `Cancel`: an engine gives up a request (decode aborted it, prefill gave up). The answer,
//! `Cancelled`, comes exactly once and only when nothing writes into the request's blocks any
//! more: vLLM reuses them at once.

mod common;

use std::time::{Duration, Instant};

use common::{World, expect_kv, kv, kv_ready, reasons, spec};
use pdpair_agent::{
    engine_api::{AgentEvent, EngineRequest},
    synthetic::SyntheticEngine,
    transport::ucx::Transport,
};
use pdpair_api::{ChecksumPolicy, KvGeometry, Role, TransferMode};

fn cancel(e: &mut SyntheticEngine, request: &str) {
    e.send(&EngineRequest::Cancel {
        request: request.into(),
    })
    .expect("Cancel");
}

fn cancelled(event: &AgentEvent, id: &str) -> bool {
    matches!(event, AgentEvent::Cancelled { request } if request == id)
}

fn timeouts(engines: &[&SyntheticEngine], t: Duration) {
    for e in engines {
        e.events().expect("events").set_read_timeout(Some(t)).expect("timeout");
    }
}

/// 32 layers of 8 heads of 128 bf16 in blocks of 16: 2 MiB per block over all layers, so 128
/// blocks take long enough over tcp for a cancel to land mid-transfer.
fn big() -> KvGeometry {
    KvGeometry {
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        ..kv(16, None)
    }
}

const BLOCKS: u32 = 128;

fn big_pair(w: &World, mode: TransferMode) -> (SyntheticEngine, SyntheticEngine) {
    let (ps, ds) = (w.agent("p", Transport::Tcp, false), w.agent("d", Transport::Tcp, false));
    let mk = |socket: &std::path::Path, role: Role, name: &str| {
        let mut s = spec(role, name, big(), b"k", ChecksumPolicy::FailClosed);
        (s.mode, s.num_blocks, s.lease_ms) = (mode, BLOCKS, 20_000);
        SyntheticEngine::register(socket, &w.dir, &s).expect("registers")
    };
    let p = mk(&ps, Role::Prefill, "p0");
    let d = mk(&ds, Role::Decode, "d0");
    timeouts(&[&p, &d], Duration::from_secs(30));
    (p, d)
}

/// D's pool after the `Cancelled` answer equals what it holds a while after prefill's transfer
/// ended: no byte landed after the answer.
fn no_write_after_the_answer(mode: TransferMode) {
    let w = World::new(&format!("cancel-mid-{mode:?}"));
    let (mut p, mut d) = big_pair(&w, mode);
    p.region_mut(0).fill(0xAB);
    let blocks: Vec<u32> = (0..BLOCKS).collect();
    let tokens = u64::from(BLOCKS) * 16;
    expect_kv(&mut d, "r", p.address.clone(), &blocks, tokens);
    kv_ready(&mut p, "r", &blocks, tokens);
    // Cancel as soon as the KV is on its way (push: prefill posted its WRITEs; pull: it lent
    // the blocks and decode reads them).
    let event = p.next_event().expect("P");
    assert!(matches!(&event, AgentEvent::TransferStarted { .. }), "{event:?}");
    let asked = Instant::now();
    cancel(&mut d, "r");
    let event = d.next_event().expect("D answers the cancel");
    assert!(cancelled(&event, "r"), "{event:?}");
    let answered = asked.elapsed();
    let at_answer = d.region(0).to_vec();
    // Prefill's transfer ends (it hears how); wait a little more for any straggler.
    let event = p.next_event().expect("P's end");
    assert!(
        matches!(&event, AgentEvent::RequestDone { .. } | AgentEvent::Released { .. }),
        "{event:?}"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        d.region(0) == &at_answer[..],
        "bytes landed in decode's blocks after Cancelled (answered after {answered:?})"
    );
    // Exactly one answer: nothing more about the request reaches decode's engine.
    d.wait_events_for(Duration::from_millis(500)).expect("timeout");
    assert!(d.next_event().is_err(), "a second event after Cancelled");
}

#[test]
fn a_push_cancelled_mid_transfer_answers_only_after_prefills_writes_ended() {
    no_write_after_the_answer(TransferMode::Push);
}

#[test]
fn a_pull_cancelled_mid_read_answers_only_after_decodes_reads_ended() {
    no_write_after_the_answer(TransferMode::Pull);
}

#[test]
fn a_cancel_before_prefill_is_ready_frees_prefill_at_its_kv_ready_without_a_failure() {
    let w = World::new("cancel-early");
    let (ps, ds) = (w.agent("p", Transport::Shm, false), w.agent("d", Transport::Shm, false));
    let mut p = w.engine(&ps, Role::Prefill, "p0", b"k");
    let mut d = w.engine(&ds, Role::Decode, "d0", b"k");
    timeouts(&[&p, &d], Duration::from_secs(10));
    expect_kv(&mut d, "r", p.address.clone(), &[0, 1], 100);
    // Let the registration reach prefill first.
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    cancel(&mut d, "r");
    let event = d.next_event().expect("D");
    assert!(cancelled(&event, "r"), "{event:?}");
    kv_ready(&mut p, "r", &[2, 3], 100);
    let event = p.next_event().expect("P");
    assert!(
        matches!(&event, AgentEvent::Released { request } if request == "r"),
        "prefill frees its blocks at once, no lease: {event:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    timeouts(&[&p], Duration::from_millis(300));
    assert!(p.next_event().is_err(), "nothing more on P");
}

#[test]
fn a_cancel_of_a_request_without_a_promise_is_answered_at_once() {
    let w = World::new("cancel-none");
    let ds = w.agent("d", Transport::Shm, false);
    let mut d = w.engine(&ds, Role::Decode, "d0", b"k");
    timeouts(&[&d], Duration::from_secs(5));
    cancel(&mut d, "never-asked");
    let event = d.next_event().expect("D");
    assert!(cancelled(&event, "never-asked"), "{event:?}");
}

#[test]
fn prefill_gives_up_a_ready_request_and_decode_asking_later_is_refused_at_once() {
    let w = World::new("cancel-prefill");
    let (ps, ds) = (w.agent("p", Transport::Shm, false), w.agent("d", Transport::Shm, false));
    let mut p = w.engine(&ps, Role::Prefill, "p0", b"k");
    let mut d = w.engine(&ds, Role::Decode, "d0", b"k");
    timeouts(&[&p, &d], Duration::from_secs(10));
    kv_ready(&mut p, "r", &[0, 1], 100);
    cancel(&mut p, "r");
    let event = p.next_event().expect("P");
    assert!(cancelled(&event, "r"), "{event:?}");
    let started = Instant::now();
    expect_kv(&mut d, "r", p.address.clone(), &[0, 1], 100);
    let event = d.next_event().expect("D");
    assert!(reasons(&event).contains(&"InvalidRequest".to_string()), "{event:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "refused at once, not after a lease"
    );
}

#[test]
fn a_cancel_while_decode_still_dials_prefill_releases_prefill_once_the_link_is_up() {
    let w = World::new("cancel-dialling");
    let (p_agent, ps) = common::ProcessAgent::start(&w, "p");
    let ds = w.agent("d", Transport::Tcp, false);
    let mut p = w.engine(&ps, Role::Prefill, "p0", b"k");
    let mut d = w.engine(&ds, Role::Decode, "d0", b"k");
    timeouts(&[&p, &d], Duration::from_secs(10));
    kv_ready(&mut p, "r", &[0, 1], 100);
    std::thread::sleep(Duration::from_millis(200));
    // Prefill's agent stalls: decode's dial connects but its handshake hangs.
    p_agent.signal(libc::SIGSTOP);
    expect_kv(&mut d, "r", p.address.clone(), &[0, 1], 100);
    std::thread::sleep(Duration::from_millis(200));
    cancel(&mut d, "r");
    std::thread::sleep(Duration::from_millis(300));
    p_agent.signal(libc::SIGCONT);
    let started = Instant::now();
    let event = d.next_event().expect("D");
    assert!(cancelled(&event, "r"), "{event:?}");
    // The queued request went out as a Release: prefill frees its blocks, no lease to wait.
    let event = p.next_event().expect("P");
    assert!(
        matches!(&event, AgentEvent::Released { request } if request == "r"),
        "{event:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    // The pair works on (and UCX's wireup between the two agents completes before the prefill
    // agent's process is killed at the end: UCX 1.13 aborts a process whose tcp endpoint fails
    // with a wireup reply still queued, docs/security.md).
    let (event, bad) = common::request(&mut p, &mut d, common::Req::from_start("after", 5, 100, 2));
    assert!(common::done(&event) && bad == 0, "{event:?}");
}
