//! The node agent: engines register their KV pools over the engine API; decode (D) engines ask
//! for KV from a prefill (P) engine; the agents authenticate each other, check the geometry with
//! the rule table before registering the peer, and P WRITEs its blocks into D's memory.
//!
//! This file holds the agent, the engine sessions and what both sides share; `decode.rs` and
//! `prefill.rs` hold each side's half of an engine.
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
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use pdpair_api::{Role, checksum::BlockSums};

mod claims;
mod decode;
mod dials;
mod prefill;
pub use prefill::{
    ENGINE_WAITING, ENGINE_WAITING_BLOCKS, MAX_GONE, MAX_LINKS_PER_ENGINE, MAX_LINKS_PER_SOURCE, MAX_WAITING,
    MAX_WAITING_BLOCKS,
};
mod publish;

use dials::Dialable;
pub use dials::{DIAL_PLACE_HELD, DIALS_PER_HOST, DIALS_PER_OWNER_HOST, parse_side_channel_ports};
use prefill::Matching;

pub use publish::{Publisher, endpoint_name};

use crate::{
    engine_api::{AgentEvent, EngineRequest, PoolRegistration, PromptDigest, ReleaseToken, Settings},
    layout::PoolLayout,
    lock,
    memory::pool::{self, Pool},
    metrics::Metrics,
    outboxes::{Charge, Outboxes},
    protocol::{self, HandshakeError, MemoryDesc, Message, PeerInfo, Reason},
    reason,
    transport::ucx_thread::UcxHandle,
    transport::{Backend as _, ucx::Transport},
    wire::{self, Sealer, hex_bytes},
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
    /// Lanes the KV stream splits each peer's large ops over ([`crate::transport::stream`]).
    pub stream_lanes: usize,
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
    /// Binds each engine to its Pod ([`crate::attest`]); `None` (outside a cluster) accepts any
    /// engine that can open the socket, and the agent says so at start.
    pub attestor: Option<Arc<crate::attest::Attestor>>,
    /// The agent's binary, which probes each peer's UCX worker address in a throwaway process
    /// before the agent's worker sees it ([`crate::transport::ucx_probe`]); `None` hands peers'
    /// addresses to UCX unprobed (a hostile one can crash the agent), and the agent says so at
    /// start.
    pub ucx_probe: Option<PathBuf>,
    /// Ports prefill engines' side channels listen at, the same on every node
    /// (`--side-channel-ports`; [`dials::parse_side_channel_ports`]); `None`: those the kernel
    /// hands out for port 0.
    pub side_channel_ports: Option<std::ops::RangeInclusive<u16>>,
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

/// A running agent.
#[derive(Clone, Debug)]
pub struct Agent {
    shared: Arc<Shared>,
}

/// A remembered rejection: when, the reasons, the message.
type Remembered = (Instant, Vec<Reason>, String);

/// Connections accepted on a side-channel listener that have not authenticated yet, at most
/// this many per agent...
pub const MAX_UNAUTHENTICATED: usize = 64;
/// ...and this many from one source address. More from that source are closed at once, before
/// reading a byte; when all are taken, one from a source holding fewer takes the place of the
/// oldest of the source holding the most ([`crate::unproven`]).
pub const MAX_UNAUTHENTICATED_PER_SOURCE: usize = 8;

/// Side-channel connections that have authenticated and are still in their handshake (a
/// thread each, until the handshake deadline), at most this many per agent...
pub const MAX_HANDSHAKING: usize = 256;
/// ...and this many from one source, under the pre-auth budget's rule ([`crate::unproven`]). A
/// decode agent starts at most [`dials::DIALS_PER_HOST`] dials to one prefill host a second
/// ([`dials::DIAL_PLACE_HELD`]), and a push handshake (a probe, a connection to decode's memory)
/// can take a second or more on a loaded node: this leaves them eight seconds.
pub const MAX_HANDSHAKING_PER_SOURCE: usize = 32;

#[derive(Debug)]
struct Shared {
    cfg: AgentConfig,
    /// UCX, for registering the engines' pools (host memory).
    ucx: UcxHandle,
    /// What moves host pools' bytes: the same UCX thread, or the tcp stream
    /// (`transport::host`).
    transport: Arc<crate::transport::host::Host>,
    /// What moves GPU pools' bytes between engines behind this agent.
    cuda: Arc<crate::transport::cuda_ipc::CudaIpc>,
    /// The engines registered here (by a registration id): who they are and the memory they
    /// described, to tell a peer that is one of them from one that only claims this agent's
    /// memory.
    locals: Mutex<Vec<(u64, LocalEngine)>>,
    /// Pools the agent allocated that no registered engine holds but that still count for a
    /// busy refusal ([`Shared::pools_held`]). Locked after `locals`, where both are.
    elsewhere: Mutex<Elsewhere>,
    metrics: Arc<Metrics>,
    /// Unauthenticated side-channel connections (the pre-auth budget).
    unauthenticated: Arc<crate::unproven::Budget>,
    /// Authenticated side-channel connections still in their handshake ([`MAX_HANDSHAKING`]).
    handshaking: Arc<crate::unproven::Budget>,
    /// What the side-channel links of each PDPair hold for their peers, in all.
    outboxes: crate::outboxes::Budgets,
    /// What the side-channel links of each PDPair hold of frames their peers are sending, in all.
    inboxes: crate::outboxes::Budgets,
    /// The engine API socket is bound.
    listening: AtomicBool,
    /// GPU memory descriptors held for registrations not made yet (`ShareGpuMemory`), on all
    /// engine connections: at most [`MAX_PENDING_GPU_FDS`].
    pending_gpu_fds: std::sync::atomic::AtomicUsize,
    /// Those descriptors by the Pod whose engines sent them (attested engines): at most
    /// [`MAX_PENDING_GPU_FDS_PER_POD`] each.
    pending_gpu_fds_by_pod: Mutex<HashMap<String, usize>>,
    /// Engine connections that have not registered yet: at most [`MAX_UNREGISTERED`].
    unregistered: std::sync::atomic::AtomicUsize,
    /// Room for registered engines' large frames being read and decoded, over all of them.
    engine_frames: Arc<crate::frame_budget::FrameBudget>,
    /// Held by a registration whose pool the agent allocates, from its room checks to the
    /// allocation.
    allocating: Mutex<()>,
    /// With attestation: engine connections not registered yet, by Pod UID
    /// ([`MAX_UNREGISTERED`] in all, [`MAX_UNREGISTERED_PER_POD`] from one Pod).
    registering: Arc<crate::unproven::Budget<String, UnixStream>>,
    /// Which prefill engine holds which side-channel address, kept across restarts.
    claims: claims::Claims,
    /// Where decode engines' links may go, and which ports prefill engines may have back.
    dialable: Dialable,
    /// Dials in flight per prefill host, for all of this agent's decode engines.
    dials: dials::DialGate,
}

/// Why an engine connection's frame before registration was not taken.
enum Unregistered {
    /// Said to the engine (`RegistrationFailed`): a frame that does not decode, or time ran out.
    Refused(String),
    /// The connection failed or closed.
    Gone(wire::FrameError),
}

/// Prefill agents one decode engine dials at once (each on a thread of its own), and
/// `ExpectKvFromPool`s it links at once, at most: requests past it are refused.
pub const MAX_DIALS: usize = 64;

/// Prefill agents one decode engine keeps links to (or dials), at most (two threads each):
/// past it the link used least recently is closed for a new one (its requests fail as for a
/// lost peer), or, when every one is still being dialled, the request is refused (`Busy`). An
/// engine naming address after address of prefill listeners that answer (an insider's) made
/// its agent keep links without end.
pub const MAX_PREFILL_LINKS: usize = 1024;

/// Engine connections that have not registered yet, at most: more are closed at once (each
/// holds a thread and a descriptor until it registers or its [`REGISTER_WITHIN`] runs out).
pub const MAX_UNREGISTERED: usize = 64;

/// Engine connections from one Pod that have not registered yet, at most (with attestation):
/// when [`MAX_UNREGISTERED`] are, a Pod holding fewer takes the place of the oldest of the Pod
/// holding the most, so one Pod's processes cannot keep every other engine from registering.
pub const MAX_UNREGISTERED_PER_POD: usize = 8;

/// GPU memory descriptors the agent holds for registrations in progress, on all engine
/// connections together (two engines' worth of [`crate::memory::cuda::MAX_VMM_CHUNKS`]): engines
/// that share descriptors and never register cannot run the agent out of descriptors.
pub const MAX_PENDING_GPU_FDS: usize = 2 * crate::memory::cuda::MAX_VMM_CHUNKS;

/// Of those, what the engines of one Pod may hold (attested engines): three quarters, so the
/// ranks of one Pod registering at once (torch's expandable segments export 3000 to 4000 a rank
/// of an 80 GB GPU) fit while another Pod's rank still does. One Pod's connections sharing
/// descriptors and never registering held the agent's whole budget, and every other Pod's GPU
/// pool shared through VMM was refused (from a review).
pub const MAX_PENDING_GPU_FDS_PER_POD: usize = MAX_PENDING_GPU_FDS / 4 * 3;

/// Engines registered at one agent, at most (each holds two threads or more, its pool's
/// mappings and, for prefill, a listener: without a bound a local process registering small
/// pools without end ran the agent out of threads and mappings for every engine on the node).
/// A node's engines are one per GPU and tensor-parallel rank: far fewer.
pub const MAX_ENGINES: usize = 256;

/// Engines one Pod registers at its node's agent, at most, where engines are attested: one Pod
/// registering [`MAX_ENGINES`] tiny pools kept every other Pod's engines on the node from
/// registering. A Pod's engines are one per GPU and rank it runs: far fewer.
pub const MAX_ENGINES_PER_POD: usize = 32;

/// Requests one engine holds at once (prefill: ready, waiting for decode; decode: asked of
/// prefill and not yet done), at most, and their block ids in all: past either a new one is
/// refused (`Busy`). Without them an engine could make the agent keep requests, each with a
/// pool's worth of block ids, for a lease (up to an hour) without end.
pub const MAX_LIVE_REQUESTS: usize = 16384;

/// Prefill agents' rejections one decode engine remembers at once, at most.
pub const MAX_REMEMBERED: usize = 4096;

/// See [`MAX_LIVE_REQUESTS`]: 64 MiB of block ids. A decode request's count once per prefill it
/// names, as each link keeps a copy: an engine naming 1024 prefills for a pool's worth of blocks
/// made its agent keep 1024 copies.
pub const MAX_LIVE_BLOCKS: usize = 16 << 20;

/// Blocks one request may name, at most: a pull `Ready` or a push `Complete` of that many
/// blocks with their checksums (some 28 bytes of text and two JSON values a block, 184 bytes a
/// block to read and decode) fits what one link may hold ([`wire::MAX_DECODE_COST`]): a larger
/// one closed the link, failing every request on it. 5M tokens of 16-token blocks.
pub const MAX_REQUEST_BLOCKS: usize = 327_680;

/// What a decode request costs its agent for each prefill it names besides its block ids, in
/// block ids (4 bytes each): the prefill's address, its link's window and registration, the
/// request's entry on that link (about 150-260 bytes). Counted as 64 block ids: a request of 1
/// block naming 1024 prefills counted 1024, and 16384 of them held 2-4 GB.
pub const PER_PREFILL: usize = 64;

/// The block ids a decode request of `blocks` blocks naming `prefills` prefills counts for
/// ([`MAX_LIVE_BLOCKS`]): each prefill's link keeps a copy, and [`PER_PREFILL`] more.
pub fn decode_held(blocks: usize, prefills: usize) -> usize {
    blocks.saturating_add(PER_PREFILL).saturating_mul(prefills)
}

/// Whether an engine holding `requests` requests of `blocks` block ids in all may take one more
/// of `more` blocks; `Err` says which bound it would pass.
pub fn live_room(requests: usize, blocks: usize, more: usize) -> Result<(), String> {
    if requests >= MAX_LIVE_REQUESTS {
        return Err(format!(
            "this engine holds {requests} requests at its agent already (at most {MAX_LIVE_REQUESTS})"
        ));
    }
    if blocks.saturating_add(more) > MAX_LIVE_BLOCKS {
        return Err(format!(
            "this engine's requests hold {blocks} block ids at its agent; this one's {more} would pass {MAX_LIVE_BLOCKS}"
        ));
    }
    Ok(())
}

/// How long an engine's pools that went still count as the agent's for a busy refusal: its
/// memory is uncharged once every mapping of it went (the engine's process still exiting).
pub const RELEASED_WITHIN: Duration = Duration::from_secs(10);

/// Memory the agent keeps for itself when it allocates an engine's pool: a pool is refused when
/// it would leave less than this under the agent's memory limit.
pub const AGENT_OWN_MEMORY: u64 = 256 << 20;

/// How long a connection whose Pod cannot be told may take to send its first frame, which is
/// answered with why it cannot register.
pub const UNATTESTED_WITHIN: Duration = Duration::from_secs(2);

/// How long an engine connection may take to register (its `Capabilities`, `ShareGpuMemory`
/// and `RegisterPool` frames); after that, no limit.
pub const REGISTER_WITHIN: Duration = Duration::from_secs(30);

/// Why a registration was refused, said to the engine as `RegistrationFailed`.
#[derive(Debug)]
struct Refusal {
    message: String,
    /// One of the agent's bounds on what it holds at once, which frees as other engines go
    /// or finish registering: the same registration may pass later.
    busy: bool,
}

impl Refusal {
    fn busy(message: String) -> Self {
        Self { message, busy: true }
    }

    fn event(self) -> AgentEvent {
        AgentEvent::RegistrationFailed {
            message: self.message,
            busy: self.busy,
        }
    }
}

impl From<String> for Refusal {
    fn from(message: String) -> Self {
        Self { message, busy: false }
    }
}

impl From<&str> for Refusal {
    fn from(message: &str) -> Self {
        message.to_owned().into()
    }
}

/// Descriptors counted in [`Shared::pending_gpu_fds`] (and, for an attested engine, in its
/// Pod's share) until dropped.
struct PendingFds<'a> {
    count: &'a std::sync::atomic::AtomicUsize,
    held: usize,
    pod: Option<(&'a Mutex<HashMap<String, usize>>, String)>,
}

impl PendingFds<'_> {
    /// Counts `n` more, if the Pod's share and the agent-wide budget allow.
    fn take(&mut self, n: usize) -> Result<(), String> {
        let mut by_pod = self.pod.as_ref().map(|(m, pod)| (lock(m), pod));
        if let Some((held, pod)) = by_pod.as_mut() {
            let mine = held.get(*pod).copied().unwrap_or(0);
            if mine + n > MAX_PENDING_GPU_FDS_PER_POD {
                return Err(format!(
                    "ShareGpuMemory: this engine's Pod holds {mine} GPU memory descriptors of registrations in progress; at most {MAX_PENDING_GPU_FDS_PER_POD}"
                ));
            }
        }
        let now = self.count.fetch_add(n, Ordering::SeqCst) + n;
        if now > MAX_PENDING_GPU_FDS {
            self.count.fetch_sub(n, Ordering::SeqCst);
            return Err(format!(
                "ShareGpuMemory: the agent holds {} GPU memory descriptors of registrations in progress; at most {MAX_PENDING_GPU_FDS}",
                now - n
            ));
        }
        if let Some((held, pod)) = by_pod.as_mut() {
            *held.entry((*pod).clone()).or_default() += n;
        }
        self.held += n;
        Ok(())
    }
}

impl Drop for PendingFds<'_> {
    fn drop(&mut self) {
        self.count.fetch_sub(self.held, Ordering::SeqCst);
        if let Some((m, pod)) = &self.pod {
            let mut held = lock(m);
            if let Some(n) = held.get_mut(pod) {
                *n = n.saturating_sub(self.held);
                if *n == 0 {
                    held.remove(pod);
                }
            }
        }
    }
}

/// An engine registered with this agent, as its peers see it.
#[derive(Debug)]
struct LocalEngine {
    /// Its Pod's uid, where engines are attested.
    pod: Option<String>,
    pdpair: String,
    role: Role,
    engine: String,
    memory: MemoryDesc,
    /// The pools the agent allocated for it (its memory cgroup is charged for them).
    held: Held,
}

/// Pools the agent allocated for one engine: they go with it.
#[derive(Clone, Debug)]
struct Held {
    /// The engine's Pod's uid, where engines are attested.
    pod: Option<String>,
    pdpair: String,
    role: Role,
    /// All their bytes, and of those the bytes that are files in the pool directory.
    all: u64,
    in_pool_dir: u64,
}

impl Held {
    /// Whether these pools count for a registration of `pdpair` and `role` from `pod`: pools of
    /// another Pod's engine of the same PDPair and role (a rollout's old Pod beside the new one),
    /// not of the registering Pod's own (they do not go for it), nor of other pairs' or roles'
    /// engines, which need not ever go.
    fn counts_for(&self, pod: Option<&str>, pdpair: &str, role: Role) -> bool {
        self.pdpair == pdpair && self.role == role && (pod.is_none() || self.pod.as_deref() != pod)
    }
}

/// Pools that count for a busy refusal besides registered engines' ([`Shared::pools_held`]).
#[derive(Debug, Default)]
struct Elsewhere {
    /// Those of registrations between their allocation and being recorded in `locals`, by
    /// registration id: a registration at once (a Pod's tensor-parallel ranks) saw their
    /// memory in use and not as held, and was refused for good.
    registering: Vec<(u64, Held)>,
    /// Those of engines that went in the last [`RELEASED_WITHIN`] (at most [`MAX_ENGINES`]):
    /// their memory may still be charged, an engine's process still ending maps it.
    released: Vec<(Instant, Held)>,
}

/// Counts a registration's pools as held until it is recorded in `locals` (or fails).
struct Registering {
    shared: Arc<Shared>,
    id: u64,
}

impl Registering {
    fn new(shared: &Arc<Shared>, id: u64, held: Held) -> Self {
        lock(&shared.elsewhere).registering.push((id, held));
        Registering {
            shared: shared.clone(),
            id,
        }
    }
}

