//! Node agents against the real API server, beside a running operator: engines register, the
//! agents publish PDEndpoints owned by the engines' Pods (no kubelet runs: the Pods exist in the
//! API only, and the engines are synthetic), and what the agents observe reaches the PDPair.

use std::{path::PathBuf, time::Duration};

use pdpair_agent::{
    agent::endpoint_name,
    engine_api::{AgentEvent, EngineRequest},
    synthetic::{EngineMemory, EngineSpec, SyntheticEngine},
};
use pdpair_api::{PDPair, Role};
use pdpair_e2e::*;

const WAIT: Duration = Duration::from_secs(60);

fn secret_key(ns: &str, pair: &str) -> Vec<u8> {
    let s = eventually(WAIT, "the pairing Secret", || pairing_secret(ns, pair));
    base64_decode(s["data"]["key"].as_str().expect("key"))
}

/// One request of 100 tokens from `p`'s blocks 0-1 into `d`'s 2-3; decode's final event.
fn push_one(p: &mut SyntheticEngine, d: &mut SyntheticEngine, request: &str, seed: u64) -> AgentEvent {
    p.fill(seed, &[0, 1], 0, 100);
    p.send(&EngineRequest::KvReady {
        release_token: None,
        request: request.into(),
        blocks: vec![0, 1],
        num_tokens: 100,
        first_token: 0,
        prompt: Some(pdpair_agent::synthetic::prompt(seed, 100)),
        event: None,
    })
    .expect("send");
    d.send(&EngineRequest::ExpectKv {
        request: request.into(),
        prefill: p.address.clone(),
        blocks: vec![2, 3],
        num_tokens: 100,
        first_token: 0,
        prompt: Some(pdpair_agent::synthetic::prompt(seed, 100)),
        event: None,
    })
    .expect("send");
    d.next_event().expect("event")
}

