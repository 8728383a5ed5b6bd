//! Connections that have not proved themselves yet: the side channel's before `AuthOk`, the KV
//! stream's before its admission proof. Anyone who reaches a port can open them, so they hold a
//! bounded budget, per source address and in all. A full budget does not lock peers out: a
//! connection from a source holding fewer than the source that holds the most takes the place of
//! that source's oldest one (which is shut down). So a few addresses holding slots open, slowly,
//! cannot keep a peer from its handshake; it takes as many addresses as the budget has slots,
//! each holding one.
//!
//! The budget itself is [`pdpair_api::budget`], shared with the operator's HTTP servers.

pub use pdpair_api::budget::{Budget, Slot, source};
