//! The thread that owns the agent's UCX context and worker. Everything UCX happens here (the
//! worker is single-threaded); other threads send [`Command`]s and wait on a reply channel. The
//! loop keeps the worker progressing, which matters: over tcp and shared memory, a peer's WRITE
//! into our memory completes only while our worker progresses.

use std::{
    collections::HashMap,
    sync::mpsc::{self, Receiver, RecvTimeoutError, Sender},
    thread,
    time::{Duration, Instant},
};

use crate::transport::ucx::{Context, Endpoint, MemRegion, RemoteKey, Transport, Worker};

/// One WRITE: `len` bytes from our address `local` to the peer's address `remote`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutOp {
    /// Local address (inside memory this agent mapped).
    pub local: u64,
    /// Bytes.
    pub len: u64,
    /// Remote address (inside the peer's registered region).
    pub remote: u64,
}

type Reply<T> = Sender<Result<T, String>>;

/// Why a put or get did not complete.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// It did not complete by its deadline: cancelled, and the peer's endpoint closed.
    #[error("not complete by its deadline ({0}); cancelled and the peer's endpoint closed")]
    Timeout(String),
    /// It failed (a bad range, an unknown peer or region, a UCX error).
    #[error("{0}")]
    Failed(String),
}

type OpReply = Sender<Result<u64, OpError>>;

/// Memory UCX allocated and registered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocated {
    /// Region id.
    pub region: u64,
    /// Packed rkey.
    pub rkey: Vec<u8>,
    /// Address (valid until the region is unmapped).
    pub addr: u64,
    /// Bytes (at least what was asked).
    pub len: u64,
}

/// Idle this long, the UCX thread waits [`IDLE_WAIT`] between progress calls (a command still
/// wakes it at once).
const IDLE_BACKOFF_AFTER: Duration = Duration::from_secs(1);

/// How long an idle UCX thread waits between progress calls.
const IDLE_WAIT: Duration = Duration::from_millis(5);

/// Empty progress polls in a row before a spinning thread yields its CPU.
pub const QUIET_POLLS_BEFORE_YIELD: u32 = 256;

/// What keeps a registered region's memory mapped (a pool's mapping of its memfd). The UCX
/// thread holds it from `Map` until UCX is done with the region, which can be after `Unmap`
/// (see [`Command::Unmap`]).
pub type Keep = Box<dyn Send>;

/// Requests to the UCX thread.
enum Command {
    /// Register `len` bytes at `addr`, which stay mapped while `keep` lives.
    Map {
        /// Address.
        addr: u64,
        /// Length.
        len: u64,
        /// Keeps `addr..addr+len` mapped; dropped once the region is unregistered and no request
        /// UCX still holds reads or writes it.
        keep: Keep,
        /// (region id, packed rkey).
        reply: Reply<(u64, Vec<u8>)>,
    },
    /// Allocate `len` bytes through UCX and register them (see [`crate::transport::ucx::Context::allocate`]).
    Allocate {
        /// Bytes.
        len: u64,
        /// The region.
        reply: Reply<Allocated>,
    },
    /// Unregister a region (and free it, when UCX allocated it). New operations on it fail at
    /// once; operations in flight on it are cancelled (their peers dropped). Where UCX still
    /// holds requests of a force-closed endpoint that read or write it (see [`Orphan`]), the
    /// registration and the memory (`keep`) live on until UCX completes them.
    Unmap {
        /// Region id.
        region: u64,
        /// Answered once it is gone.
        reply: Reply<()>,
    },
    /// Connect to a peer worker and unpack its keys.
    Connect {
        /// The peer's worker address.
        worker_address: Vec<u8>,
        /// The peer's regions: packed rkey and registered range (address, bytes). Every op's
        /// remote side must lie in one of them.
        remotes: Vec<(Vec<u8>, (u64, u64))>,
        /// Peer id, and per region where the peer's memory is mapped here (when it is).
        reply: Reply<(u64, Vec<Option<u64>>)>,
    },
    /// Post WRITEs to a peer, wait for them, flush; `corrupt` flips one byte of the first op's
    /// data in flight (a fault-injection flag for tests).
    Put {
        /// Peer id.
        peer: u64,
        /// The local regions the ops read from (their registrations are reused).
        regions: Vec<u64>,
        /// The WRITEs.
        ops: Vec<PutOp>,
        /// Flip a byte of the first op in flight.
        corrupt: bool,
        /// When it must be complete; past it the WRITEs are cancelled and the peer dropped.
        deadline: Instant,
        /// Bytes written.
        reply: OpReply,
    },
    /// Post READs from a peer (`local` is the destination, `remote` the source) and wait for
    /// them: a completed get has its data here.
    Get {
        /// Peer id.
        peer: u64,
        /// The local regions the ops write into (their registrations are reused).
        regions: Vec<u64>,
        /// The READs.
        ops: Vec<PutOp>,
        /// When it must be complete; past it the READs are cancelled and the peer dropped.
        deadline: Instant,
        /// Bytes read.
        reply: OpReply,
    },
    /// Close a peer's endpoint.
    Disconnect {
        /// Peer id.
        peer: u64,
    },
    /// UCX's description of a peer's endpoint (`ucp_ep_print_info`: its lanes).
    Describe {
        /// Peer id.
        peer: u64,
        /// The text.
        reply: Reply<String>,
    },
    /// See [`UcxHandle::orphans`].
    Orphans {
        /// The counts.
        reply: Reply<Orphans>,
    },
    /// Answered at once by a live, progressing thread (for readiness).
    Ping {
        /// Answered with ().
        reply: Reply<()>,
    },
}

/// A handle to the UCX thread.
#[derive(Clone, Debug)]
pub struct UcxHandle {
    tx: Sender<Command>,
    /// This worker's address.
    pub worker_address: Vec<u8>,
    /// The memory types the context moves (see [`Context::memory_types`]).
    pub memory_types: Vec<crate::transport::ucx::MemoryType>,
    /// Tries each peer's worker address in a throwaway process before this worker sees it.
    probe: Option<std::sync::Arc<crate::transport::ucx_probe::Prober>>,
}

