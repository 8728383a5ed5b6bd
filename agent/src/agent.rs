//! The node agent: engines register their KV pools over the engine API; decode (D) engines ask
//! for KV from a prefill (P) engine; the agents authenticate each other, check the geometry with
//! the rule table before registering the peer, and P WRITEs its blocks into D's memory.
//!
//! Threads: one per engine connection (reading its requests), one per side-channel connection
//! (reading the peer's frames), the UCX thread, one timer per engine (deadlines and leases), and
//! short-lived ones for connecting and transferring. No path leaves a request waiting forever:
//! every D request has a deadline, every P hold has a lease, and a lost peer fails what waited on
//! it at once.

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    os::unix::net::{UnixListener, UnixStream},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use pdpair_api::{
    ChecksumPolicy, Role,
    checksum::{BlockSums, Outcome, compare_request},
};

mod publish;

pub use publish::Publisher;

use crate::{
    engine_api::{AgentEvent, EngineRequest, PoolRegistration},
    layout::PoolLayout,
    metrics::Metrics,
    pool::{self, Pool},
    protocol::{self, HandshakeError, MemoryDesc, Message, PeerInfo, Registration},
    ucx::Transport,
    ucx_thread::{PutOp, UcxHandle},
    wire::{self, hex_bytes},
};

/// Agent settings.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// Identity in handshakes and logs.
    pub name: String,
    /// Host the side-channel listeners bind (loopback in tests).
    pub listen_host: IpAddr,
    /// UCX transports.
    pub transport: Transport,
    /// Fault injection: flip one byte of one block in flight per request (prefill side).
    pub corrupt_one_byte: bool,
    /// How long a remembered rejection short-circuits new requests to that peer.
    pub rejection_ttl: Duration,
    /// Where to publish PDEndpoints (in a cluster); `None` publishes nothing.
    pub publisher: Option<Publisher>,
    /// Where pools the agent allocates for engines live (see [`crate::pool`]): a directory on a
    /// memory file system that engines on the node see at the same path. Every agent on a host
    /// must use the same one (UCX finds a peer's shared-memory segments through it).
    pub pool_dir: PathBuf,
    /// How often a decode agent pings each prefill agent it is connected to (at most
    /// [`MAX_HEARTBEAT`]); a prefill silent for [`HEARTBEAT_MISSES`] of these is lost.
    pub heartbeat: Duration,
}

/// Default ping interval on decode's side-channel links.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);
/// The longest ping interval a decode agent may use (prefill's silence limit assumes it).
pub const MAX_HEARTBEAT: Duration = Duration::from_secs(5);
/// Missed heartbeats after which decode drops a silent prefill.
pub const HEARTBEAT_MISSES: u32 = 5;
/// How long prefill waits for any frame from a decode agent (which pings at least every
/// [`MAX_HEARTBEAT`]) before it drops the link and forgets its registrations.
pub const PREFILL_SILENCE_LIMIT: Duration = Duration::from_secs(30);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means a panicking thread; the data is still consistent enough to fail
    // requests with, so keep going rather than cascade the panic.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running agent.
#[derive(Clone, Debug)]
pub struct Agent {
    shared: Arc<Shared>,
}

/// A remembered rejection: when, the reasons, the message.
type Remembered = (Instant, Vec<String>, String);

/// A D registration waiting for P's KV: the link it came on, the registration, when.
type Waiting = (Arc<Link>, Registration, Instant);

#[derive(Debug)]
struct Shared {
    cfg: AgentConfig,
    ucx: UcxHandle,
    metrics: Arc<Metrics>,
    /// Peer address -> (when, reasons, message): rejections are remembered, no retry storm.
    rejections: Mutex<HashMap<String, Remembered>>,
}

