//! A synthetic engine for the loopback scenario and tests: a real client of the engine API with
//! a real shared-memory KV pool. Prefill fills blocks with bytes that depend only on (request,
//! layer, global head, token position, K/V, byte), so decode can check every received byte
//! without trusting the checksums.

use std::{
    fs::File,
    os::{fd::AsFd, unix::net::UnixStream},
    path::Path,
};

use pdpair_api::{ChecksumPolicy, KvGeometry, Parallelism, Role, TransferMode};

pub mod gpu;

use crate::{
    engine_api::{AgentEvent, EngineRequest, PoolRegistration},
    layout::PoolLayout,
    wire::{self, FrameError, hex_bytes},
};

/// The prompt digest of a synthetic request: its KV depends only on the pattern's seed and its
/// token count, so that is its "prompt" (both synthetic engines of a request derive the same).
pub fn prompt(seed: u64, num_tokens: u64) -> crate::engine_api::PromptDigest {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"pdpair synthetic prompt\0");
    h.update(seed.to_le_bytes());
    h.update(num_tokens.to_le_bytes());
    crate::engine_api::PromptDigest(h.finalize().into())
}

/// What the engine needs to register.
#[derive(Clone, Debug)]
pub struct EngineSpec {
    /// `namespace/name`.
    pub pdpair: String,
    /// Role.
    pub role: Role,
    /// Engine id.
    pub engine: String,
    /// Transfer mode.
    pub mode: TransferMode,
    /// Checksum policy.
    pub checksum: ChecksumPolicy,
    /// Handshake timeout.
    pub handshake_timeout_ms: u64,
    /// Lease.
    pub lease_ms: u64,
    /// Parallelism.
    pub parallelism: Parallelism,
    /// Geometry.
    pub kv: KvGeometry,
    /// Pairing secret.
    pub pairing_key: Vec<u8>,
    /// Blocks in the pool.
    pub num_blocks: u32,
    /// Tensor-parallel rank.
    pub tensor_rank: u32,
    /// Who allocates the pool.
    pub memory: EngineMemory,
    /// K and V arrays, or K and V per block, in a one-region pool (absent: the default for the
    /// geometry).
    pub arrangement: Option<crate::layout::KvArrangement>,
    /// The pool's regions (empty: one for every layer).
    pub regions: Vec<crate::engine_api::RegionRequest>,
}

impl EngineSpec {
    /// An engine of PDPair `pair` (its `namespace/name` and transfer settings) running `pool`'s
    /// geometry and parallelism: its pool allocated by the agent, K and V arrays first.
    pub fn of_pair(
        pair: &pdpair_api::PDPair,
        pool: &pdpair_api::PoolSpec,
        role: Role,
        engine: String,
        pairing_key: &[u8],
        num_blocks: u32,
        tensor_rank: u32,
    ) -> EngineSpec {
        let t = &pair.spec.transfer;
        EngineSpec {
            pdpair: format!(
                "{}/{}",
                pair.metadata.namespace.as_deref().unwrap_or("default"),
                pair.metadata.name.as_deref().unwrap_or("pair")
            ),
            role,
            engine,
            mode: t.mode,
            checksum: t.checksum,
            handshake_timeout_ms: t.handshake_timeout.get().as_millis() as u64,
            lease_ms: t.lease_duration.get().as_millis() as u64,
            parallelism: pool.parallelism.clone(),
            kv: pool.kv.clone(),
            pairing_key: pairing_key.to_vec(),
            num_blocks,
            tensor_rank,
            memory: EngineMemory::Agent,
            arrangement: None,
            regions: Vec::new(),
        }
    }
}

/// Who allocates a synthetic engine's pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EngineMemory {
    /// The agent (`memory_fd: false`; the engine maps the descriptor that comes with
    /// `Registered`).
    #[default]
    Agent,
    /// The engine: a memfd it creates, seals against shrinking, and sends with `RegisterPool`.
    Engine,
}

/// A registered synthetic engine.
#[derive(Debug)]
pub struct SyntheticEngine {
    stream: UnixStream,
    /// Its pool layout.
    pub layout: PoolLayout,
    /// One mapping per region.
    maps: Vec<memmap2::MmapMut>,
    /// The regions' descriptors (the engine's memfds, or the ones the agent passed).
    pools: Vec<File>,
    /// Side-channel address the agent gave it.
    pub address: String,
    /// The longest the agent says it holds an offered request, renewals included, in ms
    /// (`Registered.hold_ms`).
    pub hold_ms: u64,
}

impl SyntheticEngine {
    /// Connects to the agent at `socket` and registers, with a pool the agent allocates or (see
    /// [`EngineSpec::memory`]) a sealed memfd it creates. `_dir` is unused (pools are
    /// descriptors, not files in a directory). `Err` carries the agent's message when it
    /// refuses the registration.
    pub fn register(socket: &Path, _dir: &Path, spec: &EngineSpec) -> Result<SyntheticEngine, String> {
        Self::register_in_pod(socket, _dir, spec, None)
    }

