//! pdpair-operator: the CRDs, the manifest linter (`validate`), and (later) the admission webhook
//! and the controller. The binary in `main.rs` only parses the command line and calls in here.

pub mod crd;
pub mod validate;
