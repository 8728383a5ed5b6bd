//! Authentication and handshake over real TCP on loopback, one thread per side.

use std::{
    net::{TcpListener, TcpStream},
    thread,
};

use pdpair_api::{CacheDtype, KvLayout, ModelDtype};

use super::*;

fn kv(block: i32) -> KvGeometry {
    KvGeometry {
        engine: "vllm".into(),
        engine_version: None,
        model: "m".into(),
        dtype: ModelDtype::Bfloat16,
        cache_dtype: CacheDtype::Auto,
        layers: 2,
        kv_heads: 2,
        head_dim: 64,
        attention_backend: "FLASH_ATTN".into(),
        layout: KvLayout::Hnd,
        block_size: block,
        kernel_block_size: None,
        mla: false,
        hybrid: false,
        host_buffer: false,
    }
}

fn info(role: Role, block: i32) -> PeerInfo {
    PeerInfo {
        agent: format!("{role}-agent"),
        version: PROTOCOL_VERSION,
        pdpair: "team-a/llama".into(),
        role,
        engine: format!("{role}-0"),
        mode: TransferMode::Push,
        checksum: ChecksumPolicy::FailClosed,
        parallelism: Parallelism::default(),
        kv: kv(block),
        tensor_rank: 0,
        worker_address: vec![1; 16],
        memory: MemoryDesc::default(),
        stream_address: String::new(),
    }
}

/// A packed key with UCX's structure: one domain, a memory-type byte, 4 key bytes.
fn rkey() -> Vec<u8> {
    let mut k = 1u64.to_le_bytes().to_vec();
    k.extend_from_slice(&[0, 4, 9, 9, 9, 9]);
    k
}

#[test]
fn a_ucx_key_must_hold_exactly_its_domains_and_an_optional_device_trailer() {
    assert_eq!(check_rkey(&rkey()), Ok(()));
    // UCX 1.22 appends the memory's system device; a device's distances are 3 bytes each.
    for extra in [vec![0u8], vec![1, 2, 3, 4], vec![1, 2, 3, 4, 5, 6, 7]] {
        let mut k = rkey();
        k.extend_from_slice(&extra);
        assert_eq!(check_rkey(&k), Ok(()), "{} trailing bytes", extra.len());
    }
    // A distance cut short, a domain's bytes cut short, no domain, too short a key.
    let mut k = rkey();
    k.extend_from_slice(&[1, 2]);
    assert!(check_rkey(&k).expect_err("a partial distance").contains("take 14"));
    let short = rkey()[..12].to_vec();
    assert!(check_rkey(&short).expect_err("truncated").contains("is 12 bytes"));
    let mut none = rkey();
    none[..8].copy_from_slice(&0u64.to_le_bytes());
    assert_eq!(check_rkey(&none), Err("names no memory domain".into()));
    assert!(check_rkey(&[1, 0, 0]).is_err());
}

#[test]
fn a_ucx_worker_address_must_be_of_a_format_ucx_knows() {
    assert_eq!(check_ucx_address(&[0x10; 16]), Ok(()), "v1, flags in the high bits");
    assert_eq!(check_ucx_address(&[0x01; 16]), Ok(()), "v2");
    let e = check_ucx_address(&[0x07; 16]).expect_err("format 7");
    assert!(e.contains("format 7") && e.contains("0x07"), "{e}");
    assert!(check_ucx_address(&[0; 4]).expect_err("short").contains("is 4 bytes"));
    // Another backend's address (CUDA IPC's) is checked for its length only.
    assert_eq!(check_worker_address(&[0x07; 16]), Ok(()));
}

/// The memory description a peer's current geometry implies (16 blocks at 0x10000).
fn described(p: &PeerInfo) -> MemoryDesc {
    let l = crate::layout::PoolLayout::new(&p.kv, &p.parallelism, 16, p.tensor_rank).expect("layout");
    MemoryDesc::of(&l, vec![(0x10000, rkey())])
}

/// Runs both sides with each peer's memory as its geometry implies.
fn pair(
    p_secret: &'static [u8],
    d_secret: &'static [u8],
    mut p: PeerInfo,
    mut d: PeerInfo,
) -> (Result<PeerInfo, HandshakeError>, Result<PeerInfo, HandshakeError>) {
    p.memory = described(&p);
    d.memory = described(&d);
    pair_as_is(p_secret, d_secret, p, d)
}

