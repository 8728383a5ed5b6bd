//! Command implementations behind `main.rs`.

use std::{io::Write, path::Path};

use pdpair_api::{CacheDtype, checksum::Shape};

/// Arguments of `pdpair-agent checksum`.
#[derive(Clone, Debug, clap::Args)]
pub struct ChecksumArgs {
    /// Layers in the dump.
    #[arg(long)]
    pub layers: u32,
    /// KV heads in the dump (the logical, unsharded count).
    #[arg(long = "kv-heads")]
    pub kv_heads: u32,
    /// Elements per head.
    #[arg(long = "head-dim")]
    pub head_dim: u32,
    /// Element type: bfloat16, float16, float32, fp8, fp8_e4m3 or fp8_e5m2.
    #[arg(long = "cache-dtype")]
    pub cache_dtype: String,
    /// Tokens per block.
    #[arg(long = "block-size")]
    pub block_size: u32,
    /// The request's token count; tokens at or past it count as zero.
    #[arg(long = "num-tokens")]
    pub num_tokens: u64,
    /// Absolute position of the dump's first token.
    #[arg(long = "first-token", default_value_t = 0)]
    pub first_token: u64,
    /// An MLA cache: each token is one latent vector of head-dim elements (no V).
    #[arg(long)]
    pub mla: bool,
    /// The dump: blocks in order; inside a block, for each layer, for each head, for each token,
    /// the K bytes of that head then its V bytes (with --mla, its latent; little-endian elements).
    pub file: std::path::PathBuf,
}

/// A usage problem, reported with exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Parses a cache dtype name into element bytes.
pub fn element_bytes(name: &str) -> Result<u32, UsageError> {
    let dtype: CacheDtype = serde_json::from_value(serde_json::Value::String(name.to_owned())).map_err(|_| {
        UsageError(format!(
            "--cache-dtype {name:?} is not one of bfloat16, float16, float32, fp8, fp8_e4m3, fp8_e5m2"
        ))
    })?;
    dtype
        .element_bytes()
        .ok_or_else(|| UsageError("--cache-dtype auto cannot be used here: pass the resolved dtype".into()))
}

/// Runs `checksum`, writing one decimal u64 per block to `out`.
pub fn checksum(args: &ChecksumArgs, out: &mut dyn Write) -> Result<(), UsageError> {
    let shape = Shape {
        layers: args.layers,
        heads: args.kv_heads,
        head_dim: args.head_dim,
        element_bytes: element_bytes(&args.cache_dtype)?,
        latent: args.mla,
    };
    for (flag, value) in [
        ("--layers", args.layers),
        ("--kv-heads", args.kv_heads),
        ("--head-dim", args.head_dim),
        ("--block-size", args.block_size),
    ] {
        if value == 0 {
            return Err(UsageError(format!("{flag} must be at least 1")));
        }
    }
    if shape.pieces_per_token().is_none() {
        return Err(UsageError(format!(
            "a token's {} {} x head-dim {} x {} bytes = {} bytes, not a multiple of 8: the checksum reads 8-byte pieces",
            if args.mla { "latent takes" } else { "K and V take" },
            shape.halves(),
            args.head_dim,
            shape.element_bytes,
            shape.token_bytes()
        )));
    }
    let dump = read(&args.file)?;
    let block_bytes = shape.canonical_block_bytes(args.block_size);
    let sums = crate::checksum::canonical_dump(&shape, args.block_size, args.first_token, args.num_tokens, &dump).ok_or_else(|| {
        UsageError(format!(
            "{}: {} bytes is not a whole number of {block_bytes}-byte blocks (layers x kv-heads x block-size x 2 (1 with --mla) x head-dim x element bytes)",
            args.file.display(),
            dump.len()
        ))
    })?;
    for s in sums {
        writeln!(out, "{s}").map_err(|e| UsageError(format!("writing output: {e}")))?;
    }
    Ok(())
}

fn read(path: &Path) -> Result<Vec<u8>, UsageError> {
    std::fs::read(path).map_err(|e| UsageError(format!("{}: cannot read: {e}", path.display())))
}