impl Drop for Registering {
    fn drop(&mut self) {
        lock(&self.shared.elsewhere)
            .registering
            .retain(|(id, _)| *id != self.id);
    }
}

impl Shared {
    /// The pools that count for a registration of `pdpair` and `role` from `pod`
    /// ([`Held::counts_for`]): `(all, in the pool directory)` bytes of those the agent holds
    /// (for registered engines, and registrations being recorded), then of those it released in
    /// the last [`RELEASED_WITHIN`].
    fn pools_held(&self, pod: Option<&str>, pdpair: &str, role: Role) -> ((u64, u64), (u64, u64)) {
        let sum = |held: &mut dyn Iterator<Item = &Held>| {
            held.filter(|h| h.counts_for(pod, pdpair, role))
                .fold((0u64, 0u64), |(all, dir), h| {
                    (all.saturating_add(h.all), dir.saturating_add(h.in_pool_dir))
                })
        };
        let locals = lock(&self.locals);
        let mut elsewhere = lock(&self.elsewhere);
        elsewhere.released.retain(|(at, _)| at.elapsed() < RELEASED_WITHIN);
        let (a, d) = sum(&mut locals.iter().map(|(_, l)| &l.held));
        let (ra, rd) = sum(&mut elsewhere.registering.iter().map(|(_, h)| h));
        let released = sum(&mut elsewhere.released.iter().map(|(_, h)| h));
        ((a.saturating_add(ra), d.saturating_add(rd)), released)
    }

    /// Engine names are unique on the node (its agent): two engines of one name would share a
    /// PDEndpoint, and a peer naming one could not tell them apart.
    /// And an agent holds at most [`MAX_ENGINES`] (each holds threads, mappings, a listener),
    /// [`MAX_ENGINES_PER_POD`] of one Pod (`pod`, where attested).
    fn name_free(
        &self,
        locals: &[(u64, LocalEngine)],
        pod: Option<&str>,
        pdpair: &str,
        engine: &str,
    ) -> Result<(), Refusal> {
        if locals.len() >= MAX_ENGINES {
            return Err(Refusal::busy(format!(
                "this agent holds {MAX_ENGINES} registered engines, as many as it takes; one must go before another registers"
            )));
        }
        if let Some(pod) = pod
            && locals.iter().filter(|(_, l)| l.pod.as_deref() == Some(pod)).count() >= MAX_ENGINES_PER_POD
        {
            return Err(Refusal::busy(format!(
                "this engine's Pod has {MAX_ENGINES_PER_POD} engines registered at this agent, as many as one Pod may; one must go before another registers"
            )));
        }
        // Per pair: another tenant's engine cannot take a name to keep this pair's out.
        match locals.iter().find(|(_, l)| l.engine == engine && l.pdpair == pdpair) {
            // Which pair holds it is not said: it may be another tenant's.
            Some(_) => Err(format!(
                "engine \"{}\" of this PDPair is already registered at this agent; engine names must be unique on the node",
                crate::reason::peer_text(engine),
            )
            .into()),
            None => Ok(()),
        }
    }

    /// Where this agent may connect for a peer's memory: a KV stream only where a peer agent's
    /// stream can listen ([`Dialable::check_stream`]); UCX addresses are checked by the probe.
    fn check_memory_address(&self, address: &[u8]) -> Result<(), String> {
        if !crate::transport::stream::is_stream_address(address) {
            return Ok(());
        }
        let sock = crate::transport::stream::parse_address(address)?;
        self.dialable.check_stream(sock)
    }

    /// What a peer hears when this agent cannot connect to its memory at `address`: for a KV
    /// stream, not why (refused, no greeting, not a stream), which would tell an insider naming
    /// addresses whether something listens there; the agent logs it.
    fn memory_unreachable(&self, address: &[u8], error: String) -> String {
        if !crate::transport::stream::is_stream_address(address) {
            return error;
        }
        let at = String::from_utf8_lossy(address);
        tracing::info!(%at, %error, "cannot reach a peer's KV stream");
        format!("cannot reach the peer's KV stream at {at} (this agent's log says why)")
    }

    /// A peer whose memory is this agent's (it names one of this agent's backend addresses)
    /// must be an engine registered here, of `pdpair`, with the role, name and exact memory it
    /// claims: otherwise an authenticated peer could hand a prefill engine's own memory (learned
    /// from its handshake), or another pair's, as its own, and have the agent copy into it.
    /// `address` is where this agent would connect for the peer's memory
    /// ([`PeerInfo::address_for`]): a GPU pool behind another agent is reached at its
    /// `stream_address`, not its worker address, and an insider naming this agent's own stream
    /// there (with a worker address of nothing here) had the agent connect to itself with the
    /// insider's ranges.
    fn check_local_peer(&self, pdpair: &str, peer: &PeerInfo, address: &[u8]) -> Result<(), String> {
        let ours = [
            self.transport.address(),
            crate::transport::Backend::address(&*self.cuda),
        ];
        let at_ours = ours.iter().any(|a| *a == peer.worker_address || a == address);
        let locals = lock(&self.locals);
        // This agent's memory: its own address, or one of its engines' regions, key, base and
        // length (a peer may dress our keys in another address that still reaches this process;
        // a key alone is not ours: over tcp UCX packs the same few bytes for every region).
        let names_ours = at_ours
            || locals
                .iter()
                .any(|(_, l)| l.memory.regions.iter().any(|r| peer.memory.regions.contains(r)));
        if !names_ours {
            return Ok(());
        }
        let found = at_ours
            && locals.iter().any(|(_, l)| {
                l.pdpair == pdpair && l.role == peer.role && l.engine == peer.engine && l.memory == peer.memory
            });
        if found {
            Ok(())
        } else {
            Err(format!(
                "the peer names this agent's own memory but is no {} engine {:?} of {pdpair} registered here with that memory",
                peer.role,
                crate::reason::peer_text(&peer.engine)
            ))
        }
    }

    /// Why this agent refuses GPU pools, when it does: it has no CUDA driver, or sees no GPU.
    fn gpu_pools_refused(&self) -> Option<String> {
        if !crate::memory::cuda::driver_present() {
            return Some(
                "this agent has no CUDA driver (libcuda.so.1 is not on its loader path); register a host pool and stage KV through it"
                    .into(),
            );
        }
        match crate::memory::cuda::devices() {
            Ok(list) if !list.is_empty() => None,
            Ok(_) => {
                Some("this agent's CUDA driver shows it no GPU; register a host pool and stage KV through it".into())
            }
            Err(e) => Some(format!(
                "this agent's CUDA driver: {e}; register a host pool and stage KV through it"
            )),
        }
    }
}

/// Makes the pool directory (the agent's alone whatever the umask) where there is none, checks it
/// ([`check_pool_dir_owner`]; not a link) and returns its canonical path (UCX names its segments
/// from it, and /proc/self/maps shows the canonical one). Called before anything in it is
/// touched (`--clean-pool-dir` removes what a previous run left).
pub fn prepare_pool_dir(dir: &std::path::Path) -> Result<std::path::PathBuf, String> {
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o755)
        .create(dir)
        .map_err(|e| format!("pool directory {}: {e}", dir.display()))?;
    let own = std::fs::symlink_metadata(dir).map_err(|e| format!("pool directory {}: {e}", dir.display()))?;
    if own.file_type().is_symlink() {
        return Err(format!(
            "pool directory {} is a link: name the directory itself (a link there could be anyone's)",
            dir.display()
        ));
    }
    let canonical = dir
        .canonicalize()
        .map_err(|e| format!("pool directory {}: {e}", dir.display()))?;
    check_pool_dir_owner(&canonical)?;
    Ok(canonical)
}