/// Runs P's side (auth + handshake) on a thread and D's side here.
fn pair_as_is(
    p_secret: &'static [u8],
    d_secret: &'static [u8],
    p: PeerInfo,
    d: PeerInfo,
) -> (Result<PeerInfo, HandshakeError>, Result<PeerInfo, HandshakeError>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let (_, mut session) =
            authenticate_prefill(&mut s, |pair| (pair == "team-a/llama").then(|| p_secret.to_vec()))?;
        handshake_prefill(&mut s, &mut session, &p)
    });
    let mut c = TcpStream::connect(addr).expect("connect");
    let client = authenticate_decode(&mut c, "team-a/llama", d_secret)
        .and_then(|mut session| handshake_decode(&mut c, &mut session, &d));
    (server.join().expect("server thread"), client)
}

#[test]
fn same_secret_and_compatible_geometry_handshake() {
    let (p, d) = pair(
        b"secret-1",
        b"secret-1",
        info(Role::Prefill, 64),
        info(Role::Decode, 64),
    );
    assert_eq!(p.expect("P accepts").engine, "decode-0");
    let got = d.expect("D accepts");
    assert_eq!(got.engine, "prefill-0");
    assert_eq!(got.memory.regions[0].rkey, rkey());
}

#[test]
fn a_foreign_secret_is_rejected_before_any_geometry_crosses() {
    let (p, d) = pair(b"secret-1", b"another", info(Role::Prefill, 64), info(Role::Decode, 64));
    // D detects P's proof does not match its secret and refuses first; P hears Unauthenticated.
    assert!(matches!(d, Err(HandshakeError::Unauthenticated(_))), "{d:?}");
    assert!(matches!(p, Err(HandshakeError::Unauthenticated(_))), "{p:?}");
    assert_eq!(p.expect_err("rejected").reasons(), vec![Reason::Unauthenticated]);
}

/// What `authenticate_prefill` returns.
type Authenticated = Result<(String, Session), HandshakeError>;

/// A prefill side on loopback that authenticates one connection with the secret `secret-1`;
/// the connection to it, and its outcome.
fn prefill_with_secret_1() -> (TcpStream, thread::JoinHandle<Authenticated>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        authenticate_prefill(&mut s, |_| Some(b"secret-1".to_vec()))
    });
    (TcpStream::connect(addr).expect("connect"), server)
}

#[test]
fn a_stranger_that_skips_verification_still_cannot_pass() {
    // A D that does not check P's proof and answers with a guess: P refuses it and sends nothing
    // but the challenge and the rejection.
    let (mut c, server) = prefill_with_secret_1();
    wire::write_frame(
        &mut c,
        &Message::Hello {
            version: PROTOCOL_VERSION,
            pdpair: "team-a/llama".into(),
            nonce: nonce().expect("nonce"),
        },
    )
    .expect("hello");
    let challenge: Message = wire::read_frame(&mut c).expect("challenge");
    assert!(matches!(challenge, Message::Challenge { .. }));
    wire::write_frame(&mut c, &Message::Proof { proof: vec![0; 32] }).expect("proof");
    let answer: Message = wire::read_frame(&mut c).expect("answer");
    assert!(
        matches!(&answer, Message::Reject { reasons, .. } if reasons == &vec![Reason::Unauthenticated]),
        "{answer:?}"
    );
    assert!(
        matches!(wire::read_frame::<Message>(&mut c), Err(FrameError::Closed)),
        "P closes after rejecting"
    );
    assert!(matches!(
        server.join().expect("thread"),
        Err(HandshakeError::Unauthenticated(_))
    ));
}