/// Arguments of `pdpair-agent run`.
#[derive(Clone, Debug, clap::Args)]
pub struct RunArgs {
    /// The engine API's Unix socket.
    #[arg(long, default_value = crate::engine_api::DEFAULT_SOCKET)]
    pub socket: std::path::PathBuf,
    /// Identity in handshakes and logs (defaults to the node name).
    #[arg(long, env = "NODE_NAME", default_value = "pdpair-agent")]
    pub name: String,
    /// Address the side-channel listeners bind (the pod or node IP in a cluster).
    #[arg(long = "listen-host", env = "POD_IP", default_value = "127.0.0.1")]
    pub listen_host: std::net::IpAddr,
    /// How KV moves: auto (RDMA through UCX where UCX finds an RDMA device, which `UCX_TLS` in
    /// the environment may narrow, else the agent's tcp stream; the path is reported per peer),
    /// tcp (the agent's tcp stream, where the receiving agent places every byte; UCX's own tcp
    /// is never loaded), or shm (UCX's shared memory, for peer agents on one host).
    #[arg(long, default_value = "auto", value_parser = ["auto", "tcp", "shm"])]
    pub transport: String,
    /// Connections (lanes) the KV stream splits each peer's large ops over, each on its own
    /// thread, so sealing and copying use that many cores (1-8).
    #[arg(long = "stream-lanes", default_value_t = crate::transport::stream::DEFAULT_LANES,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=8))]
    pub stream_lanes: usize,
    /// Plain-HTTP address for /metrics, /livez and /readyz: HOST:PORT, or :PORT for every address
    /// (IPv6 and IPv4).
    #[arg(long = "admin-bind")]
    pub admin_bind: Option<pdpair_api::ListenAddr>,
    /// Fault injection for tests: flip one byte of one block in flight per request.
    #[arg(long = "corrupt-one-byte", hide = true)]
    pub corrupt_one_byte: bool,
    /// Publish PDEndpoints with this kubeconfig (local mode). In a cluster (the service account
    /// is mounted) they are published without it; `--no-publish` turns publishing off.
    #[arg(long)]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Do not publish PDEndpoints.
    #[arg(long = "no-publish")]
    pub no_publish: bool,
    /// Do not bind engines to their Pods (for engines that are not in Pods: local runs and
    /// tests). With the API server reachable (a kubeconfig, or in a cluster) the agent otherwise
    /// accepts a registration only from a process in the Pod it names, labelled for its PDPair
    /// and role; without it attestation is off either way. Logged at start.
    #[arg(long = "no-attest")]
    pub no_attest: bool,
    /// Where pools the agent allocates for engines live: a directory on a memory file system
    /// shared by every agent on the host, which must all use the same (UCX finds a peer's
    /// segments through it). Engines never see it: they get pools as descriptors.
    #[arg(long = "pool-dir", env = "PDPAIR_POOL_DIR", default_value = "/dev/shm/pdpair")]
    pub pool_dir: std::path::PathBuf,
    /// Decode side: ping each connected prefill agent this often (milliseconds, 1 to 5000); a
    /// prefill silent for 5 pings is lost and its requests fail with PeerLost.
    #[arg(long = "heartbeat-ms", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=5000))]
    pub heartbeat_ms: u64,
    /// At start, remove pool files a previous run left in `--pool-dir` (only when this agent is
    /// the directory's sole user, as the node's DaemonSet agent is).
    #[arg(long = "clean-pool-dir")]
    pub clean_pool_dir: bool,
    /// The group that owns the engine API socket (mode 0660): engines that are not the agent's
    /// user connect through it (in a cluster: engine Pods with this supplemental group).
    #[arg(long = "socket-group")]
    pub socket_group: Option<u32>,
    /// Hand peers' UCX worker addresses to UCX without first trying each in a throwaway,
    /// sealed-off process (which needs user namespaces or CAP_SYS_ADMIN). A hostile address can
    /// then crash the agent (docs/security.md).
    #[arg(long = "no-ucx-probe", env = "PDPAIR_NO_UCX_PROBE")]
    pub no_ucx_probe: bool,
    /// Ports prefill engines' side channels listen at, LOW-HIGH (from 1024), the same on every
    /// node: a prefill agent binds a free one of them, a decode agent dials no other. Unset: any
    /// port the kernel hands out (its ephemeral range), taken to be the same on every node.
    #[arg(long = "side-channel-ports", value_parser = crate::agent::parse_side_channel_ports)]
    pub side_channel_ports: Option<std::ops::RangeInclusive<u16>>,
}

