use k8s_openapi::{
    api::core::v1::{Pod, PodCondition, PodStatus},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    jiff::Timestamp,
};
use pdpair_api::{Failure, PDEndpoint, PDEndpointSpec, PDEndpointStatus, PDPair, Rejection, Role, TransferCounters};

use super::*;

fn pair() -> PDPair {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/compatible-push.yaml"))
        .expect("example exists");
    let mut pair: PDPair = serde_yaml::from_str(&text).expect("example parses");
    pair.metadata.generation = Some(3);
    pair
}

fn t(secs: i64) -> Time {
    Time(Timestamp::from_second(1_800_000_000 + secs).expect("valid time"))
}

fn endpoint(name: &str, role: Role, pair: &PDPair) -> PDEndpoint {
    let pool = if role == Role::Prefill {
        &pair.spec.prefill
    } else {
        &pair.spec.decode
    };
    let mut e = PDEndpoint::new(
        name,
        PDEndpointSpec {
            pdpair: "llama-8b".into(),
            role,
            pod: format!("{name}-pod"),
            node: "node-a".into(),
            address: "10.0.0.1:7000".into(),
            parallelism: pool.parallelism.clone(),
            kv: pool.kv.clone(),
            pool_memory: Default::default(),
            staging: None,
            tensor_rank: None,
            instance: None,
            pod_engines: None,
        },
    );
    e.metadata.namespace = Some("default".into());
    e
}

fn cond<'a>(s: &'a PDPairStatus, type_: &str) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    s.conditions
        .iter()
        .find(|c| c.type_ == type_)
        .expect("condition present")
}

fn ready(ready: i32, of: i32) -> PodCounts {
    PodCounts {
        replicas: of,
        ready,
        earlier: 0,
    }
}

#[test]
fn fresh_pair_starts_false_and_unknown_quietly() {
    let pair = pair();
    let (s, transitions) = compute(&pair, &Observed::default(), &t(0));
    assert_eq!(s.observed_generation, Some(3));
    assert_eq!(cond(&s, ct::GEOMETRY_COMPATIBLE).status, "True");
    assert_eq!(cond(&s, ct::PREFILL_READY).status, "False");
    assert_eq!(cond(&s, ct::PREFILL_READY).message, "0/2 prefill pods ready (0 exist)");
    assert_eq!(cond(&s, ct::DECODE_READY).status, "False");
    assert_eq!(cond(&s, ct::TRANSFER_READY).status, "Unknown");
    assert_eq!(cond(&s, ct::READY).status, "False");
    assert_eq!(cond(&s, ct::READY).reason, reasons::PREFILL_NOT_READY);
    assert!(transitions.is_empty(), "{transitions:?}");
    assert!(s.conditions.iter().all(|c| c.observed_generation == Some(3)));
}

#[test]
fn a_pool_of_negative_replicas_stored_past_the_webhook_is_not_ready() {
    // From before the CRD's schema bounded replicas: geometry compatible (replicas are
    // admission's), but no count of pods is ready for it ("0/-1 ready" read True).
    let mut pair = pair();
    pair.spec.decode.replicas = -1;
    let (s, _) = compute(&pair, &Observed::default(), &t(0));
    assert_eq!(cond(&s, ct::GEOMETRY_COMPATIBLE).status, "True");
    let decode = cond(&s, ct::DECODE_READY);
    assert_eq!(
        (decode.status.as_str(), decode.message.as_str()),
        (
            "False",
            "0/-1 decode pods ready (0 exist); replicas -1 is refused: it must be 0 or more"
        )
    );
    assert_eq!(cond(&s, ct::READY).status, "False");
}

#[test]
fn pods_becoming_ready_flip_pool_and_ready_conditions_once() {
    let mut pair = pair();
    let (s0, _) = compute(&pair, &Observed::default(), &t(0));
    pair.status = Some(s0.clone());
    let observed = Observed {
        prefill: ready(2, 2),
        decode: ready(4, 4),
        endpoints: vec![],
        earlier_pods: Default::default(),
        apply_refused: None,
        ready_pods: Vec::new(),
    };
    let (s1, transitions) = compute(&pair, &observed, &t(10));
    let flipped: Vec<&str> = transitions.iter().map(|t| t.type_.as_str()).collect();
    assert_eq!(flipped, [ct::PREFILL_READY, ct::DECODE_READY, ct::READY]);
    assert!(
        transitions
            .iter()
            .all(|t| !t.warning && t.from.as_deref() == Some("False") && t.to_status == "True")
    );
    assert_eq!(cond(&s1, ct::READY).status, "True");
    assert_eq!(cond(&s1, ct::PREFILL_READY).last_transition_time, t(10));
    // Unchanged conditions keep their time.
    assert_eq!(cond(&s1, ct::GEOMETRY_COMPATIBLE).last_transition_time, t(0));
    assert_eq!(
        s1.prefill,
        Some(pdpair_api::PoolStatus {
            replicas: 2,
            ready_replicas: 2
        })
    );
    // Same world again: identical status, no transitions.
    pair.status = Some(s1.clone());
    let (s2, transitions) = compute(&pair, &observed, &t(20));
    assert_eq!(s2, s1);
    assert!(transitions.is_empty());
}

#[test]
fn observed_geometry_mismatch_turns_compatible_false_with_a_warning_and_back() {
    let mut pair = pair();
    let (s0, _) = compute(&pair, &Observed::default(), &t(0));
    pair.status = Some(s0);
    let mut wrong = endpoint("d-1", Role::Decode, &pair);
    wrong.spec.kv.kernel_block_size = Some(16);
    let (s1, transitions) = compute(
        &pair,
        &Observed {
            endpoints: vec![&wrong],
            ..Observed::default()
        },
        &t(5),
    );
    let c = cond(&s1, ct::GEOMETRY_COMPATIBLE);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", reasons::OBSERVED_GEOMETRY_MISMATCH)
    );
    assert!(
        c.message.contains("kv.kernelBlockSize declared 64, observed 16"),
        "{}",
        c.message
    );
    assert!(c.message.contains("d-1-pod"), "{}", c.message);
    let t0 = &transitions[0];
    assert_eq!((t0.type_.as_str(), t0.warning), (ct::GEOMETRY_COMPATIBLE, true));
    pair.status = Some(s1);
    let right = endpoint("d-1", Role::Decode, &pair);
    let (s2, transitions) = compute(
        &pair,
        &Observed {
            endpoints: vec![&right],
            ..Observed::default()
        },
        &t(9),
    );
    assert_eq!(cond(&s2, ct::GEOMETRY_COMPATIBLE).status, "True");
    assert_eq!(transitions[0].to_status, "True");
}

#[test]
fn engines_of_pods_a_geometry_rollout_is_replacing_are_not_a_mismatch() {
    // The pair's geometry changed: its Deployments roll, and until the old pods are gone their
    // engines run the geometry declared before. Compared with the new one, every such rollout
    // turned GeometryCompatible False with a Warning (and Ready with it).
    let mut pair = pair();
    let old = endpoint("d-old", Role::Decode, &pair);
    pair.spec.decode.kv.block_size = 32;
    pair.spec.decode.kv.kernel_block_size = Some(32);
    pair.spec.prefill.kv.block_size = 32;
    pair.spec.prefill.kv.kernel_block_size = Some(32);
    let new = endpoint("d-new", Role::Decode, &pair);
    let observed = Observed {
        endpoints: vec![&old, &new],
        earlier_pods: ["d-old-pod".to_owned()].into(),
        ..Observed::default()
    };
    let (s, _) = compute(&pair, &observed, &t(5));
    let c = cond(&s, ct::GEOMETRY_COMPATIBLE);
    assert_eq!(c.status, "True", "{}", c.message);
    assert!(
        c.message.contains("1 more of an earlier geometry not compared"),
        "{}",
        c.message
    );
    // A pod of the current template running another geometry is still one.
    let observed = Observed {
        endpoints: vec![&old, &new],
        ..Observed::default()
    };
    let (s, _) = compute(&pair, &observed, &t(5));
    let c = cond(&s, ct::GEOMETRY_COMPATIBLE);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", reasons::OBSERVED_GEOMETRY_MISMATCH)
    );
}

#[test]
fn a_change_of_counters_alone_is_told_apart_from_one_of_conditions_or_counts() {
    let mut pair = pair();
    let e = endpoint("d-1", Role::Decode, &pair);
    let (a, _) = compute(&pair, &all_ready(vec![&e]), &t(5));
    pair.status = Some(a.clone());
    let mut busier = e.clone();
    busier.status.get_or_insert_with(Default::default).counters.bytes += 4096;
    let (b, _) = compute(&pair, &all_ready(vec![&busier]), &t(6));
    assert!(only_counters_differ(&a, &b), "{a:?}\n{b:?}");
    assert!(!only_counters_differ(&a, &a), "no change is no change of counters");
    let (c, _) = compute(&pair, &all_ready(vec![]), &t(6));
    assert!(!only_counters_differ(&a, &c), "an engine fewer");
    let mut d = b.clone();
    d.conditions[0].message.push_str(" (changed)");
    assert!(!only_counters_differ(&a, &d), "a condition changed");
}

#[test]
fn observed_pair_rejected_by_the_rules_names_the_rule() {
    // Both pools declare 64; the engines run 16 and 64 but say so in a way that also differs from
    // the declared spec; the declared mismatch is reported first. Here the pools declare nothing
    // inconsistent with each endpoint, so only the observed pair can be wrong: make the pair
    // declare what the engines run, then break the rules between two observed engines directly.
    let pair = pair();
    let p = endpoint("p-1", Role::Prefill, &pair);
    let mut d = endpoint("d-1", Role::Decode, &pair);
    let mut pair_for_d = pair.clone();
    d.spec.kv.kernel_block_size = Some(16);
    d.spec.kv.block_size = 16;
    pair_for_d.spec.decode.kv = d.spec.kv.clone();
    // The declared spec is now itself incompatible (push 64 vs 16): reported as declared.
    let (s, _) = compute(
        &pair_for_d,
        &Observed {
            endpoints: vec![&p, &d],
            ..Observed::default()
        },
        &t(0),
    );
    let c = cond(&s, ct::GEOMETRY_COMPATIBLE);
    assert_eq!(c.reason, "KernelBlockSizeMismatch");
    assert!(c.message.starts_with("declared geometry: "), "{}", c.message);
}

