//! `helm install` into the real control plane, with the operator running out of cluster behind
//! `webhook.url` and serving the certificate the chart generated. No kubelet runs, so the chart's
//! operator Deployment and agent DaemonSet do not start pods; the out-of-cluster operator does the
//! work, exactly as in the demo.

use std::{path::PathBuf, time::Duration};

use pdpair_e2e::*;

const WAIT: Duration = Duration::from_secs(60);
const NS: &str = "pdpair-system";

#[track_caller]
fn helm_ok(args: &[&str]) -> String {
    let out = helm(args);
    assert_eq!(out.code, 0, "helm {args:?}: {}{}", out.stdout, out.stderr);
    out.stdout
}

fn chart() -> String {
    root().join("charts/pdpair").to_string_lossy().into_owned()
}

/// Writes the chart's serving certificate and key to files, as `NOTES.txt` tells a user to.
fn chart_certificate(dir: &std::path::Path) -> (PathBuf, PathBuf, String) {
    let secret = eventually(WAIT, "the chart's webhook Secret", || {
        get_json("secret", NS, "pdpair-webhook-tls")
    });
    let decode = |field: &str| base64_decode(secret["data"][field].as_str().unwrap_or_else(|| panic!("{field}")));
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&cert, decode("tls.crt")).expect("write cert");
    std::fs::write(&key, decode("tls.key")).expect("write key");
    (cert, key, secret["data"]["ca.crt"].as_str().unwrap_or("").to_owned())
}

/// What `user` may do in namespace `ns`, as the API server's authorizer says
/// (`kubectl auth can-i --list`): one `resource [verbs]` line per rule, minus what every
/// service account may do (the namespace's `default` account's list).
fn may(user: &str, ns: &str) -> std::collections::BTreeSet<String> {
    let list = |as_user: &str| -> std::collections::BTreeSet<String> {
        let out = kubectl_ok(&["auth", "can-i", "--list", "--as", as_user, "-n", ns], None);
        out.lines()
            .skip(1)
            .filter_map(|line| {
                // `Resources  Non-Resource URLs  Resource Names  Verbs`: the resource column is
                // blank for non-resource URLs; the other three are [bracketed] lists.
                let resource = if line.starts_with(' ') || line.starts_with('[') {
                    ""
                } else {
                    line.split_whitespace().next()?
                };
                let groups: Vec<&str> = line.split('[').skip(1).filter_map(|g| g.split(']').next()).collect();
                let [urls, names, verbs] = groups[..] else { return None };
                let mut verbs: Vec<&str> = verbs.split_whitespace().collect();
                verbs.sort_unstable();
                Some(format!("{resource}{urls} names[{names}] [{}]", verbs.join(" ")))
            })
            .collect()
    };
    let baseline = list(&format!("system:serviceaccount:{ns}:default"));
    list(user).difference(&baseline).cloned().collect()
}

/// The chart's service accounts may do exactly what the operator's and the agent's code call, in
/// a workload namespace and in the release's; RBAC that grows or breaks fails here.
fn least_privilege() {
    let ns = namespace("rbac");
    let set = |lines: &[&str]| {
        lines
            .iter()
            .map(|l| (*l).to_owned())
            .collect::<std::collections::BTreeSet<_>>()
    };
    let operator = set(&[
        "pdpairs.pdpair.dev names[] [list watch]",
        "pdpairs.pdpair.dev/status names[] [patch]",
        "pdendpoints.pdpair.dev names[] [list watch]",
        "deployments.apps names[] [create delete get list patch watch]",
        "pods names[] [list watch]",
        "secrets names[] [create]",
        "events.events.k8s.io names[] [create]",
    ]);
    let agent = set(&[
        "pdendpoints.pdpair.dev names[] [create patch]",
        "pdendpoints.pdpair.dev/status names[] [patch]",
        "pods names[] [get]",
        "pdpairs.pdpair.dev names[] [get]",
    ]);
    let sa = |name: &str| format!("system:serviceaccount:{NS}:pdpair-{name}");
    assert_eq!(
        may(&sa("operator"), &ns),
        operator,
        "the operator in a workload namespace"
    );
    assert_eq!(may(&sa("agent"), &ns), agent, "the agent in a workload namespace");
    let mut in_release = operator.clone();
    // Any Lease created (a create cannot be limited by name), only its own read and written.
    in_release.insert("leases.coordination.k8s.io names[] [create]".to_owned());
    in_release.insert("leases.coordination.k8s.io names[pdpair-operator] [get patch update]".to_owned());
    assert_eq!(
        may(&sa("operator"), NS),
        in_release,
        "the operator in its own namespace: its Lease too"
    );
}

