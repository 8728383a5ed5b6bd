//! Property fuzzing of what the agent reads from others: the frame decoder (plain and sealed),
//! the authentication and handshake state machine fed by an arbitrary peer, and the engine API
//! decoder and registration path of a live agent fed arbitrary registrations. Each property
//! holds for every generated input: no panic, no hang, and nothing accepted that should not be.
//! `PROPTEST_CASES` scales the runs (docs/security.md records a longer one).

mod common;

use std::{
    io::{self, Read, Write},
    os::unix::net::UnixStream,
};

use common::{World, kv};
use pdpair_agent::{
    engine_api::{AgentEvent, EngineRequest, GpuPool, GpuRegion, PoolRegistration, RegionRequest},
    layout::LayerAt,
    protocol::{self, Message},
    transport::ucx::Transport,
    wire::{self, Opener, Sealer},
};
use pdpair_api::{ChecksumPolicy, KvLayout, Parallelism, Role, TransferMode};
use proptest::prelude::*;

/// A peer that has said everything it will say: reads come from `input`, writes are kept.
struct Scripted {
    input: io::Cursor<Vec<u8>>,
    output: Vec<u8>,
}

impl Read for Scripted {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Scripted {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn frames(messages: &[Message]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in messages {
        wire::write_frame(&mut out, m).expect("frame");
    }
    out
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..64)
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (any::<u16>(), ".{0,40}", bytes()).prop_map(|(version, pdpair, nonce)| Message::Hello {
            version,
            pdpair,
            nonce
        }),
        (any::<u16>(), bytes(), bytes()).prop_map(|(version, nonce, proof)| Message::Challenge {
            version,
            nonce,
            proof
        }),
        bytes().prop_map(|proof| Message::Proof { proof }),
        Just(Message::AuthOk),
        (".{0,20}", ".{0,80}").prop_map(|(r, message)| Message::Reject {
            reasons: vec![protocol::Reason::parse(&r)],
            message
        }),
        any::<u64>().prop_map(|seq| Message::Ping { seq }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any bytes: the decoders return a message or an error, never panic, and never allocate
    /// past the limit they were given.
    #[test]
    fn the_frame_decoders_take_any_bytes(input in prop::collection::vec(any::<u8>(), 0..512), key in any::<[u8; 32]>()) {
        let _ = wire::read_frame::<Message>(&mut input.as_slice());
        let _ = wire::read_frame::<EngineRequest>(&mut input.as_slice());
        let _ = wire::read_frame_max::<Message>(&mut input.as_slice(), wire::MAX_PREAUTH_FRAME);
        let _ = wire::read_sealed::<Message>(&mut input.as_slice(), &mut Opener::new(key), wire::MAX_FRAME);
        let _ = pdpair_agent::engine_api::decode_request(&input, 64, |_| Ok::<(), String>(()));
    }

    /// A registered engine's decoder counts the values of JSON of any shape without panicking,
    /// and takes what serde takes within the bound.
    #[test]
    fn an_engines_frames_decode_as_serde_decodes_them(json in "[\\[\\]{}\",:0-9a-z ]{0,200}", max in 0usize..64) {
        let ours = pdpair_agent::engine_api::decode_request(json.as_bytes(), usize::MAX, |_| Ok::<(), String>(())).ok();
        prop_assert_eq!(ours, serde_json::from_str::<EngineRequest>(&json).ok());
        let _ = pdpair_agent::engine_api::decode_request(json.as_bytes(), max, |_| Ok::<(), String>(()));
    }

    /// A frame sealed with one key opens with it, in order, and with no other key.
    #[test]
    fn sealed_frames_open_only_with_their_key(m in message(), key in any::<[u8; 32]>(), other in any::<[u8; 32]>()) {
        let mut buf = Vec::new();
        wire::write_sealed(&mut buf, &mut Sealer::new(key), &m).expect("seal");
        prop_assert_eq!(wire::read_sealed::<Message>(&mut buf.as_slice(), &mut Opener::new(key), wire::MAX_FRAME).ok(), Some(m));
        if other != key {
            prop_assert!(wire::read_sealed::<Message>(&mut buf.as_slice(), &mut Opener::new(other), wire::MAX_FRAME).is_err());
        }
    }

    /// Whatever a peer without the secret says, in whatever order, prefill's authentication
    /// never succeeds, never panics, and ends when the peer's bytes end.
    #[test]
    fn prefill_never_authenticates_a_peer_without_the_secret(script in prop::collection::vec(message(), 0..6)) {
        let mut peer = Scripted { input: io::Cursor::new(frames(&script)), output: Vec::new() };
        let got = protocol::authenticate_prefill(&mut peer, |_| Some(b"the-secret".to_vec()));
        prop_assert!(got.is_err(), "{:?}", script);
    }

    /// The same for decode facing an arbitrary prefill.
    #[test]
    fn decode_never_authenticates_a_peer_without_the_secret(script in prop::collection::vec(message(), 0..6)) {
        let mut peer = Scripted { input: io::Cursor::new(frames(&script)), output: Vec::new() };
        let got = protocol::authenticate_decode(&mut peer, "team-a/tiny", b"the-secret");
        prop_assert!(got.is_err(), "{:?}", script);
    }
}

fn registration() -> impl Strategy<Value = PoolRegistration> {
    (
        (
            any::<bool>(),
            // The layout (bit 0), the arrangement (bits 1-2), and the regions (by /8 and /24).
            0..48u8,
            prop_oneof![4 => 1..3i32, 1 => -2..1i32],
            prop_oneof![4 => 1..5i32, 1 => -2..1i32],
        ),
        (
            prop_oneof![1 => Just(-1), 8 => 1..16i32, 1 => Just(i32::MAX)],
            prop_oneof![1 => Just(0), 8 => 1..64i32, 1 => Just(i32::MAX)],
        ),
        (
            prop_oneof![1 => Just(0), 8 => 1..128i32, 1 => Just(i32::MAX)],
            prop_oneof![1 => Just(0u32), 8 => 1..64u32, 1 => Just(u32::MAX)],
        ),
        (
            prop_oneof![3 => Just(0u32), 1 => 0..3u32],
            any::<bool>(),
            prop_oneof![4 => "([0-9a-f]{2}){1,8}", 1 => ".{0,12}"],
        ),
        prop::option::weighted(0.15, gpu_pool()),
    )
        .prop_map(
            |((decode, layout, tensor, layers), (heads, block), (head_dim, blocks), (rank, mla, key), gpu)| {
                let mut geometry = kv(64, None);
                geometry.layers = layers;
                geometry.kv_heads = heads;
                geometry.head_dim = head_dim;
                geometry.block_size = block;
                geometry.mla = mla;
                geometry.layout = if layout % 2 == 0 { KvLayout::Hnd } else { KvLayout::Nhd };
                PoolRegistration {
                    api_version: pdpair_agent::engine_api::API_VERSION,
                    pdpair: "team-a/tiny".into(),
                    role: if decode { Role::Decode } else { Role::Prefill },
                    engine: "fuzz".into(),
                    pod: None,
                    mode: Some(TransferMode::Push),
                    checksum: Some(ChecksumPolicy::FailClosed),
                    handshake_timeout_ms: Some(100),
                    lease_ms: Some(100),
                    parallelism: Parallelism {
                        tensor,
                        ..Parallelism::default()
                    },
                    kv: geometry,
                    pairing_key: key,
                    memory_fd: false,
                    memory_path: None,
                    num_blocks: blocks,
                    tensor_rank: rank,
                    instance: None,
                    pod_engines: None,
                    kv_arrangement: arrangement(u32::from(layout / 2)),
                    // Every few registrations name regions: splits of the layers (or not), with
                    // arrangements right or wrong for the geometry.
                    regions: match layout / 8 % 3 {
                        0 => Vec::new(),
                        1 => (0..layers.max(0) as u32)
                            .map(|l| RegionRequest {
                                layers: 1,
                                kv_arrangement: arrangement(l),
                                // Strides of every size, for any arrangement.
                                layer_stride: (l % 4 == 2).then(|| u64::MAX - u64::from(l)),
                                block_stride: (l % 3 == 1).then(|| u64::from(layout) * 97),
                            })
                            .collect(),
                        _ => vec![RegionRequest {
                            layers: (layers.max(0) as u32).saturating_sub(u32::from(layout / 24 % 2)),
                            ..RegionRequest::default()
                        }],
                    },
                    // Now and then a staging reason, sometimes past its limit or beside a GPU pool.
                    staging: (layout % 5 == 0).then(|| "staged \u{7}".repeat(usize::from(layout) * 3)),
                    // Now and then the address a prefill engine had before (refused for decode).
                    address: (layout % 7 == 0)
                        .then(|| std::net::SocketAddr::from(([127, 0, 0, 1], 40_000 + u16::from(layout)))),
                    gpu,
                }
            },
        )
}

/// GPU pools, well-formed or not: UUIDs, handles and events of any shape.
fn gpu_pool() -> impl Strategy<Value = GpuPool> {
    let handle = prop_oneof![3 => "[0-9a-f]{128}", 1 => "[0-9a-fA-Fz]{0,140}"];
    (
        prop_oneof![
            2 => "GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
            1 => ".{0,40}"
        ],
        prop::collection::vec(
            (
                prop_oneof![4 => handle.clone().prop_map(Some), 1 => Just(None)],
                prop_oneof![3 => 0..(1u64 << 30), 1 => any::<u64>()],
            ),
            0..5,
        ),
        prop::option::of(handle.clone()),
        prop::collection::vec(handle, 0..3),
    )
        .prop_map(|(device_uuid, regions, event, events)| GpuPool {
            device_uuid,
            regions: regions
                .into_iter()
                .map(|(ipc_handle, offset)| GpuRegion { ipc_handle, offset })
                .collect(),
            event,
            events,
        })
}

/// Absent, or one of the arrangements, by `n`.
fn arrangement(n: u32) -> Option<pdpair_agent::layout::KvArrangement> {
    use pdpair_agent::layout::KvArrangement::*;
    [None, Some(KvFirst), Some(BlocksFirst), Some(Latent), Some(Interleaved)][n as usize % 5]
}

/// Arbitrary registrations against a live agent: each is answered (`Registered` or
/// `RegistrationFailed`, never a dropped connection or a crash), and the agent keeps answering.
#[test]
fn a_live_agent_answers_every_registration_and_keeps_serving() {
    let w = World::new("fuzz-register");
    let socket = w.agent("a", Transport::Tcp, false);
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(64);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(cases));
    let registered = std::sync::atomic::AtomicU32::new(0);
    runner
        .run(&registration(), |reg| {
            let mut s = UnixStream::connect(&socket).expect("connect");
            s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
                .expect("timeout");
            wire::write_frame(&mut s, &EngineRequest::RegisterPool(Box::new(reg.clone()))).expect("send");
            let answer = wire::read_frame::<AgentEvent>(&mut s);
            prop_assert!(
                matches!(
                    answer,
                    Ok(AgentEvent::Registered { .. } | AgentEvent::RegistrationFailed { .. })
                ),
                "{reg:?} -> {answer:?}"
            );
            if matches!(answer, Ok(AgentEvent::Registered { .. })) {
                // This agent serves host pools only: a GPU pool is always refused.
                prop_assert!(reg.gpu.is_none(), "a GPU pool was registered: {reg:?}");
                registered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(())
        })
        .expect("every registration answered");
    println!(
        "{cases} registrations: {} registered, the rest refused",
        registered.into_inner()
    );
}

/// A packed key with UCX's structure.
fn rkey() -> Vec<u8> {
    [1u64.to_le_bytes().as_slice(), &[0, 4, 1, 2, 3, 4]].concat()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// A peer's memory description: checking it never panics, and one that passes keeps every
    /// block of every layer's arrays inside the region the layer names.
    #[test]
    fn a_memory_description_that_passes_keeps_every_block_inside_its_region(
        regions in prop::collection::vec(
            (
                prop_oneof![3 => 0..(1u64 << 40), 1 => any::<u64>(), 1 => Just(u64::MAX - 4096)],
                prop_oneof![any::<u64>(), 0..(1u64 << 22)],
                prop_oneof![4 => Just(rkey()), 1 => prop::collection::vec(any::<u8>(), 0..24)],
            ),
            0..4,
        ),
        gpu in any::<bool>(),
        num_blocks in prop_oneof![0..32u32, Just(u32::MAX)],
        layers in prop_oneof![
            3 => prop::collection::vec(
                (0..3u32, 0..(1u64 << 20), prop::option::weighted(0.9, 0..(1u64 << 20)), 0..4096u64),
                2..=2,
            ),
            1 => prop::collection::vec(
                (any::<u32>(), any::<u64>(), prop::option::of(any::<u64>()), prop_oneof![Just(0u64), Just(u64::MAX / 2)]),
                0..4,
            ),
        ],
        mla in any::<bool>(),
        // Each layer's (head, token)s apart by: absent (a half token), one or two half tokens
        // (K and V side by side), or anything.
        units in prop::collection::vec(prop_oneof![Just(None), Just(Some(1u64)), Just(Some(2u64)), any::<u64>().prop_map(|u| Some(u | 1 << 63))], 4),
    ) {
        let mut geometry = kv(64, None);
        geometry.mla = mla;
        let one = pdpair_agent::layout::PoolLayout::new(&geometry, &Parallelism::default(), 1, 0).expect("layout");
        let (block_len, half) = (one.block_len() as u64, one.half_token() as u64);
        let desc = protocol::MemoryDesc {
            // A GPU pool's keys are 16-byte tokens (every other length refused), a host pool's
            // UCX keys.
            kind: if gpu { protocol::MemoryKind::Cuda } else { protocol::MemoryKind::Host },
            regions: regions
                .into_iter()
                .map(|(base, len, rkey)| protocol::RegionDesc { base, len, rkey })
                .collect(),
            num_blocks,
            block_len,
            layers: layers
                .into_iter()
                .zip(units.iter().cycle())
                .map(|((region, k, v, extra), unit)| LayerAt {
                    region,
                    k,
                    v,
                    block_stride: block_len.saturating_add(extra),
                    // Units past 2 are raw bytes, the rest half tokens.
                    unit: unit.map(|u| if u <= 2 { u * half } else { u }),
                })
                .collect(),
        };
        if desc.check(&geometry, &Parallelism::default(), 0).is_ok() {
            if gpu {
                prop_assert!(desc.regions.iter().all(|r| r.rkey.len() == protocol::CUDA_TOKEN_LEN));
            }
            for (l, layer) in desc.layers.iter().enumerate() {
                let region = &desc.regions[layer.region as usize];
                prop_assert!(region.base.checked_add(region.len).is_some());
                prop_assert_eq!(layer.v.is_none(), mla, "a V array exactly when not MLA");
                // A block's last (head, token) ends inside the region.
                let span = (desc.block_len / half - 1) * layer.unit.unwrap_or(half) + half;
                for v in [false, true] {
                    for b in [0, desc.num_blocks - 1] {
                        let Some(at) = desc.block(l as u32, v, b) else { continue };
                        prop_assert!(at >= region.base);
                        prop_assert!(at.checked_add(span).is_some_and(|e| e <= region.base + region.len));
                    }
                }
            }
        }
    }
}

#[test]
fn the_memory_description_property_sees_descriptions_that_pass() {
    // Runs the property's generator through the check alone, many times: some must pass.
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(512));
    let geometry = kv(64, None);
    let block_len = pdpair_agent::layout::PoolLayout::new(&geometry, &Parallelism::default(), 1, 0)
        .expect("layout")
        .block_len() as u64;
    let passed = std::sync::atomic::AtomicU32::new(0);
    runner
        .run(&(1u32..32, 0..(1u64 << 16), any::<bool>()), |(blocks, extra, split)| {
            let stride = block_len + extra;
            let array = u64::from(blocks) * stride;
            let region = |base| protocol::RegionDesc {
                base,
                len: 2 * 2 * array,
                rkey: rkey(),
            };
            let at = |region, k, v| LayerAt {
                region,
                k,
                v: Some(v),
                block_stride: stride,
                unit: None,
            };
            let desc = protocol::MemoryDesc {
                kind: protocol::MemoryKind::Host,
                regions: if split {
                    vec![region(4096), region(1 << 40)]
                } else {
                    vec![region(4096)]
                },
                num_blocks: blocks,
                block_len,
                layers: if split {
                    vec![at(0, 0, array), at(1, 2 * array, 3 * array)]
                } else {
                    vec![at(0, 0, array), at(0, 2 * array, 3 * array)]
                },
            };
            if desc.check(&geometry, &Parallelism::default(), 0).is_ok() {
                passed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(())
        })
        .expect("runs");
    assert_eq!(passed.into_inner(), 512, "well-formed descriptions pass");
}
