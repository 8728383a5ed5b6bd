//! The agent-wide room for large engine frames being read and decoded.
//!
//! A registered engine may send frames as long as its pool's block ids need (up to
//! [`crate::wire::MAX_FRAME`]), and decoding one holds each of its JSON values at once (about
//! [`crate::wire::VALUE_COST`] bytes each). Each engine's session reads on its own thread, so
//! without a bound over all of them a few engines sending their largest frames at once (one Pod
//! may run 32) took the agent past its memory limit, and its kill ended every engine's transfers
//! on the node. A frame that may cost more than [`FREE_FRAME`] (its length, or its values'
//! cost where more) takes room for the most it can cost from this budget before its body is
//! read, waiting up to [`WAIT`] for it, and keeps what it does cost once its values are counted,
//! until it is decoded; its body must arrive within [`BODY_WITHIN`] of its length, so an engine
//! that sends a length and trickles the rest holds room only that long.

use std::{
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

/// A frame costing at most this is read and decoded without taking room: every request up to a
/// few thousand blocks, which is nearly all of them.
pub const FREE_FRAME: usize = 64 << 10;

/// Bytes of large engine frames being read and decoded at once, over every engine on the agent.
pub const ENGINE_FRAMES: usize = 128 << 20;

/// How long a frame waits for room before its engine's connection is closed.
pub const WAIT: Duration = Duration::from_secs(10);

/// How long a frame's body may take to arrive once its length did.
pub const BODY_WITHIN: Duration = Duration::from_secs(10);

/// Room for frames, shared by every engine's session.
#[derive(Debug)]
pub struct FrameBudget {
    cap: usize,
    wait: Duration,
    used: Mutex<usize>,
    freed: Condvar,
}

/// Room taken, given back when dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Option<Arc<FrameBudget>>,
    bytes: usize,
}

impl Charge {
    /// Room that was not taken (a frame within [`FREE_FRAME`]).
    pub fn none() -> Charge {
        Charge { budget: None, bytes: 0 }
    }

    /// Bytes it holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Once a frame's values are counted: holds `cost` (its length, or its values' cost where
    /// more), or nothing where that is within [`FREE_FRAME`], giving back the rest. Never grows.
    pub fn shrink_to(&mut self, cost: usize) {
        let keep = if cost <= FREE_FRAME { 0 } else { cost.min(self.bytes) };
        if let Some(b) = &self.budget {
            let mut used = b.used.lock().unwrap_or_else(|e| e.into_inner());
            *used = used.saturating_sub(self.bytes - keep);
            b.freed.notify_all();
        }
        self.bytes = keep;
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let Some(b) = self.budget.take() {
            let mut used = b.used.lock().unwrap_or_else(|e| e.into_inner());
            *used = used.saturating_sub(self.bytes);
            b.freed.notify_all();
        }
    }
}

impl FrameBudget {
    /// `cap` bytes at once; a frame waits up to `wait` for room.
    pub fn new(cap: usize, wait: Duration) -> Arc<FrameBudget> {
        Arc::new(FrameBudget {
            cap,
            wait,
            used: Mutex::new(0),
            freed: Condvar::new(),
        })
    }

    /// Takes `bytes` (all of them: the caller decided the frame is not free), waiting for room;
    /// Err naming the bytes held when none came in time, or when `bytes` is more than all.
    pub fn take(self: &Arc<Self>, bytes: usize) -> Result<Charge, String> {
        if bytes == 0 {
            return Ok(Charge::none());
        }
        if bytes > self.cap {
            return Err(format!(
                "a frame costing {bytes} bytes to read and decode; the agent reads at most {} at once",
                self.cap
            ));
        }
        let until = Instant::now() + self.wait;
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        while used.saturating_add(bytes) > self.cap {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "no room for a frame costing {bytes} bytes in {:?}: engines' frames hold {} of the agent's {} bytes for them",
                    self.wait, *used, self.cap
                ));
            }
            used = self.freed.wait_timeout(used, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        *used += bytes;
        Ok(Charge {
            budget: Some(Arc::clone(self)),
            bytes,
        })
    }

    /// Before the body of a frame of `len` bytes (of at most `max_values` JSON values) is read:
    /// room for the most it can cost, its length or [`crate::wire::VALUE_COST`] for each value it
    /// can hold (a value takes two bytes at least), whichever is more; none for a frame that
    /// cannot cost over [`FREE_FRAME`]. One charge per frame, taken at once: a frame holding some
    /// room while it waits for more would let frames hold it all and wait on each other.
    pub fn for_frame(self: &Arc<Self>, len: usize, max_values: usize) -> Result<Charge, String> {
        let most = len.max((len / 2 + 2).min(max_values).saturating_mul(crate::wire::VALUE_COST));
        if most <= FREE_FRAME {
            return Ok(Charge::none());
        }
        self.take(most)
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        *self.used.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_takes_room_for_the_most_it_can_cost_keeps_what_it_does_and_waits_for_room() {
        use crate::wire::VALUE_COST;
        let cap = 4 * FREE_FRAME * VALUE_COST;
        let b = FrameBudget::new(cap, Duration::from_millis(200));
        // Short frames, and frames of few values, cannot cost more than FREE_FRAME.
        assert_eq!(b.for_frame(1000, usize::MAX).expect("free").bytes(), 0);
        assert_eq!(b.for_frame(FREE_FRAME, 10).expect("free").bytes(), 0);
        assert_eq!(b.used(), 0);
        // A frame of FREE_FRAME bytes may hold FREE_FRAME / 2 values.
        let mut one = b.for_frame(FREE_FRAME, usize::MAX).expect("room");
        assert_eq!(
            (one.bytes(), b.used()),
            ((FREE_FRAME / 2 + 2) * VALUE_COST, one.bytes())
        );
        // Counted: it holds what its values cost, or nothing where that is small.
        one.shrink_to(FREE_FRAME + 7);
        assert_eq!((one.bytes(), b.used()), (FREE_FRAME + 7, FREE_FRAME + 7));
        one.shrink_to(FREE_FRAME);
        assert_eq!((one.bytes(), b.used()), (0, 0));
        // Full: a frame waits for room, then gives up naming it.
        let all = b.take(cap).expect("all of it");
        let started = Instant::now();
        let e = b.for_frame(2 * FREE_FRAME, usize::MAX).expect_err("full");
        assert!(started.elapsed() >= Duration::from_millis(200), "waited for room");
        assert!(e.contains("no room for a frame costing"), "{e}");
        assert!(b.take(cap + 1).expect_err("more than all").contains("at most"));
        // Room given back wakes a waiter.
        let waiter = {
            let b = Arc::clone(&b);
            std::thread::spawn(move || b.for_frame(2 * FREE_FRAME, 1000).map(|c| c.bytes()))
        };
        std::thread::sleep(Duration::from_millis(20));
        drop(all);
        assert_eq!(waiter.join().expect("thread"), Ok(2 * FREE_FRAME));
        assert_eq!(b.used(), 0);
    }
}