/// Prefill engines p-1 (at 10.0.0.1:7000) and p-2 (at 10.0.0.2:7000), and decode d-1.
fn two_prefills_and_a_decode(pair: &PDPair) -> (PDEndpoint, PDEndpoint, PDEndpoint) {
    let p1 = endpoint("p-1", Role::Prefill, pair);
    let mut p2 = endpoint("p-2", Role::Prefill, pair);
    p2.spec.address = "10.0.0.2:7000".into();
    let mut d = endpoint("d-1", Role::Decode, pair);
    // A decode engine's address is its agent's host, no port.
    d.spec.address = "10.0.0.5".into();
    (p1, p2, d)
}

#[test]
fn news_of_a_peer_still_registered_stands_through_transfers_with_other_peers() {
    let pair = pair();
    let (p1, mut p2, mut d) = two_prefills_and_a_decode(&pair);
    // Decode rejected p-2, or failed a transfer with it (its prefill address, here as an
    // IPv4-mapped IPv6 address: the same prefill), and keeps transferring with p-1.
    for rejected in [true, false] {
        let (news_reason, other) = if rejected {
            (reasons::HANDSHAKE_REJECTED, "a rejection")
        } else {
            (reasons::TRANSFER_FAILED, "a failure")
        };
        let standing = |resolved: Option<Time>, last_success: i64| {
            let peer = "[::ffff:10.0.0.2]:7000".to_owned();
            let mut s = PDEndpointStatus {
                last_success: Some(t(last_success)),
                ..Default::default()
            };
            if rejected {
                s.last_rejection = Some(Rejection {
                    time: t(10),
                    peer,
                    reasons: vec!["KernelBlockSizeMismatch".into()],
                    message: "push needs identical kernel block sizes".into(),
                    resolved,
                });
            } else {
                s.last_failure = Some(Failure {
                    time: t(10),
                    reasons: vec!["ChecksumMismatch".into()],
                    message: "received KV does not match prefill's checksums".into(),
                    peer: Some(peer),
                    resolved,
                });
            }
            s
        };
        let ready_at = |now: i64, endpoints: Vec<&PDEndpoint>| {
            let (s, _) = compute(
                &pair,
                &Observed {
                    endpoints,
                    ..Observed::default()
                },
                &t(now),
            );
            let c = cond(&s, ct::TRANSFER_READY).clone();
            (c.status, c.reason)
        };
        let stands = ("False".to_owned(), news_reason.to_owned());
        let healthy = ("True".to_owned(), reasons::HEALTHY.to_owned());
        // p-2 is still there: transfers with p-1, one after another, do not clear it (each
        // cleared it, and the next such news set it again: TransferReady flipped with each).
        for last_success in [11, 40, 300] {
            d.status = Some(standing(None, last_success));
            assert_eq!(
                ready_at(last_success + 1, vec![&p1, &p2, &d]),
                stands,
                "{other}, {last_success}"
            );
        }
        // A transfer with p-2 itself does, as decode's agent says...
        d.status = Some(standing(Some(t(12)), 40));
        assert_eq!(ready_at(41, vec![&p1, &p2, &d]), healthy, "{other}");
        // ...but not one before it.
        d.status = Some(standing(Some(t(9)), 40));
        assert_eq!(ready_at(41, vec![&p1, &p2, &d]), stands, "{other}");
        // Once p-2 is gone (or stale), any later transfer of decode's clears it...
        d.status = Some(standing(None, 40));
        assert_eq!(ready_at(41, vec![&p1, &d]), healthy, "{other}");
        p2.status = Some(PDEndpointStatus {
            last_heartbeat: Some(t(41 - STALE_SECONDS - 1)),
            ..Default::default()
        });
        assert_eq!(ready_at(41, vec![&p1, &p2, &d]), healthy, "{other}: p-2 stale");
        // ...and none before it: it stands until it is old news.
        d.status = Some(standing(None, 10));
        assert_eq!(ready_at(41, vec![&p1, &d]), stands, "{other}");
        assert_eq!(ready_at(10 + RECENT_SECONDS, vec![&p1, &d]), healthy, "{other}");
        p2.status = None;
        assert_eq!(
            ready_at(10 + RECENT_SECONDS, vec![&p1, &p2, &d]),
            healthy,
            "{other}: old news"
        );
    }
}

#[test]
fn earlier_news_of_a_peer_still_registered_stands_once_a_later_one_of_another_is_resolved() {
    // Decode failed with p-2 (still failing), then with p-1, then transferred with p-1: with
    // the last news alone TransferReady turned True while p-2 still failed each transfer.
    let pair = pair();
    let (p1, p2, mut d) = two_prefills_and_a_decode(&pair);
    let failure = |at: i64, peer: &str, reason: &str, resolved: Option<i64>| Failure {
        time: t(at),
        reasons: vec![reason.into()],
        message: format!("with {peer}"),
        peer: Some(peer.into()),
        resolved: resolved.map(t),
    };
    let rejection = |at: i64, peer: &str, resolved: Option<i64>| Rejection {
        time: t(at),
        peer: peer.into(),
        reasons: vec!["KernelBlockSizeMismatch".into()],
        message: format!("by {peer}"),
        resolved: resolved.map(t),
    };
    let ready_at = |now: i64, endpoints: Vec<&PDEndpoint>| {
        let (s, _) = compute(
            &pair,
            &Observed {
                endpoints,
                ..Observed::default()
            },
            &t(now),
        );
        let c = cond(&s, ct::TRANSFER_READY).clone();
        (c.status, c.reason, c.message)
    };
    d.status = Some(PDEndpointStatus {
        last_success: Some(t(12)),
        last_failure: Some(failure(11, "10.0.0.1:7000", "PeerLost", Some(12))),
        earlier_failures: vec![failure(10, "10.0.0.2:7000", "ChecksumMismatch", None)],
        ..Default::default()
    });
    let (status, reason, message) = ready_at(13, vec![&p1, &p2, &d]);
    assert_eq!((status.as_str(), reason.as_str()), ("False", reasons::TRANSFER_FAILED));
    assert!(
        message.contains("ChecksumMismatch") && message.contains("with 10.0.0.2:7000"),
        "{message}"
    );
    // Once p-2 is gone, decode's later transfer clears it, as for the last news.
    assert_eq!(ready_at(13, vec![&p1, &d]).1, reasons::HEALTHY);
    // Rejections alike: p-2's earlier one stands, p-1's last one resolved.
    d.status = Some(PDEndpointStatus {
        last_success: Some(t(12)),
        last_rejection: Some(rejection(11, "10.0.0.1:7000", Some(12))),
        earlier_rejections: vec![rejection(10, "10.0.0.2:7000", None)],
        ..Default::default()
    });
    let (status, reason, message) = ready_at(13, vec![&p1, &p2, &d]);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", reasons::HANDSHAKE_REJECTED)
    );
    assert!(message.contains("by 10.0.0.2:7000"), "{message}");
    // The newest standing news is named: the last where it stands.
    d.status = Some(PDEndpointStatus {
        last_failure: Some(failure(11, "10.0.0.1:7000", "PeerLost", None)),
        earlier_failures: vec![failure(10, "10.0.0.2:7000", "ChecksumMismatch", None)],
        ..Default::default()
    });
    assert!(ready_at(13, vec![&p1, &p2, &d]).2.contains("with 10.0.0.1:7000"));
    // Old news is no news, earlier or last.
    assert_eq!(ready_at(11 + RECENT_SECONDS, vec![&p1, &p2, &d]).1, reasons::HEALTHY);
}

#[test]
fn agent_rejections_and_failures_turn_transfer_ready_false_and_totals_add_up() {
    let mut pair = pair();
    let (s0, _) = compute(&pair, &Observed::default(), &t(0));
    pair.status = Some(s0);
    let mut p = endpoint("p-1", Role::Prefill, &pair);
    let mut d = endpoint("d-1", Role::Decode, &pair);
    p.status = Some(PDEndpointStatus {
        counters: TransferCounters {
            handshakes_accepted: 2,
            transfers_completed: 5,
            bytes: 1000,
            ..Default::default()
        },
        ..Default::default()
    });
    d.status = Some(PDEndpointStatus {
        counters: TransferCounters {
            handshakes_accepted: 1,
            transfers_completed: 5,
            bytes: 1000,
            checksums_verified: 5,
            ..Default::default()
        },
        ..Default::default()
    });
    let (s1, _) = compute(
        &pair,
        &Observed {
            endpoints: vec![&p, &d],
            ..Observed::default()
        },
        &t(1),
    );
    assert_eq!(cond(&s1, ct::TRANSFER_READY).status, "True");
    let totals = s1.transfer.clone().expect("totals");
    assert_eq!(totals.endpoints, 2);
    assert_eq!(totals.counters.bytes, 2000);
    assert_eq!(totals.counters.checksums_verified, 5);
    pair.status = Some(s1);
    if let Some(s) = d.status.as_mut() {
        s.counters.handshakes_rejected = 1;
        s.last_rejection = Some(Rejection {
            time: t(2),
            peer: "10.0.0.9:7000".into(),
            reasons: vec!["KernelBlockSizeMismatch".into()],
            message: "push needs identical kernel block sizes".into(),
            resolved: None,
        });
    }
    let (s2, transitions) = compute(
        &pair,
        &Observed {
            endpoints: vec![&p, &d],
            ..Observed::default()
        },
        &t(3),
    );
    let c = cond(&s2, ct::TRANSFER_READY);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", reasons::HANDSHAKE_REJECTED)
    );
    assert!(
        c.message.contains("KernelBlockSizeMismatch") && c.message.contains("10.0.0.9:7000"),
        "{}",
        c.message
    );
    assert!(transitions.iter().any(|t| t.type_ == ct::TRANSFER_READY && t.warning));
    let at = |now: i64, d: &PDEndpoint| {
        let (s, _) = compute(
            &pair,
            &Observed {
                endpoints: vec![&p, d],
                ..Observed::default()
            },
            &t(now),
        );
        let c = cond(&s, ct::TRANSFER_READY).clone();
        (c.status, c.reason)
    };
    let healthy = ("True".to_owned(), reasons::HEALTHY.to_owned());
    // The lifetime counter stays 1, but a transfer that completed after the rejection clears it.
    if let Some(s) = d.status.as_mut() {
        s.last_success = Some(t(5));
    }
    assert_eq!(at(6, &d), healthy, "a success after the rejection");
    // A success in the same second as the rejection does not clear it (seconds resolution).
    if let Some(s) = d.status.as_mut() {
        s.last_success = Some(t(2));
    }
    assert_eq!(at(6, &d).1, reasons::HANDSHAKE_REJECTED);
    // Nor does anything clear it but time: past RECENT_SECONDS with no success it is old news.
    if let Some(s) = d.status.as_mut() {
        s.last_success = None;
    }
    assert_eq!(at(2 + RECENT_SECONDS - 1, &d).1, reasons::HANDSHAKE_REJECTED);
    assert_eq!(at(2 + RECENT_SECONDS, &d), healthy, "an old rejection");
    // A failed transfer on the path, after the last success: False, naming its reasons.
    if let Some(s) = d.status.as_mut() {
        s.last_rejection = None;
        s.counters.transfers_failed = 2;
        s.last_success = Some(t(5));
        s.last_failure = Some(Failure {
            time: t(7),
            reasons: vec!["PeerLost".into()],
            message: "the prefill agent went away".into(),
            peer: None,
            resolved: None,
        });
    }
    let (s3, _) = compute(
        &pair,
        &Observed {
            endpoints: vec![&p, &d],
            ..Observed::default()
        },
        &t(8),
    );
    let c = cond(&s3, ct::TRANSFER_READY);
    assert_eq!(c.reason, reasons::TRANSFER_FAILED);
    assert!(
        c.message.contains("PeerLost") && c.message.contains("d-1"),
        "{}",
        c.message
    );
    // Failed transfers counted but none kept as news (routine ones, such as an expired lease):
    // lifetime counters alone never hold the pair un-Ready.
    if let Some(s) = d.status.as_mut() {
        s.last_failure = None;
    }
    assert_eq!(at(8, &d), healthy, "counters alone");
    if let Some(s) = d.status.as_mut() {
        s.last_failure = Some(Failure {
            time: t(7),
            reasons: vec!["PeerLost".into()],
            message: String::new(),
            peer: None,
            resolved: None,
        });
        s.last_success = Some(t(9));
    }
    assert_eq!(at(10, &d), healthy, "a success after the failure");
}

