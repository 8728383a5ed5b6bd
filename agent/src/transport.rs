//! How bytes move between agents, and what is reported about it. Today one backend moves KV:
//! UCX puts and gets over host memory ([`crate::transport::ucx`], driven by [`crate::transport::ucx_thread`]), on the
//! transports UCX chooses (`--transport auto`, the default) or the ones `--transport` restricts
//! it to. [`lanes`] reads back which transports and devices UCX chose for each peer, so the path
//! is reported, not assumed.

pub mod lanes;
pub mod ucx;
pub mod ucx_thread;