impl Agent {
    /// Starts UCX. Fails when UCX cannot start on the configured transport.
    pub fn start(mut cfg: AgentConfig, metrics: Arc<Metrics>) -> Result<Agent, String> {
        std::fs::create_dir_all(&cfg.pool_dir)
            .map_err(|e| format!("pool directory {}: {e}", cfg.pool_dir.display()))?;
        // UCX names its segments from this path and /proc/self/maps shows the canonical one.
        cfg.pool_dir = cfg
            .pool_dir
            .canonicalize()
            .map_err(|e| format!("pool directory {}: {e}", cfg.pool_dir.display()))?;
        let ucx = UcxHandle::start(cfg.transport, &cfg.pool_dir)?;
        Ok(Agent {
            shared: Arc::new(Shared {
                cfg,
                ucx,
                metrics,
                rejections: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// Serves the engine API on a Unix socket until the process ends.
    pub fn serve(&self, socket: &Path) -> io::Result<()> {
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket)?;
        for stream in listener.incoming() {
            match stream {
                Ok(stream) => {
                    let agent = self.clone();
                    thread::spawn(move || agent.engine_session(stream));
                }
                Err(e) => tracing::warn!(error = %e, "engine API accept failed"),
            }
        }
        Ok(())
    }

    /// Handles one engine connection: registration, then its requests.
    pub fn engine_session(&self, stream: UnixStream) {
        let mut reader = match stream.try_clone() {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "engine API: cannot clone the socket");
                return;
            }
        };
        // An engine that stops reading its events must not stall transfer threads forever.
        let _ = stream.set_write_timeout(Some(Duration::from_secs(10)));
        let writer = Arc::new(Mutex::new(stream));
        let registration = match wire::read_frame::<EngineRequest>(&mut reader) {
            Ok(EngineRequest::RegisterPool(reg)) => *reg,
            Ok(_) => {
                send(
                    &writer,
                    &AgentEvent::RegistrationFailed {
                        message: "the first message must be RegisterPool".into(),
                    },
                );
                return;
            }
            Err(e) => {
                tracing::debug!(error = %e, "engine API: no registration");
                return;
            }
        };
        let engine = match Engine::register(self.shared.clone(), registration, writer.clone()) {
            Ok(engine) => engine,
            Err(message) => {
                send(&writer, &AgentEvent::RegistrationFailed { message });
                return;
            }
        };
        self.shared.metrics.registrations.inc();
        if let Some(publisher) = &self.shared.cfg.publisher {
            publisher.add(&engine);
        }
        let address = engine.address.clone();
        let memory_path =
            (engine.pool.origin != pool::Origin::EngineFile).then(|| engine.pool.path.to_string_lossy().into_owned());
        send(
            &writer,
            &AgentEvent::Registered {
                address,
                agent: self.shared.cfg.name.clone(),
                memory_path,
            },
        );
        engine.spawn_timer();
        loop {
            match wire::read_frame::<EngineRequest>(&mut reader) {
                Ok(EngineRequest::ExpectKv {
                    request,
                    prefill,
                    blocks,
                    num_tokens,
                    first_token,
                }) => {
                    engine.expect_kv(request, vec![prefill], blocks, num_tokens, first_token);
                }
                Ok(EngineRequest::ExpectKvFrom {
                    request,
                    prefills,
                    blocks,
                    num_tokens,
                    first_token,
                }) => {
                    engine.expect_kv(request, prefills, blocks, num_tokens, first_token);
                }
                Ok(EngineRequest::KvReady {
                    request,
                    blocks,
                    num_tokens,
                    first_token,
                }) => {
                    engine.kv_ready(request, blocks, num_tokens, first_token);
                }
                Ok(EngineRequest::RegisterPool(_)) => {
                    tracing::warn!(engine = %engine.reg.engine, "engine registered twice; ignoring");
                }
                Err(e) => {
                    tracing::debug!(engine = %engine.reg.engine, error = %e, "engine disconnected");
                    break;
                }
            }
        }
        engine.shutdown();
        self.shared.metrics.registrations.dec();
    }
}

fn send(writer: &Mutex<UnixStream>, event: &AgentEvent) {
    if let Err(e) = wire::write_frame(&mut *lock(writer), event) {
        tracing::debug!(error = %e, "engine API: cannot send an event");
    }
}

/// What one engine's agent observed, for its PDEndpoint's status.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Handshakes, transfers, bytes, checksum outcomes.
    pub counters: pdpair_api::TransferCounters,
    /// The last handshake rejection: (unix seconds, peer, reasons, message).
    pub last_rejection: Option<(i64, String, Vec<String>, String)>,
}

/// A D request waiting for its KV.
#[derive(Debug)]
struct Pending {
    /// The prefill engines writing into this request (several when decode gathers heads from
    /// several prefill ranks).
    prefills: Vec<String>,
    /// Completions received so far, by prefill address: (checksums, bytes).
    parts: HashMap<String, (Option<BlockSums>, u64)>,
    blocks: Vec<u32>,
    num_tokens: u64,
    first_token: u64,
    deadline: Instant,
}

/// A P request whose KV is ready.
#[derive(Clone, Debug)]
struct Ready {
    blocks: Vec<u32>,
    num_tokens: u64,
    first_token: u64,
    since: Instant,
}

/// A ready request on prefill, and the decode ranks it serves: with more decode than prefill
/// tensor-parallel ranks several decode ranks take their heads from the same prefill rank, each
/// registering on its own; the engine hears once, when all have been served.
#[derive(Debug)]
struct Serving {
    ready: Ready,
    /// Decode ranks that will ask ([`protocol::decode_ranks_served`], from the first
    /// registrant's geometry).
    expected: Option<u32>,
    /// Consumers being served: a push running, or (pull) blocks lent and not yet released.
    in_flight: u32,
    /// Consumers finished, what they moved, the first failure.
    finished: u32,
    bytes: u64,
    transfer_us: u64,
    failure: Option<(Vec<String>, String)>,
    /// `TransferStarted` went to the engine.
    started: bool,
    /// Pull: when blocks were last lent (the lease for `Released`).
    lent_since: Option<Instant>,
}

impl Serving {
    fn new(ready: Ready) -> Serving {
        Serving {
            ready,
            expected: None,
            in_flight: 0,
            finished: 0,
            bytes: 0,
            transfer_us: 0,
            failure: None,
            started: false,
            lent_since: None,
        }
    }
}

/// Prefill-side matching of KvReady and Register, in either order.
#[derive(Debug, Default)]
struct Matching {
    ready: HashMap<String, Serving>,
    /// Registrations waiting for their KvReady (several decode ranks may wait for one request).
    registered: HashMap<String, Vec<Waiting>>,
}

/// A registration being served: its link, the registration, and the ready KV.
type Consumer = (Arc<Link>, Registration, Ready);

/// One consumer's result: bytes and microseconds in flight, or failure reasons and a message.
type Served = Result<(u64, u64), (Vec<String>, String)>;

/// An authenticated, handshaken side-channel connection.
#[derive(Debug)]
struct Link {
    writer: Mutex<TcpStream>,
    /// Cleared when the link's reader stops: nothing more is sent on it.
    alive: AtomicBool,
    peer: PeerInfo,
    /// UCX peer id (P side only: P writes into D).
    ucx_peer: Option<u64>,
    addr: String,
    /// P side: which of P's heads go where in D's blocks (all to all unless tensor parallelism
    /// differs).
    heads: protocol::HeadMap,
}

impl Link {
    fn send(&self, m: &Message) -> bool {
        wire::write_frame(&mut *lock(&self.writer), m).is_ok()
    }
}

#[derive(Debug)]
enum Slot {
    Connecting(Vec<String>),
    Connected(Arc<Link>),
}

#[derive(Debug)]
struct Engine {
    shared: Arc<Shared>,
    reg: PoolRegistration,
    key: Vec<u8>,
    layout: PoolLayout,
    pool: Pool,
    local: PeerInfo,
    address: String,
    writer: Arc<Mutex<UnixStream>>,
    closed: AtomicBool,
    stats: Mutex<EngineStats>,
    // Decode side.
    pending: Mutex<HashMap<String, Pending>>,
    peers: Mutex<HashMap<String, Slot>>,
    // Prefill side.
    /// KV ready on this P engine and D registrations waiting for it, under one lock: matching
    /// them is check-and-insert across both maps, which must be atomic (with two locks a
    /// KvReady and a Register arriving together could each miss the other and both wait).
    matching: Mutex<Matching>,
}

impl Engine {
    fn register(
        shared: Arc<Shared>,
        reg: PoolRegistration,
        writer: Arc<Mutex<UnixStream>>,
    ) -> Result<Arc<Engine>, String> {
        let key = hex_bytes::decode(&reg.pairing_key)
            .filter(|k| !k.is_empty())
            .ok_or("pairing_key must be non-empty hex")?;
        let layout =
            PoolLayout::new(&reg.kv, &reg.parallelism, reg.num_blocks, reg.tensor_rank).map_err(|e| e.to_string())?;
        let owner = pool::peer_owner(&lock(&writer));
        if reg.num_blocks == 0 {
            return Err("num_blocks must be at least 1".into());
        }
        let need = layout.region_len();
        let pool = match reg.memory_path.as_deref().filter(|p| !p.is_empty()) {
            Some(path) => Pool::engine_file(&shared.ucx, path, need).map_err(|e| {
                format!(
                    "{e} ({} layers x K,V x {} blocks x {} bytes)",
                    layout.layers,
                    layout.num_blocks,
                    layout.block_len()
                )
            })?,
            None => Pool::allocate(&shared.ucx, &shared.cfg.pool_dir, need, owner)?,
        };
        let listener = match reg.role {
            Role::Prefill => Some(
                TcpListener::bind(SocketAddr::new(shared.cfg.listen_host, 0))
                    .map_err(|e| format!("binding the side channel: {e}"))?,
            ),
            Role::Decode => None,
        };
        // Prefill engines are dialled at their listener; decode engines dial out, from this host.
        let address = match &listener {
            Some(l) => l
                .local_addr()
                .map(|a| a.to_string())
                .map_err(|e| format!("side channel address: {e}"))?,
            None => shared.cfg.listen_host.to_string(),
        };
        let local = PeerInfo {
            agent: shared.cfg.name.clone(),
            version: protocol::PROTOCOL_VERSION,
            pdpair: reg.pdpair.clone(),
            role: reg.role,
            engine: reg.engine.clone(),
            mode: reg.mode,
            checksum: reg.checksum,
            parallelism: reg.parallelism.clone(),
            kv: reg.kv.clone(),
            tensor_rank: reg.tensor_rank,
            worker_address: shared.ucx.worker_address.clone(),
            memory: MemoryDesc {
                base: pool.base,
                len: layout.region_len() as u64,
                rkey: pool.rkey.clone(),
                num_blocks: layout.num_blocks,
                block_len: layout.block_len() as u64,
                block_stride: layout.block_len() as u64,
                layers: layout.layer_offsets(),
            },
        };
        let engine = Arc::new(Engine {
            shared,
            reg,
            key,
            layout,
            pool,
            local,
            address,
            writer,
            closed: AtomicBool::new(false),
            stats: Mutex::new(EngineStats::default()),
            pending: Mutex::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            matching: Mutex::new(Matching::default()),
        });
        if let Some(listener) = listener {
            let e = engine.clone();
            thread::spawn(move || e.accept(listener));
        }
        Ok(engine)
    }