#[test]
fn helm_install_upgrade_uninstall_with_the_operator_out_of_cluster() {
    // Webhook configurations left by earlier local-mode runs would point at stopped operators.
    delete_webhook_configuration();
    let port = Operator::free_port();
    let url = format!("https://127.0.0.1:{port}");
    let url_set = format!("webhook.url={url}");
    helm_ok(&[
        "install",
        "pdpair",
        &chart(),
        "--namespace",
        NS,
        "--create-namespace",
        "--set",
        &url_set,
    ]);
    let work = dir().join("helm");
    std::fs::create_dir_all(&work).expect("dir");
    let (cert, key, ca) = chart_certificate(&work);
    let hook = get_json("validatingwebhookconfiguration", "", "pdpair").expect("the chart's webhook configuration");
    assert_eq!(
        hook["webhooks"][0]["clientConfig"]["url"],
        format!("{url}/validate/pdpairs")
    );
    assert_eq!(hook["webhooks"][0]["clientConfig"]["caBundle"], ca.as_str());
    let mut op = Operator::start_serving("helm", port, &cert, &key);
    least_privilege();

    // Through the installed webhook configuration: the vLLM mismatch is refused, the compatible
    // pair admitted.
    let ns = namespace("helm");
    let out = kubectl(
        &["apply", "-f", "-"],
        Some(&manifest("vllm-push-16-64.yaml", &ns, |_| {})),
    );
    assert_ne!(out.code, 0);
    assert!(out.stderr.contains("KernelBlockSizeMismatch"), "{}", out.stderr);
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&manifest("compatible-push.yaml", &ns, |_| {})),
    );
    eventually(WAIT, "the pair's Deployments", || {
        get_json("deployment", &ns, "llama-8b-decode")
    });

    // Upgrade: values change, the certificate stays (the running operator keeps serving it).
    helm_ok(&[
        "upgrade",
        "pdpair",
        &chart(),
        "--namespace",
        NS,
        "--set",
        &url_set,
        "--set",
        "operator.replicas=3",
    ]);
    let deployment = get_json("deployment", NS, "pdpair-operator").expect("operator Deployment");
    assert_eq!(deployment["spec"]["replicas"], 3);
    let (_, _, ca_after) = chart_certificate(&work);
    assert_eq!(ca_after, ca, "an upgrade keeps the webhook certificate");
    let out = kubectl(
        &["apply", "-f", "-"],
        Some(&manifest("vllm-push-flashinfer-128-64.yaml", &ns, |_| {})),
    );
    assert!(out.stderr.contains("KernelBlocksPerLogicalMismatch"), "{}", out.stderr);

    // An upgrade that moves the webhook to another host makes a certificate for it (one kept
    // for the old names fails every call's x509 check, and with failurePolicy Fail refuses
    // every PDPair).
    let moved = format!("webhook.url=https://127.0.0.2:{port}");
    helm_ok(&["upgrade", "pdpair", &chart(), "--namespace", NS, "--set", &moved]);
    let (cert_moved, _, ca_moved) = chart_certificate(&work);
    assert_ne!(ca_moved, ca, "a certificate for the new host");
    // The certificate's DER holds the SAN iPAddress 127.0.0.2 ([7], 4 bytes).
    let pem = std::fs::read_to_string(&cert_moved).expect("cert");
    let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    let der = base64_decode(&body);
    assert!(
        der.windows(6).any(|w| w == [0x87, 4, 127, 0, 0, 2]),
        "no SAN for 127.0.0.2 in the regenerated certificate"
    );
    let hook = get_json("validatingwebhookconfiguration", "", "pdpair").expect("the webhook configuration");
    assert_eq!(hook["webhooks"][0]["clientConfig"]["caBundle"], ca_moved.as_str());

    // Uninstall: nothing of the release is left but the CRDs (Helm keeps crds/).
    helm_ok(&["uninstall", "pdpair", "--namespace", NS]);
    op.stop();
    eventually(WAIT, "the release's objects to go", || release_gone(NS).then_some(()));
    assert!(get_json("validatingwebhookconfiguration", "", "pdpair").is_none());
    assert!(
        get_json("crd", "", "pdpairs.pdpair.dev").is_some(),
        "CRDs stay, as Helm does"
    );
    assert!(get_json("crd", "", "pdendpoints.pdpair.dev").is_some());
    // With the webhook gone, PDPairs are no longer checked: say so by showing it.
    let after = kubectl(
        &["apply", "--dry-run=server", "-f", "-"],
        Some(&manifest("vllm-push-16-64.yaml", &ns, |_| {})),
    );
    assert_eq!(after.code, 0, "no webhook after uninstall: {}", after.stderr);
    let _ = std::fs::remove_dir_all(&work);
}
