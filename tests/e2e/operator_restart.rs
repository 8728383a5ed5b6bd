//! Disruptive operator scenarios, one at a time: restarts and webhook outages. Each test starts
//! and stops its own operators; a lock keeps them from overlapping.

use std::{sync::Mutex, time::Duration};

use pdpair_e2e::*;

const WAIT: Duration = Duration::from_secs(60);
static SERIAL: Mutex<()> = Mutex::new(());

fn resource_versions(ns: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (kind, name) in [
        ("pdpair", "llama-8b"),
        ("deployment", "llama-8b-prefill"),
        ("deployment", "llama-8b-decode"),
        ("secret", "llama-8b"),
    ] {
        let v = match kind {
            "secret" => pairing_secret(ns, name),
            _ => get_json(kind, ns, name),
        };
        let v = v.unwrap_or_else(|| panic!("{kind}/{name} exists"));
        out.push((
            format!("{kind}/{name}"),
            v["metadata"]["resourceVersion"].as_str().unwrap_or("").to_owned(),
        ));
    }
    out
}

/// The resource versions once they held still for 5 s (the operator's reconciles after the
/// Deployments' status updates are over; on a loaded machine that takes longer than any fixed
/// wait: a fixed 3 s once let the first operator's last status write land after the restart).
fn settled(ns: &str) -> Vec<(String, String)> {
    let until = std::time::Instant::now() + WAIT;
    let mut last = resource_versions(ns);
    loop {
        std::thread::sleep(Duration::from_secs(5));
        let now = resource_versions(ns);
        if now == last {
            return now;
        }
        assert!(
            std::time::Instant::now() < until,
            "still changing after {WAIT:?}: {now:?}"
        );
        last = now;
    }
}

/// A namespace for `test` with the compatible push pair applied, once it has its children
/// (Deployments, pairing Secret) and status; returns the namespace.
fn compatible_pair(test: &str) -> String {
    let ns = namespace(test);
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&manifest("compatible-push.yaml", &ns, |_| {})),
    );
    eventually(WAIT, "children and status", || {
        let p = get_json("pdpair", &ns, "llama-8b")?;
        condition(&p, "Ready")?;
        get_json("deployment", &ns, "llama-8b-decode")?;
        pairing_secret(&ns, "llama-8b")
    });
    ns
}

#[test]
fn a_restarted_operator_changes_nothing_that_is_already_right() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut first = Operator::start("restart-a");
    let ns = compatible_pair("restart");
    // Let the first operator settle (Deployment status updates trigger reconciles).
    let before = settled(&ns);
    let key_before = pairing_secret(&ns, "llama-8b").expect("secret")["data"]["key"].clone();
    first.stop();

    let second = Operator::start("restart-b");
    eventually(WAIT, "the new operator to lead", || second.is_leader().then_some(()));
    eventually(WAIT, "the new operator to reconcile", || {
        second
            .metrics()
            .lines()
            .any(|l| l.starts_with("pdpair_operator_reconciles_total ") && !l.ends_with(" 0"))
            .then_some(())
    });
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(resource_versions(&ns), before, "a restart must not rewrite anything");
    assert_eq!(
        pairing_secret(&ns, "llama-8b").expect("secret")["data"]["key"],
        key_before
    );
    let deployments = kubectl_ok(
        &[
            "get",
            "deployments",
            "-n",
            &ns,
            "-l",
            "pdpair.dev/name=llama-8b",
            "-o",
            "name",
        ],
        None,
    );
    assert_eq!(deployments.lines().count(), 2, "{deployments}");
    let secrets = kubectl_ok(
        &[
            "get",
            "secrets",
            "-n",
            &ns,
            "-l",
            "pdpair.dev/name=llama-8b",
            "-o",
            "name",
        ],
        None,
    );
    assert_eq!(secrets.lines().count(), 1, "{secrets}");
}

