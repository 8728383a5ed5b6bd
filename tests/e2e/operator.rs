//! The operator against a real kube-apiserver: admission, children, status, Events, GC.
//! One operator serves every test here; each test has its own namespace.

use std::{sync::OnceLock, time::Duration};

use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api,
    api::{ListParams, Patch, PatchParams},
};
use pdpair_api::{PDEndpoint, PDPair, Role};
use pdpair_e2e::*;

const WAIT: Duration = Duration::from_secs(60);

/// Applies examples/compatible-push.yaml (the pair `llama-8b`) in `ns`.
fn apply_compatible(ns: &str) {
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&manifest("compatible-push.yaml", ns, |_| {})),
    );
}

/// The condition `type_` of the pair `llama-8b` in `ns`.
fn pair_condition(ns: &str, type_: &str) -> Option<serde_json::Value> {
    condition_of(&get_json("pdpair", ns, "llama-8b")?, type_)
}

/// Annotates the pair `llama-8b` (`touch=n`), which has the operator reconcile it.
fn touch(ns: &str, n: u32) {
    kubectl_ok(
        &[
            "annotate",
            "pdpair",
            "llama-8b",
            "-n",
            ns,
            &format!("touch={n}"),
            "--overwrite",
        ],
        None,
    );
}

fn operator() -> &'static Operator {
    static OP: OnceLock<Operator> = OnceLock::new();
    OP.get_or_init(|| Operator::start("shared"))
}