impl UcxHandle {
    /// Starts the thread. Fails when UCX cannot start on `transport`.
    /// `pool_dir` is where memory this thread allocates lives (see [`crate::pool`]).
    pub fn start(transport: Transport, pool_dir: &std::path::Path) -> Result<UcxHandle, String> {
        // Canonical: peers' keys must name segments in it, as /proc/self/maps shows them.
        let pool_dir = pool_dir.canonicalize().unwrap_or_else(|_| pool_dir.to_path_buf());
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        thread::Builder::new()
            .name("ucx".into())
            .spawn(move || {
                let setup = Context::new(transport, Some(&pool_dir)).and_then(|c| Worker::new(&c).map(|w| (c, w)));
                match setup {
                    Ok((context, worker)) => match worker.address() {
                        Ok(addr) => {
                            let _ = ready_tx.send(Ok((addr.clone(), context.memory_types())));
                            run(context, worker, rx, &pool_dir, &addr);
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.to_string()));
                        }
                    },
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                    }
                }
            })
            .map_err(|e| format!("starting the UCX thread: {e}"))?;
        let (worker_address, memory_types) = ready_rx.recv().map_err(|_| "the UCX thread died".to_owned())??;
        Ok(UcxHandle {
            tx,
            worker_address,
            memory_types,
            probe: None,
        })
    }

    /// From now on, every peer's worker address is first tried by `prober`
    /// ([`crate::transport::ucx_probe`]); fails when the probe does not pass this worker's own
    /// address (it cannot run or isolate itself here).
    pub fn with_probe(mut self, prober: crate::transport::ucx_probe::Prober) -> Result<UcxHandle, String> {
        prober
            .probe(&self.worker_address)
            .map_err(|e| format!("the UCX probe does not pass this agent's own worker address: {e}"))?;
        self.probe = Some(std::sync::Arc::new(prober));
        Ok(self)
    }

    fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, String> {
        let (reply, rx) = mpsc::channel();
        self.tx
            .send(make(reply))
            .map_err(|_| "the UCX thread is gone".to_owned())?;
        rx.recv().map_err(|_| "the UCX thread dropped a request".to_owned())?
    }

    /// [`UcxHandle::call`], given up after `within` (the UCX thread busy or stuck).
    fn call_within<T>(&self, within: Duration, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, String> {
        let (reply, rx) = mpsc::channel();
        self.tx
            .send(make(reply))
            .map_err(|_| "the UCX thread is gone".to_owned())?;
        match rx.recv_timeout(within) {
            Ok(answer) => answer,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(format!("the UCX thread did not answer within {within:?}")),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err("the UCX thread dropped a request".to_owned()),
        }
    }

    /// See [`Command::Map`].
    pub fn map(&self, addr: u64, len: u64, keep: Keep) -> Result<(u64, Vec<u8>), String> {
        self.call(|reply| Command::Map { addr, len, keep, reply })
    }

    /// How many requests of force-closed endpoints UCX still holds, and the bytes of the regions
    /// kept mapped for them after their engines closed (see [`Orphan`]); an error when the UCX
    /// thread does not answer within `within` (a metrics scrape does not wait on a stuck one).
    pub fn orphans(&self, within: Duration) -> Result<Orphans, String> {
        self.call_within(within, |reply| Command::Orphans { reply })
    }

    /// See [`Command::Allocate`].
    pub fn allocate(&self, len: u64) -> Result<Allocated, String> {
        self.call(|reply| Command::Allocate { len, reply })
    }

    /// See [`Command::Unmap`]; returns once the region is gone (memory UCX allocated is freed
    /// and its file removed; where a peer's software get was let through to it, its addresses
    /// stay, as zeros, and UCX's file, emptied, until the agent stops).
    pub fn unmap(&self, region: u64) {
        let _ = self.call(|reply| Command::Unmap { region, reply });
    }

    /// A peer's worker address, checked for size and format and tried in the probe (when this
    /// handle has one) before this worker sees it.
    pub fn vet_address(&self, worker_address: &[u8]) -> Result<(), String> {
        crate::protocol::check_ucx_address(worker_address)?;
        if let Some(prober) = &self.probe {
            prober
                .probe(worker_address)
                .map_err(|e| format!("worker_address: {e}"))?;
        }
        Ok(())
    }

    /// See [`Command::Connect`].
    /// `remotes` are the peer's regions: (packed key, registered range (address, bytes)). When
    /// UCX mapped the peer's memory into this process (shared memory it allocated: puts are
    /// plain copies), this faults those mappings in, in the calling thread (the handshake's, not
    /// the UCX thread, which keeps serving other transfers), so the first transfer does not take
    /// the page faults.
    ///
    /// The keys and address are a peer's bytes: they are length- and structure-checked here,
    /// before UCX parses them, and no range may be empty or wrap.
    pub fn connect(&self, worker_address: Vec<u8>, remotes: Vec<(Vec<u8>, (u64, u64))>) -> Result<u64, String> {
        self.vet_address(&worker_address)?;
        if remotes.is_empty() || remotes.len() > crate::layout::MAX_REGIONS {
            return Err(format!(
                "the peer has {} regions; a pool has 1..={}",
                remotes.len(),
                crate::layout::MAX_REGIONS
            ));
        }
        for (i, (rkey, remote)) in remotes.iter().enumerate() {
            crate::protocol::check_rkey(rkey).map_err(|e| format!("the peer's region {i}: its key {e}"))?;
            if remote.0.checked_add(remote.1).is_none() || remote.1 == 0 {
                return Err(format!(
                    "the peer's region {i} ({:#x}+{}) is empty or wraps",
                    remote.0, remote.1
                ));
            }
        }
        let lens: Vec<u64> = remotes.iter().map(|(_, r)| r.1).collect();
        let (id, locals) = self.call(|reply| Command::Connect {
            worker_address,
            remotes,
            reply,
        })?;
        for (local, len) in locals.into_iter().zip(lens) {
            if let Some(local) = local {
                populate(local, len);
            }
        }
        Ok(id)
    }

    fn op(&self, make: impl FnOnce(OpReply) -> Command) -> Result<u64, OpError> {
        let (reply, rx) = mpsc::channel();
        self.tx
            .send(make(reply))
            .map_err(|_| OpError::Failed("the UCX thread is gone".into()))?;
        rx.recv()
            .map_err(|_| OpError::Failed("the UCX thread dropped a request".into()))?
    }

    /// See [`Command::Put`]; `within` bounds it (the UCX thread keeps serving other peers
    /// meanwhile).
    pub fn put(
        &self,
        peer: u64,
        regions: Vec<u64>,
        ops: Vec<PutOp>,
        corrupt: bool,
        within: Duration,
    ) -> Result<u64, OpError> {
        let deadline = Instant::now() + within;
        self.op(|reply| Command::Put {
            peer,
            regions,
            ops,
            corrupt,
            deadline,
            reply,
        })
    }

    /// See [`Command::Get`]; `within` bounds it.
    pub fn get(&self, peer: u64, regions: Vec<u64>, ops: Vec<PutOp>, within: Duration) -> Result<u64, OpError> {
        let deadline = Instant::now() + within;
        self.op(|reply| Command::Get {
            peer,
            regions,
            ops,
            deadline,
            reply,
        })
    }

    /// The lanes UCX chose for a peer (see [`crate::transport::lanes`]).
    pub fn lanes(&self, peer: u64) -> Result<crate::transport::lanes::Lanes, String> {
        let text = self.call(|reply| Command::Describe { peer, reply })?;
        Ok(crate::transport::lanes::Lanes::parse(&text))
    }

    /// Whether the thread answers within `within` (it is alive and progressing).
    pub fn alive(&self, within: Duration) -> bool {
        let (reply, rx) = mpsc::channel();
        self.tx.send(Command::Ping { reply }).is_ok() && matches!(rx.recv_timeout(within), Ok(Ok(())))
    }

    /// See [`Command::Disconnect`].
    pub fn disconnect(&self, peer: u64) {
        let _ = self.tx.send(Command::Disconnect { peer });
    }
}

struct Peer {
    ep: Endpoint,
    /// The peer's regions, by address.
    remotes: Vec<Remote>,
}

/// A registered region, and what keeps its memory mapped.
struct Held {
    region: MemRegion,
    _keep: Option<Keep>,
}

/// Requests UCX still holds after their endpoint was force-closed (a deadline, a failed request,
/// a disconnect, an engine that closed). UCX 1.13's tcp transport does not cancel a put queued
/// behind a full socket: the closed endpoint's queue is sent, reading the put's buffer, once a
/// stalled peer drains its socket, and its requests complete only then (measured in
/// `tests::a_stalled_peer_that_resumes_after_its_deadline_reads_nothing_unmapped`). So they are
/// polled until UCX completes them, and until then the regions they read or write stay
/// registered and mapped, and the peer's keys stay unpacked, even after `Unmap`.
///
/// A get's orphans still write into local memory (an engine's blocks) until UCX completes them
/// (measured with UCX 1.22 over shared memory: a read cut short by its deadline went on landing),
/// so its failure is answered only then ([`Orphan::answer`]): an engine that heard its request
/// failed may reuse those blocks at once. Gets need no progress of the peer on the transports
/// that carry them (shared memory reads the peer's segment itself; RDMA flushes a closed queue
/// pair's reads), so the answer comes soon.
struct Orphan {
    requests: Vec<crate::transport::ucx::Request>,
    regions: Vec<u64>,
    /// The peer's keys (and shared-memory guards), shared by all of that peer's orphans.
    remotes: std::rc::Rc<Vec<Remote>>,
    scratch: Option<Vec<u8>>,
    /// A get's failure, sent once its requests completed.
    answer: Option<(OpReply, OpError)>,
}