/// The pool directory holds the pools the agent allocates, UCX's segments and the record of
/// engines' addresses: it must be the agent's own and not writable by others (`/dev/shm` is
/// anyone's, so a host user could make `/dev/shm/pdpair`, or a link there, before the agent
/// starts, and own what the agent keeps in it).
fn check_pool_dir_owner(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).map_err(|e| format!("pool directory {}: {e}", dir.display()))?;
    // SAFETY: geteuid has no preconditions.
    #[allow(unsafe_code)]
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(format!(
            "pool directory {} belongs to uid {}, not to this agent's ({me}): whoever owns it could replace what the agent keeps there",
            dir.display(),
            meta.uid()
        ));
    }
    if meta.mode() & 0o002 != 0 {
        return Err(format!(
            "pool directory {} is writable by anyone (mode {:o}): make it the agent's alone (chmod o-w)",
            dir.display(),
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

impl Agent {
    /// Starts UCX. Fails when UCX cannot start on the configured transport.
    pub fn start(mut cfg: AgentConfig, metrics: Arc<Metrics>) -> Result<Agent, String> {
        if let Some(range) = &cfg.side_channel_ports {
            dials::check_side_channel_ports(range)?;
        }
        cfg.pool_dir = prepare_pool_dir(&cfg.pool_dir)?;
        // Before any UCX thread may log (UCX adds a log handler without a lock).
        crate::transport::ucx::filter_log();
        let mut ucx = UcxHandle::start(cfg.transport, &cfg.pool_dir)?;
        match &cfg.ucx_probe {
            Some(exe) => {
                let started = std::time::Instant::now();
                let prober = crate::transport::ucx_probe::Prober::new(exe.clone(), cfg.transport, &cfg.pool_dir);
                ucx = ucx.with_probe(prober)?;
                tracing::info!(
                    ms = started.elapsed().as_millis() as u64,
                    "peers' UCX worker addresses are probed in a throwaway process first"
                );
            }
            None => tracing::warn!("the UCX probe is off: a peer's hostile UCX worker address can crash this agent"),
        }
        // UCX's tcp is never loaded (docs/security.md): peers without RDMA get the stream.
        let stream = match cfg.transport {
            Transport::Tcp => true,
            Transport::Auto => !crate::transport::ucx::network_available(),
            Transport::Shm => false,
        };
        let stream = if stream {
            let s = crate::transport::stream::Stream::with_lanes(cfg.listen_host, cfg.stream_lanes)?;
            tracing::info!(
                address = %String::from_utf8_lossy(&s.address()),
                "KV moves over this agent's tcp stream (no RDMA device, or --transport tcp); the path is reported as Tcp"
            );
            Some(s)
        } else {
            None
        };
        if cfg.attestor.is_none() {
            tracing::warn!(
                "engine attestation is off: any process that can open the engine socket may register for any PDPair, role and pod"
            );
        }
        // GPU pools behind other agents move over the same stream, staged through host buffers.
        let cuda = crate::transport::cuda_ipc::CudaIpc::new();
        if let Some(s) = &stream {
            cuda.use_stream(s.clone());
        }
        Ok(Agent {
            shared: Arc::new(Shared {
                claims: claims::Claims::load(&cfg.pool_dir, &cfg.name),
                dialable: Dialable::here(cfg.listen_host, cfg.side_channel_ports.clone()),
                dials: dials::DialGate::default(),
                cfg,
                transport: Arc::new(crate::transport::host::Host::new(ucx.clone(), stream)),
                cuda: Arc::new(cuda),
                locals: Mutex::new(Vec::new()),
                elsewhere: Mutex::new(Elsewhere::default()),
                ucx,
                metrics,
                unauthenticated: crate::unproven::Budget::new(MAX_UNAUTHENTICATED, MAX_UNAUTHENTICATED_PER_SOURCE),
                handshaking: crate::unproven::Budget::new(MAX_HANDSHAKING, MAX_HANDSHAKING_PER_SOURCE),
                outboxes: crate::outboxes::Budgets::new(
                    crate::outboxes::OUTBOX_BUDGET,
                    crate::outboxes::AGENT_OUTBOX_BUDGET,
                ),
                inboxes: crate::outboxes::Budgets::inbound(
                    crate::outboxes::INBOX_BUDGET,
                    crate::outboxes::AGENT_INBOX_BUDGET,
                ),
                listening: AtomicBool::new(false),
                pending_gpu_fds: std::sync::atomic::AtomicUsize::new(0),
                pending_gpu_fds_by_pod: Mutex::new(HashMap::new()),
                unregistered: std::sync::atomic::AtomicUsize::new(0),
                engine_frames: crate::frame_budget::FrameBudget::new(
                    crate::frame_budget::ENGINE_FRAMES,
                    crate::frame_budget::WAIT,
                ),
                allocating: Mutex::new(()),
                registering: crate::unproven::Budget::new(MAX_UNREGISTERED, MAX_UNREGISTERED_PER_POD),
            }),
        })
    }

    /// Serves the engine API on a Unix socket until the process ends.
    pub fn serve(&self, socket: &Path) -> io::Result<()> {
        let listener = self.bind(socket)?;
        self.serve_on(listener)
    }

    /// Binds the engine API socket, mode 0660 (the agent's user and group: engines reach it
    /// through the group or by running as that user), replacing a stale one.
    pub fn bind(&self, socket: &Path) -> io::Result<UnixListener> {
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};
        // Only a socket left there is replaced: a `--socket` naming any other file (the agent
        // runs as root) is an error, not a file removed.
        match std::fs::symlink_metadata(socket) {
            Ok(m) if m.file_type().is_socket() => std::fs::remove_file(socket)?,
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!(
                        "{} exists and is not a socket; the agent replaces only a socket",
                        socket.display()
                    ),
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = UnixListener::bind(socket)?;
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o660))?;
        self.shared.listening.store(true, Ordering::SeqCst);
        Ok(listener)
    }

    /// Whether the agent is ready: the engine API is listening, the UCX thread answers, and
    /// (when it publishes) the API server answered lately. `Err` says what is not.
    pub fn ready(&self) -> Result<(), String> {
        if !self.shared.listening.load(Ordering::SeqCst) {
            return Err("the engine API socket is not bound yet".into());
        }
        if !self.shared.transport.alive(Duration::from_secs(1)) {
            return Err("the UCX thread does not answer".into());
        }
        if let Some(p) = &self.shared.cfg.publisher
            && !p.api_reachable()
        {
            return Err("the API server has not answered in the last 30 s".into());
        }
        Ok(())
    }

    /// What this agent can do (the answer to `Capabilities`).
    pub fn capabilities(&self) -> AgentEvent {
        let gpus = crate::memory::cuda::devices().unwrap_or_default();
        let refused = self.shared.gpu_pools_refused();
        AgentEvent::Capabilities {
            api_version: crate::engine_api::API_VERSION,
            agent: self.shared.cfg.name.clone(),
            ucx_version: crate::transport::ucx::version(),
            ucx_memory_types: self
                .shared
                .ucx
                .memory_types
                .iter()
                .map(|t| t.as_str().to_owned())
                .collect(),
            gpus: gpus
                .into_iter()
                .map(|d| crate::engine_api::GpuInfo {
                    uuid: d.uuid,
                    name: d.name,
                })
                .collect(),
            pool_memory: match refused {
                None => vec!["host".into(), "cuda".into()],
                Some(_) => vec!["host".into()],
            },
            gpu_sharing: match &refused {
                None => vec!["ipc_handle".into(), "vmm_fd".into()],
                Some(_) => Vec::new(),
            },
            gpu_pools_refused: refused,
            gpu_between_agents: self.shared.transport.stream().is_some(),
            gpu_events: true,
            renew_prefills: true,
        }
    }

    /// Sets the gauges read from the UCX thread (orphaned requests and the memory they hold).
    pub fn refresh_gauges(&self) {
        if let Ok(o) = self.shared.ucx.orphans(crate::admin::HEAD_TIMEOUT) {
            let m = &self.shared.metrics;
            m.orphaned_requests.set(i64::try_from(o.requests).unwrap_or(i64::MAX));
            m.orphaned_bytes.set(i64::try_from(o.retired_bytes).unwrap_or(i64::MAX));
        }
    }

    /// Serves the engine API on a bound socket until the process ends.
    pub fn serve_on(&self, listener: UnixListener) -> io::Result<()> {
        for stream in listener.incoming() {
            match stream {
                // With attestation, the budget is shared fairly by Pods (read now, as the
                // connection is accepted): a Pod's processes holding connections open cannot
                // keep other Pods' engines from registering.
                Ok(stream) if self.shared.cfg.attestor.is_some() => {
                    let peer = crate::attest::pod_of_peer(&stream);
                    let source = peer.as_ref().map_or_else(|_| "(no pod)".to_owned(), |p| p.uid.clone());
                    let slot = match self.shared.registering.admit(source.clone(), &stream) {
                        Ok((slot, evicted)) => {
                            if evicted {
                                tracing::warn!(pod_uid = %source, "engine API: {MAX_UNREGISTERED} connections were registering; closed the oldest of the Pod holding the most for one of a Pod holding fewer");
                            }
                            slot
                        }
                        Err(why) => {
                            tracing::warn!(pod_uid = %source, ?why, "engine API: closed a new connection (at most {MAX_UNREGISTERED_PER_POD} registering from one Pod, {MAX_UNREGISTERED} in all)");
                            continue;
                        }
                    };
                    let agent = self.clone();
                    let started = thread::Builder::new()
                        .name("engine".into())
                        .spawn(move || agent.session(stream, Some(peer), Some(slot)));
                    if let Err(e) = started {
                        tracing::warn!(error = %e, "engine API: cannot start a thread for a connection; closed it");
                    }
                }
                Ok(stream) => {
                    let unregistered = &self.shared.unregistered;
                    if unregistered.fetch_add(1, Ordering::SeqCst) >= MAX_UNREGISTERED {
                        unregistered.fetch_sub(1, Ordering::SeqCst);
                        tracing::warn!(
                            "engine API: {MAX_UNREGISTERED} connections are registering already; closed a new one"
                        );
                        continue;
                    }
                    let agent = self.clone();
                    let started = thread::Builder::new()
                        .name("engine".into())
                        .spawn(move || agent.engine_session(stream));
                    if let Err(e) = started {
                        unregistered.fetch_sub(1, Ordering::SeqCst);
                        tracing::warn!(error = %e, "engine API: cannot start a thread for a connection; closed it");
                    }
                }
                Err(e) => {
                    // Out of descriptors, say: do not spin on it.
                    tracing::warn!(error = %e, "engine API accept failed");
                    thread::sleep(Duration::from_millis(100));
                }
            }
        }
        Ok(())
    }

    /// Handles one engine connection: registration, then its requests. It was counted in
    /// [`Shared::unregistered`], which it leaves once registered or gone.
    pub fn engine_session(&self, stream: UnixStream) {
        self.session(stream, None, None);
    }

    /// [`Agent::engine_session`] of a connection whose Pod was read as it was accepted and
    /// that holds `slot` in the registration budget (attestation on), or (`None`) counted in
    /// [`Shared::unregistered`].
    fn session(
        &self,
        stream: UnixStream,
        peer: Option<Result<crate::attest::PodIdentity, String>>,
        mut slot: Option<crate::unproven::Slot<String, UnixStream>>,
    ) {
        struct Registering<'a>(Option<&'a std::sync::atomic::AtomicUsize>);
        impl Registering<'_> {
            fn done(&mut self) {
                if let Some(count) = self.0.take() {
                    count.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
        impl Drop for Registering<'_> {
            fn drop(&mut self) {
                self.done();
            }
        }
        let mut registering = Registering(slot.is_none().then_some(&self.shared.unregistered));
        // Who connected, read now (not when it registers, seconds later).
        let peer = peer.or_else(|| {
            self.shared
                .cfg
                .attestor
                .as_ref()
                .map(|_| crate::attest::pod_of_peer(&stream))
        });
        let reader = match stream.try_clone() {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "engine API: cannot clone the socket");
                return;
            }
        };
        // An engine that stops reading its events must not stall transfer threads forever.
        let _ = stream.set_write_timeout(Some(Duration::from_secs(10)));
        let writer = Arc::new(Mutex::new(stream));
        // A connection whose Pod cannot be told (a process in no Pod, or one that exited as it
        // connected) can never register: its first frame, whatever it is, is answered with why,
        // and it has UNATTESTED_WITHIN to send it, not REGISTER_WITHIN (it held its place among
        // the connections registering, under "(no pod)", for 30 s: one Pod's processes exiting
        // as they connected held 8 places beside the Pod's own 8), and it shares nothing.
        if let Some(Err(why)) = &peer {
            let _ = wire::read_frame_fds_by::<serde_json::Value>(
                &reader,
                crate::engine_api::MAX_REGISTRATION_FRAME,
                Some(Instant::now() + UNATTESTED_WITHIN),
            );
            let message = format!("engine attestation refused the registration: {why}");
            send(&writer, &Refusal::from(message).event());
            return;
        }
        // Registration is bounded in time, all frames together (a connection that shares memory
        // and stalls holds descriptors); once registered, an engine may be silent as long as it
        // likes.
        let register_by = Instant::now() + REGISTER_WITHIN;
        // Every read of every frame keeps to it, however the engine paces its bytes.
        // A frame that does not decode is answered naming the field (and then closed).
        let next_frame = || {
            let (frame, fds) = wire::read_frame_fds_by::<serde_json::Value>(
                &reader,
                crate::engine_api::MAX_REGISTRATION_FRAME,
                Some(register_by),
            )
            .map_err(|e| match e {
                wire::FrameError::BadLength(n) => Unregistered::Refused(format!(
                    "a frame of {n} bytes before registration; at most {} (1..={})",
                    crate::engine_api::MAX_REGISTRATION_FRAME,
                    crate::engine_api::MAX_REGISTRATION_FRAME
                )),
                wire::FrameError::Malformed(why) => {
                    Unregistered::Refused(crate::reason::peer_text(&format!("malformed frame: {why}")))
                }
                e if e.timed_out() => Unregistered::Refused(format!("no registration within {REGISTER_WITHIN:?}")),
                e => Unregistered::Gone(e),
            })?;
            crate::engine_api::decode_before_registration(frame)
                .map(|request| (request, fds))
                .map_err(Unregistered::Refused)
        };
        let mut first = next_frame();
        if let Ok((EngineRequest::Capabilities, _)) = &first {
            send(&writer, &self.capabilities());
            first = next_frame();
        }
        // VMM allocations of a GPU pool, shared before the registration that names them.
        let mut shared: Vec<(std::os::fd::OwnedFd, u64)> = Vec::new();
        let mut pending = PendingFds {
            count: &self.shared.pending_gpu_fds,
            held: 0,
            pod: match &peer {
                Some(Ok(id)) => Some((&self.shared.pending_gpu_fds_by_pod, id.uid.clone())),
                _ => None,
            },
        };
        while let Ok((EngineRequest::ShareGpuMemory { sizes }, fds)) = &mut first {
            // The budget frees as other registrations finish: busy, not a refusal of this one.
            if let Err(refusal) = crate::engine_api::check_share(sizes, fds.len(), shared.len())
                .map_err(Refusal::from)
                .and_then(|()| pending.take(fds.len()).map_err(Refusal::busy))
            {
                send(&writer, &refusal.event());
                return;
            }
            shared.extend(std::mem::take(fds).into_iter().zip(sizes.iter().copied()));
            first = next_frame();
        }
        let (registration, fds) = match first {
            Ok((EngineRequest::RegisterPool(reg), fds)) => (*reg, fds),
            Ok(_) => {
                send(
                    &writer,
                    &AgentEvent::RegistrationFailed {
                        message: "the first message must be RegisterPool (after at most one Capabilities and any ShareGpuMemory)".into(),
                        busy: false,
                    },
                );
                return;
            }
            Err(Unregistered::Refused(message)) => {
                tracing::debug!(%message, "engine API: registration refused");
                send(&writer, &Refusal::from(message).event());
                return;
            }
            Err(Unregistered::Gone(e)) => {
                tracing::debug!(error = %e, "engine API: no registration");
                return;
            }
        };
        let registered = Engine::register(self.shared.clone(), registration, fds, shared, writer.clone(), peer);
        // The descriptors are mapped (or refused) and closed by now.
        drop(pending);
        let engine = match registered {
            Ok(engine) => engine,
            Err(refusal) => {
                send(&writer, &refusal.event());
                return;
            }
        };
        registering.done();
        drop(slot.take());
        let _ = reader.set_read_timeout(None);
        self.shared.metrics.registrations.inc();
        if let Some(publisher) = &self.shared.cfg.publisher {
            publisher.add(&engine);
        }
        let registered = AgentEvent::Registered {
            // Decode engines dial out: they have none to hand anyone (an engine that offered
            // its host as one would hand decode an address no prefill listens at).
            address: match engine.reg.role {
                Role::Prefill => engine.address.clone(),
                Role::Decode => String::new(),
            },
            agent: self.shared.cfg.name.clone(),
            memory_len: engine.layout.pool_len() as u64,
            region_lens: engine.layout.region_lens().into_iter().map(|l| l as u64).collect(),
            handshake_timeout_ms: engine.settings.handshake_timeout_ms,
            lease_ms: engine.settings.lease_ms,
            hold_ms: u64::try_from(engine.lease().saturating_mul(prefill::MAX_HOLD_LEASES + 1).as_millis())
                .unwrap_or(u64::MAX),
        };
        // The engine maps what the agent allocated through these descriptors (never a path).
        let fds: Vec<_> = engine
            .pools
            .iter()
            .filter(|p| p.origin != pool::Origin::EngineMemfd)
            .map(Pool::fd)
            .collect();
        let sent = wire::write_frame_fds(&lock(&writer), &registered, &fds);
        if let Err(e) = sent {
            tracing::debug!(error = %e, "engine API: cannot send Registered");
        }
        let max_frame = crate::engine_api::max_request_frame(engine.reg.num_blocks);
        let max_values = crate::engine_api::max_request_values(engine.reg.num_blocks);
        // Whose frames these are, for the room's turns: the engine's Pod where it is attested.
        let frame_owner = match &engine.dial_owner {
            dials::DialOwner::Pod(uid) => format!("pod {uid}"),
            dials::DialOwner::Engine(id) => format!("engine {id}"),
        };
        loop {
            // Large frames take room from the agent's, over every engine (`frame_budget`).
            let budget = &self.shared.engine_frames;
            let read = wire::read_engine_frame(&reader, max_frame, crate::frame_budget::BODY_WITHIN, |n| {
                budget.for_frame(&frame_owner, n, max_values)
            });
            let frame = match read {
                Ok((bytes, mut room)) => {
                    let decoded = crate::engine_api::decode_request(&bytes, max_values, |cost| {
                        room.shrink_to(cost);
                        Ok::<(), String>(())
                    });
                    // The room goes before anything is sent back: an engine that does not read
                    // its events holds none while the agent waits to write to it.
                    drop((room, bytes));
                    match decoded {
                        Ok(request) => match request.request_id().map(crate::engine_api::check_request_id) {
                            Some(Err(why)) => {
                                let id = request.request_id().unwrap_or_default().to_owned();
                                engine.refuse(id, vec![Reason::InvalidRequest], why);
                                continue;
                            }
                            _ => Ok(request),
                        },
                        // A request that does not decode is refused on its own (the engine's
                        // other requests go on); one that does not even name its request ends
                        // the connection, the only way left to tell the engine.
                        Err((Some(request), why)) => {
                            engine.refuse(request, vec![Reason::InvalidRequest], why);
                            continue;
                        }
                        Err((None, why)) => Err(wire::FrameError::Malformed(why)),
                    }
                }
                Err(e) => Err(e),
            };
            match frame {
                Ok(EngineRequest::ExpectKv {
                    request,
                    prefill,
                    blocks,
                    num_tokens,
                    first_token,
                    prompt,
                    event,
                }) => {
                    let want = Want::of(blocks, num_tokens, first_token, prompt, event);
                    engine.expect_kv(request, vec![prefill], want);
                }
                Ok(EngineRequest::ExpectKvFrom {
                    request,
                    prefills,
                    blocks,
                    num_tokens,
                    first_token,
                    prompt,
                    event,
                }) => {
                    let want = Want::of(blocks, num_tokens, first_token, prompt, event);
                    engine.expect_kv(request, prefills, want);
                }
                Ok(EngineRequest::KvReady {
                    request,
                    blocks,
                    num_tokens,
                    first_token,
                    prompt,
                    event,
                    release_token,
                }) => {
                    let mut want = Want::of(blocks, num_tokens, first_token, prompt, event);
                    want.release_token = release_token;
                    engine.kv_ready(request, want);
                }
                Ok(EngineRequest::ExpectKvFromPool {
                    request,
                    prefill_ranks,
                    blocks,
                    num_tokens,
                    first_token,
                    prompt,
                    event,
                }) => {
                    let want = Want::of(blocks, num_tokens, first_token, prompt, event);
                    engine.expect_kv_from_pool(request, prefill_ranks, want);
                }
                Ok(EngineRequest::Release {
                    request,
                    prefill,
                    mut prefills,
                    prompt,
                    release_token,
                }) => {
                    prefills.push(prefill);
                    engine.release(request, prefills, prompt, release_token);
                }
                Ok(EngineRequest::Renew {
                    request,
                    prefill,
                    prefills,
                    prompt,
                }) => engine.renew(request, std::iter::once(prefill).chain(prefills).collect(), prompt),
                Ok(EngineRequest::Cancel { request }) => match engine.reg.role {
                    Role::Decode => engine.cancel_decode(request),
                    Role::Prefill => engine.cancel_prefill(request),
                },
                Ok(EngineRequest::RegisterPool(_)) => {
                    tracing::warn!(engine = %engine.reg.engine, "engine registered twice; ignoring");
                }
                Ok(EngineRequest::ShareGpuMemory { .. }) => {
                    // Read without a control buffer: the kernel closed any descriptors it carried.
                    tracing::warn!(engine = %engine.reg.engine, "GPU memory shared after the registration; ignoring");
                }
                Ok(EngineRequest::Capabilities) => send(&writer, &self.capabilities()),
                Err(wire::FrameError::BadLength(n)) if n > max_frame => {
                    tracing::warn!(engine = %engine.reg.engine, bytes = n, "engine sent a frame over {max_frame} bytes (room for every block id of its pool); closed its connection");
                    break;
                }
                // No room for its frame in time, or its body did not come: the frame cannot be
                // skipped unread, so the connection goes (the connector registers again).
                Err(wire::FrameError::Io(e))
                    if e.kind() == std::io::ErrorKind::OutOfMemory
                        || e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    self.shared.metrics.engine_frames_refused();
                    tracing::warn!(engine = %engine.reg.engine, error = %e, "closed an engine's connection: its frame got no room in time, or its body did not come within {:?}", crate::frame_budget::BODY_WITHIN);
                    break;
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

/// Sends an engine an event. One that cannot be written (the engine stopped reading its events
/// for the socket's write timeout, or went) ends the connection: an event left out (a request's
/// end) would have the engine wait for it forever, and one cut short leaves the stream
/// unreadable; a connection's end the engine learns, and its requests end with it.
fn send(writer: &Mutex<UnixStream>, event: &AgentEvent) {
    let mut stream = lock(writer);
    if let Err(e) = wire::write_frame(&mut *stream, event) {
        if e.timed_out() {
            tracing::warn!(error = %e, "engine API: the engine reads no events; closing its connection");
        } else {
            tracing::debug!(error = %e, "engine API: cannot send an event; closing the connection");
        }
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
}

/// What one engine's agent observed, for its PDEndpoint's status.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Handshakes, transfers, bytes, checksum outcomes.
    pub counters: pdpair_api::TransferCounters,
    /// The last handshake rejection.
    pub last_rejection: Option<SeenRejection>,
    /// When a transfer last completed (unix seconds).
    pub last_success: Option<i64>,
    /// The last failure that was not routine ([`Reason::is_routine`]).
    pub last_failure: Option<SeenFailure>,
    /// Earlier rejections by other peers than the last's, none resolved: each peer's latest,
    /// the most recent [`pdpair_api::MAX_EARLIER`], oldest first.
    pub earlier_rejections: Vec<SeenRejection>,
    /// Earlier failures with other peers than the last's (or with none named), none resolved:
    /// each peer's latest, the most recent [`pdpair_api::MAX_EARLIER`], oldest first.
    pub earlier_failures: Vec<SeenFailure>,
    /// The path to each peer this engine's agent moved bytes with (the most recent
    /// [`pdpair_api::MAX_PATHS`] peers).
    pub paths: Vec<pdpair_api::TransferPath>,
    /// When the engine registered (unix seconds).
    pub registered: i64,
}

impl EngineStats {
    /// A transfer of `bytes` with `peers` completed at `now` (unix seconds): a rejection by one
    /// of them no longer stands.
    fn transferred<'a>(&mut self, now: i64, bytes: u64, peers: impl IntoIterator<Item = &'a str>) {
        self.last_success = Some(now);
        let peers: Vec<&str> = peers.into_iter().collect();
        // News of one of them, not resolved yet, is resolved now.
        let resolve = |resolved: &mut Option<i64>, peer: Option<&str>| {
            if resolved.is_none() && peer.is_some_and(|p| peers.contains(&p)) {
                *resolved = Some(now);
            }
        };
        if let Some(r) = self.last_rejection.as_mut() {
            resolve(&mut r.resolved, Some(&r.peer));
        }
        if let Some(f) = self.last_failure.as_mut() {
            resolve(&mut f.resolved, f.peer.as_deref());
        }
        // Earlier news resolved is no news: gone (one naming no peer stands only until any
        // transfer of the engine completes, as the operator reads it).
        self.earlier_rejections.retain(|r| !peers.contains(&r.peer.as_str()));
        self.earlier_failures
            .retain(|f| f.peer.as_deref().is_some_and(|p| !peers.contains(&p)));
        let counters = &mut self.counters;
        counters.transfers_completed += 1;
        counters.bytes = counters.bytes.saturating_add(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
}

/// News of a peer (a rejection, a failure) an engine keeps: the last, and earlier news of other
/// peers not resolved.
trait News {
    /// The peer it names, where one.
    fn peer(&self) -> Option<&str>;
    /// Whether a transfer with that peer completed since.
    fn resolved(&self) -> bool;
}

impl News for SeenFailure {
    fn peer(&self) -> Option<&str> {
        self.peer.as_deref()
    }
    fn resolved(&self) -> bool {
        self.resolved.is_some()
    }
}

impl News for SeenRejection {
    fn peer(&self) -> Option<&str> {
        Some(&self.peer)
    }
    fn resolved(&self) -> bool {
        self.resolved.is_some()
    }
}

/// `news` is the last now: the last before it, where it named another peer and stands, joins
/// `earlier`, which keeps each peer's latest (news of `news`'s peer is superseded), the most
/// recent [`pdpair_api::MAX_EARLIER`]. With the last alone a failure with one peer was hidden by
/// a later one with another, which a transfer then resolved: `TransferReady` turned True while
/// the first peer still failed every transfer.
fn keep_news<T: News>(last: &mut Option<T>, earlier: &mut Vec<T>, news: T) {
    if let Some(old) = last.take()
        && !old.resolved()
        && old.peer() != news.peer()
    {
        earlier.retain(|e| e.peer() != old.peer());
        earlier.push(old);
    }
    earlier.retain(|e| e.peer() != news.peer());
    *earlier = pdpair_api::most_recent(std::mem::take(earlier));
    *last = Some(news);
}

/// A failed transfer as this engine's agent saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct SeenFailure {
    /// When (unix seconds).
    pub at: i64,
    /// Why.
    pub reasons: Vec<Reason>,
    /// The message.
    pub message: String,
    /// The peer's address (decode: the prefill's), where it failed with one.
    pub peer: Option<String>,
    /// When a transfer with that peer completed after it (unix seconds), where one did.
    pub resolved: Option<i64>,
}

/// A handshake rejection as this engine's agent saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct SeenRejection {
    /// When (unix seconds).
    pub at: i64,
    /// The peer's address: the prefill's side channel (decode), the decode agent's connection
    /// (prefill: a rejected connection is closed, so no later transfer is with it).
    pub peer: String,
    /// Why.
    pub reasons: Vec<Reason>,
    /// The message.
    pub message: String,
    /// When a transfer with the same peer completed after it (unix seconds), where one did.
    pub resolved: Option<i64>,
}

/// A peer as `engine@agent` for status. The names come from its authenticated handshake but are
/// still its text: each is cut to 64 characters and escaped.
fn peer_name(engine: &str, agent: &str) -> String {
    let short = |s: &str| crate::reason::peer_text(&s.chars().take(64).collect::<String>());
    format!("{}@{}", short(engine), short(agent))
}

/// Adds or refreshes a peer's path, used `now` (unix seconds): a peer keeps its `since` while its
/// path stays the same, and its `last_used` is refreshed once [`pdpair_api::PATH_USED_EVERY_SECONDS`]
/// passed (each refresh is a status write); a new peer goes last, and the peer used least
/// recently goes once there are [`pdpair_api::MAX_PATHS`] (the first listed went, however busy).
fn record_path(paths: &mut Vec<pdpair_api::TransferPath>, mut path: pdpair_api::TransferPath, now: i64) {
    let at = |secs: i64| {
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(secs).unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
        )
    };
    let used = |p: &pdpair_api::TransferPath| p.last_used.as_ref().unwrap_or(&p.since).0.as_second();
    match paths.iter_mut().find(|p| p.peer == path.peer) {
        Some(known) if known.kind == path.kind && known.lanes == path.lanes => {
            if now.saturating_sub(used(known)) >= pdpair_api::PATH_USED_EVERY_SECONDS {
                known.last_used = Some(at(now));
            }
        }
        Some(known) => {
            path.last_used = Some(at(now));
            *known = path;
        }
        None => {
            if paths.len() >= pdpair_api::MAX_PATHS
                && let Some(least) = (0..paths.len()).min_by_key(|&i| used(&paths[i]))
            {
                paths.remove(least);
            }
            path.last_used = Some(at(now));
            paths.push(path);
        }
    }
}

/// Now, in unix seconds.
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// What an engine says of a request's KV: its blocks, its tokens, what it was computed from.
#[derive(Debug, Default)]
pub(super) struct Want {
    /// The engine's block ids, in token order.
    pub blocks: Vec<u32>,
    /// The request's token count.
    pub num_tokens: u64,
    /// Absolute position of the first token the first block holds.
    pub first_token: u64,
    /// The engine's prompt digest, when it gives one.
    pub prompt: Option<PromptDigest>,
    /// Which of a GPU pool's `gpu.events` the engine named ([`check_event`]).
    pub event: Option<u32>,
    /// Prefill: the request's release token; decode: the one a `Release` names.
    pub release_token: Option<ReleaseToken>,
}

impl Want {
    fn of(
        blocks: Vec<u32>,
        num_tokens: u64,
        first_token: u64,
        prompt: Option<PromptDigest>,
        event: Option<u32>,
    ) -> Want {
        Want {
            blocks,
            num_tokens,
            first_token,
            prompt,
            event,
            release_token: None,
        }
    }
}

/// Checks the `event` a `what` (`KvReady`, `ExpectKv`...) names against the `events` its GPU pool
/// registered (`gpu.events`): one of them where it names one (refused where there are none), and
/// one where `required` (a prefill's `KvReady`: the agent reads its blocks only after the writes).
pub(super) fn check_event(what: &str, event: Option<u32>, events: usize, required: bool) -> Result<(), String> {
    match event {
        Some(e) if (e as usize) < events => Ok(()),
        Some(e) if events == 0 => Err(format!("{what}.event {e}: this pool registered no gpu.events")),
        Some(e) => Err(format!(
            "{what}.event {e}: the pool registered {events} gpu.events (0..={})",
            events - 1
        )),
        None if required && events > 0 => Err(format!(
            "{what}.event is missing: this pool registered {events} gpu.events, and the agent reads its blocks only after the one recorded after their writes"
        )),
        None => Ok(()),
    }
}

/// A D request waiting for its KV.
#[derive(Debug)]
struct Pending {
    /// The prefill engines writing into this request (several when decode gathers heads from
    /// several prefill ranks).
    prefills: Vec<String>,
    /// Completions received so far, by prefill address: (checksums, bytes).
    parts: HashMap<String, (Option<BlockSums>, u64)>,
    /// Pull: the prefill addresses whose `Ready` is being read (a second one is refused).
    reading: Vec<String>,
    /// The link each prefill's registration (or release) went on: only that link's loss fails
    /// the request.
    links: SentOn,
    blocks: Vec<u32>,
    num_tokens: u64,
    first_token: u64,
    /// The engine's prompt digest, sent in the registration.
    prompt: Option<PromptDigest>,
    deadline: Instant,
    /// A `Release` (decode needs nothing), answered by `ReleaseDone`, not a registration.
    release: bool,
    /// The release token that `Release` names.
    release_token: Option<ReleaseToken>,
}

/// The link a decode request's registration (or release, or a cancel's `Release`) went on, by
/// prefill address: only that link's loss ends what that prefill writes into the request's
/// blocks. A link that gave way ([`Engine::room_for_link`]) may end after a new one to the same
/// prefill took its slot, with requests of its own.
#[derive(Debug, Clone, Default)]
struct SentOn(HashMap<String, u64>);

impl SentOn {
    /// `prefill`'s registration goes on `link` (a later one replaces an earlier).
    fn sent(&mut self, prefill: &str, link: u64) {
        self.0.insert(prefill.to_owned(), link);
    }

    /// `prefill` is told on `link`, unless the request went to it on a link already.
    fn sent_unless_known(&mut self, prefill: &str, link: u64) {
        self.0.entry(prefill.to_owned()).or_insert(link);
    }

    /// Whether what went to `prefill` went on link `link`.
    fn on(&self, prefill: &str, link: u64) -> bool {
        self.0.get(prefill) == Some(&link)
    }
}

impl Pending {
    /// Whether `prefill` still owes this request its part: it is one of the request's prefills
    /// and its part is not here yet. Only such a prefill may answer for it, and only its loss
    /// fails it (a rank whose KV is here already lost nothing by closing).
    fn waits_on(&self, prefill: &str) -> bool {
        self.prefills.iter().any(|a| a == prefill) && !self.parts.contains_key(prefill)
    }

    /// Pull: whether decode's own read of `prefill`'s blocks into this request's blocks runs or
    /// ran: then only the read's end answers for that prefill (not its messages, not its link
    /// going), since until then our READs may still be writing the blocks.
    fn read_from(&self, prefill: &str) -> bool {
        self.reading.iter().any(|a| a == prefill)
    }

    /// `prefill`'s part is here (pushed to us, or read by us); whether every part is. A prefill
    /// that is not one of the request's adds nothing, and a part is recorded once (its first
    /// record stays).
    fn arrived(&mut self, prefill: &str, sums: Option<BlockSums>, bytes: u64) -> bool {
        if self.prefills.iter().any(|a| a == prefill) {
            self.parts.entry(prefill.to_owned()).or_insert((sums, bytes));
        }
        self.prefills.iter().all(|a| self.parts.contains_key(a))
    }
}

/// A sealed frame in a link's outbox and its bytes' charge; `None` closes the link.
type Queued = Option<(Vec<u8>, Charge)>;

/// An authenticated, handshaken side-channel connection.
#[derive(Debug)]
struct Link {
    /// What the peer may reach of this engine's memory through the backend (the tcp stream's
    /// admission; nothing for UCX), for as long as the link lives.
    admission: Option<crate::transport::Admission>,
    /// What we send, sealed in order, to the link's writer thread, which writes it: no thread
    /// that sends (the engine's, the timer, another link's reader) waits on a peer that stopped
    /// reading. `None` closes the link once what was queued before it is written.
    outbox: Mutex<(Sealer, std::sync::mpsc::Sender<Queued>)>,
    /// The outbox's bytes (at most [`LINK_OUTBOX`], and the agent's [`Outboxes`] in all) and
    /// whether the link is closing (nothing more is sent).
    queue: Arc<crate::outboxes::Queue>,
    outboxes: Arc<Outboxes>,
    /// The frame its reader is reading, counted against its pair's and the agent's budgets for
    /// frames being read before the frame's body is read or allocated (a peer sending the
    /// largest frames on many links, holding back their last bytes, otherwise held 16 MiB of
    /// the agent's memory per link).
    inbox: Arc<crate::outboxes::Queue>,
    inboxes: Arc<Outboxes>,
    /// A handle on the stream, to read it and to shut it down.
    stream: TcpStream,
    /// This link's id (unique in the process): requests are owned by the link they came on.
    id: u64,
    /// Cleared when the link's reader stops: nothing more is sent on it.
    alive: AtomicBool,
    /// When its peer last asked something of it (not a ping): the least used link of a full
    /// engine gives way ([`crate::agent::MAX_LINKS_PER_ENGINE`]).
    used: std::sync::atomic::AtomicU64,
    /// D side: how many heartbeats were sent, and when the last one was (when the link was
    /// made, before the first).
    pings: std::sync::atomic::AtomicU64,
    pinged: std::sync::atomic::AtomicU64,
    peer: PeerInfo,
    /// UCX peer id, on the side that moves the bytes (push: prefill; pull: decode).
    ucx_peer: Option<u64>,
    /// Decode, pull: reads of prefill's blocks running over `ucx_peer`; once the link has ended
    /// (`ended`) and none runs, the connection to prefill's memory goes (`let_go`, once): a read
    /// still running when the link ends finishes over it (over UCX prefill's memory stays
    /// registered until its lease).
    reads: std::sync::atomic::AtomicUsize,
    ended: AtomicBool,
    let_go: AtomicBool,
    /// The path UCX chose for `ucx_peer`, read after the first transfer completed (UCX may
    /// reconfigure an endpoint's lanes while it wires up).
    path: std::sync::OnceLock<pdpair_api::TransferPath>,
    addr: String,
    /// P side: which of P's heads go where in D's blocks (all to all unless tensor parallelism
    /// differs).
    heads: protocol::HeadMap,
    /// P side: registrations of this link waiting for their KvReady, and their blocks
    /// (`prefill::Held`).
    waiting: Arc<(std::sync::atomic::AtomicUsize, std::sync::atomic::AtomicUsize)>,
    /// P side: how many decode ranks take KV from this prefill rank, from the two handshakes
    /// ([`protocol::decode_ranks_served`]), worked out once: a peer of tensor parallelism 1024
    /// made it a thousand layouts per `Release` it sent.
    decode_ranks: std::sync::OnceLock<u32>,
}

/// Bytes a link holds for its peer, at most (two of the largest frames): a peer that lets more
/// pile up (it stopped reading) loses the link.
pub const LINK_OUTBOX: usize = 2 * wire::MAX_FRAME;

/// The kernel send buffer a side-channel link's socket asks for (`SO_SNDBUF`; Linux keeps twice
/// this, for its own bookkeeping). Left to autotuning, a socket whose peer stops reading grows
/// to `net.ipv4.tcp_wmem`'s maximum (4 MiB by default) of kernel memory, charged to the agent's
/// memory cgroup and counted in no outbox: an insider's 1024 links from one decode engine held 4
/// GiB that way. Side-channel frames are control messages (KV moves over UCX or the KV stream),
/// so a small buffer costs nothing but a few more writes for a large registration.
pub const LINK_SEND_BUFFER: usize = 64 << 10;

/// The charges of one frame read on `inbox` ([`wire::read_sealed_by`]'s `admit`), against
/// `inboxes`: first its length, then what decoding it holds past that. Once the frame is read
/// whole (the second charge) its reader has made progress: among the readers holding the most,
/// it is not the one closed for the rest.
fn inbox_admit<'a>(
    inboxes: &'a Arc<Outboxes>,
    inbox: &'a Arc<crate::outboxes::Queue>,
) -> impl FnMut(usize) -> Result<crate::outboxes::Charge, String> + 'a {
    let mut read = false;
    move |n| {
        if std::mem::replace(&mut read, true) {
            inbox.touch();
        }
        inboxes.charge(inbox, n, wire::MAX_DECODE_COST)
    }
}

