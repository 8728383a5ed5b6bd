//! Where KV lives: the pools engines register (host memory: memfds an engine passes, or
//! UCX-allocated shared memory; GPU memory an engine shares by CUDA IPC handle), and the guard that keeps a peer's shared segment from faulting
//! the agent when its engine truncates it.

pub mod batch_copy;
pub mod cuda;
pub mod gpu_pool;
pub mod guard;
pub mod pool;
pub mod stream_copy;