    fn event(&self, event: AgentEvent) {
        send(&self.writer, &event);
    }

    fn fail(&self, request: String, reasons: Vec<String>, message: String) {
        for r in &reasons {
            self.shared.metrics.request_failed(self.reg.role, r);
        }
        if !reasons.iter().any(|r| is_handshake_rejection(r)) {
            lock(&self.stats).counters.transfers_failed += 1;
        }
        self.event(AgentEvent::RequestFailed {
            request,
            reasons,
            message,
        });
    }

    fn transferred(&self, bytes: u64) {
        let counters = &mut lock(&self.stats).counters;
        counters.transfers_completed += 1;
        counters.bytes = counters.bytes.saturating_add(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    fn rejected(&self, peer: &str, reasons: Vec<String>, message: String) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        let mut stats = lock(&self.stats);
        stats.counters.handshakes_rejected += 1;
        stats.last_rejection = Some((now, peer.to_owned(), reasons, message));
    }

    /// A snapshot of what this engine's agent observed.
    pub fn stats(&self) -> EngineStats {
        lock(&self.stats).clone()
    }

    fn memory(&self) -> &[u8] {
        self.pool.memory(self.layout.region_len())
    }

    fn handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.reg.handshake_timeout_ms.max(1))
    }

    fn lease(&self) -> Duration {
        Duration::from_millis(self.reg.lease_ms.max(1))
    }

    /// Whether a request from the engine fits its role and pool; fails it otherwise.
    fn accept_request(&self, role: Role, what: &str, request: &str, blocks: &[u32]) -> bool {
        let problem = if self.reg.role != role {
            Some(("WrongRole", format!("{what} is for {role} engines")))
        } else {
            self.check_blocks(blocks).err().map(|e| ("InvalidRequest", e))
        };
        match problem {
            Some((reason, message)) => {
                self.fail(request.to_owned(), vec![reason.into()], message);
                false
            }
            None => true,
        }
    }

    fn check_blocks(&self, blocks: &[u32]) -> Result<(), String> {
        if blocks.is_empty() {
            return Err("no blocks".into());
        }
        match blocks.iter().find(|b| **b >= self.layout.num_blocks) {
            Some(b) => Err(format!(
                "block {b} is outside the pool's {} blocks",
                self.layout.num_blocks
            )),
            None => Ok(()),
        }
    }

    // ---- decode side ------------------------------------------------------------------------

    fn expect_kv(
        self: &Arc<Self>,
        request: String,
        mut prefills: Vec<String>,
        blocks: Vec<u32>,
        num_tokens: u64,
        first_token: u64,
    ) {
        if !self.accept_request(Role::Decode, "ExpectKv", &request, &blocks) {
            return;
        }
        prefills.sort();
        prefills.dedup();
        if prefills.is_empty() {
            return self.fail(request, vec!["InvalidRequest".into()], "no prefill address".into());
        }
        for prefill in &prefills {
            if let Some((reasons, message)) = self.remembered(prefill) {
                return self.fail(
                    request,
                    reasons,
                    format!("remembered rejection by {prefill}: {message}"),
                );
            }
        }
        let deadline = Instant::now() + self.handshake_timeout() + self.lease();
        lock(&self.pending).insert(
            request.clone(),
            Pending {
                prefills: prefills.clone(),
                parts: HashMap::new(),
                blocks,
                num_tokens,
                first_token,
                deadline,
            },
        );
        for prefill in prefills {
            let mut peers = lock(&self.peers);
            match peers.get_mut(&prefill) {
                Some(Slot::Connected(link)) => {
                    let link = link.clone();
                    drop(peers);
                    self.send_registration(&link, &request);
                }
                Some(Slot::Connecting(queue)) => queue.push(request.clone()),
                None => {
                    peers.insert(prefill.clone(), Slot::Connecting(vec![request.clone()]));
                    drop(peers);
                    let e = self.clone();
                    thread::spawn(move || e.connect(prefill));
                }
            }
        }
    }

    fn remembered(&self, peer: &str) -> Option<(Vec<String>, String)> {
        let mut cache = lock(&self.shared.rejections);
        match cache.get(peer) {
            Some((at, reasons, message)) if at.elapsed() < self.shared.cfg.rejection_ttl => {
                Some((reasons.clone(), message.clone()))
            }
            Some(_) => {
                cache.remove(peer);
                None
            }
            None => None,
        }
    }

    fn send_registration(&self, link: &Link, request: &str) {
        let reg = lock(&self.pending).get(request).map(|p| Registration {
            request: request.to_owned(),
            blocks: p.blocks.clone(),
            num_tokens: p.num_tokens,
            first_token: p.first_token,
        });
        if let Some(reg) = reg
            && !link.send(&Message::Register(reg))
            && lock(&self.pending).remove(request).is_some()
        {
            self.fail(
                request.to_owned(),
                vec!["PeerLost".into()],
                format!("cannot reach prefill {}", link.addr),
            );
        }
    }

    fn connect(self: Arc<Self>, addr: String) {
        let started = Instant::now();
        let result = self.dial(&addr);
        let metrics = &self.shared.metrics;
        match result {
            Ok(link) => {
                metrics.handshake("accepted");
                lock(&self.stats).counters.handshakes_accepted += 1;
                let link = Arc::new(link);
                let queued = match lock(&self.peers).insert(addr.clone(), Slot::Connected(link.clone())) {
                    Some(Slot::Connecting(q)) => q,
                    _ => Vec::new(),
                };
                for request in queued {
                    self.send_registration(&link, &request);
                }
                self.spawn_heartbeat(&link);
                let e = self.clone();
                thread::spawn(move || e.read_prefill(link));
            }
            Err(err) => {
                let reasons = err.reasons();
                for r in &reasons {
                    metrics.handshake(r);
                }
                metrics.reject_latency(started.elapsed());
                if matches!(
                    err,
                    HandshakeError::Rejected { .. } | HandshakeError::Unauthenticated(_)
                ) {
                    self.rejected(&addr, reasons.clone(), err.to_string());
                }
                tracing::info!(engine = %self.reg.engine, peer = %addr, error = %err, "handshake with prefill failed");
                if matches!(
                    err,
                    HandshakeError::Rejected { .. } | HandshakeError::Unauthenticated(_)
                ) {
                    lock(&self.shared.rejections)
                        .insert(addr.clone(), (Instant::now(), reasons.clone(), err.to_string()));
                }
                let queued = match lock(&self.peers).remove(&addr) {
                    Some(Slot::Connecting(q)) => q,
                    _ => Vec::new(),
                };
                for request in queued {
                    if lock(&self.pending).remove(&request).is_some() {
                        self.fail(
                            request,
                            reasons.clone(),
                            format!("handshake with prefill {addr} failed: {err}"),
                        );
                    }
                }
            }
        }
    }