#[test]
fn push_16_64_is_rejected_by_kubectl_apply_with_an_event_and_nothing_stored() {
    operator();
    let ns = namespace("reject");
    // A dry run is refused the same way and records nothing (the webhook declares
    // sideEffects: NoneOnDryRun).
    let dry = kubectl(
        &["apply", "--dry-run=server", "-f", "-"],
        Some(&manifest("vllm-push-16-64.yaml", &ns, |v| {
            v["metadata"]["name"] = "dry-16-64".into();
        })),
    );
    assert_ne!(dry.code, 0, "a dry run must be refused: {}", dry.stdout);
    assert!(dry.stderr.contains("KernelBlockSizeMismatch"), "{}", dry.stderr);
    let out = kubectl(
        &["apply", "-f", "-"],
        Some(&manifest("vllm-push-16-64.yaml", &ns, |_| {})),
    );
    assert_ne!(out.code, 0, "apply must fail: {}", out.stdout);
    for want in ["KernelBlockSizeMismatch", "spec.decode.kv.kernelBlockSize", "16", "64"] {
        assert!(
            out.stderr.contains(want),
            "kubectl's error lacks {want:?}: {}",
            out.stderr
        );
    }
    let event = event_with_reason(WAIT, &ns, "vllm-push-16-64", "Rejected", None);
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["involvedObject"]["kind"], "PDPair");
    let message = event["message"].as_str().unwrap_or("");
    assert!(
        message.contains("KernelBlockSizeMismatch") && message.contains("16") && message.contains("64"),
        "{message}"
    );
    assert!(
        get_json("pdpair", &ns, "vllm-push-16-64").is_none(),
        "a rejected PDPair must not be stored"
    );
    // The dry run came first; its Event, had one been recorded, would be there by now.
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert_eq!(
        events_about(&ns, "dry-16-64"),
        Vec::<serde_json::Value>::new(),
        "a dry run records no Event"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compatible_pair_gets_children_and_turns_ready_when_pods_are_ready() {
    operator();
    let ns = namespace("ready");
    apply_compatible(&ns);
    let pair = get_json("pdpair", &ns, "llama-8b").expect("stored");
    let uid = pair["metadata"]["uid"].as_str().expect("uid").to_owned();
    for (role, replicas) in [("prefill", 2), ("decode", 4)] {
        let name = format!("llama-8b-{role}");
        let d = eventually(WAIT, &format!("Deployment {name}"), || {
            get_json("deployment", &ns, &name)
        });
        let owner = &d["metadata"]["ownerReferences"][0];
        assert_eq!(
            (owner["kind"].as_str(), owner["uid"].as_str()),
            (Some("PDPair"), Some(uid.as_str()))
        );
        assert_eq!(owner["controller"], true);
        assert_eq!(d["metadata"]["labels"]["pdpair.dev/name"], "llama-8b");
        assert_eq!(d["metadata"]["labels"]["pdpair.dev/role"], role);
        assert_eq!(d["spec"]["replicas"], replicas);
        let tmpl = &d["spec"]["template"];
        assert_eq!(tmpl["metadata"]["labels"]["pdpair.dev/role"], role);
        assert!(tmpl["metadata"]["annotations"]["pdpair.dev/geometry-hash"].is_string());
        let c = &tmpl["spec"]["containers"][0];
        let env = c["env"].as_array().expect("env");
        let has = |k: &str, v: &str| env.iter().any(|e| e["name"] == k && e["value"] == v);
        assert!(has("PDPAIR_NAME", "llama-8b") && has("PDPAIR_NAMESPACE", &ns) && has("PDPAIR_ROLE", role));
        assert!(has("PDPAIR_AGENT_SOCKET", "/var/run/pdpair/agent.sock"));
        assert!(has("PDPAIR_PAIRING_KEY_FILE", "/var/run/pdpair-pairing/key"));
        let mounts = c["volumeMounts"].as_array().expect("mounts");
        assert!(mounts.iter().any(|m| m["mountPath"] == "/var/run/pdpair"));
        let volumes = tmpl["spec"]["volumes"].as_array().expect("volumes");
        assert!(volumes.iter().any(|v| v["hostPath"]["path"] == "/var/run/pdpair"));
        let secret = format!("llama-8b-pairing-{uid}");
        assert!(volumes.iter().any(|v| v["secret"]["secretName"] == secret.as_str()));
    }
    let secret = eventually(WAIT, "the pairing Secret", || pairing_secret(&ns, "llama-8b"));
    assert_eq!(secret["metadata"]["ownerReferences"][0]["uid"], uid.as_str());
    let key = secret["data"]["key"].as_str().expect("key");
    assert_eq!(key.len(), 44, "32 bytes in base64");
    // Conditions start False/Unknown.
    let pair = eventually(WAIT, "initial conditions", || {
        let p = get_json("pdpair", &ns, "llama-8b")?;
        condition(&p, "Ready").map(|_| p)
    });
    assert_eq!(
        condition(&pair, "GeometryCompatible").map(|c| c.0).as_deref(),
        Some("True")
    );
    assert_eq!(condition(&pair, "PrefillReady").map(|c| c.0).as_deref(), Some("False"));
    assert_eq!(condition(&pair, "DecodeReady").map(|c| c.0).as_deref(), Some("False"));
    assert_eq!(
        condition(&pair, "TransferReady").map(|c| c.0).as_deref(),
        Some("Unknown")
    );
    assert_eq!(condition(&pair, "Ready").map(|c| c.0).as_deref(), Some("False"));

    // No kubelet runs here: the test marks the ReplicaSets' pods Ready, as a kubelet would.
    let pods: Api<Pod> = Api::namespaced(client().await, &ns);
    let listed = eventually(WAIT, "6 engine pods", || {
        let out = kubectl_ok(
            &["get", "pods", "-n", &ns, "-l", "pdpair.dev/name=llama-8b", "-o", "name"],
            None,
        );
        let names: Vec<String> = out.lines().map(|l| l.trim_start_matches("pod/").to_owned()).collect();
        (names.len() == 6).then_some(names)
    });
    let ready =
        serde_json::json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
    for name in &listed {
        pods.patch_status(name, &PatchParams::default(), &Patch::Strategic(&ready))
            .await
            .expect("mark pod Ready");
    }
    let pair = eventually(WAIT, "Ready=True", || {
        let p = get_json("pdpair", &ns, "llama-8b")?;
        (condition(&p, "Ready")?.0 == "True").then_some(p)
    });
    assert_eq!(pair["status"]["prefill"]["readyReplicas"], 2);
    assert_eq!(pair["status"]["decode"]["readyReplicas"], 4);
    assert_eq!(pair["status"]["observedGeneration"], pair["metadata"]["generation"]);
    // One Event per transition.
    std::thread::sleep(Duration::from_secs(2));
    let events = events_about(&ns, "llama-8b");
    for condition in ["PrefillReady", "DecodeReady", "Ready"] {
        let n = events
            .iter()
            .filter(|e| {
                e["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with(&format!("{condition} False -> True")))
            })
            .count();
        assert_eq!(n, 1, "{condition}: {events:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_of_an_earlier_geometry_do_not_keep_a_rolling_pool_ready() {
    // A geometry changed on a running pair rolls each pool's Deployment; the old pods stay Ready
    // until new ones are (a rolling update keeps them), and counted, the pair read Ready with
    // pools on the old geometry (one pool rolled, the other not: the mismatch pdpair prevents).
    operator();
    let ns = namespace("rolling");
    apply_compatible(&ns);
    let pods: Api<Pod> = Api::namespaced(client().await, &ns);
    let ready =
        serde_json::json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
    // No kubelet here: the test marks the pods Ready, as a kubelet would.
    let mark_ready = |names: Vec<String>| {
        let pods = pods.clone();
        let ready = ready.clone();
        async move {
            for name in &names {
                let _ = pods
                    .patch_status(name, &PatchParams::default(), &Patch::Strategic(&ready))
                    .await;
            }
        }
    };
    let running = |ns: &str| -> Vec<(String, Option<String>)> {
        let out = kubectl_ok(
            &["get", "pods", "-n", ns, "-l", "pdpair.dev/name=llama-8b", "-o", "json"],
            None,
        );
        let list: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
            .map(|p| {
                let name = p["metadata"]["name"].as_str().unwrap_or_default().to_owned();
                let hash = p["metadata"]["annotations"]["pdpair.dev/geometry-hash"]
                    .as_str()
                    .map(str::to_owned);
                (name, hash)
            })
            .collect()
    };
    let first = eventually(WAIT, "6 engine pods", || {
        let pods = running(&ns);
        (pods.len() == 6).then_some(pods)
    });
    mark_ready(first.iter().map(|p| p.0.clone()).collect()).await;
    eventually(WAIT, "Ready True", || {
        pair_condition(&ns, "Ready").filter(|c| c["status"] == "True")
    });
    // Another geometry for both pools (the checksum policy is part of it).
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&manifest("compatible-push.yaml", &ns, |v| {
            v["spec"]["transfer"]["checksum"] = "FailOpen".into();
        })),
    );
    let prefill = eventually(WAIT, "PrefillReady False while the pool rolls", || {
        pair_condition(&ns, "PrefillReady").filter(|c| c["status"] == "False")
    });
    let message = prefill["message"].as_str().unwrap_or_default();
    assert!(message.contains("of an earlier geometry"), "{prefill}");
    let ready_now = pair_condition(&ns, "Ready").expect("Ready");
    assert_eq!(ready_now["status"], "False", "{ready_now}");
    // The new pods come Ready (and the rollout replaces the old ones): Ready again.
    let old: Vec<Option<String>> = first.iter().map(|p| p.1.clone()).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while pair_condition(&ns, "Ready").is_none_or(|c| c["status"] != "True") {
        assert!(
            std::time::Instant::now() < deadline,
            "Ready True on the new geometry: {:?}",
            running(&ns)
        );
        let fresh = running(&ns)
            .into_iter()
            .filter(|p| !old.contains(&p.1))
            .map(|p| p.0)
            .collect();
        mark_ready(fresh).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[test]
fn a_pools_rollout_is_its_deployments_strategy_and_both_counts_zero_are_refused() {
    operator();
    let ns = namespace("rollout");
    let with = |rollout: Option<(i32, i32)>| {
        manifest("compatible-push.yaml", &ns, |v| {
            if let Some((surge, unavailable)) = rollout {
                v["spec"]["decode"]["rollout"]["maxSurge"] = surge.into();
                v["spec"]["decode"]["rollout"]["maxUnavailable"] = unavailable.into();
            }
        })
    };
    // Both 0: no pod could be replaced; refused at admission, naming the field.
    let out = kubectl(&["apply", "-f", "-"], Some(&with(Some((0, 0)))));
    assert_ne!(out.code, 0);
    assert!(
        out.stderr.contains("InvalidRollout") && out.stderr.contains("spec.decode.rollout.maxUnavailable"),
        "{}",
        out.stderr
    );
    // Negative replicas: the CRD's schema refuses them before the webhook (which refuses them
    // too, InvalidReplicas, as admission's alone: one stored from before the schema bounded
    // them leaves both pools running, the Deployment's refusal in PoolsApplied).
    let out = kubectl(
        &["apply", "-f", "-"],
        Some(&manifest("compatible-push.yaml", &ns, |v| {
            v["spec"]["decode"]["replicas"] = (-1).into();
        })),
    );
    assert_ne!(out.code, 0);
    assert!(
        out.stderr.contains("spec.decode.replicas") && out.stderr.contains("greater than or equal to 0"),
        "{}",
        out.stderr
    );
    // One pod at a time, none above replicas (nodes with no GPU to spare).
    kubectl_ok(&["apply", "-f", "-"], Some(&with(Some((0, 1)))));
    let rolling = |role: &str| {
        get_json("deployment", &ns, &format!("llama-8b-{role}")).map(|d| d["spec"]["strategy"]["rollingUpdate"].clone())
    };
    let decode = eventually(WAIT, "decode's strategy", || {
        rolling("decode").filter(|r| r["maxSurge"] == 0)
    });
    assert_eq!(decode["maxUnavailable"], 1, "{decode}");
    let prefill = eventually(WAIT, "prefill's Deployment", || rolling("prefill"));
    assert_eq!(prefill["maxSurge"], "25%", "Kubernetes' default: {prefill}");
    // Left out again: the operator gives the field up, and Kubernetes' default is back.
    kubectl_ok(&["apply", "-f", "-"], Some(&with(None)));
    eventually(WAIT, "decode's default strategy", || {
        rolling("decode").filter(|r| r["maxSurge"] == "25%" && r["maxUnavailable"] == "25%")
    });
}

#[test]
fn update_to_incompatible_geometry_is_rejected_and_the_stored_object_is_unchanged() {
    operator();
    let ns = namespace("update");
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&manifest("vllm-push-64-64.yaml", &ns, |_| {})),
    );
    let before = get_json("pdpair", &ns, "vllm-push-64-64").expect("stored");
    let bad = manifest("vllm-push-64-64.yaml", &ns, |v| {
        v["spec"]["decode"]["kv"]["blockSize"] = 16.into();
        v["spec"]["decode"]["kv"]["kernelBlockSize"] = 16.into();
    });
    let out = kubectl(&["apply", "-f", "-"], Some(&bad));
    assert_ne!(out.code, 0);
    assert!(out.stderr.contains("KernelBlockSizeMismatch"), "{}", out.stderr);
    let after = get_json("pdpair", &ns, "vllm-push-64-64").expect("still stored");
    assert_eq!(after["spec"], before["spec"]);
    assert_eq!(after["metadata"]["generation"], before["metadata"]["generation"]);
}

#[test]
fn deleting_the_pair_garbage_collects_its_children() {
    operator();
    let ns = namespace("gc");
    apply_compatible(&ns);
    both_deployments(&ns);
    let secret = eventually(WAIT, "the Secret", || pairing_secret(&ns, "llama-8b"));
    let secret = format!("secret/{}", secret["metadata"]["name"].as_str().expect("name"));
    kubectl_ok(&["delete", "pdpair", "llama-8b", "-n", &ns, "--wait=false"], None);
    // The garbage collector rediscovers resource types every 30 s, so right after the CRD is
    // installed it may need that long to see PDPairs at all.
    eventually(Duration::from_secs(120), "garbage collection", || {
        let left = [
            "deployment/llama-8b-prefill",
            "deployment/llama-8b-decode",
            secret.as_str(),
        ]
        .iter()
        .filter(|r| {
            let (kind, name) = r.split_once('/').unwrap_or(("", ""));
            get_json(kind, &ns, name).is_some()
        })
        .count();
        (left == 0).then_some(())
    });
}

#[test]
fn a_pair_made_again_under_its_name_gets_its_own_secret_while_the_old_one_stays() {
    // The Secret was named after the pair alone. A pair made again under its name found its
    // predecessor's (409): for a moment after `kubectl delete` (until the garbage collector
    // deleted it), and for good after `kubectl delete --cascade=orphan`, which leaves it with
    // no owner. Its engines then waited for a Secret holding their pair's uid, restarted, and
    // waited again, without end. Its name now holds the pair's uid.
    operator();
    let ns = namespace("remade");
    apply_compatible(&ns);
    both_deployments(&ns);
    let uid_of = |v: &serde_json::Value| v["metadata"]["uid"].as_str().map(str::to_owned);
    let old = eventually(WAIT, "the pair's uid", || uid_of(&get_json("pdpair", &ns, "llama-8b")?));
    // The Secret a pool's pods mount, as its Deployment names it, once it exists.
    let mounted = |role: &str| {
        let d = get_json("deployment", &ns, &format!("llama-8b-{role}"))?;
        let volumes = d["spec"]["template"]["spec"]["volumes"].as_array()?.clone();
        let name = volumes.iter().find(|v| v["name"] == "pdpair-pairing")?["secret"]["secretName"]
            .as_str()?
            .to_owned();
        get_json("secret", &ns, &name)
    };
    let old_secret = eventually(WAIT, "the Secret", || mounted("decode"));
    let old_name = old_secret["metadata"]["name"].as_str().expect("name").to_owned();
    kubectl_ok(
        &[
            "delete",
            "pdpair",
            "llama-8b",
            "-n",
            &ns,
            "--cascade=orphan",
            "--wait=false",
        ],
        None,
    );
    eventually(Duration::from_secs(120), "the pair gone, its children orphaned", || {
        let gone = get_json("pdpair", &ns, "llama-8b").is_none();
        let s = get_json("secret", &ns, &old_name)?;
        (gone && s["metadata"]["ownerReferences"].as_array().is_none_or(|o| o.is_empty())).then_some(())
    });
    // The orphaned Deployments are not taken over (the PDPair's status says to remove them).
    for role in ["prefill", "decode"] {
        kubectl_ok(&["delete", "deployment", &format!("llama-8b-{role}"), "-n", &ns], None);
    }
    apply_compatible(&ns);
    let new = eventually(WAIT, "the new pair's uid", || {
        uid_of(&get_json("pdpair", &ns, "llama-8b")?)
    });
    assert_ne!(old, new, "made again");
    // Both pools' pods mount a Secret of the new pair's, holding its uid and a new key, and are
    // told that uid.
    for role in ["prefill", "decode"] {
        let secret = eventually(Duration::from_secs(90), "the new pair's Secret, mounted", || {
            mounted(role).filter(|s| s["metadata"]["ownerReferences"][0]["uid"] == new.as_str())
        });
        let said = base64_decode(secret["data"]["pdpair-uid"].as_str().expect("pdpair-uid"));
        assert_eq!(String::from_utf8_lossy(&said), new.as_str());
        assert_ne!(secret["data"]["key"], old_secret["data"]["key"], "a new key");
        let d = get_json("deployment", &ns, &format!("llama-8b-{role}")).expect("Deployment");
        let env = d["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_array()
            .expect("env")
            .clone();
        assert!(
            env.iter()
                .any(|e| e["name"] == "PDPAIR_UID" && e["value"] == new.as_str())
        );
    }
    // The orphan is left as it was.
    assert_eq!(
        get_json("secret", &ns, &old_name).expect("the orphan stays")["data"],
        old_secret["data"]
    );
}

#[test]
fn a_removed_template_prunes_its_deployment_and_only_ours() {
    operator();
    let ns = namespace("prune");
    apply_compatible(&ns);
    both_deployments(&ns);
    // Decode becomes a bring-your-own pool: its Deployment goes (with an Event), prefill's stays.
    remove_pool_template(&ns, "llama-8b", "decode");
    eventually(WAIT, "the decode Deployment pruned", || {
        get_json("deployment", &ns, "llama-8b-decode").is_none().then_some(())
    });
    let event = event_with_reason(WAIT, &ns, "llama-8b", "Pruned", None);
    assert!(
        event["note"]
            .as_str()
            .or(event["message"].as_str())
            .is_some_and(|m| m.contains("spec.decode.template was removed")),
        "{event}"
    );
    assert!(
        get_json("deployment", &ns, "llama-8b-prefill").is_some(),
        "prefill keeps its Deployment"
    );
    // A Deployment of that name the user made (not owned by the pair) is never touched.
    kubectl_ok(
        &["create", "deployment", "llama-8b-decode", "--image=byo:1", "-n", &ns],
        None,
    );
    touch(&ns, 1);
    eventually(WAIT, "a reconcile after the annotation", || {
        let p = get_json("pdpair", &ns, "llama-8b")?;
        (p["status"]["observedGeneration"].is_number()).then_some(())
    });
    std::thread::sleep(Duration::from_secs(2));
    let byo = get_json("deployment", &ns, "llama-8b-decode").expect("the user's Deployment stays");
    assert!(byo["metadata"]["ownerReferences"].is_null(), "{byo}");
}

#[test]
fn a_pool_the_api_server_refuses_leaves_both_pools_as_they_were_and_says_why() {
    // The webhook checks geometry, not every field of a pod template: an edit that changes both
    // pools and gives decode a field the API server refuses must not roll prefill alone (one
    // pool on the new spec beside the other on the old: the mismatch pdpair exists to prevent),
    // and status must say why instead of keeping the old Ready.
    operator();
    let ns = namespace("refused");
    apply_compatible(&ns);
    both_deployments(&ns);
    let image = |role: &str| {
        get_json("deployment", &ns, &format!("llama-8b-{role}")).map(|d| {
            d["spec"]["template"]["spec"]["containers"][0]["image"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
    };
    assert_eq!(image("prefill").as_deref(), Some("vllm/vllm-openai:v0.11.0"));
    let edit = |port: i64| {
        manifest("compatible-push.yaml", &ns, |v| {
            for pool in ["prefill", "decode"] {
                v["spec"][pool]["template"]["spec"]["containers"][0]["image"] = "vllm/vllm-openai:v0.12.0".into();
            }
            v["spec"]["decode"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = port.into();
        })
    };
    kubectl_ok(&["apply", "-f", "-"], Some(&edit(70000)));
    let applied = eventually(WAIT, "PoolsApplied False", || {
        pair_condition(&ns, "PoolsApplied").filter(|c| c["status"] == "False")
    });
    assert_eq!(applied["reason"], "ApplyFailed", "{applied}");
    let message = applied["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("llama-8b-decode") && message.contains("70000"),
        "{message}"
    );
    let ready = pair_condition(&ns, "Ready").expect("Ready");
    assert_eq!(
        (&ready["status"], &ready["reason"]),
        (&"False".into(), &"ApplyFailed".into()),
        "{ready}"
    );
    event_with_reason(WAIT, &ns, "llama-8b", "ApplyFailed", Some("Warning"));
    assert_eq!(
        image("prefill").as_deref(),
        Some("vllm/vllm-openai:v0.11.0"),
        "prefill was not rolled alone"
    );
    // Put right, both roll.
    kubectl_ok(&["apply", "-f", "-"], Some(&edit(8000)));
    eventually(WAIT, "PoolsApplied True", || {
        pair_condition(&ns, "PoolsApplied").filter(|c| c["status"] == "True")
    });
    for role in ["prefill", "decode"] {
        assert_eq!(image(role).as_deref(), Some("vllm/vllm-openai:v0.12.0"), "{role}");
    }
}

#[test]
fn a_deployment_of_the_name_someone_else_made_is_not_taken_over() {
    // A force-apply merged the pair's template into another's Deployment of that name (and a
    // template removed later pruned it). Now neither pool is applied, status says why, and once
    // that Deployment goes the pair's pools are made.
    operator();
    let ns = namespace("takeover");
    // Labelled as a bring-your-own pool is (docs/install.md), so its selector is the one the
    // operator's would have: an apply of the operator's Deployment onto it goes through.
    let byo = format!(
        r#"{{"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {{"name": "llama-8b-decode", "namespace": "{ns}"}},
            "spec": {{"replicas": 0,
              "selector": {{"matchLabels": {{"pdpair.dev/name": "llama-8b", "pdpair.dev/role": "decode"}}}},
              "template": {{"metadata": {{"labels": {{"pdpair.dev/name": "llama-8b", "pdpair.dev/role": "decode"}}}},
                "spec": {{"containers": [{{"name": "vllm", "image": "byo:1"}}]}}}}}}}}"#
    );
    kubectl_ok(&["apply", "-f", "-"], Some(&byo));
    apply_compatible(&ns);
    let applied = eventually(WAIT, "PoolsApplied False", || {
        condition_of(&get_json("pdpair", &ns, "llama-8b")?, "PoolsApplied").filter(|c| c["status"] == "False")
    });
    let message = applied["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("Deployment llama-8b-decode exists and is not this PDPair's"),
        "{message}"
    );
    let byo = get_json("deployment", &ns, "llama-8b-decode").expect("theirs stays");
    assert!(byo["metadata"]["ownerReferences"].is_null(), "{byo}");
    assert_eq!(byo["spec"]["template"]["spec"]["containers"][0]["image"], "byo:1");
    assert!(
        get_json("deployment", &ns, "llama-8b-prefill").is_none(),
        "neither pool"
    );
    // Theirs goes: the pair's pools are made (at the next reconcile; a touch brings it now).
    kubectl_ok(&["delete", "deployment", "llama-8b-decode", "-n", &ns], None);
    touch(&ns, 1);
    both_deployments(&ns);
    let ours = get_json("deployment", &ns, "llama-8b-decode").expect("ours");
    assert_eq!(ours["metadata"]["ownerReferences"][0]["kind"], "PDPair", "{ours}");
}

#[test]
fn what_a_quota_forbids_is_told_in_events_and_status_and_made_once_it_is_lifted() {
    // A Deployment or Secret the API server forbids (403: a ResourceQuota here; a policy
    // webhook or a namespace being deleted answer the same) is not a passing error to back off
    // from in silence: the pair's status and Events say what was refused, and once the quota is
    // lifted the pools are made.
    operator();
    let ns = namespace("quota");
    let quota = format!(
        r#"{{"apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {{"name": "none", "namespace": "{ns}"}},
            "spec": {{"hard": {{"count/deployments.apps": "0", "secrets": "0"}}}}}}"#
    );
    kubectl_ok(&["apply", "-f", "-"], Some(&quota));
    // Counted by the quota controller first (until then the API server refuses for that).
    eventually(WAIT, "the quota counted", || {
        get_json("resourcequota", &ns, "none")?["status"]["used"]
            .is_object()
            .then_some(())
    });
    apply_compatible(&ns);
    let refused = event_with_reason(WAIT, &ns, "llama-8b", "SecretRefused", Some("Warning"));
    let message = refused["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("llama-8b-pairing") && message.contains("exceeded quota"),
        "{refused}"
    );
    // Told once, not at every reconcile (each PDEndpoint heartbeat reconciles the pair; a full
    // quota refuses the create of a Secret that exists, too).
    for n in 1..=4 {
        touch(&ns, n);
        std::thread::sleep(Duration::from_millis(500));
    }
    let told = events_about(&ns, "llama-8b")
        .into_iter()
        .filter(|e| e["reason"] == "SecretRefused")
        .count();
    assert_eq!(told, 1, "{:#?}", events_about(&ns, "llama-8b"));
    let applied = eventually(WAIT, "PoolsApplied False", || {
        pair_condition(&ns, "PoolsApplied").filter(|c| c["status"] == "False")
    });
    let message = applied["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("Deployment llama-8b-") && message.contains("exceeded quota"),
        "{applied}"
    );
    let ready = pair_condition(&ns, "Ready").expect("Ready");
    assert_eq!(
        (&ready["status"], &ready["reason"]),
        (&"False".into(), &"ApplyFailed".into()),
        "{ready}"
    );
    assert!(get_json("deployment", &ns, "llama-8b-prefill").is_none());
    // Secrets allowed: the Secret comes at its next try (every 30 s while refused, whatever
    // reconciled the pair since), with nothing changed in the PDPair.
    let deployments_only = quota.replace(r#", "secrets": "0""#, "");
    assert_ne!(deployments_only, quota);
    kubectl_ok(&["apply", "-f", "-"], Some(&deployments_only));
    eventually(Duration::from_secs(90), "the pairing Secret", || {
        pairing_secret(&ns, "llama-8b")
    });
    assert!(get_json("deployment", &ns, "llama-8b-prefill").is_none());
    // Lifted: the pools come at their next try (every 30 s while refused; the resync is 5
    // minutes), with nothing changed in the PDPair.
    kubectl_ok(&["delete", "resourcequota", "none", "-n", &ns], None);
    eventually(Duration::from_secs(90), "both Deployments", || {
        (get_json("deployment", &ns, "llama-8b-prefill").is_some()
            && get_json("deployment", &ns, "llama-8b-decode").is_some())
        .then_some(())
    });
    eventually(WAIT, "PoolsApplied True", || {
        pair_condition(&ns, "PoolsApplied").filter(|c| c["status"] == "True")
    });
    eventually(WAIT, "the pairing Secret", || pairing_secret(&ns, "llama-8b"));
}

#[test]
fn a_deployment_that_stopped_being_the_pairs_is_not_taken_back() {
    // The check for another's Deployment ran only when the plan changed: with the plan the same,
    // a Deployment of the pair's whose controller reference someone removed (or another's made
    // under the name after ours went) was force-applied, our template merged into it.
    operator();
    let ns = namespace("orphaned");
    apply_compatible(&ns);
    both_deployments(&ns);
    eventually(WAIT, "PoolsApplied True", || {
        pair_condition(&ns, "PoolsApplied").filter(|c| c["status"] == "True")
    });
    let orphan = r#"[{"op": "remove", "path": "/metadata/ownerReferences"}]"#;
    kubectl_ok(
        &[
            "patch",
            "deployment",
            "llama-8b-decode",
            "-n",
            &ns,
            "--type",
            "json",
            "-p",
            orphan,
        ],
        None,
    );
    touch(&ns, 1);
    let applied = eventually(WAIT, "PoolsApplied False", || {
        pair_condition(&ns, "PoolsApplied").filter(|c| c["status"] == "False")
    });
    let message = applied["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("Deployment llama-8b-decode exists and is not this PDPair's"),
        "{message}"
    );
    let theirs = get_json("deployment", &ns, "llama-8b-decode").expect("stays");
    assert!(theirs["metadata"]["ownerReferences"].is_null(), "{theirs}");
}

/// Waits for the compatible pair's two Deployments.
fn both_deployments(ns: &str) {
    eventually(WAIT, "both Deployments", || {
        (get_json("deployment", ns, "llama-8b-prefill").is_some()
            && get_json("deployment", ns, "llama-8b-decode").is_some())
        .then_some(())
    });
}

/// The pair of examples/vllm-push-64-64.yaml applied in a namespace of its own for `test` (the
/// operator running), and it as stored: (namespace, client, its namespace's PDPairs, the pair).
async fn push_64_64_in(test: &str) -> (String, kube::Client, Api<PDPair>, PDPair) {
    operator();
    let ns = namespace(test);
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&manifest("vllm-push-64-64.yaml", &ns, |_| {})),
    );
    let client = client().await;
    let pairs: Api<PDPair> = Api::namespaced(client.clone(), &ns);
    let pair = pairs.get("vllm-push-64-64").await.expect("stored");
    (ns, client, pairs, pair)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_with_another_geometry_turns_compatible_false_and_back() {
    let (ns, client, _, pair) = push_64_64_in("observed").await;
    eventually(WAIT, "GeometryCompatible=True", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        (condition(&p, "GeometryCompatible")?.0 == "True").then_some(())
    });
    // What a node agent would publish: a decode engine really running 16-token kernel blocks.
    let endpoints: Api<PDEndpoint> = Api::namespaced(client.clone(), &ns);
    let mut wrong = endpoint(&ns, "decode-0", Role::Decode, &pair);
    wrong.spec.kv.block_size = 16;
    wrong.spec.kv.kernel_block_size = Some(16);
    create_endpoint(&client, wrong).await;
    let reason = eventually(WAIT, "GeometryCompatible=False", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        let (status, reason) = condition(&p, "GeometryCompatible")?;
        (status == "False").then_some(reason)
    });
    assert_eq!(reason, "ObservedGeometryMismatch");
    let warning = event_with_reason(
        WAIT,
        &ns,
        "vllm-push-64-64",
        "ObservedGeometryMismatch",
        Some("Warning"),
    );
    assert!(
        warning["message"]
            .as_str()
            .is_some_and(|m| m.contains("kv.kernelBlockSize declared 64, observed 16")),
        "{warning}"
    );
    // The engine is fixed.
    let fixed = endpoint(&ns, "decode-0", Role::Decode, &pair);
    let patch = serde_json::json!({"spec": fixed.spec});
    endpoints
        .patch("decode-0", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("patch PDEndpoint");
    eventually(WAIT, "GeometryCompatible=True again", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        (condition(&p, "GeometryCompatible")?.0 == "True").then_some(())
    });
    // A PDEndpoint that does not speak for a pod of the pair where it says (one node agent's
    // credentials may write PDEndpoints anywhere): here the real stand-in pod, owned by its
    // uid, but on another node. Not folded: the pair stays compatible.
    let stored = endpoints.get("decode-0").await.expect("decode-0");
    let mut forged = endpoint(&ns, "decode-forged", Role::Decode, &pair);
    forged.spec.pod = stored.spec.pod.clone();
    forged.spec.node = "node-b".into();
    forged.spec.kv.block_size = 16;
    forged.spec.kv.kernel_block_size = Some(16);
    forged.metadata.owner_references = stored.metadata.owner_references.clone();
    endpoints
        .create(&kube::api::PostParams::default(), &forged)
        .await
        .expect("create the forged PDEndpoint");
    // Then news of decode-0, which the operator reconciles after the forged endpoint: once the
    // pair shows it, the forged one was looked at too.
    let counters = serde_json::json!({"status": {"transfersCompleted": 1, "bytes": 1234}});
    endpoints
        .patch_status("decode-0", &PatchParams::default(), &Patch::Merge(&counters))
        .await
        .expect("patch PDEndpoint status");
    let p = eventually(WAIT, "decode-0's news in the pair", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        (p["status"]["transfer"]["bytes"] == 1234).then_some(p)
    });
    assert_eq!(condition(&p, "GeometryCompatible").expect("condition").0, "True", "{p}");
    assert_eq!(p["status"]["transfer"]["endpoints"], 1, "{p}");
    // And an agent's rejected handshake turns TransferReady False, with totals in status.
    // (A recent one, after the endpoint's last completed transfer: older news does not count.)
    // An earlier one of another peer than the last's, which a transfer resolved, stands too.
    let now = k8s_openapi::jiff::Timestamp::now();
    let status = serde_json::json!({"status": {
        "handshakesRejected": 2, "transfersCompleted": 3, "bytes": 4096,
        "lastSuccess": (now - k8s_openapi::jiff::SignedDuration::from_secs(60)).to_string(),
        "lastRejection": {"time": now.to_string(), "peer": "127.0.0.1:7002", "reasons": ["Unauthenticated"],
            "message": "bad proof", "resolved": now.to_string()},
        "earlierRejections": [{"time": now.to_string(), "peer": "127.0.0.1:7001", "reasons": ["Unauthenticated"], "message": "bad proof"}]
    }});
    endpoints
        .patch_status("decode-0", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("patch status");
    let pair = eventually(WAIT, "TransferReady=False", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        (condition(&p, "TransferReady")?.0 == "False").then_some(p)
    });
    assert_eq!(
        condition(&pair, "TransferReady").map(|c| c.1).as_deref(),
        Some("HandshakeRejected")
    );
    assert_eq!(pair["status"]["transfer"]["bytes"], 4096);
    assert_eq!(pair["status"]["transfer"]["endpoints"], 1);
    let list = endpoints.list(&ListParams::default()).await.expect("list");
    assert_eq!(
        list.items.len(),
        2,
        "decode-0, and the forged one (stored, not counted)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_missing_a_whole_engine_turns_transfer_ready_false_naming_the_count() {
    // Decode runs an MoE model's two data-parallel ranks in one Pod, each an engine of its own
    // (spec.instance), each saying the Pod runs 2 (spec.podEngines): dp1 never registered.
    operator();
    let ns = namespace("engines");
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&manifest("vllm-push-64-64.yaml", &ns, |v| {
            v["spec"]["decode"]["parallelism"]["data"] = 2.into();
        })),
    );
    let client = client().await;
    let pair = Api::<PDPair>::namespaced(client.clone(), &ns)
        .get("vllm-push-64-64")
        .await
        .expect("stored");
    let endpoints: Api<PDEndpoint> = Api::namespaced(client.clone(), &ns);
    // What a node agent publishes: registered two minutes ago (past the minute's grace), heard now.
    let publish = |mut e: PDEndpoint| {
        let (client, endpoints) = (client.clone(), endpoints.clone());
        async move {
            let name = e.metadata.name.clone().expect("a name");
            e.spec.tensor_rank = Some(0);
            create_endpoint(&client, e).await;
            let now = k8s_openapi::jiff::Timestamp::now();
            let status = serde_json::json!({"status": {
                "registered": (now - k8s_openapi::jiff::SignedDuration::from_secs(120)).to_string(),
                "lastHeartbeat": now.to_string(),
            }});
            endpoints
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                .await
                .expect("patch status");
        }
    };
    publish(endpoint(&ns, "prefill-0", Role::Prefill, &pair)).await;
    let engine = |name: &str, instance: &str| {
        let mut e = endpoint(&ns, name, Role::Decode, &pair);
        e.spec.pod = "decode-a".into();
        e.spec.instance = Some(instance.into());
        e.spec.pod_engines = Some(2);
        e
    };
    publish(engine("decode-dp0", "decode-a-e_dp0")).await;
    let message = eventually(WAIT, "TransferReady=False naming the Pod short", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        let c = p["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "TransferReady")?
            .clone();
        (c["status"] == "False").then_some(c)
    });
    assert_eq!(message["reason"], "EnginesNotRegistered", "{message}");
    assert!(
        message["message"]
            .as_str()
            .is_some_and(|m| m.contains("decode pod decode-a (1 of 2 engines registered)")),
        "{message}"
    );
    // dp1 registers: the Pod is whole.
    publish(engine("decode-dp1", "decode-a-e_dp1")).await;
    eventually(WAIT, "TransferReady=True", || {
        let p = get_json("pdpair", &ns, "vllm-push-64-64")?;
        (condition(&p, "TransferReady")?.0 == "True").then_some(())
    });
}