/// Arguments of `pdpair-agent ucx-probe` (run by the agent itself, see
/// [`crate::transport::ucx_probe`]); the address comes on stdin.
#[derive(Clone, Debug, clap::Args)]
pub struct UcxProbeArgs {
    /// The agent's `--transport`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "tcp", "shm"])]
    pub transport: String,
    /// The agent's pool directory.
    #[arg(long = "pool-dir")]
    pub pool_dir: std::path::PathBuf,
    /// An empty directory (the agent makes it in the pool directory and removes it after) that
    /// the probe mounts over the pool directory for its own segments.
    #[arg(long)]
    pub scratch: std::path::PathBuf,
}

/// `pdpair-agent ucx-probe`: the exit status the agent reads (0: UCX survived the address).
/// Prints one line, `ucx-probe: ...`, to stderr.
pub fn ucx_probe(args: &UcxProbeArgs) -> i32 {
    let result = args
        .transport
        .parse()
        .map_err(|e: String| crate::transport::ucx_probe::ProbeError {
            code: crate::transport::ucx_probe::EXIT_SETUP,
            message: e,
        })
        .and_then(|t| {
            crate::transport::ucx_probe::serve(t, &args.pool_dir, &args.scratch, &mut std::io::stdin().lock())
        });
    match result {
        Ok(said) => {
            eprintln!("ucx-probe: {said}");
            0
        }
        Err(e) => {
            eprintln!("ucx-probe: {}", e.message);
            e.code
        }
    }
}

/// The API server configuration: a kubeconfig, or in-cluster credentials; `None` outside a
/// cluster.
fn kube_config(args: &RunArgs) -> Result<Option<kube::Config>, UsageError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| UsageError(format!("runtime: {e}")))?;
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| UsageError(format!("{}: {e}", path.display())))?;
            rt.block_on(kube::Config::from_custom_kubeconfig(
                kc,
                &kube::config::KubeConfigOptions::default(),
            ))
            .map_err(|e| UsageError(format!("{}: {e}", path.display())))?
        }
        None if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() => {
            kube::Config::incluster().map_err(|e| UsageError(format!("in-cluster credentials: {e}")))?
        }
        None => return Ok(None),
    };
    Ok(Some(config))
}

