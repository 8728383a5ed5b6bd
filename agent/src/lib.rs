//! pdpair-agent: the node agent.
//!
//! It will run the push handshake between a decode engine's agent and a prefill engine's agent,
//! validate the peers' KV geometry with [`pdpair_api::check_pools`] (the same rule table as the
//! admission webhook), and move KV blocks with RDMA WRITEs over UCX. This crate is a skeleton
//! until the node agent issue lands; it already depends on the one rule table it must call.

pub use pdpair_api::{Verdict, check_pools};