#[test]
fn a_replayed_proof_fails() {
    // Record a genuine D's proof from one session, replay it in a new session: P's fresh nonce
    // makes it worthless.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = thread::spawn(move || {
        let mut results = Vec::new();
        for _ in 0..2 {
            let (mut s, _) = listener.accept().expect("accept");
            results.push(authenticate_prefill(&mut s, |_| Some(b"secret-1".to_vec())).is_ok());
        }
        results
    });
    // Session 1: a genuine D, recording its Hello and Proof.
    let mut c = TcpStream::connect(addr).expect("connect");
    let d_nonce = nonce().expect("nonce");
    wire::write_frame(
        &mut c,
        &Message::Hello {
            version: PROTOCOL_VERSION,
            pdpair: "team-a/llama".into(),
            nonce: d_nonce.clone(),
        },
    )
    .expect("hello");
    let Message::Challenge { nonce: p_nonce, .. } = wire::read_frame(&mut c).expect("challenge") else {
        panic!("no challenge")
    };
    let genuine = proof(b"secret-1", Role::Decode, "team-a/llama", &d_nonce, &p_nonce);
    wire::write_frame(&mut c, &Message::Proof { proof: genuine.clone() }).expect("proof");
    assert_eq!(wire::read_frame::<Message>(&mut c).expect("ok"), Message::AuthOk);
    // Session 2: the same Hello and Proof, replayed.
    let mut c = TcpStream::connect(addr).expect("connect");
    wire::write_frame(
        &mut c,
        &Message::Hello {
            version: PROTOCOL_VERSION,
            pdpair: "team-a/llama".into(),
            nonce: d_nonce,
        },
    )
    .expect("hello");
    let _: Message = wire::read_frame(&mut c).expect("challenge");
    wire::write_frame(&mut c, &Message::Proof { proof: genuine }).expect("replay");
    assert!(matches!(
        wire::read_frame::<Message>(&mut c).expect("answer"),
        Message::Reject { .. }
    ));
    assert_eq!(server.join().expect("thread"), vec![true, false]);
}

#[test]
fn vllm_push_16_64_is_rejected_at_the_handshake_with_the_rule_reason() {
    let (p, d) = pair(b"s", b"s", info(Role::Prefill, 16), info(Role::Decode, 64));
    for side in [&p, &d] {
        match side {
            Err(HandshakeError::Rejected { reasons, message }) => {
                assert_eq!(reasons, &vec!["KernelBlockSizeMismatch".to_owned()]);
                assert!(message.contains("16") && message.contains("64"), "{message}");
            }
            other => panic!("expected a rejection, got {other:?}"),
        }
    }
}

#[test]
fn flashinfer_128_64_is_rejected_with_blocks_per_logical() {
    let mut p = info(Role::Prefill, 128);
    p.kv.kernel_block_size = Some(64);
    p.kv.attention_backend = "FLASHINFER".into();
    let mut d = info(Role::Decode, 64);
    d.kv.attention_backend = "FLASHINFER".into();
    let (p, _) = pair(b"s", b"s", p, d);
    assert_eq!(
        p.expect_err("rejected").reasons(),
        vec!["KernelBlocksPerLogicalMismatch".to_owned()]
    );
}

#[test]
fn same_role_and_other_settings_are_refused() {
    let (p, _) = pair(b"s", b"s", info(Role::Prefill, 64), info(Role::Prefill, 64));
    assert_eq!(p.expect_err("rejected").reasons(), vec!["RoleMismatch".to_owned()]);
    let mut d = info(Role::Decode, 64);
    d.checksum = ChecksumPolicy::Disabled;
    let (p, _) = pair(b"s", b"s", info(Role::Prefill, 64), d);
    assert_eq!(
        p.expect_err("rejected").reasons(),
        vec!["TransferSettingsMismatch".to_owned()]
    );
}

#[test]
fn garbage_and_truncated_frames_are_errors_not_panics() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let inputs: Vec<Vec<u8>> = vec![
        vec![],
        vec![0, 0],
        vec![0, 0, 0, 0],
        vec![0xff; 4],
        [&5u32.to_be_bytes()[..], b"{\"ty"].concat(),
        [&4u32.to_be_bytes()[..], b"null"].concat(),
        [&17u32.to_be_bytes()[..], b"{\"type\":\"Nope\"} "].concat(),
    ];
    let n = inputs.len();
    let server = thread::spawn(move || {
        (0..n)
            .map(|_| {
                let (mut s, _) = listener.accept().expect("accept");
                authenticate_prefill(&mut s, |_| Some(b"s".to_vec())).is_err()
            })
            .collect::<Vec<bool>>()
    });
    for input in inputs {
        let mut c = TcpStream::connect(addr).expect("connect");
        std::io::Write::write_all(&mut c, &input).expect("write");
        drop(c);
    }
    assert!(server.join().expect("no panic").into_iter().all(|failed| failed));
}

