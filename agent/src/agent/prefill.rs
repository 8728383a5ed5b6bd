//! The prefill side of an engine: accepting decode agents (authenticating, handshaking),
//! matching their registrations with the engine's ready KV in either order, serving every decode
//! rank that takes heads from a ready request, and pushing (WRITEs) or lending (pull) its blocks.

use std::{
    collections::HashMap,
    net::{TcpListener, TcpStream},
    sync::{Arc, atomic::Ordering},
    thread,
    time::Instant,
};

use pdpair_api::{ChecksumPolicy, Role, checksum::BlockSums};

use super::*;
use crate::{
    engine_api::{PromptDigest, ReleaseToken, check_prompt, release_counts},
    protocol::{self, Message, Reason, Registration, Session},
    transport::{
        OpError,
        plan::{BlockShape, Item, Plan, in_batches, pieces},
        stream::Access,
    },
    wire,
};

/// How many leases after its KvReady a ready request may be held by renewals in all.
pub const MAX_HOLD_LEASES: u32 = 10;

/// A P request whose KV is ready.
#[derive(Clone, Debug)]
pub(super) struct Ready {
    blocks: Vec<u32>,
    num_tokens: u64,
    first_token: u64,
    /// The engine's prompt digest: a registration must bring the same.
    prompt: Option<PromptDigest>,
    since: Instant,
    /// Which of a GPU pool's `gpu.events` follows the engine's writes (checked at the KvReady).
    event: Option<u32>,
    /// The engine's release token: a decode `Release` naming it counts whatever its prompt.
    release_token: Option<ReleaseToken>,
}

impl Ready {
    /// Whether a decode `Release` of `prompt` and `token` counts for this request
    /// ([`release_counts`]).
    fn released_by(&self, prompt: Option<&PromptDigest>, token: Option<&ReleaseToken>) -> bool {
        release_counts(prompt, token, self.prompt.as_ref(), self.release_token.as_ref())
    }
}

/// A ready request on prefill, and the decode ranks it serves: with more decode than prefill
/// tensor-parallel ranks several decode ranks take their heads from the same prefill rank, each
/// registering on its own; the engine hears once, when all have been served.
#[derive(Debug)]
pub(super) struct Serving {
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
    failure: Option<(Vec<Reason>, String)>,
    /// `TransferStarted` went to the engine.
    started: bool,
    /// Pull: when blocks were last lent (the lease for `Released`).
    lent_since: Option<Instant>,
    /// Links being served: only these may answer `Released` (once each).
    links: Vec<u64>,
    /// Registrations refused as not this request's (`Engine::fits`): how many, and the first's
    /// reason and message, for the engine when the lease ends with none served.
    refused: Option<(u32, Reason, String)>,
    /// The links of decode ranks that released the request (needed nothing), each counted
    /// once, in `finished` too.
    released_by: Vec<u64>,
    /// Pull: the links whose serving failed before their read ([`Engine::consumer_failed`]),
    /// counted in `finished`: not served again.
    failed_on: Vec<u64>,
    /// When a decode agent last renewed the hold (decode's engine queues the request).
    renewed: Option<Instant>,
    /// The engine cancelled the request: it hears `Cancelled` once no transfer of it runs.
    cancelled: bool,
}

impl Serving {
    /// Whether the engine can hear how the request ended: every one of `expected` decode ranks
    /// is done, or the engine cancelled it and no transfer of it runs.
    fn concluded(&self, expected: u32) -> bool {
        self.finished >= expected || (self.cancelled && self.in_flight == 0)
    }

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
            links: Vec::new(),
            refused: None,
            released_by: Vec::new(),
            failed_on: Vec::new(),
            renewed: None,
            cancelled: false,
        }
    }
}

/// Requests that ended lately, for a lease, at most [`MAX_GONE`] of them (the oldest go first):
/// an engine cancelling ids it never made ready would otherwise add one each without end. Kept
/// as a keyed 64-bit hash of the id, not the id: ids of 512 bytes, each kept twice, made 75 MB an
/// engine, and one Pod may run 32 (a collision, about 2^-33 among all of them and not to be aimed
/// without the key, refuses one of the same engine's own requests like an ended one).
#[derive(Debug, Default)]
pub(super) struct Gone {
    keys: std::hash::RandomState,
    at: HashMap<u64, Instant>,
    order: std::collections::VecDeque<(u64, Instant)>,
}

/// Ended requests [`Gone`] remembers, at most.
pub const MAX_GONE: usize = 65536;

impl Gone {
    fn key(&self, request: &str) -> u64 {
        std::hash::BuildHasher::hash_one(&self.keys, request)
    }

    pub(super) fn insert(&mut self, request: String) {
        let (key, now) = (self.key(&request), Instant::now());
        self.at.insert(key, now);
        self.order.push_back((key, now));
        while self.order.len() > MAX_GONE {
            self.pop_oldest();
        }
    }

    pub(super) fn contains_key(&self, request: &str) -> bool {
        self.at.contains_key(&self.key(request))
    }

    /// Forgets what ended a `lease` ago or more.
    pub(super) fn expire(&mut self, lease: Duration) {
        while self.order.front().is_some_and(|(_, at)| at.elapsed() >= lease) {
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        if let Some((key, at)) = self.order.pop_front()
            && self.at.get(&key) == Some(&at)
        {
            self.at.remove(&key);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.at.len()
    }
}

/// Prefill-side matching of KvReady and Register, in either order.
#[derive(Debug, Default)]
pub(super) struct Matching {
    ready: HashMap<String, Serving>,
    /// Registrations waiting for their KvReady (several decode ranks may wait for one request).
    registered: HashMap<String, Vec<Waiting>>,
    /// Releases that came before the KvReady, and when the first came.
    released_early: HashMap<String, (Vec<EarlyRelease>, Instant)>,
    /// Requests released lately (kept for a lease): a later registration is refused at once.
    gone: Gone,
    /// Registrations (and early releases) waiting on every link of this engine, and their
    /// blocks: at most [`ENGINE_WAITING`] and [`ENGINE_WAITING_BLOCKS`].
    waiting: Counts,
}

/// Where a waiting entry is: a registration (request, place) or an early release (request,
/// place).
enum Entry<'a> {
    Registered(&'a str, usize),
    Early(&'a str, usize),
}

impl Matching {
    /// Room, past the engine's bound, for one more entry of `blocks` blocks on the link counting
    /// `mine`: the oldest entries of the link holding the most (registrations, or blocks where
    /// those are over: then only entries that hold blocks) go, as long as that link holds more
    /// than `mine` would with the new one. An evicted registration's link hears `Failed{Busy}`;
    /// an early release is dropped. So links that pile up entries lose them, heaviest first, and
    /// a decode asking for a few keeps its place however many links hold the rest.
    fn make_room(&mut self, mine: &Counts, blocks: usize) {
        // Each eviction frees an entry (or its blocks, the largest of the heaviest link's); at
        // most [`MAX_EVICTIONS`] for one newcomer, each a scan of the waiting entries.
        for _ in 0..MAX_EVICTIONS {
            let Some(evicted) = self.evict_one(mine, blocks) else {
                break;
            };
            if let Some((link, request)) = evicted {
                tracing::debug!(peer = %link.addr, %request, "this engine's waiting registrations are at their bound; dropped the oldest of the link holding the most");
                link.send(&Message::Failed {
                    request,
                    reason: Reason::Busy,
                    message: format!(
                        "the prefill engine's links have {ENGINE_WAITING} registrations (or {ENGINE_WAITING_BLOCKS} blocks) waiting for their KvReady, and this link the most: its oldest was dropped"
                    ),
                });
            }
        }
    }

    /// One eviction for [`Matching::make_room`]: `None` when the new entry fits or no other
    /// link holds more than `mine` would; else the evicted registration's link and request
    /// (`Some(None)` for an early release).
    #[allow(clippy::option_option)]
    fn evict_one(&mut self, mine: &Counts, blocks: usize) -> Option<Option<(Arc<Link>, String)>> {
        let by_blocks = self.waiting.1.load(Ordering::SeqCst) + blocks > ENGINE_WAITING_BLOCKS;
        if !by_blocks && self.waiting.0.load(Ordering::SeqCst) < ENGINE_WAITING {
            return None;
        }
        let weight = |c: &Counts| {
            if by_blocks {
                c.1.load(Ordering::SeqCst)
            } else {
                c.0.load(Ordering::SeqCst)
            }
        };
        let after = weight(mine) + if by_blocks { blocks } else { 1 };
        // The heaviest other link's oldest entry (that frees blocks, where blocks are over).
        let registered = self.registered.iter().flat_map(|(request, list)| {
            list.iter()
                .enumerate()
                .map(move |(i, (_, _, at, held))| (held, *at, Entry::Registered(request.as_str(), i)))
        });
        let early = self.released_early.iter().flat_map(|(request, (list, at))| {
            list.iter()
                .enumerate()
                .map(move |(i, (_, held, _, _))| (held, *at, Entry::Early(request.as_str(), i)))
        });
        // Where blocks are over, its largest (so a few evictions make room), else its oldest.
        let victim = registered
            .chain(early)
            .filter(|(held, ..)| !(Arc::ptr_eq(&held.counts, mine) || (by_blocks && held.blocks == 0)))
            .map(|(held, at, entry)| (weight(&held.counts), if by_blocks { held.blocks } else { 0 }, at, entry))
            .filter(|(w, ..)| *w > after)
            .max_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)).then(b.2.cmp(&a.2)));
        let (.., entry) = victim?;
        Some(match entry {
            Entry::Registered(request, i) => {
                let request = request.to_owned();
                let list = self.registered.get_mut(&request)?;
                // In order: the request's registrations are served first come.
                let (link, ..) = list.remove(i);
                if list.is_empty() {
                    self.registered.remove(&request);
                }
                Some((link, request))
            }
            Entry::Early(request, i) => {
                let request = request.to_owned();
                let list = &mut self.released_early.get_mut(&request)?.0;
                list.remove(i);
                if list.is_empty() {
                    self.released_early.remove(&request);
                }
                None
            }
        })
    }
}