    /// Like [`SyntheticEngine::register`], naming the engine's Pod (the agent then publishes a
    /// PDEndpoint owned by it).
    pub fn register_in_pod(
        socket: &Path,
        _dir: &Path,
        spec: &EngineSpec,
        pod: Option<String>,
    ) -> Result<SyntheticEngine, String> {
        let reg = Self::registration(spec, pod, spec.memory == EngineMemory::Engine);
        Self::register_as(socket, reg)
    }

    /// Registers `reg` as it is (an engine in a cluster leaves out what the agent fills from the
    /// PDPair); `reg.memory_fd` says who allocates the pool.
    pub fn register_as(socket: &Path, reg: PoolRegistration) -> Result<SyntheticEngine, String> {
        let layout = reg.layout().map_err(|e| e.to_string())?;
        let lens = layout.region_lens();
        let own = if reg.memory_fd {
            lens.iter()
                .map(|len| crate::memory::pool::backed_memfd(*len))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            Vec::new()
        };
        let stream = UnixStream::connect(socket).map_err(|e| format!("connecting to {}: {e}", socket.display()))?;
        let request = EngineRequest::RegisterPool(Box::new(reg));
        let fds: Vec<_> = own.iter().map(AsFd::as_fd).collect();
        wire::write_frame_fds(&stream, &request, &fds).map_err(|e| e.to_string())?;
        let (answer, fds) = wire::read_frame_fds::<AgentEvent>(&stream, wire::MAX_FRAME).map_err(|e| e.to_string())?;
        match answer {
            AgentEvent::Registered {
                address,
                memory_len,
                region_lens,
                hold_ms,
                ..
            } => {
                let pools = if own.is_empty() {
                    fds.into_iter().map(File::from).collect()
                } else {
                    own
                };
                if pools.len() != lens.len() {
                    return Err(format!(
                        "the pool has {} regions; the agent passed {} descriptors",
                        lens.len(),
                        pools.len()
                    ));
                }
                let maps = pools.iter().map(map_and_touch).collect::<Result<Vec<_>, _>>()?;
                let says: Vec<usize> = region_lens.iter().map(|l| *l as usize).collect();
                if maps.iter().zip(&lens).any(|(m, l)| m.len() < *l)
                    || says != lens
                    || memory_len != layout.pool_len() as u64
                {
                    return Err(format!(
                        "the agent's regions hold {:?} bytes (says {says:?}, {memory_len} in all); the layout needs {lens:?}",
                        maps.iter().map(|m| m.len()).collect::<Vec<_>>(),
                    ));
                }
                Ok(SyntheticEngine {
                    stream,
                    layout,
                    maps,
                    pools,
                    address,
                    hold_ms,
                })
            }
            AgentEvent::RegistrationFailed { message, .. } => Err(message),
            other => Err(format!("unexpected answer to RegisterPool: {other:?}")),
        }
    }

    /// The registration an engine with `spec` sends.
    pub fn registration(spec: &EngineSpec, pod: Option<String>, memory_fd: bool) -> PoolRegistration {
        PoolRegistration {
            api_version: crate::engine_api::API_VERSION,
            pdpair: spec.pdpair.clone(),
            role: spec.role,
            engine: spec.engine.clone(),
            pod,
            mode: Some(spec.mode),
            checksum: Some(spec.checksum),
            handshake_timeout_ms: Some(spec.handshake_timeout_ms),
            lease_ms: Some(spec.lease_ms),
            parallelism: spec.parallelism.clone(),
            kv: spec.kv.clone(),
            pairing_key: hex_bytes::encode(&spec.pairing_key),
            memory_fd,
            memory_path: None,
            num_blocks: spec.num_blocks,
            tensor_rank: spec.tensor_rank,
            instance: None,
            pod_engines: None,
            kv_arrangement: spec.arrangement,
            regions: spec.regions.clone(),
            gpu: None,
            staging: None,
            address: None,
        }
    }

    /// The engine's mapping of its pool's region `r`.
    pub fn region(&self, r: usize) -> &[u8] {
        &self.maps[r]
    }

    /// The engine's mapping of region `r`, to write (what its KV cache is).
    pub fn region_mut(&mut self, r: usize) -> &mut [u8] {
        &mut self.maps[r]
    }

    /// Region `r`'s descriptor (what a hostile engine would truncate).
    pub fn pool_file(&self, r: usize) -> &File {
        &self.pools[r]
    }

    /// Sends one request to the agent.
    pub fn send(&mut self, request: &EngineRequest) -> Result<(), FrameError> {
        wire::write_frame(&mut self.stream, request)
    }

