//! Harness for end-to-end tests against a real control plane (etcd + kube-apiserver +
//! kube-controller-manager + kube-scheduler from `hack/control-plane.sh`). No kubelet runs: tests
//! that need Ready pods mark them Ready themselves, and say so.
//!
//! `hack/e2e.sh` starts the control plane, exports `PDPAIR_E2E_DIR`, runs each test binary, and
//! stops every operator the harness started (their pids are in `$PDPAIR_E2E_DIR/operator-pids`).

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use kube::{
    Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
};

/// The control plane's directory, from `PDPAIR_E2E_DIR`.
pub fn dir() -> PathBuf {
    match std::env::var_os("PDPAIR_E2E_DIR") {
        Some(d) => PathBuf::from(d),
        None => panic!(
            "PDPAIR_E2E_DIR is not set: these tests need the real control plane; run them with `make e2e` (or `make test`)"
        ),
    }
}

/// The admin kubeconfig.
pub fn kubeconfig() -> PathBuf {
    dir().join("kubeconfig")
}

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A kube client for the control plane.
pub async fn client() -> Client {
    let kc = Kubeconfig::read_from(kubeconfig()).expect("read kubeconfig");
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("kubeconfig config");
    Client::try_from(config).expect("client")
}

/// The result of a command.
#[derive(Debug)]
pub struct Out {
    /// Exit code.
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// Runs kubectl against the control plane, as a user would.
pub fn kubectl(args: &[&str], stdin: Option<&str>) -> Out {
    let mut child = Command::new("kubectl")
        .args(args)
        .env("KUBECONFIG", kubeconfig())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl runs");
    let mut input = child.stdin.take().expect("stdin");
    input.write_all(stdin.unwrap_or("").as_bytes()).expect("write stdin");
    drop(input);
    let out = child.wait_with_output().expect("kubectl finishes");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Like [`kubectl`], but panics unless it succeeds; returns stdout.
#[track_caller]
pub fn kubectl_ok(args: &[&str], stdin: Option<&str>) -> String {
    let out = kubectl(args, stdin);
    assert_eq!(out.code, 0, "kubectl {args:?} failed: {}{}", out.stdout, out.stderr);
    out.stdout
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Creates a fresh namespace for one test.
pub fn namespace(test: &str) -> String {
    let name = format!(
        "e2e-{test}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    )
    .replace('_', "-");
    kubectl_ok(&["create", "namespace", &name], None);
    name
}

/// An example manifest placed in `ns`, optionally edited.
pub fn manifest(example: &str, ns: &str, edit: impl FnOnce(&mut serde_yaml::Value)) -> String {
    let text = std::fs::read_to_string(root().join("examples").join(example)).expect("example exists");
    let mut v: serde_yaml::Value = serde_yaml::from_str(&text).expect("example parses");
    v["metadata"]["namespace"] = ns.into();
    edit(&mut v);
    serde_yaml::to_string(&v).expect("serialises")
}

/// Polls `f` every 200 ms until it returns Some, or panics after `timeout` naming `what`.
#[track_caller]
pub fn eventually<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The object as JSON, or None when it does not exist.
pub fn get_json(kind: &str, ns: &str, name: &str) -> Option<serde_json::Value> {
    // An empty namespace means a cluster-scoped object.
    let out = if ns.is_empty() {
        kubectl(&["get", kind, name, "-o", "json"], None)
    } else {
        kubectl(&["get", kind, name, "-n", ns, "-o", "json"], None)
    };
    if out.code != 0 {
        return None;
    }
    serde_json::from_str(&out.stdout).ok()
}

/// The pairing Secret of the PDPair `pair` as it is now (its name holds the pair's uid), or None
/// when either does not exist.
pub fn pairing_secret(ns: &str, pair: &str) -> Option<serde_json::Value> {
    let uid = get_json("pdpair", ns, pair)?["metadata"]["uid"].as_str()?.to_owned();
    get_json("secret", ns, &format!("{pair}-pairing-{uid}"))
}

/// A condition of a PDPair, whole (status, reason, message...).
pub fn condition_of(pair: &serde_json::Value, type_: &str) -> Option<serde_json::Value> {
    pair["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .cloned()
}

/// A condition's status on a PDPair.
pub fn condition(pair: &serde_json::Value, type_: &str) -> Option<(String, String)> {
    condition_of(pair, type_).map(|c| {
        (
            c["status"].as_str().unwrap_or("").to_owned(),
            c["reason"].as_str().unwrap_or("").to_owned(),
        )
    })
}

/// Events about an object, as `kubectl get events` shows them.
pub fn events_about(ns: &str, name: &str) -> Vec<serde_json::Value> {
    let selector = format!("involvedObject.name={name}");
    let out = kubectl_ok(
        &["get", "events", "-n", ns, "--field-selector", &selector, "-o", "json"],
        None,
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("events JSON");
    v["items"].as_array().cloned().unwrap_or_default()
}

/// Waits up to `wait` for an Event with `reason` about `name` and returns it; with
/// `Some(type_)`, the Event must be of that type (`Warning`, `Normal`).
pub fn event_with_reason(
    wait: std::time::Duration,
    ns: &str,
    name: &str,
    reason: &str,
    type_: Option<&str>,
) -> serde_json::Value {
    eventually(wait, &format!("the {reason} Event about {name}"), || {
        events_about(ns, name)
            .into_iter()
            .find(|e| e["reason"] == reason && type_.is_none_or(|t| e["type"] == t))
    })
}

/// A free port below the ephemeral range: a port the kernel hands out for outgoing connections
/// (the API server makes many) could be taken between our check and the operator's bind.
fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let base = 20000 + (std::process::id() % 500) * 20;
    loop {
        let port = (base + NEXT.fetch_add(1, Ordering::SeqCst) % 10000) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A `pdpair-operator run` process in local mode against the control plane.
#[derive(Debug)]
pub struct Operator {
    child: Option<Child>,
    /// The webhook's port.
    pub webhook_port: u16,
    /// The admin port.
    pub admin_port: u16,
    /// Its identity.
    pub identity: String,
}

impl Operator {
    /// Starts an operator that installs the CRDs and the webhook configuration (pointing at
    /// itself), and waits for `/readyz`.
    pub fn start(identity: &str) -> Operator {
        Operator::start_on(identity, free_port())
    }

    /// Like [`Operator::start`], on a given webhook port (to come back where a previous one was).
    pub fn start_on(identity: &str, webhook_port: u16) -> Operator {
        Operator::start_with(identity, webhook_port, None, &[], None)
    }

    /// Like [`Operator::start`], with more arguments to `pdpair-operator run`.
    pub fn start_args(identity: &str, extra: &[&str]) -> Operator {
        Operator::start_with(identity, free_port(), None, extra, None)
    }

    /// Like [`Operator::start_args`], with the rights of `kubeconfig` (a service account's, see
    /// [`kubeconfig_as`]) and its Lease in `lease_namespace`: it installs nothing (that takes
    /// rights over the cluster) and serves a certificate it generates.
    pub fn start_as(identity: &str, kubeconfig: &std::path::Path, lease_namespace: &str, extra: &[&str]) -> Operator {
        Operator::start_with(identity, free_port(), None, extra, Some((kubeconfig, lease_namespace)))
    }

    /// A free port for a webhook the test configures itself (e.g. through the Helm chart).
    pub fn free_port() -> u16 {
        free_port()
    }

    /// Starts an operator serving the given certificate files, without `--install`: something
    /// else (the Helm chart) installed the CRDs and the webhook configuration.
    pub fn start_serving(identity: &str, webhook_port: u16, cert: &std::path::Path, key: &std::path::Path) -> Operator {
        Operator::start_with(
            identity,
            webhook_port,
            Some((cert.to_path_buf(), key.to_path_buf())),
            &[],
            None,
        )
    }

    /// `who`: another kubeconfig and the namespace of its Lease (nothing installed).
    fn start_with(
        identity: &str,
        webhook_port: u16,
        tls: Option<(PathBuf, PathBuf)>,
        extra: &[&str],
        who: Option<(&std::path::Path, &str)>,
    ) -> Operator {
        let admin_port = free_port();
        let bin = root().join("target/debug/pdpair-operator");
        assert!(
            bin.exists(),
            "{} is missing: build it first (hack/e2e.sh does)",
            bin.display()
        );
        let log = std::fs::File::create(dir().join(format!("operator-{identity}.log"))).expect("log file");
        let url = format!("https://127.0.0.1:{webhook_port}");
        let mut cmd = Command::new(bin);
        let (config, lease_namespace) = match who {
            Some((config, lease_namespace)) => (config.to_path_buf(), lease_namespace),
            None => (kubeconfig(), "default"),
        };
        cmd.args(["run", "--lease-duration", "6s", "--lease-namespace", lease_namespace])
            .arg("--kubeconfig")
            .arg(config)
            .args(["--webhook-bind", &format!("127.0.0.1:{webhook_port}")])
            .args([
                "--admin-bind",
                &format!("127.0.0.1:{admin_port}"),
                "--identity",
                identity,
            ])
            // Only the API server, with the client certificate hack/control-plane.sh gave it,
            // reaches the webhook.
            .arg("--webhook-client-ca")
            .arg(dir().join("pki/webhook-client-ca.crt"))
            .args(extra);
        match &tls {
            Some((cert, key)) => {
                cmd.arg("--tls-cert").arg(cert).arg("--tls-key").arg(key);
            }
            None if who.is_some() => {
                cmd.arg("--cert-dir").arg(dir().join(format!("certs-{identity}")));
            }
            None => {
                cmd.args(["--install", "--webhook-url", &url])
                    .arg("--cert-dir")
                    .arg(dir().join(format!("certs-{identity}")));
            }
        }
        let child = cmd
            .env("RUST_LOG", "info,pdpair_operator=debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("operator starts");
        let mut pids = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir().join("operator-pids"))
            .expect("pid file");
        writeln!(pids, "{}", child.id()).expect("record pid");
        let mut op = Operator {
            child: Some(child),
            webhook_port,
            admin_port,
            identity: identity.to_owned(),
        };
        op.wait_ready(Duration::from_secs(60));
        op
    }

    fn wait_ready(&mut self, timeout: Duration) {
        let start = Instant::now();
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!(
                    "operator {} exited early with {status}; see its log in {}",
                    self.identity,
                    dir().display()
                );
            }
            if http_get(self.admin_port, "/readyz").is_some_and(|(code, _)| code == 200) {
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "operator {} not ready after {timeout:?}",
                self.identity
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The operator's Prometheus metrics text.
    pub fn metrics(&self) -> String {
        http_get(self.admin_port, "/metrics")
            .map(|(_, body)| body)
            .unwrap_or_default()
    }

    /// The value of its counter `name` (unlabelled).
    pub fn counter(&self, name: &str) -> u64 {
        self.metrics()
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} in the operator's metrics"))
    }

    /// Whether it holds the leader Lease, per its metrics.
    pub fn is_leader(&self) -> bool {
        self.metrics().lines().any(|l| l == "pdpair_operator_leader 1")
    }

    /// Stops it with SIGTERM (it releases its Lease) and waits.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A plain HTTP/1.0 GET on loopback: (status, body).
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((code, body))
}

/// POSTs `body` to the webhook over real TLS with curl, as the API server does (with its
/// webhook client certificate): (HTTP status, response body).
pub fn post_webhook(port: u16, body: &str) -> (u16, String) {
    post_webhook_as(port, body, true)
}

/// [`post_webhook`], presenting the API server's client certificate or none: (HTTP status, or
/// 0 when no HTTP answer came, response body).
pub fn post_webhook_as(port: u16, body: &str, api_server: bool) -> (u16, String) {
    let url = format!("https://127.0.0.1:{port}/validate/pdpairs");
    let mut curl = Command::new("curl");
    if api_server {
        let pki = dir().join("pki");
        curl.arg("--cert")
            .arg(pki.join("webhook-client.crt"))
            .arg("--key")
            .arg(pki.join("webhook-client.key"));
    }
    let out = curl
        .args([
            "-sk",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
        ])
        .args(["--data-binary", "@-", &url])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            if let Some(mut i) = c.stdin.take() {
                let _ = i.write_all(body.as_bytes());
            }
            c.wait_with_output()
        })
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// Runs a command with `input` on its standard input and returns its standard output.
pub fn pipe(program: &str, args: &[&str], input: &[u8]) -> Vec<u8> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{program} runs: {e}"));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input)
        .expect("write stdin");
    child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("{program} finishes: {e}"))
        .stdout
}

/// Decodes base64 (as Secrets hold data) with coreutils' `base64 -d`.
pub fn base64_decode(text: &str) -> Vec<u8> {
    pipe("base64", &["-d"], text.as_bytes())
}

/// A `pdpair-agent run` process against the control plane (tcp, on loopback), killed on drop.
#[derive(Debug)]
pub struct AgentProcess(std::process::Child);

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl AgentProcess {
    /// Starts the agent named `name` (its node) serving `socket`, with the harness's shared pool
    /// directory and `extra` flags, and waits for its socket. Logs go to
    /// `agent-<name>.log` there.
    pub fn start(name: &str, socket: &std::path::Path, extra: &[&str]) -> AgentProcess {
        let bin = root().join("target/debug/pdpair-agent");
        assert!(
            bin.exists(),
            "{} is missing: build it first (hack/e2e.sh does)",
            bin.display()
        );
        let log = std::fs::File::create(dir().join(format!("agent-{name}.log"))).expect("log");
        // The agents of one host share their pool directory.
        let child = pdpair_agent::loopback::run_command(&bin, name, "tcp", socket, &dir().join("pools"))
            .args(extra)
            .arg("--kubeconfig")
            .arg(kubeconfig())
            .stderr(log)
            .spawn()
            .expect("agent starts");
        eventually(Duration::from_secs(60), "the agent's socket", || {
            std::os::unix::net::UnixStream::connect(socket).ok().map(|_| ())
        });
        AgentProcess(child)
    }
}

/// A Node object `name`, no kubelet behind it: the pod garbage collector deletes pods bound to a
/// node that does not exist. Tainted so that the scheduler places nothing there (stand-in pods
/// tolerate every taint, the node lifecycle controller's for a node that never reports too).
pub fn stand_in_node(name: &str) {
    let manifest = format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\nspec:\n  taints:\n  - {{key: pdpair.dev/stand-in, value: \"true\", effect: NoSchedule}}\n"
    );
    kubectl_ok(&["apply", "-f", "-"], Some(&manifest));
}

/// An engine Pod in `ns` labelled for PDPair `pair` and `role` (on `node` when given: bound
/// without a scheduler, to a [`stand_in_node`]; no kubelet runs it); returns its UID.
pub fn engine_pod(ns: &str, name: &str, pair: &str, role: &str, node: Option<&str>) -> String {
    if let Some(node) = node {
        stand_in_node(node);
    }
    let node = node.map(|n| format!("  nodeName: {n}\n")).unwrap_or_default();
    let manifest = format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels: {{pdpair.dev/name: {pair}, pdpair.dev/role: {role}}}\nspec:\n{node}  tolerations:\n  - operator: Exists\n  containers:\n  - name: engine\n    image: vllm/vllm-openai:v0.11.0\n"
    );
    kubectl_ok(&["apply", "-f", "-"], Some(&manifest));
    let pod = eventually(Duration::from_secs(60), "the Pod", || get_json("pod", ns, name));
    pod["metadata"]["uid"].as_str().expect("uid").to_owned()
}

/// Deletes the webhook configuration a local-mode operator (`--install`) made: one left by an
/// operator that stopped points at a port nothing serves, and refuses every PDPair.
pub fn delete_webhook_configuration() {
    kubectl_ok(
        &[
            "delete",
            "validatingwebhookconfiguration",
            "pdpair-validating-webhook",
            "--ignore-not-found",
        ],
        None,
    );
}

/// Removes the `role` pool's template from PDPair `pair` in `ns`: the pool becomes
/// bring-your-own, and the operator prunes its Deployment.
pub fn remove_pool_template(ns: &str, pair: &str, role: &str) {
    let patch = format!(r#"[{{"op": "remove", "path": "/spec/{role}/template"}}]"#);
    kubectl_ok(&["patch", "pdpair", pair, "-n", ns, "--type=json", "-p", &patch], None);
}

/// A copy of the control plane's kubeconfig that impersonates `user` in `groups` (the admin
/// may): a process using it has that user's rights and no more, as the API server's authorizer
/// decides them.
pub fn kubeconfig_as(user: &str, groups: &[&str]) -> PathBuf {
    let text = std::fs::read_to_string(kubeconfig()).expect("kubeconfig");
    let mut config: serde_yaml::Value = serde_yaml::from_str(&text).expect("kubeconfig parses");
    let users = config["users"].as_sequence_mut().expect("kubeconfig users");
    for u in users {
        u["user"]["as"] = user.into();
        u["user"]["as-groups"] = groups.iter().map(|g| serde_yaml::Value::from(*g)).collect();
    }
    let path = dir().join(format!("kubeconfig-as-{}", user.replace(':', "-")));
    std::fs::write(&path, serde_yaml::to_string(&config).expect("serialises")).expect("write kubeconfig");
    path
}

/// Runs Helm (`$HELM`, from `hack/helm.sh`) against the control plane.
pub fn helm(args: &[&str]) -> Out {
    let bin = std::env::var("HELM").unwrap_or_else(|_| panic!("HELM is not set: run with `make e2e`"));
    let out = Command::new(bin)
        .args(args)
        .env("KUBECONFIG", kubeconfig())
        .output()
        .expect("helm runs");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Whether nothing of the Helm release `pdpair` is left (in `ns` and cluster-wide).
pub fn release_gone(ns: &str) -> bool {
    let get = |kinds: &str, ns: Option<&str>| {
        let mut args = vec!["get", kinds, "-l", "app.kubernetes.io/instance=pdpair", "-o", "name"];
        if let Some(ns) = ns {
            args.extend(["-n", ns]);
        }
        kubectl_ok(&args, None)
    };
    get(
        "deployments,daemonsets,services,secrets,serviceaccounts,roles,rolebindings,poddisruptionbudgets,pods",
        Some(ns),
    )
    .trim()
    .is_empty()
        && get("clusterroles,clusterrolebindings,validatingwebhookconfigurations", None)
            .trim()
            .is_empty()
}

/// Creates `endpoint` as a node agent would (a stand-in: no agent runs here), with the Pod it
/// speaks for: named `spec.pod`, labelled for its pair and role, on `spec.node`, with the pool's
/// geometry annotation where the pool has a Deployment, and owning the endpoint. The operator
/// folds only endpoints whose Pod it sees so. Returns the endpoint as stored.
pub async fn create_endpoint(client: &Client, mut endpoint: pdpair_api::PDEndpoint) -> pdpair_api::PDEndpoint {
    use kube::{Api, api::PostParams};
    let ns = endpoint.metadata.namespace.clone().expect("a namespace");
    let (pair, role) = (endpoint.spec.pdpair.clone(), endpoint.spec.role.as_str());
    let (pod, node) = (endpoint.spec.pod.clone(), endpoint.spec.node.clone());
    let uid = engine_pod(&ns, &pod, &pair, role, Some(&node));
    let geometry = get_json("deployment", &ns, &format!("{pair}-{role}")).and_then(|d| {
        d["spec"]["template"]["metadata"]["annotations"]["pdpair.dev/geometry-hash"]
            .as_str()
            .map(str::to_owned)
    });
    if let Some(g) = geometry {
        let annotation = format!("pdpair.dev/geometry-hash={g}");
        kubectl_ok(&["annotate", "pod", &pod, "-n", &ns, &annotation], None);
    }
    endpoint.metadata.owner_references = Some(vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
        api_version: "v1".into(),
        kind: "Pod".into(),
        name: pod,
        uid,
        ..Default::default()
    }]);
    let endpoints: Api<pdpair_api::PDEndpoint> = Api::namespaced(client.clone(), &ns);
    endpoints
        .create(&PostParams::default(), &endpoint)
        .await
        .expect("create PDEndpoint")
}

/// What a node agent publishes for engine `name` of `pair` in `role`, its geometry the pool's
/// (a stand-in: no agent runs here; [`create_endpoint`] makes it with its Pod).
pub fn endpoint(ns: &str, name: &str, role: pdpair_api::Role, pair: &pdpair_api::PDPair) -> pdpair_api::PDEndpoint {
    let pool = if role == pdpair_api::Role::Prefill {
        &pair.spec.prefill
    } else {
        &pair.spec.decode
    };
    let mut e = pdpair_api::PDEndpoint::new(
        name,
        pdpair_api::PDEndpointSpec {
            pdpair: pair.metadata.name.clone().unwrap_or_default(),
            role,
            pod: format!("{name}-pod"),
            node: "node-a".into(),
            address: "127.0.0.1:7000".into(),
            parallelism: pool.parallelism.clone(),
            kv: pool.kv.clone(),
            pool_memory: Default::default(),
            staging: None,
            tensor_rank: None,
            instance: None,
            pod_engines: None,
        },
    );
    e.metadata.namespace = Some(ns.to_owned());
    e
}
