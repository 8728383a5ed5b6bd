//! Engines bound to their Pods, against the real API server: the agent runs with attestation on
//! (a kubeconfig, no `--no-attest`), the test creates Pods on the API server (bound to the
//! agent's node by `nodeName`; no kubelet runs them), and real engine processes connect from a
//! cgroup laid out as the kubelet lays one out for such a Pod (`/kubepods/besteffort/pod<uid>/
//! <container>` in the pids hierarchy, cgroup v1, as with the kubelet's cgroupfs driver). The
//! engine processes are small Python programs: the agent reads their pid from the socket and their
//! Pod from their cgroup, never from what they say; it reads their transfer settings from the
//! PDPair.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use pdpair_agent::{
    engine_api::EngineRequest,
    synthetic::{EngineMemory, EngineSpec, SyntheticEngine},
};
use pdpair_api::{PDPair, Role};
use pdpair_e2e::*;

const NODE: &str = "node-attest";
const CGROUPS: &str = "/sys/fs/cgroup/pids";

/// The cgroup directory the kubelet would make for a container of Pod `uid`, made here; removed
/// (leaf first, only what this made) on drop.
struct PodCgroup {
    made: Vec<PathBuf>,
    leaf: PathBuf,
}

impl PodCgroup {
    fn new(uid: &str, container: &str) -> PodCgroup {
        let leaf = Path::new(CGROUPS)
            .join("kubepods/besteffort")
            .join(format!("pod{uid}"))
            .join(container);
        let mut made = Vec::new();
        let mut at = PathBuf::from(CGROUPS);
        for part in leaf.strip_prefix(CGROUPS).expect("under the hierarchy").components() {
            at.push(part);
            if !at.exists() {
                std::fs::create_dir(&at).unwrap_or_else(|e| panic!("{}: {e}", at.display()));
                made.push(at.clone());
            }
        }
        PodCgroup { made, leaf }
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        for d in self.made.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// An engine process: joins `cgroup` (when given) by writing its own pid to `cgroup.procs`,
/// connects to the agent, sends `request` as one frame and prints the answer's JSON.
fn engine(cgroup: Option<&Path>, socket: &Path, request: &EngineRequest) -> serde_json::Value {
    const SCRIPT: &str = r#"
import json, os, socket, struct, sys
if sys.argv[1] != "-":
    with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[2])
body = sys.stdin.buffer.read()
s.sendall(struct.pack(">I", len(body)) + body)
n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
print(s.recv(n, socket.MSG_WAITALL).decode())
"#;
    let cgroup = cgroup.map_or("-".into(), |c| c.display().to_string());
    run_engine(SCRIPT, &[cgroup.as_ref(), socket.as_os_str()], request)
}

/// Runs the engine process `script` with `args`, `request` (as JSON) on its stdin; returns the
/// JSON it prints (the agent's answer).
fn run_engine(script: &str, args: &[&std::ffi::OsStr], request: &EngineRequest) -> serde_json::Value {
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let body = serde_json::to_vec(request).expect("json");
    child.stdin.take().expect("stdin").write_all(&body).expect("send");
    let out = child.wait_with_output().expect("engine runs");
    assert!(out.status.success(), "the engine process failed: {out:?}");
    serde_json::from_slice(&out.stdout).expect("the agent's answer")
}

/// An engine process that connects from `first`, asks the agent's `Capabilities` (so the agent
/// has accepted the connection), then joins `then` and registers with `request`: as if, between
/// connect and registration, its pid had come to name a process of another Pod (a process that
/// connected, passed the socket on and exited, its pid reused). Prints the answer's JSON.
fn engine_that_moves(first: &Path, then: &Path, socket: &Path, request: &EngineRequest) -> serde_json::Value {
    const SCRIPT: &str = r#"
import json, os, socket, struct, sys
def join(cg):
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
def send(s, body):
    s.sendall(struct.pack(">I", len(body)) + body)
def recv(s):
    n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
    return s.recv(n, socket.MSG_WAITALL).decode()
join(sys.argv[1])
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[3])
send(s, b'{"type": "Capabilities"}')
recv(s)
join(sys.argv[2])
send(s, sys.stdin.buffer.read())
print(recv(s))
"#;
    run_engine(
        SCRIPT,
        &[first.as_os_str(), then.as_os_str(), socket.as_os_str()],
        request,
    )
}

