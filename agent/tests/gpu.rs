//! On an NVIDIA GPU (`make gpu-check` runs these with `--ignored`; they are ignored elsewhere,
//! where no GPU exists): the checksum kernel against the CPU checksum on the same blocks in
//! device memory, copies and their range checks, and the CUDA IPC push between two processes.

use pdpair_agent::gpu_check::pattern;
use pdpair_agent::{
    checksum::gpu::{Blocks, GpuChecksum},
    layout::{KvArrangement, PoolLayout},
    memory::cuda::{DeviceMemory, Gpu},
};
use pdpair_api::{CacheDtype, KvGeometry, KvLayout, ModelDtype, Parallelism};

fn gpu() -> Gpu {
    Gpu::open(0).unwrap_or_else(|e| panic!("this test needs a GPU: {e}"))
}

fn kv(heads: i32, head_dim: i32, nhd: bool, mla: bool, dtype: CacheDtype) -> KvGeometry {
    KvGeometry {
        engine: "vllm".into(),
        engine_version: None,
        model: "m".into(),
        dtype: ModelDtype::Bfloat16,
        cache_dtype: dtype,
        layers: 4,
        kv_heads: heads,
        head_dim,
        attention_backend: "FLASH_ATTN".into(),
        layout: if nhd { KvLayout::Nhd } else { KvLayout::Hnd },
        block_size: 16,
        kernel_block_size: None,
        mla,
        hybrid: false,
        host_buffer: false,
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: make gpu-check"]
fn the_checksum_kernel_equals_the_cpu_checksum_on_the_same_blocks() {
    let g = gpu();
    let k = GpuChecksum::new(&g).expect("the kernel compiles and loads");
    // (kv heads, head dim, NHD, MLA, dtype, tensor (rank), arrangement (0 K and V arrays,
    // 1 blocks-first, 2 K and V side by side layers outermost, 3 side by side blocks outermost),
    // a region per layer, misaligned by 8 bytes: the 8-byte path)
    let cases = [
        (8, 128, false, false, CacheDtype::Auto, (1, 0), 0, false, false),
        (8, 128, true, false, CacheDtype::Auto, (2, 1), 1, false, false),
        (8, 64, false, false, CacheDtype::Fp8, (4, 3), 0, true, false),
        (1, 576, false, true, CacheDtype::Auto, (1, 0), 0, true, false),
        (4, 4, false, false, CacheDtype::Auto, (1, 0), 0, false, true),
        (4, 128, true, false, CacheDtype::Auto, (1, 0), 0, false, true),
        (8, 128, false, false, CacheDtype::Auto, (2, 1), 2, false, false),
        (8, 128, true, false, CacheDtype::Auto, (1, 0), 3, false, false),
        (4, 4, true, false, CacheDtype::Auto, (1, 0), 3, false, true),
    ];
    for (n, (heads, dim, nhd, mla, dtype, (tp, rank), arrangement, per_layer, misaligned)) in
        cases.into_iter().enumerate()
    {
        let parallelism = Parallelism {
            tensor: tp,
            ..Parallelism::default()
        };
        let mut layout = PoolLayout::new(&kv(heads, dim, nhd, mla, dtype), &parallelism, 8, rank).expect("layout");
        match arrangement {
            1 => layout = layout.arranged(KvArrangement::BlocksFirst),
            2 => layout = layout.arranged(KvArrangement::Interleaved),
            // vLLM 0.33's blocks outermost: a block's 4 layers back to back.
            3 => layout = layout.blocks_outermost(),
            _ => {}
        }
        if per_layer {
            layout = layout
                .with_regions(&[(1, None), (1, None), (1, None), (1, None)])
                .expect("regions");
        }
        let host: Vec<Vec<u8>> = layout
            .region_lens()
            .iter()
            .enumerate()
            .map(|(r, len)| pattern(*len, 17 * n as u64 + r as u64))
            .collect();
        let shift = if misaligned { 8 } else { 0 };
        let device: Vec<DeviceMemory> = host
            .iter()
            .map(|h| {
                let d = DeviceMemory::alloc(&g, h.len() + shift).expect("alloc");
                d.write(shift, h).expect("upload");
                d
            })
            .collect();
        let bases: Vec<u64> = device.iter().map(|d| d.ptr() + shift as u64).collect();
        let blocks = [7u32, 0, 3, 5];
        let (first_token, num_tokens) = (32, 32 + 16 * 3 + 5); // the last block partly filled
        let (first, count) = if layout.local_heads > 1 {
            (1, layout.local_heads - 1)
        } else {
            (0, 1)
        };
        let which = Blocks {
            blocks: &blocks,
            first_token,
            num_tokens,
            first,
            count,
        };
        // SAFETY: the device memory lives until the end of this iteration.
        #[allow(unsafe_code)]
        let gpu_sums = unsafe { k.block_sums(&layout, &bases, &which) }.expect("sums");
        let memory: Vec<&[u8]> = host.iter().map(Vec::as_slice).collect();
        let cpu: Vec<u64> = blocks
            .iter()
            .enumerate()
            .map(|(j, b)| {
                let t = first_token + j as u64 * u64::from(layout.block_size);
                layout
                    .checksum_heads(&memory, *b, t, num_tokens, first, count)
                    .expect("cpu")
            })
            .collect();
        assert_eq!(gpu_sums, cpu, "case {n}");
        assert!(cpu.iter().any(|s| *s != 0), "case {n}: nonzero sums");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: make gpu-check"]
fn copies_move_the_bytes_and_ranges_outside_memory_are_refused() {
    let g = gpu();
    let a = DeviceMemory::alloc(&g, 1 << 20).expect("alloc");
    let b = DeviceMemory::alloc(&g, 1 << 20).expect("alloc");
    let data = pattern(4096, 3);
    a.write(4096, &data).expect("upload");
    g.copy(&b, 8192, &a, 4096, 4096).expect("copy");
    g.synchronize().expect("sync");
    let mut back = vec![0u8; 4096];
    b.read(8192, &mut back).expect("download");
    assert_eq!(back, data);
    let e = g.copy(&b, (1 << 20) - 10, &a, 0, 4096).expect_err("past the end");
    assert!(e.to_string().contains("lie outside"), "{e}");
    let e = a.write(usize::MAX, &data).expect_err("wraps");
    assert!(e.to_string().contains("lie outside"), "{e}");
}

/// The batch copy kernel (`memory::batch_copy`) moves scattered copies as `split` cut them (one
/// launch for the short ones, the copy engine for a long one), at 16-byte, 8-byte and byte
/// alignment, and touches nothing else.
#[test]
#[ignore = "needs an NVIDIA GPU: make gpu-check"]
fn the_batch_copy_kernel_moves_scattered_copies_byte_for_byte() {
    use pdpair_agent::memory::batch_copy::{BatchCopy, MIN_PIECES, SHORT, split};
    let g = gpu();
    let k = BatchCopy::new(&g).expect("the kernel compiles and loads");
    let size = 64usize << 20;
    let src = DeviceMemory::alloc(&g, size).expect("alloc");
    let dst = DeviceMemory::alloc(&g, size).expect("alloc");
    let data = pattern(size, 41);
    src.write(0, &data).expect("upload");
    dst.write(0, &vec![0u8; size]).expect("zero");
    let (s0, d0) = (src.ptr(), dst.ptr());
    // 16 KiB blocks in the first 16 MiB, each to a scattered place (b * 97 + 13 mod 1024); then
    // 256-byte pieces, odd ones, and one copy long enough for the copy engine.
    let mut copies: Vec<(u64, u64, u64)> = (0..1024u64)
        .map(|b| (d0 + ((b * 97 + 13) % 1024) * 16384, s0 + b * 16384, 16384))
        .collect();
    copies.extend((0..4096u64).map(|i| (d0 + (16 << 20) + i * 512, s0 + (17 << 20) + i * 256, 256)));
    copies.extend((0..64u64).map(|i| (d0 + (20 << 20) + i * 1024 + 3, s0 + i * 999 + 1, 8 * i + 5)));
    copies.extend((0..64u64).map(|i| (d0 + (21 << 20) + i * 1024 + 8, s0 + i * 1000 + 8, 8 * i + 8)));
    copies.push((d0 + (32 << 20), s0 + (24 << 20), 4 * SHORT + 16));
    let s = split(&copies, true);
    assert!(s.pieces() >= MIN_PIECES && s.engine.len() == 1, "{} pieces", s.pieces());
    // SAFETY: every range lies in `src` or `dst`, held until the synchronize below.
    #[allow(unsafe_code)]
    let bytes = unsafe { k.queue(&s) }.expect("queued");
    g.synchronize().expect("the launch ran");
    assert_eq!(bytes, copies.iter().map(|c| c.2).sum::<u64>());
    let mut want = vec![0u8; size];
    for &(d, from, n) in &copies {
        let (d, from, n) = ((d - d0) as usize, (from - s0) as usize, n as usize);
        want[d..d + n].copy_from_slice(&data[from..from + n]);
    }
    let mut back = vec![0u8; size];
    dst.read(0, &mut back).expect("download");
    let wrong = back.iter().zip(&want).filter(|(a, b)| a != b).count();
    assert_eq!(wrong, 0, "{wrong} bytes differ");
}

#[test]
#[ignore = "needs an NVIDIA GPU: make gpu-check"]
fn gpu_check_pushes_through_an_ipc_handle_from_another_process_verified() {
    let bin = std::env::var_os("PDPAIR_AGENT_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_pdpair-agent").into());
    let out = std::process::Command::new(bin)
        .args(["gpu-check", "--mib", "64", "--repeat", "1", "-o", "json"])
        .output()
        .expect("gpu-check runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("json");
    assert_eq!(report["ok"], true, "{report}");
    let rows = report["rows"].as_array().expect("rows");
    assert!(
        rows.iter().any(|r| r["check"]
            .as_str()
            .is_some_and(|c| c.contains("verified on the receiving GPU"))),
        "{report}"
    );
    assert!(
        rows.iter()
            .any(|r| r["check"].as_str().is_some_and(|c| c.starts_with("refused"))),
        "an overclaiming handle is refused: {report}"
    );
}

mod common;

/// One request from the GPU prefill `p` to the GPU decode `d` through their agent: `p`'s
/// `p_blocks` filled with pattern `seed`, `d`'s `d_blocks` cleared; checksums Verified and every
/// byte read back from `d`'s GPU.
fn gpu_to_gpu(
    p: &mut pdpair_agent::synthetic::gpu::GpuEngine,
    d: &mut pdpair_agent::synthetic::gpu::GpuEngine,
    request: &str,
    seed: u64,
    p_blocks: &[u32],
    d_blocks: &[u32],
    tokens: u64,
) {
    d.clear().expect("clear");
    p.fill(seed, p_blocks, 0, tokens).expect("fill");
    expect_kv(d, p, request, d_blocks, tokens, None);
    let event = p.event();
    kv_ready(p, request, p_blocks, tokens, event);
    let done = request_end(d);
    landed(d, request, &done, seed, d_blocks, tokens);
}

/// Decode `d` expects `request` from `p` into `blocks` (`event`: the one of its `gpu.events` it
/// names).
fn expect_kv(
    d: &mut pdpair_agent::synthetic::gpu::GpuEngine,
    p: &pdpair_agent::synthetic::gpu::GpuEngine,
    request: &str,
    blocks: &[u32],
    tokens: u64,
    event: Option<u32>,
) {
    d.send(&pdpair_agent::engine_api::EngineRequest::ExpectKv {
        request: request.into(),
        prefill: p.address.clone(),
        blocks: blocks.to_vec(),
        num_tokens: tokens,
        first_token: 0,
        prompt: None,
        event,
    })
    .expect("ExpectKv");
}

/// Prefill `p` says `request`'s KV is ready in `blocks` (`event`: the one of its `gpu.events`
/// recorded after the writes).
fn kv_ready(
    p: &mut pdpair_agent::synthetic::gpu::GpuEngine,
    request: &str,
    blocks: &[u32],
    tokens: u64,
    event: Option<u32>,
) {
    p.send(&pdpair_agent::engine_api::EngineRequest::KvReady {
        release_token: None,
        request: request.into(),
        blocks: blocks.to_vec(),
        num_tokens: tokens,
        first_token: 0,
        prompt: None,
        event,
    })
    .expect("KvReady");
}

/// Decode's next `RequestDone` or `RequestFailed`.
fn request_end(d: &mut pdpair_agent::synthetic::gpu::GpuEngine) -> pdpair_agent::engine_api::AgentEvent {
    use pdpair_agent::engine_api::AgentEvent;
    loop {
        if let e @ (AgentEvent::RequestDone { .. } | AgentEvent::RequestFailed { .. }) =
            d.next_event().expect("decode event")
        {
            return e;
        }
    }
}

/// `done` is `request`'s `RequestDone` with its checksums Verified, and every byte of the
/// pattern `seed` is in `d`'s `blocks` (read back from the GPU).
fn landed(
    d: &pdpair_agent::synthetic::gpu::GpuEngine,
    request: &str,
    done: &pdpair_agent::engine_api::AgentEvent,
    seed: u64,
    blocks: &[u32],
    tokens: u64,
) {
    assert!(
        matches!(done, pdpair_agent::engine_api::AgentEvent::RequestDone { checksum: Some(c), .. } if c == "Verified"),
        "{request}: {done:?}"
    );
    assert_eq!(
        d.verify(seed, blocks, 0, tokens).expect("read back"),
        0,
        "{request}: every byte arrived"
    );
}

/// A prefill engine records one of its `gpu.events` after each request's writes and names it in
/// the `KvReady`: the agent waits for that one, not for work the engine queued after it (its next
/// forward pass, here a second of copies), so decode's `RequestDone` comes while that work still
/// runs. Registered without them (only `gpu.event`, whose latest record follows the later work),
/// the same request waits for all of it.
#[test]
#[ignore = "needs an NVIDIA GPU: make gpu-check"]
fn a_request_waits_for_the_event_its_kv_ready_names_not_for_later_work() {
    use pdpair_agent::synthetic::gpu::{EVENTS, GpuEngine, Sharing};
    use pdpair_api::{ChecksumPolicy, Role};

    let g = gpu();
    let w = common::World::new("gpu-events");
    let (_agent, socket) = common::ProcessAgent::start(&w, "a");
    let geometry = kv(8, 128, false, false, CacheDtype::Auto);
    let spec = |role, name: &str| {
        let mut s = common::spec(role, name, geometry.clone(), b"k", ChecksumPolicy::FailClosed);
        s.num_blocks = 16;
        s.lease_ms = 20_000;
        s
    };
    for (events, tag) in [(EVENTS, "named"), (0, "one")] {
        let mut p = GpuEngine::register_with(
            &socket,
            &spec(Role::Prefill, &format!("p-{tag}")),
            &g,
            Sharing::Ipc,
            events,
        )
        .expect("GPU prefill registers");
        let mut d =
            GpuEngine::register(&socket, &spec(Role::Decode, &format!("d-{tag}")), &g).expect("GPU decode registers");
        for e in [&p, &d] {
            e.wait_events_for(std::time::Duration::from_secs(30)).expect("timeout");
        }
        let blocks: Vec<u32> = (0..8).collect();
        d.clear().expect("clear");
        p.fill(5, &blocks, 0, 8 * 16).expect("fill");
        let named = p.event();
        assert_eq!(named.is_some(), events > 0);
        expect_kv(&mut d, &p, tag, &blocks, 8 * 16, None);
        // Decode's registration reaches prefill first, so the push starts at the KvReady.
        std::thread::sleep(std::time::Duration::from_millis(200));
        // The next forward pass: 500 copies of 2 GiB (about 1 TiB read and written: hundreds of
        // milliseconds or more on one GPU), queued and its events recorded before the KvReady of
        // the request that came before it.
        p.busy(2 << 30, 500).expect("busy");
        kv_ready(&mut p, tag, &blocks, 8 * 16, named);
        let done = request_end(&mut d);
        // Asked before the read-back, which waits for the GPU (the engines share its stream).
        let later_work_done = p.idle().expect("query");
        if events > 0 {
            assert!(
                !later_work_done,
                "{tag}: the request waited for the work after its event"
            );
        } else {
            assert!(
                later_work_done,
                "{tag}: without events it waits for the engine's latest record"
            );
        }
        landed(&d, tag, &done, 5, &blocks, 8 * 16);
    }
}

/// A decode engine gives a request blocks its earlier work may still write (a finished
/// request's kernels), records one of its `gpu.events` after that work and names it in the
/// `ExpectKv`: nothing writes the blocks before it passed, so the request's KV is what lands,
/// not the stale writes after it. Every byte is read back.
#[test]
#[ignore = "needs an NVIDIA GPU: make gpu-check"]
fn a_receive_waits_for_the_event_its_expect_kv_names_before_its_blocks_are_written() {
    use pdpair_agent::synthetic::gpu::GpuEngine;
    use pdpair_api::{ChecksumPolicy, Role};

    let g = gpu();
    let w = common::World::new("gpu-decode-events");
    let (_agent, socket) = common::ProcessAgent::start(&w, "a");
    let geometry = kv(8, 128, false, false, CacheDtype::Auto);
    let spec = |role, name: &str| {
        let mut s = common::spec(role, name, geometry.clone(), b"k", ChecksumPolicy::FailClosed);
        s.num_blocks = 16;
        s.lease_ms = 20_000;
        s
    };
    let mut p = GpuEngine::register(&socket, &spec(Role::Prefill, "p"), &g).expect("GPU prefill registers");
    let mut d = GpuEngine::register(&socket, &spec(Role::Decode, "d"), &g).expect("GPU decode registers");
    for e in [&p, &d] {
        e.wait_events_for(std::time::Duration::from_secs(30)).expect("timeout");
    }
    let blocks: Vec<u32> = (0..8).collect();
    d.clear().expect("clear");
    p.fill(6, &blocks, 0, 8 * 16).expect("fill");
    // Half a TiB of copies, then 0xee over decode's whole pool, queued before the receive.
    d.stale_writes(2 << 30, 250).expect("stale writes");
    let named = d.event();
    assert!(named.is_some());
    expect_kv(&mut d, &p, "stale", &blocks, 8 * 16, named);
    let event = p.event();
    kv_ready(&mut p, "stale", &blocks, 8 * 16, event);
    // The request's KV, not the stale writes queued before it.
    let done = request_end(&mut d);
    landed(&d, "stale", &done, 6, &blocks, 8 * 16);
}

/// Both engines' pools in GPU memory behind one agent (its own process: a process cannot open
/// its own IPC handles): the agent opens them by IPC handle, copies prefill's blocks into
/// decode's on the GPU (CUDA IPC, coalesced), and both sides checksum on the GPU (FailClosed).
/// Decode's engine then reads its pool back and checks every byte; the path is `CudaIpc`. A host
/// decode takes the GPU prefill's KV over the agent's own KV stream, and a handle that claims
/// more than its allocation holds is refused at registration.
#[test]
#[ignore = "needs an NVIDIA GPU: make gpu-check"]
fn gpu_pools_behind_one_agent_move_gpu_to_gpu_checked_byte_for_byte() {
    use pdpair_agent::{
        engine_api::{AgentEvent, EngineRequest},
        synthetic::{SyntheticEngine, gpu::GpuEngine},
    };
    use pdpair_api::{ChecksumPolicy, Role};

    let g = gpu();
    let w = common::World::new("gpu-pools");
    let (_agent, socket) = common::ProcessAgent::start(&w, "a");
    // 256 KiB blocks (4 layers, K and V, 8 heads x 16 tokens x 128 x 2 bytes): 64 of them.
    let geometry = kv(8, 128, false, false, CacheDtype::Auto);
    let spec = |role, name: &str| {
        let mut s = common::spec(role, name, geometry.clone(), b"k", ChecksumPolicy::FailClosed);
        s.num_blocks = 64;
        s.lease_ms = 10_000;
        s
    };
    let mut p = GpuEngine::register(&socket, &spec(Role::Prefill, "p0"), &g).expect("GPU prefill registers");
    let mut d = GpuEngine::register(&socket, &spec(Role::Decode, "d0"), &g).expect("GPU decode registers");
    for e in [&p, &d] {
        e.wait_events_for(std::time::Duration::from_secs(30)).expect("timeout");
    }
    // Decode's blocks in another order than prefill's: some copies coalesce, some do not.
    let p_blocks: Vec<u32> = (0..32).collect();
    let d_blocks: Vec<u32> = (0..16).chain(40..56).rev().collect();
    gpu_to_gpu(&mut p, &mut d, "r", 11, &p_blocks, &d_blocks, 32 * 16 - 5);
    // A host decode engine of the same pair: the GPU prefill's KV reaches it over the agent's own
    // KV stream (staged through host memory), every byte checked.
    let mut h = SyntheticEngine::register(&socket, &w.dir, &spec(Role::Decode, "h0")).expect("host decode");
    h.wait_events_for(std::time::Duration::from_secs(30)).expect("timeout");
    h.clear(&[0, 1]);
    p.fill(12, &[33, 34], 0, 20).expect("fill");
    h.send(&EngineRequest::ExpectKv {
        request: "h".into(),
        prefill: p.address.clone(),
        blocks: vec![0, 1],
        num_tokens: 20,
        first_token: 0,
        prompt: None,
        event: None,
    })
    .expect("ExpectKv");
    p.send(&EngineRequest::KvReady {
        release_token: None,
        request: "h".into(),
        blocks: vec![33, 34],
        num_tokens: 20,
        first_token: 0,
        prompt: None,
        event: p.event(),
    })
    .expect("KvReady");
    let done = loop {
        if let e @ (AgentEvent::RequestDone { .. } | AgentEvent::RequestFailed { .. }) =
            h.next_event().expect("host decode event")
        {
            break e;
        }
    };
    assert!(
        matches!(&done, AgentEvent::RequestDone { checksum: Some(c), .. } if c == "Verified"),
        "{done:?}"
    );
    assert_eq!(h.verify(12, &[0, 1], 0, 20), 0, "every byte reached the host pool");
    // A handle that claims more than its allocation holds.
    let small = DeviceMemory::alloc(&g, 1 << 20).expect("alloc");
    let mut reg = SyntheticEngine::registration(&spec(Role::Prefill, "p1"), None, false);
    let region = reg.layout().expect("layout").region_lens()[0];
    reg.gpu = Some(pdpair_agent::engine_api::GpuPool {
        device_uuid: g.uuid(),
        regions: vec![pdpair_agent::engine_api::GpuRegion {
            ipc_handle: Some(small.ipc_handle().expect("handle").to_hex()),
            offset: 0,
        }],
        event: None,
        events: Vec::new(),
    });
    assert!(region > 1 << 20);
    let e = SyntheticEngine::register_as(&socket, reg).expect_err("an overclaiming handle");
    assert!(e.contains("gpu.regions[0].ipc_handle") && e.contains("bytes"), "{e}");
}

/// vLLM 0.33's layout (each head's token's K and V side by side) in GPU memory behind one agent:
/// blocks outermost into blocks outermost (block by block: a block's layers one copy), into
/// layers outermost (a block of a layer per copy), and into K and V arrays (a copy per head's
/// token); checksums on the GPU (FailClosed), every byte read back.
#[test]
#[ignore = "needs an NVIDIA GPU: make gpu-check"]
fn gpu_pools_with_k_and_v_side_by_side_move_gpu_to_gpu_checked_byte_for_byte() {
    use pdpair_agent::{engine_api::RegionRequest, synthetic::gpu::GpuEngine};
    use pdpair_api::{ChecksumPolicy, Role};

    let g = gpu();
    let w = common::World::new("gpu-side-by-side");
    let (_agent, socket) = common::ProcessAgent::start(&w, "a");
    let geometry = kv(8, 128, false, false, CacheDtype::Auto);
    // A block's K and V: 16 tokens x 8 heads x 128 x 2 bytes, twice.
    let chunk = 2 * 16 * 8 * 128 * 2;
    let side_by_side = |layer_stride, block_stride| {
        vec![RegionRequest {
            layers: 4,
            kv_arrangement: Some(KvArrangement::Interleaved),
            layer_stride: Some(layer_stride),
            block_stride: Some(block_stride),
        }]
    };
    let spec = |role, name: &str, regions| {
        let mut s = common::spec(role, name, geometry.clone(), b"k", ChecksumPolicy::FailClosed);
        s.num_blocks = 64;
        s.lease_ms = 10_000;
        s.regions = regions;
        s
    };
    let mut p = GpuEngine::register(&socket, &spec(Role::Prefill, "p0", side_by_side(chunk, 4 * chunk)), &g)
        .expect("GPU prefill registers");
    let mut d = GpuEngine::register(&socket, &spec(Role::Decode, "d0", side_by_side(64 * chunk, chunk)), &g)
        .expect("GPU decode registers");
    let mut a = GpuEngine::register(&socket, &spec(Role::Decode, "d1", Vec::new()), &g).expect("GPU arrays register");
    let mut b = GpuEngine::register(&socket, &spec(Role::Decode, "d2", side_by_side(chunk, 5 * chunk)), &g)
        .expect("GPU blocks outermost registers");
    for e in [&p, &d, &a, &b] {
        e.wait_events_for(std::time::Duration::from_secs(30)).expect("timeout");
    }
    let p_blocks: Vec<u32> = (0..32).collect();
    let d_blocks: Vec<u32> = (0..16).chain(40..56).rev().collect();
    gpu_to_gpu(&mut p, &mut d, "r", 21, &p_blocks, &d_blocks, 32 * 16 - 5);
    gpu_to_gpu(&mut p, &mut a, "s", 22, &p_blocks[..8], &d_blocks[..8], 8 * 16);
    gpu_to_gpu(&mut p, &mut b, "t", 23, &p_blocks, &d_blocks, 32 * 16);
}

/// Sends `shared` as `ShareGpuMemory` (descriptor, claimed bytes) and then `reg`; the agent's
/// refusal, or `None` when it registered the pool.
fn register_sharing_raw(
    socket: &std::path::Path,
    shared: &[(std::os::fd::BorrowedFd<'_>, u64)],
    reg: pdpair_agent::engine_api::PoolRegistration,
) -> Option<String> {
    use pdpair_agent::{
        engine_api::{AgentEvent, EngineRequest},
        wire,
    };
    let mut s = std::os::unix::net::UnixStream::connect(socket).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .expect("timeout");
    let fds: Vec<_> = shared.iter().map(|(fd, _)| *fd).collect();
    let sizes = shared.iter().map(|(_, n)| *n).collect();
    wire::write_frame_fds(&s, &EngineRequest::ShareGpuMemory { sizes }, &fds).expect("share");
    wire::write_frame(&mut s, &EngineRequest::RegisterPool(Box::new(reg))).expect("register");
    match wire::read_frame::<AgentEvent>(&mut s).expect("an answer") {
        AgentEvent::RegistrationFailed { message, .. } => Some(message),
        AgentEvent::Registered { .. } => None,
        other => panic!("unexpected answer: {other:?}"),
    }
}

/// GPU pools shared as VMM allocations (`ShareGpuMemory`: file descriptors of `cuMemCreate`
/// memory, as torch's `expandable_segments` allocates), their regions straddling allocations:
/// a VMM prefill pushes to an IPC-handle decode and to a VMM decode through one agent, every
/// byte and checksum checked. Refused: a descriptor that is no GPU allocation, and an allocation
/// claimed larger than it is.
#[test]
#[ignore = "needs an NVIDIA GPU: make gpu-check"]
fn gpu_pools_shared_as_vmm_descriptors_move_byte_for_byte_and_false_claims_are_refused() {
    use pdpair_agent::{
        engine_api::{GpuPool, GpuRegion},
        synthetic::{
            SyntheticEngine,
            gpu::{GpuEngine, Sharing},
        },
    };
    use pdpair_api::{ChecksumPolicy, Role};
    use std::os::fd::AsFd;

    let g = gpu();
    let w = common::World::new("gpu-vmm");
    let (_agent, socket) = common::ProcessAgent::start(&w, "a");
    let geometry = kv(8, 128, false, false, CacheDtype::Auto);
    let spec = |role, name: &str| {
        let mut s = common::spec(role, name, geometry.clone(), b"k", ChecksumPolicy::FailClosed);
        s.num_blocks = 64;
        s.lease_ms = 10_000;
        s
    };
    // 16 MiB of pool in 2 MiB allocations, the region starting 4 KiB into the first.
    let vmm = Sharing::Vmm { chunk: 2 << 20 };
    let mut p = GpuEngine::register_sharing(&socket, &spec(Role::Prefill, "p0"), &g, vmm).expect("VMM prefill");
    let mut d_ipc = GpuEngine::register(&socket, &spec(Role::Decode, "d0"), &g).expect("IPC decode");
    let mut d_vmm = GpuEngine::register_sharing(&socket, &spec(Role::Decode, "d1"), &g, vmm).expect("VMM decode");
    for (n, d) in [&mut d_ipc, &mut d_vmm].into_iter().enumerate() {
        d.wait_events_for(std::time::Duration::from_secs(30)).expect("timeout");
        let p_blocks: Vec<u32> = (0..32).collect();
        let d_blocks: Vec<u32> = (8..40).rev().collect();
        gpu_to_gpu(
            &mut p,
            d,
            &format!("r{n}"),
            20 + n as u64,
            &p_blocks,
            &d_blocks,
            32 * 16 - 3,
        );
    }
    // False claims, each refused at registration.
    let mut reg = SyntheticEngine::registration(&spec(Role::Prefill, "p1"), None, false);
    let region = reg.layout().expect("layout").region_lens()[0] as u64;
    reg.gpu = Some(GpuPool {
        device_uuid: g.uuid(),
        regions: vec![GpuRegion {
            ipc_handle: None,
            offset: 0,
        }],
        event: None,
        events: Vec::new(),
    });
    // A memfd is no GPU allocation.
    #[allow(unsafe_code)]
    // SAFETY: memfd_create with a static name; the new descriptor is owned here.
    let memfd =
        unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(libc::memfd_create(c"x".as_ptr(), 0)) };
    let e = register_sharing_raw(
        &socket,
        &[(memfd.as_fd(), region.div_ceil(2 << 20) * (2 << 20))],
        reg.clone(),
    )
    .expect("a memfd is refused");
    assert!(e.contains("shared GPU allocation 0"), "{e}");
    // A 2 MiB allocation claimed as the whole region.
    let (_small, fds) = DeviceMemory::alloc_vmm(&g, 2 << 20, 2 << 20).expect("alloc");
    assert_eq!(fds.len(), 1);
    let claim = region.div_ceil(2 << 20) * (2 << 20);
    assert!(claim > 2 << 20);
    let e = register_sharing_raw(&socket, &[(fds[0].0.as_fd(), claim)], reg).expect("an overclaim is refused");
    assert!(
        e.contains(&format!("shared GPU allocation 0 does not hold the {claim} bytes")),
        "{e}"
    );
    println!("refused as it should: {e}");
}