impl Link {
    /// Reads the link's next frame with `opener`, its length charged to the link's inbox first
    /// ([`Link::inbox`]): over the budgets, of the links holding the most of a frame, the one
    /// longest without a frame read whole is closed (this one's read fails when that is itself).
    fn read(&self, reader: &mut impl std::io::Read, opener: &mut wire::Opener) -> Result<Message, wire::FrameError> {
        // Up to the frame's length and then what decoding its values holds past it
        // ([`wire::MAX_DECODE_COST`] at most).
        let admit = inbox_admit(&self.inboxes, &self.inbox);
        let (message, (charge, more)) = wire::read_sealed_by(reader, opener, wire::MAX_FRAME, admit)?;
        drop(more);
        charge.written();
        Ok(message)
    }

    /// A link over `stream` (its handshake done, its write timeout set: a write that takes
    /// longer ends the link), with its writer thread started; its outbox counts against
    /// `outboxes`.
    #[allow(clippy::too_many_arguments)]
    fn new(
        (outboxes, inboxes): (&Arc<Outboxes>, &Arc<Outboxes>),
        stream: TcpStream,
        sealer: Sealer,
        admission: Option<crate::transport::Admission>,
        peer: PeerInfo,
        ucx_peer: Option<u64>,
        addr: String,
        heads: protocol::HeadMap,
    ) -> std::io::Result<Link> {
        wire::set_send_buffer(&stream, LINK_SEND_BUFFER)?;
        let handle = stream.try_clone()?;
        // One handle for both budgets to shut the link down with (a descriptor per link more,
        // on an agent holding thousands of links, counts).
        let shut = Arc::new(stream.try_clone()?);
        let queue = outboxes.queue(shut.clone(), addr.clone());
        let inbox = inboxes.queue(shut, addr.clone());
        let (outbox, queued_frames) = std::sync::mpsc::channel::<Queued>();
        thread::Builder::new().name("link-writer".into()).spawn(move || {
            let mut stream = stream;
            // A frame's charge is released once written; those still queued when this ends are
            // released as the channel drops them.
            for (frame, charge) in queued_frames.iter().map_while(|f| f) {
                let written = std::io::Write::write_all(&mut stream, &frame);
                if written.is_ok() {
                    charge.written();
                }
                if let Err(e) = written {
                    tracing::debug!(error = %e, "a link's write failed; closing it");
                    break;
                }
            }
            // The link is gone (dropped, closed, or a write failed): its reader ends it.
            let _ = stream.shutdown(std::net::Shutdown::Both);
        })?;
        Ok(Link {
            admission,
            outbox: Mutex::new((sealer, outbox)),
            queue,
            outboxes: outboxes.clone(),
            inbox,
            inboxes: inboxes.clone(),
            stream: handle,
            id: next_link_id(),
            alive: AtomicBool::new(true),
            used: std::sync::atomic::AtomicU64::new(crate::outboxes::now()),
            pings: std::sync::atomic::AtomicU64::new(0),
            pinged: std::sync::atomic::AtomicU64::new(crate::outboxes::now()),
            peer,
            ucx_peer,
            reads: std::sync::atomic::AtomicUsize::new(0),
            ended: AtomicBool::new(false),
            let_go: AtomicBool::new(false),
            path: std::sync::OnceLock::new(),
            addr,
            heads,
            waiting: Default::default(),
            decode_ranks: std::sync::OnceLock::new(),
        })
    }

    /// Queues `m` for the peer. False, and the link closed, when it cannot be: a write failed
    /// (the peer stopped reading until the write timeout, or went away), [`LINK_OUTBOX`]
    /// bytes wait, or the agent's outboxes are full and this link holds the most
    /// ([`crate::outboxes`]); its reader then ends it and fails its requests, and later sends
    /// fail at once (docs/protocol.md).
    fn send(&self, m: &Message) -> bool {
        let queued = {
            let mut outbox = lock(&self.outbox);
            if self.queue.stopped() {
                return false;
            }
            let (sealer, sender) = &mut *outbox;
            // Sealed only when it fits: a refused frame leaves no gap in the sequence.
            let mut charged = Err(String::new());
            let fits = |len: usize| {
                charged = self.outboxes.charge(&self.queue, len, LINK_OUTBOX);
                charged.is_ok()
            };
            match wire::seal_if(sealer, m, fits) {
                Ok(Some(frame)) => match charged {
                    Ok(charge) => sender.send(Some((frame, charge))).is_ok(),
                    Err(_) => false,
                },
                Ok(None) => {
                    let why = charged.err().unwrap_or_default();
                    tracing::warn!(peer = %self.addr, "{why}; closing its link");
                    false
                }
                Err(e) => {
                    tracing::warn!(peer = %self.addr, error = %e, "cannot seal a frame; closing the link");
                    false
                }
            }
        };
        if !queued {
            self.close();
        }
        queued
    }

    /// Closes the link once the frames queued so far are written (a failure's `Failed` reaches
    /// the peer before the link goes).
    fn close_after_sent(&self) {
        let outbox = lock(&self.outbox);
        // Under the outbox lock: no frame is queued behind the close.
        self.queue.stop();
        if outbox.1.send(None).is_err() {
            drop(outbox);
            self.close();
        }
    }

    /// Closes `request`'s blocks to this link (where its backend bounds them per request).
    fn close_window(&self, request: &str) {
        if let Some(w) = self.admission.as_ref().and_then(|a| a.windows()) {
            w.close(request);
        }
    }

    fn close(&self) {
        self.queue.close();
    }

    /// Ends the link as its engine goes: nothing more is read (its reader ends now), and it
    /// closes once what was queued is written (a `Complete` or `Released` the engine's last
    /// answers depended on still reaches the peer; a peer that does not read loses it at the
    /// write timeout).
    fn finish(&self) {
        // Stopped before the reader ends: a reader that fails on a link still running closes
        // it at once, dropping what was queued.
        self.close_after_sent();
        let _ = self.stream.shutdown(std::net::Shutdown::Read);
    }
}

