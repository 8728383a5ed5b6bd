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

use crate::ucx::{Context, Endpoint, MemRegion, RemoteKey, Transport, Worker};

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

/// Empty progress polls in a row before a spinning thread yields its CPU.
pub const QUIET_POLLS_BEFORE_YIELD: u32 = 256;

/// Requests to the UCX thread.
#[derive(Debug)]
pub enum Command {
    /// Register `len` bytes at `addr` (memory the caller keeps mapped until `Unmap`).
    Map {
        /// Address.
        addr: u64,
        /// Length.
        len: u64,
        /// (region id, packed rkey).
        reply: Reply<(u64, Vec<u8>)>,
    },
    /// Unregister a region.
    Unmap {
        /// Region id.
        region: u64,
    },
    /// Connect to a peer worker and unpack its key.
    Connect {
        /// The peer's worker address.
        worker_address: Vec<u8>,
        /// The peer's packed rkey.
        rkey: Vec<u8>,
        /// Peer id.
        reply: Reply<u64>,
    },
    /// Post WRITEs to a peer, wait for them, flush; `corrupt` flips one byte of the first op's
    /// data in flight (a fault-injection flag for tests).
    Put {
        /// Peer id.
        peer: u64,
        /// The local region the ops read from (its registration is reused).
        region: u64,
        /// The WRITEs.
        ops: Vec<PutOp>,
        /// Flip a byte of the first op in flight.
        corrupt: bool,
        /// Bytes written.
        reply: Reply<u64>,
    },
    /// Post READs from a peer (`local` is the destination, `remote` the source) and wait for
    /// them: a completed get has its data here.
    Get {
        /// Peer id.
        peer: u64,
        /// The local region the ops write into (its registration is reused).
        region: u64,
        /// The READs.
        ops: Vec<PutOp>,
        /// Bytes read.
        reply: Reply<u64>,
    },
    /// Close a peer's endpoint.
    Disconnect {
        /// Peer id.
        peer: u64,
    },
}

/// A handle to the UCX thread.
#[derive(Clone, Debug)]
pub struct UcxHandle {
    tx: Sender<Command>,
    /// This worker's address.
    pub worker_address: Vec<u8>,
}