#[test]
fn agents_publish_endpoints_and_their_observations_reach_the_pair() {
    let _op = Operator::start("agents");
    let ns = namespace("agents");
    // The pair expects RDMA or shared memory; its agents are restricted to tcp (`AgentProcess`
    // runs `--transport tcp`).
    let text = manifest("vllm-push-64-64.yaml", &ns, |v| {
        v["spec"]["transfer"]["requirePath"] = serde_yaml::from_str("[Rdma, SharedMemory]").expect("yaml");
    });
    kubectl_ok(&["apply", "-f", "-"], Some(&text));
    let pair: PDPair = serde_yaml::from_str(&text).expect("PDPair");
    // The engines get the pair's secret the way a pod does: from the Secret the operator made.
    let key = secret_key(&ns, "vllm-push-64-64");
    assert_eq!(key.len(), 32);
    for (name, role) in [
        ("decode-pod", "decode"),
        ("prefill-pod", "prefill"),
        ("prefill16-pod", "prefill"),
    ] {
        // On the node of the agent its engine registers with: the operator counts an endpoint
        // only for a Pod on the node it names.
        let node = if role == "decode" { "node-d" } else { "node-p" };
        engine_pod(&ns, name, "vllm-push-64-64", role, Some(node));
    }
    let work = dir().join(format!("agents-{ns}"));
    std::fs::create_dir_all(&work).expect("dir");
    let (d_sock, p_sock) = (work.join("node-d.sock"), work.join("node-p.sock"));
    // The engines here are threads of this test, not processes in Pods (no kubelet runs):
    // tests/e2e/attest.rs covers attestation.
    let _d_agent = AgentProcess::start("node-d", &d_sock, &["--no-attest"]);
    let _p_agent = AgentProcess::start("node-p", &p_sock, &["--no-attest"]);
    let spec = |role: Role, engine: &str, pod: &str, block: i32| {
        let pool = if role == Role::Prefill {
            &pair.spec.prefill
        } else {
            &pair.spec.decode
        };
        let mut kv = pool.kv.clone();
        kv.block_size = block;
        kv.kernel_block_size = Some(block);
        (
            EngineSpec {
                pdpair: format!("{ns}/vllm-push-64-64"),
                role,
                engine: engine.into(),
                mode: pair.spec.transfer.mode,
                checksum: pair.spec.transfer.checksum,
                handshake_timeout_ms: 2000,
                lease_ms: 5000,
                parallelism: pool.parallelism.clone(),
                kv,
                pairing_key: key.clone(),
                num_blocks: 4,
                memory: EngineMemory::Agent,
                arrangement: Default::default(),
                regions: Vec::new(),
                tensor_rank: 0,
            },
            pod.to_owned(),
        )
    };
    let register = |socket: &PathBuf, (spec, pod): (EngineSpec, String)| {
        SyntheticEngine::register_in_pod(socket, &work, &spec, Some(pod)).expect("registers")
    };
    // Decode says why it stages (as the vLLM connector does); prefill says nothing.
    let (d_spec, d_pod) = spec(Role::Decode, "d0", "decode-pod", 64);
    let mut d_reg = SyntheticEngine::registration(&d_spec, Some(d_pod), false);
    d_reg.staging = Some("the KV cache is in cpu memory, not on a GPU\u{1b}[31m".into());
    d_reg.instance = Some("decode-pod-engine-a".into());
    d_reg.pod_engines = Some(1);
    let mut d = SyntheticEngine::register_as(&d_sock, d_reg).expect("registers");
    let mut p = register(&p_sock, spec(Role::Prefill, "p0", "prefill-pod", 64));
    // Both endpoints appear, owned by their Pods, and the pair counts them.
    let endpoint = eventually(WAIT, "the decode PDEndpoint", || {
        get_json("pdendpoint", &ns, &endpoint_name("decode-pod", "d0"))
    });
    let owner = &endpoint["metadata"]["ownerReferences"][0];
    assert_eq!(
        (owner["kind"].as_str(), owner["name"].as_str()),
        (Some("Pod"), Some("decode-pod"))
    );
    assert_eq!(endpoint["spec"]["node"], "node-d");
    assert_eq!(endpoint["spec"]["role"], "decode");
    // Its tensor-parallel rank, so the operator can tell an engine with some ranks unregistered.
    assert_eq!(endpoint["spec"]["tensorRank"], 0, "{endpoint}");
    // And which engine of its Pod it is a rank of.
    assert_eq!(endpoint["spec"]["instance"], "decode-pod-engine-a", "{endpoint}");
    // And how many engines its Pod runs, so the operator can tell a Pod missing one.
    assert_eq!(endpoint["spec"]["podEngines"], 1, "{endpoint}");
    // Where its KV pool is, and why it stages, in its words made printable.
    assert_eq!(endpoint["spec"]["poolMemory"], "Host");
    let staging = endpoint["spec"]["staging"].as_str().expect("staging");
    assert!(
        staging.starts_with("the KV cache is in cpu memory, not on a GPU") && !staging.contains('\u{1b}'),
        "{staging:?}"
    );
    let prefill = eventually(WAIT, "the prefill PDEndpoint", || {
        get_json("pdendpoint", &ns, &endpoint_name("prefill-pod", "p0"))
    });
    assert_eq!(prefill["spec"]["poolMemory"], "Host");
    assert!(prefill["spec"].get("staging").is_none(), "{prefill}");
    eventually(WAIT, "2 endpoints in the pair's status", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        (p["status"]["transfer"]["endpoints"] == 2 && condition(&p, "GeometryCompatible")?.0 == "True").then_some(())
    });
    // A transfer: counted in both endpoints' status and in the pair's totals.
    let event = push_one(&mut p, &mut d, "r1", 1);
    assert!(matches!(event, AgentEvent::RequestDone { .. }), "{event:?}");
    assert_eq!(d.verify(1, &[2, 3], 0, 100), 0);
    let pair_json = eventually(WAIT, "the transfer in the pair's totals", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        (p["status"]["transfer"]["transfersCompleted"] == 2).then_some(p)
    });
    assert!(pair_json["status"]["transfer"]["bytes"].as_i64().is_some_and(|b| b > 0));
    assert_eq!(
        condition(&pair_json, "TransferReady").map(|c| c.0).as_deref(),
        Some("True")
    );
    // The path: prefill's agent moved the bytes, over its tcp stream, and says so; decode's
    // holds no endpoint and reports none.
    let endpoint = eventually(WAIT, "the path in prefill's PDEndpoint", || {
        let e = get_json("pdendpoint", &ns, &endpoint_name("prefill-pod", "p0"))?;
        e["status"]["paths"].get(0).is_some().then_some(e)
    });
    // When its engine registered (an engine registering again in its Pod keeps the endpoint).
    assert!(endpoint["status"]["registered"].is_string(), "{endpoint}");
    let path = &endpoint["status"]["paths"][0];
    assert_eq!(path["kind"], "Tcp", "{endpoint}");
    assert_eq!(path["lanes"], serde_json::json!(["tcp-stream/127.0.0.1"]), "{endpoint}");
    assert_eq!(path["backend"], "TcpStream");
    assert_eq!(path["emulated"], false, "the receiving agent places the bytes");
    assert_eq!(path["peer"], "d0@node-d", "{endpoint}");
    let decode = get_json("pdendpoint", &ns, &endpoint_name("decode-pod", "d0")).expect("decode's endpoint");
    assert!(decode["status"]["paths"].is_null(), "{decode}");
    // Tcp is not what the pair requires: TransferPath False with a Warning Event (no kubelet
    // runs the pods here, so Ready is False for that already).
    let pair_json = eventually(WAIT, "TransferPath=False", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        (condition(&p, "TransferPath")?.0 == "False").then_some(p)
    });
    assert_eq!(
        condition(&pair_json, "TransferPath").map(|c| c.1).as_deref(),
        Some("PathNotAllowed")
    );
    let warning = event_with_reason(WAIT, &ns, "vllm-push-64-64", "PathNotAllowed", Some("Warning"));
    let message = warning["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("requirePath [Rdma, SharedMemory]")
            && message.contains(&format!(
                "{}: Tcp (tcp-stream/127.0.0.1)",
                endpoint_name("prefill-pod", "p0")
            )),
        "{message}"
    );
    // (No kubelet runs here to end a Pod's containers.)
    let force_delete_pod = |pod: &str| {
        kubectl_ok(
            &[
                "delete",
                "pod",
                pod,
                "-n",
                &ns,
                "--wait=false",
                "--grace-period=0",
                "--force",
            ],
            None,
        );
    };
    let patch_pair = |patch: &str| {
        kubectl_ok(
            &[
                "patch",
                "pdpair",
                "vllm-push-64-64",
                "-n",
                &ns,
                "--type=merge",
                "-p",
                patch,
            ],
            None,
        );
    };
    let path_is = |status: &str, reason: &str| {
        eventually(WAIT, &format!("TransferPath={status} {reason}"), || {
            let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
            (condition(&p, "TransferPath")? == (status.to_owned(), reason.to_owned())).then_some(())
        });
    };
    // Allowing Tcp turns it True, its reason the path.
    patch_pair(r#"{"spec":{"transfer":{"requirePath":["Rdma","Tcp"]}}}"#);
    path_is("True", "Tcp");
    // Requiring every engine's KV in GPU memory: these engines' pools are host memory (decode
    // says why it stages), so False, with a Warning naming them; and True again without it.
    patch_pair(r#"{"spec":{"transfer":{"requireDirect":true}}}"#);
    path_is("False", "StagingNotAllowed");
    let warning = event_with_reason(WAIT, &ns, "vllm-push-64-64", "StagingNotAllowed", Some("Warning"));
    let message = warning["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("requireDirect is set, but 2 of 2 engine(s) hand their agent a host pool")
            && message.contains(&endpoint_name("decode-pod", "d0")),
        "{message}"
    );
    patch_pair(r#"{"spec":{"transfer":{"requireDirect":false}}}"#);
    path_is("True", "Tcp");
    // An engine that runs 16-token blocks: its endpoint shows the mismatch in the pair's status...
    let p16 = register(&p_sock, spec(Role::Prefill, "p16", "prefill16-pod", 16));
    let reason = eventually(WAIT, "GeometryCompatible=False", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        let (status, reason) = condition(&p, "GeometryCompatible")?;
        (status == "False").then_some(reason)
    });
    assert_eq!(reason, "ObservedGeometryMismatch");
    // ...and decode's agent rejects it at the handshake, which the pair reports too.
    d.send(&EngineRequest::ExpectKv {
        request: "r2".into(),
        prefill: p16.address.clone(),
        blocks: vec![2],
        num_tokens: 10,
        first_token: 0,
        prompt: None,
        event: None,
    })
    .expect("send");
    let event = d.next_event().expect("event");
    assert!(
        matches!(&event, AgentEvent::RequestFailed { reasons, .. } if reasons == &vec!["KernelBlockSizeMismatch".to_owned()]),
        "{event:?}"
    );
    let endpoint = eventually(WAIT, "the rejection in decode's PDEndpoint", || {
        let e = get_json("pdendpoint", &ns, &endpoint_name("decode-pod", "d0"))?;
        (e["status"]["handshakesRejected"] == 1).then_some(e)
    });
    assert_eq!(
        endpoint["status"]["lastRejection"]["reasons"][0],
        "KernelBlockSizeMismatch"
    );
    assert!(endpoint["status"]["lastHeartbeat"].is_string());
    let pair_json = eventually(WAIT, "TransferReady=False", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        (condition(&p, "TransferReady")?.0 == "False").then_some(p)
    });
    assert_eq!(
        condition(&pair_json, "TransferReady").map(|c| c.1).as_deref(),
        Some("HandshakeRejected")
    );
    // While the 16-token engine is still registered, decode's transfers with the other prefill
    // leave the rejection standing (each one cleared it, and TransferReady flipped with every
    // rejection and transfer after it). A later second than the rejection's:
    std::thread::sleep(Duration::from_millis(1100));
    let completed = |p: &serde_json::Value| p["status"]["transfer"]["transfersCompleted"].as_i64();
    let before = completed(&pair_json).unwrap_or(0);
    let event = push_one(&mut p, &mut d, "r-beside", 5);
    assert!(matches!(event, AgentEvent::RequestDone { .. }), "{event:?}");
    let pair_json = eventually(WAIT, "both sides' transfer in the pair's totals", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        (completed(&p)? >= before + 2).then_some(p)
    });
    let endpoint = get_json("pdendpoint", &ns, &endpoint_name("decode-pod", "d0")).expect("decode's endpoint");
    assert!(
        endpoint["status"]["lastSuccess"].as_str() > endpoint["status"]["lastRejection"]["time"].as_str(),
        "{endpoint}"
    );
    // Both rejections stand: decode's of the 16-token engine, still registered, and that
    // engine's own of decode (it never transferred).
    let message = condition_of(&pair_json, "TransferReady").expect("TransferReady")["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.starts_with("2 endpoint(s) rejected a handshake that still stands"),
        "{message}"
    );
    // Deleting a Pod garbage-collects its endpoint.
    force_delete_pod("prefill16-pod");
    eventually(WAIT, "the endpoint of the deleted Pod to go", || {
        get_json("pdendpoint", &ns, &endpoint_name("prefill16-pod", "p16"))
            .is_none()
            .then_some(())
    });
    drop(p16);
    // Routine engine-side outcomes are counted but are no news about the path: KV that no
    // decode asked for expires on prefill (a failure in its counters, no lastFailure)...
    p.fill(3, &[0], 0, 10);
    p.send(&EngineRequest::KvReady {
        release_token: None,
        request: "nobody-asks".into(),
        blocks: vec![0],
        num_tokens: 10,
        first_token: 0,
        prompt: None,
        event: None,
    })
    .expect("send");
    // (Prefill's earlier events, r1's, are still queued: skip to this request's last.)
    let event = loop {
        let event = p.next_event().expect("event");
        let v = serde_json::to_value(&event).expect("json");
        if v["request"] == "nobody-asks" && v["type"] != "TransferStarted" {
            break event;
        }
    };
    assert!(
        matches!(&event, AgentEvent::RequestFailed { reasons, .. } if reasons == &vec!["LeaseExpired".to_owned()]),
        "{event:?}"
    );
    let endpoint = eventually(WAIT, "the expiry in prefill's PDEndpoint", || {
        let e = get_json("pdendpoint", &ns, &endpoint_name("prefill-pod", "p0"))?;
        (e["status"]["transfersFailed"] == 1).then_some(e)
    });
    assert!(endpoint["status"]["lastFailure"].is_null(), "{endpoint}");
    // ...and a transfer that completes after decode's rejection turns the pair's TransferReady
    // True again (the rejected engine is gone), though the lifetime counters still hold the
    // rejection and the expiry.
    // A PDEndpoint deleted while its engine lives is made again by its agent (with its status).
    let decode_endpoint = endpoint_name("decode-pod", "d0");
    kubectl_ok(&["delete", "pdendpoint", &decode_endpoint, "-n", &ns], None);
    let event = push_one(&mut p, &mut d, "r3", 4);
    assert!(matches!(event, AgentEvent::RequestDone { .. }), "{event:?}");
    eventually(WAIT, "decode's PDEndpoint made again", || {
        let e = get_json("pdendpoint", &ns, &decode_endpoint)?;
        e["status"]["lastSuccess"].is_string().then_some(())
    });
    // (The endpoint made again is folded with its status: it was made before its status came.)
    let pair_json = eventually(WAIT, "TransferReady=True after a later transfer", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        (condition(&p, "TransferReady")?.0 == "True" && p["status"]["transfer"]["handshakesRejected"] == 1).then_some(p)
    });
    assert_eq!(pair_json["status"]["transfer"]["transfersFailed"], 1);
    let endpoint = get_json("pdendpoint", &ns, &endpoint_name("decode-pod", "d0")).expect("decode's endpoint");
    assert!(
        endpoint["status"]["lastSuccess"].as_str() >= endpoint["status"]["lastRejection"]["time"].as_str(),
        "{endpoint}"
    );
    // With pdpair's connector, a Pod Ready for over a minute whose engine never registered (a
    // decode Pod with no engine here; Ready for two minutes by the status a kubelet would write)
    // turns TransferReady False naming it: its KV would never move.
    engine_pod(&ns, "decode2-pod", "vllm-push-64-64", "decode", Some("node-d"));
    let since = k8s_openapi::jiff::Timestamp::from_second(k8s_openapi::jiff::Timestamp::now().as_second() - 120)
        .expect("a time");
    let ready = format!(
        r#"{{"status":{{"phase":"Running","conditions":[{{"type":"Ready","status":"True","lastTransitionTime":"{since}"}}]}}}}"#
    );
    kubectl_ok(
        &[
            "patch",
            "pod",
            "decode2-pod",
            "-n",
            &ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            &ready,
        ],
        None,
    );
    patch_pair(r#"{"spec":{"transfer":{"connector":"Pdpair"}}}"#);
    let message = eventually(WAIT, "TransferReady=False EnginesNotRegistered", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        let c = condition_of(&p, "TransferReady")?;
        (c["status"] == "False" && c["reason"] == "EnginesNotRegistered").then(|| c["message"].to_string())
    });
    assert!(message.contains("decode pod decode2-pod"), "{message}");
    // Gone, it counts no more.
    force_delete_pod("decode2-pod");
    eventually(WAIT, "TransferReady=True without decode2-pod", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        (condition(&p, "TransferReady")?.0 == "True").then_some(())
    });
    // A request that fails with a prefill (its engine gone, its Pod and PDEndpoint still there)
    // names that prefill in decode's lastFailure, and the pair's TransferReady turns False.
    let address = p.address.clone();
    drop(p);
    d.send(&EngineRequest::ExpectKv {
        request: "r4".into(),
        prefill: address.clone(),
        blocks: vec![2, 3],
        num_tokens: 100,
        first_token: 0,
        prompt: Some(pdpair_agent::synthetic::prompt(6, 100)),
        event: None,
    })
    .expect("send");
    let event = d.next_event().expect("event");
    assert!(matches!(event, AgentEvent::RequestFailed { .. }), "{event:?}");
    let endpoint = eventually(WAIT, "the failure in decode's PDEndpoint", || {
        let e = get_json("pdendpoint", &ns, &endpoint_name("decode-pod", "d0"))?;
        e["status"]["lastFailure"].is_object().then_some(e)
    });
    assert_eq!(
        endpoint["status"]["lastFailure"]["peer"],
        address.as_str(),
        "{endpoint}"
    );
    assert!(endpoint["status"]["lastFailure"]["resolved"].is_null(), "{endpoint}");
    eventually(WAIT, "TransferReady=False TransferFailed", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        (condition(&p, "TransferReady")? == ("False".to_owned(), "TransferFailed".to_owned())).then_some(())
    });
    let _ = std::fs::remove_dir_all(&work);
}