#[test]
fn unequal_tensor_parallelism_maps_head_ranges_between_ranks() {
    // 2 KV heads in `info`; use 8 so that tensor parallelism shards them.
    let with = |role: Role, tp: i32, rank: u32| {
        let mut i = info(role, 64);
        i.kv.kv_heads = 8;
        i.parallelism.tensor = tp;
        i.tensor_rank = rank;
        i
    };
    // Decode rank 1 of 4 holds heads 2..4, inside prefill rank 0 of 2 (heads 0..4).
    let map = head_map(&with(Role::Prefill, 2, 0), &with(Role::Decode, 4, 1));
    assert_eq!(
        map,
        Ok(HeadMap {
            p_first: 2,
            count: 2,
            d_first: 0
        })
    );
    let (p, d) = pair(b"s", b"s", with(Role::Prefill, 2, 0), with(Role::Decode, 4, 1));
    assert!(p.is_ok() && d.is_ok(), "{p:?} {d:?}");
    // Prefill rank 1 of 2 (heads 4..8) into decode rank 0 of 1 (all 8): the second half.
    let map = head_map(&with(Role::Prefill, 2, 1), &with(Role::Decode, 1, 0));
    assert_eq!(
        map,
        Ok(HeadMap {
            p_first: 0,
            count: 4,
            d_first: 4
        })
    );
    let (p, d) = pair(b"s", b"s", with(Role::Prefill, 2, 1), with(Role::Decode, 1, 0));
    assert!(p.is_ok() && d.is_ok(), "{p:?} {d:?}");
    // Decode rank 2 of 4 holds heads 4..6, which prefill rank 0 does not: refused by name.
    let (p, _) = pair(b"s", b"s", with(Role::Prefill, 2, 0), with(Role::Decode, 4, 2));
    assert_eq!(p.expect_err("refused").reasons(), vec!["WrongTensorRank".to_owned()]);
    // Partial blocks need HND on both sides.
    let mut nhd = with(Role::Decode, 4, 1);
    nhd.kv.layout = KvLayout::Nhd;
    let mut p_nhd = with(Role::Prefill, 2, 0);
    p_nhd.kv.layout = KvLayout::Nhd;
    assert_eq!(
        head_map(&p_nhd, &nhd).map_err(|e| e.0),
        Err(vec![Reason::AgentUnsupported])
    );
}

#[test]
fn pull_is_served_between_lined_up_ranks_and_one_layout() {
    let with = |role: Role, tp: i32, layout: KvLayout| {
        let mut i = info(role, if role == Role::Prefill { 16 } else { 32 });
        i.mode = TransferMode::Pull;
        i.kv.kv_heads = 8;
        i.kv.layout = layout;
        i.parallelism.tensor = tp;
        i
    };
    let hnd = KvLayout::Hnd;
    let (p, d) = pair(b"s", b"s", with(Role::Prefill, 1, hnd), with(Role::Decode, 1, hnd));
    assert!(p.is_ok() && d.is_ok(), "{p:?} {d:?}");
    // Unequal tensor parallelism: decode rank 0 of 2 reads heads 0..4 of prefill's 8.
    let (p, d) = pair(b"s", b"s", with(Role::Prefill, 1, hnd), with(Role::Decode, 2, hnd));
    assert!(p.is_ok() && d.is_ok(), "{p:?} {d:?}");
    // Reading part of a block's heads needs HND (the rule table says so first).
    let nhd = KvLayout::Nhd;
    let (p, _) = pair(b"s", b"s", with(Role::Prefill, 1, nhd), with(Role::Decode, 2, nhd));
    assert_eq!(
        p.expect_err("refused").reasons(),
        vec!["HeterogeneousTensorParallelLayout".to_owned()]
    );
    // Different layouts: the rule table refuses them, except with MLA, where pull between
    // layouts is beyond this agent.
    let (p, _) = pair(b"s", b"s", with(Role::Prefill, 1, nhd), with(Role::Decode, 1, hnd));
    assert_eq!(p.expect_err("refused").reasons(), vec!["LayoutMismatch".to_owned()]);
    let mla = |mut i: PeerInfo| {
        i.kv.mla = true;
        i.kv.kv_heads = 1;
        i
    };
    let (p, _) = pair(
        b"s",
        b"s",
        mla(with(Role::Prefill, 1, nhd)),
        mla(with(Role::Decode, 1, hnd)),
    );
    assert_eq!(p.expect_err("refused").reasons(), vec![Reason::AgentUnsupported]);
}