/// Entries one newcomer may evict past the engine's bound (see [`Matching::make_room`]); when
/// they do not make room it is refused.
const MAX_EVICTIONS: usize = 256;

/// A count and a number of blocks, shared by what they count.
type Counts = Arc<(std::sync::atomic::AtomicUsize, std::sync::atomic::AtomicUsize)>;

/// A release of a request that came before its KvReady: the link that released (counted against
/// its bound), the prompt digest it gave, and the decode ranks its geometry expects. Kept per
/// prompt: at the KvReady only those of the request's prompt count, and set how many ranks are
/// expected (a release of another prompt neither takes a place of the request's own decode
/// ranks nor says how many there are).
type EarlyRelease = (u64, Held, (Option<PromptDigest>, Option<ReleaseToken>), u32);

/// The early releases of a request that count once it is `ready`: only those of its prompt or
/// token (the others let their link's registration go, nothing more), and only they say how many
/// ranks to expect; once per link (releases of two prompts from one link, one counting by its
/// prompt and one by the token, took two decode ranks' places).
fn early_counted(early: Vec<EarlyRelease>, ready: &Ready) -> Vec<EarlyRelease> {
    let mut links = std::collections::HashSet::new();
    early
        .into_iter()
        .filter(|(_, _, (prompt, token), _)| ready.released_by(prompt.as_ref(), token.as_ref()))
        .filter(|(id, ..)| links.insert(*id))
        .collect()
}

/// A D registration waiting for P's KV: the link it came on, the registration, when, and its
/// place in the link's bound.
type Waiting = (Arc<Link>, Registration, Instant, Held);

/// Links one prefill engine keeps with one source address at most (a decode agent holds one per
/// decode engine on its node), a connection counting as one from its proof on, its handshake
/// included: more are closed before authentication, or before `AuthOk`.
pub const MAX_LINKS_PER_SOURCE: usize = 128;

/// Links one prefill engine keeps in all (two threads each): past it, a decode that has just
/// authenticated and handshaken takes the place of the link whose peer asked least recently
/// for anything, of those not being served (a pull decode reading lent blocks asks nothing
/// until it has read them). Links are bounded per source, not across addresses: an insider holding many
/// addresses could otherwise open links (and threads) without end; a decode asking for work
/// keeps its place, an idle one dials again when it has work. (Connections still in their
/// handshake are bounded per agent: `MAX_HANDSHAKING`.)
pub const MAX_LINKS_PER_ENGINE: usize = 1024;

/// Registrations (and releases that came first) one decode link may have waiting for their
/// KvReady, at most: more are refused (an insider could otherwise fill the agent's memory with
/// registrations of requests that never come). A decode engine asks for far fewer at once (vLLM
/// runs at most a few hundred requests).
pub const MAX_WAITING: usize = 4096;

/// Block ids in one decode link's waiting registrations, at most (16 MiB of them).
pub const MAX_WAITING_BLOCKS: usize = 1 << 22;

/// Registrations, and block ids, waiting on all links of one prefill engine together, at most:
/// past them the link holding the most gives up its oldest ([`Matching::make_room`]). Links
/// are bounded per source, not across addresses: without it an insider holding links from many
/// addresses made the engine keep 16 MiB of block ids per link.
pub const ENGINE_WAITING: usize = 4 * MAX_WAITING;
pub const ENGINE_WAITING_BLOCKS: usize = 4 * MAX_WAITING_BLOCKS;

/// One waiting registration counted against its link's [`MAX_WAITING`] and
/// [`MAX_WAITING_BLOCKS`], for as long as it lives (however it leaves the waiting list).
#[derive(Debug)]
pub(super) struct Held {
    /// The link's counts (not the link: an early release outlives its link by up to a lease,
    /// and must not keep the link's socket and writer thread), and its engine's.
    counts: Counts,
    engine: Counts,
    blocks: usize,
}

impl Held {
    /// A place for a registration of `blocks` blocks on `link` of the engine counting
    /// `engine` (taken under its matching lock), or why there is none.
    fn take(link: &Link, engine: &Counts, blocks: usize) -> Result<Held, (Reason, String)> {
        let now = link.waiting.0.load(Ordering::SeqCst);
        let now_blocks = link.waiting.1.load(Ordering::SeqCst);
        if now >= MAX_WAITING || now_blocks + blocks > MAX_WAITING_BLOCKS {
            return Err((
                Reason::InvalidRequest,
                format!(
                    "this link has {now} registrations and releases of {now_blocks} blocks waiting for their KvReady; at most {MAX_WAITING} of {MAX_WAITING_BLOCKS}"
                ),
            ));
        }
        let all = engine.0.load(Ordering::SeqCst);
        let all_blocks = engine.1.load(Ordering::SeqCst);
        if all >= ENGINE_WAITING || all_blocks + blocks > ENGINE_WAITING_BLOCKS {
            // `Matching::make_room` found no link holding more than this one would (or no room
            // within its evictions).
            return Err((
                Reason::Busy,
                format!(
                    "this engine's links have {all} registrations and releases of {all_blocks} blocks waiting for their KvReady (at most {ENGINE_WAITING} of {ENGINE_WAITING_BLOCKS}), and no other link holds more than this one would ({now} of {now_blocks} now)"
                ),
            ));
        }
        for c in [&link.waiting, engine] {
            c.0.fetch_add(1, Ordering::SeqCst);
            c.1.fetch_add(blocks, Ordering::SeqCst);
        }
        Ok(Held {
            counts: link.waiting.clone(),
            engine: engine.clone(),
            blocks,
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        for c in [&self.counts, &self.engine] {
            c.0.fetch_sub(1, Ordering::SeqCst);
            c.1.fetch_sub(self.blocks, Ordering::SeqCst);
        }
    }
}

/// A registration being served: its link, the registration, the ready KV, and (push) the
/// blocks paired to write, (P block, D block, first token), from [`Engine::fits`].
pub(super) type Consumer = (Arc<Link>, Registration, Ready, Pairs);

/// Blocks paired by absolute token position: (P block, D block, first token).
type Pairs = Vec<(u32, u32, u64)>;

/// A registration prefill serves, or why it refuses it (told only to its link).
type Begun = Result<Consumer, (Reason, String)>;

/// One consumer's result: bytes and microseconds in flight, or failure reasons and a message.
pub(super) type Served = Result<(u64, u64), (Vec<Reason>, String)>;

/// An authenticated connection's place among its source's links while it is in its handshake
/// ([`Engine::shaking_place`]); given back when dropped.
pub(super) struct Shaking<'a> {
    engine: &'a Engine,
    source: std::net::IpAddr,
}

impl Shaking<'_> {
    /// Its link is among the accepted ones now, which `shaking` (locked, with `accepted`) counts
    /// no longer: counted once, never twice, so the source's next link finds its place.
    fn into_link(self, shaking: &mut HashMap<std::net::IpAddr, usize>) {
        Self::given_back(shaking, self.source);
        // Given back above; it holds nothing else.
        std::mem::forget(self);
    }

    fn given_back(shaking: &mut HashMap<std::net::IpAddr, usize>, source: std::net::IpAddr) {
        if let Some(n) = shaking.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                shaking.remove(&source);
            }
        }
    }
}

impl Drop for Shaking<'_> {
    fn drop(&mut self) {
        Self::given_back(&mut lock(&self.engine.shaking), self.source);
    }
}

