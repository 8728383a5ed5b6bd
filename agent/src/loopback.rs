//! `pdpair-agent loopback`: a prefill/decode scenario on one machine with real agent processes,
//! real sockets and real UCX, driven by synthetic engines. Tests, the demo and the benchmarks use
//! it.

use std::{
    collections::BTreeMap,
    io::IsTerminal,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc::{self, Receiver},
    thread,
    time::{Duration, Instant},
};

use pdpair_api::{PDPair, Role, TransferMode};
use serde::Serialize;

use crate::{
    engine_api::{AgentEvent, EngineRequest},
    synthetic::{EngineMemory, EngineSpec, SyntheticEngine},
    wire,
};

/// Options of the scenario.
#[derive(Clone, Debug)]
pub struct Options {
    /// The pair: transfer settings, its decode pool (one D agent) and prefill pool (one P agent).
    pub pair: PathBuf,
    /// More P agents, each from another manifest's prefill pool, in the same pair.
    pub also_prefill: Vec<PathBuf>,
    /// P agents that hold a different pairing secret.
    pub foreign_prefill: Vec<PathBuf>,
    /// Requests, round-robin over the P agents.
    pub requests: u32,
    /// Prompt tokens per request.
    pub prompt_tokens: u64,
    /// `tcp` or `shm`.
    pub transport: String,
    /// The agents' `--stream-lanes` (their default when `None`).
    pub stream_lanes: Option<usize>,
    /// Flip one byte of one block in flight per request.
    pub corrupt_one_byte: bool,
    /// SIGKILL the first P agent once this many of its requests started transferring.
    pub kill_prefill_after: Option<u32>,
    /// Check every received byte on decode (turn off for large benchmarks).
    pub verify_bytes: bool,
    /// Decode uses reversed block ids: every block is its own WRITE.
    pub scatter_blocks: bool,
    /// Who allocates the engines' pools.
    pub engine_memory: EngineMemory,
    /// Run every tensor-parallel rank of each pool as its own engine (all of a pool's ranks on
    /// its one agent, as on a node); by default only rank 0 of each.
    pub all_ranks: bool,
    /// Decode already holds this many tokens of each prompt (a prefix-cache hit, whole decode
    /// kernel blocks): it asks only for the tail, paired by absolute position.
    pub decode_prefix_hit: u64,
    /// Every engine's pool is one region per layer.
    pub region_per_layer: bool,
    /// (prefill, decode): engines of that role register one `Interleaved` region (vLLM 0.33),
    /// layers outermost unless `blocks_outermost`.
    pub side_by_side: (bool, bool),
    /// Side-by-side pools have blocks outermost (else layers).
    pub blocks_outermost: bool,
    /// The agent binary (this executable).
    pub agent_bin: PathBuf,
    /// Agents and pods that already run (the demo); by default the scenario starts its own.
    pub external: External,
}

/// Running agents to use instead of starting them, and the Pods the engines say they run in.
#[derive(Clone, Debug, Default)]
pub struct External {
    /// The decode agent's engine API socket.
    pub decode_agent: Option<PathBuf>,
    /// The (first) prefill agent's engine API socket.
    pub prefill_agent: Option<PathBuf>,
    /// The pair's secret (the pairing Secret's `key`), instead of a generated one.
    pub pairing_key_file: Option<PathBuf>,
    /// The decode engine's Pod (its agent then publishes a PDEndpoint).
    pub decode_pod: Option<String>,
    /// The prefill engine's Pod.
    pub prefill_pod: Option<String>,
}

/// Latency percentiles in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Maximum (only for rejections).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max: Option<f64>,
}

fn percentiles(mut ms: Vec<f64>, with_max: bool) -> Percentiles {
    if ms.is_empty() {
        return Percentiles {
            max: with_max.then_some(0.0),
            ..Percentiles::default()
        };
    }
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() as f64 - 1.0) * q).round() as usize];
    Percentiles {
        p50: at(0.5),
        p99: at(0.99),
        max: with_max.then(|| ms[ms.len() - 1]),
    }
}

