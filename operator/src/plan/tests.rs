use k8s_openapi::api::core::v1::PodTemplateSpec;
use pdpair_api::{PDPair, Role};

use super::*;

fn pair() -> PDPair {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/compatible-push.yaml"))
        .expect("example exists");
    let mut pair: PDPair = serde_yaml::from_str(&text).expect("example parses");
    pair.metadata.uid = Some("uid-1".into());
    pair
}

#[test]
fn deployment_is_owned_labelled_and_wired() {
    let pair = pair();
    let d = deployment(&pair, Role::Decode, &Wiring::default()).expect("decode has a template");
    assert_eq!(d.metadata.name.as_deref(), Some("llama-8b-decode"));
    assert_eq!(d.metadata.namespace.as_deref(), Some("default"));
    let owner = &d.metadata.owner_references.as_ref().expect("owner")[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
        ("PDPair", "llama-8b", "uid-1")
    );
    assert_eq!(owner.controller, Some(true));
    let spec = d.spec.expect("spec");
    assert_eq!(spec.replicas, Some(4));
    let labels = spec.selector.match_labels.expect("selector");
    assert_eq!(labels.get(LABEL_NAME).map(String::as_str), Some("llama-8b"));
    assert_eq!(labels.get(LABEL_ROLE).map(String::as_str), Some("decode"));
    let meta = spec.template.metadata.expect("template metadata");
    let pod_labels = meta.labels.expect("labels");
    assert_eq!(pod_labels.get(LABEL_ROLE).map(String::as_str), Some("decode"));
    assert_eq!(
        pod_labels.get("app.kubernetes.io/name").map(String::as_str),
        Some("llama-8b"),
        "user labels kept"
    );
    assert_eq!(
        meta.annotations.expect("annotations").get(ANNOTATION_GEOMETRY),
        Some(&geometry_hash(&pair, Role::Decode))
    );
    let pod = spec.template.spec.expect("pod spec");
    let c = &pod.containers[0];
    let env: Vec<(&str, &str)> = c
        .env
        .as_ref()
        .expect("env")
        .iter()
        .map(|e| (e.name.as_str(), e.value.as_deref().unwrap_or("")))
        .collect();
    for want in [
        ("PDPAIR_NAME", "llama-8b"),
        ("PDPAIR_NAMESPACE", "default"),
        ("PDPAIR_ROLE", "decode"),
        ("PDPAIR_AGENT_SOCKET", "/var/run/pdpair/agent.sock"),
        ("PDPAIR_PAIRING_KEY_FILE", "/var/run/pdpair-pairing/key"),
        ("PDPAIR_UID", "uid-1"),
    ] {
        assert!(env.contains(&want), "{want:?} missing from {env:?}");
    }
    assert!(env.contains(&("VLLM_ATTENTION_BACKEND", "FLASH_ATTN")), "user env kept");
    let pod_name = c
        .env
        .as_ref()
        .and_then(|e| e.iter().find(|v| v.name == "PDPAIR_POD_NAME"))
        .and_then(|v| v.value_from.as_ref())
        .and_then(|f| f.field_ref.as_ref())
        .map(|f| f.field_path.as_str());
    assert_eq!(
        pod_name,
        Some("metadata.name"),
        "the Pod's name through the downward API"
    );
    let mounts = c.volume_mounts.as_ref().expect("mounts");
    assert!(
        mounts
            .iter()
            .any(|m| m.mount_path == "/var/run/pdpair" && m.name == "pdpair-agent" && m.read_only == Some(true))
    );
    assert!(
        mounts
            .iter()
            .any(|m| m.mount_path == "/var/run/pdpair-pairing" && m.read_only == Some(true))
    );
    let volumes = pod.volumes.expect("volumes");
    let host = volumes
        .iter()
        .find(|v| v.name == "pdpair-agent")
        .and_then(|v| v.host_path.as_ref())
        .expect("hostPath");
    assert_eq!(host.path, "/var/run/pdpair");
    let secret = volumes
        .iter()
        .find(|v| v.name == "pdpair-pairing")
        .and_then(|v| v.secret.as_ref())
        .expect("secret");
    assert_eq!(secret.secret_name.as_deref(), Some("llama-8b-pairing-uid-1"));
}