/// A prefill engine's side-channel listener: at `before` (the address it had before its agent
/// restarted) where that is on `host`, a side-channel port (of the agents' range where set, else
/// one the kernel hands out to anyone: its ephemeral range, less the ports reserved from it for
/// services; either way an engine cannot take a service's port this way) and free; else at a
/// new port.
fn side_channel_listener(host: IpAddr, ports: &Dialable, before: Option<SocketAddr>) -> io::Result<TcpListener> {
    if let Some(at) = before {
        if at.ip() == host && ports.side_channel_port(at.port()) {
            match TcpListener::bind(at) {
                Ok(l) => return Ok(l),
                Err(e) => tracing::info!(%at, error = %e, "cannot listen where the engine was before; at a new port"),
            }
        } else {
            tracing::info!(%at, "the engine's address before is not this agent's host and side-channel ports; at a new port");
        }
    }
    ports.listen(host)
}

/// Starts `f` on a thread of its own named `name`. `Err` when the system gives none (a pids
/// limit on the agent's cgroup, memory): the caller then refuses or fails what the thread was
/// for. (`thread::spawn` panics there, ending the calling thread: a prefill engine's acceptor
/// that met the limit once never accepted a link again.)
fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> io::Result<()> {
    thread::Builder::new().name(name.into()).spawn(f).map(drop)
}

fn next_link_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
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
    /// Transfer settings: the registration's, checked against (or filled from) the PDPair.
    settings: Settings,
    key: Vec<u8>,
    layout: PoolLayout,
    /// One pool per region of `layout`, in order (host memory; empty for a GPU pool).
    pools: Vec<Pool>,
    /// The pool, when it is GPU memory.
    device: Option<crate::memory::gpu_pool::DevicePool>,
    local: PeerInfo,
    address: String,
    writer: Arc<Mutex<UnixStream>>,
    closed: AtomicBool,
    stats: Mutex<EngineStats>,
    // Decode side.
    pending: Mutex<HashMap<String, Pending>>,
    /// Cancelled decode requests: the prefill addresses that may still be writing into their
    /// blocks; `Cancelled` goes to the engine when none is left.
    cancelled: Mutex<HashMap<String, decode::Cancelling>>,
    peers: Mutex<HashMap<String, Slot>>,
    /// `ExpectKvFromPool`s linking to their ranks now (each on a thread of its own): at most
    /// [`MAX_DIALS`].
    picking: std::sync::atomic::AtomicUsize,
    /// `ExpectKvFromPool` requests still linking to their ranks (not pending yet) -> whether
    /// the engine cancelled them meanwhile.
    linking: Mutex<HashMap<String, bool>>,
    /// Requests -> the links' windows their blocks are open in (the tcp stream's; push: decode's
    /// blocks to writes, pull: prefill's to reads): closed when the request ends for the engine.
    windows: Mutex<HashMap<String, Vec<std::sync::Arc<crate::transport::stream::Windows>>>>,
    /// Prefill address -> (when, reasons, message): this engine's remembered rejections (no
    /// retry storm; another engine on the agent has its own, so one engine's bad key or
    /// misrouted rank never blocks another).
    rejections: Mutex<HashMap<String, Remembered>>,
    // Prefill side.
    /// KV ready on this P engine and D registrations waiting for it, under one lock: matching
    /// them is check-and-insert across both maps, which must be atomic (with two locks a
    /// KvReady and a Register arriving together could each miss the other and both wait).
    matching: Mutex<Matching>,
    /// The decode agents' links this P engine accepted: closed when the engine goes, so their
    /// threads end and the engine's pools are freed then, not when a silent peer times out.
    accepted: Mutex<Vec<std::sync::Weak<Link>>>,
    /// Connections to this P engine that have authenticated and are still in their handshake,
    /// by source: they count as links of it ([`MAX_LINKS_PER_SOURCE`]).
    shaking: Mutex<HashMap<std::net::IpAddr, usize>>,
    /// Its PDPair's outbox budget, which its links' outboxes count against.
    outboxes: Arc<Outboxes>,
    /// Its PDPair's budget for frames its links are reading.
    inboxes: Arc<Outboxes>,
    /// This registration's id in `Shared::locals`.
    local_id: u64,
    /// Whose share of the dial places to a prefill host its dials take: its Pod's where attested.
    dial_owner: dials::DialOwner,
    /// Where its blocks are, for windows ([`Engine::arrays`]).
    arrays: std::sync::OnceLock<Option<Arc<crate::transport::stream::Arrays>>>,
}

