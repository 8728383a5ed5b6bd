//! KV checksums over a pool's blocks, as `pdpair_api::checksum` defines them: [`cpu`] computes
//! them over host memory (a GPU kernel will sit beside it, bit-identical).

pub mod cpu;
pub mod gpu;

pub use cpu::*;