#[test]
fn a_pair_without_a_uid_plans_nothing() {
    // The Secret's name holds the uid: without one there is no name for it, and the controller
    // refuses such a pair before planning (a pool not planned reads as a removed template).
    let mut pair = pair();
    pair.metadata.uid = None;
    assert!(deployment(&pair, Role::Decode, &Wiring::default()).is_none());
    assert!(pairing_secret(&pair, &[7u8; 32]).is_none());
}

#[test]
fn a_pool_keeps_the_pairing_secret_it_mounts_only_where_asked_to() {
    let pair = pair();
    let planned = deployment(&pair, Role::Decode, &Wiring::default()).expect("template");
    let mounted = |d: &Deployment| {
        d.spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|p| p.volumes.as_ref())
            .and_then(|v| v.iter().find(|v| v.name == "pdpair-pairing").cloned())
            .and_then(|v| v.secret)
            .and_then(|s| s.secret_name)
    };
    // What an earlier operator rendered: the Secret named after the pair alone.
    // `planned`, its pods mounting the Secret `name`.
    let mounting = |name: &str| {
        let mut d = planned.clone();
        d.spec
            .as_mut()
            .and_then(|s| s.template.spec.as_mut())
            .and_then(|p| p.volumes.as_mut())
            .and_then(|v| v.iter_mut().find(|v| v.name == "pdpair-pairing"))
            .and_then(|v| v.secret.as_mut())
            .expect("volume")
            .secret_name = Some(name.into());
        d
    };
    let live = mounting("llama-8b-pairing");
    let mut to_old = planned.clone();
    assert_eq!(
        keep_pairing_secret(&mut to_old, &live, "llama-8b").as_deref(),
        Some("llama-8b-pairing")
    );
    assert_eq!(mounted(&to_old).as_deref(), Some("llama-8b-pairing"));
    // The same one: nothing to keep.
    let mut same = planned.clone();
    assert_eq!(keep_pairing_secret(&mut same, &planned, "llama-8b"), None);
    assert_eq!(same, planned);
    // A Secret this operator would not name for the pair (patched into the live Deployment by
    // hand, or another pair's): not kept.
    for other in [
        "someone-elses",
        "llama-8b-pairing-",
        "llama-8b-pairingx",
        "llama-8b-2-pairing",
        "llama-8b-pairing-mine",
        // Pair `llama-8b-pairing-x`'s, before and after uids were in the name.
        "llama-8b-pairing-x-pairing",
        "llama-8b-pairing-x-pairing-uid-2",
    ] {
        let patched = mounting(other);
        let mut kept = planned.clone();
        assert_eq!(keep_pairing_secret(&mut kept, &patched, "llama-8b"), None, "{other}");
        assert_eq!(kept, planned, "{other}");
    }
}

#[test]
fn planning_twice_is_identical_and_wiring_is_not_duplicated() {
    let mut pair = pair();
    let first = deployment(&pair, Role::Prefill, &Wiring::default()).expect("template");
    // Feed the planned template back in, as if the user had copied it: still one of each.
    pair.spec.prefill.template = first.spec.as_ref().map(|s| s.template.clone());
    let second = deployment(&pair, Role::Prefill, &Wiring::default()).expect("template");
    let c = engine_container(&second);
    let names: Vec<&str> = c.env.as_ref().expect("env").iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names.iter().filter(|n| **n == "PDPAIR_ROLE").count(), 1);
    assert_eq!(
        c.volume_mounts
            .as_ref()
            .expect("mounts")
            .iter()
            .filter(|m| m.name == "pdpair-agent")
            .count(),
        1
    );
    assert_eq!(deployment(&pair, Role::Prefill, &Wiring::default()), Some(second));
}