/// Arguments of `pdpair-agent loopback`.
#[derive(Clone, Debug, clap::Args)]
pub struct LoopbackArgs {
    /// The PDPair manifest: transfer settings, decode pool (one D agent), prefill pool (one P agent).
    #[arg(long)]
    pub pair: std::path::PathBuf,
    /// Another P agent from this manifest's prefill pool, in the same pair (repeatable).
    #[arg(long = "also-prefill")]
    pub also_prefill: Vec<std::path::PathBuf>,
    /// A P agent from this manifest's prefill pool holding a different pairing secret (repeatable).
    #[arg(long = "foreign-prefill")]
    pub foreign_prefill: Vec<std::path::PathBuf>,
    /// Requests, round-robin over the P agents.
    #[arg(long, default_value_t = 10)]
    pub requests: u32,
    /// Prompt tokens per request.
    #[arg(long = "prompt-tokens", default_value_t = 1024)]
    pub prompt_tokens: u64,
    /// How both agents move KV: shm (UCX's shared memory: they are on one host), tcp (the
    /// agents' tcp stream), or auto (RDMA where there is a device, else the stream).
    #[arg(long, default_value = "shm", value_parser = ["auto", "tcp", "shm"])]
    pub transport: String,
    /// The agents' `--stream-lanes` (KV stream connections per peer; theirs by default).
    #[arg(long = "stream-lanes", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=8))]
    pub stream_lanes: Option<usize>,
    /// Flip one byte of one block in flight per request (push: prefill corrupts what it writes).
    #[arg(long = "corrupt-one-byte")]
    pub corrupt_one_byte: bool,
    /// SIGKILL the first P agent once this many of its requests started transferring.
    #[arg(long = "kill-prefill-after")]
    pub kill_prefill_after: Option<u32>,
    /// Give decode scattered (reversed) block ids, so no two blocks coalesce into one WRITE.
    #[arg(long = "scatter-blocks")]
    pub scatter_blocks: bool,
    /// Use this running decode agent (its engine API socket) instead of starting one.
    #[arg(long = "decode-agent")]
    pub decode_agent: Option<std::path::PathBuf>,
    /// Use this running agent for the pair's own prefill instead of starting one.
    #[arg(long = "prefill-agent")]
    pub prefill_agent: Option<std::path::PathBuf>,
    /// The pair's secret (e.g. the pairing Secret's key) instead of a generated one.
    #[arg(long = "pairing-key-file")]
    pub pairing_key_file: Option<std::path::PathBuf>,
    /// The decode engine's Pod: its agent publishes a PDEndpoint owned by it.
    #[arg(long = "decode-pod")]
    pub decode_pod: Option<String>,
    /// The pair's own prefill engine's Pod.
    #[arg(long = "prefill-pod")]
    pub prefill_pod: Option<String>,
    /// Run every tensor-parallel rank of each pool as its own engine (a pool's ranks share its
    /// agent, as on a node); by default only rank 0 of each.
    #[arg(long = "all-ranks")]
    pub all_ranks: bool,
    /// Who allocates each engine's pool: the agent (shared memory peers on the host write with
    /// one copy) or the engine (its own file, registered by the agent).
    #[arg(long = "engine-memory", default_value = "agent", value_parser = ["agent", "engine"])]
    pub engine_memory: String,
    /// Decode already holds this many tokens of each prompt (a prefix-cache hit; whole decode
    /// kernel blocks): only the tail moves, paired by absolute token position, every byte checked.
    #[arg(long = "decode-prefix-hit", default_value_t = 0)]
    pub decode_prefix_hit: u64,
    /// Each engine registers its pool as one memory region per layer (as vLLM allocates its
    /// per-layer KV tensors) instead of one region.
    #[arg(long = "region-per-layer")]
    pub region_per_layer: bool,
    /// Engines of these roles (`decode`, `prefill` or `both`) register their pools as vLLM 0.33
    /// lays out its KV cache: one region, each head's token's K and V side by side
    /// (`Interleaved`), layers outermost (its default `LB..` layouts).
    #[arg(long = "side-by-side", value_parser = parse_side_by_side)]
    pub side_by_side: Option<(bool, bool)>,
    /// With `--side-by-side`: blocks outermost (vLLM 0.33's `BL..` layouts).
    #[arg(long = "blocks-outermost", requires = "side_by_side")]
    pub blocks_outermost: bool,
    /// Skip the decode engine's byte-by-byte check (for large benchmarks; checksums still run).
    #[arg(long = "no-verify-bytes")]
    pub no_verify_bytes: bool,
    /// Output format.
    #[arg(short = 'o', long = "output", default_value = "text", value_parser = ["text", "json"])]
    pub output: String,
}