#[test]
fn with_the_webhook_down_creation_is_refused_and_works_again_when_it_is_back() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut op = Operator::start("outage-a");
    let port = op.webhook_port;
    let ns = namespace("outage");
    op.stop();
    let out = kubectl(
        &["apply", "-f", "-"],
        Some(&manifest("vllm-push-64-64.yaml", &ns, |_| {})),
    );
    assert_ne!(
        out.code, 0,
        "failurePolicy Fail must refuse creation while the webhook is down"
    );
    assert!(out.stderr.contains("validate.pdpairs.pdpair.dev"), "{}", out.stderr);
    assert!(get_json("pdpair", &ns, "vllm-push-64-64").is_none());
    let _back = Operator::start_on("outage-b", port);
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&manifest("vllm-push-64-64.yaml", &ns, |_| {})),
    );
    assert!(get_json("pdpair", &ns, "vllm-push-64-64").is_some());
}

#[test]
fn a_pdpair_stored_past_the_webhook_that_does_not_parse_stops_only_itself() {
    // The CRD keeps pod templates whole and unchecked, so a template that is not a pod template
    // is stored wherever the webhook is bypassed (here: down, under failurePolicy Ignore). The
    // operator's watch read PDPairs as one typed list: one such object failed the list, so no
    // pair was reconciled and the operator never turned ready (its webhook then refused every
    // PDPair in the cluster). Now it is that object's own fault, in its own status.
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut op = Operator::start("bad-object-a");
    let port = op.webhook_port;
    op.stop();
    kubectl_ok(
        &[
            "patch",
            "validatingwebhookconfiguration",
            "pdpair-validating-webhook",
            "--type=json",
            "-p",
            r#"[{"op": "replace", "path": "/webhooks/0/failurePolicy", "value": "Ignore"}]"#,
        ],
        None,
    );
    let ns = namespace("bad-object");
    let bad = manifest("compatible-push.yaml", &ns, |v| {
        v["metadata"]["name"] = "bad".into();
        v["spec"]["decode"]["template"]["spec"]["containers"][0]["env"][0]["value"] = 8000.into();
    });
    kubectl_ok(&["apply", "-f", "-"], Some(&bad));
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&manifest("compatible-push.yaml", &ns, |_| {})),
    );
    // Back up (it installs its webhook again, failurePolicy Fail): it turns ready, runs the good
    // pair, and says what is wrong with the bad one.
    let _back = Operator::start_on("bad-object-b", port);
    eventually(Duration::from_secs(60), "the good pair's Deployments", || {
        (get_json("deployment", &ns, "llama-8b-prefill").is_some()
            && get_json("deployment", &ns, "llama-8b-decode").is_some())
        .then_some(())
    });
    let applied = eventually(Duration::from_secs(60), "the bad pair's PoolsApplied", || {
        condition_of(&get_json("pdpair", &ns, "bad")?, "PoolsApplied").filter(|c| c["status"] == "False")
    });
    let message = applied["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("spec.decode.template is not a pod template: spec.containers[0].env[0].value"),
        "{message}"
    );
    assert!(
        get_json("deployment", &ns, "bad-prefill").is_none(),
        "neither pool of it"
    );
    // The webhook refuses such a template by name.
    let out = kubectl(
        &["apply", "-f", "-"],
        Some(&bad.replace("name: bad", "name: bad-again")),
    );
    assert_ne!(out.code, 0);
    assert!(
        out.stderr.contains("spec.decode.template is not a pod template"),
        "{}",
        out.stderr
    );
}

