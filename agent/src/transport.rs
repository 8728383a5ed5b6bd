//! How bytes move between agents, and what is reported about it.
//!
//! The session state machines (`agent/decode.rs`, `agent/prefill.rs`) plan every transfer as
//! [`PutOp`]s between registered regions and hand them to a [`Backend`], which moves the bytes
//! and says which path they took; the sessions never call UCX (or, later, CUDA) themselves. Today
//! one backend moves KV: UCX puts and gets over host memory ([`ucx`], driven by [`ucx_thread`]),
//! on the transports UCX chooses (`--transport auto`, the default) or the ones `--transport`
//! restricts it to. [`lanes`] reads back which transports and devices UCX chose for each peer,
//! so the path is reported, not assumed. A new backend (CUDA IPC between engines behind one
//! agent, staged copies through pinned host memory) is a new module implementing [`Backend`].

use std::time::{Duration, Instant};

pub mod cuda_ipc;
pub mod host;
pub mod lanes;
pub mod plan;
pub mod stream;
pub mod ucx;
pub mod ucx_probe;
pub mod ucx_thread;

pub use ucx_thread::{OpError, PutOp};

/// The path a backend's transfers with one peer take, as the backend observed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    /// The class of path.
    pub kind: pdpair_api::PathKind,
    /// What moved the bytes.
    pub backend: pdpair_api::Backend,
    /// The lanes that carried the bytes (`transport/device`).
    pub lanes: Vec<String>,
    /// Whether remote memory access was emulated with messages.
    pub emulated: bool,
    /// The library version behind the backend (UCX's; empty for the tcp stream).
    pub version: String,
}

/// What an admission holds (see [`Backend::admit`]): the stream's, or nothing where peers reach
/// memory by keys alone; dropping it revokes it.
#[derive(Debug, Default)]
pub struct Admission(Option<stream::Admission>);

impl Admission {
    /// A stream's admission.
    pub fn stream(a: stream::Admission) -> Admission {
        Admission(Some(a))
    }

    /// Where the admitted peer may write (push) or read (pull), when the backend bounds it per
    /// request (the stream's admissions): the session opens a request's blocks there before it
    /// registers (push) or lends (pull) them, and closes them when the request ends for the
    /// engine or the link.
    pub fn windows(&self) -> Option<std::sync::Arc<stream::Windows>> {
        self.0.as_ref().map(|a| a.windows.clone())
    }
}

/// What moves a session's bytes. Peers are ids the backend hands out at [`Backend::connect`];
/// regions are ids of memory registered with it (see `crate::memory::pool`). Every op is checked
/// by the backend against those regions and the peer's, whatever the session planned.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Which backend this is, for status and metrics.
    fn kind(&self) -> pdpair_api::Backend;

    /// What a peer needs to reach this backend (UCX: the worker address).
    fn address(&self) -> Vec<u8>;

    /// Whether a peer's `address` may be handed to [`Backend::connect`] (UCX: it passed the probe,
    /// [`ucx_probe`]); `connect` asks again (a remembered address is answered at once).
    fn vet_address(&self, _address: &[u8]) -> Result<(), String> {
        Ok(())
    }

    /// Connects to a peer at `address` whose regions are `remotes` (key, (address, bytes)).
    /// `key` is the side-channel session's stream key: a backend whose peer places the bytes
    /// (the tcp stream) proves with it that this is the peer the session authenticated, by
    /// `by` (the handshake's deadline: connecting is part of setting up the link, which the
    /// pair's `handshakeTimeout` bounds).
    fn connect(
        &self,
        address: Vec<u8>,
        remotes: Vec<(Vec<u8>, (u64, u64))>,
        key: &[u8; 32],
        by: Instant,
    ) -> Result<u64, String>;

    /// Lets the peer of a session (holding `key`) reach the local `regions` with `access`,
    /// where this backend's peers reach memory through it (the tcp stream); until the returned
    /// value drops. Backends whose memory is reached by keys alone (UCX, CUDA IPC) need nothing.
    fn admit(&self, _key: &[u8; 32], _regions: &[u64], _access: stream::Access) -> Result<Admission, String> {
        Ok(Admission::default())
    }

    /// Drops a peer (what is in flight to it fails).
    fn disconnect(&self, peer: u64);

    /// Writes `ops` from the local `regions` into the peer's, within `within`; bytes written.
    /// `corrupt` flips a byte in flight (fault injection for tests).
    fn put(
        &self,
        peer: u64,
        regions: Vec<u64>,
        ops: Vec<PutOp>,
        corrupt: bool,
        within: Duration,
    ) -> Result<u64, OpError>;

    /// Reads `ops` from the peer's regions into the local `regions`, within `within`; bytes read.
    fn get(&self, peer: u64, regions: Vec<u64>, ops: Vec<PutOp>, within: Duration) -> Result<u64, OpError>;

    /// The path transfers with `peer` take.
    fn observe(&self, peer: u64) -> Result<Observed, String>;

    /// Whether the backend answers within `within` (for readiness).
    fn alive(&self, within: Duration) -> bool;
}

impl Backend for ucx_thread::UcxHandle {
    fn kind(&self) -> pdpair_api::Backend {
        pdpair_api::Backend::UcxHost
    }

    fn address(&self) -> Vec<u8> {
        self.worker_address.clone()
    }

    fn vet_address(&self, address: &[u8]) -> Result<(), String> {
        ucx_thread::UcxHandle::vet_address(self, address)
    }

    fn connect(
        &self,
        address: Vec<u8>,
        remotes: Vec<(Vec<u8>, (u64, u64))>,
        _key: &[u8; 32],
        _by: Instant,
    ) -> Result<u64, String> {
        ucx_thread::UcxHandle::connect(self, address, remotes)
    }

    fn disconnect(&self, peer: u64) {
        ucx_thread::UcxHandle::disconnect(self, peer);
    }

    fn put(
        &self,
        peer: u64,
        regions: Vec<u64>,
        ops: Vec<PutOp>,
        corrupt: bool,
        within: Duration,
    ) -> Result<u64, OpError> {
        ucx_thread::UcxHandle::put(self, peer, regions, ops, corrupt, within)
    }

    fn get(&self, peer: u64, regions: Vec<u64>, ops: Vec<PutOp>, within: Duration) -> Result<u64, OpError> {
        ucx_thread::UcxHandle::get(self, peer, regions, ops, within)
    }

    fn observe(&self, peer: u64) -> Result<Observed, String> {
        let lanes = self.lanes(peer)?;
        Ok(Observed {
            kind: lanes.kind(),
            backend: pdpair_api::Backend::UcxHost,
            emulated: lanes.carrying().1,
            lanes: lanes.names(),
            version: ucx::version(),
        })
    }

    fn alive(&self, within: Duration) -> bool {
        ucx_thread::UcxHandle::alive(self, within)
    }
}
