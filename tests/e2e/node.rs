//! pdpair in the cluster as a user installs it, on a real node (hack/node.sh: containerd, runc,
//! the CNI bridge, a kubelet and kube-proxy; `hack/e2e-node.sh` runs this): `helm install` with
//! the default values (no `webhook.url`, the chart's own certificate), the operator as two pods
//! under the chart's service account serving the webhook through its Service, the agent as the
//! DaemonSet, and engine pods the operator makes from a PDPair running the test engine, attested
//! by the agent pod. No GPU and no model here: the engines move a synthetic pattern, every byte
//! of which decode checks.

use std::time::Duration;

use pdpair_e2e::*;

const WAIT: Duration = Duration::from_secs(120);
const NS: &str = "pdpair-system";

/// The pods matching `selector` in `ns`, when there are `n` and all are Ready.
fn ready_pods(ns: &str, selector: &str, n: usize) -> Option<Vec<String>> {
    let out = kubectl(&["get", "pods", "-n", ns, "-l", selector, "-o", "json"], None);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).ok()?;
    let pods: Vec<&serde_json::Value> = v["items"]
        .as_array()?
        .iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .collect();
    let ready = |p: &&serde_json::Value| {
        p["status"]["conditions"]
            .as_array()
            .is_some_and(|cs| cs.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
    };
    (pods.len() == n && pods.iter().all(ready)).then(|| {
        pods.iter()
            .filter_map(|p| p["metadata"]["name"].as_str().map(String::from))
            .collect()
    })
}

/// The prefill engine's side-channel address, from its PDEndpoint.
fn prefill_address(ns: &str) -> Option<String> {
    let out = kubectl(&["get", "pdendpoints", "-n", ns, "-o", "json"], None);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).ok()?;
    v["items"]
        .as_array()?
        .iter()
        .find(|e| e["spec"]["role"] == "prefill")
        .and_then(|e| e["spec"]["address"].as_str().map(String::from))
}

/// One transfer from the prefill engine at `address`, run in the decode pod (`kubectl exec`).
fn transfer(ns: &str, address: &str) -> Out {
    kubectl(
        &[
            "exec",
            "-n",
            ns,
            "deploy/test-pair-decode",
            "--",
            "pdpair-agent",
            "test-engine",
            "--prefill",
            address,
        ],
        None,
    )
}