/// See [`UcxHandle::orphans`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Orphans {
    /// Requests of force-closed endpoints UCX has not completed.
    pub requests: u64,
    /// Bytes of unregistered regions kept mapped for them, and (over shared memory) for the
    /// answers to peers' software gets UCX may still be sending (for the agent's life).
    pub retired_bytes: u64,
}

/// One region of a peer's pool.
struct Remote {
    rkey: RemoteKey,
    /// The region (address, bytes) from the peer's authenticated handshake.
    range: (u64, u64),
    /// Over shared memory: the guard over our mapping of the peer's segment (its engine may
    /// truncate it; see [`crate::guard`]).
    _guard: Option<crate::memory::guard::Guard>,
}

/// A put or get posted and not yet complete. Its requests (and, for a put, the flush after
/// them) are polled by the loop; the thread never blocks on one peer.
struct InFlight {
    peer: u64,
    regions: Vec<u64>,
    requests: Vec<crate::transport::ucx::Request>,
    /// A put flushes once its requests completed (remote completion).
    flush: Flush,
    bytes: u64,
    deadline: Instant,
    reply: OpReply,
    /// The corrupted copy a fault-injecting put reads from, alive until it completes.
    _scratch: Option<Vec<u8>>,
}

enum Flush {
    /// A get: nothing to flush.
    None,
    /// A put whose flush is not posted yet.
    Pending,
    /// A put's flush in progress.
    Posted(crate::transport::ucx::Request),
}

/// What became of an in-flight operation this round.
enum Step {
    Waiting,
    Done(Result<u64, OpError>),
    TimedOut,
    /// A request failed while others of the op are still posted: UCX would go on reading or
    /// writing their buffers after we answered (and after the engine unmapped them), so the
    /// peer's endpoint is closed first.
    Broken(String),
}

fn step(op: &mut InFlight, peers: &HashMap<u64, Peer>) -> Step {
    let mut failed = None;
    op.requests.retain(|r| match r.poll() {
        None => true,
        Some(Ok(())) => false,
        Some(Err(e)) => {
            failed.get_or_insert(e.to_string());
            false
        }
    });
    if let Some(e) = failed {
        if op.requests.is_empty() {
            return Step::Done(Err(OpError::Failed(e)));
        }
        return Step::Broken(e);
    }
    if op.requests.is_empty() {
        match &op.flush {
            Flush::None => return Step::Done(Ok(op.bytes)),
            Flush::Pending => match peers.get(&op.peer).map(|p| p.ep.flush_nb()) {
                Some(Ok(None)) => return Step::Done(Ok(op.bytes)),
                Some(Ok(Some(r))) => op.flush = Flush::Posted(r),
                Some(Err(e)) => return Step::Done(Err(OpError::Failed(e.to_string()))),
                None => return Step::Done(Err(OpError::Failed(format!("peer {} was dropped", op.peer)))),
            },
            Flush::Posted(r) => match r.poll() {
                None => {}
                Some(Ok(())) => return Step::Done(Ok(op.bytes)),
                Some(Err(e)) => return Step::Done(Err(OpError::Failed(e.to_string()))),
            },
        }
    }
    if Instant::now() >= op.deadline {
        return Step::TimedOut;
    }
    Step::Waiting
}

/// Force-closes a peer's endpoint and fails every operation in flight on it with `why`. Their
/// requests UCX has not completed become [`Orphan`]s, which hold the peer's keys and name the
/// regions that must stay mapped.
fn drop_peer(
    peers: &mut HashMap<u64, Peer>,
    inflight: &mut Vec<InFlight>,
    orphans: &mut Vec<Orphan>,
    peer: u64,
    why: &OpError,
) {
    let remotes = peers.remove(&peer).map(|Peer { ep, remotes }| {
        drop(ep); // Endpoint's drop force-closes and waits for the close
        remotes
    });
    let remotes = std::rc::Rc::new(remotes.unwrap_or_default());
    for op in inflight.extract_if(.., |op| op.peer == peer) {
        let InFlight {
            mut requests,
            flush,
            regions,
            reply,
            _scratch,
            ..
        } = op;
        let get = matches!(flush, Flush::None);
        if let Flush::Posted(r) = flush {
            requests.push(r);
        }
        requests.retain(|r| r.poll().is_none());
        if requests.is_empty() {
            let _ = reply.send(Err(why.clone()));
            continue;
        }
        // A put's failure is answered now (it reads local memory, which stays mapped);
        // a get's once it no longer writes.
        let answer = if get {
            Some((reply, why.clone()))
        } else {
            let _ = reply.send(Err(why.clone()));
            None
        };
        orphans.push(Orphan {
            requests,
            regions,
            remotes: remotes.clone(),
            scratch: _scratch,
            answer,
        });
    }
}

/// Drops the orphans UCX completed (answering their gets), then the unregistered regions no
/// orphan names any more.
fn reap(orphans: &mut Vec<Orphan>, retired: &mut HashMap<u64, Held>) {
    orphans.retain_mut(|o| {
        o.requests.retain(|r| r.poll().is_none());
        if !o.requests.is_empty() {
            return true;
        }
        if let Some((reply, why)) = o.answer.take() {
            let _ = reply.send(Err(why));
        }
        false
    });
    retired.retain(|id, _| orphans.iter().any(|o| o.regions.contains(id)));
}