    fn dial(&self, addr: &str) -> Result<Link, HandshakeError> {
        let sock: SocketAddr = addr
            .parse()
            .map_err(|_| HandshakeError::Protocol(format!("bad prefill address {addr:?}")))?;
        let mut stream = TcpStream::connect_timeout(&sock, self.handshake_timeout()).map_err(wire::FrameError::from)?;
        stream
            .set_read_timeout(Some(self.handshake_timeout()))
            .map_err(wire::FrameError::from)?;
        stream.set_nodelay(true).map_err(wire::FrameError::from)?;
        protocol::authenticate_decode(&mut stream, &self.reg.pdpair, &self.key)?;
        let peer = protocol::handshake_decode(&mut stream, &self.local)?;
        // Heartbeats: we ping every `heartbeat` and prefill answers, so a read that waits
        // HEARTBEAT_MISSES of them means prefill is stuck; a write as long means the same.
        let silence = self.silence_limit();
        stream.set_read_timeout(Some(silence)).map_err(wire::FrameError::from)?;
        stream
            .set_write_timeout(Some(silence))
            .map_err(wire::FrameError::from)?;
        // Pull: decode reads from prefill's memory through its own endpoint.
        let ucx_peer = match self.reg.mode {
            pdpair_api::TransferMode::Pull => Some(
                self.shared
                    .ucx
                    .connect(
                        peer.worker_address.clone(),
                        peer.memory.rkey.clone(),
                        (peer.memory.base, peer.memory.len),
                    )
                    .map_err(HandshakeError::Protocol)?,
            ),
            pdpair_api::TransferMode::Push => None,
        };
        // Which of prefill's heads are ours (pull reads just those); the handshake checked that
        // they line up.
        let heads = protocol::head_map(&peer, &self.local).unwrap_or(protocol::HeadMap {
            p_first: 0,
            count: self.layout.local_heads,
            d_first: 0,
        });
        Ok(Link {
            writer: Mutex::new(stream),
            alive: AtomicBool::new(true),
            peer,
            ucx_peer,
            addr: addr.to_owned(),
            heads,
        })
    }

    fn silence_limit(&self) -> Duration {
        self.shared.cfg.heartbeat.min(MAX_HEARTBEAT) * HEARTBEAT_MISSES
    }

    /// Pings a prefill link every heartbeat while its reader runs.
    fn spawn_heartbeat(self: &Arc<Self>, link: &Arc<Link>) {
        let (engine, link) = (Arc::downgrade(self), Arc::downgrade(link));
        let every = self.shared.cfg.heartbeat.min(MAX_HEARTBEAT);
        thread::spawn(move || {
            for seq in 1u64.. {
                thread::sleep(every);
                let (Some(engine), Some(link)) = (engine.upgrade(), link.upgrade()) else {
                    return;
                };
                if engine.closed.load(Ordering::SeqCst)
                    || !link.alive.load(Ordering::SeqCst)
                    || !link.send(&Message::Ping { seq })
                {
                    return;
                }
            }
        });
    }