#[test]
fn endpoint_heartbeats_apply_no_deployment_again_and_a_changed_one_is_put_back() {
    use kube::{
        Api,
        api::{Patch, PatchParams},
    };
    // Every PDEndpoint status write (each agent's heartbeat, and every second while KV moves)
    // reconciles its pair. Each reconcile applied both Deployments again and created the pairing
    // Secret again (409): three writes to the API server per heartbeat of every engine, for a
    // plan that had not changed. Now an unchanged plan is applied only to a Deployment that
    // changed since it was applied. Alone in this binary's operator, so its counters are this
    // pair's.
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let op = Operator::start("applies");
    let ns = compatible_pair("applies");
    settled(&ns);
    let pair: pdpair_api::PDPair =
        serde_json::from_value(get_json("pdpair", &ns, "llama-8b").expect("pair")).expect("a PDPair");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let kube = rt.block_on(client());
    let endpoints: Api<pdpair_api::PDEndpoint> = Api::namespaced(kube.clone(), &ns);
    rt.block_on(create_endpoint(
        &kube,
        endpoint(&ns, "decode-0", pdpair_api::Role::Decode, &pair),
    ));
    eventually(WAIT, "the endpoint counted", || {
        let p = get_json("pdpair", &ns, "llama-8b")?;
        (p["status"]["transfer"]["endpoints"] == 1).then_some(())
    });
    std::thread::sleep(Duration::from_secs(2));
    let (applies, reconciles, secrets, writes) = (
        op.counter("pdpair_operator_deployment_applies_total"),
        op.counter("pdpair_operator_reconciles_total"),
        op.counter("pdpair_operator_pairing_secret_checks_total"),
        op.counter("pdpair_operator_status_writes_total"),
    );
    for i in 1..=5u64 {
        let status = serde_json::json!({"status": {"transfersCompleted": i, "bytes": i * 4096}});
        rt.block_on(endpoints.patch_status("decode-0", &PatchParams::default(), &Patch::Merge(&status)))
            .expect("patch status");
        std::thread::sleep(Duration::from_millis(300));
    }
    eventually(WAIT, "the heartbeats in the pair's status", || {
        let p = get_json("pdpair", &ns, "llama-8b")?;
        (p["status"]["transfer"]["bytes"] == 5 * 4096).then_some(())
    });
    assert!(
        op.counter("pdpair_operator_reconciles_total") >= reconciles + 5,
        "each heartbeat reconciled the pair"
    );
    // Counters alone are written at most every 5 s: a pair of busy engines got a status patch
    // per engine write.
    let written = op.counter("pdpair_operator_status_writes_total") - writes;
    assert!(
        (1..5).contains(&written),
        "{written} status writes for 5 heartbeats in 1.5 s"
    );
    assert_eq!(
        op.counter("pdpair_operator_deployment_applies_total"),
        applies,
        "no Deployment applied again for an unchanged plan"
    );
    // Not asked again per heartbeat (5 more without the fix): once a resync, which may fall in
    // these seconds on a slow run.
    let asked = op.counter("pdpair_operator_pairing_secret_checks_total") - secrets;
    assert!(
        asked <= 1,
        "the pairing Secret asked for {asked} times more in 5 heartbeats, not once a resync"
    );
    // Someone changes a Deployment: the plan is applied to it again.
    kubectl_ok(
        &["scale", "deployment", "llama-8b-decode", "-n", &ns, "--replicas=7"],
        None,
    );
    eventually(WAIT, "the decode pool's replicas put back", || {
        let d = get_json("deployment", &ns, "llama-8b-decode")?;
        (d["spec"]["replicas"] == 4).then_some(())
    });
    assert!(op.counter("pdpair_operator_deployment_applies_total") > applies);
}

