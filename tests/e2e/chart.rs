//! The Helm chart, rendered with `helm template` (Helm from `hack/helm.sh`, path in `$HELM`):
//! default and non-default values, the objects that matter, and every schema value used.

use std::{collections::BTreeSet, path::PathBuf, process::Command};

use pdpair_e2e::{base64_decode, pipe};
use serde_yaml::Value;

fn helm() -> String {
    std::env::var("HELM")
        .unwrap_or_else(|_| panic!("HELM is not set: run these tests with `make e2e` (hack/helm.sh installs Helm)"))
}

fn chart() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../charts/pdpair")
}

fn render(sets: &[&str]) -> Result<Vec<Value>, String> {
    let args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s]).collect();
    render_with(&args)
}

/// `helm template` with these arguments after the chart.
fn render_with(args: &[&str]) -> Result<Vec<Value>, String> {
    let mut cmd = Command::new(helm());
    cmd.args(["template", "rel"])
        .arg(chart())
        .args(["--namespace", "pdpair-system"])
        .args(args);
    let out = cmd.output().expect("helm runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    Ok(serde_yaml::Deserializer::from_str(&text)
        .filter_map(|d| serde::Deserialize::deserialize(d).ok())
        .filter(|v: &Value| !v.is_null())
        .collect())
}

fn find<'a>(objs: &'a [Value], kind: &str, name_suffix: &str) -> Option<&'a Value> {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"].as_str().is_some_and(|n| n.ends_with(name_suffix)))
}

fn get<'a>(objs: &'a [Value], kind: &str, name_suffix: &str) -> &'a Value {
    find(objs, kind, name_suffix).unwrap_or_else(|| panic!("no {kind} *{name_suffix} rendered"))
}

/// (apiGroup, resource) -> verbs of a ClusterRole.
fn verbs(role: &Value) -> Vec<(String, String, BTreeSet<String>)> {
    let mut out = Vec::new();
    for rule in role["rules"].as_sequence().expect("rules") {
        for g in rule["apiGroups"].as_sequence().expect("groups") {
            for r in rule["resources"].as_sequence().expect("resources") {
                let v: BTreeSet<String> = rule["verbs"]
                    .as_sequence()
                    .expect("verbs")
                    .iter()
                    .filter_map(|x| x.as_str().map(str::to_owned))
                    .collect();
                out.push((
                    g.as_str().unwrap_or("").to_owned(),
                    r.as_str().unwrap_or("").to_owned(),
                    v,
                ));
            }
        }
    }
    out
}