impl Engine {
    fn register(
        shared: Arc<Shared>,
        reg: PoolRegistration,
        fds: Vec<std::os::fd::OwnedFd>,
        gpu_memory: Vec<(std::os::fd::OwnedFd, u64)>,
        writer: Arc<Mutex<UnixStream>>,
        peer: Option<Result<crate::attest::PodIdentity, String>>,
    ) -> Result<Arc<Engine>, Refusal> {
        if let Some(path) = &reg.memory_path {
            return Err(Refusal::from(format!(
                "memory_path {:?} is not accepted: pass the pool as a sealed memfd (memory_fd: true, SCM_RIGHTS), or let the agent allocate it",
                crate::reason::peer_text(path)
            )));
        }
        // Descriptors the registration does not announce are closed, unused.
        let fds = if reg.memory_fd { fds } else { Vec::new() };
        let key = hex_bytes::decode(&reg.pairing_key)
            .filter(|k| !k.is_empty())
            .ok_or("pairing_key must be non-empty hex")?;
        let layout = reg.layout().map_err(|e| e.to_string())?;
        reg.check_names()?;
        reg.check_staging()?;
        reg.check_address()?;
        if reg.num_blocks == 0 {
            return Err("num_blocks must be at least 1".into());
        }
        if reg.gpu.is_none() && !gpu_memory.is_empty() {
            return Err(Refusal::from(format!(
                "{} GPU allocations were shared (ShareGpuMemory), but the registration is not a GPU pool (no gpu)",
                gpu_memory.len()
            )));
        }
        if let Some(gpu) = &reg.gpu {
            gpu.check(layout.regions.len(), reg.memory_fd, gpu_memory.len())?;
            if let Some(why) = shared.gpu_pools_refused() {
                return Err(Refusal::from(format!("gpu: GPU pools are not accepted: {why}")));
            }
        }
        if reg.memory_fd && fds.len() != layout.regions.len() {
            return Err(Refusal::from(format!(
                "memory_fd is true but the RegisterPool frame carried {} descriptors; the pool has {} regions (one memfd per region, in order)",
                fds.len(),
                layout.regions.len()
            )));
        }
        let mut pod_uid = None;
        if let Some(attestor) = &shared.cfg.attestor {
            // Who connected, as the kernel recorded it at connect and its cgroup said as the
            // connection was accepted (not what the engine says).
            let peer = peer.unwrap_or_else(|| Err("the engine connection's peer was not read".into()));
            let pod = attestor
                .check(&reg, peer)
                .map_err(|e| format!("engine attestation refused the registration: {e}"))?;
            tracing::info!(engine = %reg.engine, pod_uid = %pod.uid, container = ?pod.container, "engine attested");
            pod_uid = Some(pod.uid);
        }
        // What the engine cannot know comes from the PDPair; what it says must agree with it.
        let pair = match &shared.cfg.attestor {
            Some(attestor) => Some(attestor.pdpair(&reg.pdpair)?),
            None => None,
        };
        let settings =
            crate::engine_api::resolve(&reg, pair.as_ref().map(|p| (reg.pdpair.as_str(), &p.spec.transfer)))?;
        // Before the pool is allocated (checked again, under the lock, as it is recorded).
        shared.name_free(&lock(&shared.locals), pod_uid.as_deref(), &reg.pdpair, &reg.engine)?;
        let need = layout.pool_len_checked().ok_or_else(|| {
            format!(
                "num_blocks {} with this geometry ({} layers x {} arrays x {} heads x {} tokens x {} x {} bytes) overflows the address space",
                reg.num_blocks, layout.layers, layout.halves(), layout.local_heads, layout.block_size, layout.head_dim, layout.element_bytes
            )
        })?;
        // Registrations whose pools the agent allocates take turns from the checks below to the
        // allocation: two at once would each see the room the other takes.
        let allocating = (fds.is_empty() && reg.gpu.is_none()).then(|| lock(&shared.allocating));
        if allocating.is_some() {
            // The agent allocates (and faults in) the whole pool, and its memory cgroup is
            // charged for it: never more than its limit leaves (it would be killed, and every
            // engine on the node with it), nor than its file system holds.
            // Busy only where the pools it holds for other engines, which go with them, would
            // leave room: a rollout's new Pod on a node whose agent holds the old Pod's pools
            // registers once they go (its engine refused for good crash-looped meanwhile). What
            // else holds the agent's memory (its links' buffers, UCX, socket memory) need not
            // go, and a refusal said busy is tried again for good: not busy where only that
            // would make room.
            let ((held, held_in_dir), (released, released_in_dir)) =
                shared.pools_held(pod_uid.as_deref(), &reg.pdpair, reg.role);
            let until_they_go = |held: u64, released: u64| {
                format!(
                    "; the agent holds {held} bytes of pools for other Pods' engines of this PDPair and role, and released {released} in the last {} s (their memory perhaps still mapped), which go with them: this one fits once enough of them go (busy)",
                    RELEASED_WITHIN.as_secs()
                )
            };
            if let Some((limit, used)) = pool::memory_limit() {
                let room = limit.saturating_sub(used).saturating_sub(AGENT_OWN_MEMORY);
                if need as u64 > room {
                    let gone = held.saturating_add(released);
                    let busy = gone > 0 && need as u64 <= room.saturating_add(gone);
                    let mut message = format!(
                        "the pool needs {need} bytes, which the agent allocates and its memory cgroup is charged for: its memory limit leaves {room} (limit {limit}, in use {used}, {AGENT_OWN_MEMORY} kept for the agent itself); raise the agent's memory limit (the chart's agent.resources.limits.memory) or register fewer blocks"
                    );
                    if busy {
                        message.push_str(&until_they_go(held, released));
                    }
                    return Err(Refusal { message, busy });
                }
            }
            let free = pool::available(&shared.cfg.pool_dir).unwrap_or(0);
            if need as u64 > free {
                let gone = held_in_dir.saturating_add(released_in_dir);
                let busy = gone > 0 && need as u64 <= free.saturating_add(gone);
                let mut message = format!(
                    "the pool needs {need} bytes ({} layers x {} arrays x {} blocks x {} bytes); the pool directory {} has {free} free",
                    layout.layers,
                    layout.halves(),
                    layout.num_blocks,
                    layout.block_len(),
                    shared.cfg.pool_dir.display()
                );
                if busy {
                    message.push_str(&until_they_go(held_in_dir, released_in_dir));
                }
                return Err(Refusal { message, busy });
            }
        }
        // An address another engine held when the agent stopped stays that engine's a while.
        let before = reg.address.filter(|&at| {
            let ours = shared.claims.allows(at, &reg.pdpair, &reg.engine);
            if !ours {
                tracing::info!(%at, "another engine held the address before the agent restarted; at a new port");
            }
            ours
        });
        let listener = match reg.role {
            Role::Prefill => Some(
                side_channel_listener(shared.cfg.listen_host, &shared.dialable, before)
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
        // Last: nothing after this fails, so no registered region is left behind.
        let owner = format!("{}/{}/{}", reg.pdpair, reg.role, reg.engine);
        let (pools, device) = match &reg.gpu {
            Some(gpu) => (
                Vec::new(),
                Some(crate::memory::gpu_pool::DevicePool::open(
                    &shared.cuda,
                    &layout,
                    gpu,
                    &owner,
                    &gpu_memory,
                )?),
            ),
            None => (Engine::pools(&shared, &layout, fds)?, None),
        };
        // What the agent allocated counts as held from here until the engine is recorded.
        let local_id = next_link_id();
        let lens = layout.region_lens();
        let bytes_of = |counts: &dyn Fn(&Pool) -> bool| -> u64 {
            pools
                .iter()
                .zip(&lens)
                .filter(|(p, _)| counts(p))
                .map(|(_, len)| *len as u64)
                .fold(0u64, u64::saturating_add)
        };
        let held = Held {
            pod: pod_uid.clone(),
            pdpair: reg.pdpair.clone(),
            role: reg.role,
            all: bytes_of(&|p| p.origin != pool::Origin::EngineMemfd),
            in_pool_dir: bytes_of(&|p| p.path.is_some()),
        };
        let registering = (held.all > 0).then(|| Registering::new(&shared, local_id, held.clone()));
        drop(allocating);
        let (worker_address, memory) = match &device {
            Some(d) => (
                crate::transport::Backend::address(&*shared.cuda),
                MemoryDesc {
                    kind: protocol::MemoryKind::Cuda,
                    ..MemoryDesc::of(&layout, d.regions.iter().map(|r| (r.base, r.token.to_vec())).collect())
                },
            ),
            None => (
                shared.transport.address(),
                MemoryDesc::of(&layout, pools.iter().map(|p| (p.base, p.rkey.clone())).collect()),
            ),
        };
        let local = PeerInfo {
            agent: shared.cfg.name.clone(),
            version: protocol::PROTOCOL_VERSION,
            pdpair: reg.pdpair.clone(),
            role: reg.role,
            engine: reg.engine.clone(),
            mode: settings.mode,
            checksum: settings.checksum,
            parallelism: reg.parallelism.clone(),
            kv: reg.kv.clone(),
            tensor_rank: reg.tensor_rank,
            worker_address,
            stream_address: match (&device, shared.transport.stream()) {
                (Some(_), Some(s)) => String::from_utf8_lossy(&s.address()).into_owned(),
                _ => String::new(),
            },
            memory,
        };
        let outboxes = shared.outboxes.of(&reg.pdpair);
        let inboxes = shared.inboxes.of(&reg.pdpair);
        let engine = Arc::new(Engine {
            shared,
            reg,
            settings,
            key,
            layout,
            pools,
            device,
            local,
            address,
            writer,
            closed: AtomicBool::new(false),
            stats: Mutex::new(EngineStats {
                registered: unix_now(),
                ..EngineStats::default()
            }),
            pending: Mutex::new(HashMap::new()),
            cancelled: Mutex::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            picking: std::sync::atomic::AtomicUsize::new(0),
            linking: Mutex::new(HashMap::new()),
            windows: Mutex::new(HashMap::new()),
            rejections: Mutex::new(HashMap::new()),
            matching: Mutex::new(Matching::default()),
            arrays: std::sync::OnceLock::new(),
            accepted: Mutex::new(Vec::new()),
            shaking: Mutex::new(HashMap::new()),
            outboxes,
            inboxes,
            local_id,
            dial_owner: match pod_uid.clone() {
                Some(uid) => dials::DialOwner::Pod(uid.into()),
                None => dials::DialOwner::Engine(local_id),
            },
        });
        {
            let mut locals = lock(&engine.shared.locals);
            // Another registration of the name may have got here first.
            if let Err(taken) =
                engine
                    .shared
                    .name_free(&locals, pod_uid.as_deref(), &engine.reg.pdpair, &engine.reg.engine)
            {
                drop(locals);
                engine.shutdown();
                return Err(taken);
            }
            locals.push((
                engine.local_id,
                LocalEngine {
                    pod: pod_uid,
                    pdpair: engine.reg.pdpair.clone(),
                    role: engine.reg.role,
                    engine: engine.reg.engine.clone(),
                    memory: engine.local.memory.clone(),
                    held,
                },
            ));
            drop(registering);
        }
        // Its deadlines and leases, and (prefill) its side channel: without a thread for
        // either it does not register.
        let mut started = engine
            .spawn_timer()
            .map_err(|e| format!("no thread for the engine's timer: {e}"));
        if let (Ok(()), Some(listener)) = (&started, listener) {
            let e = engine.clone();
            started = spawn("side-channel", move || e.accept(listener))
                .map_err(|e| format!("no thread for the engine's side channel: {e}"));
        }
        if let Err(why) = started {
            engine.shutdown();
            return Err(Refusal::from(why));
        }
        if let Some(at) = engine.side_channel() {
            engine.shared.claims.hold(at, &engine.reg.pdpair, &engine.reg.engine);
        }
        Ok(engine)
    }

    /// A prefill engine's side-channel address.
    fn side_channel(&self) -> Option<SocketAddr> {
        (self.reg.role == Role::Prefill)
            .then(|| self.address.parse().ok())
            .flatten()
    }

    fn event(&self, event: AgentEvent) {
        // A request that ended for the engine: its blocks may go to another request at once,
        // so no link writes or reads them any more (the stream drops late writes and refuses
        // late reads).
        if let AgentEvent::RequestDone { request, .. }
        | AgentEvent::RequestFailed { request, .. }
        | AgentEvent::Released { request }
        | AgentEvent::Cancelled { request } = &event
        {
            self.close_windows(request);
        }
        send(&self.writer, &event);
    }

    /// Closes every link's window onto `request`'s blocks.
    fn close_windows(&self, request: &str) {
        if let Some(open) = lock(&self.windows).remove(request) {
            for w in open {
                w.close(request);
            }
        }
    }

    /// Opens `request`'s blocks to `link` (push: its writes into decode's; pull: its reads of
    /// prefill's), where its backend bounds them per request.
    fn open_window(&self, link: &Link, request: &str, blocks: &[u32]) {
        let Some(w) = link.admission.as_ref().and_then(|a| a.windows()) else {
            return;
        };
        let blocks: Vec<u32> = blocks.iter().copied().filter(|b| *b < self.layout.num_blocks).collect();
        match self.arrays() {
            // The block ids only, however many layers.
            Some(arrays) => w.allow_blocks(request, arrays, blocks),
            // A pool of one block: a range per layer and half.
            None => {
                let mut ranges = Vec::with_capacity(blocks.len() * self.layout.layers as usize * 2);
                for &b in &blocks {
                    for layer in 0..self.layout.layers {
                        for (r, at, len) in self.layout.block_extents(layer, b) {
                            ranges.push((self.region_addr(r, at), len as u64));
                        }
                    }
                }
                w.allow(request, ranges);
            }
        }
        let mut open = lock(&self.windows);
        let list = open.entry(request.to_owned()).or_default();
        if !list.iter().any(|o| std::sync::Arc::ptr_eq(o, &w)) {
            list.push(w);
        }
    }

    fn fail(&self, request: String, reasons: Vec<Reason>, message: String) {
        let event = self.failure(request, reasons, message);
        self.event(event);
    }

    /// Refuses a message about `request` that was not accepted (a second `ExpectKv` or
    /// `KvReady` for a request still open, bad blocks, the wrong role): answered and counted
    /// as [`Engine::fail`] does, but a request of that name already accepted keeps its windows
    /// (the first keeps its promise).
    fn refuse(&self, request: String, reasons: Vec<Reason>, message: String) {
        self.fail_quietly(request, reasons, message);
    }

    /// Fails a request whose windows were closed while its name was still held: touches none
    /// (a new request of the name may have opened its own since; [`Engine::answer`]).
    fn fail_quietly(&self, request: String, reasons: Vec<Reason>, message: String) {
        self.fail_quietly_with(request, reasons, message, None);
    }

    /// [`Engine::fail_quietly`], a failure with `peer` (its address) where it is known.
    fn fail_quietly_with(&self, request: String, reasons: Vec<Reason>, message: String, peer: Option<String>) {
        let event = self.failure_with(request, reasons, message, peer);
        self.answer(&event);
    }

    /// Tells the engine how a request ended whose windows were closed while its name was still
    /// held (before it left `pending` or `ready`, so a new request of the name was refused
    /// until then): touches no windows, where [`Engine::event`] would close the ones a new
    /// request of the name opened since.
    fn answer(&self, event: &AgentEvent) {
        send(&self.writer, event);
    }

    /// Counts a failure and makes its event.
    fn failure(&self, request: String, reasons: Vec<Reason>, message: String) -> AgentEvent {
        self.failure_with(request, reasons, message, None)
    }

    /// [`Engine::failure`] with the peer it failed with (its address), where known.
    fn failure_with(&self, request: String, reasons: Vec<Reason>, message: String, peer: Option<String>) -> AgentEvent {
        for r in &reasons {
            self.shared.metrics.request_failed(self.reg.role, *r);
        }
        if !reasons.iter().any(|r| r.is_handshake_rejection()) {
            let mut stats = lock(&self.stats);
            stats.counters.transfers_failed += 1;
            if !reasons.iter().all(|r| r.is_routine()) {
                let news = SeenFailure {
                    at: unix_now(),
                    reasons: reasons.clone(),
                    message: message.clone(),
                    peer,
                    resolved: None,
                };
                let stats = &mut *stats;
                keep_news(&mut stats.last_failure, &mut stats.earlier_failures, news);
            }
        }
        AgentEvent::RequestFailed {
            request,
            reasons: reason::names(&reasons),
            message,
        }
    }

    /// Records the path of a transfer this agent moved over `link` (it holds the UCX endpoint).
    fn moved(&self, link: &Link) {
        if let Some(path) = self.path_of(link) {
            self.shared.metrics.transfer_path(&path);
            record_path(&mut lock(&self.stats).paths, path, unix_now());
        }
    }

    /// A transfer of `bytes` with `peers` completed (decode: the prefill ranks' addresses, as a
    /// rejection names them; a rejection by one of them no longer stands).
    fn transferred<'a>(&self, bytes: u64, peers: impl IntoIterator<Item = &'a str>) {
        lock(&self.stats).transferred(unix_now(), bytes, peers);
    }

    /// The path `link`'s transfers take (from UCX's lanes for its endpoint), once known.
    fn path_of(&self, link: &Link) -> Option<pdpair_api::TransferPath> {
        if let Some(p) = link.path.get() {
            return Some(p.clone());
        }
        let seen = match self.transport().observe(link.ucx_peer?) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(peer = %link.addr, error = %e, "cannot read the transport's path");
                return None;
            }
        };
        let path = pdpair_api::TransferPath {
            peer: peer_name(&link.peer.engine, &link.peer.agent),
            kind: seen.kind,
            backend: seen.backend,
            lanes: seen.lanes,
            emulated: seen.emulated,
            ucx_version: seen.version,
            since: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::from_second(unix_now())
                    .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
            ),
            last_used: None,
        };
        tracing::info!(engine = %self.reg.engine, path = %path.describe(), "transfer path");
        Some(link.path.get_or_init(|| path).clone())
    }

    fn rejected(&self, peer: &str, reasons: Vec<Reason>, message: String) {
        let now = unix_now();
        let mut stats = lock(&self.stats);
        stats.counters.handshakes_rejected += 1;
        let news = SeenRejection {
            at: now,
            peer: peer.to_owned(),
            reasons,
            message,
            resolved: None,
        };
        let stats = &mut *stats;
        keep_news(&mut stats.last_rejection, &mut stats.earlier_rejections, news);
    }

    /// A snapshot of what this engine's agent observed.
    pub fn stats(&self) -> EngineStats {
        lock(&self.stats).clone()
    }

    /// Each region's bytes, in order.
    fn memory(&self) -> Vec<&[u8]> {
        self.pools
            .iter()
            .zip(self.layout.region_lens())
            .map(|(p, len)| p.memory(len))
            .collect()
    }

    /// The backend's ids of the pool's regions.
    fn regions(&self) -> Vec<u64> {
        match &self.device {
            Some(d) => d.regions.iter().map(|r| r.id).collect(),
            None => self.pools.iter().map(|p| p.region).collect(),
        }
    }

    /// The registered address of a block of a layer's K (`v = false`, or the latent) or V array.
    /// Where this engine's blocks are, for windows ([`crate::transport::stream::Arrays`]),
    /// worked out once; `None` where they do not make arrays (a pool of one block).
    fn arrays(&self) -> Option<Arc<crate::transport::stream::Arrays>> {
        self.arrays
            .get_or_init(|| {
                // Each layer's block 0's extents beside block 1's (an `Interleaved` layer's K and
                // V are one).
                let pieces: Vec<(u64, u64, u64)> = (0..self.layout.layers)
                    .flat_map(|layer| {
                        let second = if self.layout.num_blocks > 1 {
                            self.layout.block_extents(layer, 1)
                        } else {
                            Vec::new()
                        };
                        self.layout
                            .block_extents(layer, 0)
                            .into_iter()
                            .enumerate()
                            .map(|(i, (r, at, len))| {
                                let next = second.get(i).map_or(0, |(r, at, _)| self.region_addr(*r, *at));
                                (self.region_addr(r, at), next, len as u64)
                            })
                            .collect::<Vec<_>>()
                    })
                    .collect();
                crate::transport::stream::Arrays::of(&pieces, self.layout.num_blocks).map(Arc::new)
            })
            .clone()
    }

    /// Where each of our layers' arrays lies here and in `remote` (the memory of `peer`, named
    /// in the error), in order, with the pieces that move of each of their blocks, for a
    /// transfer's plan: `pieces(local unit, remote unit, bytes)` makes the pieces of the blocks
    /// of arrays whose (head, token)s are `unit`s apart on each side, `bytes` each. A layer whose
    /// K and V lie side by side on both sides (`Interleaved`) moves as one array, a head's
    /// token's K and V together. `Err` when the peer's description lacks an array of ours
    /// (defence only: the rule table refuses MLA beside non-MLA, and each side's description has
    /// a V array exactly when it is not MLA), or from `pieces`. The plan goes block by block
    /// where that merges more ([`block_major`]).
    fn places(
        &self,
        remote: &MemoryDesc,
        peer: &str,
        pieces: impl Fn(u64, u64, u64) -> Result<Vec<crate::transport::plan::Piece>, String>,
        part_len: impl Fn(u64) -> u64,
        items: Vec<crate::transport::plan::Item>,
    ) -> Result<crate::transport::plan::Plan, String> {
        let half = self.layout.half_token() as u64;
        let mut arrays = Vec::new();
        let mut keys: Vec<(u64, u64, u64)> = Vec::new();
        let mut sets = Vec::new();
        let mut set_of = |key: (u64, u64, u64)| -> Result<usize, String> {
            if let Some(i) = keys.iter().position(|k| *k == key) {
                return Ok(i);
            }
            sets.push(crate::transport::plan::Pieces {
                part_len: part_len(key.0),
                pieces: pieces(key.0, key.1, key.2)?,
            });
            keys.push(key);
            Ok(keys.len() - 1)
        };
        for layer in 0..self.layout.layers {
            let Some(l) = remote.layers.get(layer as usize) else {
                return Err(format!("{peer} memory has no layer {layer}"));
            };
            let (ours, theirs) = (self.layout.unit(layer) as u64, l.unit.unwrap_or(half));
            let side_by_side = ours == 2 * half && theirs == 2 * half && l.v == l.k.checked_add(half);
            let (halves, len): (&[bool], u64) = if side_by_side {
                (&[false], 2 * half)
            } else {
                (self.layout.arrays(), half)
            };
            for v in halves {
                let Some(far) = remote.block(layer, *v, 0) else {
                    return Err(format!(
                        "{peer} memory has no {} array for layer {layer}",
                        if *v { "V" } else { "K" }
                    ));
                };
                arrays.push(crate::transport::plan::Place {
                    local: self.block_addr(layer, *v, 0),
                    local_stride: self.layout.block_stride(layer) as u64,
                    remote: far,
                    remote_stride: l.block_stride,
                    set: set_of((ours, theirs, len))?,
                });
            }
        }
        let one_region = self.layout.regions.len() == 1 && remote.layers.windows(2).all(|w| w[0].region == w[1].region);
        Ok(crate::transport::plan::Plan {
            block_major: one_region && block_major(&arrays),
            arrays,
            items,
            sets,
        })
    }

    fn block_addr(&self, layer: u32, v: bool, block: u32) -> u64 {
        let (r, at) = self.layout.block_offset(layer, v, block);
        self.region_addr(r, at)
    }

    /// The registered address of offset `at` of region `r`.
    fn region_addr(&self, r: usize, at: usize) -> u64 {
        match &self.device {
            Some(d) => d.regions[r].base + at as u64,
            None => self.pools[r].base + at as u64,
        }
    }

    /// Connects this engine's backend to `peer`'s memory, on the side that moves the bytes
    /// (push: prefill; pull: decode): refused where the peer names this agent's own memory, or
    /// a KV stream where none can listen; a stream not reached is told without why. The
    /// backend's id for the peer.
    fn connect_to_memory(&self, peer: &PeerInfo, stream_key: &[u8; 32], until: Instant) -> Result<u64, String> {
        let address = peer.address_for(&self.local);
        self.shared.check_local_peer(&self.reg.pdpair, peer, &address)?;
        self.shared.check_memory_address(&address)?;
        self.transport()
            .connect(address.clone(), peer.memory.keys(), stream_key, until)
            .map_err(|e| self.shared.memory_unreachable(&address, e))
    }

    /// What moves this engine's bytes: CUDA IPC for a GPU pool, UCX for a host pool.
    fn transport(&self) -> &dyn crate::transport::Backend {
        match &self.device {
            Some(_) => &*self.shared.cuda,
            None => &*self.shared.transport,
        }
    }

    /// `blocks` (the `j`th holding tokens from `first_token + j * block_size`) with each one's
    /// first token, those that hold any of the request's `num_tokens`.
    fn live_blocks(&self, blocks: &[u32], first_token: u64, num_tokens: u64) -> Vec<(u32, u64)> {
        let step = u64::from(self.layout.block_size);
        blocks
            .iter()
            .enumerate()
            .map(|(i, b)| (*b, first_token + i as u64 * step))
            .filter(|(_, t)| *t < num_tokens)
            .collect()
    }

    /// The checksums of `blocks` (block, its first token) over `count` local heads from
    /// `first`: on the host over the pool's memory, or on the GPU in place. `None` when one
    /// cannot be computed.
    /// On prefill a GPU pool's engine writes were waited for first (`Prefill::written`).
    fn sums_of(&self, blocks: &[(u32, u64)], num_tokens: u64, first: u32, count: u32) -> Option<Vec<u64>> {
        let Some(device) = &self.device else {
            let memory = self.memory();
            // Bytes read per block: `count` heads of every layer's K and V (or latent) arrays.
            let arrays = u64::from(self.layout.layers) * u64::from(self.layout.halves());
            let per_block =
                u64::from(self.layout.block_size) * u64::from(count) * self.layout.half_token() as u64 * arrays;
            let threads = crate::checksum::threads_for(per_block.saturating_mul(blocks.len() as u64));
            return crate::checksum::each_on_threads(blocks, threads.count(), |(b, t)| {
                self.layout.checksum_heads(&memory, *b, *t, num_tokens, first, count)
            });
        };
        let step = u64::from(self.layout.block_size);
        let first_token = blocks.first().map_or(0, |(_, t)| *t);
        let contiguous = blocks
            .iter()
            .enumerate()
            .all(|(j, (_, t))| *t == first_token + j as u64 * step);
        let run = |ids: &[u32], first_token: u64| {
            device.sums(
                &self.layout,
                &crate::checksum::gpu::Blocks {
                    blocks: ids,
                    first_token,
                    num_tokens,
                    first,
                    count,
                },
            )
        };
        if contiguous {
            let ids: Vec<u32> = blocks.iter().map(|(b, _)| *b).collect();
            return run(&ids, first_token);
        }
        blocks
            .iter()
            .map(|(b, t)| run(&[*b], *t).and_then(|s| s.first().copied()))
            .collect()
    }

    /// Maps and registers the engine's memfds (one per region), or allocates the regions: all
    /// of them or none (what was registered before a failure is released).
    fn pools(shared: &Shared, layout: &PoolLayout, fds: Vec<std::os::fd::OwnedFd>) -> Result<Vec<Pool>, String> {
        let lens = layout.region_lens();
        let mut pools: Vec<Pool> = Vec::with_capacity(lens.len());
        let mut fds = fds.into_iter();
        for (i, len) in lens.iter().enumerate() {
            let region = &layout.regions[i];
            let pool = match fds.next() {
                Some(fd) => Pool::engine_memfd(&shared.ucx, fd, *len).map_err(|e| {
                    format!(
                        "region {i}: {e} ({} layers x {} arrays x {} blocks x {} bytes)",
                        region.layers,
                        layout.halves(),
                        layout.num_blocks,
                        layout.block_len()
                    )
                }),
                None => Pool::allocate(&shared.ucx, &shared.cfg.pool_dir, *len).map_err(|e| format!("region {i}: {e}")),
            };
            match pool {
                Ok(pool) => pools.push(pool),
                Err(e) => {
                    for p in &pools {
                        p.release(&shared.ucx);
                    }
                    return Err(e);
                }
            }
        }
        if let Some(s) = shared.transport.stream() {
            let keeps: Vec<_> = pools.iter().map(Pool::keep).collect();
            if let Some(i) = keeps.iter().position(Option::is_none) {
                for p in &pools {
                    p.release(&shared.ucx);
                }
                return Err(format!(
                    "region {i}: UCX allocated it, and the tcp stream moves only the agent's own mappings"
                ));
            }
            for ((p, len), keep) in pools.iter().zip(&lens).zip(keeps.into_iter().flatten()) {
                s.register(p.region, p.base, *len as u64, keep);
            }
        }
        Ok(pools)
    }

    fn handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.settings.handshake_timeout_ms.max(1))
    }

    fn lease(&self) -> Duration {
        Duration::from_millis(self.settings.lease_ms.max(1))
    }

    /// Whether a request from the engine fits its role and pool; fails it otherwise.
    /// [`check_event`] against this engine's pool: required on a prefill's `KvReady`.
    fn check_event(&self, what: &str, event: Option<u32>) -> Result<(), String> {
        let events = self.device.as_ref().map_or(0, |d| d.events());
        check_event(what, event, events, self.reg.role == Role::Prefill)
    }

    fn accept_request(&self, role: Role, what: &str, request: &str, blocks: &[u32], tokens: (u64, u64)) -> bool {
        if !self.role_is(role, what, request) {
            return false;
        }
        match self
            .check_blocks(blocks)
            .and_then(|()| check_tokens(tokens.0, tokens.1))
            .and_then(|()| check_covered(blocks.len(), self.layout.block_size, tokens))
        {
            Ok(()) => true,
            Err(message) => {
                self.refuse(request.to_owned(), vec![Reason::InvalidRequest], message);
                false
            }
        }
    }

    /// Whether a request fits the engine's role; fails it (`WrongRole`) otherwise.
    fn role_is(&self, role: Role, what: &str, request: &str) -> bool {
        if self.reg.role == role {
            return true;
        }
        self.refuse(
            request.to_owned(),
            vec![Reason::WrongRole],
            format!("{what} is for {role} engines"),
        );
        false
    }

    fn check_blocks(&self, blocks: &[u32]) -> Result<(), String> {
        check_blocks(blocks, self.layout.num_blocks)
    }

    // ---- timers and shutdown ----------------------------------------------------------------

    /// The engine's timers, each on a thread of its own: deadlines (decode) and leases
    /// (prefill), whose answers may wait on the engine's socket (an engine may pause its reading
    /// up to the write timeout); and heartbeats on decode's links, which must not: while they
    /// waited there, every idle prefill link went silent past its misses and was dropped, and
    /// its requests failed `PeerLost`.
    fn spawn_timer(self: &Arc<Self>) -> io::Result<()> {
        let every = |name: &'static str, tick: fn(&Engine)| {
            let e = Arc::downgrade(self);
            spawn(name, move || {
                loop {
                    thread::sleep(Duration::from_millis(20));
                    let Some(e) = e.upgrade() else { return };
                    if e.closed.load(Ordering::SeqCst) {
                        return;
                    }
                    tick(&e);
                }
            })
        };
        every("timer", Engine::expire)?;
        if self.reg.role == Role::Decode {
            every("heartbeat", Engine::ping_links)?;
        }
        Ok(())
    }

    /// Deadlines (decode) and leases (prefill).
    fn expire(&self) {
        self.expire_pending();
        self.expire_ready();
    }

    fn shutdown(&self) {
        self.closed.store(true, Ordering::SeqCst);
        // Wake the acceptor so it sees `closed` and drops the listener.
        if let Ok(addr) = self.address.parse::<SocketAddr>() {
            let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(100));
        }
        for (_, slot) in lock(&self.peers).drain() {
            if let Slot::Connected(link) = slot {
                link.finish();
            }
        }
        for link in lock(&self.accepted).drain(..) {
            if let Some(link) = link.upgrade() {
                link.finish();
            }
        }
        lock(&self.pending).clear();
        for pool in &self.pools {
            if let Some(s) = self.shared.transport.stream() {
                s.forget(pool.region);
            }
            pool.release(&self.shared.ucx);
        }
        if let Some(d) = &self.device {
            d.release();
        }
        {
            // Its pools still count a while (their memory perhaps still mapped); moved under
            // `locals`, so a check meanwhile counts them once.
            let mut locals = lock(&self.shared.locals);
            let (gone, kept) = std::mem::take(&mut *locals)
                .into_iter()
                .partition::<Vec<_>, _>(|(id, _)| *id == self.local_id);
            *locals = kept;
            let mut elsewhere = lock(&self.shared.elsewhere);
            elsewhere.released.retain(|(at, _)| at.elapsed() < RELEASED_WITHIN);
            for (_, l) in gone.into_iter().filter(|(_, l)| l.held.all > 0) {
                if elsewhere.released.len() < MAX_ENGINES {
                    elsewhere.released.push((Instant::now(), l.held));
                }
            }
        }
        if let Some(at) = self.side_channel() {
            self.shared.claims.release(at, &self.reg.pdpair, &self.reg.engine);
        }
    }
}

