//! What moves host pools: UCX (RDMA between nodes, shared memory with `--transport shm`, `self`
//! between two engines behind this agent) or, where the agent runs the tcp stream
//! (`--transport tcp`, or `auto` where UCX found no RDMA device), the stream for every peer
//! but its own engines, which still meet through UCX's `self`.
//!
//! An agent runs one of the two for its peers, and says which in its address: a peer that
//! offers the other is refused at connect, naming both, so nothing falls back silently.

use std::{
    collections::HashMap,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use crate::{
    lock,
    transport::{
        Admission, Backend, Observed, OpError, PutOp,
        stream::{self, Access, Stream},
        ucx_thread::UcxHandle,
    },
};

#[derive(Clone, Copy, Debug)]
enum Route {
    Ucx(u64),
    Stream(u64),
}

/// The host-memory backend of an agent.
#[derive(Debug)]
pub struct Host {
    ucx: UcxHandle,
    stream: Option<Stream>,
    routes: Mutex<HashMap<u64, Route>>,
    next: AtomicU64,
}

impl Host {
    /// UCX for every peer, or the `stream` for every peer but this agent's own engines.
    pub fn new(ucx: UcxHandle, stream: Option<Stream>) -> Host {
        Host {
            ucx,
            stream,
            routes: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        }
    }

    /// The stream, when this agent runs one.
    pub fn stream(&self) -> Option<&Stream> {
        self.stream.as_ref()
    }

    fn route(&self, peer: u64) -> Result<Route, String> {
        lock(&self.routes)
            .get(&peer)
            .copied()
            .ok_or_else(|| format!("unknown peer {peer}"))
    }

    fn mismatch(&self, peer_streams: bool) -> String {
        let ours = if self.stream.is_some() {
            "this agent moves KV over its tcp stream (--transport tcp, or auto without an RDMA device)"
        } else {
            "this agent moves KV over UCX (--transport auto with an RDMA device, or shm)"
        };
        let theirs = if peer_streams {
            "the peer offers its tcp stream"
        } else {
            "the peer offers a UCX worker address"
        };
        format!("{theirs}, but {ours}: run both agents with transports that meet")
    }
}

impl Backend for Host {
    fn kind(&self) -> pdpair_api::Backend {
        match self.stream {
            Some(_) => pdpair_api::Backend::TcpStream,
            None => pdpair_api::Backend::UcxHost,
        }
    }

    fn address(&self) -> Vec<u8> {
        match &self.stream {
            Some(s) => s.address(),
            None => self.ucx.worker_address.clone(),
        }
    }

    fn vet_address(&self, address: &[u8]) -> Result<(), String> {
        match (&self.stream, stream::is_stream_address(address)) {
            (Some(_), true) => stream::parse_address(address).map(|_| ()),
            (None, false) => self.ucx.vet_address(address),
            (_, peer_streams) => Err(self.mismatch(peer_streams)),
        }
    }

    fn connect(
        &self,
        address: Vec<u8>,
        remotes: Vec<(Vec<u8>, (u64, u64))>,
        key: &[u8; 32],
        by: Instant,
    ) -> Result<u64, String> {
        let route = match &self.stream {
            // Our own engines: UCX's self (a copy in this process).
            Some(s) if address == s.address() => {
                Route::Ucx(self.ucx.connect(self.ucx.worker_address.clone(), remotes)?)
            }
            Some(s) if stream::is_stream_address(&address) => {
                Route::Stream(s.connect_by(&address, remotes.into_iter().map(|(_, r)| r).collect(), key, by)?)
            }
            None if !stream::is_stream_address(&address) => Route::Ucx(self.ucx.connect(address, remotes)?),
            _ => return Err(self.mismatch(stream::is_stream_address(&address))),
        };
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.routes).insert(id, route);
        Ok(id)
    }

    fn admit(&self, key: &[u8; 32], regions: &[u64], access: Access) -> Result<Admission, String> {
        match &self.stream {
            Some(s) => Ok(Admission::stream(s.admit(key, regions, access)?)),
            None => Ok(Admission::default()),
        }
    }

    fn disconnect(&self, peer: u64) {
        match lock(&self.routes).remove(&peer) {
            Some(Route::Ucx(id)) => self.ucx.disconnect(id),
            Some(Route::Stream(id)) => {
                if let Some(s) = &self.stream {
                    s.disconnect(id);
                }
            }
            None => {}
        }
    }

    fn put(
        &self,
        peer: u64,
        regions: Vec<u64>,
        ops: Vec<PutOp>,
        corrupt: bool,
        within: Duration,
    ) -> Result<u64, OpError> {
        match (self.route(peer).map_err(OpError::Failed)?, &self.stream) {
            (Route::Ucx(id), _) => self.ucx.put(id, regions, ops, corrupt, within),
            (Route::Stream(id), Some(s)) => s.put(id, &regions, &ops, corrupt, within),
            (Route::Stream(_), None) => Err(OpError::Failed("no stream".into())),
        }
    }

    fn get(&self, peer: u64, regions: Vec<u64>, ops: Vec<PutOp>, within: Duration) -> Result<u64, OpError> {
        match (self.route(peer).map_err(OpError::Failed)?, &self.stream) {
            (Route::Ucx(id), _) => self.ucx.get(id, regions, ops, within),
            (Route::Stream(id), Some(s)) => s.get(id, &regions, &ops, within),
            (Route::Stream(_), None) => Err(OpError::Failed("no stream".into())),
        }
    }

    fn observe(&self, peer: u64) -> Result<Observed, String> {
        match (self.route(peer)?, &self.stream) {
            (Route::Ucx(id), _) => Backend::observe(&self.ucx, id),
            (Route::Stream(id), Some(s)) => s.observe(id),
            (Route::Stream(_), None) => Err("no stream".into()),
        }
    }

    fn alive(&self, within: Duration) -> bool {
        self.ucx.alive(within)
    }
}