/// Outcomes per P agent.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PerPrefill {
    /// Its manifest's name.
    pub name: String,
    /// Requests that succeeded.
    pub succeeded: u32,
    /// Requests refused at the handshake (authentication or geometry).
    pub rejected: u32,
    /// Other failures.
    pub failed: u32,
    /// Failure reasons and their counts.
    pub reasons: BTreeMap<String, u32>,
    /// How long rejections took, from the decode engine's request to its failure.
    pub reject_latency_ms: Percentiles,
    #[serde(skip)]
    reject_ms: Vec<f64>,
}

/// Checksum outcomes on decode.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ChecksumCounts {
    /// Verified loads.
    pub verified: u32,
    /// Mismatched loads (failed under FailClosed, logged under FailOpen).
    pub mismatched: u32,
    /// Unverified loads.
    pub unverified: u32,
}

/// The scenario's result (`-o json`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    /// Push or Pull.
    pub mode: TransferMode,
    /// tcp or shm.
    pub transport: String,
    /// Requests run.
    pub requests: u32,
    /// Succeeded.
    pub succeeded: u32,
    /// Refused at the handshake.
    pub rejected: u32,
    /// Failed otherwise.
    pub failed: u32,
    /// Per P agent, the --pair's first.
    pub per_prefill: Vec<PerPrefill>,
    /// KV bytes moved.
    pub bytes: u64,
    /// 10^9 bytes per second of KV moved while transfers were in flight (posting to flush).
    pub throughput_gb_per_s: f64,
    /// Decode-side latency of successful requests, request to completion.
    pub latency_ms: Percentiles,
    /// Checksum outcomes.
    pub checksum: ChecksumCounts,
    /// Successful requests whose bytes the decode engine found wrong (possible only without
    /// checksums or under FailOpen).
    pub byte_errors: u32,
    /// Tokens of each prompt decode already held (only the rest moved).
    pub decode_prefix_hit: u64,
    /// Memory regions of the decode engine's pool (rank 0), as the agent registered them.
    pub decode_regions: usize,
    /// Completed transfers by the path the agents that moved them report (`Kind/Backend`, from
    /// their `pdpair_agent_transfer_paths_total`), over the agents this scenario started.
    pub paths: std::collections::BTreeMap<String, u64>,
}

/// An agent process this scenario started: killed when dropped, on every path out (an early
/// error included), so none outlives the scenario.
struct Spawned(Child, std::net::SocketAddr);

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Spawned {
    /// This agent's completed transfers by path, from its admin port's `/metrics`.
    fn paths(&self) -> Vec<(String, u64)> {
        metrics(self.1).map_or_else(Vec::new, |text| transfer_paths(&text))
    }
}

/// `GET /metrics` from an agent's admin port (1 s deadlines).
pub(crate) fn metrics(addr: std::net::SocketAddr) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// `pdpair_agent_transfer_paths_total{backend="B",kind="K"} N` lines as (`K/B`, N).
pub fn transfer_paths(metrics: &str) -> Vec<(String, u64)> {
    metrics
        .lines()
        .filter_map(|l| {
            let labels = l.strip_prefix("pdpair_agent_transfer_paths_total{")?;
            let (labels, n) = labels.split_once("} ")?;
            let value = |key: &str| {
                labels
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(key)?.strip_prefix("=\"")?.strip_suffix('"'))
            };
            Some((
                format!("{}/{}", value("kind")?, value("backend")?),
                n.trim().parse().ok()?,
            ))
        })
        .collect()
}

/// A free port on loopback for an agent's admin server.
pub(crate) fn free_admin_addr() -> Result<std::net::SocketAddr, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port for an agent's admin server: {e}"))
}

struct Prefill {
    name: String,
    /// Its pool (geometry and parallelism).
    pool: pdpair_api::PoolSpec,
    agent: Option<Spawned>,
    /// Its ranks' engines (empty when one could not register).
    ranks: Vec<SyntheticEngine>,
    /// Their events, with the rank.
    events: Option<Receiver<(usize, AgentEvent)>>,
    started: u32,
}

/// One channel for the events of several engines, each tagged with its index.
fn readers(engines: &[SyntheticEngine]) -> Option<Receiver<(usize, AgentEvent)>> {
    let (tx, rx) = mpsc::channel();
    for (i, engine) in engines.iter().enumerate() {
        let mut stream = engine.events().ok()?;
        let tx = tx.clone();
        thread::spawn(move || {
            while let Ok(event) = wire::read_frame::<AgentEvent>(&mut stream) {
                if tx.send((i, event)).is_err() {
                    break;
                }
            }
        });
    }
    Some(rx)
}

