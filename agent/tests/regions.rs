//! Pools of several memory regions (vLLM's per-layer KV tensors) and MLA's latent arrays, end to
//! end: two agents in one process, real UCX over tcp and shared memory, synthetic engines whose
//! regions differ on the two sides (vLLM 0.33's one allocation with K and V side by side, layers
//! or blocks outermost, among them). Every received byte is compared with what prefill wrote, and
//! the checksum (FailClosed) reads every region.

use std::os::fd::AsFd;

use pdpair_agent::{
    engine_api::{AgentEvent, EngineRequest, RegionRequest},
    layout::KvArrangement::{self, BlocksFirst, Interleaved, KvFirst, Latent},
    synthetic::{EngineMemory, EngineSpec, SyntheticEngine},
    transport::ucx::Transport,
};
use pdpair_api::{ChecksumPolicy, KvGeometry, Role, TransferMode};

mod common;

use common::{Req, World, kv, request, spec};

/// Four layers (MLA: one latent vector of 64 elements per token).
fn geometry(mla: bool) -> KvGeometry {
    let mut g = kv(64, None);
    g.layers = 4;
    if mla {
        g.mla = true;
        g.kv_heads = 1;
        g.head_dim = 64;
    }
    g
}

fn regions(spec: &[(u32, Option<KvArrangement>)]) -> Vec<RegionRequest> {
    spec.iter()
        .map(|(layers, kv_arrangement)| RegionRequest {
            layers: *layers,
            kv_arrangement: *kv_arrangement,
            ..RegionRequest::default()
        })
        .collect()
}

fn engine(
    role: Role,
    mla: bool,
    mode: TransferMode,
    memory: EngineMemory,
    split: &[(u32, Option<KvArrangement>)],
) -> EngineSpec {
    engine_with(role, mla, mode, memory, regions(split))
}

fn engine_with(
    role: Role,
    mla: bool,
    mode: TransferMode,
    memory: EngineMemory,
    regions: Vec<RegionRequest>,
) -> EngineSpec {
    let name = if role == Role::Prefill { "p0" } else { "d0" };
    EngineSpec {
        mode,
        memory,
        regions,
        ..spec(role, name, geometry(mla), b"k", ChecksumPolicy::FailClosed)
    }
}

/// Requests from a prefill engine split as `p` to a decode engine split as `d`: whole, and
/// after a prefix hit on decode; every byte right and the checksum verified.
fn transfer(
    name: &str,
    transport: Transport,
    mode: TransferMode,
    mla: bool,
    memory: EngineMemory,
    p: &[(u32, Option<KvArrangement>)],
    d: &[(u32, Option<KvArrangement>)],
) {
    transfer_with(name, transport, mode, mla, memory, regions(p), regions(d));
}

/// [`transfer`] between regions as the engines name them.
fn transfer_with(
    name: &str,
    transport: Transport,
    mode: TransferMode,
    mla: bool,
    memory: EngineMemory,
    p: Vec<RegionRequest>,
    d: Vec<RegionRequest>,
) {
    let w = World::new(name);
    let (ps, ds) = (w.agent("p", transport, false), w.agent("d", transport, false));
    let (pn, dn) = (p.len(), d.len());
    let mut pe = SyntheticEngine::register(&ps, &w.dir, &engine_with(Role::Prefill, mla, mode, memory, p)).expect("P");
    let mut de = SyntheticEngine::register(&ds, &w.dir, &engine_with(Role::Decode, mla, mode, memory, d)).expect("D");
    assert_eq!(pe.layout.regions.len(), pn.max(1), "{name}: prefill's regions");
    assert_eq!(de.layout.regions.len(), dn.max(1), "{name}: decode's regions");
    for (i, d_first) in [0u64, 64].into_iter().enumerate() {
        let (event, bad) = request(
            &mut pe,
            &mut de,
            Req {
                id: &format!("r{i}"),
                seed: 40 + i as u64,
                p_first: 0,
                d_first,
                tokens: 150,
                blocks: 3,
            },
        );
        assert!(
            matches!(&event, AgentEvent::RequestDone { checksum: Some(c), .. } if c == "Verified"),
            "{name}: {event:?}"
        );
        assert_eq!(bad, 0, "{name}: every received byte matches");
    }
}