#[test]
fn a_geometry_spelled_differently_is_not_a_mismatch() {
    // The connector registers kernelBlockSize explicitly, and vLLM resolves cacheDtype auto to the
    // model dtype: the same geometry as a spec that leaves both to their defaults.
    let mut pair = pair();
    for kv in [&mut pair.spec.prefill.kv, &mut pair.spec.decode.kv] {
        kv.kernel_block_size = None;
        kv.cache_dtype = pdpair_api::CacheDtype::Auto;
    }
    let p = endpoint("p-1", Role::Prefill, &pair);
    let mut d = endpoint("d-1", Role::Decode, &pair);
    d.spec.kv.kernel_block_size = Some(d.spec.kv.block_size);
    d.spec.kv.cache_dtype = d.spec.kv.resolved_cache_dtype();
    assert_ne!(d.spec.kv, pair.spec.decode.kv, "spelled differently");
    let observed = Observed {
        endpoints: vec![&p, &d],
        ..Observed::default()
    };
    let (s, _) = compute(&pair, &observed, &t(0));
    assert_eq!(
        cond(&s, ct::GEOMETRY_COMPATIBLE).status,
        "True",
        "{:?}",
        cond(&s, ct::GEOMETRY_COMPATIBLE)
    );
    // A real difference still is one, named with the values as they mean.
    d.spec.kv.kernel_block_size = Some(d.spec.kv.block_size / 2);
    let (s, _) = compute(&pair, &observed_with(&p, &d), &t(0));
    let c = cond(&s, ct::GEOMETRY_COMPATIBLE);
    assert_eq!(c.reason, reasons::OBSERVED_GEOMETRY_MISMATCH);
    assert!(
        c.message.contains(&format!(
            "kv.kernelBlockSize declared {}, observed {}",
            pair.spec.decode.kv.block_size,
            pair.spec.decode.kv.block_size / 2
        )),
        "{}",
        c.message
    );
}

fn observed_with<'a>(p: &'a PDEndpoint, d: &'a PDEndpoint) -> Observed<'a> {
    Observed {
        endpoints: vec![p, d],
        ..Observed::default()
    }
}

#[test]
fn declared_incompatibility_blocks_ready() {
    let mut pair = pair();
    pair.spec.decode.kv.kernel_block_size = Some(16);
    pair.spec.decode.kv.block_size = 16;
    let observed = Observed {
        prefill: ready(2, 2),
        decode: ready(4, 4),
        endpoints: vec![],
        earlier_pods: Default::default(),
        apply_refused: None,
        ready_pods: Vec::new(),
    };
    let (s, transitions) = compute(&pair, &observed, &t(0));
    assert_eq!(cond(&s, ct::GEOMETRY_COMPATIBLE).reason, "KernelBlockSizeMismatch");
    assert_eq!(cond(&s, ct::READY).reason, reasons::GEOMETRY_INCOMPATIBLE);
    // A new False GeometryCompatible is news even without a previous status.
    assert_eq!(transitions.len(), 1);
    assert!(transitions[0].warning);
}

#[test]
fn a_pool_the_api_server_refused_turns_pools_applied_and_ready_false_with_a_warning_once() {
    let mut pair = pair();
    let refused = || Observed {
        apply_refused: Some(
            "Deployment llama-8b-decode: spec.template.spec.containers[0].ports[0].containerPort: Invalid value: 70000"
                .into(),
        ),
        ..all_ready(vec![])
    };
    let (s, transitions) = compute(&pair, &refused(), &t(0));
    let c = cond(&s, ct::POOLS_APPLIED);
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", reasons::APPLY_FAILED));
    assert!(
        c.message.contains("containerPort: Invalid value: 70000"),
        "{}",
        c.message
    );
    let r = cond(&s, ct::READY);
    assert_eq!((r.status.as_str(), r.reason.as_str()), ("False", reasons::APPLY_FAILED));
    let warned: Vec<_> = transitions
        .iter()
        .filter(|t| t.warning)
        .map(|t| t.type_.as_str())
        .collect();
    assert_eq!(warned, [ct::POOLS_APPLIED], "{transitions:?}");
    // The same refusal again is no news; applied, the pair is ready.
    pair.status = Some(s);
    let (s, transitions) = compute(&pair, &refused(), &t(1));
    assert!(transitions.is_empty(), "{transitions:?}");
    pair.status = Some(s);
    let (s, transitions) = compute(&pair, &all_ready(vec![]), &t(2));
    assert_eq!(cond(&s, ct::POOLS_APPLIED).status, "True");
    assert_eq!(cond(&s, ct::READY).status, "True");
    assert!(
        transitions.iter().any(|t| t.type_ == ct::POOLS_APPLIED && !t.warning),
        "{transitions:?}"
    );
}

#[test]
fn pod_counts_skip_terminating_and_count_ready() {
    let pod = |ready: bool, terminating: bool| Pod {
        metadata: ObjectMeta {
            deletion_timestamp: terminating.then(|| t(0)),
            ..ObjectMeta::default()
        },
        status: Some(PodStatus {
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        }),
        spec: None,
    };
    let pods = [pod(true, false), pod(false, false), pod(true, true)];
    let counts = PodCounts {
        replicas: 2,
        ready: 1,
        earlier: 0,
    };
    assert_eq!(PodCounts::of(&pods, None), counts);
    // Evicted (phase Failed, kept until collected) or completed pods run nothing: not counted
    // (they made a pool of 2 read "(3 exist)").
    let ended = |phase: &str| {
        let mut p = pod(false, false);
        p.status.as_mut().expect("status").phase = Some(phase.into());
        p
    };
    let pods = [pod(true, false), pod(false, false), ended("Failed"), ended("Succeeded")];
    assert_eq!(PodCounts::of(&pods, None), counts);
}

#[test]
fn ready_pods_are_those_counted_ready_with_when_they_turned_ready() {
    let pair = pair();
    let now = crate::plan::geometry_hash(&pair, Role::Decode);
    let pod = |name: &str, ready: bool, since: Option<i64>| Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            creation_timestamp: Some(t(5)),
            annotations: Some([(ANNOTATION_GEOMETRY.to_owned(), now.clone())].into()),
            ..ObjectMeta::default()
        },
        status: Some(PodStatus {
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                last_transition_time: since.map(t),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        }),
        spec: None,
    };
    let mut terminating = pod("terminating", true, Some(1));
    terminating.metadata.deletion_timestamp = Some(t(9));
    let mut ended = pod("evicted", true, Some(1));
    ended.status.as_mut().expect("status").phase = Some("Failed".into());
    let mut earlier = pod("earlier", true, Some(1));
    earlier.metadata.annotations = Some([(ANNOTATION_GEOMETRY.to_owned(), "0123456789abcdef".to_owned())].into());
    let pods = [
        pod("a", true, Some(30)),
        pod("b", true, None),
        pod("not-ready", false, Some(1)),
        terminating,
        ended,
        earlier,
    ];
    let ready = |name: &str, since: i64| ReadyPod {
        role: Role::Decode,
        name: name.into(),
        since: Some(t(since)),
    };
    // Without a transition time, since the Pod was made.
    assert_eq!(
        ReadyPod::of(Role::Decode, &pods, Some(&now)),
        [ready("a", 30), ready("b", 5)]
    );
    assert_eq!(
        PodCounts::of(&pods, Some(&now)).ready,
        2,
        "the same pods PodCounts counts Ready"
    );
    // A pool the user brings (no template) counts every pod of any geometry.
    assert_eq!(ReadyPod::of(Role::Decode, &pods, None).len(), 3);
}