#[test]
fn an_operator_of_some_namespaces_runs_their_pairs_and_leaves_the_others_alone() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (watched, also, other) = (namespace("watched"), namespace("also-watched"), namespace("unwatched"));
    let scope = format!("{watched},{also}");
    // With the chart's rights for `operator.watchNamespaces` and no more: its RBAC, rendered
    // by Helm (for Kubernetes 1.21, which this 1.20 control plane is not: the chart refuses
    // the setting before it, for its webhook's namespaceSelector), applied here, and the
    // operator run as its service account, which the API server's authorizer then checks
    // at every call.
    let release = namespace("scoped-release");
    let rbac = helm(&[
        "template",
        "pdpair-scoped",
        &root().join("charts/pdpair").to_string_lossy(),
        "--namespace",
        &release,
        "--kube-version",
        "1.21.0",
        "--set",
        &format!("operator.watchNamespaces={{{scope}}}"),
        "--show-only",
        "templates/rbac.yaml",
    ]);
    assert_eq!(rbac.code, 0, "helm template: {}", rbac.stderr);
    assert!(
        !rbac.stdout.contains("kind: ClusterRoleBinding"),
        "rights in the watched namespaces only"
    );
    kubectl_ok(&["apply", "-f", "-"], Some(&rbac.stdout));
    let crds = pipe(
        &root().join("target/debug/pdpair-operator").to_string_lossy(),
        &["crd"],
        b"",
    );
    kubectl_ok(&["apply", "-f", "-"], Some(&String::from_utf8_lossy(&crds)));
    // Installing the webhook configuration takes rights over the cluster, so this operator does
    // not: the one an earlier operator here installed points at a port nothing serves now.
    delete_webhook_configuration();
    let account = format!("system:serviceaccount:{release}:pdpair-scoped-operator");
    for (ns, may) in [(&watched, "yes"), (&also, "yes"), (&other, "no")] {
        let out = kubectl(
            &[
                "auth",
                "can-i",
                "list",
                "pdpairs.pdpair.dev",
                "-n",
                ns,
                "--as",
                &account,
            ],
            None,
        );
        assert_eq!(out.stdout.trim(), may, "list pdpairs in {ns}: {}", out.stderr);
    }
    let config = kubeconfig_as(
        &account,
        &[
            "system:serviceaccounts",
            &format!("system:serviceaccounts:{release}"),
            "system:authenticated",
        ],
    );
    let op = Operator::start_as("scoped", &config, &release, &["--namespace", &scope]);
    for ns in [&watched, &also, &other] {
        kubectl_ok(
            &["apply", "-f", "-"],
            Some(&manifest("compatible-push.yaml", ns, |_| {})),
        );
    }
    for ns in [&watched, &also] {
        eventually(WAIT, "the watched pair's children and status", || {
            let p = get_json("pdpair", ns, "llama-8b")?;
            condition(&p, "GeometryCompatible")?;
            get_json("deployment", ns, "llama-8b-decode")?;
            pairing_secret(ns, "llama-8b")
        });
    }
    std::thread::sleep(Duration::from_secs(3));
    let pair = get_json("pdpair", &other, "llama-8b").expect("stored");
    assert!(
        pair["status"].is_null(),
        "another namespace's pair got a status: {pair}"
    );
    assert!(get_json("deployment", &other, "llama-8b-decode").is_none());
    assert!(pairing_secret(&other, "llama-8b").is_none());
    // A pool made bring-your-own: its Deployment is deleted, with an Event.
    remove_pool_template(&watched, "llama-8b", "decode");
    eventually(WAIT, "the decode Deployment pruned", || {
        get_json("deployment", &watched, "llama-8b-decode")
            .is_none()
            .then_some(())
    });
    event_with_reason(WAIT, &watched, "llama-8b", "Pruned", Some("Normal"));
    // Its Lease went through too, and no call was refused.
    assert!(op.is_leader(), "the operator leads with its Lease in {release}");
    let log = std::fs::read_to_string(dir().join("operator-scoped.log")).expect("log");
    assert!(!log.contains("forbidden"), "a call was refused: {log}");
    // A watched namespace deleted, its RoleBinding with it: its watches cannot list, for good.
    // Readiness waited for every watch, so a restarted operator was never ready, the webhook
    // Service had no endpoints, and `failurePolicy: Fail` refused every PDPair write. Now it is
    // ready (`start_as` waits for `/readyz`), answers reviews, runs the namespace it may list,
    // and tells the one it cannot.
    drop(op);
    kubectl_ok(&["delete", "namespace", &also, "--wait=false"], None);
    eventually(Duration::from_secs(120), "the namespace deleted", || {
        get_json("namespace", "", &also).is_none().then_some(())
    });
    let op = Operator::start_as("scoped-again", &config, &release, &["--namespace", &scope]);
    let object: serde_json::Value =
        serde_yaml::from_str(&manifest("compatible-push.yaml", &watched, |_| {})).expect("manifest");
    let review = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "review-scoped", "name": "llama-8b", "namespace": &watched, "operation": "CREATE",
            "kind": {"group": "pdpair.dev", "version": "v1alpha1", "kind": "PDPair"},
            "resource": {"group": "pdpair.dev", "version": "v1alpha1", "resource": "pdpairs"},
            "userInfo": {"username": "someone"}, "object": object, "dryRun": true,
        }
    });
    let (code, body) = post_webhook(op.webhook_port, &review.to_string());
    assert!(code == 200 && body.contains("\"allowed\":true"), "{code}: {body}");
    // The watched namespace lists a moment later; the deleted one never.
    eventually(WAIT, "one scope left unsynced", || {
        op.metrics()
            .lines()
            .any(|l| l == "pdpair_operator_watch_scopes_unsynced 1")
            .then_some(())
    });
    let (_, ready) = http_get(op.admin_port, "/readyz").expect("readyz");
    assert_eq!(ready, "ready (watches_synced=false)\n");
    eventually(WAIT, "the new operator to lead", || op.is_leader().then_some(()));
    kubectl_ok(
        &[
            "scale",
            "deployment",
            "llama-8b-prefill",
            "-n",
            &watched,
            "--replicas=5",
        ],
        None,
    );
    eventually(WAIT, "the watched namespace's pool put back", || {
        let d = get_json("deployment", &watched, "llama-8b-prefill")?;
        (d["spec"]["replicas"] == 2).then_some(())
    });
    kubectl_ok(
        &["delete", "-f", "-", "--wait=false", "--ignore-not-found"],
        Some(&rbac.stdout),
    );
}