#[test]
fn per_layer_regions_push_into_one_region_and_back_over_tcp() {
    let per_layer = [(1, None), (1, Some(BlocksFirst)), (1, None), (1, Some(KvFirst))];
    for mode in [TransferMode::Push, TransferMode::Pull] {
        transfer(
            &format!("regions-tcp-{mode:?}-a"),
            Transport::Tcp,
            mode,
            false,
            EngineMemory::Agent,
            &per_layer,
            &[],
        );
        transfer(
            &format!("regions-tcp-{mode:?}-b"),
            Transport::Tcp,
            mode,
            false,
            EngineMemory::Agent,
            &[(3, Some(BlocksFirst)), (1, None)],
            &per_layer,
        );
    }
}

#[test]
fn per_layer_regions_over_shared_memory_in_the_engines_own_memfds() {
    for mode in [TransferMode::Push, TransferMode::Pull] {
        transfer(
            &format!("regions-shm-{mode:?}"),
            Transport::Shm,
            mode,
            false,
            EngineMemory::Engine,
            &[(1, None); 4],
            &[(2, None), (2, Some(BlocksFirst))],
        );
        transfer(
            &format!("regions-shm-agent-{mode:?}"),
            Transport::Shm,
            mode,
            false,
            EngineMemory::Agent,
            &[(1, None); 4],
            &[(1, None); 4],
        );
    }
}

/// One block's K and V, side by side (64 tokens x 2 heads x 16 elements x 2 bytes, twice).
const CHUNK: u64 = 2 * 64 * 2 * 16 * 2;

/// One `Interleaved` region of all four layers, `layer_stride` and `block_stride` apart.
fn interleaved(layer_stride: u64, block_stride: u64) -> Vec<RegionRequest> {
    vec![RegionRequest {
        layers: 4,
        kv_arrangement: Some(Interleaved),
        layer_stride: Some(layer_stride),
        block_stride: Some(block_stride),
    }]
}

#[test]
fn kv_side_by_side_moves_to_and_from_every_arrangement() {
    // vLLM 0.33's one allocation with blocks outermost ([blocks, layers, heads, tokens, K|V]),
    // here with 512 bytes between blocks, and with layers outermost, dense.
    let blocks_outer = interleaved(CHUNK, 4 * CHUNK + 512);
    let layers_outer = interleaved(16 * CHUNK, CHUNK);
    let per_layer = regions(&[(1, None), (1, Some(BlocksFirst)), (2, None)]);
    for mode in [TransferMode::Push, TransferMode::Pull] {
        // Side by side on both sides: a block moves whole, K and V together.
        transfer_with(
            &format!("interleaved-both-{mode:?}"),
            Transport::Tcp,
            mode,
            false,
            EngineMemory::Agent,
            blocks_outer.clone(),
            layers_outer.clone(),
        );
        // Blocks outermost on both sides: a block's layers back to back, one op (block by block).
        for transport in [Transport::Tcp, Transport::Shm] {
            transfer_with(
                &format!("sbs-blocks-{transport:?}-{mode:?}"),
                transport,
                mode,
                false,
                EngineMemory::Agent,
                blocks_outer.clone(),
                interleaved(CHUNK, 4 * CHUNK),
            );
        }
        // Side by side into K and V arrays and back: a head's token at a time.
        transfer_with(
            &format!("interleaved-to-arrays-{mode:?}"),
            Transport::Tcp,
            mode,
            false,
            EngineMemory::Agent,
            blocks_outer.clone(),
            per_layer.clone(),
        );
        transfer_with(
            &format!("sbs-shm-{mode:?}"),
            Transport::Shm,
            mode,
            false,
            EngineMemory::Engine,
            Vec::new(),
            blocks_outer.clone(),
        );
    }
}