#[test]
fn pods_of_an_earlier_geometry_are_not_counted_ready_while_their_pool_rolls() {
    // A geometry changed on a running pair rolls each pool's Deployment on its own: a Ready pod
    // of the old geometry (kept while the new one loads the model) counted, and a pool read
    // "1/1 ready" on the old geometry beside the other on the new.
    let pair = pair();
    let now = crate::plan::geometry_hash(&pair, Role::Decode);
    let pod = |geometry: Option<&str>| Pod {
        metadata: ObjectMeta {
            annotations: geometry.map(|g| [(ANNOTATION_GEOMETRY.to_owned(), g.to_owned())].into()),
            ..ObjectMeta::default()
        },
        status: Some(PodStatus {
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        }),
        spec: None,
    };
    let rolling = [pod(Some("0123456789abcdef")), pod(None)];
    let counts = PodCounts::of(&rolling, Some(&now));
    assert_eq!(
        counts,
        PodCounts {
            replicas: 0,
            ready: 0,
            earlier: 2
        }
    );
    let cond = pool_condition("DecodeReady", Role::Decode, 1, counts);
    assert_eq!((cond.status, cond.reason.as_str()), ("False", reasons::PODS_NOT_READY));
    assert!(
        cond.message.contains("2 more of an earlier geometry"),
        "{}",
        cond.message
    );
    // Rolled: counted. A pool the user brings (no template) counts every pod.
    assert_eq!(PodCounts::of(&[pod(Some(&now))], Some(&now)), ready(1, 1));
    assert_eq!(PodCounts::of(&rolling, None), ready(2, 2));
}

#[test]
fn differences_name_every_field() {
    let pair = pair();
    let mut kv = pair.spec.decode.kv.clone();
    kv.model = "other".into();
    kv.layout = pdpair_api::KvLayout::Nhd;
    let mut par = pair.spec.decode.parallelism.clone();
    par.tensor = 8;
    let d = differences(&pair.spec.decode.parallelism, &pair.spec.decode.kv, &par, &kv);
    assert_eq!(
        d,
        [
            "parallelism.tensor declared 4, observed 8",
            "kv.layout declared \"HND\", observed \"NHD\"",
            "kv.model declared \"meta-llama/Llama-3.1-8B-Instruct\", observed \"other\"",
        ]
    );
    // Data parallelism: an engine saying 1 may be one of a dense model's data-parallel ranks,
    // which vLLM runs as engines of data parallelism 1; another count is a difference.
    let mut declared = pair.spec.decode.parallelism.clone();
    declared.data = 4;
    let kv = &pair.spec.decode.kv;
    par = declared.clone();
    par.data = 1;
    assert_eq!(differences(&declared, kv, &par, kv), Vec::<String>::new());
    par.data = 2;
    assert_eq!(
        differences(&declared, kv, &par, kv),
        ["parallelism.data declared 4, observed 2"]
    );
    declared.data = 1;
    par.data = 4;
    assert_eq!(
        differences(&declared, kv, &par, kv),
        ["parallelism.data declared 1, observed 4"]
    );
}

#[test]
fn an_engine_version_counts_only_where_the_pool_declares_one() {
    // The vLLM connector always reports its vLLM's version; a pool that declares none (as most
    // examples) runs whichever its image has, and is not a mismatch for it.
    let mut pair = pair();
    pair.spec.prefill.kv.engine_version = None;
    pair.spec.decode.kv.engine_version = None;
    let mut p = endpoint("p-1", Role::Prefill, &pair);
    p.spec.kv.engine_version = Some("0.33.0".into());
    let mut d = endpoint("d-1", Role::Decode, &pair);
    d.spec.kv.engine_version = Some("0.33.0".into());
    let (s, _) = compute(&pair, &observed_with(&p, &d), &t(0));
    let c = cond(&s, ct::GEOMETRY_COMPATIBLE);
    assert_eq!(c.status, "True", "{c:?}");
    // Undeclared on both pools, the engines' versions still differ: their agents refuse each
    // other at every handshake (the rule table's identity), and so does the condition.
    d.spec.kv.engine_version = Some("0.11.0".into());
    let (s, _) = compute(&pair, &observed_with(&p, &d), &t(0));
    let c = cond(&s, ct::GEOMETRY_COMPATIBLE);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "IdentityMismatch"),
        "{c:?}"
    );
    assert!(
        c.message.contains("PDEndpoints p-1 (prefill") && c.message.contains("0.11.0"),
        "{}",
        c.message
    );
    d.spec.kv.engine_version = Some("0.33.0".into());
    // Declared, another version is one.
    pair.spec.prefill.kv.engine_version = Some("0.11.0".into());
    let (s, _) = compute(&pair, &observed_with(&p, &d), &t(0));
    let c = cond(&s, ct::GEOMETRY_COMPATIBLE);
    assert_eq!(c.reason, reasons::OBSERVED_GEOMETRY_MISMATCH, "{c:?}");
    assert!(
        c.message
            .contains("kv.engineVersion declared \"0.11.0\", observed \"0.33.0\""),
        "{}",
        c.message
    );
}

fn all_ready(endpoints: Vec<&PDEndpoint>) -> Observed<'_> {
    Observed {
        prefill: ready(2, 2),
        decode: ready(4, 4),
        endpoints,
        earlier_pods: Default::default(),
        apply_refused: None,
        ready_pods: Vec::new(),
    }
}

fn path(peer: &str, kind: pdpair_api::PathKind, lanes: &[&str]) -> pdpair_api::TransferPath {
    pdpair_api::TransferPath {
        peer: peer.into(),
        kind,
        backend: pdpair_api::Backend::UcxHost,
        lanes: lanes.iter().map(|l| (*l).to_owned()).collect(),
        emulated: kind == pdpair_api::PathKind::Tcp,
        ucx_version: "1.13.1".into(),
        since: t(1),
        last_used: None,
    }
}

#[test]
fn endpoints_gone_stale_and_paths_not_used_lately_no_longer_speak_for_the_pair() {
    // An engine restarted under a new name in the same Pod, or an evicted Pod, leaves its
    // PDEndpoint until the Pod goes; its agent no longer writes it. Its old geometry, rejection
    // and path held GeometryCompatible, TransferReady and TransferPath False, and its counters
    // stayed in the totals. And a live engine's path to a peer rescheduled away held
    // requirePath False.
    use pdpair_api::PathKind;
    let mut pair = pair();
    pair.spec.transfer.require_path = vec![PathKind::Rdma];
    let heard = |at: i64| PDEndpointStatus {
        last_heartbeat: Some(t(at)),
        counters: TransferCounters {
            transfers_completed: 1,
            bytes: 100,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut p = endpoint("p-1", Role::Prefill, &pair);
    let mut d = endpoint("d-1", Role::Decode, &pair);
    let mut old = endpoint("d-old", Role::Decode, &pair);
    p.status = Some(heard(1000));
    d.status = Some(heard(1000));
    old.spec.kv.kernel_block_size = Some(16);
    let mut s = heard(1000 - STALE_SECONDS - 10);
    s.last_rejection = Some(Rejection {
        time: t(1000 - STALE_SECONDS - 20),
        peer: "p-1@node-a".into(),
        reasons: vec!["KernelBlockSizeMismatch".into()],
        message: "push needs identical kernel block sizes".into(),
        resolved: None,
    });
    s.paths = vec![path("p-1@node-a", PathKind::Tcp, &["tcp/eth0"])];
    old.status = Some(s);
    let rdma = |peer: &str, used: i64| pdpair_api::TransferPath {
        last_used: Some(t(used)),
        ..path(peer, PathKind::Rdma, &["rc_mlx5/mlx5_0:1"])
    };
    let tcp_to_gone = pdpair_api::TransferPath {
        last_used: Some(t(1000 - RECENT_SECONDS - 1)),
        ..path("d-gone@node-c", PathKind::Tcp, &["tcp/eth0"])
    };
    if let Some(s) = p.status.as_mut() {
        s.paths = vec![rdma("d-1@node-b", 990), tcp_to_gone.clone()];
    }
    let now = t(1000);
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d, &old]), &now);
    for type_ in [
        ct::GEOMETRY_COMPATIBLE,
        ct::TRANSFER_READY,
        ct::TRANSFER_PATH,
        ct::READY,
    ] {
        assert_eq!(cond(&s, type_).status, "True", "{:?}", cond(&s, type_));
    }
    let c = cond(&s, ct::TRANSFER_PATH);
    assert!(c.message.starts_with("1 transfer path(s): p-1: Rdma"), "{}", c.message);
    let totals = s.transfer.expect("totals");
    assert_eq!(
        (totals.endpoints, totals.counters.bytes),
        (2, 200),
        "the stale one is not counted"
    );
    // Still live, each speaks as before: the old geometry and the TCP path turn them False.
    let mut revived = old.clone();
    if let Some(s) = revived.status.as_mut() {
        s.last_heartbeat = Some(t(995));
    }
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d, &revived]), &now);
    for type_ in [ct::GEOMETRY_COMPATIBLE, ct::TRANSFER_PATH] {
        assert_eq!(cond(&s, type_).status, "False", "{:?}", cond(&s, type_));
    }
    // A path used within RECENT_SECONDS counts, and one an agent lists without lastUsed (from
    // before it) too.
    for recent in [Some(t(1000 - RECENT_SECONDS + 5)), None] {
        if let Some(s) = p.status.as_mut() {
            s.paths[1].last_used = recent.clone();
        }
        let (s, _) = compute(&pair, &all_ready(vec![&p, &d]), &now);
        assert_eq!(cond(&s, ct::TRANSFER_PATH).status, "False", "{recent:?}");
    }
}

