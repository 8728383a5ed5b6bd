//! The path KV took between two engines, as the node agent that moved it observed it: which
//! backend moved the bytes and, for UCX, the transports and devices UCX chose. The agent reports
//! it per peer in the PDEndpoint's status; the operator folds it into the PDPair's
//! `TransferPath` condition and compares it with `spec.transfer.requirePath`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::schema;

/// A class of transfer path: what `spec.transfer.requirePath` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
pub enum PathKind {
    /// RDMA NICs (InfiniBand or RoCE: UCX's rc, dc or ud transports).
    Rdma,
    /// Shared memory between processes on one node (UCX's posix, sysv, cma, xpmem or knem).
    SharedMemory,
    /// Both engines behind one agent: UCX's `self` transport, a copy inside the agent process.
    Local,
    /// GPU to GPU on one node: the agent copies between both engines' GPU memory, opened through
    /// CUDA IPC handles (NVLink or PCIe peer to peer; no host memory on the way).
    CudaIpc,
    /// TCP sockets.
    Tcp,
    /// A transport pdpair does not classify (its lanes say which).
    Other,
}

impl PathKind {
    /// Its name in status, conditions and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            PathKind::Rdma => "Rdma",
            PathKind::SharedMemory => "SharedMemory",
            PathKind::Local => "Local",
            PathKind::CudaIpc => "CudaIpc",
            PathKind::Tcp => "Tcp",
            PathKind::Other => "Other",
        }
    }

    /// How good a path of this class is, for picking the worst of several: RDMA and shared
    /// memory first, TCP and unknown last.
    pub fn rank(self) -> u8 {
        match self {
            PathKind::Rdma | PathKind::SharedMemory | PathKind::Local | PathKind::CudaIpc => 0,
            PathKind::Tcp => 1,
            PathKind::Other => 2,
        }
    }
}

impl std::fmt::Display for PathKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What moved the bytes inside the agent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Backend {
    /// UCX puts and gets between host memory pools.
    #[default]
    UcxHost,
    /// CUDA copies between GPU pools the agent opened through CUDA IPC handles.
    CudaIpc,
    /// The agent's own TCP stream between host memory pools: the receiving agent places every
    /// byte (UCX's tcp transport is never loaded).
    TcpStream,
    /// GPU pools behind two agents: each agent copies between its engine's GPU memory and its
    /// host buffers, piece by piece, and the pieces move over the agents' TCP stream.
    StagedStream,
}

impl Backend {
    /// Its name in status and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::UcxHost => "UcxHost",
            Backend::CudaIpc => "CudaIpc",
            Backend::TcpStream => "TcpStream",
            Backend::StagedStream => "StagedStream",
        }
    }
}

/// The path this engine's transfers to or from one peer took.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TransferPath {
    /// The peer engine, as `engine@agent` (the names from its authenticated handshake).
    #[schemars(length(max = crate::endpoint::MAX_PEER))]
    pub peer: String,
    /// The class of path (the worst of its lanes).
    pub kind: PathKind,
    /// What moved the bytes.
    pub backend: Backend,
    /// The transports and devices that carried the WRITEs or READs, as UCX chose them
    /// (`transport/device`, for example `rc_mlx5/mlx5_0:1`, `posix/memory`, `tcp/eth0`).
    #[schemars(length(max = MAX_PATH_LANES), inner(length(max = MAX_LANE_NAME)))]
    pub lanes: Vec<String>,
    /// Whether UCX had no transport with native remote memory access for this peer and emulated
    /// the WRITEs or READs with messages (as over TCP).
    #[serde(default)]
    pub emulated: bool,
    /// The UCX library version the agent loaded (absent when UCX did not move the bytes).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = MAX_LANE_NAME))]
    pub ucx_version: String,
    /// When the first transfer over this path completed.
    #[schemars(schema_with = "schema::time_required")]
    pub since: Time,
    /// When a transfer over this path last completed, to the minute (the agent refreshes it at
    /// most once a minute). The operator folds only paths used in the last 15 minutes: a peer
    /// that is gone, or whose path changed, no longer speaks for the pair. Absent from agents
    /// before it (their paths count as long as they are listed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::time")]
    pub last_used: Option<Time>,
}

/// How often, at most, an agent refreshes a path's `lastUsed` (each refresh is a status write).
pub const PATH_USED_EVERY_SECONDS: i64 = 60;

/// The most lanes a path lists.
pub const MAX_PATH_LANES: usize = 32;
/// The most characters of a lane's name (and of a UCX version).
pub const MAX_LANE_NAME: usize = 256;

impl TransferPath {
    /// One line for messages: `Tcp (tcp/lo, emulated RMA) with d0@node-b`.
    pub fn describe(&self) -> String {
        let mut lanes = self.lanes.join(", ");
        if self.emulated {
            lanes.push_str(if lanes.is_empty() {
                "emulated RMA"
            } else {
                ", emulated RMA"
            });
        }
        format!("{} ({lanes}) with {}", self.kind, self.peer)
    }
}