#[test]
fn each_decode_rank_has_its_prefill_sources_and_each_prefill_rank_counts_its_decode_ranks() {
    let with = |role: Role, tp: i32, rank: u32, heads: i32| {
        let mut i = info(role, 16);
        i.kv.kv_heads = heads;
        i.parallelism.tensor = tp;
        i.tensor_rank = rank;
        i
    };
    let sources = |p: &PeerInfo, d: &PeerInfo, r: u32| prefill_sources(&p.kv, &p.parallelism, &d.kv, &d.parallelism, r);
    // 8 heads, prefill TP 2 -> decode TP 4: decode ranks 0, 1 from prefill 0; 2, 3 from 1.
    let (p, d) = (with(Role::Prefill, 2, 0, 8), with(Role::Decode, 4, 0, 8));
    let got: Vec<Vec<u32>> = (0..4).map(|r| sources(&p, &d, r)).collect();
    assert_eq!(got, [vec![0], vec![0], vec![1], vec![1]]);
    assert_eq!(decode_ranks_served(&p, &d), 2);
    // Prefill TP 4 -> decode TP 2: each decode rank gathers from two prefill ranks; each prefill
    // rank serves one decode rank.
    let (p, d) = (with(Role::Prefill, 4, 3, 8), with(Role::Decode, 2, 0, 8));
    assert_eq!(sources(&p, &d, 0), [0, 1]);
    assert_eq!(sources(&p, &d, 1), [2, 3]);
    assert_eq!(decode_ranks_served(&p, &d), 1);
    // Equal: rank to rank.
    let (p, d) = (with(Role::Prefill, 2, 1, 8), with(Role::Decode, 2, 0, 8));
    assert_eq!(sources(&p, &d, 1), [1]);
    assert_eq!(decode_ranks_served(&p, &d), 1);
    // More prefill ranks than heads (2 heads, TP 4: ranks 0,1 share head 0, ranks 2,3 head 1),
    // decode TP 2 (one head each): several prefill ranks hold a decode rank's head; it takes one.
    // Decode rank r takes holder r mod 2: rank 0 -> prefill 0, rank 1 -> prefill 3.
    let (p, d) = (with(Role::Prefill, 4, 0, 2), with(Role::Decode, 2, 0, 2));
    assert_eq!(sources(&p, &d, 0), [0]);
    assert_eq!(sources(&p, &d, 1), [3]);
    assert_eq!(decode_ranks_served(&p, &d), 1);
}

#[test]
fn a_decode_speaking_an_older_version_is_refused_before_anything_else() {
    // Version 3 changed what `Release` means (it also cancels): a version 2 prefill would count
    // a cancelling decode as served while still pushing to it. Version 4 describes memory as
    // regions: a version 3 peer would read a description without its one base and key. Version
    // 5 lets the address be a KV stream's: a version 4 peer would hand it to UCX. Version 6
    // seals the stream: a version 5 peer would read records as headers. Version 7 offers a GPU
    // pool's KV stream: a version 6 peer would take a GPU pool behind another agent for one
    // behind its own. Version 9 carries decode's prompt digest in `Register`: a version 8
    // prefill would drop it and serve KV of another prompt. Version 10 describes layers whose K
    // and V lie side by side (`unit`): a version 9 peer would write their blocks as dense arrays.
    // So the versions must not meet.
    let (mut c, server) = prefill_with_secret_1();
    wire::write_frame(
        &mut c,
        &Message::Hello {
            version: PROTOCOL_VERSION - 1,
            pdpair: "team-a/llama".into(),
            nonce: nonce().expect("nonce"),
        },
    )
    .expect("hello");
    let answer: Message = wire::read_frame(&mut c).expect("answer");
    assert!(
        matches!(&answer, Message::Reject { reasons, .. } if reasons == &vec![Reason::VersionMismatch]),
        "{answer:?}"
    );
    assert_eq!(PROTOCOL_VERSION, 10);
    assert!(server.join().expect("thread").is_err());
}