#[test]
fn transfer_path_is_unknown_until_an_agent_reports_one_then_names_the_worst() {
    use pdpair_api::PathKind;
    let pair = pair();
    let mut p = endpoint("p0", Role::Prefill, &pair);
    let d = endpoint("d0", Role::Decode, &pair);
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d]), &t(2));
    assert_eq!(cond(&s, ct::TRANSFER_PATH).status, "Unknown");
    assert_eq!(cond(&s, ct::TRANSFER_PATH).reason, reasons::NO_TRANSFERS);
    assert_eq!(
        cond(&s, ct::READY).status,
        "True",
        "an unknown path does not block Ready"
    );
    p.status = Some(PDEndpointStatus {
        paths: vec![
            path("10.0.0.2:7000", PathKind::Rdma, &["rc_mlx5/mlx5_0:1"]),
            path("10.0.0.3:7000", PathKind::Tcp, &["tcp/eth0"]),
        ],
        ..PDEndpointStatus::default()
    });
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d]), &t(2));
    let c = cond(&s, ct::TRANSFER_PATH);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "Tcp"),
        "the worst path names it"
    );
    assert!(
        c.message.contains("p0: Rdma (rc_mlx5/mlx5_0:1) with 10.0.0.2:7000"),
        "{}",
        c.message
    );
    assert!(
        c.message
            .contains("p0: Tcp (tcp/eth0, emulated RMA) with 10.0.0.3:7000"),
        "{}",
        c.message
    );
    assert!(!c.message.contains("stage KV"), "{}", c.message);
    // Paths alike in rank name the same reason whichever endpoint reports which.
    let reported = |kinds: [PathKind; 2]| {
        let mut a = endpoint("a", Role::Prefill, &pair);
        let mut b = endpoint("b", Role::Decode, &pair);
        for (e, kind) in [(&mut a, kinds[0]), (&mut b, kinds[1])] {
            e.status = Some(PDEndpointStatus {
                paths: vec![path("10.0.0.9:7000", kind, &["x"])],
                ..PDEndpointStatus::default()
            });
        }
        let (s, _) = compute(&pair, &all_ready(vec![&a, &b]), &t(2));
        cond(&s, ct::TRANSFER_PATH).reason.clone()
    };
    for (x, y) in [
        (PathKind::Rdma, PathKind::SharedMemory),
        (PathKind::Local, PathKind::CudaIpc),
    ] {
        assert_eq!(reported([x, y]), reported([y, x]), "{x:?} and {y:?}");
    }
    // An engine that says it stages through host memory is counted and named; one with a GPU
    // pool, or a host pool without a word, is not.
    let mut staged = endpoint("d1", Role::Decode, &pair);
    staged.spec.staging = Some("the agent refused the GPU pool: ...".into());
    let mut gpu = endpoint("d2", Role::Decode, &pair);
    gpu.spec.pool_memory = pdpair_api::PoolMemory::Gpu;
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d, &staged, &gpu]), &t(2));
    let c = cond(&s, ct::TRANSFER_PATH);
    assert!(
        c.message
            .ends_with("; 1 of 4 engine(s) stage KV through host memory (d1: their PDEndpoints' spec.staging say why)"),
        "{}",
        c.message
    );
}

#[test]
fn a_path_outside_require_path_turns_transfer_path_and_ready_false_with_a_warning() {
    use pdpair_api::PathKind;
    let mut pair = pair();
    pair.spec.transfer.require_path = vec![PathKind::Rdma, PathKind::SharedMemory];
    let mut p = endpoint("p0", Role::Prefill, &pair);
    let d = endpoint("d0", Role::Decode, &pair);
    p.status = Some(PDEndpointStatus {
        paths: vec![path("10.0.0.2:7000", PathKind::Rdma, &["rc_mlx5/mlx5_0:1"])],
        ..PDEndpointStatus::default()
    });
    let (s0, _) = compute(&pair, &all_ready(vec![&p, &d]), &t(2));
    assert_eq!(cond(&s0, ct::TRANSFER_PATH).status, "True", "Rdma is allowed");
    assert_eq!(cond(&s0, ct::READY).status, "True");
    pair.status = Some(s0);
    // RDMA fell back to TCP for one peer.
    p.status
        .as_mut()
        .expect("status")
        .paths
        .push(path("10.0.0.3:7000", PathKind::Tcp, &["tcp/eth0"]));
    let (s1, transitions) = compute(&pair, &all_ready(vec![&p, &d]), &t(3));
    let c = cond(&s1, ct::TRANSFER_PATH);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", reasons::PATH_NOT_ALLOWED)
    );
    assert_eq!(
        c.message,
        "1 of 2 transfer path(s) are not in spec.transfer.requirePath [Rdma, SharedMemory]: p0: Tcp (tcp/eth0, emulated RMA) with 10.0.0.3:7000"
    );
    assert_eq!(cond(&s1, ct::READY).reason, reasons::PATH_NOT_ALLOWED);
    let warned: Vec<_> = transitions
        .iter()
        .filter(|t| t.warning)
        .map(|t| t.type_.as_str())
        .collect();
    assert_eq!(warned, [ct::TRANSFER_PATH], "{transitions:?}");
    // Allowing Tcp clears it.
    pair.status = Some(s1);
    pair.spec.transfer.require_path.push(PathKind::Tcp);
    let (s2, _) = compute(&pair, &all_ready(vec![&p, &d]), &t(4));
    assert_eq!(cond(&s2, ct::TRANSFER_PATH).status, "True");
    assert_eq!(cond(&s2, ct::READY).status, "True");
}

#[test]
fn an_engine_staging_through_host_memory_under_require_direct_turns_transfer_path_and_ready_false() {
    use pdpair_api::{PathKind, PoolMemory};
    let mut pair = pair();
    let mut p = endpoint("p0", Role::Prefill, &pair);
    let mut d = endpoint("d0", Role::Decode, &pair);
    p.spec.pool_memory = PoolMemory::Gpu;
    d.spec.staging = Some("the agent accepts no GPU pools".into());
    // Not required: no transfer yet, Unknown; the staging engine is counted in the message.
    let (s0, _) = compute(&pair, &all_ready(vec![&p, &d]), &t(2));
    let c = cond(&s0, ct::TRANSFER_PATH);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("Unknown", reasons::NO_TRANSFERS)
    );
    assert!(
        c.message.contains("1 of 2 engine(s) stage KV through host memory (d0"),
        "{}",
        c.message
    );
    assert_eq!(cond(&s0, ct::READY).status, "True");
    pair.status = Some(s0);
    // Required: False before any transfer, naming the engine, with a Warning; Ready says why.
    pair.spec.transfer.require_direct = true;
    let (s1, transitions) = compute(&pair, &all_ready(vec![&p, &d]), &t(3));
    let c = cond(&s1, ct::TRANSFER_PATH);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", reasons::STAGING_NOT_ALLOWED)
    );
    assert!(
        c.message.starts_with(
            "spec.transfer.requireDirect is set, but 1 of 2 engine(s) hand their agent a host pool, not their KV cache in GPU memory (d0)"
        ),
        "{}",
        c.message
    );
    let r = cond(&s1, ct::READY);
    assert_eq!(
        (r.status.as_str(), r.reason.as_str()),
        ("False", reasons::STAGING_NOT_ALLOWED)
    );
    assert!(
        transitions.iter().any(|t| t.type_ == ct::TRANSFER_PATH && t.warning),
        "{transitions:?}"
    );
    // A host pool without a word of why (an engine whose cache is on the CPU) counts too.
    d.spec.staging = None;
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d]), &t(3));
    assert_eq!(cond(&s, ct::TRANSFER_PATH).reason, reasons::STAGING_NOT_ALLOWED);
    // A path outside requirePath as well: its reason stays, and the message says both.
    pair.spec.transfer.require_path = vec![PathKind::Rdma];
    p.status = Some(PDEndpointStatus {
        paths: vec![path("10.0.0.3:7000", PathKind::Tcp, &["tcp/eth0"])],
        ..PDEndpointStatus::default()
    });
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d]), &t(3));
    let c = cond(&s, ct::TRANSFER_PATH);
    assert_eq!(c.reason, reasons::PATH_NOT_ALLOWED);
    assert!(
        c.message.contains("not in spec.transfer.requirePath") && c.message.contains("requireDirect is set"),
        "{}",
        c.message
    );
    // Every engine in GPU memory: True.
    pair.spec.transfer.require_path.clear();
    d.spec.pool_memory = PoolMemory::Gpu;
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d]), &t(4));
    assert_eq!(cond(&s, ct::TRANSFER_PATH).status, "True");
    assert_eq!(cond(&s, ct::READY).status, "True");
}

#[test]
fn many_paths_are_counted_not_all_named() {
    use pdpair_api::PathKind;
    let pair = pair();
    let mut p = endpoint("p0", Role::Prefill, &pair);
    p.status = Some(PDEndpointStatus {
        paths: (0..5)
            .map(|i| path(&format!("10.0.0.{i}:7000"), PathKind::SharedMemory, &["posix/memory"]))
            .collect(),
        ..PDEndpointStatus::default()
    });
    let (s, _) = compute(&pair, &observed_with(&p, &p), &t(2));
    let c = cond(&s, ct::TRANSFER_PATH);
    assert!(c.message.starts_with("10 transfer path(s): "), "{}", c.message);
    assert!(c.message.ends_with("; and 7 more"), "{}", c.message);
}

