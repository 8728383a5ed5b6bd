//! What the agent holds for its peers, in all: every side-channel link queues its frames in an
//! outbox its writer thread empties ([`crate::agent`]), bounded per link
//! ([`crate::agent::LINK_OUTBOX`]) and, here, across every link of the agent. Links are bounded
//! per source address, not across addresses: without this budget, an insider holding the pair's
//! key who opens links from many addresses and reads nothing would multiply the per-link bound
//! (32 MiB) by the links it holds.
//!
//! A full budget does not shut out peers that read: a frame for a link holding nothing is always
//! queued (its writer is about to write it), and otherwise the link holding the most is closed,
//! unless that is the sending link, whose frame is then refused (and its link closed, as a full
//! link outbox is). So the peers that let bytes pile up lose their links, biggest first, and a
//! link that keeps up keeps its place however many addresses hold the rest.

use std::{
    net::{Shutdown, TcpStream},
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
};

use crate::lock;

/// Bytes all of an agent's link outboxes hold, at most (give or take one frame per sender
/// racing another): eight links' worth.
pub const OUTBOX_BUDGET: usize = 8 * crate::agent::LINK_OUTBOX;

/// The agent's budget of queued bytes.
#[derive(Debug)]
pub struct Outboxes {
    budget: usize,
    total: AtomicUsize,
    queues: Mutex<Vec<Weak<Queue>>>,
}

/// One link's outbox, as the budget sees it.
#[derive(Debug)]
pub struct Queue {
    queued: AtomicUsize,
    closing: AtomicBool,
    /// A handle on the link's stream, to shut it down when the link is closed.
    stream: TcpStream,
    peer: String,
}

/// Bytes of one frame in an outbox: released when it is dropped (written, or dropped unwritten
/// with a closed link's outbox).
#[derive(Debug)]
pub struct Charge {
    queue: Arc<Queue>,
    outboxes: Arc<Outboxes>,
    len: usize,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.queue.queued.fetch_sub(self.len, Ordering::SeqCst);
        self.outboxes.total.fetch_sub(self.len, Ordering::SeqCst);
    }
}

impl Queue {
    /// Bytes queued on this link.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Whether the link is closed or closing (nothing more is queued on it).
    pub fn closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// Marks the link closing; it closes once what is queued is written.
    pub fn stop(&self) {
        self.closing.store(true, Ordering::SeqCst);
    }

    /// Closes the link now: its writer's next write and its reader fail, and it ends.
    pub fn close(&self) {
        self.stop();
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

impl Outboxes {
    pub fn new(budget: usize) -> Arc<Outboxes> {
        Arc::new(Outboxes {
            budget,
            total: AtomicUsize::new(0),
            queues: Mutex::new(Vec::new()),
        })
    }

    /// Bytes queued in every outbox.
    pub fn total(&self) -> usize {
        self.total.load(Ordering::SeqCst)
    }

    /// The outbox of a link over `stream` (a handle the budget may shut down) to `peer`.
    pub fn queue(&self, stream: TcpStream, peer: String) -> Arc<Queue> {
        let q = Arc::new(Queue {
            queued: AtomicUsize::new(0),
            closing: AtomicBool::new(false),
            stream,
            peer,
        });
        let mut queues = lock(&self.queues);
        queues.retain(|w| w.strong_count() > 0);
        queues.push(Arc::downgrade(&q));
        q
    }

    /// Room for a frame of `len` bytes on `queue`, which may hold at most `per_link`: the
    /// charge, or why there is none (the caller closes the link). Over the budget, the link
    /// holding the most is closed to make room, unless that is `queue`.
    pub fn charge(self: &Arc<Self>, queue: &Arc<Queue>, len: usize, per_link: usize) -> Result<Charge, String> {
        let mine = queue.queued();
        if mine + len > per_link {
            return Err(format!("a peer let {per_link} bytes pile up"));
        }
        if mine > 0 && self.total() + len > self.budget {
            self.make_room(queue, mine, len)?;
        }
        queue.queued.fetch_add(len, Ordering::SeqCst);
        self.total.fetch_add(len, Ordering::SeqCst);
        Ok(Charge {
            queue: queue.clone(),
            outboxes: self.clone(),
            len,
        })
    }

    fn make_room(&self, queue: &Arc<Queue>, mine: usize, len: usize) -> Result<(), String> {
        let open: Vec<Arc<Queue>> = {
            let mut queues = lock(&self.queues);
            queues.retain(|w| w.strong_count() > 0);
            queues
                .iter()
                .filter_map(Weak::upgrade)
                .filter(|q| !q.closing())
                .collect()
        };
        // Closed links' frames are being dropped (their writers fail at once): not counted.
        let held: usize = open.iter().map(|q| q.queued()).sum();
        if held + len <= self.budget {
            return Ok(());
        }
        match open.iter().max_by_key(|q| q.queued()) {
            Some(biggest) if !Arc::ptr_eq(biggest, queue) && biggest.queued() > mine + len => {
                tracing::warn!(
                    peer = %biggest.peer,
                    held = biggest.queued(),
                    "the agent's outboxes hold {held} bytes, over its {} budget; closed the link holding the most",
                    self.budget
                );
                biggest.close();
                Ok(())
            }
            _ => Err(format!(
                "the agent's outboxes hold {held} bytes, over its {} budget, and no other peer's holds more than this one's would ({})",
                self.budget,
                mine + len
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn stream() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let ours = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        (ours, l.accept().expect("accept").0)
    }

    #[test]
    fn over_the_budget_the_biggest_holder_is_closed_and_a_link_holding_nothing_always_gets_its_frame() {
        let o = Outboxes::new(100);
        let (a, _a) = stream();
        let (b, _b) = stream();
        let (c, _c) = stream();
        let (qa, qb, qc) = (o.queue(a, "a".into()), o.queue(b, "b".into()), o.queue(c, "c".into()));
        let mut held = vec![o.charge(&qa, 60, 1000).expect("a"), o.charge(&qb, 30, 1000).expect("b")];
        // c holds nothing: its frame is queued even though the budget is full.
        held.push(o.charge(&qc, 20, 1000).expect("a link holding nothing"));
        assert_eq!(o.total(), 110);
        // c again: now over, a holds the most and is closed; c's frame goes.
        held.push(o.charge(&qc, 20, 1000).expect("c makes room"));
        assert!(qa.closing() && !qb.closing() && !qc.closing());
        // a's frames are counted until dropped (its writer failing), but not against others.
        held.push(o.charge(&qc, 5, 1000).expect("a's bytes are not counted"));
        // b would hold more than anyone else (c, 45): its frame is refused.
        let err = o.charge(&qb, 50, 1000).expect_err("the biggest holder's frame");
        assert!(err.contains("more than this one's would (80)"), "{err}");
        drop(held);
        assert_eq!(
            (o.total(), qa.queued(), qb.queued(), qc.queued()),
            (0, 0, 0, 0),
            "charges released"
        );
        assert!(
            o.charge(&qb, 1001, 1000).expect_err("per link").contains("1000 bytes"),
            "the per-link bound still holds"
        );
    }
}
