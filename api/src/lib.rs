//! pdpair-api: the `PDPair` custom resource, KV geometry, and the compatibility rule table.
//!
//! Pure but for [`ListenAddr::bind`] and [`budget`]'s shutting down of connections: no other
//! I/O and no async. The operator's admission webhook, its controller and the node
//! agent's handshake all call [`check`] (or [`check_pools`]), so a pair admitted on paper is a
//! pair the agents accept at run time.

pub mod budget;
pub mod checksum;
mod duration;
mod endpoint;
mod listen;
mod names;
mod path;
pub mod rules;
mod schema;
mod types;

pub use duration::{DURATION_PATTERN, Duration, DurationError};
pub use endpoint::*;
pub use listen::ListenAddr;
pub use names::{check_dns1123_label, check_dns1123_subdomain};
pub use path::{Backend, PATH_USED_EVERY_SECONDS, PathKind, TransferPath};
pub use rules::{Reason, Verdict, Violation, check, check_admission, check_pools};
pub use types::*;
