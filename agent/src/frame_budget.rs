//! The agent-wide room for large engine frames being read and decoded.
//!
//! A registered engine may send frames as long as its pool's block ids need (up to
//! [`crate::wire::MAX_FRAME`]), and decoding one holds each of its JSON values in serde's buffer
//! (an internally tagged enum), and then the typed message, at once. Each engine's session reads
//! on its own thread, so without a bound over all of them a few engines sending their costliest
//! frames at once (one Pod may run 32) took the agent past its memory limit, and its kill ended
//! every engine's transfers on the node. A frame that may cost more than [`FREE_FRAME`] takes
//! room for the most it can cost ([`cost`]) from this budget before its body is read, and keeps
//! what it does cost once its values are counted, until it is decoded. Its body must arrive
//! within [`BODY_WITHIN`] of its length, so an engine that sends a length and trickles the rest
//! holds room only that long. Room goes to the waiting frame whose owner (the engine's Pod, or
//! the engine) holds least, then to the one waiting longest: one Pod's engines, however many
//! frames they send, cannot keep another Pod's frame waiting past the next frame to end (frames
//! of many Pods that came first each take their turn). A frame that waits [`WAIT`] for room
//! ends its engine's connection (its body cannot be skipped unread).

use std::{
    collections::HashMap,
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

/// A frame that may cost at most this ([`cost`]) is read and decoded without taking room: any
/// frame of up to about 4 KiB (a request of some 600 blocks). 256 engines, the most an agent
/// takes, hold 64 MiB with one such frame each.
pub const FREE_FRAME: usize = 256 << 10;

/// Bytes of large engine frames being read and decoded at once, over every engine on the agent.
pub const ENGINE_FRAMES: usize = 128 << 20;

/// Bytes decoding a registered engine's frame holds per JSON value it counts, at most: the value
/// in serde's buffer (32), its key's place where it is in an object (keys are not counted: 32),
/// and the typed message's element with its own allocation (64).
pub const VALUE_COST: usize = 128;

/// How long a frame waits for room before its engine's connection is closed: within the vLLM
/// connector's 30 s for a send (its step waits on a frame the agent does not read), so the agent
/// closes first and says why.
pub const WAIT: Duration = Duration::from_secs(20);

/// How long a frame's body may take to arrive once its length did.
pub const BODY_WITHIN: Duration = Duration::from_secs(10);

/// What decoding a frame of `len` bytes holding `values` JSON values costs at most: its bytes
/// twice (the frame, and strings copied out of it) and [`VALUE_COST`] per value.
pub fn cost(len: usize, values: usize) -> usize {
    len.saturating_mul(2).saturating_add(values.saturating_mul(VALUE_COST))
}

/// The most JSON values a registered engine's frame may hold whatever its pool: what a frame of
/// [`crate::wire::MAX_FRAME`] bytes may cost besides its bytes fits [`ENGINE_FRAMES`] (786432:
/// block ids for over 12M tokens).
pub const MAX_VALUES: usize = (ENGINE_FRAMES - 2 * crate::wire::MAX_FRAME) / VALUE_COST;

/// Room for frames, shared by every engine's session.
#[derive(Debug)]
pub struct FrameBudget {
    cap: usize,
    wait: Duration,
    state: Mutex<State>,
    freed: Condvar,
}

#[derive(Debug, Default)]
struct State {
    used: usize,
    /// Bytes each owner holds now.
    held: HashMap<String, usize>,
    /// Frames waiting for room: owner and arrival.
    waiting: Vec<(String, u64)>,
    arrivals: u64,
}

impl State {
    fn give_back(&mut self, owner: &str, bytes: usize) {
        self.used = self.used.saturating_sub(bytes);
        if let Some(h) = self.held.get_mut(owner) {
            *h = h.saturating_sub(bytes);
            if *h == 0 {
                self.held.remove(owner);
            }
        }
    }

    /// The waiting frame whose turn it is: its owner holds least, then it came first.
    fn next(&self) -> Option<u64> {
        self.waiting
            .iter()
            .min_by_key(|(owner, at)| (self.held.get(owner).copied().unwrap_or(0), *at))
            .map(|(_, at)| *at)
    }
}

/// Room taken, given back when dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Option<(Arc<FrameBudget>, String)>,
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

    /// Once a frame's values are counted: holds `cost` (what decoding it costs), or nothing where
    /// that is within [`FREE_FRAME`], giving back the rest. Never grows.
    pub fn shrink_to(&mut self, cost: usize) {
        let keep = if cost <= FREE_FRAME { 0 } else { cost.min(self.bytes) };
        if let Some((b, owner)) = &self.budget {
            let mut state = b.state.lock().unwrap_or_else(|e| e.into_inner());
            state.give_back(owner, self.bytes - keep);
            b.freed.notify_all();
        }
        self.bytes = keep;
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let Some((b, owner)) = self.budget.take() {
            let mut state = b.state.lock().unwrap_or_else(|e| e.into_inner());
            state.give_back(&owner, self.bytes);
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
            state: Mutex::new(State::default()),
            freed: Condvar::new(),
        })
    }

    /// Takes `bytes` for `owner`, waiting for its turn and for room ([`FrameBudget`]); Err naming
    /// the bytes held when none came in time, or when `bytes` is more than all.
    pub fn take(self: &Arc<Self>, owner: &str, bytes: usize) -> Result<Charge, String> {
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
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let me = state.arrivals;
        state.arrivals += 1;
        state.waiting.push((owner.to_owned(), me));
        loop {
            if state.next() == Some(me) && state.used.saturating_add(bytes) <= self.cap {
                state.waiting.retain(|(_, at)| *at != me);
                state.used += bytes;
                *state.held.entry(owner.to_owned()).or_insert(0) += bytes;
                return Ok(Charge {
                    budget: Some((Arc::clone(self), owner.to_owned())),
                    bytes,
                });
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                state.waiting.retain(|(_, at)| *at != me);
                // Its turn may have held others back.
                self.freed.notify_all();
                return Err(format!(
                    "no room for a frame costing {bytes} bytes in {:?}: engines' frames hold {} of the agent's {} bytes for them",
                    self.wait, state.used, self.cap
                ));
            }
            state = self
                .freed
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Before the body of a frame of `len` bytes (of at most `max_values` JSON values) is read:
    /// room for the most it can cost ([`cost`]; a value takes two bytes at least), none for a
    /// frame that cannot cost over [`FREE_FRAME`]. One charge per frame, taken at once: a frame
    /// holding some room while it waits for more would let frames hold it all and wait on each
    /// other.
    pub fn for_frame(self: &Arc<Self>, owner: &str, len: usize, max_values: usize) -> Result<Charge, String> {
        let most = cost(len, (len / 2 + 2).min(max_values));
        if most <= FREE_FRAME {
            return Ok(Charge::none());
        }
        self.take(owner, most)
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).used
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_takes_room_for_the_most_it_can_cost_keeps_what_it_does_and_waits_for_room() {
        let cap = 4 * FREE_FRAME * VALUE_COST;
        let b = FrameBudget::new(cap, Duration::from_millis(200));
        // Short frames, and frames of few values, cannot cost more than FREE_FRAME.
        assert_eq!(b.for_frame("a", 1000, usize::MAX).expect("free").bytes(), 0);
        assert_eq!(b.for_frame("a", FREE_FRAME / 4, 10).expect("free").bytes(), 0);
        assert_eq!(b.used(), 0);
        // A frame of FREE_FRAME bytes may hold FREE_FRAME / 2 values.
        let mut one = b.for_frame("a", FREE_FRAME, usize::MAX).expect("room");
        assert_eq!(one.bytes(), cost(FREE_FRAME, FREE_FRAME / 2 + 2));
        assert_eq!(b.used(), one.bytes());
        // Counted: it holds what it costs, or nothing where that is small.
        one.shrink_to(FREE_FRAME + 7);
        assert_eq!((one.bytes(), b.used()), (FREE_FRAME + 7, FREE_FRAME + 7));
        one.shrink_to(FREE_FRAME);
        assert_eq!((one.bytes(), b.used()), (0, 0));
        // Full: a frame waits for room, then gives up naming it.
        let all = b.take("a", cap).expect("all of it");
        let started = Instant::now();
        let e = b.for_frame("b", 2 * FREE_FRAME, usize::MAX).expect_err("full");
        assert!(started.elapsed() >= Duration::from_millis(200), "waited for room");
        assert!(e.contains("no room for a frame costing"), "{e}");
        assert!(b.take("a", cap + 1).expect_err("more than all").contains("at most"));
        drop(all);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn room_goes_to_the_owner_holding_least_then_to_the_frame_waiting_longest() {
        let b = FrameBudget::new(100, Duration::from_secs(20));
        let kept = b.take("insider", 40).expect("room");
        let held = b.take("insider", 50).expect("room");
        let order = Arc::new(Mutex::new(Vec::new()));
        let wait_for = |owner: &'static str, bytes: usize| {
            let (budget, order) = (Arc::clone(&b), Arc::clone(&order));
            let t = std::thread::spawn(move || {
                let c = budget.take(owner, bytes).expect("room in time");
                order.lock().expect("order").push(owner);
                std::thread::sleep(Duration::from_millis(50));
                drop(c);
            });
            // In this order: each waits before the next comes.
            while b.state.lock().expect("state").waiting.len() < 1 + usize::from(owner == "other") {
                std::thread::sleep(Duration::from_millis(5));
            }
            t
        };
        // The insider's third frame came first, and another Pod's after it: the other goes
        // first (it holds nothing, the insider 40), the insider's once the other's is done.
        let insider = wait_for("insider", 50);
        let other = wait_for("other", 50);
        drop(held);
        insider.join().expect("insider");
        other.join().expect("other");
        assert_eq!(*order.lock().expect("order"), vec!["other", "insider"]);
        drop(kept);
        assert_eq!(b.used(), 0);
    }
}