#[test]
fn a_pool_keeps_the_pairing_secret_it_mounts_while_its_new_one_is_refused() {
    // An operator from before the pairing Secret's name held the pair's uid left pools mounting
    // `<name>-pairing`. This one renders `<name>-pairing-<uid>`; where a quota refuses its create,
    // the pools were rolled to pods mounting a Secret that does not exist, which never started
    // (and a rolling update takes down old pods meanwhile).
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut first = Operator::start("renamed-a");
    let ns = compatible_pair("renamed");
    let uid = get_json("pdpair", &ns, "llama-8b").expect("pair")["metadata"]["uid"]
        .as_str()
        .expect("uid")
        .to_owned();
    first.stop();
    kubectl_ok(
        &[
            "create",
            "secret",
            "generic",
            "llama-8b-pairing",
            "-n",
            &ns,
            "--from-literal=key=old",
        ],
        None,
    );
    let mounted = |role: &str| -> Option<String> {
        let d = get_json("deployment", &ns, &format!("llama-8b-{role}"))?;
        let volumes = d["spec"]["template"]["spec"]["volumes"].as_array()?.clone();
        volumes.iter().find(|v| v["name"] == "pdpair-pairing")?["secret"]["secretName"]
            .as_str()
            .map(str::to_owned)
    };
    for role in ["prefill", "decode"] {
        let d = get_json("deployment", &ns, &format!("llama-8b-{role}")).expect("Deployment");
        let at = d["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .position(|v| v["name"] == "pdpair-pairing")
            .expect("the pairing volume");
        let patch = format!(
            r#"[{{"op": "replace", "path": "/spec/template/spec/volumes/{at}/secret/secretName", "value": "llama-8b-pairing"}}]"#
        );
        kubectl_ok(
            &[
                "patch",
                "deployment",
                &format!("llama-8b-{role}"),
                "-n",
                &ns,
                "--type=json",
                "-p",
                &patch,
            ],
            None,
        );
        assert_eq!(mounted(role).as_deref(), Some("llama-8b-pairing"));
    }
    kubectl_ok(
        &["delete", "secret", &format!("llama-8b-pairing-{uid}"), "-n", &ns],
        None,
    );
    let quota = format!(
        r#"{{"apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {{"name": "no-secrets", "namespace": "{ns}"}},
            "spec": {{"hard": {{"secrets": "0"}}}}}}"#
    );
    kubectl_ok(&["apply", "-f", "-"], Some(&quota));
    eventually(WAIT, "the quota counted", || {
        get_json("resourcequota", &ns, "no-secrets")?["status"]["used"]
            .is_object()
            .then_some(())
    });
    let second = Operator::start("renamed-b");
    event_with_reason(WAIT, &ns, "llama-8b", "SecretRefused", Some("Warning"));
    eventually(WAIT, "both pools applied", || {
        (second.counter("pdpair_operator_deployment_applies_total") >= 2).then_some(())
    });
    for role in ["prefill", "decode"] {
        assert_eq!(
            mounted(role).as_deref(),
            Some("llama-8b-pairing"),
            "{role} keeps the Secret it mounts"
        );
    }
    // Lifted: the Secret is made at its next try (every 30 s while refused), and the pools move
    // to it.
    kubectl_ok(&["delete", "resourcequota", "no-secrets", "-n", &ns], None);
    let want = format!("llama-8b-pairing-{uid}");
    eventually(Duration::from_secs(90), "the pools on the new Secret", || {
        (mounted("prefill").as_deref() == Some(want.as_str()) && mounted("decode").as_deref() == Some(want.as_str()))
            .then_some(())
    });
    assert!(pairing_secret(&ns, "llama-8b").is_some());
}