fn run(context: Context, worker: Worker, rx: Receiver<Command>, pool_dir: &std::path::Path, own_address: &[u8]) {
    let mut registered: HashMap<u64, Held> = HashMap::new();
    let mut peers: HashMap<u64, Peer> = HashMap::new();
    let mut inflight: Vec<InFlight> = Vec::new();
    let mut orphans: Vec<Orphan> = Vec::new();
    let mut retired: HashMap<u64, Held> = HashMap::new();
    // Regions kept, as zeros, for answers to peers' software gets; see `Unmap`.
    let mut answered: Vec<Held> = Vec::new();
    let mut next_id = 1u64;
    let mut idle_since = Instant::now();
    let mut quiet = 0u32;
    loop {
        // Progress hard while there is traffic; back off to short sleeps when idle so an idle
        // agent does not burn a core.
        if worker.progress() {
            idle_since = Instant::now();
            quiet = 0;
        } else {
            quiet = quiet.saturating_add(1);
        }
        if !inflight.is_empty() {
            idle_since = Instant::now();
            let mut dropped = Vec::new();
            let mut i = 0;
            while i < inflight.len() {
                match step(&mut inflight[i], &peers) {
                    Step::Waiting => i += 1,
                    Step::Done(result) => {
                        let op = inflight.swap_remove(i);
                        let _ = op.reply.send(result);
                    }
                    Step::TimedOut => {
                        let peer = inflight[i].peer;
                        dropped.push((peer, OpError::Timeout(format!("peer {peer}"))));
                        i += 1;
                    }
                    Step::Broken(e) => {
                        dropped.push((inflight[i].peer, OpError::Failed(e)));
                        i += 1;
                    }
                }
            }
            for (peer, why) in dropped {
                drop_peer(&mut peers, &mut inflight, &mut orphans, peer, &why);
            }
        }
        if !orphans.is_empty() {
            reap(&mut orphans, &mut retired);
        }
        // A command wakes the thread at once whatever the wait; the wait paces only progress
        // for what arrives without one (a peer's wireup). Idle for a second, 5 ms: at 200 us an
        // idle agent woke 5000 times a second, and a node's (or a test process's) many idle
        // agents took the cores their busy ones needed.
        let idle = idle_since.elapsed();
        let wait = if idle < Duration::from_millis(5) {
            Duration::ZERO
        } else if idle < IDLE_BACKOFF_AFTER {
            Duration::from_micros(200)
        } else {
            IDLE_WAIT
        };
        let cmd = if wait.is_zero() {
            match rx.try_recv() {
                Ok(c) => c,
                Err(mpsc::TryRecvError::Empty) => {
                    // Spinning: after a run of empty polls, let a thread sharing this CPU run
                    // (with fewer cores than busy threads a pure spin starves the very thread we
                    // wait for), but not on every poll: a yield is a system call.
                    if quiet >= QUIET_POLLS_BEFORE_YIELD {
                        std::thread::yield_now();
                    }
                    continue;
                }
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        } else {
            match rx.recv_timeout(wait) {
                Ok(c) => c,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        };
        idle_since = Instant::now();
        match cmd {
            Command::Map { addr, len, keep, reply } => {
                // SAFETY: `keep` keeps addr..addr+len mapped, and lives as long as the region.
                let result = unsafe_map(&context, addr, len).and_then(|r| {
                    let key = r.packed_rkey().map_err(|e| e.to_string())?;
                    let id = next_id;
                    next_id += 1;
                    registered.insert(
                        id,
                        Held {
                            region: r,
                            _keep: Some(keep),
                        },
                    );
                    Ok((id, key))
                });
                let _ = reply.send(result);
            }
            Command::Allocate { len, reply } => {
                let result = usize::try_from(len)
                    .map_err(|_| format!("cannot allocate {len} bytes"))
                    .and_then(|len| context.allocate(len).map_err(|e| e.to_string()))
                    .and_then(|r| {
                        let rkey = r.packed_rkey().map_err(|e| e.to_string())?;
                        let (addr, len) = (r.addr(), r.len() as u64);
                        // Fault the pages into this mapping now (the prefill side's WRITEs read
                        // through it), not inside the first transfer.
                        populate(addr, len);
                        let region = next_id;
                        next_id += 1;
                        // UCX's mapping of its file is guarded for as long as it lives here (an
                        // engine may truncate the file; an orphaned put may read it after the
                        // pool was released).
                        let guard: Keep = Box::new(crate::memory::guard::guard(addr, len));
                        registered.insert(
                            region,
                            Held {
                                region: r,
                                _keep: Some(guard),
                            },
                        );
                        Ok(Allocated {
                            region,
                            rkey,
                            addr,
                            len,
                        })
                    });
                let _ = reply.send(result);
            }
            Command::Unmap { region, reply } => {
                // Operations still reading or writing the region are cancelled first (their
                // peers' endpoints closed), so UCX never touches memory after it is unmapped.
                let users: Vec<u64> = inflight
                    .iter()
                    .filter(|op| op.regions.contains(&region))
                    .map(|op| op.peer)
                    .collect();
                for peer in users {
                    let why = OpError::Failed(format!("region {region} was unregistered (its engine closed)"));
                    drop_peer(&mut peers, &mut inflight, &mut orphans, peer, &why);
                }
                if let Some(mut held) = registered.remove(&region) {
                    let (addr, len) = (held.region.addr(), held.region.len());
                    // Over shared memory, a peer's software get let through to it is answered
                    // by UCX after its handler returned, reading the region as the peer drains
                    // it, with no sign once done: its addresses stay mapped for this thread's
                    // life (unmapped, such an answer killed the agent with SIGSEGV; measured).
                    let answering = held.region.withdraw();
                    // Memory UCX allocated is its segment file in the pool directory, which
                    // UCX frees with the registration: kept, the file's pages go with a
                    // truncation (a peer that attached it reads zeros through its guard).
                    let segment = answering
                        .then(|| crate::memory::pool::mapping_path(addr))
                        .flatten()
                        .filter(|p| p.parent() == Some(pool_dir));
                    if answering || orphans.iter().any(|o| o.regions.contains(&region)) {
                        // The engine is gone: its memory need not be kept, only the addresses
                        // UCX may still read. Zero pages replace it, so a peer that never
                        // resumes holds no pool's memory, and a late WRITE or answer sends
                        // zeros, not the engine's KV.
                        overlay_zeros(addr, len);
                        if answering {
                            if let Some(path) = segment {
                                truncate_segment(&path);
                            }
                            answered.push(held);
                        } else {
                            retired.insert(region, held);
                        }
                    }
                }
                let _ = reply.send(Ok(()));
            }
            Command::Connect {
                worker_address,
                remotes,
                reply,
            } => {
                let result = worker
                    .connect(&worker_address)
                    .map_err(|e| e.to_string())
                    .and_then(|ep| {
                        // UCX takes an address with this worker's id for this worker (its `self`
                        // lane), whatever its other bytes: a peer's copy of our address with a
                        // byte changed would have us put into our own memory at ranges it
                        // describes. Only our address itself may reach us (the caller checks
                        // that such a peer is one of our engines, with its exact memory).
                        let reaches_us = crate::transport::lanes::Lanes::parse(&ep.print_info())
                            .names()
                            .iter()
                            .any(|n| n.starts_with("self/"));
                        if reaches_us && worker_address != own_address {
                            return Err(
                                "the peer's worker address reaches this agent's own worker but is not its address"
                                    .to_owned(),
                            );
                        }
                        Ok(ep)
                    })
                    .and_then(|ep| {
                        let mut unpacked = Vec::with_capacity(remotes.len());
                        let mut locals = Vec::with_capacity(remotes.len());
                        for (rkey, range) in remotes {
                            let rkey = ep.unpack_rkey(&rkey).map_err(|e| e.to_string())?;
                            // Where UCX mapped the peer's memory here (it allocated it in shared
                            // memory): the caller faults that mapping in before the first
                            // transfer.
                            let local = rkey.local_ptr(range.0);
                            let mut guard = None;
                            if let Some(at) = local {
                                // Over shared memory a put is a memcpy into this mapping: the
                                // whole region the peer described must be that mapping, or a
                                // peer that claims more than its segment holds would make us copy
                                // into our own memory past it.
                                mapped_whole(&rkey, range, at)?;
                                // Our own registered memory (an endpoint to our own worker, UCX
                                // 1.22's self lane), else a segment in the pool directory.
                                if !inside_registered(&registered, at, range.1) {
                                    segment_in(pool_dir, at)?;
                                }
                                guard = Some(crate::memory::guard::guard(at, range.1));
                            }
                            locals.push(local);
                            unpacked.push(Remote {
                                rkey,
                                range,
                                _guard: guard,
                            });
                        }
                        unpacked.sort_by_key(|r| r.range.0);
                        let id = next_id;
                        next_id += 1;
                        peers.insert(id, Peer { ep, remotes: unpacked });
                        Ok((id, locals))
                    });
                let _ = reply.send(result);
            }
            Command::Get {
                peer,
                regions,
                ops,
                deadline,
                reply,
            } => {
                let posted = match (peers.get(&peer), local_regions(&registered, &regions, &ops)) {
                    (Some(p), Ok(r)) => remote_keys(p, &ops).and_then(|keys| post_gets(p, &r, &keys, &ops)),
                    (None, _) => Err(format!("unknown peer {peer}")),
                    (_, Err(e)) => Err(e),
                };
                match posted {
                    Ok((requests, bytes)) => inflight.push(InFlight {
                        peer,
                        regions,
                        requests,
                        flush: Flush::None,
                        bytes,
                        deadline,
                        reply,
                        _scratch: None,
                    }),
                    Err(e) => {
                        let _ = reply.send(Err(OpError::Failed(e)));
                    }
                }
            }
            Command::Put {
                peer,
                regions,
                ops,
                corrupt,
                deadline,
                reply,
            } => {
                let posted = match (peers.get(&peer), local_regions(&registered, &regions, &ops)) {
                    (Some(p), Ok(r)) => remote_keys(p, &ops).and_then(|keys| post_puts(p, &r, &keys, &ops, corrupt)),
                    (None, _) => Err(format!("unknown peer {peer}")),
                    (_, Err(e)) => Err(e),
                };
                match posted {
                    Ok((requests, bytes, scratch)) => inflight.push(InFlight {
                        peer,
                        regions,
                        requests,
                        flush: Flush::Pending,
                        bytes,
                        deadline,
                        reply,
                        _scratch: scratch,
                    }),
                    Err(e) => {
                        let _ = reply.send(Err(OpError::Failed(e)));
                    }
                }
            }
            Command::Ping { reply } => {
                let _ = reply.send(Ok(()));
            }
            Command::Orphans { reply } => {
                reap(&mut orphans, &mut retired);
                let _ = reply.send(Ok(Orphans {
                    requests: orphans.iter().map(|o| o.requests.len() as u64).sum(),
                    retired_bytes: retired.values().map(|h| h.region.len() as u64).sum::<u64>()
                        + answered.iter().map(|h| h.region.len() as u64).sum::<u64>(),
                }));
            }
            Command::Describe { peer, reply } => {
                let text = peers
                    .get(&peer)
                    .map(|p| p.ep.print_info())
                    .ok_or_else(|| format!("unknown peer {peer}"));
                let _ = reply.send(text);
            }
            Command::Disconnect { peer } => {
                let why = OpError::Failed(format!("peer {peer} was disconnected"));
                drop_peer(&mut peers, &mut inflight, &mut orphans, peer, &why);
            }
        }
    }
    // Endpoints first (each force-closed), then every request UCX may still hold is released,
    // then the peers' keys (before the worker: UCX takes them from its memory pool), then the
    // worker (which destroys what is left of the closed endpoints), and only then the memory
    // those requests named.
    let mut scratch = Vec::new();
    let mut keys = Vec::new();
    for (_, Peer { ep, remotes }) in peers.drain() {
        drop(ep);
        keys.push(std::rc::Rc::new(remotes));
    }
    for op in inflight.drain(..) {
        let InFlight {
            requests,
            flush,
            reply,
            _scratch,
            ..
        } = op;
        let _ = reply.send(Err(OpError::Failed("the UCX thread stopped".into())));
        drop(requests);
        drop(flush);
        scratch.push(_scratch);
    }
    let mut answers = Vec::new();
    for o in orphans.drain(..) {
        let Orphan {
            requests,
            remotes,
            scratch: s,
            answer,
            ..
        } = o;
        answers.extend(answer);
        drop(requests);
        keys.push(remotes);
        scratch.push(s);
    }
    drop(keys);
    drop(worker);
    // No get writes once the worker is gone.
    for (reply, why) in answers {
        let _ = reply.send(Err(why));
    }
    drop(scratch);
    drop(answered);
    drop(retired);
    drop(registered);
    drop(context);
}

/// Per op, the registered region (of `ids`) its local range lies in: a transfer never touches
/// memory this agent no longer holds (an engine that closed has its regions unmapped, and memory
/// UCX allocated is freed with them).
fn local_regions<'a>(
    registered: &'a HashMap<u64, Held>,
    ids: &[u64],
    ops: &[PutOp],
) -> Result<Vec<&'a MemRegion>, String> {
    let mut held = Vec::with_capacity(ids.len());
    for id in ids {
        let region = registered
            .get(id)
            .ok_or_else(|| format!("region {id} is no longer registered (its engine closed)"))?;
        held.push(&region.region);
    }
    held.sort_by_key(|r| r.addr());
    ops.iter()
        .map(|op| {
            let i = held.partition_point(|r| r.addr() <= op.local);
            i.checked_sub(1)
                .map(|i| held[i])
                .filter(|r| {
                    op.local
                        .checked_add(op.len)
                        .is_some_and(|e| e <= r.addr() + r.len() as u64)
                })
                .ok_or_else(|| {
                    format!(
                        "local range {:#x}+{} lies outside the registered regions {ids:?}",
                        op.local, op.len
                    )
                })
        })
        .collect()
}