/// A process of the Pod of `cgroup` that opens `n` engine connections and asks each for the
/// agent's `Capabilities` (so each is accepted and waits to register), keeping them open until
/// its stdin closes. Returns it and, per connection, whether the agent answered.
fn holding_connections(cgroup: &Path, socket: &Path, n: usize) -> (std::process::Child, Vec<bool>) {
    const SCRIPT: &str = r#"
import json, os, socket, struct, sys
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
held, answered = [], []
for _ in range(int(sys.argv[3])):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(sys.argv[2])
    body = b'{"type": "Capabilities"}'
    try:
        s.sendall(struct.pack(">I", len(body)) + body)
        answered.append(len(s.recv(4, socket.MSG_WAITALL)) == 4)
    except OSError:
        answered.append(False)
    held.append(s)
print(json.dumps(answered), flush=True)
sys.stdin.read()
"#;
    reporting(
        SCRIPT,
        &[cgroup.as_os_str(), socket.as_os_str(), n.to_string().as_ref()],
    )
}

/// Starts the Python program `script` with `args`, its stdin held open (it runs until that
/// closes); returns it once it has printed its first line, and that line's JSON.
fn reporting<T: serde::de::DeserializeOwned>(script: &str, args: &[&std::ffi::OsStr]) -> (std::process::Child, T) {
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().expect("stdout")),
        &mut line,
    )
    .expect("its report");
    let report = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    (child, report)
}

/// A process of the Pod of `cgroup` that registers, each on a connection of its own, the engines
/// whose frames `frames` holds (a JSON list per engine: its `RegisterPool`, then its requests),
/// all of them first, then sends their requests, and keeps the connections open until its stdin
/// closes. Returns it once every request is sent, and each registration's answer.
fn engines_holding_requests(
    cgroup: &Path,
    socket: &Path,
    frames: &Path,
) -> (std::process::Child, Vec<serde_json::Value>) {
    const SCRIPT: &str = r#"
import json, os, socket, struct, sys
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
def send(s, frame):
    body = json.dumps(frame).encode()
    s.sendall(struct.pack(">I", len(body)) + body)
def recv(s):
    n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
    return json.loads(s.recv(n, socket.MSG_WAITALL))
engines = json.load(open(sys.argv[3]))
held, answers = [], []
for frames in engines:
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[2])
    send(s, frames[0])
    answers.append(recv(s))
    held.append(s)
for s, frames in zip(held, engines):
    for frame in frames[1:]:
        send(s, frame)
print(json.dumps(answers), flush=True)
sys.stdin.read()
"#;
    reporting(SCRIPT, &[cgroup.as_os_str(), socket.as_os_str(), frames.as_os_str()])
}