impl UcxHandle {
    /// Starts the thread. Fails when UCX cannot start on `transport`.
    pub fn start(transport: Transport) -> Result<UcxHandle, String> {
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        thread::Builder::new()
            .name("ucx".into())
            .spawn(move || {
                let setup = Context::new(transport).and_then(|c| Worker::new(&c).map(|w| (c, w)));
                match setup {
                    Ok((context, worker)) => match worker.address() {
                        Ok(addr) => {
                            let _ = ready_tx.send(Ok(addr));
                            run(context, worker, rx);
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
        let worker_address = ready_rx.recv().map_err(|_| "the UCX thread died".to_owned())??;
        Ok(UcxHandle { tx, worker_address })
    }

    fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, String> {
        let (reply, rx) = mpsc::channel();
        self.tx
            .send(make(reply))
            .map_err(|_| "the UCX thread is gone".to_owned())?;
        rx.recv().map_err(|_| "the UCX thread dropped a request".to_owned())?
    }

    /// See [`Command::Map`].
    pub fn map(&self, addr: u64, len: u64) -> Result<(u64, Vec<u8>), String> {
        self.call(|reply| Command::Map { addr, len, reply })
    }

    /// See [`Command::Unmap`].
    pub fn unmap(&self, region: u64) {
        let _ = self.tx.send(Command::Unmap { region });
    }

    /// See [`Command::Connect`].
    pub fn connect(&self, worker_address: Vec<u8>, rkey: Vec<u8>) -> Result<u64, String> {
        self.call(|reply| Command::Connect {
            worker_address,
            rkey,
            reply,
        })
    }

    /// See [`Command::Put`].
    pub fn put(&self, peer: u64, region: u64, ops: Vec<PutOp>, corrupt: bool) -> Result<u64, String> {
        self.call(|reply| Command::Put {
            peer,
            region,
            ops,
            corrupt,
            reply,
        })
    }

    /// See [`Command::Get`].
    pub fn get(&self, peer: u64, region: u64, ops: Vec<PutOp>) -> Result<u64, String> {
        self.call(|reply| Command::Get {
            peer,
            region,
            ops,
            reply,
        })
    }

    /// See [`Command::Disconnect`].
    pub fn disconnect(&self, peer: u64) {
        let _ = self.tx.send(Command::Disconnect { peer });
    }
}

struct Peer {
    ep: Endpoint,
    rkey: RemoteKey,
}

fn run(context: Context, worker: Worker, rx: Receiver<Command>) {
    let mut regions: HashMap<u64, MemRegion> = HashMap::new();
    let mut peers: HashMap<u64, Peer> = HashMap::new();
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
        let wait = if idle_since.elapsed() < Duration::from_millis(5) {
            Duration::ZERO
        } else {
            Duration::from_micros(200)
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
            Command::Map { addr, len, reply } => {
                // SAFETY: the caller keeps addr..addr+len mapped until it sends Unmap.
                let result = unsafe_map(&context, addr, len).and_then(|r| {
                    let key = r.packed_rkey().map_err(|e| e.to_string())?;
                    let id = next_id;
                    next_id += 1;
                    regions.insert(id, r);
                    Ok((id, key))
                });
                let _ = reply.send(result);
            }
            Command::Unmap { region } => {
                regions.remove(&region);
            }
            Command::Connect {
                worker_address,
                rkey,
                reply,
            } => {
                let result = worker
                    .connect(&worker_address)
                    .map_err(|e| e.to_string())
                    .and_then(|ep| {
                        let rkey = ep.unpack_rkey(&rkey).map_err(|e| e.to_string())?;
                        let id = next_id;
                        next_id += 1;
                        peers.insert(id, Peer { ep, rkey });
                        Ok(id)
                    });
                let _ = reply.send(result);
            }
            Command::Get {
                peer,
                region,
                ops,
                reply,
            } => {
                let result = match peers.get(&peer) {
                    Some(p) => get_all(p, regions.get(&region), &ops),
                    None => Err(format!("unknown peer {peer}")),
                };
                let _ = reply.send(result);
            }
            Command::Put {
                peer,
                region,
                ops,
                corrupt,
                reply,
            } => {
                let result = match peers.get(&peer) {
                    Some(p) => put_all(p, regions.get(&region), &ops, corrupt),
                    None => Err(format!("unknown peer {peer}")),
                };
                let _ = reply.send(result);
            }
            Command::Disconnect { peer } => {
                peers.remove(&peer); // force-closed on drop
            }
        }
    }
    drop(peers);
    drop(regions);
}

#[allow(unsafe_code)]
fn unsafe_map(context: &Context, addr: u64, len: u64) -> Result<MemRegion, String> {
    // SAFETY: see Command::Map: the memory stays mapped until Unmap removes the region.
    unsafe { context.map(addr as *mut u8, len as usize) }.map_err(|e| e.to_string())
}

#[allow(unsafe_code)]
fn put_all(peer: &Peer, region: Option<&MemRegion>, ops: &[PutOp], corrupt: bool) -> Result<u64, String> {
    let mut scratch: Option<Vec<u8>> = None;
    let mut pending = Vec::new();
    let mut bytes = 0u64;
    for (i, op) in ops.iter().enumerate() {
        // SAFETY: `local` lies in memory this agent mapped for the engine, kept mapped while the
        // engine is registered (and a registered engine's transfer holds its state alive).
        let mut data = unsafe { std::slice::from_raw_parts(op.local as *const u8, op.len as usize) };
        let mut registered = region;
        if corrupt && i == 0 && !data.is_empty() {
            registered = None;
            let mut copy = data.to_vec();
            let at = copy.len() / 2;
            copy[at] ^= 0x5a;
            scratch = Some(copy);
            data = scratch.as_deref().unwrap_or(data);
        }
        // SAFETY: `data` stays valid until the flush below returns; the remote range was derived
        // from the peer's registered region.
        match unsafe { peer.ep.put(data, op.remote, &peer.rkey, registered) } {
            Ok(Some(req)) => pending.push(req),
            Ok(None) => {}
            Err(e) => return Err(e.to_string()),
        }
        bytes += op.len;
    }
    for req in pending {
        peer.ep.wait(req, || {}).map_err(|e| e.to_string())?;
    }
    peer.ep.flush(|| {}).map_err(|e| e.to_string())?;
    drop(scratch);
    Ok(bytes)
}

#[allow(unsafe_code)]
fn get_all(peer: &Peer, region: Option<&MemRegion>, ops: &[PutOp]) -> Result<u64, String> {
    let mut pending = Vec::new();
    let mut bytes = 0u64;
    for op in ops {
        // SAFETY: `local` lies in memory this agent mapped for the engine and registered as
        // `region`, kept mapped while the engine is registered; the remote range was derived from
        // the peer's registered region.
        match unsafe {
            peer.ep
                .get(op.local as *mut u8, op.len as usize, op.remote, &peer.rkey, region)
        } {
            Ok(Some(req)) => pending.push(req),
            Ok(None) => {}
            Err(e) => return Err(e.to_string()),
        }
        bytes += op.len;
    }
    for req in pending {
        peer.ep.wait(req, || {}).map_err(|e| e.to_string())?;
    }
    Ok(bytes)
}