/// Whether a failure reason (by name) is a refused handshake (authentication or the rule
/// table), as opposed to a failed transfer.
pub fn is_handshake_rejection(reason: &str) -> bool {
    Reason::parse(reason).is_handshake_rejection()
}

/// The most tokens a request may have: token positions stay far from overflowing when blocks
/// are counted on from them.
pub const MAX_TOKENS: u64 = 1 << 40;

/// A request's `first_token` and `num_tokens`, each at most [`MAX_TOKENS`].
pub fn check_tokens(first_token: u64, num_tokens: u64) -> Result<(), String> {
    for (name, v) in [("first_token", first_token), ("num_tokens", num_tokens)] {
        if v > MAX_TOKENS {
            return Err(format!("{name} is {v}; at most {MAX_TOKENS}"));
        }
    }
    Ok(())
}

/// A request's `blocks` (of `block_size` tokens each) hold its tokens `first_token..num_tokens`:
/// fewer would have the request end done with the tokens past them never moved (blocks are
/// paired by token position, and those past the last one named are none of the engine's).
pub fn check_covered(blocks: usize, block_size: u32, (first_token, num_tokens): (u64, u64)) -> Result<(), String> {
    if num_tokens <= first_token {
        return Err(format!(
            "num_tokens {num_tokens} is not past first_token {first_token}: no token to move"
        ));
    }
    let held = (blocks as u64).saturating_mul(u64::from(block_size));
    if held < num_tokens - first_token {
        return Err(format!(
            "blocks names {blocks} blocks of {block_size} tokens, which hold {held}; tokens {first_token}..{num_tokens} need {}",
            (num_tokens - first_token).div_ceil(u64::from(block_size.max(1)))
        ));
    }
    Ok(())
}

/// A request's `blocks`: at least one, each inside the pool's `num_blocks` and named once (a
/// request's blocks are distinct; every one costs a range per layer in the windows and ops the
/// agent builds for it).
pub fn check_blocks(blocks: &[u32], num_blocks: u32) -> Result<(), String> {
    if blocks.is_empty() {
        return Err("blocks is empty".into());
    }
    if blocks.len() > MAX_REQUEST_BLOCKS {
        return Err(format!(
            "blocks names {} blocks; a request has at most {MAX_REQUEST_BLOCKS} (the side channel's frames of its block ids and checksums must fit what a link may hold)",
            blocks.len()
        ));
    }
    if blocks.len() > num_blocks as usize {
        return Err(format!(
            "blocks names {} blocks; the pool has {num_blocks}",
            blocks.len()
        ));
    }
    if let Some(b) = blocks.iter().find(|b| **b >= num_blocks) {
        return Err(format!("block {b} is outside the pool's {num_blocks} blocks"));
    }
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    match sorted.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(format!("block {} is named twice in blocks", w[0])),
        None => Ok(()),
    }
}

#[cfg(test)]
impl AgentConfig {
    /// An agent on loopback over tcp, its pools in `pool_dir`, without attestation, publishing
    /// or the UCX probe (the crate's own tests).
    pub(crate) fn for_tests(pool_dir: PathBuf) -> AgentConfig {
        AgentConfig {
            name: "a".into(),
            listen_host: std::net::Ipv4Addr::LOCALHOST.into(),
            transport: crate::transport::ucx::Transport::Tcp,
            stream_lanes: crate::transport::stream::DEFAULT_LANES,
            corrupt_one_byte: false,
            rejection_ttl: Duration::from_secs(30),
            publisher: None,
            pool_dir,
            heartbeat: Duration::from_secs(1),
            attestor: None,
            ucx_probe: None,
            side_channel_ports: None,
        }
    }
}