impl Engine {
    pub(super) fn accept(self: Arc<Self>, listener: TcpListener) {
        for stream in listener.incoming() {
            if self.closed.load(Ordering::SeqCst) {
                break;
            }
            let Ok(stream) = stream else { continue };
            let Ok(source) = stream.peer_addr().map(|a| crate::unproven::source(a.ip())) else {
                continue;
            };
            // Authenticated links are bounded per source too: an insider cannot multiply the
            // per-link bounds (outbox, waiting registrations, threads) by opening links. (Checked
            // first: a connection closed for it takes no one's pre-auth slot; and again once it
            // has authenticated, when it takes its place.)
            if self.links_from(source) >= MAX_LINKS_PER_SOURCE {
                self.shared.metrics.handshake_refused(Reason::Busy);
                tracing::warn!(engine = %self.reg.engine, %source, "a source holds {MAX_LINKS_PER_SOURCE} links to this engine already; closed another");
                drop(stream);
                continue;
            }
            // The pre-auth budget: a connection over it is closed before a byte is read or a
            // thread started, so a flood costs a bounded number of threads and buffers; when it
            // is full, a source holding fewer takes the place of the biggest one's oldest.
            let slot = match self.shared.unauthenticated.admit(source, &stream) {
                Ok((slot, evicted)) => {
                    if evicted {
                        self.shared.metrics.handshake_refused(Reason::Busy);
                    }
                    slot
                }
                Err(_) => {
                    self.shared.metrics.handshake_refused(Reason::Busy);
                    drop(stream);
                    continue;
                }
            };
            let e = self.clone();
            if let Err(err) = super::spawn("side-channel", move || e.serve_decode(stream, source, slot)) {
                // The connection (and its place) went with the closure.
                self.shared.metrics.handshake_refused(Reason::Busy);
                tracing::warn!(engine = %self.reg.engine, error = %err, "no thread for a decode agent's connection; closed it");
            }
        }
    }

    /// Links to this engine from `source` whose reader still runs, and its connections that
    /// have authenticated and are still in their handshake.
    fn links_from(&self, source: std::net::IpAddr) -> usize {
        Self::links_from_locked(&self.accepted, &lock(&self.shaking), source)
    }

    /// [`Engine::links_from`], `shaking` locked (lock order: `shaking`, then `accepted`).
    fn links_from_locked(
        accepted: &Mutex<Vec<std::sync::Weak<Link>>>,
        shaking: &HashMap<std::net::IpAddr, usize>,
        source: std::net::IpAddr,
    ) -> usize {
        let mut accepted = lock(accepted);
        accepted.retain(|l| l.strong_count() > 0);
        let links = accepted
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .filter(|l| {
                l.alive.load(Ordering::SeqCst)
                    && l.addr
                        .parse::<SocketAddr>()
                        .is_ok_and(|a| crate::unproven::source(a.ip()) == source)
            })
            .count();
        links + shaking.get(&source).copied().unwrap_or(0)
    }