    /// Waits for the next event.
    pub fn next_event(&mut self) -> Result<AgentEvent, FrameError> {
        wire::read_frame(&mut self.stream)
    }

    /// Waits at most `within` for each event from now on ([`SyntheticEngine::next_event`] then
    /// fails), on this handle and every other of the socket.
    pub fn wait_events_for(&self, within: std::time::Duration) -> std::io::Result<()> {
        self.stream.set_read_timeout(Some(within))
    }

    /// A second handle on the socket for a reader thread.
    pub fn events(&self) -> std::io::Result<UnixStream> {
        self.stream.try_clone()
    }

    /// Prefill: writes the request's KV into its blocks.
    pub fn fill(&mut self, seed: u64, blocks: &[u32], first_token: u64, num_tokens: u64) {
        let mut maps: Vec<&mut [u8]> = self.maps.iter_mut().map(|m| &mut m[..]).collect();
        fill_into(&self.layout, &mut maps, seed, blocks, first_token, num_tokens);
    }

    /// Decode: zeroes blocks before a request, so stale bytes cannot pass verification.
    pub fn clear(&mut self, blocks: &[u32]) {
        for block in blocks {
            for l in 0..self.layout.layers {
                for (r, at, len) in self.layout.block_extents(l, *block) {
                    self.maps[r][at..at + len].fill(0);
                }
            }
        }
    }

    /// Decode: counts the received tokens whose bytes differ from what prefill computed.
    pub fn verify(&self, seed: u64, blocks: &[u32], first_token: u64, num_tokens: u64) -> u64 {
        let maps: Vec<&[u8]> = self.maps.iter().map(|m| &m[..]).collect();
        verify_in(&self.layout, &maps, seed, blocks, first_token, num_tokens)
    }
}

/// Writes a request's KV (what prefill computed for `seed`) into `blocks` of a pool laid out as
/// `layout`, one slice per region.
pub fn fill_into(
    layout: &PoolLayout,
    maps: &mut [&mut [u8]],
    seed: u64,
    blocks: &[u32],
    first_token: u64,
    num_tokens: u64,
) {
    let half = layout.half_token();
    let mut writes = Vec::new();
    for_each_token(layout, blocks, first_token, num_tokens, |at, l, h, t, v| {
        writes.push((at, l, h, t, v))
    });
    for ((r, at), l, h, t, v) in writes {
        token_bytes(seed, l, h, t, v, &mut maps[r][at..at + half]);
    }
}

/// Counts the tokens of `blocks` whose bytes differ from what prefill computed for `seed`.
pub fn verify_in(
    layout: &PoolLayout,
    maps: &[&[u8]],
    seed: u64,
    blocks: &[u32],
    first_token: u64,
    num_tokens: u64,
) -> u64 {
    let half = layout.half_token();
    let mut expected = vec![0u8; half];
    let mut bad = 0u64;
    for_each_token(layout, blocks, first_token, num_tokens, |(r, at), l, h, t, v| {
        token_bytes(seed, l, h, t, v, &mut expected);
        if maps[r][at..at + half] != expected[..] {
            bad += 1;
        }
    });
    bad
}
fn token_bytes(seed: u64, layer: u32, head: u32, token: u64, v: bool, out: &mut [u8]) {
    let mut x = seed
        ^ (u64::from(layer) << 52)
        ^ (u64::from(head) << 40)
        ^ token.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ u64::from(v);
    for chunk in out.chunks_mut(8) {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let bytes = z.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

fn for_each_token(
    layout: &PoolLayout,
    blocks: &[u32],
    first_token: u64,
    num_tokens: u64,
    mut f: impl FnMut((usize, usize), u32, u32, u64, bool),
) {
    let b = u64::from(layout.block_size);
    for (i, block) in blocks.iter().enumerate() {
        for j in 0..layout.block_size {
            let t = first_token + i as u64 * b + u64::from(j);
            if t >= num_tokens {
                return;
            }
            for l in 0..layout.layers {
                for h in 0..layout.local_heads {
                    for v in layout.arrays() {
                        let (r, at) = layout.block_offset(l, *v, *block);
                        f((r, at + layout.token_offset(l, h, j)), l, layout.head_offset + h, t, *v);
                    }
                }
            }
        }
    }
}

/// Maps a pool file and touches every page, as an engine that allocated its KV cache at startup
/// has: the memory exists before any transfer.
fn map_and_touch(file: &File) -> Result<memmap2::MmapMut, String> {
    #[allow(unsafe_code)]
    // SAFETY: a pool file shared with the agent, which maps it too: that is the point.
    let mut map = unsafe { memmap2::MmapMut::map_mut(file) }.map_err(|e| format!("mapping the pool: {e}"))?;
    for page in map.chunks_mut(4096) {
        page[0] = 0;
    }
    Ok(map)
}