/// Per op, the peer's region from its handshake that its remote range lies in (and that
/// region's key): a peer's descriptor can never steer a put or get outside what it registered
/// (checked arithmetic).
fn remote_keys<'a>(peer: &'a Peer, ops: &[PutOp]) -> Result<Vec<&'a RemoteKey>, String> {
    ops.iter()
        .map(|op| {
            let i = peer.remotes.partition_point(|r| r.range.0 <= op.remote);
            i.checked_sub(1)
                .map(|i| &peer.remotes[i])
                .filter(|r| {
                    op.remote
                        .checked_add(op.len)
                        .is_some_and(|e| e <= r.range.0.saturating_add(r.range.1))
                })
                .map(|r| &r.rkey)
                .ok_or_else(|| {
                    format!(
                        "remote range {:#x}+{} lies outside the peer's regions",
                        op.remote, op.len
                    )
                })
        })
        .collect()
}

/// The peer's whole region `remote` appears here as one contiguous run of mappings starting at
/// `at` (UCX maps the peer's segment; a region larger than the segment would run past it).
fn mapped_whole(rkey: &RemoteKey, remote: (u64, u64), at: u64) -> Result<(), String> {
    let (base, len) = remote;
    let last = base + len - 1;
    if rkey.local_ptr(last) != Some(at + len - 1) {
        return Err(format!(
            "the peer's key does not map its whole region {base:#x}+{len} contiguously"
        ));
    }
    if !crate::memory::pool::mapped(at, len) {
        return Err(format!(
            "the peer's key maps fewer than the {len} bytes of the region it described"
        ));
    }
    Ok(())
}

/// Whether `at..at+len` lies inside one region registered here.
fn inside_registered(registered: &HashMap<u64, Held>, at: u64, len: u64) -> bool {
    registered.values().any(|h| {
        let (start, end) = (h.region.addr(), h.region.addr() + h.region.len() as u64);
        at >= start && at.checked_add(len).is_some_and(|e| e <= end)
    })
}

/// The file UCX mapped at `at` for a peer's key is a UCX segment in the pool directory: a
/// peer's shared-memory key names the file to map (a directory and a segment name, or
/// `/proc/<pid>/fd/<fd>` of any process), and UCX maps whatever it names.
fn segment_in(pool_dir: &std::path::Path, at: u64) -> Result<(), String> {
    let path = crate::memory::pool::mapping_path(at);
    let ours = path.as_deref().is_some_and(|p| {
        p.parent() == Some(pool_dir)
            && p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(crate::memory::pool::UCX_SEGMENT_PREFIX))
    });
    if ours {
        return Ok(());
    }
    Err(match path {
        Some(p) => format!(
            "the peer's key maps {}, not a shared-memory segment in the pool directory {}",
            crate::reason::peer_text(&p.to_string_lossy()),
            pool_dir.display()
        ),
        None => format!(
            "the peer's key maps memory that is no file in the pool directory {}",
            pool_dir.display()
        ),
    })
}