/// A GPU pool's description for `p`'s geometry (one region, a token for its key).
fn gpu(p: &PeerInfo) -> MemoryDesc {
    let l = crate::layout::PoolLayout::new(&p.kv, &p.parallelism, 16, p.tensor_rank).expect("layout");
    MemoryDesc {
        kind: MemoryKind::Cuda,
        ..MemoryDesc::of(&l, vec![(0x7f00_0000_0000, vec![5; CUDA_TOKEN_LEN])])
    }
}

#[test]
fn a_gpu_pool_and_a_host_pool_meet_only_over_both_agents_streams_and_two_gpu_pools_pass() {
    let (mut p, mut d) = (info(Role::Prefill, 16), info(Role::Decode, 16));
    p.memory = gpu(&p);
    d.memory = described(&d);
    // A host pool on UCX: nothing moves GPU KV to it.
    let (pr, dr) = pair_as_is(b"s", b"s", p.clone(), d.clone());
    let e = pr.expect_err("prefill refuses");
    assert_eq!(e.reasons(), vec![Reason::AgentUnsupported]);
    assert!(
        e.to_string().contains(
            "the peer's pool is host memory and ours GPU: such pools move KV only over the agents' tcp streams"
        ) && e
            .to_string()
            .contains("the peer has a host pool on UCX and we a GPU pool whose agent runs no KV stream"),
        "{e}"
    );
    assert!(dr.is_err(), "decode hears the refusal");
    // A host pool on a stream, and a GPU pool whose agent runs none: still refused.
    d.worker_address = b"pdpair-tcp:127.0.0.2:4001".to_vec();
    let (pr, dr) = pair_as_is(b"s", b"s", p.clone(), d.clone());
    let e = pr.expect_err("prefill refuses");
    assert!(
        e.to_string()
            .contains("the peer has a host pool on a KV stream and we a GPU pool whose agent runs no KV stream"),
        "{e}"
    );
    assert!(dr.is_err(), "decode hears the refusal");
    // Both on streams: they meet, each dialling the other's stream (GPU KV staged).
    p.stream_address = "pdpair-tcp:127.0.0.1:4000".into();
    let (pr, dr) = pair_as_is(b"s", b"s", p.clone(), d.clone());
    assert!(pr.is_ok() && dr.is_ok(), "{pr:?} {dr:?}");
    assert_eq!(p.address_for(&d), b"pdpair-tcp:127.0.0.1:4000".to_vec());
    assert_eq!(d.address_for(&p), b"pdpair-tcp:127.0.0.2:4001".to_vec());
    // The other way round: a host prefill, a GPU decode.
    let (mut hp, mut gd) = (info(Role::Prefill, 16), info(Role::Decode, 16));
    hp.memory = described(&hp);
    hp.worker_address = b"pdpair-tcp:127.0.0.1:4002".to_vec();
    gd.memory = gpu(&gd);
    gd.stream_address = "pdpair-tcp:127.0.0.2:4003".into();
    let (pr, dr) = pair_as_is(b"s", b"s", hp, gd);
    assert!(pr.is_ok() && dr.is_ok(), "{pr:?} {dr:?}");
    p.stream_address.clear();
    d.memory = gpu(&d);
    d.worker_address = p.worker_address.clone();
    let (pr, dr) = pair_as_is(b"s", b"s", p.clone(), d.clone());
    assert!(pr.is_ok() && dr.is_ok(), "{pr:?} {dr:?}");
    // A GPU pool's key is a 16-byte token: a UCX key (or any other length) is refused.
    d.memory.regions[0].rkey = rkey();
    let (pr, _) = pair_as_is(b"s", b"s", p, d);
    let e = pr.expect_err("a GPU region with a UCX key");
    assert!(e.to_string().contains("a GPU region's token is 16"), "{e}");
}