#[test]
fn a_pools_rollout_is_its_deployments_rolling_update_and_absent_kubernetes_defaults() {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let mut pair = pair();
    let strategy = |pair: &PDPair, role| {
        deployment(pair, role, &Wiring::default())
            .and_then(|d| d.spec)
            .and_then(|s| s.strategy)
    };
    assert_eq!(strategy(&pair, Role::Decode), None, "Kubernetes' defaults");
    pair.spec.decode.rollout = Some(pdpair_api::Rollout {
        max_surge: Some(0),
        max_unavailable: Some(1),
    });
    let s = strategy(&pair, Role::Decode).expect("a strategy");
    assert_eq!(s.type_.as_deref(), Some("RollingUpdate"));
    let r = s.rolling_update.expect("rolling update");
    assert_eq!(
        (r.max_surge, r.max_unavailable),
        (Some(IntOrString::Int(0)), Some(IntOrString::Int(1)))
    );
    assert_eq!(strategy(&pair, Role::Prefill), None, "each pool its own");
    // One left out stays Kubernetes' default.
    pair.spec.decode.rollout = Some(pdpair_api::Rollout {
        max_surge: None,
        max_unavailable: Some(2),
    });
    let r = strategy(&pair, Role::Decode)
        .and_then(|s| s.rolling_update)
        .expect("rolling update");
    assert_eq!((r.max_surge, r.max_unavailable), (None, Some(IntOrString::Int(2))));
    // One admission refuses, stored all the same (the webhook skipped: failurePolicy Ignore, a
    // namespace it does not watch): the pools are still planned, and the API server's refusal
    // of the Deployment says why (PoolsApplied False), the engines left running; the KV rules
    // failing would plan no Deployment and prune both.
    pair.spec.decode.rollout = Some(pdpair_api::Rollout {
        max_surge: Some(0),
        max_unavailable: Some(0),
    });
    assert!(!pdpair_api::check_admission(&pair.spec).allowed());
    for role in [Role::Prefill, Role::Decode] {
        assert!(planned_deployment(&pair, role, &Wiring::default()).is_some(), "{role}");
    }
    // So too negative replicas (stored before the CRD's schema bounded them), given to the API
    // server as they are.
    pair.spec.decode.rollout = None;
    pair.spec.decode.replicas = -1;
    assert!(!pdpair_api::check_admission(&pair.spec).allowed());
    for role in [Role::Prefill, Role::Decode] {
        assert!(planned_deployment(&pair, role, &Wiring::default()).is_some(), "{role}");
    }
    let replicas = deployment(&pair, Role::Decode, &Wiring::default()).and_then(|d| d.spec?.replicas);
    assert_eq!(replicas, Some(-1));
}

#[test]
fn bring_your_own_pool_has_no_deployment() {
    let mut pair = pair();
    pair.spec.prefill.template = None;
    assert!(deployment(&pair, Role::Prefill, &Wiring::default()).is_none());
    assert!(deployment(&pair, Role::Decode, &Wiring::default()).is_some());
}

#[test]
fn geometry_hash_changes_with_geometry_only() {
    let pair = pair();
    let base = geometry_hash(&pair, Role::Prefill);
    let mut other = pair.clone();
    other.spec.prefill.replicas = 7;
    other.spec.prefill.template = Some(PodTemplateSpec::default());
    assert_eq!(
        geometry_hash(&other, Role::Prefill),
        base,
        "replicas and template do not roll"
    );
    other.spec.prefill.kv.block_size = 128;
    assert_ne!(geometry_hash(&other, Role::Prefill), base);
    let mut other = pair.clone();
    other.spec.prefill.parallelism.tensor = 4;
    assert_ne!(geometry_hash(&other, Role::Prefill), base);
    let mut other = pair;
    other.spec.transfer.mode = pdpair_api::TransferMode::Pull;
    assert_ne!(geometry_hash(&other, Role::Prefill), base);
}

#[test]
fn pairing_secret_is_owned_and_holds_the_key() {
    let pair = pair();
    let s = pairing_secret(&pair, &[7u8; 32]).expect("named pair");
    assert_eq!(s.metadata.name.as_deref(), Some("llama-8b-pairing-uid-1"));
    assert_eq!(s.metadata.owner_references.expect("owner")[0].uid, "uid-1");
    let data = s.data.expect("data");
    assert_eq!(data.get("key").map(|b| b.0.len()), Some(32));
    // Whose key it is, beside it: the engine compares it with its PDPAIR_UID.
    assert_eq!(data.get("pdpair-uid").map(|b| b.0.as_slice()), Some(&b"uid-1"[..]));
}