#[test]
fn with_pdpairs_connector_a_ready_pod_without_an_engine_registered_turns_transfer_ready_false() {
    // One decode pod's engine never registered (its agent refused it, or has no room for its
    // pool yet): its KV never moves, though both roles have engines. Past a minute Ready
    // without one, TransferReady is False naming it, with a Warning, and Ready with it.
    let mut pair = pair();
    pair.spec.transfer.connector = pdpair_api::Connector::Pdpair;
    let heard = PDEndpointStatus {
        last_heartbeat: Some(t(100)),
        ..PDEndpointStatus::default()
    };
    let mut p = endpoint("p-1", Role::Prefill, &pair);
    p.spec.pod = "prefill-a".into();
    p.status = Some(heard.clone());
    let mut d = endpoint("d-1", Role::Decode, &pair);
    d.spec.pod = "decode-a".into();
    d.status = Some(heard);
    let pod = |role: Role, name: &str, since: i64| ReadyPod {
        role,
        name: name.into(),
        since: Some(t(since)),
    };
    let mut observed = all_ready(vec![&p, &d]);
    observed.ready_pods = vec![
        pod(Role::Prefill, "prefill-a", 0),
        pod(Role::Decode, "decode-a", 0),
        pod(Role::Decode, "decode-b", 50),
    ];
    // A minute's grace: its engine registers as vLLM starts, and its PDEndpoint may come a
    // moment after the Pod turned Ready.
    let (s0, _) = compute(&pair, &observed, &t(110));
    assert_eq!(
        cond(&s0, ct::TRANSFER_READY).status,
        "True",
        "{:?}",
        cond(&s0, ct::TRANSFER_READY)
    );
    assert_eq!(cond(&s0, ct::READY).status, "True");
    assert_eq!(
        changes_in(&pair, &observed.endpoints, &observed.ready_pods, &t(110)),
        Some(std::time::Duration::from_secs(1)),
        "looked at again as its grace ends"
    );
    pair.status = Some(s0);
    let (s1, transitions) = compute(&pair, &observed, &t(111));
    let c = cond(&s1, ct::TRANSFER_READY);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", reasons::NOT_REGISTERED)
    );
    assert!(
        c.message.starts_with(
            "1 pod(s) Ready for over 60 s have no live PDEndpoint, so no engine of theirs registered with their node agent, or their agent cannot publish it: decode pod decode-b"
        ),
        "{}",
        c.message
    );
    assert!(
        transitions.iter().any(|t| t.type_ == ct::TRANSFER_READY && t.warning),
        "{transitions:?}"
    );
    let r = cond(&s1, ct::READY);
    assert_eq!(
        (r.status.as_str(), r.reason.as_str()),
        ("False", reasons::NOT_REGISTERED)
    );
    // Its engine registers: True again. An engine of the other role in a Pod of that name does
    // not count for it.
    let mut b = endpoint("d-2", Role::Decode, &pair);
    b.spec.pod = "decode-b".into();
    b.status = d.status.clone();
    let mut wrong_role = b.clone();
    wrong_role.spec.role = Role::Prefill;
    observed.endpoints = vec![&p, &d, &wrong_role];
    let (s, _) = compute(&pair, &observed, &t(111));
    assert_eq!(cond(&s, ct::TRANSFER_READY).reason, reasons::NOT_REGISTERED);
    observed.endpoints = vec![&p, &d, &b];
    let (s, _) = compute(&pair, &observed, &t(111));
    assert_eq!(cond(&s, ct::TRANSFER_READY).status, "True");
    // Its engine's endpoint gone stale (the agent or engine went), the others' live: not
    // registered any more.
    let fresh = PDEndpointStatus {
        last_heartbeat: Some(t(300)),
        ..PDEndpointStatus::default()
    };
    let (mut p_live, mut d_live) = (p.clone(), d.clone());
    p_live.status = Some(fresh.clone());
    d_live.status = Some(fresh.clone());
    let mut d_news = d_live.clone();
    d_news.status = Some(PDEndpointStatus {
        last_rejection: Some(Rejection {
            time: t(200),
            peer: "10.0.0.9:7000".into(),
            reasons: vec!["KernelBlockSizeMismatch".into()],
            message: "push needs identical kernel block sizes".into(),
            resolved: None,
        }),
        ..fresh
    });
    observed.endpoints = vec![&p_live, &d_live, &b];
    let (s, _) = compute(&pair, &observed, &t(100 + STALE_SECONDS + 1));
    let c = cond(&s, ct::TRANSFER_READY);
    assert_eq!(c.reason, reasons::NOT_REGISTERED, "{}", c.message);
    // Other news is said after it.
    observed.endpoints = vec![&p_live, &d_news, &b];
    let (s, _) = compute(&pair, &observed, &t(100 + STALE_SECONDS + 1));
    let c = cond(&s, ct::TRANSFER_READY);
    assert_eq!(c.reason, reasons::NOT_REGISTERED);
    assert!(
        c.message.contains("; and 1 endpoint(s) rejected a handshake"),
        "{}",
        c.message
    );
    // Without pdpair's connector engines need not register.
    pair.spec.transfer.connector = pdpair_api::Connector::None;
    observed.endpoints = vec![&p, &d];
    let (s, _) = compute(&pair, &observed, &t(111));
    assert_eq!(cond(&s, ct::TRANSFER_READY).status, "True");
}

#[test]
fn with_pdpairs_connector_ready_needs_a_live_engine_of_each_role() {
    // Pods Ready and no engine registered (a template whose command drops the operator's
    // --kv-transfer-config, an agent gone) is not a ready pair when the operator wired the
    // connector; without it, engines may not register at all, and Ready does not wait for them.
    let mut pair = pair();
    pair.spec.transfer.connector = pdpair_api::Connector::Pdpair;
    let (s, _) = compute(&pair, &all_ready(vec![]), &t(0));
    let r = cond(&s, ct::READY);
    assert_eq!(
        (r.status.as_str(), r.reason.as_str()),
        ("False", reasons::NOT_REGISTERED),
        "{r:?}"
    );
    assert!(
        r.message.contains("no prefill engine has registered with a node agent"),
        "{}",
        r.message
    );
    // One role registered: the other is named.
    let mut p = endpoint("p-1", Role::Prefill, &pair);
    p.status = Some(PDEndpointStatus {
        last_heartbeat: Some(t(0)),
        ..PDEndpointStatus::default()
    });
    let (s, _) = compute(&pair, &all_ready(vec![&p]), &t(10));
    let r = cond(&s, ct::READY);
    assert_eq!(r.reason, reasons::NOT_REGISTERED);
    assert!(
        r.message.contains("no decode engine") && !r.message.contains("no prefill"),
        "{}",
        r.message
    );
    // Both: ready.
    let mut d = endpoint("d-1", Role::Decode, &pair);
    d.status = p.status.clone();
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d]), &t(10));
    assert_eq!(cond(&s, ct::READY).status, "True", "{:?}", cond(&s, ct::READY));
    // Their agents silent for over STALE_SECONDS: not ready, saying so.
    let late = t(STALE_SECONDS + 1);
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d]), &late);
    let r = cond(&s, ct::READY);
    assert_eq!(r.reason, reasons::NOT_REGISTERED);
    assert!(
        r.message.contains("have not been heard of for over 120 s"),
        "{}",
        r.message
    );
    // Endpoints whose agents never wrote their status count from when they were made.
    let (mut p, mut d) = (p.clone(), d.clone());
    (p.status, d.status) = (None, None);
    p.metadata.creation_timestamp = Some(t(0));
    d.metadata.creation_timestamp = Some(t(0));
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d]), &t(10));
    assert_eq!(cond(&s, ct::READY).status, "True", "{:?}", cond(&s, ct::READY));
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d]), &late);
    assert_eq!(cond(&s, ct::READY).reason, reasons::NOT_REGISTERED);
    // Without pdpair's connector, Ready does not wait for engines to register.
    pair.spec.transfer.connector = pdpair_api::Connector::None;
    let (s, _) = compute(&pair, &all_ready(vec![]), &t(0));
    assert_eq!(cond(&s, ct::READY).status, "True");
}

#[test]
fn times_from_the_future_and_hostile_text_are_not_taken_as_written() {
    // PDEndpoints are written by node agents, whose credentials may be a compromised node's.
    let mut pair = pair();
    pair.spec.transfer.connector = pdpair_api::Connector::Pdpair;
    let mut p = endpoint("p-1", Role::Prefill, &pair);
    let mut d = endpoint("d-1", Role::Decode, &pair);
    // A heartbeat far ahead of the operator's clock kept an engine live until then.
    let ahead = PDEndpointStatus {
        last_heartbeat: Some(t(SKEW_SECONDS + 10_000)),
        ..PDEndpointStatus::default()
    };
    (p.status, d.status) = (Some(ahead.clone()), Some(ahead));
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d]), &t(0));
    assert_eq!(cond(&s, ct::READY).reason, reasons::NOT_REGISTERED);
    // Within the skew: live.
    let near = PDEndpointStatus {
        last_heartbeat: Some(t(SKEW_SECONDS)),
        ..PDEndpointStatus::default()
    };
    (p.status, d.status) = (Some(near.clone()), Some(near));
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d]), &t(0));
    assert_eq!(cond(&s, ct::READY).status, "True");
    // A rejection from far in the future counted until then; a near one counts.
    let rejected = |at: i64, message: &str| Rejection {
        time: t(at),
        peer: "10.0.0.9:7000".into(),
        reasons: vec!["Unauthenticated".into()],
        message: message.into(),
        resolved: None,
    };
    if let Some(s) = d.status.as_mut() {
        s.last_rejection = Some(rejected(RECENT_SECONDS * 100, "later"));
    }
    let (s, _) = compute(&pair, &all_ready(vec![&p, &d]), &t(0));
    assert_eq!(cond(&s, ct::TRANSFER_READY).status, "True");
    // Control characters are escaped and a message is cut to MAX_MESSAGE.
    let hostile = format!("line\nnext\u{1b}[31m{}", "x".repeat(20_000));
    if let Some(s) = d.status.as_mut() {
        s.last_rejection = Some(rejected(1, &hostile));
    }
    let (s, transitions) = compute(&pair, &all_ready(vec![&p, &d]), &t(2));
    let c = cond(&s, ct::TRANSFER_READY);
    assert_eq!(c.status, "False");
    assert!(c.message.contains("line\\nnext\\u{1b}[31m"), "{}", &c.message[..200]);
    assert!(!c.message.chars().any(char::is_control));
    assert_eq!(c.message.chars().count(), MAX_MESSAGE);
    assert!(cond(&s, ct::READY).message.chars().count() <= MAX_MESSAGE);
    assert!(transitions.iter().all(|t| t.message.chars().count() <= MAX_MESSAGE));
    // Every condition, also one added to after it was made (TransferPath names engines that
    // stage): a path of many long lanes, and staging engines with long names.
    let lanes: Vec<String> = (0..32).map(|i| format!("tcp/{i}{}", "l".repeat(250))).collect();
    let lanes: Vec<&str> = lanes.iter().map(String::as_str).collect();
    let mut staged: Vec<PDEndpoint> = (0..3)
        .map(|i| endpoint(&format!("{i}{}", "e".repeat(250)), Role::Decode, &pair))
        .collect();
    for e in &mut staged {
        e.spec.staging = Some("cpu".into());
        e.status = Some(PDEndpointStatus {
            paths: vec![path("x@y", pdpair_api::PathKind::Tcp, &lanes)],
            ..PDEndpointStatus::default()
        });
    }
    let (s, _) = compute(&pair, &all_ready(staged.iter().collect()), &t(2));
    assert!(
        s.conditions.iter().all(|c| c.message.chars().count() <= MAX_MESSAGE),
        "{:?}",
        s.conditions
            .iter()
            .map(|c| c.message.chars().count())
            .collect::<Vec<_>>()
    );
}