/// A PDPair manifest from a file (YAML, merge keys applied).
pub fn load(path: &Path) -> Result<PDPair, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut v: serde_yaml::Value = serde_yaml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    v.apply_merge().map_err(|e| format!("{}: {e}", path.display()))?;
    serde_yaml::from_value(v).map_err(|e| format!("{}: not a PDPair: {e}", path.display()))
}

/// `bin run` for an agent named `name` on loopback with `transport`, serving `socket`, its pools
/// in `pool_dir` (the agents of a host share one), output discarded: the command the loopback
/// scenario and the test harnesses start agents with (they add their own flags).
pub fn run_command(bin: &Path, name: &str, transport: &str, socket: &Path, pool_dir: &Path) -> Command {
    let mut cmd = Command::new(bin);
    cmd.args([
        "run",
        "--name",
        name,
        "--listen-host",
        "127.0.0.1",
        "--transport",
        transport,
    ])
    .arg("--socket")
    .arg(socket)
    .arg("--pool-dir")
    .arg(pool_dir)
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    cmd
}

fn spawn_agent(opts: &Options, dir: &Path, name: &str, corrupt: bool) -> Result<(Spawned, PathBuf), String> {
    let socket = dir.join(format!("{name}.sock"));
    let command = || {
        let mut cmd = run_command(&opts.agent_bin, name, &opts.transport, &socket, &dir.join("pools"));
        if let Some(lanes) = opts.stream_lanes {
            cmd.arg("--stream-lanes").arg(lanes.to_string());
        }
        if corrupt {
            cmd.arg("--corrupt-one-byte");
        }
        cmd
    };
    // The admin port is picked free here and bound by the agent a moment later: anything on the
    // host may take it between the two (an agent started beside this one), and then the agent
    // exits. A few tries, each with a new port.
    let mut attempt = 0;
    loop {
        attempt += 1;
        let admin = free_admin_addr()?;
        let mut child = Spawned(
            command()
                .arg("--admin-bind")
                .arg(admin.to_string())
                .spawn()
                .map_err(|e| format!("starting {}: {e}", opts.agent_bin.display()))?,
            admin,
        );
        let start = Instant::now();
        loop {
            if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
                return Ok((child, socket));
            }
            if let Ok(Some(status)) = child.0.try_wait() {
                if attempt == 3 {
                    return Err(format!(
                        "agent {name} exited ({status}) before opening {}",
                        socket.display()
                    ));
                }
                break;
            }
            if start.elapsed() > Duration::from_secs(10) {
                return Err(format!("agent {name} did not open {}", socket.display()));
            }
            thread::sleep(Duration::from_millis(10));
        }
    }
}

fn blocks_for(tokens: u64, block: u32) -> u32 {
    tokens.div_ceil(u64::from(block)).max(1) as u32
}