fn connector_pair() -> PDPair {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/vllm-pdpair-connector.yaml"
    ))
    .expect("example exists");
    let mut v: serde_yaml::Value = serde_yaml::from_str(&text).expect("yaml");
    v.apply_merge().expect("merge keys");
    let mut pair: PDPair = serde_yaml::from_value(v).expect("example parses");
    pair.metadata.uid = Some("uid-2".into());
    pair
}

fn engine_container(d: &Deployment) -> &k8s_openapi::api::core::v1::Container {
    &d.spec
        .as_ref()
        .expect("spec")
        .template
        .spec
        .as_ref()
        .expect("pod")
        .containers[0]
}

#[test]
fn the_pdpair_connector_is_rendered_into_each_pools_vllm_args_replacing_the_templates() {
    let mut pair = connector_pair();
    // A template that still names another connector, both spellings: replaced, not doubled.
    let prefill = pair.spec.prefill.template.as_mut().expect("template");
    let args = prefill.spec.as_mut().expect("pod").containers[0]
        .args
        .as_mut()
        .expect("args");
    args.push(r#"--kv-transfer-config={"kv_connector":"NixlConnector","kv_role":"kv_both"}"#.into());
    args.push("--kv-transfer-config".into());
    args.push(r#"{"kv_connector":"NixlConnector"}"#.into());
    for (role, kv_role) in [(Role::Prefill, "kv_producer"), (Role::Decode, "kv_consumer")] {
        let d = deployment(&pair, role, &Wiring::default()).expect("template");
        let c = engine_container(&d);
        let args = c.args.as_ref().expect("args");
        let flags: Vec<&String> = args
            .iter()
            .filter(|a| a.contains("kv-transfer-config") || a.contains("Nixl"))
            .collect();
        assert_eq!(flags.len(), 1, "exactly one connector flag: {args:?}");
        let config: serde_json::Value =
            serde_json::from_str(flags[0].strip_prefix("--kv-transfer-config=").expect("flag=value")).expect("JSON");
        assert_eq!(
            config,
            serde_json::json!({"kv_connector": "PdpairConnector", "kv_connector_module_path": "pdpair_vllm",
                               "kv_role": kv_role, "kv_load_failure_policy": "recompute",
                               "engine_id": "$(PDPAIR_POD_NAME)"})
        );
        // The kubelet expands it from the container's env, which sets it from the Pod's name.
        let pod_name = c
            .env
            .as_ref()
            .and_then(|env| env.iter().find(|e| e.name == "PDPAIR_POD_NAME"));
        assert_eq!(
            pod_name
                .and_then(|e| e.value_from.as_ref())
                .and_then(|v| v.field_ref.as_ref())
                .map(|f| f.field_path.as_str()),
            Some("metadata.name"),
            "{pod_name:?}"
        );
        assert!(
            args.contains(&"--block-size=16".to_string()),
            "the template's own args stay: {args:?}"
        );
        let env = c.env.as_ref().expect("env");
        let kv = env
            .iter()
            .find(|e| e.name == "PDPAIR_KV")
            .and_then(|e| e.value.as_deref())
            .expect("PDPAIR_KV");
        let kv: pdpair_api::KvGeometry = serde_json::from_str(kv).expect("the declared geometry");
        assert_eq!(kv, pair.spec.prefill.kv);
        // Planning what was planned changes nothing.
        let mut again = pair.clone();
        let pool = match role {
            Role::Prefill => &mut again.spec.prefill,
            Role::Decode => &mut again.spec.decode,
        };
        pool.template = d.spec.as_ref().map(|s| s.template.clone());
        assert_eq!(
            deployment(&again, role, &Wiring::default())
                .as_ref()
                .map(engine_container),
            Some(c)
        );
    }
    // The template's own load failure policy stays (vLLM's `fail` answers the client with an
    // error for a request whose KV did not arrive; pdpair's default recomputes it).
    let policy_of = |pair: &PDPair| {
        let d = deployment(pair, Role::Decode, &Wiring::default()).expect("template");
        let args = engine_container(&d).args.clone().expect("args");
        let flag = args
            .iter()
            .find_map(|a| a.strip_prefix("--kv-transfer-config="))
            .expect("the flag")
            .to_owned();
        let config: serde_json::Value = serde_json::from_str(&flag).expect("JSON");
        config["kv_load_failure_policy"].as_str().map(str::to_owned)
    };
    // In each of vLLM's spellings: `--flag value`, `_` in the flag's name, and a dotted field
    // (which vLLM merges over the whole flag: dropped, its policy kept).
    for spelling in [
        vec![
            "--kv-transfer-config",
            r#"{"kv_connector":"NixlConnector","kv_load_failure_policy":"fail"}"#,
        ],
        vec![r#"--kv_transfer_config={"kv_load_failure_policy":"fail"}"#],
        vec!["--kv-transfer-config.kv_load_failure_policy", "fail"],
        vec!["--kv_transfer_config.kv_load_failure_policy=fail"],
    ] {
        let mut spelled = pair.clone();
        let args = spelled
            .spec
            .decode
            .template
            .as_mut()
            .expect("template")
            .spec
            .as_mut()
            .expect("pod")
            .containers[0]
            .args
            .get_or_insert_with(Vec::new);
        args.extend(spelling.iter().map(|a| (*a).to_owned()));
        assert_eq!(policy_of(&spelled).as_deref(), Some("fail"), "{spelling:?}");
        let d = deployment(&spelled, Role::Decode, &Wiring::default()).expect("template");
        let args = engine_container(&d).args.clone().expect("args");
        assert_eq!(
            args.iter()
                .filter(|a| a.replace('_', "-").starts_with("--kv-transfer-config") || *a == "fail")
                .count(),
            1,
            "{args:?}"
        );
    }
    assert_eq!(policy_of(&pair).as_deref(), Some("recompute"));
    // Without the connector the template's args are left alone.
    pair.spec.transfer.connector = pdpair_api::Connector::None;
    let d = deployment(&pair, Role::Prefill, &Wiring::default()).expect("template");
    let args = engine_container(&d).args.as_ref().expect("args");
    assert!(args.iter().any(|a| a.contains("NixlConnector")), "{args:?}");
    assert!(!args.iter().any(|a| a.contains("PdpairConnector")), "{args:?}");
}

#[test]
fn an_incompatible_pair_or_a_removed_template_plans_no_deployment() {
    let mut pair = pair();
    assert!(planned_deployment(&pair, Role::Prefill, &Wiring::default()).is_some());
    assert!(planned_deployment(&pair, Role::Decode, &Wiring::default()).is_some());
    // The decode template removed (a bring-your-own pool now): only prefill is planned.
    let mut byo = pair.clone();
    byo.spec.decode.template = None;
    assert!(planned_deployment(&byo, Role::Prefill, &Wiring::default()).is_some());
    assert!(planned_deployment(&byo, Role::Decode, &Wiring::default()).is_none());
    // Stored incompatible (the webhook bypassed): nothing runs, on either side.
    pair.spec.decode.kv.kernel_block_size = Some(16);
    pair.spec.decode.kv.block_size = 16;
    assert!(!pdpair_api::check(&pair.spec).allowed(), "incompatible");
    assert!(planned_deployment(&pair, Role::Prefill, &Wiring::default()).is_none());
    assert!(planned_deployment(&pair, Role::Decode, &Wiring::default()).is_none());
}

#[test]
fn engine_pods_join_the_agents_socket_group() {
    let wiring = Wiring {
        socket_group: Some(2000),
        socket_dir: None,
    };
    let security = |pair: &PDPair| {
        let d = deployment(pair, Role::Decode, &wiring).expect("template");
        d.spec
            .and_then(|s| s.template.spec)
            .and_then(|s| s.security_context)
            .unwrap_or_default()
    };
    // No fsGroup of its own: the socket group becomes it (the pairing key is then readable too).
    let mut pair = pair();
    let sc = security(&pair);
    assert_eq!(sc.fs_group, Some(2000));
    assert_eq!(sc.supplemental_groups, None);
    // Another fsGroup is kept; the socket group is added beside it, once.
    let spec = pair
        .spec
        .decode
        .template
        .as_mut()
        .and_then(|t| t.spec.as_mut())
        .expect("pod spec");
    spec.security_context.get_or_insert_with(Default::default).fs_group = Some(3000);
    let sc = security(&pair);
    assert_eq!(
        (sc.fs_group, sc.supplemental_groups.clone()),
        (Some(3000), Some(vec![2000]))
    );
    let planned = deployment(&pair, Role::Decode, &wiring).expect("template");
    pair.spec.decode.template = planned.spec.map(|s| s.template);
    assert_eq!(security(&pair).supplemental_groups, Some(vec![2000]), "not twice");
    // Without a socket group configured, nothing is added.
    let d = deployment(&self::pair(), Role::Decode, &Wiring::default()).expect("template");
    let sc = d.spec.and_then(|s| s.template.spec).and_then(|s| s.security_context);
    assert!(sc.as_ref().is_none_or(|sc| sc.fs_group.is_none()), "{sc:?}");
}

#[test]
fn engine_pods_mount_the_agents_socket_directory_where_the_chart_put_it() {
    // The chart's agent.socketDir is where the agent listens on the node; engine pods mount that
    // host directory at the path PDPAIR_AGENT_SOCKET names (before, always /var/run/pdpair on
    // the node: with another socketDir no engine found its agent).
    let host_path = |wiring: &Wiring| {
        let d = deployment(&pair(), Role::Decode, wiring).expect("template");
        let spec = d.spec.and_then(|s| s.template.spec).expect("pod spec");
        let volume = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "pdpair-agent")
            .cloned()
            .expect("the agent's volume");
        let mounted = spec.containers[0]
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == "pdpair-agent")
            .map(|m| m.mount_path.clone());
        (volume.host_path.map(|h| h.path), mounted)
    };
    let moved = Wiring {
        socket_group: None,
        socket_dir: Some("/run/pdpair".into()),
    };
    assert_eq!(
        host_path(&moved),
        (Some("/run/pdpair".into()), Some(names::AGENT_SOCKET_DIR.into()))
    );
    assert_eq!(
        host_path(&Wiring::default()),
        (
            Some(names::AGENT_SOCKET_DIR.into()),
            Some(names::AGENT_SOCKET_DIR.into())
        )
    );
}

#[test]
fn init_containers_mount_the_agents_socket_directory_and_the_pairing_key_read_only() {
    // The engines' containers get both read-only; an init container of the template mounting the
    // agent's volume read-write could replace the agent's socket on the node.
    let mut v = serde_json::to_value(pair()).expect("json");
    v["spec"]["decode"]["template"]["spec"]["initContainers"] = serde_json::json!([{
        "name": "setup", "image": "busybox", "restartPolicy": "Always",
        "volumeMounts": [
            {"name": "pdpair-agent", "mountPath": "/sock"},
            {"name": "pdpair-pairing", "mountPath": "/key", "readOnly": false},
            {"name": "scratch", "mountPath": "/scratch"},
        ],
    }]);
    let pair: PDPair = serde_json::from_value(v).expect("pair");
    let d = deployment(&pair, Role::Decode, &Wiring::default()).expect("template");
    let spec = d.spec.and_then(|s| s.template.spec).expect("pod spec");
    let mounts = spec.init_containers.expect("init")[0]
        .volume_mounts
        .clone()
        .expect("mounts");
    let read_only = |name: &str| mounts.iter().find(|m| m.name == name).map(|m| m.read_only);
    assert_eq!(read_only("pdpair-agent"), Some(Some(true)));
    assert_eq!(read_only("pdpair-pairing"), Some(Some(true)));
    assert_eq!(read_only("scratch"), Some(None), "other mounts as they were");
}