/// Runs the agent until it is killed.
pub fn run(args: &RunArgs) -> Result<(), UsageError> {
    let transport: crate::transport::ucx::Transport = args.transport.parse().map_err(UsageError)?;
    let metrics = std::sync::Arc::new(crate::metrics::Metrics::new());
    let kube = kube_config(args)?;
    let cfg = crate::agent::AgentConfig {
        name: args.name.clone(),
        listen_host: args.listen_host,
        transport,
        stream_lanes: args.stream_lanes,
        corrupt_one_byte: args.corrupt_one_byte,
        rejection_ttl: std::time::Duration::from_secs(30),
        publisher: match kube.clone().filter(|_| !args.no_publish) {
            Some(config) => Some(crate::agent::Publisher::start(config, args.name.clone()).map_err(UsageError)?),
            None => None,
        },
        attestor: match kube.filter(|_| !args.no_attest) {
            Some(config) => Some(std::sync::Arc::new(
                crate::attest::Attestor::new(config, args.name.clone()).map_err(UsageError)?,
            )),
            None => None,
        },
        pool_dir: args.pool_dir.clone(),
        heartbeat: std::time::Duration::from_millis(args.heartbeat_ms),
        ucx_probe: if args.no_ucx_probe {
            None
        } else {
            Some(
                std::env::current_exe()
                    .map_err(|e| UsageError(format!("the agent's own binary, for the UCX probe: {e}")))?,
            )
        },
        side_channel_ports: args.side_channel_ports.clone(),
    };
    // Checked before anything in it is removed (and again as the agent starts).
    crate::agent::prepare_pool_dir(&args.pool_dir).map_err(UsageError)?;
    if args.clean_pool_dir {
        let removed = crate::memory::pool::clean_dir(&args.pool_dir);
        if removed > 0 {
            tracing::info!(dir = %args.pool_dir.display(), removed, "removed pool files a previous run left");
        }
    }
    let agent =
        crate::agent::Agent::start(cfg, metrics.clone()).map_err(|e| UsageError(format!("starting UCX: {e}")))?;
    if let Some(addr) = args.admin_bind {
        let listener = addr.bind().map_err(|e| UsageError(format!("binding {addr}: {e}")))?;
        let a = agent.clone();
        std::thread::spawn(move || crate::admin::serve(listener, metrics, a));
    }
    if let Some(parent) = args.socket.parent() {
        std::fs::create_dir_all(parent).map_err(|e| UsageError(format!("{}: {e}", parent.display())))?;
    }
    let listener = agent
        .bind(&args.socket)
        .map_err(|e| UsageError(format!("{}: {e}", args.socket.display())))?;
    if let Some(gid) = args.socket_group {
        // Run the agent with that group (as the chart does) and the socket already has it; else
        // change it (which needs CAP_CHOWN).
        use std::os::unix::fs::MetadataExt;
        let has = std::fs::metadata(&args.socket).map(|m| m.gid()).ok();
        if has != Some(gid) {
            std::os::unix::fs::chown(&args.socket, None, Some(gid)).map_err(|e| {
                UsageError(format!(
                    "--socket-group {gid}: {}: {e} (run the agent with that group, or with CAP_CHOWN)",
                    args.socket.display()
                ))
            })?;
        }
    }
    tracing::info!(socket = %args.socket.display(), name = %args.name, transport = %args.transport, ucx = %crate::transport::ucx::version(), "serving the engine API");
    agent
        .serve_on(listener)
        .map_err(|e| UsageError(format!("{}: {e}", args.socket.display())))
}

/// Runs `loopback`, printing the report.
pub fn loopback(args: &LoopbackArgs, out: &mut dyn Write) -> Result<(), UsageError> {
    let opts = crate::loopback::Options {
        pair: args.pair.clone(),
        also_prefill: args.also_prefill.clone(),
        foreign_prefill: args.foreign_prefill.clone(),
        requests: args.requests,
        prompt_tokens: args.prompt_tokens,
        transport: args.transport.clone(),
        stream_lanes: args.stream_lanes,
        corrupt_one_byte: args.corrupt_one_byte,
        kill_prefill_after: args.kill_prefill_after,
        verify_bytes: !args.no_verify_bytes,
        scatter_blocks: args.scatter_blocks,
        engine_memory: if args.engine_memory == "engine" {
            crate::synthetic::EngineMemory::Engine
        } else {
            crate::synthetic::EngineMemory::Agent
        },
        all_ranks: args.all_ranks,
        decode_prefix_hit: args.decode_prefix_hit,
        region_per_layer: args.region_per_layer,
        side_by_side: args.side_by_side.unwrap_or_default(),
        blocks_outermost: args.blocks_outermost,
        external: crate::loopback::External {
            decode_agent: args.decode_agent.clone(),
            prefill_agent: args.prefill_agent.clone(),
            pairing_key_file: args.pairing_key_file.clone(),
            decode_pod: args.decode_pod.clone(),
            prefill_pod: args.prefill_pod.clone(),
        },
        agent_bin: std::env::current_exe().map_err(|e| UsageError(format!("finding this executable: {e}")))?,
    };
    let report = crate::loopback::run(&opts).map_err(UsageError)?;
    let text = if args.output == "json" {
        serde_json::to_string(&report).map_err(|e| UsageError(e.to_string()))? + "\n"
    } else {
        crate::loopback::text(&report)
    };
    out.write_all(text.as_bytes())
        .map_err(|e| UsageError(format!("writing output: {e}")))
}