/// Runs the scenario. `progress` draws a bar on stderr when it is a terminal.
pub fn run(opts: &Options) -> Result<Report, String> {
    let pair = load(&opts.pair)?;
    let transfer = &pair.spec.transfer;
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let dir = base.join(format!("pdpair-loopback-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let result = scenario(opts, &pair, transfer, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn scenario(opts: &Options, pair: &PDPair, transfer: &pdpair_api::TransferSpec, dir: &Path) -> Result<Report, String> {
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).map_err(|e| format!("random: {e}"))?;
    let secret: Vec<u8> = match &opts.external.pairing_key_file {
        Some(path) => std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?,
        None => secret.to_vec(),
    };
    let engine_spec =
        |role: Role, engine: String, pool: &pdpair_api::PoolSpec, key: &[u8], num_blocks: u32, tensor_rank: u32| {
            let layer = crate::engine_api::RegionRequest {
                layers: 1,
                ..Default::default()
            };
            // vLLM 0.33's [layers, blocks, ...] (its default) or [blocks, layers, ...], each block
            // a (head, token)'s K and V side by side.
            let side_by_side = || {
                use crate::layout::{KvArrangement, PoolLayout};
                let strides = PoolLayout::new(&pool.kv, &pool.parallelism, num_blocks, tensor_rank)
                    .ok()
                    .and_then(|l| {
                        let l = if opts.blocks_outermost {
                            l.blocks_outermost()
                        } else {
                            l.arranged(KvArrangement::Interleaved)
                        };
                        l.region_strides(0)
                    });
                crate::engine_api::RegionRequest {
                    layers: u32::try_from(pool.kv.layers).unwrap_or(0),
                    kv_arrangement: Some(KvArrangement::Interleaved),
                    layer_stride: strides.map(|s| s.0),
                    block_stride: strides.map(|s| s.1),
                }
            };
            EngineSpec {
                memory: opts.engine_memory,
                regions: if (role == Role::Prefill && opts.side_by_side.0)
                    || (role == Role::Decode && opts.side_by_side.1)
                {
                    vec![side_by_side()]
                } else if opts.region_per_layer {
                    vec![layer; usize::try_from(pool.kv.layers).unwrap_or(0)]
                } else {
                    Vec::new()
                },
                ..EngineSpec::of_pair(pair, pool, role, engine, key, num_blocks, tensor_rank)
            }
        };
    let kernel = |pool: &pdpair_api::PoolSpec| u32::try_from(pool.kv.kernel_block_size()).unwrap_or(1).max(1);
    // Rank 0 of each pool, or every rank (each its own engine) with --all-ranks; rank 0 keeps the
    // engine's plain name.
    let ranks = |pool: &pdpair_api::PoolSpec| {
        if opts.all_ranks {
            u32::try_from(pool.parallelism.tensor).unwrap_or(1).max(1)
        } else {
            1
        }
    };
    let rank_name = |base: String, r: u32| if r == 0 { base } else { format!("{base}-r{r}") };
    let mut agents: Vec<Spawned> = Vec::new();
    // Bad input is refused before anything starts.
    let hit = opts.decode_prefix_hit;
    let d_kernel = kernel(&pair.spec.decode);
    if hit >= opts.prompt_tokens || !hit.is_multiple_of(u64::from(d_kernel)) {
        return Err(format!(
            "--decode-prefix-hit {hit} must be below --prompt-tokens {} and a multiple of decode's kernel block size {d_kernel}",
            opts.prompt_tokens
        ));
    }
    // Decode.
    let d_socket = match &opts.external.decode_agent {
        Some(socket) => socket.clone(),
        None => {
            let (d_agent, d_socket) = spawn_agent(opts, dir, "decode", false)?;
            agents.push(d_agent);
            d_socket
        }
    };
    let d_blocks_n = blocks_for(opts.prompt_tokens - hit, d_kernel);
    let mut decode = Vec::new();
    for r in 0..ranks(&pair.spec.decode) {
        let spec = engine_spec(
            Role::Decode,
            rank_name("decode-0".into(), r),
            &pair.spec.decode,
            &secret,
            d_blocks_n,
            r,
        );
        let pod = opts.external.decode_pod.clone().filter(|_| r == 0);
        decode.push(
            SyntheticEngine::register_in_pod(&d_socket, dir, &spec, pod)
                .map_err(|e| format!("the decode engine (rank {r}) could not register: {e}"))?,
        );
    }
    let d_events = readers(&decode).ok_or("cannot read the decode engines' events")?;
    // Prefills: the pair's own, then --also-prefill, then --foreign-prefill.
    let mut sources: Vec<(PDPair, bool)> = vec![(pair.clone(), false)];
    for p in &opts.also_prefill {
        sources.push((load(p)?, false));
    }
    for p in &opts.foreign_prefill {
        sources.push((load(p)?, true));
    }
    let mut prefills = Vec::new();
    for (i, (manifest, foreign)) in sources.iter().enumerate() {
        let name = manifest.metadata.name.clone().unwrap_or_else(|| format!("prefill-{i}"));
        let (child, socket) = match (&opts.external.prefill_agent, i) {
            (Some(socket), 0) => (None, socket.clone()),
            _ => {
                let (child, socket) = spawn_agent(opts, dir, &format!("prefill-{i}"), opts.corrupt_one_byte)?;
                (Some(child), socket)
            }
        };
        let mut key = secret.clone();
        if *foreign {
            getrandom::fill(&mut key).map_err(|e| format!("random: {e}"))?;
        }
        let pool = &manifest.spec.prefill;
        let n = blocks_for(opts.prompt_tokens, kernel(pool));
        // An engine the agent refuses to register (an invalid pool) fails its requests.
        let mut engines = Vec::new();
        for r in 0..ranks(pool) {
            let spec = engine_spec(Role::Prefill, rank_name(format!("prefill-{i}"), r), pool, &key, n, r);
            let pod = opts.external.prefill_pod.clone().filter(|_| i == 0 && r == 0);
            match SyntheticEngine::register_in_pod(&socket, dir, &spec, pod) {
                Ok(engine) => engines.push(engine),
                Err(_) => {
                    engines.clear();
                    break;
                }
            }
        }
        let events = readers(&engines);
        prefills.push(Prefill {
            name,
            pool: pool.clone(),
            agent: child,
            ranks: engines,
            events,
            started: 0,
        });
    }
    let mut report = Report {
        mode: transfer.mode,
        transport: opts.transport.clone(),
        requests: opts.requests,
        decode_prefix_hit: hit,
        decode_regions: decode.first().map_or(0, |d| d.layout.regions.len()),
        per_prefill: prefills
            .iter()
            .map(|p| PerPrefill {
                name: p.name.clone(),
                ..PerPrefill::default()
            })
            .collect(),
        ..Report::default()
    };
    let mut latencies = Vec::new();
    let mut transfer_us = 0u64;
    let bar = std::io::stderr().is_terminal() && opts.requests >= 20;
    let n_prefills = prefills.len();
    let deadline = transfer.handshake_timeout.get() + transfer.lease_duration.get() + Duration::from_secs(5);
    for r in 0..opts.requests {
        if bar {
            eprint!(
                "\r[{:<40}] {}/{}",
                "#".repeat((40 * r / opts.requests) as usize),
                r,
                opts.requests
            );
        }
        let pi = (r as usize) % prefills.len();
        let id = format!("req-{r}");
        let seed = 0x5eed_0000 + u64::from(r);
        let tokens = opts.prompt_tokens;
        let p = &mut prefills[pi];
        let stats = &mut report.per_prefill[pi];
        if p.ranks.is_empty() {
            stats.failed += 1;
            *stats.reasons.entry("RegistrationFailed".into()).or_default() += 1;
            continue;
        }
        for engine in &mut p.ranks {
            let p_blocks: Vec<u32> = (0..blocks_for(tokens, engine.layout.block_size)).collect();
            // Without byte checks (large benchmarks), fill each prefill pool once: the transfer
            // moves the same bytes either way.
            if opts.verify_bytes || (r as usize) < n_prefills {
                engine.fill(seed, &p_blocks, 0, tokens);
            }
            let _ = engine.send(&EngineRequest::KvReady {
                release_token: None,
                request: id.clone(),
                blocks: p_blocks,
                num_tokens: tokens,
                first_token: 0,
                prompt: Some(crate::synthetic::prompt(seed, tokens)),
                event: None,
            });
        }
        let d_blocks: Vec<u32> = if opts.scatter_blocks {
            (0..d_blocks_n).rev().collect()
        } else {
            (0..d_blocks_n).collect()
        };
        let asked = Instant::now();
        for (rank, engine) in decode.iter_mut().enumerate() {
            if opts.verify_bytes {
                engine.clear(&d_blocks);
            }
            // The prefill ranks holding this rank's heads (of those running).
            let d_pool = &pair.spec.decode;
            let mut from: Vec<String> = crate::protocol::prefill_sources(
                &p.pool.kv,
                &p.pool.parallelism,
                &d_pool.kv,
                &d_pool.parallelism,
                rank as u32,
            )
            .into_iter()
            .filter_map(|j| p.ranks.get(j as usize).map(|e| e.address.clone()))
            .collect();
            if from.is_empty() {
                from.push(p.ranks[0].address.clone());
            }
            let request = if from.len() == 1 {
                EngineRequest::ExpectKv {
                    request: id.clone(),
                    prefill: from.remove(0),
                    blocks: d_blocks.clone(),
                    num_tokens: tokens,
                    first_token: hit,
                    prompt: Some(crate::synthetic::prompt(seed, tokens)),
                    event: None,
                }
            } else {
                EngineRequest::ExpectKvFrom {
                    request: id.clone(),
                    prefills: from,
                    blocks: d_blocks.clone(),
                    num_tokens: tokens,
                    first_token: hit,
                    prompt: Some(crate::synthetic::prompt(seed, tokens)),
                    event: None,
                }
            };
            engine
                .send(&request)
                .map_err(|e| format!("the decode agent went away: {e}"))?;
        }
        // Wait for every decode rank's verdict, watching P's events (transfer starts, for
        // --kill-prefill-after, counted on its rank 0).
        let mut outcomes: Vec<Option<Outcome>> = vec![None; decode.len()];
        while outcomes.iter().any(Option::is_none) {
            if let Some(rx) = &p.events {
                while let Ok((rank, ev)) = rx.try_recv() {
                    match ev {
                        AgentEvent::TransferStarted { .. } if rank == 0 => {
                            p.started += 1;
                            if pi == 0 && opts.kill_prefill_after == Some(p.started) {
                                drop(p.agent.take()); // SIGKILL, reaped
                            }
                        }
                        AgentEvent::RequestDone {
                            transfer_us: Some(us), ..
                        } => transfer_us += us,
                        _ => {}
                    }
                }
            }
            match d_events.recv_timeout(Duration::from_millis(2)) {
                Ok((
                    rank,
                    AgentEvent::RequestDone {
                        request,
                        bytes,
                        checksum,
                        transfer_us: us,
                    },
                )) if request == id => {
                    // Decode reports its own transfer time when it read the KV (pull).
                    transfer_us += us.unwrap_or(0);
                    outcomes[rank] = Some(Ok((bytes, checksum)));
                }
                Ok((rank, AgentEvent::RequestFailed { request, reasons, .. })) if request == id => {
                    outcomes[rank] = Some(Err(reasons));
                }
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) if asked.elapsed() > deadline => {
                    for o in outcomes.iter_mut().filter(|o| o.is_none()) {
                        *o = Some(Err(vec!["LoopbackTimeout".into()]));
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err("the decode agent went away".into()),
            }
        }
        let ms = asked.elapsed().as_secs_f64() * 1e3;
        match combine(outcomes.into_iter().flatten()) {
            Ok((bytes, checksum)) => {
                stats.succeeded += 1;
                report.succeeded += 1;
                report.bytes += bytes;
                latencies.push(ms);
                match checksum.as_deref() {
                    Some("Verified") => report.checksum.verified += 1,
                    Some("Mismatched") => report.checksum.mismatched += 1,
                    Some("Unverified") => report.checksum.unverified += 1,
                    _ => {}
                }
                if opts.verify_bytes && decode.iter().any(|d| d.verify(seed, &d_blocks, hit, tokens) > 0) {
                    report.byte_errors += 1;
                }
            }
            Err(reasons) => {
                let rejected = reasons.iter().any(|r| crate::agent::is_handshake_rejection(r));
                if rejected {
                    stats.rejected += 1;
                    report.rejected += 1;
                    stats.reject_ms.push(ms);
                } else {
                    stats.failed += 1;
                    report.failed += 1;
                }
                for reason in reasons {
                    match reason.as_str() {
                        "ChecksumMismatch" => report.checksum.mismatched += 1,
                        "ChecksumUnverified" => report.checksum.unverified += 1,
                        _ => {}
                    }
                    *stats.reasons.entry(reason).or_default() += 1;
                }
            }
        }
    }
    if bar {
        eprintln!("\r[{}] {}/{}", "#".repeat(40), opts.requests, opts.requests);
    }
    // Let the last prefill events (their transfer times) arrive.
    thread::sleep(Duration::from_millis(50));
    for p in &prefills {
        if let Some(rx) = &p.events {
            while let Ok((_, ev)) = rx.try_recv() {
                if let AgentEvent::RequestDone {
                    transfer_us: Some(us), ..
                } = ev
                {
                    transfer_us += us;
                }
            }
        }
    }
    for stats in &mut report.per_prefill {
        stats.reject_latency_ms = percentiles(std::mem::take(&mut stats.reject_ms), true);
    }
    report.latency_ms = percentiles(latencies, false);
    report.throughput_gb_per_s = if transfer_us > 0 {
        report.bytes as f64 / (transfer_us as f64 * 1e3)
    } else {
        0.0
    };
    drop(decode);
    for p in &mut prefills {
        p.ranks.clear();
        agents.extend(p.agent.take());
    }
    for (path, n) in agents.iter().flat_map(Spawned::paths) {
        *report.paths.entry(path).or_default() += n;
    }
    drop(agents);
    Ok(report)
}

/// A decode rank's outcome: bytes and checksum outcome, or failure reasons.
type Outcome = Result<(u64, Option<String>), Vec<String>>;

/// A request's outcome over its decode ranks: done when every rank is (bytes add; the worst
/// checksum outcome wins), else the ranks' failure reasons, each once.
fn combine(outcomes: impl Iterator<Item = Outcome>) -> Result<(u64, Option<String>), Vec<String>> {
    let rank = |c: &Option<String>| match c.as_deref() {
        Some("Mismatched") => 3,
        Some("Unverified") => 2,
        Some(_) => 1,
        None => 0,
    };
    let mut done: (u64, Option<String>) = (0, None);
    let mut reasons: Vec<String> = Vec::new();
    for outcome in outcomes {
        match outcome {
            Ok((bytes, checksum)) => {
                done.0 += bytes;
                if rank(&checksum) > rank(&done.1) {
                    done.1 = checksum;
                }
            }
            Err(rs) => {
                for r in rs {
                    if !reasons.contains(&r) {
                        reasons.push(r);
                    }
                }
            }
        }
    }
    if reasons.is_empty() { Ok(done) } else { Err(reasons) }
}

/// Human-readable summary.
pub fn text(report: &Report) -> String {
    let mut out = format!(
        "{:?} over {}: {} requests, {} succeeded, {} rejected, {} failed\n",
        report.mode, report.transport, report.requests, report.succeeded, report.rejected, report.failed
    );
    if !report.paths.is_empty() {
        let paths: Vec<String> = report.paths.iter().map(|(p, n)| format!("{p} {n}")).collect();
        out.push_str(&format!(
            "  transfers by path (as the agents that moved them report): {}\n",
            paths.join(", ")
        ));
    }
    if report.decode_prefix_hit > 0 {
        out.push_str(&format!(
            "  decode held the first {} tokens of each prompt: only the tail moved\n",
            report.decode_prefix_hit
        ));
    }
    for p in &report.per_prefill {
        out.push_str(&format!(
            "  prefill {}: {} succeeded, {} rejected, {} failed",
            p.name, p.succeeded, p.rejected, p.failed
        ));
        if !p.reasons.is_empty() {
            let reasons: Vec<String> = p.reasons.iter().map(|(r, n)| format!("{r} x{n}")).collect();
            out.push_str(&format!(" [{}]", reasons.join(", ")));
        }
        if p.rejected > 0 {
            let l = &p.reject_latency_ms;
            out.push_str(&format!(
                " (rejected in p50 {:.2} ms, max {:.2} ms)",
                l.p50,
                l.max.unwrap_or(0.0)
            ));
        }
        out.push('\n');
    }
    out.push_str(&format!(
        "  moved {:.1} MB at {:.2} GB/s in flight; latency p50 {:.2} ms, p99 {:.2} ms\n",
        report.bytes as f64 / 1e6,
        report.throughput_gb_per_s,
        report.latency_ms.p50,
        report.latency_ms.p99
    ));
    out.push_str(&format!(
        "  checksums: {} verified, {} mismatched, {} unverified; byte errors seen by decode: {}\n",
        report.checksum.verified, report.checksum.mismatched, report.checksum.unverified, report.byte_errors
    ));
    out
}

#[cfg(test)]
mod path_tests {
    #[test]
    fn transfer_paths_are_read_from_the_metrics_text() {
        let text = "# HELP x\npdpair_agent_transfer_paths_total{backend=\"UcxHost\",kind=\"Tcp\"} 3\n\
                    pdpair_agent_transfers_total{role=\"prefill\"} 3\n\
                    pdpair_agent_transfer_paths_total{backend=\"UcxHost\",kind=\"SharedMemory\"} 12\n\
                    pdpair_agent_transfer_paths_total{kind=\"Tcp\"} x\n";
        assert_eq!(
            super::transfer_paths(text),
            [("Tcp/UcxHost".to_owned(), 3), ("SharedMemory/UcxHost".to_owned(), 12)]
        );
    }
}