/// Replaces `addr..addr+len` (whole pages of a mapping this process holds) with private
/// anonymous zero pages (`MAP_FIXED`): the addresses stay valid, the memory behind them (a
/// memfd's or segment's pages) is no longer referenced here. Best effort: on failure the original
/// mapping stays.
#[allow(unsafe_code)]
fn overlay_zeros(addr: u64, len: usize) {
    // Pools are mappings from a page on, of whole pages (a pool's length need not be: its
    // mapping's last page is rounded up); anything else (a test's heap buffer) is left as it is.
    let page = crate::memory::pool::page_size();
    if !addr.is_multiple_of(page as u64) {
        tracing::debug!(
            addr,
            len,
            "a retired region that does not start a page keeps its memory"
        );
        return;
    }
    let len = len.div_ceil(page) * page;
    // SAFETY: only this thread reads through these addresses from now on (UCX, for requests the
    // peer never completed); they stay mapped, with zeros. The range is a registered region's
    // mapping, from a page on, to the end of its last page (checked above).
    let done = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if done == libc::MAP_FAILED {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot release a retired region's memory");
    }
}

/// Frees the pages of UCX's segment file at `path` (in the pool directory, the agent's own: not
/// followed through a link), which UCX keeps while its registration lives.
fn truncate_segment(path: &std::path::Path) {
    use std::os::unix::fs::OpenOptionsExt;
    let done = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .and_then(|f| f.set_len(0));
    if let Err(e) = done {
        tracing::warn!(path = %path.display(), error = %e, "cannot release a retired segment's memory");
    }
}

/// Best effort: fault `addr..addr+len` into this process's page tables for writing
/// (`MADV_POPULATE_WRITE`, Linux 5.14); older kernels leave the faults to first use.
#[allow(unsafe_code)]
pub fn populate(addr: u64, len: u64) {
    // SAFETY: madvise only changes page-table state of a range this process mapped; it reads or
    // writes no memory the program sees, and fails harmlessly on an unmapped range.
    let _ = unsafe { libc::madvise(addr as *mut libc::c_void, len as usize, libc::MADV_POPULATE_WRITE) };
}

#[allow(unsafe_code)]
fn unsafe_map(context: &Context, addr: u64, len: u64) -> Result<MemRegion, String> {
    // SAFETY: see Command::Map: the memory stays mapped until Unmap removes the region.
    unsafe { context.map(addr as *mut u8, len as usize) }.map_err(|e| e.to_string())
}

/// Posts the WRITEs; returns their requests, the bytes, and the corrupted copy a
/// fault-injecting put reads from (kept alive until the put completes).
#[allow(unsafe_code, clippy::type_complexity)]
fn post_puts(
    peer: &Peer,
    regions: &[&MemRegion],
    keys: &[&RemoteKey],
    ops: &[PutOp],
    corrupt: bool,
) -> Result<(Vec<crate::transport::ucx::Request>, u64, Option<Vec<u8>>), String> {
    let mut scratch: Option<Vec<u8>> = None;
    let mut pending = Vec::new();
    let mut bytes = 0u64;
    for (i, op) in ops.iter().enumerate() {
        // SAFETY: `local` lies in a registered region (checked), whose memory stays mapped until
        // UCX completed every request on it (see Orphan).
        let mut data = unsafe { std::slice::from_raw_parts(op.local as *const u8, op.len as usize) };
        let mut registered = Some(regions[i]);
        if corrupt && i == 0 && !data.is_empty() {
            registered = None;
            let mut copy = data.to_vec();
            let at = copy.len() / 2;
            copy[at] ^= 0x5a;
            scratch = Some(copy);
            data = scratch.as_deref().unwrap_or(data);
        }
        // SAFETY: `data` stays valid until the put completes (the scratch copy travels with the
        // in-flight operation); the remote range lies in the peer's region (checked).
        match unsafe { peer.ep.put(data, op.remote, keys[i], registered) } {
            Ok(Some(req)) => pending.push(req),
            Ok(None) => {}
            Err(e) => return Err(e.to_string()),
        }
        bytes += op.len;
    }
    Ok((pending, bytes, scratch))
}

