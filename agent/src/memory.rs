//! Where KV lives: the pools engines register (host memory today: memfds an engine passes, or
//! UCX-allocated shared memory), and the guard that keeps a peer's shared segment from faulting
//! the agent when its engine truncates it.

pub mod cuda;
pub mod guard;
pub mod pool;