/// Arguments of `pdpair-agent bench-put`.
#[derive(Clone, Debug, clap::Args)]
pub struct BenchPutArgs {
    /// MiB written per round.
    #[arg(long, default_value_t = 256)]
    pub mib: usize,
    /// KiB per put (distinct memory each: unlike ucx_perftest, small puts are not cache hits).
    #[arg(long = "put-kib", default_value_t = 8192)]
    pub put_kib: usize,
    /// Rounds; the first and the best later one are reported.
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,
}

/// Measures put bandwidth over shared memory into registered and into UCX-allocated memory.
pub fn bench_put(args: &BenchPutArgs, out: &mut dyn Write) -> Result<(), UsageError> {
    for b in crate::bench::put_bandwidth(args.mib, args.put_kib, args.rounds).map_err(UsageError)? {
        writeln!(
            out,
            "target={} bytes={} put_bytes={} first_gb_per_s={:.2} best_gb_per_s={:.2}",
            b.target, b.bytes, b.put_bytes, b.first_gb_per_s, b.best_gb_per_s
        )
        .map_err(|e| UsageError(format!("writing output: {e}")))?;
    }
    Ok(())
}

/// Arguments of `pdpair-agent bench-checksum`.
#[derive(Clone, Debug, clap::Args)]
pub struct BenchChecksumArgs {
    /// MiB of KV to checksum (in the canonical layout).
    #[arg(long, default_value_t = 512)]
    pub mib: usize,
    /// Repetitions; the best is reported.
    #[arg(long, default_value_t = 5)]
    pub repeat: u32,
}