/// Posts the READs; returns their requests and the bytes.
#[allow(unsafe_code)]
fn post_gets(
    peer: &Peer,
    regions: &[&MemRegion],
    keys: &[&RemoteKey],
    ops: &[PutOp],
) -> Result<(Vec<crate::transport::ucx::Request>, u64), String> {
    let mut pending = Vec::new();
    let mut bytes = 0u64;
    for (i, op) in ops.iter().enumerate() {
        // SAFETY: `local` lies in the registered region `regions[i]` (checked), whose memory
        // stays mapped until UCX completed every request on it (see Orphan); the remote range lies in the peer's region whose key is `keys[i]` (checked).
        match unsafe {
            peer.ep.get(
                op.local as *mut u8,
                op.len as usize,
                op.remote,
                keys[i],
                Some(regions[i]),
            )
        } {
            Ok(Some(req)) => pending.push(req),
            Ok(None) => {}
            Err(e) => return Err(e.to_string()),
        }
        bytes += op.len;
    }
    Ok((pending, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(10);

    /// For memory a test holds itself until both UCX threads are gone (no request outlives them).
    fn unkept() -> Keep {
        Box::new(())
    }

    /// Drops the UCX threads and removes `dir` once they have freed their segments in it.
    fn finish(handles: [UcxHandle; 2], dir: &std::path::Path) {
        drop(handles);
        let start = Instant::now();
        while std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some()) && start.elapsed() < Duration::from_secs(2) {
            thread::sleep(Duration::from_millis(5));
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A pool of several regions on both sides: one put reads from each local region and writes
    /// into each of the peer's with that region's key; a range that starts in one region and
    /// runs past it (into the gap before the next) is refused, on both sides.
    #[test]
    fn a_put_spans_several_regions_each_op_inside_one() {
        let dir = std::env::temp_dir().join(format!("pdpair-ucx-regions-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (a, b) = (
            UcxHandle::start(Transport::Shm, &dir).expect("A"),
            UcxHandle::start(Transport::Shm, &dir).expect("B"),
        );
        // Two sources and two targets, each its own allocation and registration.
        let sources: Vec<Vec<u8>> = (0..2u8).map(|r| vec![r + 1; 4096]).collect();
        let targets: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; 4096]).collect();
        let src: Vec<u64> = sources
            .iter()
            .map(|m| a.map(m.as_ptr() as u64, 4096, unkept()).expect("map").0)
            .collect();
        let dst: Vec<(u64, Vec<u8>)> = targets
            .iter()
            .map(|m| b.map(m.as_ptr() as u64, 4096, unkept()).expect("map"))
            .collect();
        let remotes = dst
            .iter()
            .zip(&targets)
            .map(|((_, rkey), m)| (rkey.clone(), (m.as_ptr() as u64, 4096)))
            .collect();
        let peer = a.connect(b.worker_address.clone(), remotes).expect("connect");
        let op = |s: usize, d: usize, at: u64, len: u64| PutOp {
            local: sources[s].as_ptr() as u64 + at,
            len,
            remote: targets[d].as_ptr() as u64 + at,
        };
        // Source 0 into target 1 and source 1 into target 0, in one put.
        let ops = vec![op(0, 1, 0, 4096), op(1, 0, 0, 4096)];
        assert_eq!(a.put(peer, src.clone(), ops, false, T), Ok(8192));
        assert!(
            targets[1] == sources[0] && targets[0] == sources[1],
            "each op landed in its region"
        );
        let e = a
            .put(peer, src.clone(), vec![op(0, 1, 2048, 4096)], false, T)
            .expect_err("runs past both regions");
        assert!(e.to_string().contains("outside the registered regions"), "{e}");
        let past_remote = PutOp {
            remote: targets[0].as_ptr() as u64 + 2048,
            ..op(0, 0, 0, 4096)
        };
        let e = a.put(peer, src.clone(), vec![past_remote], false, T).expect_err("past");
        assert!(e.to_string().contains("outside the peer's regions"), "{e}");
        let e = a
            .put(peer, vec![src[1]], vec![op(0, 0, 0, 16)], false, T)
            .expect_err("a region the put does not name");
        assert!(e.to_string().contains("outside the registered regions"), "{e}");
        a.disconnect(peer);
        for r in src {
            a.unmap(r);
        }
        for (r, _) in dst {
            b.unmap(r);
        }
        finish([a, b], &dir);
    }

    #[test]
    fn puts_only_read_memory_inside_a_registered_region() {
        let dir = std::env::temp_dir().join(format!("pdpair-ucx-thread-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (a, b) = (
            UcxHandle::start(Transport::Shm, &dir).expect("A"),
            UcxHandle::start(Transport::Shm, &dir).expect("B"),
        );
        let source: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        let target = vec![0u8; 8192];
        let (src_region, _) = a.map(source.as_ptr() as u64, 8192, unkept()).expect("map source");
        let (dst_region, rkey) = b.map(target.as_ptr() as u64, 8192, unkept()).expect("map target");
        let peer = a
            .connect(b.worker_address.clone(), vec![(rkey, (target.as_ptr() as u64, 8192))])
            .expect("connect");
        let op = |local: u64, len: u64| PutOp {
            local,
            len,
            remote: target.as_ptr() as u64,
        };
        let base = source.as_ptr() as u64;
        let e = a
            .put(peer, vec![src_region], vec![op(base + 4096, 8192)], false, T)
            .expect_err("past the end");
        assert!(e.to_string().contains("outside the registered regions"), "{e}");
        let e = a
            .put(peer, vec![src_region], vec![op(base - 1, 16)], false, T)
            .expect_err("before the start");
        assert!(e.to_string().contains("outside the registered regions"), "{e}");
        assert_eq!(a.put(peer, vec![src_region], vec![op(base, 8192)], false, T), Ok(8192));
        assert!(target == source, "the put landed");
        a.unmap(src_region);
        let e = a
            .put(peer, vec![src_region], vec![op(base, 16)], false, T)
            .expect_err("unmapped");
        assert!(e.to_string().contains("no longer registered"), "{e}");
        a.disconnect(peer);
        b.unmap(dst_region);
        finish([a, b], &dir);
    }

    #[test]
    fn puts_and_gets_only_touch_the_peers_region_and_a_key_must_map_all_of_it() {
        let dir = std::env::temp_dir().join(format!("pdpair-ucx-remote-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let dir = dir.canonicalize().expect("canonical");
        let (a, b) = (
            UcxHandle::start(Transport::Shm, &dir).expect("A"),
            UcxHandle::start(Transport::Shm, &dir).expect("B"),
        );
        // B's pool is UCX shared memory: A's puts are memcpys into A's mapping of it.
        let pool = b.allocate(1 << 16).expect("allocate");
        let source = vec![5u8; 1 << 16];
        let (src, _) = a
            .map(source.as_ptr() as u64, source.len() as u64, unkept())
            .expect("map");
        // A peer that claims a region larger than its segment: the copy would run past A's
        // mapping of it, into A's own memory.
        let e = a
            .connect(
                b.worker_address.clone(),
                vec![(pool.rkey.clone(), (pool.addr, pool.len + (64 << 20)))],
            )
            .expect_err("a region larger than the key maps");
        assert!(e.to_string().contains("map"), "{e}");
        let peer = a
            .connect(
                b.worker_address.clone(),
                vec![(pool.rkey.clone(), (pool.addr, 1 << 12))],
            )
            .expect("connect to the first 4 KiB");
        let op = |remote: u64, len: u64| PutOp {
            local: source.as_ptr() as u64,
            len,
            remote,
        };
        for bad in [
            op(pool.addr + 4096, 1),
            op(pool.addr - 1, 2),
            op(pool.addr, 4097),
            op(u64::MAX - 2, 8),
        ] {
            let e = a.put(peer, vec![src], vec![bad], false, T).expect_err("outside");
            assert!(e.to_string().contains("outside the peer's region"), "{e}");
            let e = a.get(peer, vec![src], vec![bad], T).expect_err("outside");
            assert!(e.to_string().contains("outside the peer's region"), "{e}");
        }
        assert_eq!(a.put(peer, vec![src], vec![op(pool.addr, 4096)], false, T), Ok(4096));
        // Keys and addresses are checked before UCX sees them.
        for (address, rkey) in [
            (Vec::new(), pool.rkey.clone()),
            (b.worker_address.clone(), Vec::new()),
            // Cut inside its domains (a key's tail may be an optional device byte).
            (b.worker_address.clone(), pool.rkey[..9].to_vec()),
        ] {
            assert!(a.connect(address, vec![(rkey, (pool.addr, 4096))]).is_err());
        }
        a.disconnect(peer);
        a.unmap(src);
        b.unmap(pool.region);
        finish([a, b], &dir);
    }

    #[test]
    fn allocated_memory_is_a_named_file_a_peer_writes_directly() {
        let dir = std::env::temp_dir().join(format!("pdpair-ucx-alloc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let dir = dir.canonicalize().expect("canonical");
        let (a, b) = (
            UcxHandle::start(Transport::Shm, &dir).expect("A"),
            UcxHandle::start(Transport::Shm, &dir).expect("B"),
        );
        let pool = b.allocate(1 << 20).expect("allocate");
        assert!(pool.len >= 1 << 20);
        let path = crate::memory::pool::mapping_path(pool.addr).expect("a named file");
        assert_eq!(path.parent(), Some(dir.as_path()), "{}", path.display());
        // An engine's view: its own mapping of the file.
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .open(&path)
            .expect("open");
        let engine = memmap2::MmapOptions::new().map_raw(&file).expect("map");
        let source: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 253) as u8).collect();
        let (src_region, _) = a
            .map(source.as_ptr() as u64, source.len() as u64, unkept())
            .expect("map source");
        let peer = a
            .connect(
                b.worker_address.clone(),
                vec![(pool.rkey.clone(), (pool.addr, pool.len))],
            )
            .expect("connect");
        let ops = vec![PutOp {
            local: source.as_ptr() as u64,
            len: source.len() as u64,
            remote: pool.addr,
        }];
        assert_eq!(a.put(peer, vec![src_region], ops, false, T), Ok(1 << 20));
        // SAFETY: the engine mapping holds at least 1 MiB and nothing writes it any more.
        #[allow(unsafe_code)]
        let seen = unsafe { std::slice::from_raw_parts(engine.as_ptr(), 1 << 20) };
        assert!(seen == &source[..], "the engine sees what the peer wrote");
        a.disconnect(peer);
        b.unmap(pool.region);
        let start = Instant::now();
        while path.exists() {
            assert!(start.elapsed() < Duration::from_secs(5), "freeing removes the file");
            thread::sleep(Duration::from_millis(5));
        }
        finish([a, b], &dir);
    }

    /// A UCX worker on its own thread that a test can stop (it stops progressing, like a peer
    /// agent under SIGSTOP: our emulated WRITEs queue), resume, or kill (its worker destroyed).
    /// It exposes one registered target region.
    struct StallablePeer {
        state: std::sync::Arc<std::sync::atomic::AtomicU8>,
        thread: Option<thread::JoinHandle<()>>,
        address: Vec<u8>,
        rkey: Vec<u8>,
        target: u64,
    }

    const RUN: u8 = 0;
    const STOP: u8 = 1;
    const KILL: u8 = 2;

    impl StallablePeer {
        #[allow(unsafe_code)]
        fn start(len: usize, dir: std::path::PathBuf) -> StallablePeer {
            use std::sync::atomic::Ordering;
            let state = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(RUN));
            let st = state.clone();
            let (tx, rx) = mpsc::channel();
            let thread = thread::spawn(move || {
                let context = Context::new(Transport::Shm, Some(&dir)).expect("peer context");
                let worker = Worker::new(&context).expect("peer worker");
                let target = vec![0u8; len];
                // SAFETY: `target` outlives the region (dropped below, after it).
                let region = unsafe { context.map(target.as_ptr().cast_mut(), len) }.expect("peer map");
                let hello = (
                    worker.address().expect("address"),
                    region.packed_rkey().expect("rkey"),
                    target.as_ptr() as u64,
                );
                tx.send(hello).expect("hello");
                loop {
                    match st.load(Ordering::SeqCst) {
                        RUN => {
                            worker.progress();
                        }
                        STOP => thread::sleep(Duration::from_millis(1)),
                        _ => break,
                    }
                }
                drop(worker);
                drop(region);
                drop(target);
            });
            let (address, rkey, target) = rx.recv().expect("the peer started");
            StallablePeer {
                state,
                thread: Some(thread),
                address,
                rkey,
                target,
            }
        }

        fn set(&mut self, to: u8) {
            self.state.store(to, std::sync::atomic::Ordering::SeqCst);
            if to == KILL
                && let Some(t) = self.thread.take()
            {
                t.join().expect("the peer thread");
            }
        }
    }

    impl Drop for StallablePeer {
        fn drop(&mut self) {
            self.set(KILL);
        }
    }

    /// Polls `a`'s orphans until `done` holds (or `within` passes); returns the last answer.
    fn orphans_until(a: &UcxHandle, within: Duration, done: impl Fn(&Orphans) -> bool) -> Orphans {
        let start = Instant::now();
        loop {
            let o = a.orphans(Duration::from_secs(10)).expect("orphans");
            if done(&o) || start.elapsed() > within {
                return o;
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// 64 MiB of WRITEs to a stalled peer over shared memory (emulated: the peer's worker must
    /// progress), a 300 ms deadline, then the engine's pool
    /// released and its mapping dropped: UCX still holds the WRITEs, so the region and its
    /// memory must outlive the release. `then` resumes the peer: UCX completes the requests and
    /// the memory goes.
    fn stalled_peer_then(then: u8) {
        let dir = std::env::temp_dir().join(format!("pdpair-ucx-stalled-{then}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let len: usize = 64 << 20;
        let mut peer = StallablePeer::start(len, dir.clone());
        let a = UcxHandle::start(Transport::Shm, &dir).expect("A");
        let mut source = memmap2::MmapMut::map_anon(len).expect("anonymous memory");
        source.fill(7);
        let base = source.as_ptr() as u64;
        let (region, _) = a.map(base, len as u64, Box::new(source)).expect("map");
        let id = a
            .connect(
                peer.address.clone(),
                vec![(peer.rkey.clone(), (peer.target, len as u64))],
            )
            .expect("connect");
        let (chunk, target) = (8u64 << 20, peer.target);
        let op = |i: u64| PutOp {
            local: base + i * chunk,
            len: chunk,
            remote: target + i * chunk,
        };
        assert_eq!(
            a.put(id, vec![region], vec![op(0)], false, T),
            Ok(chunk),
            "the peer is up"
        );
        peer.set(STOP);
        let stalled = a.put(
            id,
            vec![region],
            (0..8).map(op).collect(),
            false,
            Duration::from_millis(300),
        );
        assert!(matches!(stalled, Err(OpError::Timeout(_))), "{stalled:?}");
        a.unmap(region); // the pool's release; its mapping (`source`) is the UCX thread's now
        // Its memory went: zero pages stand at its addresses (UCX may still read them).
        #[allow(unsafe_code)]
        // SAFETY: the addresses stay mapped while the region is retired (asserted below).
        let now = unsafe { std::slice::from_raw_parts(base as *const u8, 4096) };
        assert!(
            now.iter().all(|b| *b == 0),
            "the retired region still holds the engine's bytes"
        );
        let held = a.orphans(Duration::from_secs(10)).expect("orphans");
        assert!(
            held.requests > 0 && held.retired_bytes == len as u64,
            "UCX still holds the queued WRITEs and their region stays mapped: {held:?}"
        );
        peer.set(then);
        // Resumed, the peer progresses and UCX completes the closed endpoint's queue from the
        // region.
        let after = orphans_until(&a, Duration::from_secs(20), |o| *o == Orphans::default());
        assert_eq!(
            after,
            Orphans::default(),
            "UCX completed the orphans and the memory went"
        );
        assert!(a.alive(Duration::from_secs(2)), "the UCX thread survived");
        drop(peer);
        drop(a);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_get_cut_short_by_its_deadline_is_answered_only_once_ucx_no_longer_writes() {
        // 256 MiB of READs over shared memory with a deadline they cannot meet: the endpoint is
        // closed, and UCX may still complete what it had started, writing into the engine's
        // blocks. The engine must hear the failure only after that (it reuses the blocks).
        let dir = std::env::temp_dir().join(format!("pdpair-ucx-get-deadline-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let len: usize = 256 << 20;
        let peer = StallablePeer::start(len, dir.clone());
        let a = UcxHandle::start(Transport::Shm, &dir).expect("A");
        let blocks = memmap2::MmapMut::map_anon(len).expect("anonymous memory");
        let base = blocks.as_ptr() as u64;
        let (region, _) = a.map(base, len as u64, Box::new(blocks)).expect("map");
        let chunk = 8u64 << 20;
        let ops: Vec<PutOp> = (0..len as u64 / chunk)
            .map(|i| PutOp {
                local: base + i * chunk,
                len: chunk,
                remote: peer.target + i * chunk,
            })
            .collect();
        let mut cut = 0;
        for _ in 0..5 {
            let id = a
                .connect(
                    peer.address.clone(),
                    vec![(peer.rkey.clone(), (peer.target, len as u64))],
                )
                .expect("connect");
            match a.get(id, vec![region], ops.clone(), Duration::from_micros(1)) {
                Err(OpError::Timeout(_)) => cut += 1,
                other => panic!("256 MiB read within 1 us: {other:?}"),
            }
            // Answered: nothing of that read is left with UCX.
            assert_eq!(
                a.orphans(Duration::from_secs(10)).expect("orphans").requests,
                0,
                "answered while UCX still reads"
            );
        }
        assert_eq!(cut, 5);
        drop(peer);
        drop(a);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_stalled_peer_that_resumes_after_its_deadline_reads_nothing_unmapped() {
        stalled_peer_then(RUN);
    }

    // A peer that dies instead: over shared memory (error mode NONE) UCX never fails the queue,
    // so nothing here can end it; UCX's tcp, which did (socket errors), is no longer loaded, and
    // RDMA, which does, cannot run here.
}