#[test]
fn the_pair_is_looked_at_again_when_an_endpoint_goes_stale_or_news_leaves_its_window() {
    use std::time::Duration;
    let pair = pair();
    let mut p = endpoint("p-1", Role::Prefill, &pair);
    let mut d = endpoint("d-1", Role::Decode, &pair);
    let now = t(1010);
    assert_eq!(
        changes_in(&pair, &[&p, &d], &[], &now),
        None,
        "no times: nothing changes"
    );
    p.status = Some(PDEndpointStatus {
        last_heartbeat: Some(t(1000)),
        paths: vec![pdpair_api::TransferPath {
            last_used: Some(t(500)),
            ..path("d-1@node-b", pdpair_api::PathKind::Rdma, &["rc"])
        }],
        last_rejection: Some(Rejection {
            time: t(995),
            peer: "d-1@node-b".into(),
            reasons: vec!["KernelBlockSizeMismatch".into()],
            message: String::new(),
            resolved: None,
        }),
        ..Default::default()
    });
    // Silent since 800: stale already, nothing of it to wait for, its news either.
    d.status = Some(PDEndpointStatus {
        last_heartbeat: Some(t(800)),
        last_failure: Some(Failure {
            time: t(130), // would leave its window in 20 s
            reasons: vec!["PeerLost".into()],
            message: String::new(),
            peer: None,
            resolved: None,
        }),
        ..Default::default()
    });
    assert_eq!(
        changes_in(&pair, &[&p, &d], &[], &now),
        Some(Duration::from_secs(1000 + STALE_SECONDS as u64 + 1 - 1010)),
        "p goes stale first"
    );
    // Later: the path has left its window; the rejection leaves its own before p goes stale.
    if let Some(s) = p.status.as_mut() {
        s.last_heartbeat = Some(t(1780));
    }
    assert_eq!(
        changes_in(&pair, &[&p], &[], &t(1790)),
        Some(Duration::from_secs(995 + RECENT_SECONDS as u64 - 1790)),
    );
    // An earlier failure of another peer, which leaves its window first.
    if let Some(s) = p.status.as_mut() {
        s.earlier_failures = vec![Failure {
            time: t(992),
            reasons: vec!["PeerLost".into()],
            message: String::new(),
            peer: Some("10.0.0.9:7000".into()),
            resolved: None,
        }];
    }
    assert_eq!(
        changes_in(&pair, &[&p], &[], &t(1790)),
        Some(Duration::from_secs(992 + RECENT_SECONDS as u64 - 1790)),
    );
}

#[test]
fn a_pods_engines_named_by_their_ranks_are_each_judged_whole() {
    // vLLM's data-parallel ranks are engines of their own in one Pod: dp0 registered rank 0
    // only, dp1 rank 1 only. Counted together, each rank registered once and the Pod looked
    // whole; named by their engines, each is short of one.
    let mut pair = pair();
    pair.spec.decode.parallelism.tensor = 2;
    let made = |name: &str, rank: i32, instance: Option<&str>| {
        let mut e = endpoint(name, Role::Decode, &pair);
        e.spec.pod = "decode-a".into();
        e.spec.tensor_rank = Some(rank);
        e.spec.instance = instance.map(str::to_owned);
        e.metadata.creation_timestamp = Some(t(0));
        e.status = Some(PDEndpointStatus {
            last_heartbeat: Some(t(100)),
            registered: Some(t(0)),
            ..PDEndpointStatus::default()
        });
        e
    };
    let p = endpoint("p-0", Role::Prefill, &pair);
    let transfer = |endpoints: Vec<&PDEndpoint>| {
        let (s, _) = compute(&pair, &all_ready(endpoints), &t(110));
        let c = cond(&s, ct::TRANSFER_READY).clone();
        (c.status, c.message)
    };
    let dp0_r0 = made("d-0-0", 0, Some("decode-a-e_dp0"));
    let dp1_r1 = made("d-1-1", 1, Some("decode-a-e_dp1"));
    let (status, message) = transfer(vec![&p, &dp0_r0, &dp1_r1]);
    assert!(
        status == "False"
            && message.contains("decode pod decode-a (rank 0, 1 of 2 short: engine decode-a-e_dp0, decode-a-e_dp1)"),
        "{message}"
    );
    // Each whole: True.
    let dp0_r1 = made("d-0-1", 1, Some("decode-a-e_dp0"));
    let dp1_r0 = made("d-1-0", 0, Some("decode-a-e_dp1"));
    assert_eq!(transfer(vec![&p, &dp0_r0, &dp0_r1, &dp1_r0, &dp1_r1]).0, "True");
    // One short of rank 1 named as such.
    let (status, message) = transfer(vec![&p, &dp0_r0, &dp1_r0, &dp1_r1]);
    assert!(
        status == "False" && message.contains("decode pod decode-a (rank 1 of 2 short: engine decode-a-e_dp0)"),
        "{message}"
    );
    // An endpoint naming no engine (an engine before instance): the Pod's ranks counted together,
    // as before (each rank once here: not news).
    let unnamed = made("d-x-1", 1, None);
    assert_eq!(transfer(vec![&p, &dp0_r0, &unnamed]).0, "True");
    // Two engines naming the same one (an engine's own word) count together: still short where
    // the Pod's ranks are counted unevenly.
    let same_r0 = made("d-s-0", 0, Some("decode-a-e_dp0"));
    let (status, message) = transfer(vec![&p, &dp0_r0, &dp0_r1, &same_r0]);
    assert!(
        status == "False" && message.contains("decode pod decode-a (rank 1 of 2 short: engine decode-a-e_dp0)"),
        "{message}"
    );
}

#[test]
fn a_pod_missing_a_whole_engine_of_those_its_engines_say_it_runs_is_short_once_settled() {
    // vLLM's data-parallel ranks (of an MoE model: one data-parallel group) are engines of
    // their own in one Pod, each whole: dp1 never registered (its agent refused it, say). Each
    // rank of dp0 whole, nothing was short.
    let mut pair = pair();
    pair.spec.decode.parallelism.tensor = 2;
    pair.spec.decode.parallelism.data = 3;
    let made_heard =
        |name: &str, rank: i32, instance: Option<&str>, pod_engines: Option<i32>, registered: i64, heard: i64| {
            let mut e = endpoint(name, Role::Decode, &pair);
            e.spec.pod = "decode-a".into();
            e.spec.tensor_rank = Some(rank);
            e.spec.instance = instance.map(str::to_owned);
            e.spec.pod_engines = pod_engines;
            e.metadata.creation_timestamp = Some(t(0));
            e.status = Some(PDEndpointStatus {
                last_heartbeat: Some(t(heard)),
                registered: Some(t(registered)),
                ..PDEndpointStatus::default()
            });
            e
        };
    let made = |name: &str, rank: i32, instance: Option<&str>, pod_engines: Option<i32>, registered: i64| {
        made_heard(name, rank, instance, pod_engines, registered, 100)
    };
    let p = endpoint("p-0", Role::Prefill, &pair);
    let transfer = |endpoints: Vec<&PDEndpoint>, at: i64| {
        let (s, _) = compute(&pair, &all_ready(endpoints), &t(at));
        let c = cond(&s, ct::TRANSFER_READY).clone();
        (c.status, c.reason, c.message)
    };
    let dp0 = Some("decode-a-e_dp0");
    let dp0_r0 = made("d-0-0", 0, dp0, Some(2), 0);
    let dp0_r1 = made("d-0-1", 1, dp0, Some(2), 50);
    // A minute's grace from the last registration, then news naming the count.
    assert_eq!(transfer(vec![&p, &dp0_r0, &dp0_r1], 105).0, "True");
    assert_eq!(
        changes_in(&pair, &[&p, &dp0_r0, &dp0_r1], &[], &t(105)),
        Some(std::time::Duration::from_secs(6)),
        "looked at again as the grace ends"
    );
    let (status, reason, message) = transfer(vec![&p, &dp0_r0, &dp0_r1], 111);
    assert_eq!((status.as_str(), reason.as_str()), ("False", reasons::NOT_REGISTERED));
    assert!(
        message.contains("decode pod decode-a (1 of 2 engines registered)"),
        "{message}"
    );
    // dp1 registers whole: True.
    let dp1 = Some("decode-a-e_dp1");
    let dp1_r0 = made("d-1-0", 0, dp1, Some(2), 0);
    let dp1_r1 = made("d-1-1", 1, dp1, Some(2), 0);
    assert_eq!(transfer(vec![&p, &dp0_r0, &dp0_r1, &dp1_r0, &dp1_r1], 200).0, "True");
    // dp1 with rank 1 only: both said.
    let (status, _, message) = transfer(vec![&p, &dp0_r0, &dp0_r1, &dp1_r1], 200);
    assert!(
        status == "False" && message.contains("decode pod decode-a (rank 0 of 2 short: engine decode-a-e_dp1)"),
        "{message}"
    );
    let (_, _, message) = transfer(vec![&p, &dp0_r1, &dp0_r0], 200);
    assert!(message.contains("(1 of 2 engines registered)"), "{message}");
    let two_short = made("d-0-0", 0, dp0, Some(3), 0);
    let (_, _, message) = transfer(vec![&p, &two_short, &dp0_r1, &dp1_r0, &dp1_r1], 200);
    assert!(
        message.contains("decode pod decode-a (2 of 3 engines registered)"),
        "{message}"
    );
    // Endpoints saying different counts: the most counts.
    let says_one = made("d-0-1", 1, dp0, Some(1), 0);
    let (_, _, message) = transfer(vec![&p, &dp0_r0, &says_one], 200);
    assert!(message.contains("(1 of 2 engines registered)"), "{message}");
    // An engine whose endpoints went stale (ended: its agent heard no more of it) counts no
    // more, a minute after the last went.
    let gone = 200 - super::STALE_SECONDS - 70;
    let dp1_r0_gone = made_heard("d-1-0", 0, dp1, Some(2), 0, gone);
    let dp1_r1_gone = made_heard("d-1-1", 1, dp1, Some(2), 0, gone);
    let (status, _, message) = transfer(vec![&p, &dp0_r0, &dp0_r1, &dp1_r0_gone, &dp1_r1_gone], 200);
    assert!(
        status == "False" && message.contains("decode pod decode-a (1 of 2 engines registered)"),
        "{message}"
    );
    // Not counted where an endpoint of the Pod does not say the count (an engine or agent
    // before podEngines), names no engine, or says one outside 1..=1024 or over the engine's
    // data parallelism (3 here).
    for (instance, engines) in [
        (dp0, None),
        (None, Some(2)),
        (dp0, Some(0)),
        (dp0, Some(1025)),
        (dp0, Some(4)),
    ] {
        let r1 = made("d-0-1", 1, instance, engines, 0);
        assert_eq!(
            transfer(vec![&p, &dp0_r0, &r1], 200).0,
            "True",
            "{instance:?} {engines:?}"
        );
    }
}