fn set(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn default_values_render_a_least_privilege_hardened_install() {
    let objs = render(&[]).expect("renders");
    // The webhook: Fail, no side effects, PDPair CREATE/UPDATE only, namespace opt-out, our CA.
    let hook = get(&objs, "ValidatingWebhookConfiguration", "rel-pdpair");
    let w = &hook["webhooks"][0];
    assert_eq!(w["failurePolicy"], "Fail");
    assert_eq!(w["sideEffects"], "NoneOnDryRun");
    assert_eq!(w["timeoutSeconds"], 5);
    let rule = &w["rules"][0];
    assert_eq!(rule["apiGroups"][0], "pdpair.dev");
    assert_eq!(rule["resources"], serde_yaml::to_value(["pdpairs"]).expect("yaml"));
    assert_eq!(
        rule["operations"],
        serde_yaml::to_value(["CREATE", "UPDATE"]).expect("yaml")
    );
    assert_eq!(
        w["namespaceSelector"]["matchExpressions"][0]["key"],
        "pdpair.dev/webhook"
    );
    assert_eq!(w["clientConfig"]["service"]["path"], "/validate/pdpairs");
    let secret = get(&objs, "Secret", "webhook-tls");
    assert_eq!(
        w["clientConfig"]["caBundle"], secret["data"]["ca.crt"],
        "the caBundle is the generated CA"
    );
    // The certificate covers the Service's names.
    let crt = base64_decode(secret["data"]["tls.crt"].as_str().expect("tls.crt"));
    let text = openssl_text(&crt);
    assert!(text.contains("DNS:rel-pdpair-webhook.pdpair-system.svc"), "{text}");
    // The operator: two replicas, probes on the admin port, hardened.
    let op = get(&objs, "Deployment", "operator");
    assert_eq!(op["spec"]["replicas"], 2);
    // On different nodes where the scheduler can (the webhook fails closed).
    let spread = &op["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        [0]["podAffinityTerm"];
    assert_eq!(spread["topologyKey"], "kubernetes.io/hostname", "{op:?}");
    assert_eq!(
        spread["labelSelector"]["matchLabels"],
        op["spec"]["selector"]["matchLabels"]
    );
    let c = &op["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["port"], "admin");
    // Every address of both families: the Pod IP the kubelet probes and the API server calls is
    // IPv6 in an IPv6 cluster.
    let args = operator_args(&objs);
    assert!(
        args.contains(&"--webhook-bind=:9443".to_owned()) && args.contains(&"--admin-bind=:8080".to_owned()),
        "{args:?}"
    );
    let sc = &c["securityContext"];
    assert_eq!(
        (
            sc["runAsNonRoot"].as_bool(),
            sc["readOnlyRootFilesystem"].as_bool(),
            sc["allowPrivilegeEscalation"].as_bool()
        ),
        (Some(true), Some(true), Some(false))
    );
    assert!(
        c["args"]
            .as_sequence()
            .expect("args")
            .iter()
            .any(|a| a == "--tls-cert=/etc/pdpair/tls/tls.crt")
    );
    assert_eq!(get(&objs, "PodDisruptionBudget", "operator")["spec"]["minAvailable"], 1);
    // One replica: a budget keeping one available would block every drain of its node.
    let one = render(&["operator.replicas=1"]).expect("render");
    assert!(find(&one, "PodDisruptionBudget", "operator").is_none());
    assert_eq!(get(&one, "Deployment", "operator")["spec"]["replicas"], 1);
    // RBAC: exactly what the code calls.
    let operator = verbs(get(&objs, "ClusterRole", "operator"));
    let expect = [
        ("pdpair.dev", "pdpairs", set(&["list", "watch"])),
        ("pdpair.dev", "pdpairs/status", set(&["patch"])),
        ("pdpair.dev", "pdendpoints", set(&["list", "watch"])),
        (
            "apps",
            "deployments",
            set(&["get", "list", "watch", "create", "patch", "delete"]),
        ),
        ("", "pods", set(&["list", "watch"])),
        ("", "secrets", set(&["create"])),
        ("events.k8s.io", "events", set(&["create"])),
    ];
    assert_eq!(
        operator,
        expect
            .iter()
            .map(|(g, r, v)| ((*g).to_owned(), (*r).to_owned(), v.clone()))
            .collect::<Vec<_>>()
    );
    let lease = verbs(get(&objs, "Role", "operator-lease"));
    assert_eq!(
        lease,
        vec![
            ("coordination.k8s.io".to_owned(), "leases".to_owned(), set(&["create"])),
            (
                "coordination.k8s.io".to_owned(),
                "leases".to_owned(),
                set(&["get", "update", "patch"])
            )
        ]
    );
    // Only the operator's own Lease is read or written (a create cannot be limited by name).
    let rules = get(&objs, "Role", "operator-lease")["rules"]
        .as_sequence()
        .expect("rules")
        .clone();
    assert_eq!(
        rules[1]["resourceNames"][0].as_str(),
        Some("pdpair-operator"),
        "{rules:?}"
    );
    assert!(rules[0]["resourceNames"].is_null(), "{rules:?}");
    let agent = verbs(get(&objs, "ClusterRole", "agent"));
    assert!(
        agent
            .iter()
            .all(|(_, r, v)| r != "secrets" && !v.contains("*") && !v.contains("delete")),
        "{agent:?}"
    );
    assert!(
        agent
            .iter()
            .any(|(_, r, v)| r == "pdendpoints/status" && v.contains("patch"))
    );
    // Attestation reads the engine's Pod and PDPair by name, nothing more.
    assert!(
        agent.iter().any(|(_, r, v)| r == "pdpairs" && *v == set(&["get"])),
        "{agent:?}"
    );
    assert!(
        agent.iter().any(|(_, r, v)| r == "pods" && *v == set(&["get"])),
        "{agent:?}"
    );
    // The agent: GPU nodes, the socket and pool hostPaths, IPC_LOCK, no host network by default.
    let ds = get(&objs, "DaemonSet", "agent");
    let spec = &ds["spec"]["template"]["spec"];
    assert_eq!(spec["nodeSelector"]["nvidia.com/gpu.present"], "true");
    assert_eq!(spec["hostNetwork"], false);
    assert!(
        spec["volumes"]
            .as_sequence()
            .expect("volumes")
            .iter()
            .any(|v| v["hostPath"]["path"] == "/var/run/pdpair")
    );
    let pools = spec["volumes"]
        .as_sequence()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "pools")
        .expect("a pools volume");
    assert_eq!(pools["hostPath"]["path"], "/dev/shm/pdpair");
    let args: Vec<&str> = spec["containers"][0]["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert!(
        args.contains(&"--pool-dir=/dev/shm/pdpair")
            && args.contains(&"--admin-bind=:9090")
            && args.contains(&"--clean-pool-dir")
            && args.contains(&"--stream-lanes=4")
            && !args.iter().any(|a| a.starts_with("--side-channel-ports")),
        "{args:?}"
    );
    assert!(
        spec["containers"][0]["volumeMounts"]
            .as_sequence()
            .expect("mounts")
            .iter()
            .any(|m| m["name"] == "pools" && m["mountPath"] == "/dev/shm/pdpair"),
        "the agent sees the pool directory at its host path"
    );
    assert_eq!(
        spec["containers"][0]["securityContext"]["capabilities"]["add"],
        serde_yaml::from_str::<serde_yaml::Value>("[IPC_LOCK]").expect("yaml")
    );
    assert!(find(&objs, "ServiceMonitor", "").is_none());
    assert!(spec["priorityClassName"].is_null(), "none by default");
}

fn openssl_text(pem: &[u8]) -> String {
    String::from_utf8_lossy(&pipe("openssl", &["x509", "-noout", "-text"], pem)).into_owned()
}

#[test]
fn non_default_values_change_what_they_should() {
    let objs = render(&[
        "webhook.url=https://127.0.0.1:9443",
        "agent.enabled=false",
        "operator.replicas=3",
        "operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=pool",
        "operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
        "metrics.serviceMonitor.enabled=true",
        "metrics.dashboard.enabled=true",
        "operator.podDisruptionBudget.enabled=false",
        "webhook.failurePolicy=Ignore",
    ])
    .expect("renders");
    let w = &get(&objs, "ValidatingWebhookConfiguration", "rel-pdpair")["webhooks"][0];
    assert_eq!(w["clientConfig"]["url"], "https://127.0.0.1:9443/validate/pdpairs");
    assert!(w["clientConfig"]["service"].is_null());
    assert_eq!(w["failurePolicy"], "Ignore");
    let crt = base64_decode(
        get(&objs, "Secret", "webhook-tls")["data"]["tls.crt"]
            .as_str()
            .expect("crt"),
    );
    assert!(
        openssl_text(&crt).contains("IP Address:127.0.0.1"),
        "the URL's host is in the certificate"
    );
    assert!(find(&objs, "DaemonSet", "agent").is_none());
    assert!(find(&objs, "ClusterRole", "agent").is_none());
    assert!(find(&objs, "PodDisruptionBudget", "operator").is_none());
    let op = get(&objs, "Deployment", "operator");
    assert_eq!(op["spec"]["replicas"], 3);
    // An affinity of the user's replaces the spread.
    let affinity = &op["spec"]["template"]["spec"]["affinity"];
    assert!(affinity["podAntiAffinity"].is_null(), "{affinity:?}");
    assert_eq!(
        affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"]
            [0]["key"],
        "pool"
    );
    assert!(find(&objs, "ServiceMonitor", "rel-pdpair").is_some());
    assert!(find(&objs, "PodMonitor", "").is_none(), "no agents, no agent monitor");
    let dash = get(&objs, "ConfigMap", "dashboard");
    let json: serde_json::Value =
        serde_json::from_str(dash["data"]["pdpair.json"].as_str().expect("json")).expect("dashboard is JSON");
    assert!(json["panels"].as_array().is_some_and(|p| !p.is_empty()));
    // Host networking and UCX settings reach the agent.
    let objs = render(&[
        "agent.hostNetwork=true",
        "agent.streamLanes=2",
        "agent.sideChannelPorts=40000-40999",
        "agent.ucx.tls=rc\\,sm",
        "agent.ucx.netDevices=mlx5_0:1",
        "agent.priorityClassName=system-node-critical",
    ])
    .expect("renders");
    let spec = &get(&objs, "DaemonSet", "agent")["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"], true);
    assert_eq!(spec["priorityClassName"], "system-node-critical");
    let args: Vec<&str> = spec["containers"][0]["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert!(
        args.contains(&"--stream-lanes=2") && args.contains(&"--side-channel-ports=40000-40999"),
        "{args:?}"
    );
    let env = spec["containers"][0]["env"].as_sequence().expect("env");
    assert!(env.iter().any(|e| e["name"] == "UCX_TLS" && e["value"] == "rc,sm"));
    assert!(
        env.iter()
            .any(|e| e["name"] == "UCX_NET_DEVICES" && e["value"] == "mlx5_0:1")
    );
    assert!(
        env.iter().any(|e| e["name"] == "UCX_MEM_EVENTS" && e["value"] == "n"),
        "no UCX memory hooks"
    );
    // The system's UCX unless the image's 1.22 is asked for.
    assert!(
        !env.iter()
            .any(|e| e["name"] == "LD_LIBRARY_PATH" || e["name"] == "UCX_MODULE_DIR")
    );
    let with_122 = render(&["agent.ucx.library=1.22"]).expect("renders");
    let env122 = get(&with_122, "DaemonSet", "agent")["spec"]["template"]["spec"]["containers"][0]["env"].clone();
    let env122 = env122.as_sequence().expect("env");
    assert!(
        env122
            .iter()
            .any(|e| e["name"] == "LD_LIBRARY_PATH" && e["value"] == "/opt/ucx-1.22/lib")
    );
    assert!(
        env122
            .iter()
            .any(|e| e["name"] == "UCX_MODULE_DIR" && e["value"] == "/opt/ucx-1.22/lib/ucx")
    );
    // By default UCX chooses; the operator hands the agents' socket group to engine pods.
    let args = |objs: &[serde_yaml::Value], kind: &str, name: &str| -> Vec<String> {
        get(objs, kind, name)["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_sequence()
            .expect("args")
            .iter()
            .filter_map(|a| a.as_str().map(str::to_owned))
            .collect()
    };
    assert!(args(&objs, "DaemonSet", "agent").contains(&"--transport=auto".to_owned()));
    // Only agents reach agents, but for the admin port; no policy for host-network agents.
    let plain = render(&[]).expect("renders");
    let policy = get(&plain, "NetworkPolicy", "agent");
    let selector = &get(&plain, "DaemonSet", "agent")["spec"]["template"]["metadata"]["labels"];
    assert_eq!(&policy["spec"]["podSelector"]["matchLabels"], selector);
    assert_eq!(
        &policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"],
        selector
    );
    assert_eq!(policy["spec"]["ingress"][1]["ports"][0]["port"], 9090);
    assert!(
        policy["spec"]["ingress"][1]["from"].is_null(),
        "the admin port is open to all"
    );
    assert_eq!(policy["spec"]["ingress"].as_sequence().map(Vec::len), Some(2));
    assert!(find(&objs, "NetworkPolicy", "agent").is_none(), "host networking");
    let off = render(&["agent.networkPolicy.enabled=false"]).expect("renders");
    assert!(find(&off, "NetworkPolicy", "agent").is_none());
    // Peers' UCX addresses are probed unless turned off.
    assert!(!args(&objs, "DaemonSet", "agent").contains(&"--no-ucx-probe".to_owned()));
    let unprobed = render(&["agent.ucx.probe=false"]).expect("renders");
    assert!(args(&unprobed, "DaemonSet", "agent").contains(&"--no-ucx-probe".to_owned()));
    // The probe mounts in namespaces of its own: the runtime's default seccomp and AppArmor
    // profiles would refuse it (the agent then does not start), so they are lifted for it: by
    // the pod annotation before Kubernetes 1.30, by the container's field from it.
    let template = |objs: &[Value]| get(objs, "DaemonSet", "agent")["spec"]["template"].clone();
    let apparmor = "container.apparmor.security.beta.kubernetes.io/agent";
    let old = template(&render_with(&["--kube-version", "1.29.0"]).expect("renders"));
    let new = template(&render_with(&["--kube-version", "1.30.0"]).expect("renders"));
    for t in [&old, &new] {
        assert_eq!(
            t["spec"]["containers"][0]["securityContext"]["seccompProfile"]["type"],
            "Unconfined"
        );
    }
    assert_eq!(old["metadata"]["annotations"][apparmor], "unconfined");
    assert!(old["spec"]["containers"][0]["securityContext"]["appArmorProfile"].is_null());
    assert_eq!(
        new["spec"]["containers"][0]["securityContext"]["appArmorProfile"]["type"],
        "Unconfined"
    );
    assert!(new["metadata"]["annotations"][apparmor].is_null());
    for version in ["1.29.0", "1.30.0"] {
        let t =
            template(&render_with(&["--kube-version", version, "--set", "agent.ucx.probe=false"]).expect("renders"));
        let sc = &t["spec"]["containers"][0]["securityContext"];
        assert!(
            sc["seccompProfile"].is_null() && sc["appArmorProfile"].is_null() && t["metadata"]["annotations"].is_null(),
            "no probe, the runtime's profiles: {t:?}"
        );
    }
    assert!(args(&objs, "Deployment", "operator").contains(&"--agent-socket-group=2000".to_owned()));
    // Engine pods mount the directory the agent listens in.
    assert!(args(&objs, "Deployment", "operator").contains(&"--agent-socket-dir=/var/run/pdpair".to_owned()));
    let moved = render(&["agent.socketDir=/run/pdpair"]).expect("renders");
    assert!(args(&moved, "Deployment", "operator").contains(&"--agent-socket-dir=/run/pdpair".to_owned()));
    assert!(args(&moved, "DaemonSet", "agent").contains(&"--socket=/run/pdpair/agent.sock".to_owned()));
    let objs = render(&["agent.socketGroup=0", "agent.ucx.transport=tcp"]).expect("renders");
    assert!(args(&objs, "DaemonSet", "agent").contains(&"--transport=tcp".to_owned()));
    assert!(
        !args(&objs, "Deployment", "operator")
            .iter()
            .any(|a| a.starts_with("--agent-socket-group")),
        "no socket group, nothing for the operator to add"
    );
}

#[test]
fn a_pod_monitor_scrapes_every_agent_pod_for_the_dashboards_agent_panels() {
    let objs = render(&[
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.labels.team=ml",
    ])
    .expect("renders");
    let agents = &get(&objs, "DaemonSet", "agent")["spec"]["template"];
    let monitor = get(&objs, "PodMonitor", "agent");
    assert_eq!(monitor["metadata"]["labels"]["team"], "ml");
    let selector = monitor["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .expect("matchLabels");
    assert!(!selector.is_empty());
    for (k, v) in selector {
        assert_eq!(&agents["metadata"]["labels"][k], v, "the agent Pods carry {k:?}");
    }
    let endpoint = &monitor["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["path"], "/metrics");
    let port = endpoint["port"].as_str().expect("a named port");
    assert!(
        agents["spec"]["containers"][0]["ports"]
            .as_sequence()
            .expect("ports")
            .iter()
            .any(|p| p["name"] == port),
        "the agent declares port {port}"
    );
}

#[test]
fn watched_namespaces_are_the_only_ones_the_operator_and_agents_have_rights_in_and_the_webhook_reviews() {
    let namespaces = ["team-a", "team-b"];
    let objs = render(&["operator.watchNamespaces={team-a,team-b}"]).expect("renders");
    assert!(
        find(&objs, "ClusterRoleBinding", "").is_none(),
        "no right anywhere but the watched namespaces"
    );
    for component in ["operator", "agent"] {
        let role = get(&objs, "ClusterRole", component);
        let mut bound: Vec<&str> = objs
            .iter()
            .filter(|o| o["kind"] == "RoleBinding" && o["roleRef"]["name"] == role["metadata"]["name"])
            .map(|b| {
                assert_eq!(b["roleRef"]["kind"], "ClusterRole");
                assert_eq!(
                    b["subjects"][0]["name"].as_str(),
                    role["metadata"]["name"].as_str(),
                    "its own ServiceAccount"
                );
                b["metadata"]["namespace"].as_str().expect("namespaced")
            })
            .collect();
        bound.sort();
        assert_eq!(bound, namespaces, "{component}'s rights");
    }
    assert!(operator_args(&objs).contains(&"--namespace=team-a,team-b".to_owned()));
    let selector = &get(&objs, "ValidatingWebhookConfiguration", "rel-pdpair")["webhooks"][0]["namespaceSelector"];
    let only = selector["matchExpressions"]
        .as_sequence()
        .expect("expressions")
        .iter()
        .find(|e| e["key"] == "kubernetes.io/metadata.name")
        .expect("the watched namespaces");
    assert_eq!(only["operator"], "In");
    assert_eq!(
        only["values"],
        serde_yaml::from_str::<serde_yaml::Value>("[team-a, team-b]").expect("yaml")
    );
    // Before 1.21 no namespace carries the label the webhook's selector needs: refused.
    let e = render_with(&["--kube-version", "1.20.2", "--set", "operator.watchNamespaces={team-a}"]).expect_err("1.20");
    assert!(e.contains("needs Kubernetes 1.21"), "{e}");
    // Unset: every namespace, by ClusterRoleBindings, and no --namespace.
    let objs = render(&[]).expect("renders");
    assert!(find(&objs, "RoleBinding", "pdpair-operator").is_none());
    assert!(
        find(&objs, "ClusterRoleBinding", "operator").is_some() && find(&objs, "ClusterRoleBinding", "agent").is_some()
    );
    assert!(!operator_args(&objs).iter().any(|a| a.starts_with("--namespace")));
}

#[test]
fn certificate_modes() {
    let objs = render(&["webhook.certificates.mode=cert-manager"]).expect("renders");
    let hook = get(&objs, "ValidatingWebhookConfiguration", "rel-pdpair");
    assert_eq!(
        hook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        "pdpair-system/rel-pdpair-webhook"
    );
    assert_eq!(
        get(&objs, "Certificate", "webhook")["spec"]["secretName"],
        "rel-pdpair-webhook-tls"
    );
    assert!(find(&objs, "Issuer", "selfsigned").is_some());
    assert!(
        find(&objs, "Secret", "webhook-tls").is_none(),
        "cert-manager writes the Secret"
    );
    let e = render(&["webhook.certificates.mode=secret"]).expect_err("needs a secret name");
    assert!(
        e.contains("is required when webhook.certificates.mode is secret"),
        "{e}"
    );
    let objs = render(&[
        "webhook.certificates.mode=secret",
        "webhook.certificates.secretName=mine",
        "webhook.certificates.caBundle=Q0E=",
    ])
    .expect("renders");
    assert_eq!(
        get(&objs, "ValidatingWebhookConfiguration", "rel-pdpair")["webhooks"][0]["clientConfig"]["caBundle"],
        "Q0E="
    );
    let op = get(&objs, "Deployment", "operator");
    assert_eq!(
        op["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"],
        "mine"
    );
}

/// The operator container's args.
fn operator_args(objs: &[Value]) -> Vec<String> {
    get(objs, "Deployment", "operator")["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect()
}

#[test]
fn a_webhook_client_ca_makes_the_operator_serve_only_the_callers_it_signed() {
    // Without one (the default: managed control planes cannot present a client certificate)
    // the webhook serves any caller.
    let objs = render(&[]).expect("renders");
    assert!(
        !operator_args(&objs)
            .iter()
            .any(|a| a.starts_with("--webhook-client-ca")),
        "{:?}",
        operator_args(&objs)
    );
    assert!(find(&objs, "ConfigMap", "webhook-client-ca").is_none());
    let dir = std::env::temp_dir().join(format!("pdpair-chart-client-ca-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let ca = dir.join("ca.crt");
    let pem = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n";
    std::fs::write(&ca, pem).expect("write");
    let file = format!("webhook.clientCA={}", ca.display());
    let objs = render_with(&["--set-file", &file]).expect("renders");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        get(&objs, "ConfigMap", "webhook-client-ca")["data"]["ca.crt"].as_str(),
        Some(pem),
        "the CA, byte for byte"
    );
    assert!(operator_args(&objs).contains(&"--webhook-client-ca=/etc/pdpair/client-ca/ca.crt".to_owned()));
    let pod = &get(&objs, "Deployment", "operator")["spec"]["template"];
    let mounted = pod["spec"]["containers"][0]["volumeMounts"]
        .as_sequence()
        .expect("mounts")
        .iter()
        .find(|m| m["mountPath"] == "/etc/pdpair/client-ca")
        .expect("the CA is mounted");
    let volume = pod["spec"]["volumes"]
        .as_sequence()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == mounted["name"])
        .expect("its volume");
    assert_eq!(volume["configMap"]["name"], "rel-pdpair-webhook-client-ca");
    // Read once at start: a new CA must roll the pods.
    assert!(
        pod["metadata"]["annotations"]["pdpair.dev/webhook-client-ca-sha256"]
            .as_str()
            .is_some_and(|h| h.len() == 64),
        "{:?}",
        pod["metadata"]
    );
}

#[test]
fn bad_values_fail_with_the_path_and_the_value() {
    for (set, want) in [
        ("operator.replicas=0", "/operator/replicas"),
        ("webhook.certificates.mode=selfmade", "/webhook/certificates/mode"),
        ("webhook.url=http://127.0.0.1:9443", "/webhook/url"),
        ("agent.ucx.transport=ib", "/agent/ucx/transport"),
        ("agent.ucx.library=1.23", "/agent/ucx/library"),
        ("agent.ucx.probe=maybe", "/agent/ucx/probe"),
        ("agent.streamLanes=9", "/agent/streamLanes"),
        ("agent.sideChannelPorts=80-90", "/agent/sideChannelPorts"),
        ("agent.sideChannelPorts=40000", "/agent/sideChannelPorts"),
        ("agent.sideChannelPorts=1000-2000", "/agent/sideChannelPorts"),
        ("agent.sideChannelPorts=40000-65536", "/agent/sideChannelPorts"),
        ("operator.leaseDuration=soon", "/operator/leaseDuration"),
        ("operator.leaseDuration=10000000000s", "/operator/leaseDuration"),
        ("operator.leaseDuration=1s1s1s1s1s", "/operator/leaseDuration"),
        (
            "operator.podDisruptionBudget.minAvailable=2",
            "operator.podDisruptionBudget.minAvailable is 2 with operator.replicas 2",
        ),
        (
            "operator.podDisruptionBudget.minAvailable=100%",
            "operator.podDisruptionBudget.minAvailable is 100%",
        ),
        (
            // Rounded up: 2 of 2 replicas.
            "operator.podDisruptionBudget.minAvailable=51%",
            "operator.podDisruptionBudget.minAvailable is 51%",
        ),
        ("agent.socketDir=/", "/agent/socketDir"),
        ("agent.priorityClassName=Node_Critical", "/agent/priorityClassName"),
        ("agent.socketDir=/var/run/../run", "/agent/socketDir"),
        ("agent.poolDir=/dev/shm/", "/agent/poolDir"),
        (
            "operator.podDisruptionBudget.minAvailable=half",
            "/operator/podDisruptionBudget/minAvailable",
        ),
        ("agent.ucx.extraEnv.UCX_A:B=1", "/agent/ucx/extraEnv"),
        ("operator.typo=1", "typo"),
        ("webhook.clientCA=not a certificate", "/webhook/clientCA"),
        ("operator.watchNamespaces={Team-A}", "/operator/watchNamespaces/0"),
        ("operator.watchNamespaces={a,a}", "/operator/watchNamespaces"),
    ] {
        let e = render(&[set]).expect_err(set);
        assert!(e.contains(want), "{set}: {e}");
    }
}

#[test]
fn every_value_in_the_schema_is_used_by_a_template() {
    let schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(chart().join("values.schema.json")).expect("schema"))
            .expect("JSON");
    let mut leaves = Vec::new();
    fn walk(path: &str, node: &serde_json::Value, out: &mut Vec<String>) {
        match node["properties"].as_object() {
            Some(props) => {
                for (k, v) in props {
                    walk(
                        &if path.is_empty() {
                            k.clone()
                        } else {
                            format!("{path}.{k}")
                        },
                        v,
                        out,
                    );
                }
            }
            None => out.push(path.to_owned()),
        }
    }
    walk("", &schema, &mut leaves);
    let mut templates = String::new();
    for entry in std::fs::read_dir(chart().join("templates")).expect("templates") {
        templates.push_str(&std::fs::read_to_string(entry.expect("entry").path()).expect("read"));
    }
    let unused: Vec<&String> = leaves
        .iter()
        .filter(|leaf| {
            // A value counts as used when it, or an object holding it, is referenced.
            let parts: Vec<&str> = leaf.split('.').collect();
            !(1..=parts.len()).any(|n| {
                let prefix = parts[..n].join(".");
                templates.contains(&format!(".Values.{prefix} "))
                    || templates.contains(&format!(".Values.{prefix}}}"))
                    || templates.contains(&format!(".Values.{prefix} |"))
                    || templates.contains(&format!(".Values.{prefix}\n"))
            })
        })
        .collect();
    assert!(
        unused.is_empty(),
        "values in the schema that no template uses: {unused:?}"
    );
    // And every value in values.yaml is in the schema (additionalProperties: false enforces the
    // rest at install time).
    assert!(leaves.len() > 30, "{leaves:?}");
}

#[test]
fn chart_crds_are_the_generated_ones() {
    for file in ["pdpair.dev_pdpairs.yaml", "pdpair.dev_pdendpoints.yaml"] {
        let a = std::fs::read_to_string(chart().join("crds").join(file)).expect("chart CRD");
        let b = std::fs::read_to_string(chart().join("../../crds").join(file)).expect("CRD");
        assert_eq!(a, b, "{file}");
    }
}

#[test]
fn helm_lint_is_clean() {
    let out = Command::new(helm())
        .args(["lint", "--strict"])
        .arg(chart())
        .output()
        .expect("helm lint");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(!text.contains("[WARNING]") && !text.contains("[ERROR]"), "{text}");
}

#[test]
fn the_out_of_cluster_command_in_the_notes_runs_as_the_charts_replicas_do() {
    // The chart's operator replicas still run with webhook.url: the command the NOTES print must
    // take their Lease, their engine wiring and their namespaces, or it leads beside them (its
    // Lease in `default`) and reconciles every namespace.
    let notes = |sets: &[&str]| {
        let mut cmd = Command::new(helm());
        cmd.args(["install", "rel"])
            .arg(chart())
            .args(["--dry-run=client", "--namespace", "pdpair-system"]);
        for s in sets {
            cmd.args(["--set", s]);
        }
        let out = cmd.output().expect("helm runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines()
            .find(|l| l.trim_start().starts_with("pdpair-operator run"))
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("no operator command in the notes: {text}"))
    };
    let url = "webhook.url=https://127.0.0.1:19443";
    let plain = notes(&[url]);
    for want in [
        "--lease-namespace pdpair-system",
        "--agent-socket-dir /var/run/pdpair",
        "--agent-socket-group 2000",
    ] {
        assert!(plain.contains(want), "{want:?} in {plain}");
    }
    assert!(!plain.contains("--namespace "), "{plain}");
    let scoped = notes(&[url, "operator.watchNamespaces={team-a,team-b}"]);
    assert!(scoped.contains("--namespace team-a,team-b"), "{scoped}");
}