#[test]
fn mla_latent_arrays_move_whole_and_per_layer() {
    for (transport, mode) in [
        (Transport::Tcp, TransferMode::Push),
        (Transport::Shm, TransferMode::Pull),
    ] {
        transfer(
            &format!("mla-{transport:?}-{mode:?}"),
            transport,
            mode,
            true,
            EngineMemory::Agent,
            &[(1, None), (1, Some(Latent)), (2, None)],
            &[],
        );
    }
    // The latent pool holds one array per layer: half of what K and V of the same size take.
    let w = World::new("mla-size");
    let s = w.agent("a", Transport::Tcp, false);
    let e = SyntheticEngine::register(
        &s,
        &w.dir,
        &engine(Role::Decode, true, TransferMode::Push, EngineMemory::Agent, &[]),
    )
    .expect("registered");
    assert_eq!(
        e.layout.pool_len(),
        4 * 16 * 64 * 64 * 2,
        "4 layers x 16 blocks x 64 tokens x 64 x 2 bytes"
    );
}

/// Sends `spec`'s registration with `fds` attached; returns the agent's answer.
fn register_with(socket: &std::path::Path, spec: &EngineSpec, fds: &[std::fs::File]) -> AgentEvent {
    let stream = std::os::unix::net::UnixStream::connect(socket).expect("connect");
    let reg = SyntheticEngine::registration(spec, None, !fds.is_empty());
    let fds: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
    pdpair_agent::wire::write_frame_fds(&stream, &EngineRequest::RegisterPool(Box::new(reg)), &fds).expect("send");
    pdpair_agent::wire::read_frame::<AgentEvent>(&mut &stream).expect("answer")
}

fn refusal(event: AgentEvent) -> String {
    match event {
        AgentEvent::RegistrationFailed { message, .. } => message,
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn bad_region_registrations_are_refused_naming_the_field_and_the_agent_keeps_serving() {
    let w = World::new("regions-refused");
    let s = w.agent("a", Transport::Tcp, false);
    let memfd = |len| pdpair_agent::memory::pool::backed_memfd(len).expect("memfd");
    let per_layer = engine(
        Role::Decode,
        false,
        TransferMode::Push,
        EngineMemory::Engine,
        &[(1, None); 4],
    );
    // One region's bytes: 16 blocks x K,V x 64 tokens x 2 heads x 16 x 2 bytes.
    let region = 16 * 2 * 64 * 2 * 16 * 2;
    let m = refusal(register_with(&s, &per_layer, &[memfd(region), memfd(region)]));
    assert!(m.contains("carried 2 descriptors; the pool has 4 regions"), "{m}");
    let m = refusal(register_with(
        &s,
        &per_layer,
        &[memfd(region), memfd(region), memfd(4096), memfd(region)],
    ));
    assert!(m.starts_with("region 2:") && m.contains("holds 4096 bytes"), "{m}");
    let mut both = per_layer.clone();
    both.arrangement = Some(BlocksFirst);
    let m = refusal(register_with(&s, &both, &[]));
    assert!(m.contains("kv_arrangement and regions are both set"), "{m}");
    let short = engine(
        Role::Decode,
        false,
        TransferMode::Push,
        EngineMemory::Agent,
        &[(1, None), (2, None)],
    );
    let m = refusal(register_with(&s, &short, &[]));
    assert!(
        m.contains("regions hold 3 layers in all; the geometry has kv.layers 4"),
        "{m}"
    );
    let latent = engine(
        Role::Decode,
        false,
        TransferMode::Push,
        EngineMemory::Agent,
        &[(2, None), (2, Some(Latent))],
    );
    let m = refusal(register_with(&s, &latent, &[]));
    assert!(
        m.contains("regions[1].kv_arrangement is Latent, but kv.mla is false"),
        "{m}"
    );
    let mut mla_kv = engine(Role::Decode, true, TransferMode::Push, EngineMemory::Agent, &[]);
    mla_kv.arrangement = Some(KvFirst);
    let m = refusal(register_with(&s, &mla_kv, &[]));
    assert!(m.contains("kv_arrangement is KvFirst; kv.mla is true"), "{m}");
    // The refused registrations left nothing behind: the same engine registers whole.
    let ok = register_with(
        &s,
        &per_layer,
        &[memfd(region), memfd(region), memfd(region), memfd(region)],
    );
    assert!(
        matches!(&ok, AgentEvent::Registered { region_lens, .. } if region_lens == &vec![region as u64; 4]),
        "{ok:?}"
    );
}