#[test]
fn gpu_pools_behind_two_agents_meet_over_both_agents_kv_streams() {
    let (mut p, mut d) = (info(Role::Prefill, 16), info(Role::Decode, 16));
    p.memory = gpu(&p);
    d.memory = gpu(&d);
    // Two agents: two CUDA IPC addresses.
    p.worker_address = [crate::transport::cuda_ipc::ADDRESS_PREFIX, &[1; 16]].concat();
    d.worker_address = [crate::transport::cuda_ipc::ADDRESS_PREFIX, &[2; 16]].concat();
    p.stream_address = "pdpair-tcp:127.0.0.1:4000".into();
    let (pr, dr) = pair_as_is(b"s", b"s", p.clone(), d.clone());
    let e = pr.expect_err("decode's agent runs no stream");
    assert_eq!(e.reasons(), vec![Reason::AgentUnsupported]);
    assert!(
        e.to_string().contains(
            "the peer has a GPU pool whose agent runs no KV stream and we a GPU pool whose agent runs a KV stream"
        ),
        "{e}"
    );
    assert!(dr.is_err(), "decode refuses too");
    d.stream_address = "pdpair-tcp:127.0.0.2:4001".into();
    let (pr, dr) = pair_as_is(b"s", b"s", p.clone(), d.clone());
    assert!(pr.is_ok() && dr.is_ok(), "{pr:?} {dr:?}");
    // Each side dials the other's stream; behind one agent it is the CUDA IPC address.
    assert_eq!(d.address_for(&p), b"pdpair-tcp:127.0.0.2:4001".to_vec());
    assert_eq!(p.address_for(&d), b"pdpair-tcp:127.0.0.1:4000".to_vec());
    let mut same = d.clone();
    same.worker_address = p.worker_address.clone();
    assert_eq!(same.address_for(&p), p.worker_address);
    // A stream address that does not parse is refused, naming the field.
    d.stream_address = "pdpair-tcp:nowhere".into();
    let (pr, _) = pair_as_is(b"s", b"s", p, d);
    let e = pr.expect_err("a bad stream address");
    assert!(e.to_string().contains("stream_address"), "{e}");
}

/// A stream that counts the bytes written to it.
struct Counting<'a> {
    inner: &'a mut TcpStream,
    written: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl std::io::Read for Counting<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.inner.read(buf)
    }
}

impl std::io::Write for Counting<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written.fetch_add(n, std::sync::atomic::Ordering::SeqCst);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[test]
fn a_proven_peer_is_told_so_only_after_the_listener_was() {
    // The listener gives back the connection's pre-auth slot when told it is proven: told
    // after `AuthOk`, a connection accepted could still be shut down to make room for another.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let written = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut counting = Counting {
            inner: &mut s,
            written: written.clone(),
        };
        let mut at_proof = None;
        authenticate_prefill_then(
            &mut counting,
            |_| Some(b"secret-1".to_vec()),
            || {
                at_proof = Some(written.load(std::sync::atomic::Ordering::SeqCst));
                true
            },
        )
        .expect("authenticated");
        (at_proof, written.load(std::sync::atomic::Ordering::SeqCst))
    });
    let mut c = TcpStream::connect(addr).expect("connect");
    authenticate_decode(&mut c, "team-a/llama", b"secret-1").expect("decode authenticated");
    let (at_proof, total) = server.join().expect("server");
    let at_proof = at_proof.expect("told the proof was checked");
    assert!(
        at_proof > 0 && total > at_proof,
        "AuthOk ({} bytes) goes after: {at_proof} of {total}",
        total - at_proof
    );
}

