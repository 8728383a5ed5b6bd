//! What the agent's integration tests share: geometries, engine specs, and a world of agents
//! in this process (each with its own UCX context and worker) with a shared pool directory.
#![allow(dead_code)]

use std::{
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use pdpair_agent::{
    agent::{Agent, AgentConfig},
    engine_api::{AgentEvent, EngineRequest},
    metrics::Metrics,
    synthetic::{EngineMemory, EngineSpec, SyntheticEngine},
    transport::ucx::Transport,
};
use pdpair_api::{CacheDtype, ChecksumPolicy, KvGeometry, KvLayout, ModelDtype, Parallelism, Role, TransferMode};

pub fn kv(block: i32, kernel: Option<i32>) -> KvGeometry {
    KvGeometry {
        engine: "vllm".into(),
        engine_version: None,
        model: "tiny".into(),
        dtype: ModelDtype::Bfloat16,
        cache_dtype: CacheDtype::Auto,
        layers: 2,
        kv_heads: 2,
        head_dim: 16,
        attention_backend: "FLASH_ATTN".into(),
        layout: KvLayout::Hnd,
        block_size: block,
        kernel_block_size: kernel,
        mla: false,
        hybrid: false,
        host_buffer: false,
    }
}

pub fn spec(role: Role, engine: &str, kv: KvGeometry, key: &[u8], checksum: ChecksumPolicy) -> EngineSpec {
    EngineSpec {
        pdpair: "team-a/tiny".into(),
        role,
        engine: engine.into(),
        mode: TransferMode::Push,
        checksum,
        handshake_timeout_ms: 2000,
        lease_ms: 3000,
        parallelism: Parallelism::default(),
        kv,
        pairing_key: key.to_vec(),
        num_blocks: 16,
        tensor_rank: 0,
        memory: EngineMemory::Agent,
        arrangement: Default::default(),
        regions: Vec::new(),
    }
}

pub struct World {
    pub dir: PathBuf,
    pub metrics: std::sync::Mutex<Vec<Arc<Metrics>>>,
    /// Decode agents' ping interval.
    pub heartbeat: Duration,
}

impl World {
    pub fn new(name: &str) -> World {
        let dir = std::env::temp_dir().join(format!("pdpair-push-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        World {
            dir,
            metrics: std::sync::Mutex::new(Vec::new()),
            heartbeat: pdpair_agent::agent::DEFAULT_HEARTBEAT,
        }
    }

    /// An engine on the agent at `socket`: the test geometry (`kv(64, None)`), FailClosed, its
    /// pool allocated by the agent.
    pub fn engine(&self, socket: &std::path::Path, role: Role, name: &str, key: &[u8]) -> SyntheticEngine {
        SyntheticEngine::register(
            socket,
            &self.dir,
            &spec(role, name, kv(64, None), key, ChecksumPolicy::FailClosed),
        )
        .unwrap_or_else(|e| panic!("engine {name} registers: {e}"))
    }

    pub fn pools(&self) -> PathBuf {
        self.dir.join("pools")
    }

    pub fn agent(&self, name: &str, transport: Transport, corrupt: bool) -> PathBuf {
        self.agent_probing_with(name, transport, corrupt, env!("CARGO_BIN_EXE_pdpair-agent").into())
    }

    /// [`World::agent`], its UCX probe run as `probe`.
    #[allow(dead_code)]
    pub fn agent_probing_with(&self, name: &str, transport: Transport, corrupt: bool, probe: PathBuf) -> PathBuf {
        self.agent_configured(name, transport, |cfg| {
            cfg.corrupt_one_byte = corrupt;
            cfg.ucx_probe = Some(probe);
        })
    }

    /// The configuration of a test agent `name` on `transport` (what [`World::agent`] starts).
    pub fn config(&self, name: &str, transport: Transport) -> AgentConfig {
        AgentConfig {
            name: name.into(),
            listen_host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            transport,
            stream_lanes: pdpair_agent::transport::stream::DEFAULT_LANES,
            corrupt_one_byte: false,
            rejection_ttl: Duration::from_secs(30),
            publisher: None,
            // The agents of one host share their pool directory.
            pool_dir: self.pools(),
            heartbeat: self.heartbeat,
            attestor: None,
            // Every test agent probes its peers' UCX addresses, as the DaemonSet's does.
            ucx_probe: Some(env!("CARGO_BIN_EXE_pdpair-agent").into()),
            side_channel_ports: None,
        }
    }

    /// [`World::agent`], its configuration changed by `change`.
    pub fn agent_configured(&self, name: &str, transport: Transport, change: impl FnOnce(&mut AgentConfig)) -> PathBuf {
        let mut cfg = self.config(name, transport);
        change(&mut cfg);
        let metrics = Arc::new(Metrics::new());
        self.metrics.lock().expect("metrics").push(metrics.clone());
        let agent = Agent::start(cfg, metrics).expect("agent starts");
        let socket = self.dir.join(format!("{name}.sock"));
        let s = socket.clone();
        std::thread::spawn(move || agent.serve(&s));
        let start = Instant::now();
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(start.elapsed() < Duration::from_secs(5), "agent socket never came up");
            std::thread::sleep(Duration::from_millis(10));
        }
        socket
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // Let the agents release the engines' pools (their files live in the pool dir) before
        // the directory goes.
        let start = Instant::now();
        let metrics = self.metrics.lock().map(|m| m.clone()).unwrap_or_default();
        while metrics.iter().any(|m| m.registrations.get() > 0) && start.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One request: its id, the content seed, where P's and D's blocks start, the token count and
/// P's block count.
pub struct Req<'a> {
    pub id: &'a str,
    pub seed: u64,
    pub p_first: u64,
    pub d_first: u64,
    pub tokens: u64,
    pub blocks: usize,
}

impl<'a> Req<'a> {
    /// A request whose blocks start at token 0 on both sides.
    pub fn from_start(id: &'a str, seed: u64, tokens: u64, blocks: usize) -> Req<'a> {
        Req {
            id,
            seed,
            p_first: 0,
            d_first: 0,
            tokens,
            blocks,
        }
    }
}

/// Runs one request P -> D; returns D's final event and the count of wrong tokens D saw.
pub fn request(p: &mut SyntheticEngine, d: &mut SyntheticEngine, r: Req<'_>) -> (AgentEvent, u64) {
    let b = u64::from(p.layout.block_size);
    let p_blocks: Vec<u32> = (0..r.blocks as u32).map(|i| i + 3).collect();
    let d_skip = ((r.d_first - r.p_first) / b) as usize;
    let d_blocks: Vec<u32> = (0..(r.blocks - d_skip) as u32).map(|i| 15 - i).collect();
    p.fill(r.seed, &p_blocks, r.p_first, r.tokens);
    d.clear(&d_blocks);
    p.send(&EngineRequest::KvReady {
        release_token: None,
        request: r.id.into(),
        blocks: p_blocks,
        num_tokens: r.tokens,
        first_token: r.p_first,
        prompt: Some(pdpair_agent::synthetic::prompt(r.seed, r.tokens)),
        event: None,
    })
    .expect("KvReady");
    d.send(&EngineRequest::ExpectKv {
        request: r.id.into(),
        prefill: p.address.clone(),
        blocks: d_blocks.clone(),
        num_tokens: r.tokens,
        first_token: r.d_first,
        prompt: Some(pdpair_agent::synthetic::prompt(r.seed, r.tokens)),
        event: None,
    })
    .expect("ExpectKv");
    let event = d.next_event().expect("D event");
    let bad = d.verify(r.seed, &d_blocks, r.d_first, r.tokens);
    (event, bad)
}

pub fn done(event: &AgentEvent) -> bool {
    matches!(event, AgentEvent::RequestDone { .. })
}

pub fn reasons(event: &AgentEvent) -> Vec<String> {
    match event {
        AgentEvent::RequestFailed { reasons, .. } => reasons.clone(),
        _ => Vec::new(),
    }
}

/// A prefill agent in its own process (so it can be stopped), sharing the World's pool dir.
pub struct ProcessAgent(pub std::process::Child);

impl ProcessAgent {
    pub fn start(w: &World, name: &str) -> (ProcessAgent, PathBuf) {
        ProcessAgent::start_with(w, name, &[])
    }

    /// [`ProcessAgent::start`], with more arguments to `pdpair-agent run`.
    pub fn start_with(w: &World, name: &str, extra: &[&str]) -> (ProcessAgent, PathBuf) {
        ProcessAgent::start_over(w, name, "tcp", extra)
    }

    /// [`ProcessAgent::start_with`], over `transport` (`--transport`).
    pub fn start_over(w: &World, name: &str, transport: &str, extra: &[&str]) -> (ProcessAgent, PathBuf) {
        let socket = w.dir.join(format!("{name}.sock"));
        // The GPU check runs these tests on another machine, with the agent carried beside them.
        let carried = std::env::var_os("PDPAIR_AGENT_BIN");
        let bin = carried
            .clone()
            .map(PathBuf::from)
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_pdpair-agent").into());
        let mut cmd = pdpair_agent::loopback::run_command(&bin, name, transport, &socket, &w.pools());
        if carried.is_some() {
            // Under the GPU check its warnings and errors go to the report, which is all that
            // comes back from that machine.
            cmd.stderr(std::process::Stdio::inherit()).env("RUST_LOG", "warn");
        }
        let child = cmd.arg("--no-publish").args(extra).spawn().expect("agent process");
        let start = Instant::now();
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the agent process never opened its socket"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        (ProcessAgent(child), socket)
    }

    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::kill(self.0.id() as i32, signal) };
        assert_eq!(rc, 0, "kill({signal})");
    }
}

impl Drop for ProcessAgent {
    fn drop(&mut self) {
        // SIGKILL reaches a stopped process too.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Prefill: the request's KV is ready in `blocks` (from token 0).
pub fn kv_ready(p: &mut SyntheticEngine, request: &str, blocks: &[u32], num_tokens: u64) {
    kv_ready_of(p, request, blocks, num_tokens, None);
}

/// [`kv_ready`], computed from the prompt of digest `prompt`.
pub fn kv_ready_of(
    p: &mut SyntheticEngine,
    request: &str,
    blocks: &[u32],
    num_tokens: u64,
    prompt: Option<pdpair_agent::engine_api::PromptDigest>,
) {
    p.send(&EngineRequest::KvReady {
        release_token: None,
        request: request.into(),
        blocks: blocks.to_vec(),
        num_tokens,
        first_token: 0,
        prompt,
        event: None,
    })
    .expect("KvReady");
}

/// Decode: the request's KV comes from `prefill` into `blocks` (from token 0).
pub fn expect_kv(d: &mut SyntheticEngine, request: &str, prefill: String, blocks: &[u32], num_tokens: u64) {
    expect_kv_of(d, request, prefill, blocks, num_tokens, None);
}

/// [`expect_kv`], for the prompt of digest `prompt`.
pub fn expect_kv_of(
    d: &mut SyntheticEngine,
    request: &str,
    prefill: String,
    blocks: &[u32],
    num_tokens: u64,
    prompt: Option<pdpair_agent::engine_api::PromptDigest>,
) {
    d.send(&EngineRequest::ExpectKv {
        request: request.into(),
        prefill,
        blocks: blocks.to_vec(),
        num_tokens,
        first_token: 0,
        prompt,
        event: None,
    })
    .expect("ExpectKv");
}

/// An engine of `mode` on the agent at `socket` (64-token blocks, FailClosed), whose events
/// are awaited up to 20 s.
pub fn engine_in_mode(
    w: &World,
    socket: &std::path::Path,
    role: Role,
    name: &str,
    key: &[u8],
    mode: TransferMode,
) -> SyntheticEngine {
    let mut s = spec(role, name, kv(64, None), key, ChecksumPolicy::FailClosed);
    s.mode = mode;
    let e = SyntheticEngine::register(socket, &w.dir, &s).expect("engine");
    e.events()
        .expect("events")
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    e
}
