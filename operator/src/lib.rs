//! pdpair-operator: the CRDs, the manifest linter (`validate`), the admission webhook and the
//! PDPair controller. The binary in `main.rs` only parses the command line and calls in here.
//!
//! Pure parts, tested with fixtures: [`plan`] (children), [`status`] (conditions and
//! transitions), [`webhook::review`]. The rest is thin I/O around them.

pub mod admin;
pub mod controller;
pub mod crd;
pub mod events;
pub mod install;
pub mod lease;
pub mod metrics;
pub mod names;
pub mod plan;
pub mod run;
pub mod server;
pub mod status;
#[cfg(test)]
mod test_api;
pub mod tls;
pub mod validate;
pub mod webhook;
