//! pdpair-agent: the node agent.
//!
//! It runs the push handshake between a decode engine's agent and a prefill engine's agent,
//! validates the peers' KV geometry with [`pdpair_api::check_pools`] (the same rule table as the
//! admission webhook), and moves KV blocks with RDMA WRITEs over UCX, verified by KV checksums.

pub mod admin;

/// Locks `m`. A poisoned lock means a panicking thread; the data is still consistent enough to
/// fail requests with, so keep going rather than cascade the panic.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub mod agent;
pub mod api_client;
pub mod attest;
pub mod bench;
pub mod checksum;
pub mod cli;
pub mod engine_api;
pub mod frame_budget;
pub mod gpu_check;
pub mod layout;
pub mod loopback;
pub mod memory;
pub mod metrics;
pub mod outboxes;
pub mod protocol;
pub mod reason;
pub mod synthetic;
pub mod test_engine;
pub mod transport;
pub mod tuning;
pub mod unproven;
pub mod wire;