/// An AdmissionReview of creating `example` as `name` in `ns`, as the API server sends it.
fn review_of(example: &str, ns: &str, name: &str) -> String {
    let object: serde_json::Value = serde_yaml::from_str(&manifest(example, ns, |v| {
        v["metadata"]["name"] = name.into();
    }))
    .expect("manifest");
    serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": format!("review-{name}"),
            "kind": {"group": "pdpair.dev", "version": "v1alpha1", "kind": "PDPair"},
            "resource": {"group": "pdpair.dev", "version": "v1alpha1", "resource": "pdpairs"},
            "name": name,
            "namespace": ns,
            "operation": "CREATE",
            "userInfo": {"username": "someone"},
            "object": object,
            "dryRun": false,
        }
    })
    .to_string()
}

#[test]
fn a_review_without_the_api_servers_client_certificate_gets_no_answer_and_records_no_event() {
    // The webhook port is reachable from any pod. Each denied review records a Rejected Event
    // on the PDPair name and namespace it names: a forger could fill any namespace's events.
    // With --webhook-client-ca only the API server (its WebhookAdmissionConfiguration presents
    // a client certificate from that CA) gets through the TLS handshake.
    let op = operator();
    let ns = namespace("forged");
    let failed_before = op.counter("pdpair_operator_webhook_tls_failures_total");
    let (code, body) = post_webhook_as(
        op.webhook_port,
        &review_of("vllm-push-16-64.yaml", &ns, "forged"),
        false,
    );
    assert_eq!(code, 0, "answered without a client certificate: {body}");
    assert!(
        op.counter("pdpair_operator_webhook_tls_failures_total") > failed_before,
        "the refused handshake is counted"
    );
    // The same review with the API server's certificate is answered, and its Event recorded.
    let (code, body) = post_webhook(op.webhook_port, &review_of("vllm-push-16-64.yaml", &ns, "certified"));
    assert!(code == 200 && body.contains("\"allowed\":false"), "{code}: {body}");
    event_with_reason(WAIT, &ns, "certified", "Rejected", None);
    assert!(
        events_about(&ns, "forged").is_empty(),
        "the forged review recorded an Event"
    );
    // And the real API server, through its client certificate, still has kubectl's apply refused
    // with the rule's message.
    let out = kubectl(
        &["apply", "-f", "-"],
        Some(&manifest("vllm-push-16-64.yaml", &ns, |_| {})),
    );
    assert!(
        out.code != 0 && out.stderr.contains("KernelBlockSizeMismatch"),
        "{}",
        out.stderr
    );
}