#[test]
fn the_largest_handshake_fits_its_bound_and_a_frame_of_many_values_is_refused() {
    // 128 regions with keys of the largest UCX blob, a worker address as large, 1024 layers,
    // names at their bounds: read back whole within MAX_HANDSHAKE_FRAME.
    let mut p = info(Role::Decode, 16);
    p.worker_address = vec![0xab; MAX_UCX_BLOB];
    p.kv.model = "m".repeat(1024);
    p.stream_address = format!("pdpair-tcp:[{}]:65535", "f".repeat(39));
    p.memory.regions = (0..crate::layout::MAX_REGIONS as u64)
        .map(|i| RegionDesc {
            base: u64::MAX - i,
            len: u64::MAX,
            rkey: vec![0xcd; MAX_UCX_BLOB],
        })
        .collect();
    p.memory.layers = (0..crate::layout::MAX_LAYERS)
        .map(|l| LayerAt {
            region: l,
            k: u64::MAX,
            v: Some(u64::MAX),
            block_stride: u64::MAX,
            unit: Some(u64::MAX),
        })
        .collect();
    let key = [7; 32];
    let mut frame = Vec::new();
    wire::write_sealed(
        &mut frame,
        &mut wire::Sealer::new(key),
        &Message::Handshake(Box::new(p.clone())),
    )
    .expect("seal");
    assert!(frame.len() < MAX_HANDSHAKE_FRAME, "{} bytes", frame.len());
    let back = wire::read_sealed::<Message>(&mut frame.as_slice(), &mut wire::Opener::new(key), MAX_HANDSHAKE_FRAME);
    assert_eq!(back.ok(), Some(Message::Handshake(Box::new(p))));
    // A frame whose values would take decoding past four times its bound, however short its text
    // (the object, its type, seq and pad, and pad's zeros).
    let values = 4 * MAX_HANDSHAKE_FRAME / wire::VALUE_COST + 1;
    let text = format!(r#"{{"type":"Ping","seq":1,"pad":[{}]}}"#, vec!["0"; values].join(","));
    let mut many = Vec::new();
    wire::write_sealed(
        &mut many,
        &mut wire::Sealer::new(key),
        &serde_json::from_str::<serde_json::Value>(&text).expect("json"),
    )
    .expect("seal");
    match wire::read_sealed::<Message>(&mut many.as_slice(), &mut wire::Opener::new(key), MAX_HANDSHAKE_FRAME) {
        // The object, its 3 keys, "Ping", 1, the array and its zeros.
        Err(wire::FrameError::Malformed(e)) => {
            assert!(e.contains(&format!("holds {} JSON values in", values + 7)), "{e}")
        }
        other => panic!("{other:?}"),
    }
    // Keys count: a Ping of many empty keys (serde keeps every one, key and value, in its
    // buffer: 64 bytes each, in a vector grown by doubling) took 4 times what it was charged
    // when only values counted (from a review).
    struct ManyKeys(usize);
    impl serde::Serialize for ManyKeys {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeMap;
            let mut m = s.serialize_map(None)?;
            m.serialize_entry("type", "Ping")?;
            m.serialize_entry("seq", &1)?;
            for _ in 0..self.0 {
                m.serialize_entry("", &0)?;
            }
            m.end()
        }
    }
    let keys = 4 * MAX_HANDSHAKE_FRAME / wire::VALUE_COST / 2;
    let mut frame = Vec::new();
    wire::write_sealed(&mut frame, &mut wire::Sealer::new(key), &ManyKeys(keys)).expect("seal");
    assert!(
        frame.len() < MAX_HANDSHAKE_FRAME / 4,
        "a short frame: {} bytes",
        frame.len()
    );
    match wire::read_sealed::<Message>(&mut frame.as_slice(), &mut wire::Opener::new(key), MAX_HANDSHAKE_FRAME) {
        Err(wire::FrameError::Malformed(e)) => {
            assert!(e.contains(&format!("holds {} JSON values in", 2 * keys + 5)), "{e}")
        }
        other => panic!("a frame of {keys} keys: {other:?}"),
    }
}

#[test]
fn the_largest_ready_and_complete_a_peer_sends_fit_what_one_link_may_hold() {
    // A request of the most blocks an engine may name, with checksums of the most digits: its
    // pull `Ready` and push `Complete`, read and decoded with every charge counted, fit what one
    // link may hold (a larger one closed the link, failing every request on it).
    let n = crate::agent::MAX_REQUEST_BLOCKS;
    let sums = Some(BlockSums {
        block_size: 16,
        first_token: u64::MAX,
        sums: vec![u64::MAX; n],
    });
    for m in [
        Message::Ready {
            request: "r".repeat(512),
            blocks: (u32::MAX - n as u32..u32::MAX).collect(),
            first_token: u64::MAX,
            num_tokens: u64::MAX,
            sums: sums.clone(),
        },
        Message::Complete {
            request: "r".repeat(512),
            sums: sums.clone(),
            bytes: u64::MAX,
        },
    ] {
        let key = [9; 32];
        let mut frame = Vec::new();
        wire::write_sealed(&mut frame, &mut wire::Sealer::new(key), &m).expect("seal");
        let mut charged = 0usize;
        let got = wire::read_sealed_by::<Message, ()>(
            &mut frame.as_slice(),
            &mut wire::Opener::new(key),
            wire::MAX_FRAME,
            |n| {
                charged += n;
                Ok(())
            },
        );
        assert!(got.is_ok(), "{}: {got:?}", kind(&m));
        assert!(
            charged <= wire::MAX_DECODE_COST,
            "{} charged {charged} bytes, more than a link may hold ({})",
            kind(&m),
            wire::MAX_DECODE_COST
        );
    }
}