/// Measures the checksum's speed on one core beside a plain read of the same bytes.
pub fn bench_checksum(args: &BenchChecksumArgs, out: &mut dyn Write) -> Result<(), UsageError> {
    // An 8B-class shape: 32 layers, 8 KV heads of 128, bf16, 16-token blocks.
    let shape = Shape {
        layers: 32,
        heads: 8,
        head_dim: 128,
        element_bytes: 2,
        latent: false,
    };
    let block_bytes = shape.canonical_block_bytes(16);
    let blocks = (args.mib << 20).div_ceil(block_bytes).max(1);
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let data: Vec<u8> = (0..blocks * block_bytes)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let tokens = (blocks * 16) as u64;
    let mut best_read = f64::MAX;
    let mut best_sum = f64::MAX;
    for _ in 0..args.repeat.max(1) {
        let t = std::time::Instant::now();
        let plain = data.chunks_exact(8).fold(0u64, |a, c| {
            a.wrapping_add(u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        });
        std::hint::black_box(plain);
        best_read = best_read.min(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        let sums = crate::checksum::canonical_dump(&shape, 16, 0, tokens, &data);
        std::hint::black_box(sums);
        best_sum = best_sum.min(t.elapsed().as_secs_f64());
    }
    let gb = data.len() as f64 / 1e9;
    writeln!(
        out,
        "bytes={} plain_read_gb_per_s={:.2} checksum_gb_per_s={:.2} ratio={:.2}",
        data.len(),
        gb / best_read,
        gb / best_sum,
        best_read / best_sum
    )
    .map_err(|e| UsageError(format!("writing output: {e}")))
}

/// Arguments of `pdpair-agent synthetic-engine`: one request of the synthetic engine as its own
/// process, so engines written elsewhere (the Python connector's client) are checked against this
/// one byte for byte on the same inputs.
#[derive(Clone, Debug, clap::Args)]
pub struct SyntheticEngineArgs {
    /// The agent's engine API socket.
    #[arg(long)]
    pub socket: std::path::PathBuf,
    /// The PDPair manifest (transfer settings and the pool of `--role`).
    #[arg(long)]
    pub pair: std::path::PathBuf,
    /// prefill or decode.
    #[arg(long, value_parser = ["prefill", "decode"])]
    pub role: String,
    /// Engine id.
    #[arg(long)]
    pub engine: String,
    /// The pair's secret.
    #[arg(long = "pairing-key-file")]
    pub pairing_key_file: std::path::PathBuf,
    /// Tensor-parallel rank.
    #[arg(long = "tensor-rank", default_value_t = 0)]
    pub tensor_rank: u32,
    /// Blocks in the pool.
    #[arg(long = "num-blocks")]
    pub num_blocks: u32,
    /// Request id.
    #[arg(long)]
    pub request: String,
    /// The request's block ids, comma-separated, in token order.
    #[arg(long, value_delimiter = ',')]
    pub blocks: Vec<u32>,
    /// The request's token count.
    #[arg(long = "num-tokens")]
    pub num_tokens: u64,
    /// Absolute position of the first block's first token.
    #[arg(long = "first-token", default_value_t = 0)]
    pub first_token: u64,
    /// Seed of the synthetic pattern.
    #[arg(long)]
    pub seed: u64,
    /// Decode: the prefill ranks' addresses (repeatable: several make an `ExpectKvFromPool`).
    #[arg(long)]
    pub prefill: Vec<String>,
    /// The request's prompt digest (64 hex digits; absent: none is sent).
    #[arg(long, value_parser = parse_prompt)]
    pub prompt: Option<crate::engine_api::PromptDigest>,
    /// Where each layer's K and V blocks are in a one-region pool: KvFirst, BlocksFirst or
    /// (MLA) Latent; absent: the geometry's default.
    #[arg(long = "kv-arrangement", value_parser = parse_arrangement)]
    pub kv_arrangement: Option<crate::layout::KvArrangement>,
    /// The pool's regions, in layer order: comma-separated `LAYERS[:ARRANGEMENT[:LAYER_STRIDE:BLOCK_STRIDE]]`
    /// (strides in bytes, `Interleaved` only; absent: one region).
    #[arg(long, value_delimiter = ',', value_parser = parse_region)]
    pub regions: Vec<crate::engine_api::RegionRequest>,
}

fn parse_arrangement(s: &str) -> Result<crate::layout::KvArrangement, String> {
    use crate::layout::KvArrangement::*;
    match s {
        "KvFirst" => Ok(KvFirst),
        "BlocksFirst" => Ok(BlocksFirst),
        "Latent" => Ok(Latent),
        "Interleaved" => Ok(Interleaved),
        other => Err(format!("{other:?} is not KvFirst, BlocksFirst, Latent or Interleaved")),
    }
}

/// (prefill, decode).
fn parse_side_by_side(s: &str) -> Result<(bool, bool), String> {
    match s {
        "prefill" => Ok((true, false)),
        "decode" => Ok((false, true)),
        "both" => Ok((true, true)),
        other => Err(format!("{other:?} is not prefill, decode or both")),
    }
}

fn parse_prompt(s: &str) -> Result<crate::engine_api::PromptDigest, String> {
    serde_json::from_value(serde_json::Value::String(s.to_owned())).map_err(|e| format!("prompt {s:?}: {e}"))
}

fn parse_region(s: &str) -> Result<crate::engine_api::RegionRequest, String> {
    let mut parts = s.split(':');
    let layers = parts.next().unwrap_or_default();
    let arrangement = parts.next().map(parse_arrangement).transpose()?;
    let stride = |what: &str, v: Option<&str>| {
        v.map(|v| v.parse::<u64>().map_err(|e| format!("region {s:?}: {what} {v:?}: {e}")))
            .transpose()
    };
    let layer_stride = stride("layer stride", parts.next())?;
    let block_stride = stride("block stride", parts.next())?;
    if parts.next().is_some() {
        return Err(format!(
            "region {s:?}: LAYERS[:ARRANGEMENT[:LAYER_STRIDE:BLOCK_STRIDE]]"
        ));
    }
    Ok(crate::engine_api::RegionRequest {
        layers: layers
            .parse()
            .map_err(|e| format!("region {s:?}: layers {layers:?}: {e}"))?,
        kv_arrangement: arrangement,
        layer_stride,
        block_stride,
    })
}

/// Runs `synthetic-engine`: prints `{"address": ...}` once registered, then (prefill) fills and
/// sends `KvReady`, or (decode) clears and sends `ExpectKv`, and prints the request's final event
/// with, on decode, `bad_tokens` (received tokens whose bytes differ from the pattern).
pub fn synthetic_engine(args: &SyntheticEngineArgs, out: &mut dyn Write) -> Result<(), UsageError> {
    use crate::{
        engine_api::{AgentEvent, EngineRequest},
        synthetic::{EngineSpec, SyntheticEngine},
    };
    let pair = crate::loopback::load(&args.pair).map_err(UsageError)?;
    let role = if args.role == "prefill" {
        pdpair_api::Role::Prefill
    } else {
        pdpair_api::Role::Decode
    };
    let pool = if args.role == "prefill" {
        &pair.spec.prefill
    } else {
        &pair.spec.decode
    };
    let spec = EngineSpec {
        arrangement: args.kv_arrangement,
        regions: args.regions.clone(),
        ..EngineSpec::of_pair(
            &pair,
            pool,
            role,
            args.engine.clone(),
            &read(&args.pairing_key_file)?,
            args.num_blocks,
            args.tensor_rank,
        )
    };
    let mut engine = SyntheticEngine::register(&args.socket, Path::new("."), &spec).map_err(UsageError)?;
    let say = |out: &mut dyn Write, v: serde_json::Value| {
        writeln!(out, "{v}")
            .and_then(|()| out.flush())
            .map_err(|e| UsageError(format!("writing output: {e}")))
    };
    say(out, serde_json::json!({ "address": engine.address }))?;
    let (request, blocks) = (args.request.clone(), args.blocks.clone());
    let (num_tokens, first_token, prompt) = (args.num_tokens, args.first_token, args.prompt.clone());
    let message = if role == pdpair_api::Role::Prefill {
        engine.fill(args.seed, &blocks, first_token, num_tokens);
        EngineRequest::KvReady {
            release_token: None,
            request,
            blocks,
            num_tokens,
            first_token,
            prompt,
            event: None,
        }
    } else {
        engine.clear(&blocks);
        match args.prefill.as_slice() {
            [one] => EngineRequest::ExpectKv {
                request,
                prefill: one.clone(),
                blocks,
                num_tokens,
                first_token,
                prompt,
                event: None,
            },
            many => EngineRequest::ExpectKvFromPool {
                request,
                prefill_ranks: many.to_vec(),
                blocks,
                num_tokens,
                first_token,
                prompt,
                event: None,
            },
        }
    };
    engine.send(&message).map_err(|e| UsageError(e.to_string()))?;
    loop {
        let event = engine.next_event().map_err(|e| UsageError(e.to_string()))?;
        if matches!(event, AgentEvent::TransferStarted { .. }) {
            continue;
        }
        let mut v = serde_json::to_value(&event).map_err(|e| UsageError(e.to_string()))?;
        if role == pdpair_api::Role::Decode {
            v["bad_tokens"] = engine.verify(args.seed, &args.blocks, first_token, num_tokens).into();
        }
        return say(out, v);
    }
}

#[cfg(test)]
mod tests {
    use super::RunArgs;
    use clap::Parser;

    #[derive(Parser)]
    struct Run {
        #[command(flatten)]
        args: RunArgs,
    }

    #[test]
    fn side_channel_ports_are_read_and_a_bad_range_is_refused_naming_the_flag() {
        let run = Run::try_parse_from(["run", "--side-channel-ports", "40000-40999"]).expect("parses");
        assert_eq!(run.args.side_channel_ports, Some(40000..=40999));
        assert_eq!(
            Run::try_parse_from(["run"]).expect("parses").args.side_channel_ports,
            None
        );
        let refused = Run::try_parse_from(["run", "--side-channel-ports", "80-90"])
            .err()
            .expect("refused")
            .to_string();
        assert!(
            refused.contains("--side-channel-ports") && refused.contains("80-90") && refused.contains("below 1024"),
            "{refused}"
        );
    }
}