    fn read_prefill(self: Arc<Self>, link: Arc<Link>) {
        let mut reader = match lock(&link.writer).try_clone() {
            Ok(r) => r,
            Err(_) => return self.lost(&link, "cannot read the side channel".into()),
        };
        loop {
            match wire::read_frame::<Message>(&mut reader) {
                Ok(Message::Complete { request, sums, bytes }) => self.complete(&link.addr, request, sums, bytes, None),
                Ok(Message::Ready {
                    request,
                    blocks,
                    first_token,
                    num_tokens,
                    sums,
                }) => {
                    let (e, link) = (self.clone(), link.clone());
                    thread::spawn(move || e.read_kv(&link, request, blocks, first_token, num_tokens, sums));
                }
                Ok(Message::Failed {
                    request,
                    reason,
                    message,
                }) => {
                    if lock(&self.pending).remove(&request).is_some() {
                        self.fail(request, vec![reason], message);
                    }
                }
                Ok(Message::Ping { seq }) => {
                    link.send(&Message::Pong { seq });
                }
                Ok(Message::Reject { reasons, message }) => {
                    link.alive.store(false, Ordering::SeqCst);
                    return self.refused(&link, reasons, message);
                }
                Ok(_) => {}
                Err(e) => {
                    link.alive.store(false, Ordering::SeqCst);
                    // Close it: a stuck prefill must not get our later frames.
                    let _ = lock(&link.writer).shutdown(std::net::Shutdown::Both);
                    let why = match &e {
                        wire::FrameError::Io(io)
                            if matches!(io.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
                        {
                            format!(
                                "silent for {:?} ({HEARTBEAT_MISSES} heartbeats unanswered)",
                                self.silence_limit()
                            )
                        }
                        _ => e.to_string(),
                    };
                    return self.lost(&link, why);
                }
            }
        }
    }

    /// The prefill peer refused us after the handshake (it checks its memory layout against
    /// ours): fail what waited on it with its reasons, and remember them.
    fn refused(&self, link: &Link, reasons: Vec<String>, message: String) {
        self.rejected(&link.addr, reasons.clone(), message.clone());
        lock(&self.shared.rejections).insert(link.addr.clone(), (Instant::now(), reasons.clone(), message.clone()));
        for request in self.forget_peer(&link.addr) {
            self.fail(
                request,
                reasons.clone(),
                format!("prefill {} refused: {message}", link.addr),
            );
        }
    }

    /// Drops the connection slot of a prefill peer and takes the requests that waited on it.
    fn forget_peer(&self, addr: &str) -> Vec<String> {
        lock(&self.peers).remove(addr);
        let mut pending = lock(&self.pending);
        let ids: Vec<String> = pending
            .iter()
            .filter(|(_, p)| p.prefills.iter().any(|a| a == addr))
            .map(|(id, _)| id.clone())
            .collect();
        ids.into_iter().filter(|id| pending.remove(id).is_some()).collect()
    }

    /// The prefill peer is gone: fail at once everything that waited on it.
    fn lost(&self, link: &Link, why: String) {
        let failed = self.forget_peer(&link.addr);
        if self.closed.load(Ordering::SeqCst) {
            return;
        }
        for request in failed {
            self.fail(
                request,
                vec!["PeerLost".into()],
                format!("prefill {} ({}) went away: {why}", link.addr, link.peer.agent),
            );
        }
    }

    /// A prefill rank's KV is in place (pushed to us, or read by us in `transfer_us`): verify
    /// once every rank's part is here.
    fn complete(&self, from: &str, request: String, sums: Option<BlockSums>, bytes: u64, transfer_us: Option<u64>) {
        let p = {
            let mut pending = lock(&self.pending);
            let Some(p) = pending.get_mut(&request) else { return };
            p.parts.insert(from.to_owned(), (sums, bytes));
            if p.parts.len() < p.prefills.len() {
                return; // more prefill ranks to come
            }
            let Some(p) = pending.remove(&request) else { return };
            p
        };
        let bytes: u64 = p.parts.values().map(|(_, b)| *b).sum();
        // Each prefill rank summed its own heads; checksums add over heads, so the parts' sums
        // add up to decode's whole-block checksums.
        let sums = combine(p.parts.values().map(|(s, _)| s.as_ref()));
        self.shared.metrics.transfer_done(Role::Decode, bytes);
        self.transferred(bytes);
        if self.reg.checksum == ChecksumPolicy::Disabled {
            return self.event(AgentEvent::RequestDone {
                request,
                bytes,
                checksum: None,
                transfer_us,
            });
        }
        let block = u64::from(self.layout.block_size);
        let ours = BlockSums {
            block_size: self.layout.block_size,
            first_token: p.first_token,
            sums: p
                .blocks
                .iter()
                .enumerate()
                .filter(|(i, _)| p.first_token + *i as u64 * block < p.num_tokens)
                .map(|(i, b)| {
                    self.layout
                        .checksum(self.memory(), *b, p.first_token + i as u64 * block, p.num_tokens)
                        .unwrap_or(0)
                })
                .collect(),
        };
        let outcome = match &sums {
            Some(theirs) => compare_request(theirs, &ours, p.num_tokens).outcome(),
            None => Outcome::Unverified,
        };
        self.shared.metrics.checksum(outcome);
        {
            let counters = &mut lock(&self.stats).counters;
            match outcome {
                Outcome::Verified => counters.checksums_verified += 1,
                Outcome::Mismatched => counters.checksums_mismatched += 1,
                Outcome::Unverified => counters.checksums_unverified += 1,
            }
        }
        let name = format!("{outcome:?}");
        match (outcome, self.reg.checksum) {
            (Outcome::Verified, _) | (_, ChecksumPolicy::FailOpen) => {
                if outcome != Outcome::Verified {
                    tracing::warn!(%request, ?outcome, "KV checksum not verified (FailOpen: accepted)");
                }
                self.event(AgentEvent::RequestDone {
                    request,
                    bytes,
                    checksum: Some(name),
                    transfer_us,
                });
            }
            (Outcome::Mismatched, _) => self.fail(
                request,
                vec!["ChecksumMismatch".into()],
                "received KV does not match prefill's checksums".into(),
            ),
            _ => self.fail(
                request,
                vec!["ChecksumUnverified".into()],
                "received KV could not be verified (FailClosed)".into(),
            ),
        }
    }

    /// Pull: read the request's KV from prefill's blocks into ours, then verify it like a push
    /// completion and release prefill's blocks.
    fn read_kv(
        &self,
        link: &Link,
        request: String,
        p_blocks: Vec<u32>,
        p_first: u64,
        num_tokens: u64,
        sums: Option<BlockSums>,
    ) {
        let Some(p) = lock(&self.pending)
            .get(&request)
            .map(|p| (p.blocks.clone(), p.first_token, p.num_tokens))
        else {
            return;
        };
        let (d_blocks, d_first, d_tokens) = p;
        let started = Instant::now();
        let outcome = if d_tokens != num_tokens {
            Err((
                "TokenCountMismatch",
                format!("decode expects {d_tokens} tokens, prefill computed {num_tokens}"),
            ))
        } else {
            let p_block = u32::try_from(link.peer.kv.kernel_block_size()).unwrap_or(0);
            self.pull_ops(
                &link.peer.memory,
                link.heads,
                p_block,
                &p_blocks,
                p_first,
                &d_blocks,
                d_first,
                num_tokens,
            )
            .map_err(|m| ("TokenRangeNotCovered", m))
            .and_then(|ops| match link.ucx_peer {
                Some(peer) => self
                    .shared
                    .ucx
                    .get(peer, self.pool.region, ops)
                    .map_err(|e| ("ReadFailed", format!("reading prefill's blocks failed: {e}"))),
                None => Err(("TransportFailed", "no UCX endpoint to prefill".into())),
            })
        };
        match outcome {
            Ok(bytes) => {
                let took = started.elapsed();
                link.send(&Message::Released {
                    request: request.clone(),
                    bytes,
                });
                self.complete(&link.addr, request, sums, bytes, Some(took.as_micros() as u64));
            }
            Err((reason, message)) => {
                link.send(&Message::Released {
                    request: request.clone(),
                    bytes: 0,
                });
                if lock(&self.pending).remove(&request).is_some() {
                    self.fail(request, vec![reason.into()], message);
                }
            }
        }
    }

    /// Pull READs: each of our blocks (starting at `d_first`, `B_d` tokens) gathers the prefill
    /// blocks (`B_p` tokens, `B_d` a multiple) that start at its tokens, paired by absolute
    /// position. NHD blocks take each prefill block whole at its token offset; HND blocks take it
    /// head by head; adjacent reads are merged.
    #[allow(clippy::too_many_arguments)]
    fn pull_ops(
        &self,
        remote: &MemoryDesc,
        map: protocol::HeadMap,
        p_block: u32,
        p_blocks: &[u32],
        p_first: u64,
        d_blocks: &[u32],
        d_first: u64,
        num_tokens: u64,
    ) -> Result<Vec<PutOp>, String> {
        let (bd, bp) = (u64::from(self.layout.block_size), u64::from(p_block));
        if bp == 0 || bd % bp != 0 {
            return Err(format!("decode's block size {bd} is not a multiple of prefill's {bp}"));
        }
        let half = self.layout.half_token() as u64;
        let heads = u64::from(self.layout.local_heads);
        let base = self.pool.base;
        let mut ops: Vec<PutOp> = Vec::new();
        let mut push = |op: PutOp| match ops.last_mut() {
            Some(last) if last.local + last.len == op.local && last.remote + last.len == op.remote => {
                last.len += op.len
            }
            _ => ops.push(op),
        };
        for (i, d) in d_blocks.iter().enumerate() {
            let t = d_first + i as u64 * bd;
            if t >= num_tokens {
                break;
            }
            for j in 0..bd / bp {
                let tj = t + j * bp;
                if tj >= num_tokens {
                    break;
                }
                if tj < p_first || !(tj - p_first).is_multiple_of(bp) {
                    return Err(format!(
                        "token {tj} does not start a prefill block (prefill blocks start at {p_first})"
                    ));
                }
                let Some(pb) = p_blocks.get(((tj - p_first) / bp) as usize) else {
                    return Err(format!("token {tj} is past prefill's {} blocks", p_blocks.len()));
                };
                if *pb >= remote.num_blocks {
                    return Err(format!(
                        "prefill block {pb} is outside its {} blocks",
                        remote.num_blocks
                    ));
                }
                for layer in 0..self.layout.layers {
                    let (rk, rv) = remote.layers[layer as usize];
                    for (v, array) in [(false, rk), (true, rv)] {
                        let dst = base + self.layout.block_offset(layer, v, *d) as u64;
                        let src = remote.base + array + u64::from(*pb) * remote.block_stride;
                        match self.layout.layout {
                            pdpair_api::KvLayout::Nhd => push(PutOp {
                                local: dst + j * bp * heads * half,
                                remote: src,
                                len: bp * heads * half,
                            }),
                            pdpair_api::KvLayout::Hnd => {
                                // Our heads d_first.. come from prefill's p_first.. (all of
                                // them when tensor parallelism is equal).
                                for h in 0..u64::from(map.count) {
                                    let (dh, ph) = (u64::from(map.d_first) + h, u64::from(map.p_first) + h);
                                    push(PutOp {
                                        local: dst + (dh * bd + j * bp) * half,
                                        remote: src + ph * bp * half,
                                        len: bp * half,
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(ops)
    }

    // ---- prefill side -----------------------------------------------------------------------

    fn accept(self: Arc<Self>, listener: TcpListener) {
        for stream in listener.incoming() {
            if self.closed.load(Ordering::SeqCst) {
                break;
            }
            let Ok(stream) = stream else { continue };
            let e = self.clone();
            thread::spawn(move || e.serve_decode(stream));
        }
    }

    fn serve_decode(self: Arc<Self>, mut stream: TcpStream) {
        let peer_addr = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let _ = stream.set_read_timeout(Some(self.handshake_timeout()));
        let _ = stream.set_nodelay(true);
        let key = self.key.clone();
        let pdpair = self.reg.pdpair.clone();
        let peer = protocol::authenticate_prefill(&mut stream, |p| (p == pdpair).then(|| key.clone()))
            .and_then(|_| protocol::handshake_prefill(&mut stream, &self.local));
        let peer = match peer {
            Ok(peer) => peer,
            Err(err) => {
                for r in err.reasons() {
                    self.shared.metrics.handshake(&r);
                }
                if matches!(
                    err,
                    HandshakeError::Rejected { .. } | HandshakeError::Unauthenticated(_)
                ) {
                    self.rejected(&peer_addr, err.reasons(), err.to_string());
                }
                tracing::info!(engine = %self.reg.engine, peer = %peer_addr, error = %err, "refused a decode agent");
                return;
            }
        };
        // Which heads go where (checked in the handshake), and so decode's block length.
        let all = protocol::HeadMap {
            p_first: 0,
            count: self.layout.local_heads,
            d_first: 0,
        };
        let heads = protocol::head_map(&self.local, &peer).unwrap_or(all);
        let expected_block_len = PoolLayout::new(&peer.kv, &peer.parallelism, 1, peer.tensor_rank)
            .map(|l| l.block_len() as u64)
            .unwrap_or(0);
        // Push writes whole (or head-range) blocks of the same size; pull reads into larger ones.
        let push = self.reg.mode == pdpair_api::TransferMode::Push;
        if (push && peer.memory.block_len != expected_block_len)
            || peer.memory.layers.len() != self.layout.layers as usize
        {
            let _ = wire::write_frame(
                &mut stream,
                &Message::Reject {
                    reasons: vec!["MemoryLayoutMismatch".into()],
                    message: "block length or layer count differs".into(),
                },
            );
            return;
        }
        // In pull mode decode reads from us: no endpoint of ours writes to it.
        let connected = if push {
            self.shared
                .ucx
                .connect(
                    peer.worker_address.clone(),
                    peer.memory.rkey.clone(),
                    (peer.memory.base, peer.memory.len),
                )
                .map(Some)
        } else {
            Ok(None)
        };
        let ucx_peer = match connected {
            Ok(id) => id,
            Err(e) => {
                let _ = wire::write_frame(
                    &mut stream,
                    &Message::Reject {
                        reasons: vec!["TransportFailed".into()],
                        message: e,
                    },
                );
                return;
            }
        };
        self.shared.metrics.handshake("accepted");
        lock(&self.stats).counters.handshakes_accepted += 1;
        let Ok(mut reader) = stream.try_clone() else { return };
        // Decode pings at least every MAX_HEARTBEAT: a decode agent silent much longer is gone.
        let _ = stream.set_read_timeout(Some(PREFILL_SILENCE_LIMIT));
        let link = Arc::new(Link {
            writer: Mutex::new(stream),
            alive: AtomicBool::new(true),
            heads,
            peer,
            ucx_peer,
            addr: peer_addr,
        });
        loop {
            match wire::read_frame::<Message>(&mut reader) {
                Ok(Message::Register(reg)) => self.registration(&link, reg),
                Ok(Message::Released { request, bytes }) => self.released(request, bytes),
                Ok(Message::Ping { seq }) => {
                    link.send(&Message::Pong { seq });
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(engine = %self.reg.engine, peer = %link.addr, error = %e, "decode link ended");
                    break;
                }
            }
        }
        link.alive.store(false, Ordering::SeqCst);
        // D is gone: forget its registrations (the P engine's KV stays ready for a retry until
        // its lease ends).
        lock(&self.matching).registered.retain(|_, waiting| {
            waiting.retain(|(l, _, _)| !Arc::ptr_eq(l, &link));
            !waiting.is_empty()
        });
        if let Some(id) = ucx_peer {
            self.shared.ucx.disconnect(id);
        }
    }

    /// Pull: a decode rank has read a request's blocks; once every decode rank has, the prefill
    /// engine may reuse them.
    fn released(&self, request: String, bytes: u64) {
        let lent = lock(&self.matching)
            .ready
            .get(&request)
            .is_some_and(|s| s.in_flight > 0);
        if lent {
            self.shared.metrics.transfer_done(Role::Prefill, bytes);
            self.transferred(bytes);
            self.finish(request, Ok((bytes, 0)));
        }
    }

    /// Starts serving a ready request to one registration: counts it in flight and says how
    /// many decode ranks to expect (the first time). `None` when the request is not ready.
    fn begin(&self, matching: &mut Matching, link: &Arc<Link>, reg: Registration) -> Option<Consumer> {
        let serving = matching.ready.get_mut(&reg.request)?;
        if serving.expected.is_none() {
            serving.expected = Some(protocol::decode_ranks_served(&self.local, &link.peer));
        }
        serving.in_flight += 1;
        if self.reg.mode == pdpair_api::TransferMode::Pull {
            serving.lent_since = Some(Instant::now());
        }
        Some((link.clone(), reg, serving.ready.clone()))
    }

    /// One consumer of a ready request is done; when all expected are, tell the engine once:
    /// done (bytes and in-flight time summed) or the first failure.
    fn finish(&self, request: String, outcome: Served) {
        let concluded = {
            let mut matching = lock(&self.matching);
            let Some(serving) = matching.ready.get_mut(&request) else {
                return;
            };
            serving.in_flight = serving.in_flight.saturating_sub(1);
            serving.finished += 1;
            match outcome {
                Ok((bytes, us)) => {
                    serving.bytes += bytes;
                    serving.transfer_us += us;
                }
                Err(failure) => {
                    serving.failure.get_or_insert(failure);
                }
            }
            if serving.finished >= serving.expected.unwrap_or(1) {
                matching.ready.remove(&request)
            } else {
                None
            }
        };
        let Some(serving) = concluded else { return };
        match serving.failure {
            Some((reasons, message)) => self.fail(request, reasons, message),
            None => self.event(AgentEvent::RequestDone {
                request,
                bytes: serving.bytes,
                checksum: None,
                transfer_us: (self.reg.mode == pdpair_api::TransferMode::Push).then_some(serving.transfer_us),
            }),
        }
    }

    /// `TransferStarted` to the engine, once per request.
    fn started(&self, request: &str) {
        let first = lock(&self.matching)
            .ready
            .get_mut(request)
            .is_some_and(|s| !std::mem::replace(&mut s.started, true));
        if first {
            self.event(AgentEvent::TransferStarted {
                request: request.to_owned(),
            });
        }
    }

    fn registration(self: &Arc<Self>, link: &Arc<Link>, reg: Registration) {
        if let Err(e) = self.check_remote_blocks(link, &reg.blocks) {
            link.send(&Message::Failed {
                request: reg.request,
                reason: "InvalidRequest".into(),
                message: e,
            });
            return;
        }
        let mut matching = lock(&self.matching);
        if matching.ready.contains_key(&reg.request) {
            let consumer = self.begin(&mut matching, link, reg);
            drop(matching);
            if let Some(consumer) = consumer {
                self.spawn_transfer(consumer);
            }
        } else {
            matching
                .registered
                .entry(reg.request.clone())
                .or_default()
                .push((link.clone(), reg, Instant::now()));
        }
    }

    fn check_remote_blocks(&self, link: &Link, blocks: &[u32]) -> Result<(), String> {
        if blocks.is_empty() {
            return Err("no blocks".into());
        }
        match blocks.iter().find(|b| **b >= link.peer.memory.num_blocks) {
            Some(b) => Err(format!(
                "decode block {b} is outside its {} blocks",
                link.peer.memory.num_blocks
            )),
            None => Ok(()),
        }
    }

    fn kv_ready(self: &Arc<Self>, request: String, blocks: Vec<u32>, num_tokens: u64, first_token: u64) {
        if !self.accept_request(Role::Prefill, "KvReady", &request, &blocks) {
            return;
        }
        let ready = Ready {
            blocks,
            num_tokens,
            first_token,
            since: Instant::now(),
        };
        let consumers: Vec<Consumer> = {
            let mut matching = lock(&self.matching);
            if matching.ready.contains_key(&request) {
                drop(matching);
                return self.fail(
                    request.clone(),
                    vec!["InvalidRequest".into()],
                    format!("request {request} is already ready (KvReady twice)"),
                );
            }
            matching.ready.insert(request.clone(), Serving::new(ready));
            let waiting = matching.registered.remove(&request).unwrap_or_default();
            waiting
                .into_iter()
                .filter_map(|(link, reg, _)| self.begin(&mut matching, &link, reg))
                .collect()
        };
        for consumer in consumers {
            self.spawn_transfer(consumer);
        }
    }

    fn spawn_transfer(self: &Arc<Self>, (link, reg, ready): Consumer) {
        let e = self.clone();
        thread::spawn(move || e.transfer(&link, reg, ready));
    }

    /// Pull: tell decode where the request's KV is (with our checksums) and hold the blocks until
    /// it has read them or the lease ends.
    fn lend(&self, link: &Link, reg: Registration, ready: Ready) {
        let b = u64::from(self.layout.block_size);
        let live: Vec<(u32, u64)> = ready
            .blocks
            .iter()
            .enumerate()
            .map(|(i, block)| (*block, ready.first_token + i as u64 * b))
            .filter(|(_, t)| *t < ready.num_tokens)
            .collect();
        let sums = (self.reg.checksum != ChecksumPolicy::Disabled).then(|| BlockSums {
            block_size: self.layout.block_size,
            first_token: ready.first_token,
            // Just the heads decode reads (checksums add over heads: a decode rank gathering from
            // several prefill ranks compares their sum with its whole blocks).
            sums: live
                .iter()
                .map(|(p, t)| {
                    self.layout
                        .checksum_heads(
                            self.memory(),
                            *p,
                            *t,
                            ready.num_tokens,
                            link.heads.p_first,
                            link.heads.count,
                        )
                        .unwrap_or(0)
                })
                .collect(),
        });
        self.started(&reg.request);
        let sent = link.send(&Message::Ready {
            request: reg.request.clone(),
            blocks: ready.blocks,
            first_token: ready.first_token,
            num_tokens: ready.num_tokens,
            sums,
        });
        if !sent {
            self.finish(
                reg.request,
                Err((vec!["PeerLost".into()], "decode went away before reading".into())),
            );
        }
    }

    fn transfer(&self, link: &Link, reg: Registration, ready: Ready) {
        let request = reg.request.clone();
        let refuse = |reason: &str, message: String| {
            link.send(&Message::Failed {
                request: request.clone(),
                reason: reason.into(),
                message: message.clone(),
            });
            self.finish(request.clone(), Err((vec![reason.into()], message)));
        };
        if reg.num_tokens != ready.num_tokens {
            return refuse(
                "TokenCountMismatch",
                format!(
                    "decode expects {} tokens, prefill computed {}",
                    reg.num_tokens, ready.num_tokens
                ),
            );
        }
        if self.reg.mode == pdpair_api::TransferMode::Pull {
            return self.lend(link, reg, ready);
        }
        let pairs = match pair_blocks(self.layout.block_size, &ready, &reg) {
            Ok(p) => p,
            Err(message) => return refuse("TokenRangeNotCovered", message),
        };
        let Some(ucx_peer) = link.ucx_peer else {
            return refuse("TransportFailed", "no UCX endpoint".into());
        };
        let ops = self.put_ops(&link.peer.memory, &pairs, link.heads);
        self.started(&request);
        let sums = (self.reg.checksum != ChecksumPolicy::Disabled).then(|| BlockSums {
            block_size: self.layout.block_size,
            first_token: reg.first_token,
            sums: pairs
                .iter()
                .map(|(p, _, t)| {
                    self.layout
                        .checksum_heads(
                            self.memory(),
                            *p,
                            *t,
                            ready.num_tokens,
                            link.heads.p_first,
                            link.heads.count,
                        )
                        .unwrap_or(0)
                })
                .collect(),
        });
        let started = Instant::now();
        match self
            .shared
            .ucx
            .put(ucx_peer, self.pool.region, ops, self.shared.cfg.corrupt_one_byte)
        {
            Ok(bytes) => {
                let took = started.elapsed();
                self.shared.metrics.transfer_latency(took);
                self.shared.metrics.transfer_done(Role::Prefill, bytes);
                self.transferred(bytes);
                if link.send(&Message::Complete {
                    request: request.clone(),
                    sums,
                    bytes,
                }) {
                    self.finish(request, Ok((bytes, took.as_micros() as u64)));
                } else {
                    self.finish(
                        request,
                        Err((vec!["PeerLost".into()], "decode went away before the completion".into())),
                    );
                }
            }
            Err(e) => refuse("WriteFailed", format!("posting the WRITEs failed: {e}")),
        }
    }

    /// WRITEs for block pairs (P block, D block, first token), one per layer and K/V, with runs
    /// of consecutive blocks on both sides coalesced into one put.
    fn put_ops(&self, remote: &MemoryDesc, pairs: &[(u32, u32, u64)], heads: protocol::HeadMap) -> Vec<PutOp> {
        let block_len = self.layout.block_len() as u64;
        let base = self.pool.base;
        if heads.count != self.layout.local_heads || remote.block_len != block_len {
            // A head range of our blocks into a head range of decode's (HND: head-major inside a
            // block, so each range is contiguous): one put per block, layer and K/V.
            let head_bytes = u64::from(self.layout.block_size) * self.layout.half_token() as u64;
            let mut ops = Vec::new();
            for layer in 0..self.layout.layers {
                let (rk, rv) = remote.layers[layer as usize];
                for (v, remote_array) in [(false, rk), (true, rv)] {
                    for (p, d, _) in pairs {
                        ops.push(PutOp {
                            local: base
                                + self.layout.block_offset(layer, v, *p) as u64
                                + u64::from(heads.p_first) * head_bytes,
                            len: u64::from(heads.count) * head_bytes,
                            remote: remote.base
                                + remote_array
                                + u64::from(*d) * remote.block_stride
                                + u64::from(heads.d_first) * head_bytes,
                        });
                    }
                }
            }
            return ops;
        }
        let mut runs: Vec<(u32, u32, u32)> = Vec::new(); // (p start, d start, count)
        for (p, d, _) in pairs {
            match runs.last_mut() {
                Some((ps, ds, n)) if *ps + *n == *p && *ds + *n == *d => *n += 1,
                _ => runs.push((*p, *d, 1)),
            }
        }
        let mut ops = Vec::new();
        for layer in 0..self.layout.layers {
            let (rk, rv) = remote.layers[layer as usize];
            for (v, remote_array) in [(false, rk), (true, rv)] {
                for (ps, ds, n) in &runs {
                    ops.push(PutOp {
                        local: base + self.layout.block_offset(layer, v, *ps) as u64,
                        len: u64::from(*n) * block_len,
                        remote: remote.base + remote_array + u64::from(*ds) * remote.block_stride,
                    });
                }
            }
        }
        ops
    }

    // ---- timers and shutdown ----------------------------------------------------------------

    fn spawn_timer(self: &Arc<Self>) {
        let e = Arc::downgrade(self);
        thread::spawn(move || {
            loop {
                thread::sleep(Duration::from_millis(20));
                let Some(e) = e.upgrade() else { return };
                if e.closed.load(Ordering::SeqCst) {
                    return;
                }
                e.expire();
            }
        });
    }

    fn expire(&self) {
        let now = Instant::now();
        let late: Vec<(String, Pending)> = {
            let mut pending = lock(&self.pending);
            let ids: Vec<String> = pending
                .iter()
                .filter(|(_, p)| p.deadline <= now)
                .map(|(id, _)| id.clone())
                .collect();
            ids.into_iter()
                .filter_map(|id| pending.remove(&id).map(|p| (id, p)))
                .collect()
        };
        for (request, p) in late {
            self.fail(
                request,
                vec!["DeadlineExceeded".into()],
                format!("no KV from prefill {} before the deadline", p.prefills.join(", ")),
            );
        }
        let lease = self.lease();
        let pull = self.reg.mode == pdpair_api::TransferMode::Pull;
        // Ready KV nobody is reading or writing now, past its lease; and (pull) blocks lent to a
        // decode rank that did not release them in time.
        let expired: Vec<(String, Serving)> = {
            let ready = &mut lock(&self.matching).ready;
            let ids: Vec<String> = ready
                .iter()
                .filter(|(_, s)| {
                    (s.in_flight == 0 && s.ready.since.elapsed() >= lease)
                        || (pull && s.in_flight > 0 && s.lent_since.is_some_and(|at| at.elapsed() >= lease))
                })
                .map(|(id, _)| id.clone())
                .collect();
            ids.into_iter()
                .filter_map(|id| ready.remove(&id).map(|s| (id, s)))
                .collect()
        };
        for (request, serving) in expired {
            self.shared.metrics.lease_expired();
            let message = if serving.in_flight > 0 {
                "decode did not read the request's blocks within the lease".to_owned()
            } else if serving.finished == 0 {
                "no decode engine registered for the request within the lease".to_owned()
            } else {
                format!(
                    "{} of {} decode ranks took the request's KV within the lease",
                    serving.finished,
                    serving.expected.unwrap_or(1)
                )
            };
            self.fail(request, vec!["LeaseExpired".into()], message);
        }
        let stale: Vec<(Arc<Link>, String)> = {
            let registered = &mut lock(&self.matching).registered;
            let mut stale = Vec::new();
            registered.retain(|id, waiting| {
                waiting.retain(|(link, _, at)| {
                    let old = at.elapsed() >= lease;
                    if old {
                        stale.push((link.clone(), id.clone()));
                    }
                    !old
                });
                !waiting.is_empty()
            });
            stale
        };
        for (link, request) in stale {
            self.shared.metrics.lease_expired();
            link.send(&Message::Failed {
                request,
                reason: "LeaseExpired".into(),
                message: "the prefill engine did not finish the request within the lease".into(),
            });
        }
    }

    fn shutdown(&self) {
        self.closed.store(true, Ordering::SeqCst);
        // Wake the acceptor so it sees `closed` and drops the listener.
        if let Ok(addr) = self.address.parse::<SocketAddr>() {
            let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(100));
        }
        for (_, slot) in lock(&self.peers).drain() {
            if let Slot::Connected(link) = slot {
                let _ = lock(&link.writer).shutdown(std::net::Shutdown::Both);
            }
        }
        lock(&self.pending).clear();
        self.pool.release(&self.shared.ucx);
    }
}

/// Adds prefill ranks' block checksums element by element; `None` when any is missing or they do
/// not cover the same blocks.
fn combine<'a>(parts: impl Iterator<Item = Option<&'a BlockSums>>) -> Option<BlockSums> {
    let mut total: Option<BlockSums> = None;
    for part in parts {
        let part = part?;
        match &mut total {
            None => total = Some(part.clone()),
            Some(t) => {
                if (t.block_size, t.first_token, t.sums.len()) != (part.block_size, part.first_token, part.sums.len()) {
                    return None;
                }
                for (a, b) in t.sums.iter_mut().zip(&part.sums) {
                    *a = a.wrapping_add(*b);
                }
            }
        }
    }
    total
}

/// Whether a failure reason is a refused handshake (authentication or the rule table), as opposed
/// to a failed transfer.
pub fn is_handshake_rejection(reason: &str) -> bool {
    reason == protocol::UNAUTHENTICATED
        || pdpair_api::Reason::ALL.iter().any(|r| r.as_str() == reason)
        || matches!(
            reason,
            "RoleMismatch"
                | "TransferSettingsMismatch"
                | "VersionMismatch"
                | "PairMismatch"
                | "MemoryLayoutMismatch"
                | "WrongTensorRank"
                | protocol::AGENT_UNSUPPORTED
        )
}

/// Pairs D's blocks with P's by absolute token position (never by list length): D block `i`
/// holds tokens from `reg.first_token + i*B`; the P block holding that token must start exactly
/// there. Blocks wholly past the request's tokens are skipped. Returns (P block, D block, first
/// token) for each block to write.
fn pair_blocks(block_size: u32, ready: &Ready, reg: &Registration) -> Result<Vec<(u32, u32, u64)>, String> {
    let b = u64::from(block_size);
    let mut out = Vec::new();
    for (i, d) in reg.blocks.iter().enumerate() {
        let t = reg.first_token + i as u64 * b;
        if t >= reg.num_tokens {
            break;
        }
        if t < ready.first_token || !(t - ready.first_token).is_multiple_of(b) {
            return Err(format!(
                "decode block {i} starts at token {t}, which no prefill block starts at (prefill blocks start at {})",
                ready.first_token
            ));
        }
        let k = ((t - ready.first_token) / b) as usize;
        let Some(p) = ready.blocks.get(k) else {
            return Err(format!(
                "token {t} is past prefill's {} blocks from token {}",
                ready.blocks.len(),
                ready.first_token
            ));
        };
        out.push((*p, *d, t));
    }
    if out.is_empty() {
        return Err("no decode block holds any of the request's tokens".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(first: u64, blocks: Vec<u32>) -> Ready {
        Ready {
            blocks,
            num_tokens: 40,
            first_token: first,
            since: Instant::now(),
        }
    }

    fn reg(first: u64, blocks: Vec<u32>) -> Registration {
        Registration {
            request: "r".into(),
            blocks,
            num_tokens: 40,
            first_token: first,
        }
    }

    #[test]
    fn pairs_by_absolute_token_position_after_a_prefix_hit() {
        // P computed all 40 tokens in blocks 10..13 (16 tokens each); D already holds the first
        // 16 tokens (a prefix-cache hit) and asks for two blocks from token 16. Pairing by list
        // length would send P's first two blocks: wrong. By position: P's blocks 11 and 12.
        let pairs = pair_blocks(16, &ready(0, vec![10, 11, 12]), &reg(16, vec![5, 6])).expect("pairs");
        assert_eq!(pairs, vec![(11, 5, 16), (12, 6, 32)]);
    }

    #[test]
    fn refuses_misaligned_or_uncovered_ranges() {
        assert!(pair_blocks(16, &ready(0, vec![1, 2, 3]), &reg(8, vec![5])).is_err());
        assert!(pair_blocks(16, &ready(16, vec![1, 2]), &reg(0, vec![5])).is_err());
        assert!(pair_blocks(16, &ready(0, vec![1]), &reg(0, vec![5, 6])).is_err());
        // Blocks wholly past the request's tokens are skipped, not refused.
        let pairs = pair_blocks(16, &ready(0, vec![1, 2, 3]), &reg(0, vec![7, 8, 9, 4])).expect("pairs");
        assert_eq!(pairs.len(), 3);
    }
}