#[test]
fn a_pod_with_some_of_an_engines_tensor_parallel_ranks_registered_turns_transfer_ready_false_once_settled() {
    // Decode runs tensor parallelism 2 from the pair's template: each Pod is whole engines. Pod
    // decode-a has both ranks registered; decode-b only rank 0 (rank 1's agent refused it, or
    // has no room for its pool): that engine's requests move no KV, though the Pod has an
    // endpoint.
    let mut pair = pair();
    pair.spec.decode.parallelism.tensor = 2;
    assert!(pair.spec.decode.template.is_some());
    let made = |name: &str, role: Role, pod: &str, rank: Option<i32>, registered: i64, heard: i64| {
        let mut e = endpoint(name, role, &pair);
        e.spec.pod = pod.into();
        e.spec.tensor_rank = rank;
        e.metadata.creation_timestamp = Some(t(0));
        e.status = Some(PDEndpointStatus {
            last_heartbeat: Some(t(heard)),
            registered: Some(t(registered)),
            ..PDEndpointStatus::default()
        });
        e
    };
    let p0 = made("p-0", Role::Prefill, "prefill-a", Some(0), 0, 100);
    let p1 = made("p-1", Role::Prefill, "prefill-a", Some(1), 0, 100);
    let a0 = made("d-a0", Role::Decode, "decode-a", Some(0), 0, 100);
    let a1 = made("d-a1", Role::Decode, "decode-a", Some(1), 0, 100);
    // Registered at 50 (its endpoint made long before: an engine restarted in its Pod keeps it).
    let b0 = made("d-b0", Role::Decode, "decode-b", Some(0), 50, 100);
    let transfer_in = |pair: &PDPair, endpoints: Vec<&PDEndpoint>, at: i64| {
        let (s, _) = compute(pair, &all_ready(endpoints), &t(at));
        let c = cond(&s, ct::TRANSFER_READY).clone();
        (c.status, c.reason, c.message, cond(&s, ct::READY).status.clone())
    };
    let transfer = |endpoints: Vec<&PDEndpoint>, at: i64| transfer_in(&pair, endpoints, at);
    // A minute's grace from its registration: an engine's ranks register moments apart.
    let (status, _, message, _) = transfer(vec![&p0, &p1, &a0, &a1, &b0], 110);
    assert_eq!(status, "True", "{message}");
    assert_eq!(
        changes_in(&pair, &[&p0, &p1, &a0, &a1, &b0], &[], &t(105)),
        Some(std::time::Duration::from_secs(6)),
        "looked at again as the grace ends"
    );
    let (status, reason, message, ready) = transfer(vec![&p0, &p1, &a0, &a1, &b0], 111);
    assert_eq!(
        (status.as_str(), reason.as_str(), ready.as_str()),
        ("False", reasons::NOT_REGISTERED, "False")
    );
    assert_eq!(
        message,
        "1 pod(s) have had an engine partly registered (some of its tensor-parallel ranks registered and others not, or fewer of the pod's engines registered than it runs) for over 60 s: decode pod decode-b (rank 1 of 2 short) (KV moves to or from none of an engine short's ranks; the log of the rank or engine short says why it did not register, or its agent's why it cannot publish it)"
    );
    // Its rank 1 registers: True.
    let b1 = made("d-b1", Role::Decode, "decode-b", Some(1), 60, 100);
    assert_eq!(transfer(vec![&p0, &p1, &a0, &a1, &b0, &b1], 200).0, "True");
    // Two engines in one Pod, one short of rank 1; a rank outside the parallelism does not count
    // as one.
    let b0_again = made("d-b0x", Role::Decode, "decode-b", Some(0), 60, 100);
    let (status, _, message, _) = transfer(vec![&p0, &p1, &a0, &a1, &b0, &b1, &b0_again], 200);
    assert!(
        status == "False" && message.contains("decode pod decode-b (rank 1 of 2 short)"),
        "{message}"
    );
    let outside = made("d-b1", Role::Decode, "decode-b", Some(2), 60, 100);
    assert_eq!(
        transfer(vec![&p0, &p1, &a0, &a1, &b0, &outside], 200).0,
        "True",
        "decode-b left out"
    );
    // An engine's endpoints going stale one after another (its Pod's engine ended: each rank's
    // last heartbeat came at its own moment): no news until a minute after the last went.
    let c0 = made("d-c0", Role::Decode, "decode-c", Some(0), 0, 100);
    let c1 = made("d-c1", Role::Decode, "decode-c", Some(1), 0, 130);
    let stale_at = 100 + super::STALE_SECONDS;
    let (status, _, message, _) = transfer(vec![&p0, &p1, &a0, &a1, &c0, &c1], stale_at + 20);
    assert_eq!(status, "True", "{message}");
    // A Pod whose endpoint names no rank (an agent before tensorRank) is left out, not others.
    let unnamed = made("d-b1", Role::Decode, "decode-b", None, 60, 100);
    assert_eq!(transfer(vec![&p0, &p1, &a0, &a1, &b0, &unnamed], 200).0, "True");
    let d0 = made("d-d0", Role::Decode, "decode-d", Some(0), 60, 100);
    let (status, _, message, _) = transfer(vec![&p0, &p1, &a0, &a1, &b0, &unnamed, &d0], 200);
    assert!(
        status == "False" && message.contains("decode pod decode-d"),
        "{message}"
    );
    assert!(!message.contains("decode-b"), "{message}");
    // A registration time ahead of the clock does not hold the grace open.
    let ahead = made("d-d0", Role::Decode, "decode-d", Some(0), 10_000, 100);
    assert_eq!(transfer(vec![&p0, &p1, &a0, &a1, &ahead], 200).0, "False");
    // Each Pod is judged on its own endpoints and its own last change: in a pool run from the
    // pair's template each Pod is whole engines, so ranks spread over two Pods are two engines
    // short, and a registration in another Pod holds no grace open for a settled one.
    let x0 = made("d-x0", Role::Decode, "decode-x", Some(0), 0, 100);
    let y1 = made("d-y1", Role::Decode, "decode-y", Some(1), 0, 100);
    let (status, _, message, _) = transfer(vec![&p0, &p1, &x0, &y1], 200);
    assert!(
        status == "False"
            && message.starts_with(
                "2 pod(s) have had an engine partly registered (some of its tensor-parallel ranks registered and others not, or fewer of the pod's engines registered than it runs) for over 60 s: decode pod decode-x (rank 1 of 2 short), decode pod decode-y (rank 0 of 2 short) ("
            ),
        "{message}"
    );
    let fresh = made("d-e0", Role::Decode, "decode-e", Some(0), 190, 200);
    let (status, _, message, _) = transfer(vec![&p0, &p1, &a0, &a1, &b0, &fresh], 200);
    assert!(
        status == "False"
            && message.starts_with("1 pod(s) have had")
            && message.contains("decode pod decode-b (rank 1"),
        "{message}"
    );
    // A rank whose endpoint went stale counts no more, a minute after it went.
    let b1_gone = made(
        "d-b1",
        Role::Decode,
        "decode-b",
        Some(1),
        60,
        100 - super::STALE_SECONDS - 70,
    );
    assert_eq!(transfer(vec![&p0, &p1, &a0, &a1, &b0, &b1_gone], 200).0, "False");
    let b1_going = made(
        "d-b1",
        Role::Decode,
        "decode-b",
        Some(1),
        60,
        170 - super::STALE_SECONDS,
    );
    assert_eq!(transfer(vec![&p0, &p1, &a0, &a1, &b0, &b1_going], 200).0, "True");
    // A heartbeat further ahead than clocks' skew makes an endpoint stale, and holds no grace
    // open until then.
    let b1_ahead = made("d-b1", Role::Decode, "decode-b", Some(1), 60, 10_000);
    assert_eq!(transfer(vec![&p0, &p1, &a0, &a1, &b0, &b1_ahead], 200).0, "False");
    // The pair is looked at again a minute after an endpoint went stale.
    let c1_later = made("d-c1", Role::Decode, "decode-c", Some(1), 0, 200);
    assert_eq!(
        changes_in(&pair, &[&c0, &c1_later], &[], &t(stale_at + 5)),
        Some(std::time::Duration::from_secs(56)),
        "rank 0 went stale at {stale_at}"
    );
    // Endpoints of another tensor parallelism (a rollout to a new one) count on their own.
    let mut other = made("d-z0", Role::Decode, "decode-z", Some(0), 0, 100);
    other.spec.parallelism.tensor = 1;
    assert_eq!(transfer(vec![&p0, &p1, &a0, &a1, &b0, &b1, &other], 200).0, "True");

    // A pool you bring may spread an engine's ranks over Pods, each holding some: no news, unless
    // a Pod of the pool holds every rank (its Pods are whole engines, then).
    let mut brought = pair.clone();
    brought.spec.decode.template = None;
    let transfer = |endpoints: Vec<&PDEndpoint>, at: i64| transfer_in(&brought, endpoints, at);
    assert_eq!(transfer(vec![&p0, &p1, &x0, &y1], 200).0, "True");
    assert_eq!(transfer(vec![&p0, &p1, &x0, &b0], 200).0, "True");
    let (status, _, message, _) = transfer(vec![&p0, &p1, &a0, &a1, &b0], 200);
    assert!(
        status == "False" && message.contains("1 pod(s) have had") && message.contains("decode pod decode-b (rank 1"),
        "{message}"
    );
}