    /// A place among `source`'s links for a connection that has just authenticated, held
    /// through its handshake until its link is among the accepted ones; `None` when the source
    /// holds [`MAX_LINKS_PER_SOURCE`] already. Without it, a connection counted only once its
    /// handshake was done: an insider could authenticate any number of connections, each with
    /// a thread and a handshake frame of up to 4 MiB, until its deadline.
    fn shaking_place(&self, source: std::net::IpAddr) -> Option<Shaking<'_>> {
        let mut shaking = lock(&self.shaking);
        if Self::links_from_locked(&self.accepted, &shaking, source) >= MAX_LINKS_PER_SOURCE {
            return None;
        }
        *shaking.entry(source).or_default() += 1;
        Some(Shaking { engine: self, source })
    }

    fn serve_decode(self: Arc<Self>, stream: TcpStream, source: std::net::IpAddr, slot: crate::unproven::Slot) {
        let peer_addr = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let _ = stream.set_nodelay(true);
        let key = self.key.clone();
        let pdpair = self.reg.pdpair.clone();
        // One deadline for authentication and handshake together: a peer that trickles bytes
        // runs out of time however it paces them.
        let mut timed = wire::Deadline::new(&stream, self.handshake_timeout());
        let handshake_until = timed.until();
        // Proven: no longer counted against the pre-auth budget (given back before `AuthOk`),
        // but as one of its source's links, if it has room for one more, and against the
        // agent's budget of connections in their handshake, which is shared as the pre-auth
        // one is (a thread each, until the deadline: without it, an insider holding many
        // addresses could hold 128 such threads per address).
        let mut slot = Some(slot);
        let mut place = None;
        let mut shaking_slot = None;
        let proven = || {
            drop(slot.take());
            place = self.shaking_place(source);
            if place.is_some() {
                match self.shared.handshaking.admit(source, &stream) {
                    Ok((taken, evicted)) => {
                        if evicted {
                            self.shared.metrics.handshake_refused(Reason::Busy);
                        }
                        shaking_slot = Some(taken);
                    }
                    Err(_) => place = None,
                }
            }
            place.is_some()
        };
        let shaken = protocol::authenticate_prefill_then(&mut timed, |p| (p == pdpair).then(|| key.clone()), proven)
            .and_then(|(_, mut session)| {
                // Pull: this decode reads our blocks, through our stream where we run one;
                // admitted before our handshake names the stream.
                let admission = match self.settings.mode {
                    pdpair_api::TransferMode::Pull => Some(
                        self.transport()
                            .admit(&session.stream_key, &self.regions(), Access::Read)
                            .map_err(|e| HandshakeError::Rejected {
                                reasons: vec![Reason::TransportFailed],
                                message: e,
                            })?,
                    ),
                    pdpair_api::TransferMode::Push => None,
                };
                // In push we connect to decode's worker: its address is probed before we answer.
                let push = self.settings.mode == pdpair_api::TransferMode::Push;
                let vet = |peer: &PeerInfo| {
                    (push && peer.memory.kind == crate::protocol::MemoryKind::Host)
                        .then(|| self.transport().vet_address(&peer.worker_address).err())
                        .flatten()
                        .map(|e| (vec![Reason::TransportFailed], e))
                };
                // D's handshake frame, up to 4 MiB, is charged to the pair's budget for frames
                // being read before its body is read, as a link's frames are (over it, of the
                // connections holding the most, the one longest without a frame read whole is
                // closed), and stays charged until the link is made: what it decodes to is held
                // that long (through the probe and the connection to D's memory).
                let shut = stream.try_clone().map_err(wire::FrameError::from)?;
                let inbox = self.inboxes.queue(shut, peer_addr.clone());
                let admit = super::inbox_admit(&self.inboxes, &inbox);
                protocol::handshake_prefill_vetted(&mut timed, &mut session, &self.local, vet, admit)
                    .map(|(peer, charged)| (peer, session, admission, charged))
            });
        let (peer, mut session, admission, charged) = match shaken {
            Ok(done) => done,
            // Shut down to make room: counted `Busy` then.
            Err(_) if slot.as_ref().is_some_and(crate::unproven::Slot::evicted) => return,
            Err(_) if shaking_slot.as_ref().is_some_and(crate::unproven::Slot::evicted) => return,
            // Authenticated, with no place among its source's links or in the agent's budget
            // of connections in their handshake.
            Err(_) if slot.is_none() && place.is_none() => {
                self.shared.metrics.handshake_refused(Reason::Busy);
                tracing::warn!(engine = %self.reg.engine, %source, "a source holds {MAX_LINKS_PER_SOURCE} links to this engine, or the agent as many connections in their handshake as it takes; closed another after it authenticated");
                return;
            }
            Err(err) => {
                for r in err.reasons() {
                    self.shared.metrics.handshake_refused(r);
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
        let push = self.settings.mode == pdpair_api::TransferMode::Push;
        let mut stream = stream;
        if (push && peer.memory.block_len != expected_block_len)
            || peer.memory.layers.len() != self.layout.layers as usize
        {
            let _ = session.send(
                &mut stream,
                &Message::Reject {
                    reasons: vec![Reason::MemoryLayoutMismatch],
                    message: "block length or layer count differs".into(),
                },
            );
            return;
        }
        // In pull mode decode reads from us: no endpoint of ours writes to it.
        let connected = if push {
            self.connect_to_memory(&peer, &session.stream_key, handshake_until)
                .map(Some)
        } else {
            Ok(None)
        };
        let ucx_peer = match connected {
            Ok(id) => id,
            Err(e) => {
                tracing::info!(engine = %self.reg.engine, peer = %peer_addr, error = %e, "cannot connect to a decode agent's memory");
                let _ = session.send(
                    &mut stream,
                    &Message::Reject {
                        reasons: vec![Reason::TransportFailed],
                        message: e,
                    },
                );
                return;
            }
        };
        self.shared.metrics.handshake_accepted();
        lock(&self.stats).counters.handshakes_accepted += 1;
        let Ok(mut reader) = stream.try_clone() else {
            if let Some(id) = ucx_peer {
                self.transport().disconnect(id);
            }
            return;
        };
        // Decode pings at least every MAX_HEARTBEAT: a decode agent silent much longer is gone.
        let _ = stream.set_read_timeout(Some(PREFILL_SILENCE_LIMIT));
        let _ = stream.set_write_timeout(Some(PREFILL_SILENCE_LIMIT));
        let Session { sealer, mut opener, .. } = session;
        // The handshake is done with: from here the link's own reader charges what it reads.
        drop(charged);
        let Ok(link) = Link::new(
            (&self.outboxes, &self.inboxes),
            stream,
            sealer,
            admission,
            peer,
            ucx_peer,
            peer_addr,
            heads,
        ) else {
            if let Some(id) = ucx_peer {
                self.transport().disconnect(id);
            }
            return;
        };
        let link = Arc::new(link);
        {
            // Lock order: `shaking`, then `accepted` ([`Engine::links_from`]).
            let mut shaking = lock(&self.shaking);
            let mut accepted = lock(&self.accepted);
            accepted.retain(|l| l.strong_count() > 0);
            let live: Vec<Arc<Link>> = accepted
                .iter()
                .filter_map(std::sync::Weak::upgrade)
                .filter(|l| l.alive.load(Ordering::SeqCst))
                .collect();
            if live.len() >= MAX_LINKS_PER_ENGINE {
                // A link being served (pull: its peer reads lent blocks, and asks nothing until
                // it has; push: being pushed to) is in use however long ago its peer last asked:
                // the least recently used of the others goes first. (Lock order: `accepted`,
                // then `matching`; nothing takes them the other way round.)
                let serving: std::collections::HashSet<u64> = lock(&self.matching)
                    .ready
                    .values()
                    .flat_map(|s| s.links.iter().copied())
                    .collect();
                if let Some(idle) = live
                    .iter()
                    .min_by_key(|l| (serving.contains(&l.id), l.used.load(Ordering::SeqCst)))
                {
                    tracing::warn!(engine = %self.reg.engine, peer = %idle.addr, "this engine holds {MAX_LINKS_PER_ENGINE} links; closed the one whose peer asked least recently for anything, of those not being served");
                    idle.close();
                }
            }
            accepted.push(Arc::downgrade(&link));
            if let Some(place) = place.take() {
                place.into_link(&mut shaking);
            }
        }
        // Out of its handshake (the agent's budget of connections in theirs).
        drop(shaking_slot);
        // Checked after the push: a shutdown that ran before it did not see this link.
        if self.closed.load(Ordering::SeqCst) {
            link.close();
        }
        loop {
            match link.read(&mut reader, &mut opener) {
                // An id no engine of ours could have sent is kept nowhere (and not echoed back).
                Ok(
                    Message::Register(Registration { ref request, .. })
                    | Message::Released { ref request, .. }
                    | Message::Release { ref request, .. }
                    | Message::Renew { ref request, .. },
                ) if crate::engine_api::check_request_id(request).is_err() => {
                    self.shared.metrics.foreign_answer();
                    tracing::warn!(engine = %self.reg.engine, peer = %link.addr, bytes = request.len(), "ignored a message whose request id is too long");
                }
                Ok(Message::Ping { seq }) => {
                    link.send(&Message::Pong { seq });
                }
                Ok(m) => {
                    // Asked something: this link is in use (a full engine keeps it). Not for a
                    // renewal or a read's end of nothing this engine holds for it: an insider's
                    // links kept fresh that way would make honest ones give way first.
                    let used = match m {
                        Message::Register(reg) => self.registration(&link, reg),
                        Message::Released { request, bytes } => self.released(&link, request, bytes),
                        Message::Release { request, prompt, token } => {
                            self.decode_released(&link, request, prompt, token)
                        }
                        Message::Renew { request, prompt } => self.renewed(&request, prompt),
                        _ => false,
                    };
                    if used {
                        link.used.store(crate::outboxes::now(), Ordering::SeqCst);
                    }
                }
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
            waiting.retain(|(l, ..)| !Arc::ptr_eq(l, &link));
            !waiting.is_empty()
        });
        if let Some(id) = ucx_peer {
            self.transport().disconnect(id);
        }
    }

    /// Pull: a decode rank has read a request's blocks; once every decode rank has, the prefill
    /// engine may reuse them.
    fn released(&self, link: &Link, request: String, bytes: u64) -> bool {
        // Only a link the blocks were lent to releases them, once: another decode agent of the
        // pair cannot end a request it was not served. Only in pull: in push the link is being
        // pushed to, and its Released would end the request under a running push.
        let pull = self.settings.mode == pdpair_api::TransferMode::Pull;
        let lent = pull
            && lock(&self.matching).ready.get_mut(&request).is_some_and(|s| {
                match s.links.iter().position(|id| *id == link.id) {
                    Some(i) if s.in_flight > 0 => {
                        s.links.swap_remove(i);
                        true
                    }
                    _ => false,
                }
            });
        if !lent {
            self.shared.metrics.foreign_answer();
            tracing::warn!(engine = %self.reg.engine, peer = %link.addr, "ignored a Released for a request not lent on this link");
        }
        if lent {
            // This decode rank read them: nothing more of them is read through this link.
            link.close_window(&request);
            self.shared.metrics.transfer_done(Role::Prefill, bytes);
            self.transferred(bytes, [link.addr.as_str()]);
            self.finish(request, Ok((bytes, 0)));
        }
        lent
    }

    /// Starts serving a ready request to one registration: counts it in flight and says how
    /// many decode ranks to expect (the first time). `None` when the request is not ready;
    /// `Some(Err)` when as many decode ranks as expected are served or being served (another
    /// decode given the same request id: serving it too would let the first to end conclude
    /// the request, and free its blocks, while the other still reads them).
    ///
    /// A registration that is not the request's (another prompt, token count or range) is
    /// refused here, before it counts for anything: only its link hears it, and the request
    /// stays ready for the decode it belongs to (which may be behind the same link: a request a
    /// client paired wrongly and the right one can reach one decode engine). So whoever holds a
    /// request id can neither take its KV for another prompt, nor take the place of the decode
    /// it belongs to, nor end it for the engine.
    fn begin(&self, matching: &mut Matching, link: &Arc<Link>, reg: Registration) -> Option<Begun> {
        let serving = matching.ready.get_mut(&reg.request)?;
        let pairs = match self.fits(&reg, &serving.ready) {
            Ok(pairs) => pairs,
            Err(refusal) => {
                let (n, ..) = serving.refused.get_or_insert_with(|| (0, refusal.0, refusal.1.clone()));
                *n = n.saturating_add(1);
                return Some(Err(refusal));
            }
        };
        let expected = *serving.expected.get_or_insert_with(|| self.decode_ranks(link));
        let why = if serving.cancelled {
            Some("was cancelled by the prefill engine".to_owned())
        } else if serving.released_by.contains(&link.id) {
            Some("was released by this link".to_owned())
        } else if serving.failed_on.contains(&link.id) {
            Some("failed on this link already".to_owned())
        } else if serving.finished.saturating_add(serving.in_flight) >= expected {
            Some(format!(
                "is served to as many decode ranks as expected ({expected}) already"
            ))
        } else {
            None
        };
        if let Some(why) = why {
            return Some(Err((Reason::InvalidRequest, format!("request {} {why}", reg.request))));
        }
        serving.in_flight += 1;
        serving.links.push(link.id);
        if self.settings.mode == pdpair_api::TransferMode::Pull {
            serving.lent_since = Some(Instant::now());
        }
        Some(Ok((link.clone(), reg, serving.ready.clone(), pairs)))
    }

    /// Whether a registration is the ready request's: the same prompt (checked first, before
    /// anything of the request is said), the same token count, and (push) blocks that pair
    /// with prefill's, which it returns (none in pull: decode pairs them as it reads).
    fn fits(&self, reg: &Registration, ready: &Ready) -> Result<Pairs, (Reason, String)> {
        let request = &reg.request;
        check_prompt(reg.prompt.as_ref(), ready.prompt.as_ref())
            .map_err(|why| (Reason::PromptMismatch, format!("request {request}: {why}")))?;
        if reg.num_tokens != ready.num_tokens {
            return Err((
                Reason::TokenCountMismatch,
                format!(
                    "decode expects {} tokens, prefill computed {}",
                    reg.num_tokens, ready.num_tokens
                ),
            ));
        }
        match self.settings.mode {
            pdpair_api::TransferMode::Push => {
                pair_blocks(self.layout.block_size, ready, reg).map_err(|e| (Reason::TokenRangeNotCovered, e))
            }
            pdpair_api::TransferMode::Pull => Ok(Vec::new()),
        }
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
                    // A peer's numbers (pull: decode says what it read): saturating.
                    serving.bytes = serving.bytes.saturating_add(bytes);
                    serving.transfer_us = serving.transfer_us.saturating_add(us);
                }
                Err(failure) => {
                    serving.failure.get_or_insert(failure);
                }
            }
            if serving.concluded(serving.expected.unwrap_or(1)) {
                self.take_ready(&mut matching, &request)
            } else {
                None
            }
        };
        if let Some(serving) = concluded {
            self.conclude(request, serving);
        }
    }

    /// Prefill's engine gives up `request`: its blocks are free once no transfer reads them (at
    /// once when none runs), and the engine hears `Cancelled` then; later registrations of it
    /// are refused at once.
    pub(super) fn cancel_prefill(&self, request: String) {
        let concluded = {
            let mut matching = lock(&self.matching);
            match matching.ready.get_mut(&request) {
                Some(serving) if serving.cancelled => return,
                Some(serving) if serving.in_flight > 0 => {
                    serving.cancelled = true;
                    None
                }
                Some(_) => self.take_ready(&mut matching, &request).map(|mut s| {
                    s.cancelled = true;
                    s
                }),
                None => {
                    matching.gone.insert(request.clone());
                    drop(matching);
                    return self.event(AgentEvent::Cancelled { request });
                }
            }
        };
        if let Some(serving) = concluded {
            self.conclude(request, serving);
        }
    }

    /// A decode rank needs nothing of `request`: it counts as served, with nothing moved; when
    /// every expected rank is done the engine hears `Released` (all released) or `RequestDone`.
    /// Before the KvReady, the release is kept and applied when it comes.
    ///
    /// A decode agent also sends it to cancel (its engine aborted the request): a registration
    /// of this link still waiting for the KvReady is dropped, so nothing will be written; a
    /// push to this link that is running is left to end, and its `Complete` or `Failed` is the
    /// answer; blocks lent to this link (pull) count as released.
    ///
    /// A release whose prompt digest is not the request's counts for nothing (a decode given
    /// the request id with another prompt, winding down the registration prefill refused it):
    /// it only withdraws that link's own waiting registration.
    /// Whether the release was of something this engine holds for the link: a ready request of
    /// its prompt, or a registration the link has waiting (not a release kept for a request not
    /// ready, which anyone may send of any id).
    fn decode_released(
        &self,
        link: &Link,
        request: String,
        prompt: Option<PromptDigest>,
        token: Option<ReleaseToken>,
    ) -> bool {
        let real = {
            let matching = lock(&self.matching);
            matching
                .ready
                .get(&request)
                .is_some_and(|s| s.ready.released_by(prompt.as_ref(), token.as_ref()))
                || matching
                    .registered
                    .get(&request)
                    .is_some_and(|w| w.iter().any(|(l, ..)| l.id == link.id))
        };
        self.release_for(link, request, prompt, token);
        real
    }

    fn release_for(&self, link: &Link, request: String, prompt: Option<PromptDigest>, token: Option<ReleaseToken>) {
        let expected = self.decode_ranks(link);
        let concluded = {
            let mut matching = lock(&self.matching);
            let gone = matching.gone.contains_key(&request);
            if let Some(waiting) = matching.registered.get_mut(&request) {
                waiting.retain(|(l, ..)| l.id != link.id);
                if waiting.is_empty() {
                    matching.registered.remove(&request);
                }
            }
            let pull = self.settings.mode == pdpair_api::TransferMode::Pull;
            let served_here = matching
                .ready
                .get(&request)
                .and_then(|s| s.links.iter().position(|id| *id == link.id));
            match (matching.ready.get_mut(&request), served_here) {
                // Pushing to this link right now: the transfer's end answers.
                (Some(_), Some(_)) if !pull => return,
                (Some(serving), _) if !serving.ready.released_by(prompt.as_ref(), token.as_ref()) => None,
                (Some(serving), lent) => {
                    // Pull, lent to this link: decode will not read them.
                    if let Some(i) = lent {
                        link.close_window(&request);
                        serving.links.swap_remove(i);
                        serving.in_flight = serving.in_flight.saturating_sub(1);
                    }
                    let expected = *serving.expected.get_or_insert(expected);
                    // A decode rank that needed nothing takes one of the expected ranks' places:
                    // once per link, and only a place no transfer holds (another link of the
                    // pair cannot end a request under a running transfer, nor count twice).
                    let counted =
                        serving.released_by.contains(&link.id) || serving.finished + serving.in_flight >= expected;
                    if !counted {
                        serving.released_by.push(link.id);
                        serving.finished += 1;
                    }
                    if serving.concluded(expected) {
                        self.take_ready(&mut matching, &request)
                    } else {
                        None
                    }
                }
                (None, _) if gone => None,
                (None, _) => {
                    let (of_prompt, again) = matching.released_early.get(&request).map_or((0, false), |(e, _)| {
                        let mine = |(_, _, (p, _), _): &&EarlyRelease| *p == prompt;
                        (
                            e.iter().filter(mine).count(),
                            e.iter().filter(mine).any(|(id, ..)| *id == link.id),
                        )
                    });
                    if !again && of_prompt < expected as usize {
                        // Counted with the link's waiting registrations: kept for a lease.
                        matching.make_room(&link.waiting, 0);
                        let engine_waiting = matching.waiting.clone();
                        let early = matching
                            .released_early
                            .entry(request.clone())
                            .or_insert((Vec::new(), Instant::now()));
                        match Held::take(link, &engine_waiting, 0) {
                            Ok(held) => early.0.push((link.id, held, (prompt, token), expected)),
                            Err((reason, why)) => {
                                if early.0.is_empty() {
                                    matching.released_early.remove(&request);
                                }
                                drop(matching);
                                link.send(&Message::Failed {
                                    request,
                                    reason,
                                    message: format!("a release before the KvReady is not kept: {why}"),
                                });
                                return;
                            }
                        }
                    }
                    None
                }
            }
        };
        link.send(&Message::ReleaseDone {
            request: request.clone(),
        });
        if let Some(serving) = concluded {
            self.conclude(request, serving);
        }
    }

    /// How many decode ranks take KV from this prefill rank, as `link`'s peer sees it (once per
    /// link).
    fn decode_ranks(&self, link: &Link) -> u32 {
        *link
            .decode_ranks
            .get_or_init(|| protocol::decode_ranks_served(&self.local, &link.peer))
    }

    /// A decode agent renews its hold on a ready request (its engine queues it): the lease starts
    /// again, up to [`MAX_HOLD_LEASES`] leases after the KvReady in all, so no peer can pin a
    /// pool's blocks forever. A renewal of another prompt (a decode given the request id with
    /// its own prompt, queued) holds nothing. Whether it renewed the request.
    fn renewed(&self, request: &str, prompt: Option<PromptDigest>) -> bool {
        let lease = self.lease();
        if let Some(s) = lock(&self.matching).ready.get_mut(request)
            && s.in_flight == 0
            && check_prompt(prompt.as_ref(), s.ready.prompt.as_ref()).is_ok()
            && s.ready.since.elapsed() < lease * MAX_HOLD_LEASES
        {
            s.renewed = Some(Instant::now());
            return true;
        }
        false
    }

    /// Takes concluded `request` out of `ready` (`matching` held), its windows closed first: a
    /// new request of the name is refused while it is there, so none it opens is closed by this
    /// one's answer ([`Engine::conclude`], after the lock is gone).
    fn take_ready(&self, matching: &mut Matching, request: &str) -> Option<Serving> {
        self.close_windows(request);
        matching.ready.remove(request)
    }

    /// Tells the engine how a request every expected decode rank is done with ended; its
    /// windows were closed ([`Engine::take_ready`], or it never was ready).
    fn conclude(&self, request: String, serving: Serving) {
        if serving.cancelled {
            lock(&self.matching).gone.insert(request.clone());
            return self.answer(&AgentEvent::Cancelled { request });
        }
        if serving.failure.is_none() && serving.released_by.len() == serving.finished as usize {
            lock(&self.matching).gone.insert(request.clone());
            return self.answer(&AgentEvent::Released { request });
        }
        match serving.failure {
            Some((reasons, message)) => self.fail_quietly(request, reasons, message),
            None => self.answer(&AgentEvent::RequestDone {
                request,
                bytes: serving.bytes,
                checksum: None,
                transfer_us: (self.settings.mode == pdpair_api::TransferMode::Push).then_some(serving.transfer_us),
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

    /// Whether it was taken (served, or waiting for the KvReady): a refused one is not the
    /// link's use.
    fn registration(self: &Arc<Self>, link: &Arc<Link>, reg: Registration) -> bool {
        let id = reg.request.clone();
        let refuse_for = |reason: Reason, message: String| {
            link.send(&Message::Failed {
                request: id.clone(),
                reason,
                message,
            });
        };
        let refuse = |message: String| refuse_for(Reason::InvalidRequest, message);
        if let Err(e) = self
            .check_remote_blocks(link, &reg.blocks)
            .and_then(|()| crate::agent::check_tokens(reg.first_token, reg.num_tokens))
        {
            refuse(e);
            return false;
        }
        let mut matching = lock(&self.matching);
        let twice = matching
            .ready
            .get(&reg.request)
            .is_some_and(|s| s.links.contains(&link.id))
            || matching
                .registered
                .get(&reg.request)
                .is_some_and(|w| w.iter().any(|(l, ..)| l.id == link.id));
        let refusal = if matching.gone.contains_key(&reg.request) {
            Some(format!(
                "request {} was released: prefill's blocks are free",
                reg.request
            ))
        } else if twice {
            // The first registration keeps its promise; this one is refused on its own.
            Some(format!("request {} is already registered on this link", reg.request))
        } else {
            None
        };
        if let Some(message) = refusal {
            drop(matching);
            refuse(message);
            return false;
        }
        if matching.ready.contains_key(&reg.request) {
            let consumer = self.begin(&mut matching, link, reg);
            drop(matching);
            match consumer {
                Some(Ok(consumer)) => {
                    self.spawn_transfer(consumer);
                    true
                }
                Some(Err((reason, why))) => {
                    refuse_for(reason, why);
                    false
                }
                None => false,
            }
        } else {
            // Under the matching lock: the check and the count are one step.
            matching.make_room(&link.waiting, reg.blocks.len());
            match Held::take(link, &matching.waiting, reg.blocks.len()) {
                Ok(held) => {
                    matching.registered.entry(reg.request.clone()).or_default().push((
                        link.clone(),
                        reg,
                        Instant::now(),
                        held,
                    ));
                    true
                }
                Err((reason, why)) => {
                    drop(matching);
                    refuse_for(reason, why);
                    false
                }
            }
        }
    }

    fn check_remote_blocks(&self, link: &Link, blocks: &[u32]) -> Result<(), String> {
        crate::agent::check_blocks(blocks, link.peer.memory.num_blocks).map_err(|e| format!("decode's {e}"))
    }

    pub(super) fn kv_ready(self: &Arc<Self>, request: String, want: Want) {
        let Want {
            blocks,
            num_tokens,
            first_token,
            prompt,
            event,
            release_token,
        } = want;
        if !self.accept_request(Role::Prefill, "KvReady", &request, &blocks, (first_token, num_tokens)) {
            return;
        }
        if let Err(why) = self.check_event("KvReady", event) {
            return self.refuse(request, vec![Reason::InvalidRequest], why);
        }
        let ready = Ready {
            blocks,
            num_tokens,
            first_token,
            prompt,
            since: Instant::now(),
            event,
            release_token,
        };
        let consumers: Vec<(Arc<Link>, Begun)> = {
            let mut matching = lock(&self.matching);
            if matching.ready.contains_key(&request) {
                drop(matching);
                return self.refuse(
                    request.clone(),
                    vec![Reason::InvalidRequest],
                    format!("request {request} is already ready (KvReady twice); the first stands"),
                );
            }
            let held = matching.ready.values().map(|s| s.ready.blocks.len()).sum();
            if let Err(why) = super::live_room(matching.ready.len(), held, ready.blocks.len()) {
                drop(matching);
                return self.refuse(request, vec![Reason::Busy], why);
            }
            let mut serving = Serving::new(ready);
            if let Some((early, _)) = matching.released_early.remove(&request) {
                let ours = early_counted(early, &serving.ready);
                if let Some((_, _, _, expected)) = ours.first() {
                    serving.expected = Some(*expected);
                }
                serving.released_by = ours.into_iter().map(|(id, ..)| id).collect();
                serving.finished = u32::try_from(serving.released_by.len()).unwrap_or(u32::MAX);
            }
            if serving.expected.is_some_and(|e| serving.finished >= e) {
                // Every decode rank released it before it was ready: free at once.
                drop(matching);
                return self.conclude(request, serving);
            }
            matching.ready.insert(request.clone(), serving);
            let waiting = matching.registered.remove(&request).unwrap_or_default();
            waiting
                .into_iter()
                .filter_map(|(link, reg, ..)| Some((link.clone(), self.begin(&mut matching, &link, reg)?)))
                .collect()
        };
        for (link, consumer) in consumers {
            match consumer {
                Ok(consumer) => self.spawn_transfer(consumer),
                Err((reason, message)) => {
                    link.send(&Message::Failed {
                        request: request.clone(),
                        reason,
                        message,
                    });
                }
            }
        }
    }

    fn spawn_transfer(self: &Arc<Self>, (link, reg, ready, pairs): Consumer) {
        let (e, l, request) = (self.clone(), link.clone(), reg.request.clone());
        if let Err(err) = super::spawn("transfer", move || e.transfer(&l, reg, ready, pairs)) {
            // Nothing was written: failed as a transfer that could not start.
            let message = format!("no thread for the transfer: {err}");
            link.send(&Message::Failed {
                request: request.clone(),
                reason: Reason::TransportFailed,
                message: message.clone(),
            });
            self.consumer_failed(&link, request, Err((vec![Reason::TransportFailed], message)));
        }
    }

    /// A consumer on `link` failed before it was served: it is served no more (a later
    /// `Released` or `Release` of it counts for nothing; with its link still among the
    /// request's, it took another decode rank's place, ending the request under that rank's
    /// read), then counted as finished, unless its link's `Release` or `Released` counted it
    /// meanwhile (counted twice, it ended the request under another rank's read too).
    fn consumer_failed(&self, link: &Link, request: String, outcome: Served) {
        let serving_it = lock(&self.matching).ready.get_mut(&request).is_some_and(|serving| {
            match serving.links.iter().position(|id| *id == link.id) {
                Some(i) => {
                    serving.links.swap_remove(i);
                    serving.failed_on.push(link.id);
                    true
                }
                None => false,
            }
        });
        link.close_window(&request);
        if serving_it {
            self.finish(request, outcome);
        }
    }

    /// Pull: tell decode where the request's KV is (with our checksums) and hold the blocks until
    /// it has read them or the lease ends.
    fn lend(&self, link: &Link, reg: Registration, ready: Ready) {
        // A GPU pool's blocks are checksummed and lent once the engine's writes are done (a
        // decode agent reading them over the stream cannot wait for the engine's event itself).
        if let Err(e) = self.written(&ready) {
            // Decode hears it now, not at its deadline.
            link.send(&Message::Failed {
                request: reg.request.clone(),
                reason: Reason::TransferTimeout,
                message: e.clone(),
            });
            return self.consumer_failed(link, reg.request, Err((vec![Reason::TransferTimeout], e)));
        }
        let live = self.live_blocks(&ready.blocks, ready.first_token, ready.num_tokens);
        let sums = self.head_sums(link, ready.first_token, ready.num_tokens, live.iter().copied());
        self.started(&reg.request);
        // The link may read these blocks now (the stream refuses others), until it releases
        // them or the request ends for the engine; unless it ended while the checksums (or the
        // engine's GPU event) were awaited: checked, and opened, under the matching lock, so a
        // window never opens after the request's end closed its windows.
        {
            let matching = lock(&self.matching);
            if !matching
                .ready
                .get(&reg.request)
                .is_some_and(|s| s.links.contains(&link.id))
            {
                return;
            }
            self.open_window(link, &reg.request, &ready.blocks);
        }
        let sent = link.send(&Message::Ready {
            request: reg.request.clone(),
            blocks: ready.blocks,
            first_token: ready.first_token,
            num_tokens: ready.num_tokens,
            sums,
        });
        if !sent {
            self.consumer_failed(
                link,
                reg.request,
                Err((vec![Reason::PeerLost], "decode went away before reading".into())),
            );
        }
    }

    /// Waits, until a lease from now, for the engine's writes of a ready request in a GPU pool
    /// (the event its KvReady named, or the pool's one event); host pools are written before
    /// the KvReady.
    fn written(&self, ready: &Ready) -> Result<(), String> {
        match &self.device {
            Some(device) => device.wait_written(ready.event, Instant::now() + self.lease()),
            None => Ok(()),
        }
    }

    /// The checksums (unless Disabled) of our blocks `(block, first token)`, over just the heads
    /// `link`'s decode rank takes: checksums add over heads, so a decode rank gathering from
    /// several prefill ranks compares their sum with its whole blocks.
    fn head_sums(
        &self,
        link: &Link,
        first_token: u64,
        num_tokens: u64,
        blocks: impl Iterator<Item = (u32, u64)>,
    ) -> Option<BlockSums> {
        if self.settings.checksum == ChecksumPolicy::Disabled {
            return None;
        }
        // A block whose checksum cannot be computed sends none at all: decode counts the
        // request Unverified (never a sum of 0 that would match decode's 0).
        let blocks: Vec<(u32, u64)> = blocks.collect();
        let sums = self.sums_of(&blocks, num_tokens, link.heads.p_first, link.heads.count)?;
        Some(BlockSums {
            block_size: self.layout.block_size,
            first_token,
            sums,
        })
    }

    fn transfer(&self, link: &Link, reg: Registration, ready: Ready, pairs: Pairs) {
        let request = reg.request.clone();
        let refuse = |reason: Reason, message: String| {
            link.send(&Message::Failed {
                request: request.clone(),
                reason,
                message: message.clone(),
            });
            self.finish(request.clone(), Err((vec![reason], message)));
        };
        // The registration fits the request, and (push) its blocks are paired (`Engine::fits`,
        // checked in `begin`).
        if self.settings.mode == pdpair_api::TransferMode::Pull {
            return self.lend(link, reg, ready);
        }
        let Some(ucx_peer) = link.ucx_peer else {
            return refuse(Reason::TransportFailed, "no UCX endpoint".into());
        };
        // A GPU pool's blocks are read (checksummed, written out) once the engine's writes
        // are done.
        if let Err(e) = self.written(&ready) {
            return refuse(Reason::TransferTimeout, e);
        }
        let plan = match self.put_plan(&link.peer.memory, &pairs, link.heads) {
            Ok(plan) => plan,
            Err(message) => return refuse(Reason::MemoryLayoutMismatch, message),
        };
        self.started(&request);
        // The checksums read the same (ready, unchanging) blocks the WRITEs read: compute them
        // while the WRITEs are in flight; they go in `Complete`, after the flush.
        let started = Instant::now();
        let head_sums = || {
            self.head_sums(
                link,
                reg.first_token,
                ready.num_tokens,
                pairs.iter().map(|(p, _, t)| (*p, *t)),
            )
        };
        let (sums, put) = thread::scope(|scope| {
            let sums = thread::Builder::new()
                .name("sums".into())
                .spawn_scoped(scope, head_sums);
            let put = in_batches(plan.ops(), started + self.lease(), |ops, within, first| {
                self.transport().put(
                    ucx_peer,
                    self.regions(),
                    ops,
                    first && self.shared.cfg.corrupt_one_byte,
                    within,
                )
            });
            // A checksum thread that panicked sends no sums: decode counts the request
            // Unverified (FailClosed fails it). Without a thread they are computed after the
            // WRITEs.
            let sums = match sums {
                Ok(t) => t.join().ok().flatten(),
                Err(_) => head_sums(),
            };
            (sums, put)
        });
        match put {
            Ok(bytes) => {
                let took = started.elapsed();
                self.shared.metrics.transfer_latency(took);
                self.shared.metrics.transfer_done(Role::Prefill, bytes);
                self.moved(link);
                self.transferred(bytes, [link.addr.as_str()]);
                if link.send(&Message::Complete {
                    request: request.clone(),
                    sums,
                    bytes,
                }) {
                    self.finish(request, Ok((bytes, took.as_micros() as u64)));
                } else {
                    self.finish(
                        request,
                        Err((vec![Reason::PeerLost], "decode went away before the completion".into())),
                    );
                }
            }
            Err(e @ OpError::Timeout(_)) => {
                // The WRITEs were cancelled and the endpoint closed; the link goes too (decode
                // sees it lost and reconnects for later requests).
                refuse(Reason::TransferTimeout, format!("writing decode's blocks: {e}"));
                link.close_after_sent();
            }
            Err(e) => refuse(Reason::WriteFailed, format!("the WRITEs failed: {e}")),
        }
    }

    /// The WRITEs for block pairs (P block, D block, first token), as a plan: per layer and
    /// array, each block (or its head range of decode's blocks, HND: head-major inside a block,
    /// so each range is contiguous; or, where one side holds K and V side by side and the other
    /// apart, each head's token), runs of blocks consecutive on both sides merged where both
    /// sides keep a layer's K (or V) blocks back to back (K and V interleaved per block,
    /// FlashInfer, are a put per block). `Err` when decode's description lacks an array of ours
    /// (`places`) or its blocks cannot be pieced (`plan::pieces`).
    fn put_plan(
        &self,
        remote: &MemoryDesc,
        pairs: &[(u32, u32, u64)],
        heads: protocol::HeadMap,
    ) -> Result<Plan, String> {
        let half = self.layout.half_token() as u64;
        let tokens = self.layout.block_size;
        // Push writes blocks of the same tokens (checked at the handshake): decode's heads follow.
        let remote_heads = u32::try_from(remote.block_len / (u64::from(tokens) * half).max(1))
            .map_err(|_| format!("decode's block_len {} is not a block of our tokens", remote.block_len))?;
        let nhd = self.layout.layout == pdpair_api::KvLayout::Nhd;
        let items = pairs
            .iter()
            .map(|(p, d, _)| Item {
                local: *p,
                at: 0,
                remote: *d,
            })
            .collect();
        self.places(
            remote,
            "decode's",
            |ours, theirs, len| {
                let shape = |heads, unit| BlockShape {
                    tokens,
                    heads,
                    nhd,
                    unit,
                };
                pieces(
                    &shape(self.layout.local_heads, ours),
                    heads.p_first,
                    &shape(remote_heads, theirs),
                    heads.d_first,
                    heads.count,
                    tokens,
                    len,
                )
            },
            |_| 0,
            items,
        )
    }

    /// Frees ready KV past its lease and fails registrations that waited past it.
    pub(super) fn expire_ready(&self) {
        let lease = self.lease();
        let pull = self.settings.mode == pdpair_api::TransferMode::Pull;
        // Ready KV nobody is reading or writing now, past its lease; and (pull) blocks lent to a
        // decode rank that did not release them in time.
        let expired: Vec<(String, Serving)> = {
            lock(&self.matching)
                .ready
                .extract_if(|request, s| {
                    let expired = (s.in_flight == 0 && s.renewed.unwrap_or(s.ready.since).elapsed() >= lease)
                        || (pull && s.in_flight > 0 && s.lent_since.is_some_and(|at| at.elapsed() >= lease));
                    if expired {
                        // As [`Engine::take_ready`]: its windows close while its name is held.
                        self.close_windows(request);
                    }
                    expired
                })
                .collect()
        };
        for (request, serving) in expired {
            self.shared.metrics.lease_expired();
            if serving.cancelled {
                // The engine cancelled it and waits for `Cancelled`: the lease ended what held
                // the blocks (a decode rank that never released its loan), so that is the answer.
                self.conclude(request, serving);
                continue;
            }
            let message = if serving.in_flight > 0 {
                "decode did not read the request's blocks within the lease".to_owned()
            } else if let (0, Some((n, reason, first))) = (serving.finished, &serving.refused) {
                format!(
                    "no decode engine's registration was this request's within the lease: {n} refused, the first for {reason}: {first}"
                )
            } else if serving.finished == 0 {
                "no decode engine registered for the request within the lease".to_owned()
            } else {
                format!(
                    "{} of {} decode ranks took the request's KV within the lease",
                    serving.finished,
                    serving.expected.unwrap_or(1)
                )
            };
            self.fail_quietly(request, vec![Reason::LeaseExpired], message);
        }
        {
            let mut matching = lock(&self.matching);
            matching.gone.expire(lease);
            matching.released_early.retain(|_, (_, at)| at.elapsed() < lease);
        }
        let stale: Vec<(Arc<Link>, String)> = {
            let registered = &mut lock(&self.matching).registered;
            let mut stale = Vec::new();
            registered.retain(|id, waiting| {
                waiting.retain(|(link, _, at, _)| {
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
                reason: Reason::LeaseExpired,
                message: "the prefill engine did not finish the request within the lease".into(),
            });
        }
    }
}

/// Pairs D's blocks with P's by absolute token position (never by list length): D block `i`
/// holds tokens from `reg.first_token + i*B`; the P block holding that token must start exactly
/// there. Blocks wholly past the request's tokens are skipped. Returns (P block, D block, first
/// token) for each block to write.
fn pair_blocks(block_size: u32, ready: &Ready, reg: &Registration) -> Result<Pairs, String> {
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

    #[test]
    fn ended_requests_are_remembered_for_a_lease_and_at_most_max_gone_of_them() {
        let mut gone = Gone::default();
        for i in 0..MAX_GONE + 10 {
            gone.insert(format!("r{i}"));
        }
        assert_eq!(gone.len(), MAX_GONE);
        assert!(
            !gone.contains_key("r0") && !gone.contains_key("r9"),
            "the oldest went first"
        );
        assert!(gone.contains_key("r10") && gone.contains_key(&format!("r{}", MAX_GONE + 9)));
        // One ended again is remembered from then (its older entry does not take it away).
        gone.insert("r10".into());
        for i in 0..MAX_GONE - 1 {
            gone.insert(format!("s{i}"));
        }
        assert!(gone.contains_key("r10"), "remembered from its second end");
        gone.expire(Duration::ZERO);
        assert_eq!(gone.len(), 0);
    }

    #[test]
    fn an_engines_live_requests_are_bounded_in_count_and_block_ids() {
        use crate::agent::{MAX_LIVE_BLOCKS, MAX_LIVE_REQUESTS, live_room};
        assert!(live_room(MAX_LIVE_REQUESTS - 1, 0, 1).is_ok());
        let e = live_room(MAX_LIVE_REQUESTS, 0, 1).expect_err("full");
        assert!(e.contains(&format!("holds {MAX_LIVE_REQUESTS} requests")), "{e}");
        assert!(live_room(1, MAX_LIVE_BLOCKS - 5, 5).is_ok());
        let e = live_room(1, MAX_LIVE_BLOCKS - 5, 6).expect_err("blocks");
        assert!(e.contains(&format!("would pass {MAX_LIVE_BLOCKS}")), "{e}");
        assert!(live_room(0, usize::MAX, usize::MAX).is_err(), "no overflow");
    }

    fn ready(first: u64, blocks: Vec<u32>) -> Ready {
        Ready {
            release_token: None,
            blocks,
            num_tokens: 40,
            first_token: first,
            prompt: None,
            since: Instant::now(),
            event: None,
        }
    }

    #[test]
    fn a_kv_ready_names_one_of_the_pools_events_where_it_registered_them_and_none_elsewhere() {
        let check = |event, events| crate::agent::check_event("KvReady", event, events, true);
        assert_eq!(check(None, 0), Ok(()));
        assert_eq!(check(Some(3), 4), Ok(()));
        assert_eq!(check(Some(0), 1), Ok(()));
        let e = check(Some(4), 4).expect_err("past the last");
        assert!(
            e.contains("KvReady.event 4") && e.contains("4 gpu.events (0..=3)"),
            "{e}"
        );
        let e = check(Some(u32::MAX), 64).expect_err("far past");
        assert!(e.contains(&format!("KvReady.event {}", u32::MAX)), "{e}");
        let e = check(Some(0), 0).expect_err("no events");
        assert!(e.contains("KvReady.event 0: this pool registered no gpu.events"), "{e}");
        let e = check(None, 2).expect_err("required");
        assert!(
            e.contains("KvReady.event is missing") && e.contains("2 gpu.events"),
            "{e}"
        );
        // Decode's ExpectKv may name none (the engine waited itself), never one past the last.
        let decode = |event, events| crate::agent::check_event("ExpectKv", event, events, false);
        assert_eq!(decode(None, 2), Ok(()));
        assert_eq!(decode(Some(1), 2), Ok(()));
        assert!(decode(Some(2), 2).is_err_and(|e| e.contains("ExpectKv.event 2")));
        assert!(decode(Some(0), 0).is_err_and(|e| e.contains("ExpectKv.event 0: this pool registered no gpu.events")));
    }

    fn reg(first: u64, blocks: Vec<u32>) -> Registration {
        Registration {
            request: "r".into(),
            blocks,
            num_tokens: 40,
            first_token: first,
            prompt: None,
        }
    }

    /// A registration of `blocks` blocks (counted; its ids are not kept) waiting on `link`.
    fn wait(m: &mut Matching, link: &Arc<Link>, request: &str, blocks: usize) {
        m.make_room(&link.waiting, blocks);
        let held = Held::take(link, &m.waiting, blocks).expect("a place");
        let reg = Registration {
            request: request.into(),
            ..reg(0, Vec::new())
        };
        m.registered
            .entry(request.into())
            .or_default()
            .push((link.clone(), reg, Instant::now(), held));
    }

    /// An early release waiting on `link` (it holds no blocks).
    fn release_early(m: &mut Matching, link: &Arc<Link>, request: &str) {
        m.make_room(&link.waiting, 0);
        let held = Held::take(link, &m.waiting, 0).expect("a place");
        let at = Instant::now();
        m.released_early
            .entry(request.into())
            .or_insert((Vec::new(), at))
            .0
            .push((link.id, held, (None, None), 1));
    }

    fn mute() -> Arc<Link> {
        Arc::new(crate::agent::tests::link_to_a_mute_peer().0)
    }

    #[test]
    fn early_releases_count_by_prompt_or_token_once_per_link() {
        use crate::{engine_api::ReleaseToken, synthetic::prompt};
        let ready = Ready {
            blocks: vec![1],
            num_tokens: 16,
            first_token: 0,
            prompt: Some(prompt(1, 16)),
            since: Instant::now(),
            event: None,
            release_token: Some(ReleaseToken([7; 32])),
        };
        let m = Matching::default();
        let (a, b) = (mute(), mute());
        let early = |link: &Arc<Link>, seed: u64, token: u8| -> EarlyRelease {
            let held = Held::take(link, &m.waiting, 0).expect("a place");
            (
                link.id,
                held,
                (Some(prompt(seed, 16)), Some(ReleaseToken([token; 32]))),
                2,
            )
        };
        let counted = |e: Vec<EarlyRelease>| early_counted(e, &ready).iter().map(|(id, ..)| *id).collect::<Vec<_>>();
        // Its prompt, its token, or both: counted; neither: not.
        assert_eq!(counted(vec![early(&a, 1, 9), early(&b, 2, 7)]), vec![a.id, b.id]);
        assert_eq!(counted(vec![early(&a, 2, 9)]), Vec::<u64>::new());
        // Two of one link (one by its prompt, one by the token) take one place.
        assert_eq!(counted(vec![early(&a, 1, 9), early(&a, 2, 7)]), vec![a.id]);
    }

    #[test]
    fn past_the_engines_blocks_the_heaviest_links_largest_registration_gives_way_not_its_early_releases() {
        // Links filling the engine's blocks, each with early releases (no blocks) as its
        // oldest entries: evicting those freed nothing, and every registration was refused.
        let mut m = Matching::default();
        let insiders: Vec<Arc<Link>> = (0..4).map(|_| mute()).collect();
        for (l, link) in insiders.iter().enumerate() {
            for i in 0..8 {
                release_early(&mut m, link, &format!("e{l}-{i}"));
            }
            for i in 0..4 {
                wait(&mut m, link, &format!("r{l}-{i}"), MAX_WAITING_BLOCKS / 4);
            }
        }
        assert_eq!(m.waiting.1.load(Ordering::SeqCst), ENGINE_WAITING_BLOCKS, "full");
        let decode = mute();
        wait(&mut m, &decode, "real", 1000);
        assert!(m.waiting.1.load(Ordering::SeqCst) <= ENGINE_WAITING_BLOCKS);
        assert_eq!(m.released_early.len(), 32, "no early release went");
        assert_eq!(
            m.registered.values().map(Vec::len).sum::<usize>(),
            16,
            "one of 16 went, for one"
        );
        // A large one takes as many as it needs, heaviest links first.
        wait(&mut m, &mute(), "large", MAX_WAITING_BLOCKS * 5 / 8);
        assert!(m.waiting.1.load(Ordering::SeqCst) <= ENGINE_WAITING_BLOCKS);
        assert_eq!(
            m.registered.values().map(Vec::len).sum::<usize>(),
            15,
            "two more went for it"
        );
    }

    #[test]
    fn past_the_engines_registrations_the_oldest_of_the_heaviest_link_gives_way_and_the_heaviest_is_refused() {
        let mut m = Matching::default();
        let insiders: Vec<Arc<Link>> = (0..4).map(|_| mute()).collect();
        for (l, link) in insiders.iter().enumerate() {
            for i in 0..MAX_WAITING - l {
                wait(&mut m, link, &format!("r{l}-{i}"), 1);
            }
        }
        // Not quite full (the lighter links hold a few less): top it up from the heaviest.
        let newcomer = mute();
        for i in 0..10 {
            wait(&mut m, &newcomer, &format!("new-{i}"), 1);
        }
        assert!(m.waiting.0.load(Ordering::SeqCst) <= ENGINE_WAITING);
        assert!(
            !m.registered.contains_key("r0-0"),
            "the heaviest link's oldest went first"
        );
        assert!(m.registered.contains_key("r3-0"), "a lighter link's stays");
        // A link that would hold the most is refused rather than take another's place.
        m.make_room(&insiders[0].waiting, 1);
        let refused = Held::take(&insiders[0], &m.waiting, 1);
        assert!(matches!(&refused, Err((Reason::Busy, _))), "{refused:?}");
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