#[test]
fn malformed_reviews_get_errors_over_tls_and_the_webhook_keeps_serving() {
    let op = operator();
    for garbage in ["", "{", "not json at all", "{\"kind\":\"AdmissionReview\"}", "[]"] {
        let (code, body) = post_webhook(op.webhook_port, garbage);
        assert!(
            code == 400 || (code == 200 && body.contains("\"allowed\":false")),
            "{garbage:?} got {code}: {body}"
        );
    }
    let ns = namespace("garbage");
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&manifest("vllm-pull-16-32.yaml", &ns, |_| {})),
    );
    let metrics = op.metrics();
    assert!(
        metrics.contains("pdpair_operator_admission_decisions_total{outcome=\"error\",reason=\"Malformed\"}"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_time_the_operator_could_not_read_is_refused_by_the_api_server() {
    // The API server's `date-time` takes more than 9 digits of a second (Go's parser cuts them);
    // the operator's (jiff) does not, and one such time in a PDEndpoint failed its whole list of
    // them: after its next restart the operator reconciled no pair again. Node agents'
    // credentials write PDEndpoints; whoever may patch `pdpairs/status` writes conditions.
    let (ns, client, pairs, pair) = push_64_64_in("times").await;
    create_endpoint(&client, endpoint(&ns, "decode-0", Role::Decode, &pair)).await;
    let endpoints: Api<PDEndpoint> = Api::namespaced(client.clone(), &ns);
    let bad = "2025-01-01T00:00:00.1234567890Z";
    for (field, status) in [
        ("lastHeartbeat", serde_json::json!({"lastHeartbeat": bad})),
        ("lastSuccess", serde_json::json!({"lastSuccess": bad})),
        (
            "lastFailure.time",
            serde_json::json!({"lastFailure": {"time": bad, "reasons": ["TransportFailed"], "message": "m"}}),
        ),
        (
            "lastRejection.time",
            serde_json::json!({"lastRejection": {"time": bad, "peer": "p", "reasons": ["Unauthenticated"], "message": "m"}}),
        ),
        (
            "earlierFailures.time",
            serde_json::json!({"earlierFailures": [{"time": bad, "reasons": ["TransportFailed"], "message": "m"}]}),
        ),
        (
            "earlierRejections.time",
            serde_json::json!({"earlierRejections": [{"time": bad, "peer": "p", "reasons": ["Unauthenticated"], "message": "m"}]}),
        ),
    ] {
        let e = endpoints
            .patch_status(
                "decode-0",
                &PatchParams::default(),
                &Patch::Merge(&serde_json::json!({ "status": status })),
            )
            .await
            .expect_err(field);
        assert!(
            e.to_string().contains(field.split('.').next().unwrap_or(field)),
            "{field}: {e}"
        );
    }
    let condition = serde_json::json!({"status": {"conditions": [{
        "type": "Ready", "status": "True", "reason": "R", "message": "", "lastTransitionTime": bad
    }]}});
    let e = pairs
        .patch_status("vllm-push-64-64", &PatchParams::default(), &Patch::Merge(&condition))
        .await
        .expect_err("a condition's lastTransitionTime");
    assert!(e.to_string().contains("lastTransitionTime"), "{e}");
    // Nine digits and an offset are times both read; the list still reads whole.
    let good = serde_json::json!({"status": {"lastHeartbeat": "2025-01-01T05:30:00.123456789+05:30"}});
    endpoints
        .patch_status("decode-0", &PatchParams::default(), &Patch::Merge(&good))
        .await
        .expect("a time the operator reads is stored");
    let list = endpoints.list(&ListParams::default()).await.expect("the list reads");
    assert_eq!(list.items.len(), 1);
}