/// Whether a plan of `arrays` (in one region on each side) merges more block by block: several
/// arrays of one stride on each side, each array's block 0 after the one before and all of
/// them within one block's stride (a block's arrays nearer each other than one block to the
/// next: vLLM 0.33's blocks-outermost layouts, a block's layers back to back).
fn block_major(arrays: &[crate::transport::plan::Place]) -> bool {
    let (Some(first), Some(last)) = (arrays.first(), arrays.last()) else {
        return false;
    };
    arrays.len() > 1
        && arrays
            .iter()
            .all(|a| a.local_stride == first.local_stride && a.remote_stride == first.remote_stride)
        && arrays
            .windows(2)
            .all(|w| w[0].local < w[1].local && w[0].remote < w[1].remote)
        && last.local - first.local < first.local_stride
        && last.remote - first.remote < first.remote_stride
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_goes_block_by_block_only_where_a_blocks_arrays_lie_within_one_block_stride() {
        let place = |local, remote, stride| crate::transport::plan::Place {
            local,
            local_stride: stride,
            remote,
            remote_stride: stride,
            set: 0,
        };
        // Blocks outermost on both sides (layers 64 bytes apart, blocks 192).
        let blocks_outer: Vec<_> = (0..3).map(|l| place(64 * l, 4096 + 64 * l, 192)).collect();
        assert!(super::block_major(&blocks_outer));
        // Layers outermost (a layer's blocks back to back): array by array.
        let layers_outer: Vec<_> = (0..3).map(|l| place(640 * l, 640 * l, 64)).collect();
        assert!(!super::block_major(&layers_outer));
        // One side blocks outermost, the other not; strides that differ; one array.
        let mixed: Vec<_> = (0..3).map(|l| place(64 * l, 640 * l, 192)).collect();
        assert!(!super::block_major(&mixed));
        let mut uneven = blocks_outer.clone();
        uneven[1].remote_stride = 200;
        assert!(!super::block_major(&uneven));
        assert!(!super::block_major(&blocks_outer[..1]));
    }

    #[test]
    fn the_engine_socket_replaces_only_a_socket_left_in_its_place() {
        let dir = std::env::temp_dir().join(format!("pdpair-bind-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let agent = Agent::start(AgentConfig::for_tests(dir.join("pools")), Arc::new(Metrics::new())).expect("agent");
        // A file where the socket goes: left alone, the bind refused naming it.
        let precious = dir.join("precious");
        std::fs::write(&precious, b"keep").expect("file");
        let e = agent.bind(&precious).expect_err("not a socket");
        assert!(e.to_string().contains("is not a socket"), "{e}");
        assert_eq!(std::fs::read(&precious).expect("still there"), b"keep");
        // A socket left by an earlier run: replaced.
        let socket = dir.join("agent.sock");
        drop(UnixListener::bind(&socket).expect("stale"));
        agent.bind(&socket).expect("a stale socket is replaced");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_pool_directory_anyone_may_write_is_refused() {
        // /dev/shm is anyone's: a host user could make the pool directory before the agent
        // does, and own what the agent keeps there.
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("pdpair-pool-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        assert_eq!(prepare_pool_dir(&dir), dir.canonicalize().map_err(|e| e.to_string()));
        // A link to it: refused (a link there could be anyone's, to anywhere).
        let link = dir.with_extension("link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&dir, &link).expect("link");
        let e = prepare_pool_dir(&link).expect_err("a link");
        assert!(e.contains("is a link"), "{e}");
        let _ = std::fs::remove_file(&link);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let e = prepare_pool_dir(&dir).expect_err("anyone may write it");
        assert!(e.contains("writable by anyone") && e.contains("777"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_requests_blocks_are_distinct_inside_the_pool_and_at_least_one() {
        assert_eq!(check_blocks(&[3, 0, 4], 5), Ok(()));
        assert_eq!(check_blocks(&[], 5).expect_err("refused"), "blocks is empty");
        assert_eq!(
            check_blocks(&[1, 5], 5).expect_err("refused"),
            "block 5 is outside the pool's 5 blocks"
        );
        assert_eq!(
            check_blocks(&[4, 1, 4], 5).expect_err("refused"),
            "block 4 is named twice in blocks"
        );
        // A frame's worth of one block (each id costs a range per layer in the windows).
        assert_eq!(
            check_blocks(&[0; 6], 5).expect_err("refused"),
            "blocks names 6 blocks; the pool has 5"
        );
        assert_eq!(
            check_blocks(&[0, 0], 5).expect_err("refused"),
            "block 0 is named twice in blocks"
        );
        // At most MAX_REQUEST_BLOCKS, whatever the pool (protocol::tests: their frames fit a link).
        let most: Vec<u32> = (0..MAX_REQUEST_BLOCKS as u32 + 1).collect();
        assert_eq!(check_blocks(&most[..MAX_REQUEST_BLOCKS], u32::MAX), Ok(()));
        assert!(
            check_blocks(&most, u32::MAX)
                .expect_err("refused")
                .contains(&format!("at most {MAX_REQUEST_BLOCKS}")),
        );
        assert_eq!(check_tokens(MAX_TOKENS, MAX_TOKENS), Ok(()));
        // The blocks hold the tokens (from first_token, block by block), or the tokens past
        // them never move and the request ends done.
        assert_eq!(check_covered(2, 16, (0, 32)), Ok(()));
        assert_eq!(check_covered(3, 16, (16, 50)), Ok(()));
        assert_eq!(
            check_covered(4, 16, (0, 33)),
            Ok(()),
            "blocks past the tokens are skipped"
        );
        assert_eq!(
            check_covered(2, 16, (0, 33)).expect_err("refused"),
            "blocks names 2 blocks of 16 tokens, which hold 32; tokens 0..33 need 3"
        );
        assert_eq!(
            check_covered(1, 16, (32, 32)).expect_err("refused"),
            "num_tokens 32 is not past first_token 32: no token to move"
        );
        assert!(check_covered(usize::MAX, u32::MAX, (0, MAX_TOKENS)).is_ok());
        assert_eq!(
            check_tokens(u64::MAX - 3, 100).expect_err("refused"),
            format!("first_token is {}; at most {MAX_TOKENS}", u64::MAX - 3)
        );
    }

    #[test]
    fn gpu_memory_descriptors_held_for_registrations_are_bounded_across_connections() {
        let count = std::sync::atomic::AtomicUsize::new(0);
        let mut a = PendingFds {
            count: &count,
            held: 0,
            pod: None,
        };
        let mut b = PendingFds {
            count: &count,
            held: 0,
            pod: None,
        };
        a.take(MAX_PENDING_GPU_FDS - 10).expect("within");
        let e = b.take(11).expect_err("past the budget");
        assert!(
            e.contains(&format!("holds {} GPU memory descriptors", MAX_PENDING_GPU_FDS - 10)),
            "{e}"
        );
        b.take(10).expect("to the budget");
        assert_eq!(count.load(Ordering::SeqCst), MAX_PENDING_GPU_FDS);
        // A connection that goes (registered, refused or dropped) gives its share back.
        drop(a);
        assert_eq!(count.load(Ordering::SeqCst), 10);
        let mut c = PendingFds {
            count: &count,
            held: 0,
            pod: None,
        };
        c.take(MAX_PENDING_GPU_FDS - 10).expect("room again");
        drop((b, c));
        assert_eq!(count.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn one_pods_engines_hold_at_most_its_share_of_gpu_memory_descriptors() {
        // One Pod's connections sharing descriptors and never registering held the agent's whole
        // budget: every other Pod's GPU pool shared through VMM was refused (from a review).
        let count = std::sync::atomic::AtomicUsize::new(0);
        let by_pod = Mutex::new(HashMap::new());
        let of = |pod: &str| PendingFds {
            count: &count,
            held: 0,
            pod: Some((&by_pod, pod.to_owned())),
        };
        let (mut a1, mut a2, mut b) = (of("a"), of("a"), of("b"));
        a1.take(MAX_PENDING_GPU_FDS_PER_POD - 1)
            .expect("within the Pod's share");
        let e = a2.take(2).expect_err("past the Pod's share");
        assert!(
            e.contains(&format!(
                "this engine's Pod holds {} GPU memory descriptors",
                MAX_PENDING_GPU_FDS_PER_POD - 1
            )),
            "{e}"
        );
        a2.take(1).expect("to the Pod's share");
        b.take(MAX_PENDING_GPU_FDS - MAX_PENDING_GPU_FDS_PER_POD)
            .expect("another Pod takes the rest");
        // A connection that goes gives its Pod's share back.
        drop(a1);
        a2.take(MAX_PENDING_GPU_FDS_PER_POD - 1).expect("room again");
        drop((a2, b));
        assert_eq!(count.load(Ordering::SeqCst), 0);
        assert!(lock(&by_pod).is_empty());
    }
    use pdpair_api::{Backend, PathKind, TransferPath};

    fn path(peer: &str, kind: PathKind, since: i64) -> TransferPath {
        TransferPath {
            peer: peer.into(),
            kind,
            backend: Backend::UcxHost,
            lanes: vec![format!("{kind}/dev")],
            emulated: false,
            ucx_version: String::new(),
            since: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::from_second(since).expect("time"),
            ),
            last_used: None,
        }
    }

    fn used(mut p: TransferPath, at: i64) -> TransferPath {
        p.last_used = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(at).expect("time"),
        ));
        p
    }

    #[test]
    fn a_prefill_rank_whose_part_arrived_owes_nothing_more() {
        let mut p = Pending {
            prefills: vec!["a".into(), "b".into()],
            parts: HashMap::new(),
            reading: Vec::new(),
            links: SentOn::default(),
            blocks: vec![1],
            num_tokens: 16,
            first_token: 0,
            prompt: None,
            deadline: Instant::now(),
            release: false,
            release_token: None,
        };
        assert!(p.waits_on("a") && p.waits_on("b") && !p.waits_on("c"));
        // Pull: decode records its read of a's blocks before a hears `Released` (and may close
        // its link): a's loss then fails nothing, b's still does.
        assert!(!p.arrived("a", None, 8), "b's part is still to come");
        assert!(!p.waits_on("a") && p.waits_on("b"));
        // A stranger's part, or a's again with other bytes, changes nothing.
        assert!(!p.arrived("c", None, 8) && !p.parts.contains_key("c"));
        assert!(!p.arrived("a", None, 99));
        assert_eq!(p.parts["a"].1, 8, "the first record stays");
        assert!(p.arrived("b", None, 8));
    }

    #[test]
    fn pools_count_for_a_busy_refusal_only_where_they_go_for_the_registration() {
        let held = |pod: Option<&str>, pdpair: &str, role: Role| Held {
            pod: pod.map(str::to_owned),
            pdpair: pdpair.into(),
            role,
            all: 1 << 20,
            in_pool_dir: 0,
        };
        let old = held(Some("old-pod"), "ns/pair", Role::Prefill);
        // A rollout's old Pod of the same pair and role: counted for the new Pod.
        assert!(old.counts_for(Some("new-pod"), "ns/pair", Role::Prefill));
        // Its own Pod's (another rank of it): they do not go for it.
        assert!(!old.counts_for(Some("old-pod"), "ns/pair", Role::Prefill));
        // Another role's, or another pair's: they need not ever go.
        assert!(!old.counts_for(Some("new-pod"), "ns/pair", Role::Decode));
        assert!(!old.counts_for(Some("new-pod"), "ns/other", Role::Prefill));
        // Engines not attested (no Pod known): the same pair and role count.
        assert!(held(None, "ns/pair", Role::Prefill).counts_for(None, "ns/pair", Role::Prefill));
        assert!(old.counts_for(None, "ns/pair", Role::Prefill));
    }

    #[test]
    fn a_rejection_or_failure_is_resolved_by_a_transfer_with_that_peer_only() {
        let failure = |peer: Option<&str>| SeenFailure {
            at: 100,
            reasons: vec![Reason::PeerLost],
            message: "the prefill agent went away".into(),
            peer: peer.map(str::to_owned),
            resolved: None,
        };
        let mut stats = EngineStats {
            last_rejection: Some(SeenRejection {
                at: 100,
                peer: "10.0.0.2:7000".into(),
                reasons: vec![Reason::Unauthenticated],
                message: "the peer proved no pairing secret".into(),
                resolved: None,
            }),
            last_failure: Some(failure(Some("10.0.0.3:7000"))),
            ..Default::default()
        };
        let resolved = |s: &EngineStats| {
            (
                s.last_rejection.as_ref().and_then(|r| r.resolved),
                s.last_failure.as_ref().and_then(|f| f.resolved),
            )
        };
        stats.transferred(101, 10, ["10.0.0.1:7000"]);
        assert_eq!(stats.last_success, Some(101));
        assert_eq!(resolved(&stats), (None, None), "another peer");
        stats.transferred(102, 10, ["10.0.0.1:7000", "10.0.0.2:7000"]);
        stats.transferred(103, 10, ["10.0.0.2:7000", "10.0.0.3:7000"]);
        stats.transferred(104, 10, ["10.0.0.3:7000"]);
        assert_eq!(resolved(&stats), (Some(102), Some(103)), "the first one with each");
        assert_eq!((stats.counters.transfers_completed, stats.counters.bytes), (4, 40));
        // A failure with no peer named is resolved by nothing.
        stats.last_failure = Some(failure(None));
        stats.transferred(105, 10, ["10.0.0.3:7000"]);
        assert_eq!(resolved(&stats).1, None);
    }

    #[test]
    fn a_failure_or_rejection_with_one_peer_is_not_hidden_by_a_later_one_with_another() {
        let failure = |at: i64, peer: Option<&str>| SeenFailure {
            at,
            reasons: vec![Reason::TransportFailed],
            message: format!("at {at}"),
            peer: peer.map(str::to_owned),
            resolved: None,
        };
        let mut stats = EngineStats::default();
        let fail = |s: &mut EngineStats, f: SeenFailure| keep_news(&mut s.last_failure, &mut s.earlier_failures, f);
        let standing = |s: &EngineStats| -> Vec<(i64, Option<String>)> {
            s.earlier_failures
                .iter()
                .chain(s.last_failure.iter())
                .filter(|f| f.resolved.is_none())
                .map(|f| (f.at, f.peer.clone()))
                .collect()
        };
        let a = Some("10.0.0.1:7000");
        let b = Some("10.0.0.2:7000");
        fail(&mut stats, failure(1, a));
        fail(&mut stats, failure(2, b));
        // B's transfer resolves B's; A's still stands (with the last alone, it was gone).
        stats.transferred(3, 10, b);
        assert_eq!(standing(&stats), [(1, a.map(str::to_owned))]);
        assert_eq!(stats.last_failure.as_ref().map(|f| f.resolved), Some(Some(3)));
        // A failure of A again supersedes its earlier one; the last (B's, resolved) goes.
        fail(&mut stats, failure(4, a));
        assert!(stats.earlier_failures.is_empty(), "{:?}", stats.earlier_failures);
        assert_eq!(standing(&stats), [(4, a.map(str::to_owned))]);
        // One naming no peer stands until any transfer; each peer once, the most recent kept.
        fail(&mut stats, failure(5, None));
        for i in 0..20 {
            fail(&mut stats, failure(6 + i, Some(&format!("10.0.1.{i}:7000"))));
        }
        assert_eq!(stats.earlier_failures.len(), pdpair_api::MAX_EARLIER);
        assert_eq!(stats.earlier_failures.first().map(|f| f.at), Some(25 - 8));
        assert_eq!(stats.last_failure.as_ref().map(|f| f.at), Some(25));
        fail(&mut stats, failure(30, None));
        fail(&mut stats, failure(31, a));
        assert_eq!(
            stats.earlier_failures.last().map(|f| (f.at, f.peer.clone())),
            Some((30, None))
        );
        stats.transferred(32, 10, ["10.0.1.19:7000"]);
        assert!(
            stats
                .earlier_failures
                .iter()
                .all(|f| f.peer.is_some() && f.peer.as_deref() != Some("10.0.1.19:7000")),
            "resolved, and none naming no peer after a transfer: {:?}",
            stats.earlier_failures
        );
        assert_eq!(stats.earlier_failures.len(), pdpair_api::MAX_EARLIER - 2);
        // Rejections alike.
        let rejection = |at: i64, peer: &str| SeenRejection {
            at,
            peer: peer.to_owned(),
            reasons: vec![Reason::Unauthenticated],
            message: String::new(),
            resolved: None,
        };
        keep_news(
            &mut stats.last_rejection,
            &mut stats.earlier_rejections,
            rejection(40, "p:1"),
        );
        keep_news(
            &mut stats.last_rejection,
            &mut stats.earlier_rejections,
            rejection(41, "p:2"),
        );
        stats.transferred(42, 10, ["p:2"]);
        let ats: Vec<_> = stats.earlier_rejections.iter().map(|r| (r.at, r.resolved)).collect();
        assert_eq!(ats, [(40, None)]);
    }

    #[test]
    fn a_peers_names_in_status_are_cut_and_escaped() {
        assert_eq!(peer_name("d0", "node-b"), "d0@node-b");
        let long = "x".repeat(500);
        assert_eq!(
            peer_name(&long, "a\n\u{1b}[31m"),
            format!("{}@a\\n\\u{{1b}}[31m", "x".repeat(64))
        );
    }

    #[test]
    fn a_peer_keeps_its_path_until_it_changes_and_the_peers_used_least_recently_go_first() {
        let mut paths = Vec::new();
        record_path(&mut paths, path("a", PathKind::Rdma, 1), 1);
        record_path(&mut paths, path("a", PathKind::Rdma, 2), 2);
        assert_eq!(
            paths,
            [used(path("a", PathKind::Rdma, 1), 1)],
            "the same path keeps its first time, and its use is refreshed at most once a minute"
        );
        record_path(&mut paths, path("a", PathKind::Rdma, 2), 61);
        assert_eq!(
            paths,
            [used(path("a", PathKind::Rdma, 1), 61)],
            "a minute on: refreshed"
        );
        record_path(&mut paths, path("a", PathKind::Tcp, 62), 62);
        assert_eq!(
            paths,
            [used(path("a", PathKind::Tcp, 62), 62)],
            "a changed path replaces it"
        );
        for i in 0..pdpair_api::MAX_PATHS - 1 {
            record_path(
                &mut paths,
                path(&format!("p{i}"), PathKind::SharedMemory, 100),
                100 + i as i64,
            );
        }
        // The first listed (a), used again: p0 is now the one used least recently.
        record_path(&mut paths, path("a", PathKind::Tcp, 62), 200);
        record_path(&mut paths, path("new", PathKind::SharedMemory, 201), 201);
        assert_eq!(paths.len(), pdpair_api::MAX_PATHS);
        assert!(paths.iter().any(|p| p.peer == "a"), "a, used lately, stays");
        assert!(!paths.iter().any(|p| p.peer == "p0"), "p0, used least recently, went");
        assert_eq!(paths.last().map(|p| p.peer.as_str()), Some("new"));
    }

    /// A frame of about 1 MiB.
    fn mib_frame() -> Message {
        Message::Failed {
            request: "f".into(),
            reason: Reason::InvalidRequest,
            message: "x".repeat(1 << 20),
        }
    }

    /// A link to a peer that never reads (a connected socket whose far end is left unread).
    pub(super) fn link_to_a_mute_peer() -> (Link, TcpStream) {
        link_to_a_mute_peer_in(&Outboxes::new(crate::outboxes::OUTBOX_BUDGET))
    }

    /// The same, its outbox counted in `outboxes`.
    fn link_to_a_mute_peer_in(outboxes: &Arc<Outboxes>) -> (Link, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let ours = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (theirs, _) = listener.accept().expect("accept");
        ours.set_write_timeout(Some(PREFILL_SILENCE_LIMIT)).expect("timeout");
        let kv = pdpair_api::KvGeometry {
            engine: "vllm".into(),
            engine_version: None,
            model: "m".into(),
            dtype: pdpair_api::ModelDtype::Bfloat16,
            cache_dtype: Default::default(),
            layers: 2,
            kv_heads: 2,
            head_dim: 16,
            attention_backend: "FLASH_ATTN".into(),
            layout: pdpair_api::KvLayout::Nhd,
            block_size: 16,
            kernel_block_size: None,
            mla: false,
            hybrid: false,
            host_buffer: false,
        };
        let peer = PeerInfo {
            agent: "mute".into(),
            version: protocol::PROTOCOL_VERSION,
            pdpair: "team-a/llama".into(),
            role: Role::Decode,
            engine: "d0".into(),
            mode: pdpair_api::TransferMode::Pull,
            checksum: pdpair_api::ChecksumPolicy::FailClosed,
            parallelism: Default::default(),
            kv,
            tensor_rank: 0,
            worker_address: Vec::new(),
            memory: MemoryDesc::default(),
            stream_address: String::new(),
        };
        let heads = protocol::HeadMap {
            p_first: 0,
            count: 2,
            d_first: 0,
        };
        let link = Link::new(
            (outboxes, outboxes),
            ours,
            Sealer::new([7; 32]),
            None,
            peer,
            None,
            "mute".into(),
            heads,
        )
        .expect("a link");
        (link, theirs)
    }

    #[test]
    fn a_peer_that_stops_reading_never_blocks_a_sender_and_loses_its_link_past_the_outbox() {
        // Frames of 1 MiB to a peer that reads nothing: the socket buffers fill, then the outbox;
        // each send returns at once (the timer, the engine's thread, another link's reader send
        // on links), and the first past the outbox's bound is refused and closes the link.
        let (link, mut theirs) = link_to_a_mute_peer();
        let big = mib_frame();
        let (done, finished) = std::sync::mpsc::channel();
        let sender = thread::spawn(move || {
            let refused = (0..1000).find(|_| !link.send(&big));
            let _ = done.send(refused);
            link
        });
        let refused = finished
            .recv_timeout(Duration::from_secs(20))
            .expect("sends to a peer that reads nothing returned without waiting for it");
        let refused = refused.expect("the outbox is bounded");
        // Sealed, each frame is a little over 1 MiB; the kernel holds about LINK_SEND_BUFFER more.
        assert!(
            refused >= (LINK_OUTBOX >> 20) - 1,
            "refused only past the outbox's {LINK_OUTBOX} bytes: {refused}"
        );
        let link = sender.join().expect("sender");
        assert!(
            !link.send(&Message::Pong { seq: 1 }),
            "a closed link sends nothing more"
        );
        // The peer then finds the link closed after what was in flight.
        theirs.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        let mut sink = vec![0u8; 1 << 20];
        loop {
            match std::io::Read::read(&mut theirs, &mut sink) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e) => panic!("the link was not closed: {e}"),
            }
        }
    }

    #[test]
    fn a_peer_that_stops_reading_holds_a_small_kernel_send_buffer_per_link() {
        // What the kernel holds for a link whose peer reads nothing is the agent's memory too
        // (its cgroup is charged), and no outbox counts it: left to autotuning it grew to 4 MiB
        // a link.
        let (link, _theirs) = link_to_a_mute_peer();
        let big = mib_frame();
        for _ in 0..8 {
            assert!(link.send(&big), "within the outbox");
        }
        // The writer fills the socket until the kernel takes no more.
        let mut queued = 0;
        for _ in 0..50 {
            thread::sleep(Duration::from_millis(20));
            let now = wire::send_queued(&link.stream);
            if now == queued && now > 0 {
                break;
            }
            queued = now;
        }
        let sndbuf = wire::send_buffer(&link.stream);
        assert!(sndbuf <= 2 * LINK_SEND_BUFFER, "SO_SNDBUF {sndbuf}");
        // The kernel takes one more segment (up to 64 KiB) while under its buffer.
        assert!(
            queued > 0 && queued <= 2 * LINK_SEND_BUFFER + (64 << 10),
            "the kernel holds {queued} bytes for the link"
        );
    }

    /// Holds of `links`' open (not closing) outboxes.
    fn open_held(links: &[(Link, TcpStream)]) -> usize {
        links
            .iter()
            .filter(|(l, _)| !l.queue.shut())
            .map(|(l, _)| l.queue.queued())
            .sum()
    }

    #[test]
    fn links_that_stop_reading_hold_at_most_their_pairs_budget_in_all() {
        // An insider with many addresses holds many links (they are bounded per source only)
        // and reads nothing: each link's outbox alone let it pile up 32 MiB per link.
        const BUDGET: usize = 8 << 20;
        let outboxes = Outboxes::new(BUDGET);
        let mutes: Vec<(Link, TcpStream)> = (0..6).map(|_| link_to_a_mute_peer_in(&outboxes)).collect();
        let big = mib_frame();
        for _ in 0..20 {
            for (l, _) in &mutes {
                l.send(&big);
                let held = open_held(&mutes);
                assert!(held <= BUDGET + (2 << 20), "open links hold {held} bytes");
            }
        }
        assert!(
            mutes.iter().any(|(l, _)| l.queue.shut()),
            "links over the budget were closed"
        );
        // Closed links' frames are released as their writers fail.
        let settled = std::time::Instant::now() + Duration::from_secs(10);
        while outboxes.total() > BUDGET + (2 << 20) {
            assert!(
                std::time::Instant::now() < settled,
                "the total stays {}",
                outboxes.total()
            );
            thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_link_that_reads_keeps_its_place_while_links_that_do_not_hold_the_budget() {
        const BUDGET: usize = 16 << 20;
        let outboxes = Outboxes::new(BUDGET);
        let mutes: Vec<(Link, TcpStream)> = (0..2).map(|_| link_to_a_mute_peer_in(&outboxes)).collect();
        let big = mib_frame();
        // Two links that read nothing fill the budget, half each.
        while outboxes.total() + (2 << 20) <= BUDGET {
            for (l, _) in &mutes {
                assert!(l.send(&big), "filling");
            }
        }
        // A peer that reads, late: its link holds a few frames while the budget is full.
        let (reading, mut theirs) = link_to_a_mute_peer_in(&outboxes);
        let mut sent = 0;
        while reading.queue.queued() < 3 << 20 {
            assert!(sent < 64, "the link never held 3 MiB");
            assert!(reading.send(&big), "frame {sent} to a peer that reads was refused");
            sent += 1;
        }
        assert!(
            mutes.iter().any(|(l, _)| l.queue.shut()),
            "the link holding the most made room"
        );
        let drained = thread::spawn(move || {
            let mut sink = vec![0u8; 1 << 20];
            let mut n = 0usize;
            while let Ok(k @ 1..) = std::io::Read::read(&mut theirs, &mut sink) {
                n += k;
            }
            n
        });
        for i in 0..20 {
            assert!(
                reading.send(&big),
                "frame {} to a peer that reads was refused",
                sent + i
            );
        }
        reading.finish();
        assert!(
            drained.join().expect("reader") > (sent + 20) << 20,
            "every frame reached it"
        );
        assert!(open_held(&mutes) <= BUDGET);
    }

    #[test]
    fn a_links_progress_is_when_its_writer_last_finished_a_frame() {
        // What the budget closes first is the link longest without progress: a peer that reads,
        // however slowly, makes some each time a frame is written to it.
        let (link, mut theirs) = link_to_a_mute_peer();
        let big = mib_frame();
        let mut sent = 0;
        while link.queue.queued() < 2 << 20 {
            assert!(sent < 64 && link.send(&big), "queued behind a full socket");
            sent += 1;
        }
        let before = link.queue.progress();
        thread::sleep(Duration::from_millis(20));
        assert_eq!(link.queue.progress(), before, "nothing written meanwhile");
        let drained = thread::spawn(move || {
            let mut sink = vec![0u8; 1 << 20];
            while let Ok(1..) = std::io::Read::read(&mut theirs, &mut sink) {}
        });
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while link.queue.progress() == before {
            assert!(
                std::time::Instant::now() < until,
                "no progress recorded as frames were written"
            );
            thread::sleep(Duration::from_millis(1));
        }
        assert!(link.queue.progress() >= before + 20_000);
        link.close();
        drained.join().expect("reader");
    }

    #[test]
    fn a_link_closed_after_a_frame_delivers_that_frame_first() {
        let (link, mut theirs) = link_to_a_mute_peer();
        assert!(link.send(&Message::Pong { seq: 9 }));
        link.close_after_sent();
        // Nothing is queued behind the close (it would be lost while the send said it went).
        assert!(!link.send(&Message::Pong { seq: 10 }), "a send after close_after_sent");
        theirs.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut opener = wire::Opener::new([7; 32]);
        let got = wire::read_sealed::<Message>(&mut theirs, &mut opener, wire::MAX_FRAME).expect("the frame");
        assert_eq!(got, Message::Pong { seq: 9 });
        assert!(matches!(
            wire::read_sealed::<Message>(&mut theirs, &mut opener, wire::MAX_FRAME),
            Err(wire::FrameError::Closed)
        ));
    }

    #[test]
    fn a_link_its_engine_leaves_still_delivers_what_was_queued() {
        // The engine heard its answer after the frame its peer needs was queued (prefill's
        // Complete, decode's Released), and may leave at once: the link stops reading but
        // delivers the frame, even from behind a full socket. (Closed at once, the blocked write
        // failed and the frame was lost: the peer's engine heard PeerLost for a transfer that
        // had worked.)
        let (link, mut theirs) = link_to_a_mute_peer();
        let filler = mib_frame();
        for _ in 0..24 {
            assert!(link.send(&filler));
        }
        assert!(link.send(&Message::Complete {
            request: "r".into(),
            sums: None,
            bytes: 7,
        }));
        link.finish();
        let mut ours = link.stream.try_clone().expect("clone");
        ours.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        assert_eq!(
            std::io::Read::read(&mut ours, &mut [0u8; 8]).expect("read"),
            0,
            "reading ended"
        );
        theirs.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        let mut opener = wire::Opener::new([7; 32]);
        for i in 0..24 {
            let got = wire::read_sealed::<Message>(&mut theirs, &mut opener, wire::MAX_FRAME);
            assert!(matches!(got, Ok(Message::Failed { .. })), "filler {i}: {got:?}");
        }
        let last = wire::read_sealed::<Message>(&mut theirs, &mut opener, wire::MAX_FRAME).expect("the Complete");
        assert!(matches!(last, Message::Complete { bytes: 7, .. }), "{last:?}");
        assert!(matches!(
            wire::read_sealed::<Message>(&mut theirs, &mut opener, wire::MAX_FRAME),
            Err(wire::FrameError::Closed)
        ));
    }
}