#[test]
fn helm_install_runs_pdpair_in_pods_and_a_pair_turns_ready_with_a_transfer() {
    let chart = root().join("charts/pdpair");
    let install = helm(&[
        "install",
        "pdpair",
        &chart.to_string_lossy(),
        "--namespace",
        NS,
        "--create-namespace",
    ]);
    assert_eq!(install.code, 0, "{}{}", install.stdout, install.stderr);
    eventually(WAIT, "two operator pods Ready", || {
        ready_pods(NS, "app.kubernetes.io/component=operator", 2)
    });
    eventually(WAIT, "the agent DaemonSet's pod Ready", || {
        ready_pods(NS, "app.kubernetes.io/component=agent", 1)
    });
    // The operators run as the chart's service account, and one of them holds the Lease.
    let op = get_json("deployment", NS, "pdpair-operator").expect("operator Deployment");
    assert_eq!(op["spec"]["template"]["spec"]["serviceAccountName"], "pdpair-operator");
    let leader = eventually(WAIT, "a leader", || {
        let lease = get_json("lease", NS, "pdpair-operator")?;
        lease["spec"]["holderIdentity"].as_str().map(String::from)
    });

    // The webhook answers through its Service: the vLLM mismatch is refused at kubectl apply.
    let ns = namespace("node");
    let refused = || {
        kubectl(
            &["apply", "-f", "-"],
            Some(&manifest("vllm-push-16-64.yaml", &ns, |_| {})),
        )
    };
    let out = refused();
    assert_ne!(out.code, 0, "{}", out.stdout);
    assert!(out.stderr.contains("KernelBlockSizeMismatch"), "{}", out.stderr);

    // The test pair: its engine pods run, register with the agent pod (attested as their Pods),
    // and the pair turns Ready.
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&manifest("test-engine-pair.yaml", &ns, |_| {})),
    );
    eventually(WAIT, "both engine pods Ready", || {
        ready_pods(&ns, "pdpair.dev/name=test-pair", 2)
    });
    // The example sets no fsGroup: the operator gave its non-root engines the agent's socket group.
    let d = get_json("deployment", &ns, "test-pair-prefill").expect("the prefill Deployment");
    assert_eq!(d["spec"]["template"]["spec"]["securityContext"]["fsGroup"], 2000, "{d}");
    let address = eventually(WAIT, "the prefill PDEndpoint", || prefill_address(&ns));
    // kubectl logs reaches the kubelet: the prefill engine said where the agent put it.
    let logs = kubectl_ok(&["logs", "-n", &ns, "deploy/test-pair-prefill"], None);
    assert!(logs.contains("\"registered\""), "{logs}");
    let out = transfer(&ns, &address);
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("\"type\":\"RequestDone\"")
            && out.stdout.contains("\"checksum\":\"Verified\"")
            && out.stdout.contains("\"bad_tokens\":0"),
        "{}",
        out.stdout
    );
    let pair = eventually(WAIT, "the pair Ready with the transfer in its totals", || {
        let p = get_json("pdpair", &ns, "test-pair")?;
        (condition(&p, "Ready")?.0 == "True"
            && condition(&p, "TransferReady")?.0 == "True"
            && p["status"]["transfer"]["transfersCompleted"].as_i64() >= Some(1))
        .then_some(p)
    });
    assert_eq!(pair["status"]["transfer"]["endpoints"], 2, "{}", pair["status"]);
    let printed = kubectl_ok(&["get", "pdp", "test-pair", "-n", &ns], None);
    assert!(printed.lines().nth(1).is_some_and(|l| l.contains("True")), "{printed}");
    // The path, as the chart's default (`transport: auto`) let UCX choose it: both engines are
    // behind the node's one agent, which reaches its own worker through UCX's `self`.
    let path = eventually(WAIT, "the pair's TransferPath", || {
        let p = get_json("pdpair", &ns, "test-pair")?;
        condition(&p, "TransferPath").filter(|c| c.0 == "True")
    });
    assert_eq!(path.1, "Local", "{}", pair["status"]);
    let printed = kubectl_ok(&["get", "pdp", "test-pair", "-n", &ns], None);
    assert!(printed.lines().nth(1).is_some_and(|l| l.contains("Local")), "{printed}");
    let endpoints = kubectl_ok(&["get", "pde", "-n", &ns, "-o", "json"], None);
    let endpoints: serde_json::Value = serde_json::from_str(&endpoints).expect("json");
    let lanes: Vec<&serde_json::Value> = endpoints["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter_map(|e| e["status"]["paths"].get(0))
        .map(|p| &p["lanes"][0])
        .collect();
    assert_eq!(
        lanes,
        [&serde_json::json!("self/memory0")],
        "prefill's endpoint alone: {endpoints}"
    );

    // The leader's pod goes: the other takes the Lease, and the webhook keeps answering.
    kubectl_ok(&["delete", "pod", "-n", NS, &leader, "--wait=false"], None);
    let out = refused();
    assert!(
        out.stderr.contains("KernelBlockSizeMismatch"),
        "with the leader gone: {}",
        out.stderr
    );
    eventually(WAIT, "another leader", || {
        let lease = get_json("lease", NS, "pdpair-operator")?;
        let holder = lease["spec"]["holderIdentity"].as_str()?;
        (holder != leader).then_some(())
    });

    // The agent's pod goes: a request then fails with a reason; once the DaemonSet's new pod is
    // up and the prefill engine registered again, requests succeed.
    let agent = ready_pods(NS, "app.kubernetes.io/component=agent", 1).expect("the agent pod")[0].clone();
    kubectl_ok(
        &["delete", "pod", "-n", NS, &agent, "--wait=true", "--timeout=60s"],
        None,
    );
    let out = transfer(&ns, &address);
    assert_ne!(out.code, 0, "a transfer with the agent gone: {}", out.stdout);
    assert!(!out.stderr.trim().is_empty(), "it says why");
    eventually(WAIT, "a new agent pod Ready", || {
        ready_pods(NS, "app.kubernetes.io/component=agent", 1).filter(|p| p[0] != agent)
    });
    eventually(Duration::from_secs(180), "a transfer through the new agent", || {
        let address = prefill_address(&ns)?;
        let out = transfer(&ns, &address);
        (out.code == 0 && out.stdout.contains("\"bad_tokens\":0")).then_some(())
    });

    // The image's UCX 1.22 (agent.ucx.library) and the agents' own side-channel ports: the
    // DaemonSet's pod is replaced, the engines register again (the prefill engine at a port of
    // the range), and transfers go through an agent that loaded 1.22, as its PDEndpoint says.
    let agent = ready_pods(NS, "app.kubernetes.io/component=agent", 1).expect("the agent pod")[0].clone();
    let out = helm(&[
        "upgrade",
        "pdpair",
        &chart.to_string_lossy(),
        "--namespace",
        NS,
        "--reuse-values",
        "--set",
        "agent.ucx.library=1.22",
        "--set",
        "agent.sideChannelPorts=40000-40999",
    ]);
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
    eventually(WAIT, "the agent pod on UCX 1.22 Ready", || {
        ready_pods(NS, "app.kubernetes.io/component=agent", 1).filter(|p| p[0] != agent)
    });
    let version = eventually(Duration::from_secs(180), "a transfer through UCX 1.22", || {
        let address = prefill_address(&ns)?;
        let port: u16 = address.rsplit_once(':')?.1.parse().ok()?;
        if !(40000..=40999).contains(&port) {
            return None;
        }
        let out = transfer(&ns, &address);
        if out.code != 0 || !out.stdout.contains("\"bad_tokens\":0") {
            return None;
        }
        let endpoints: serde_json::Value =
            serde_json::from_str(&kubectl_ok(&["get", "pde", "-n", &ns, "-o", "json"], None)).ok()?;
        endpoints["items"]
            .as_array()?
            .iter()
            .filter_map(|e| e["status"]["paths"].get(0))
            .find(|p| p["ucxVersion"].as_str().is_some_and(|v| v.starts_with("1.22")))
            .map(|p| (p["ucxVersion"].clone(), p["lanes"].clone(), p["kind"].clone()))
    });
    assert_eq!(version.2, "Local", "{version:?}");
    assert_eq!(version.1, serde_json::json!(["self/memory"]), "{version:?}");

    // Uninstall: the pair is the user's; with it deleted, nothing of the release is left but the
    // CRDs.
    kubectl_ok(&["delete", "pdpair", "test-pair", "-n", &ns, "--wait=false"], None);
    let out = helm(&["uninstall", "pdpair", "--namespace", NS]);
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
    eventually(WAIT, "the release's objects to go", || release_gone(NS).then_some(()));
    assert!(
        get_json("crd", "", "pdpairs.pdpair.dev").is_some(),
        "CRDs stay, as Helm does"
    );
}