#[test]
fn an_engine_registers_only_as_the_pod_its_process_runs_in() {
    let _op = Operator::start("attest");
    let ns = namespace("attest");
    let text = manifest("vllm-push-64-64.yaml", &ns, |_| {});
    // The PDPair exists: the agent fills (and checks) an engine's transfer settings from it.
    kubectl_ok(&["apply", "-f", "-"], Some(&text));
    let pair: PDPair = serde_yaml::from_str(&text).expect("PDPair");
    let decode_uid = engine_pod(&ns, "decode-pod", "vllm-push-64-64", "decode", Some(NODE));
    let other_uid = engine_pod(&ns, "other-pair-pod", "another-pair", "decode", Some(NODE));
    let work = dir().join("attest");
    std::fs::create_dir_all(&work).expect("dir");
    let socket = work.join("agent.sock");
    // Attestation on (no --no-attest); no PDEndpoints are needed here.
    let _agent = AgentProcess::start(NODE, &socket, &["--no-publish"]);
    let spec = |role: Role| EngineSpec {
        pdpair: format!("{ns}/vllm-push-64-64"),
        role,
        engine: "e0".into(),
        mode: pair.spec.transfer.mode,
        checksum: pair.spec.transfer.checksum,
        // The PDPair's, as an engine that read its environment would send them.
        handshake_timeout_ms: pair.spec.transfer.handshake_timeout.get().as_millis() as u64,
        lease_ms: pair.spec.transfer.lease_duration.get().as_millis() as u64,
        parallelism: pair.spec.decode.parallelism.clone(),
        kv: pair.spec.decode.kv.clone(),
        pairing_key: vec![7; 32],
        num_blocks: 4,
        memory: EngineMemory::Agent,
        arrangement: Default::default(),
        regions: Vec::new(),
        tensor_rank: 0,
    };
    let register = |role: Role, pod: &str| {
        EngineRequest::RegisterPool(Box::new(SyntheticEngine::registration(
            &spec(role),
            Some(pod.into()),
            false,
        )))
    };
    // What the engine cannot know (mode, checksum, timeouts) left out: the PDPair's.
    let bare = |role: Role, pod: &str| {
        let mut reg = SyntheticEngine::registration(&spec(role), Some(pod.into()), false);
        (reg.mode, reg.checksum, reg.handshake_timeout_ms, reg.lease_ms) = (None, None, None, None);
        reg
    };
    let decode_cg = PodCgroup::new(&decode_uid, "c0ffee01");
    let other_cg = PodCgroup::new(&other_uid, "c0ffee02");
    // The decode Pod's process, registering as that Pod's decode engine: accepted, with its
    // settings given or left to the PDPair.
    let answer = engine(Some(&decode_cg.leaf), &socket, &register(Role::Decode, "decode-pod"));
    assert_eq!(answer["type"], "Registered", "{answer}");
    let answer = engine(
        Some(&decode_cg.leaf),
        &socket,
        &EngineRequest::RegisterPool(Box::new(bare(Role::Decode, "decode-pod"))),
    );
    assert_eq!(answer["type"], "Registered", "{answer}");
    let refused = |answer: serde_json::Value, needle: &str| {
        assert_eq!(answer["type"], "RegistrationFailed", "{answer}");
        let message = answer["message"].as_str().unwrap_or_default().to_owned();
        assert!(message.contains(needle), "{message}");
    };
    // Settings that disagree with the PDPair: refused, naming the field.
    let mut pull = bare(Role::Decode, "decode-pod");
    pull.mode = Some(pdpair_api::TransferMode::Pull);
    refused(
        engine(
            Some(&decode_cg.leaf),
            &socket,
            &EngineRequest::RegisterPool(Box::new(pull)),
        ),
        "mode: the registration says Pull",
    );
    // The same process registering as the pair's prefill: its Pod says decode.
    refused(
        engine(Some(&decode_cg.leaf), &socket, &register(Role::Prefill, "decode-pod")),
        "pdpair.dev/role",
    );
    // Another pair's Pod claiming to be this pair's decode Pod.
    refused(
        engine(Some(&other_cg.leaf), &socket, &register(Role::Decode, "decode-pod")),
        "UID",
    );
    // Another pair's Pod naming itself: its labels name another PDPair.
    refused(
        engine(Some(&other_cg.leaf), &socket, &register(Role::Decode, "other-pair-pod")),
        "pdpair.dev/name",
    );
    // The Pod is the one the process was in when the agent accepted its connection: a process
    // of another pair's Pod that is in the decode Pod's cgroup by the time it registers (its pid
    // another's by then) is still the other Pod's.
    refused(
        engine_that_moves(
            &other_cg.leaf,
            &decode_cg.leaf,
            &socket,
            &register(Role::Decode, "decode-pod"),
        ),
        "UID",
    );
    // Connections waiting to register are shared by Pods: one Pod's processes holding them
    // open (64 of them locked every engine on the node out, before any attestation) hold at
    // most 8, and another Pod's engine registers meanwhile.
    let per_pod = pdpair_agent::agent::MAX_UNREGISTERED_PER_POD;
    let (mut holder, answered) = holding_connections(&other_cg.leaf, &socket, per_pod + 1);
    assert_eq!(answered.iter().filter(|a| **a).count(), per_pod, "{answered:?}");
    assert!(!answered[per_pod], "the one past the Pod's share is closed unanswered");
    let answer = engine(Some(&decode_cg.leaf), &socket, &register(Role::Decode, "decode-pod"));
    assert_eq!(answer["type"], "Registered", "{answer}");
    drop(holder.stdin.take());
    let _ = holder.wait();
    // A process in no Pod at all.
    refused(
        engine(None, &socket, &register(Role::Decode, "decode-pod")),
        "not in a Pod's cgroup",
    );
    // It can never register: its first frame, whatever it is, is answered with why, and its
    // place among the connections registering goes with it (it was answered Capabilities and
    // held the place for its 30 s).
    refused(
        engine(None, &socket, &EngineRequest::Capabilities),
        "not in a Pod's cgroup",
    );
    // A registration that names no Pod.
    let mut anonymous = SyntheticEngine::registration(&spec(Role::Decode), None, false);
    anonymous.pod = None;
    refused(
        engine(
            Some(&decode_cg.leaf),
            &socket,
            &EngineRequest::RegisterPool(Box::new(anonymous)),
        ),
        "must name its Pod",
    );
    // Registered engines are shared by Pods too: one Pod registering as many small pools as
    // the agent takes (256) kept every other Pod's engines on the node out. One Pod registers
    // MAX_ENGINES_PER_POD and no more, and another Pod's engine registers meanwhile.
    let per_pod = pdpair_agent::agent::MAX_ENGINES_PER_POD;
    let engines: Vec<Vec<EngineRequest>> = (0..=per_pod)
        .map(|e| {
            let mut s = spec(Role::Decode);
            s.num_blocks = 1;
            let mut reg = SyntheticEngine::registration(&s, Some("decode-pod".into()), false);
            reg.engine = format!("many{e}");
            vec![EngineRequest::RegisterPool(Box::new(reg))]
        })
        .collect();
    let frames = work.join("many-engines.json");
    std::fs::write(&frames, serde_json::to_vec(&engines).expect("json")).expect("frames");
    let (mut holder, answers) = engines_holding_requests(&decode_cg.leaf, &socket, &frames);
    let registered = answers.iter().filter(|a| a["type"] == "Registered").count();
    assert_eq!(registered, per_pod, "{answers:?}");
    refused(
        answers[per_pod].clone(),
        &format!("Pod has {per_pod} engines registered"),
    );
    let neighbour_uid = engine_pod(&ns, "decode-pod-2", "vllm-push-64-64", "decode", Some(NODE));
    let neighbour_cg = PodCgroup::new(&neighbour_uid, "c0ffee03");
    let answer = engine(
        Some(&neighbour_cg.leaf),
        &socket,
        &register(Role::Decode, "decode-pod-2"),
    );
    assert_eq!(answer["type"], "Registered", "{answer}");
    drop(holder.stdin.take());
    let _ = holder.wait();
    // The dial places to one prefill host are shared by Pods: two engines of one Pod naming
    // addresses on that host where no agent answers (listeners that accept and never write) hold
    // DIALS_PER_OWNER_HOST of them together, not each, until those go stale.
    let mute: Vec<std::net::TcpListener> = (0..20)
        .map(|_| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.set_nonblocking(true).expect("nonblocking");
            l
        })
        .collect();
    let engines: Vec<Vec<EngineRequest>> = (0..2)
        .map(|e| {
            let mut reg = SyntheticEngine::registration(&spec(Role::Decode), Some("decode-pod".into()), false);
            reg.engine = format!("ranked{e}");
            let mut frames = vec![EngineRequest::RegisterPool(Box::new(reg))];
            for (i, l) in mute.iter().enumerate().skip(e * 10).take(10) {
                frames.push(EngineRequest::ExpectKv {
                    request: format!("stuck{i}"),
                    prefill: l.local_addr().expect("addr").to_string(),
                    blocks: vec![(i % 4) as u32],
                    num_tokens: 64,
                    first_token: 0,
                    prompt: None,
                    event: None,
                });
            }
            frames
        })
        .collect();
    let frames = work.join("ranked-engines.json");
    std::fs::write(&frames, serde_json::to_vec(&engines).expect("json")).expect("frames");
    let (mut holder, answers) = engines_holding_requests(&decode_cg.leaf, &socket, &frames);
    assert!(answers.iter().all(|a| a["type"] == "Registered"), "{answers:?}");
    // The dials that reached the listeners, counted from the first for half the time a place is
    // held (so none has gone stale and been taken again meanwhile).
    let mut dialled = Vec::new();
    let waiting_until = Instant::now() + Duration::from_secs(20);
    while dialled.is_empty() {
        assert!(Instant::now() < waiting_until, "no dial reached the listeners");
        dialled.extend(mute.iter().filter_map(|l| l.accept().ok()));
        std::thread::sleep(Duration::from_millis(5));
    }
    let counting_until = Instant::now() + pdpair_agent::agent::DIAL_PLACE_HELD / 2;
    while Instant::now() < counting_until {
        dialled.extend(mute.iter().filter_map(|l| l.accept().ok()));
        std::thread::sleep(Duration::from_millis(10));
    }
    // At most the Pod's share (each engine its own owner: 4 at once); fewer where the second
    // came late.
    assert!(
        (1..=pdpair_agent::agent::DIALS_PER_OWNER_HOST).contains(&dialled.len()),
        "{} dials of one Pod's engines in flight to one host at once",
        dialled.len()
    );
    drop(holder.stdin.take());
    let _ = holder.wait();
}
