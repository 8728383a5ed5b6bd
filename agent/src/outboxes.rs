//! What the agent holds for the peers of one PDPair, in all: every side-channel link queues its
//! frames in an outbox its writer thread empties ([`crate::agent`]), bounded per link
//! ([`crate::agent::LINK_OUTBOX`]) and, here, across every link of the pair. Links are bounded
//! per source address, not across addresses: without this budget, an insider holding the pair's
//! key who opens links from many addresses and reads nothing would multiply the per-link bound
//! (32 MiB) by the links it holds. One budget per pair: an insider of one pair cannot make
//! another pair's links give up their place.
//!
//! A full budget does not shut out peers that read: a small frame for a link holding nothing is
//! always queued (its writer is about to write it), and otherwise, among the links holding at least an
//! equal share of what is held, the one whose writer has gone longest without finishing a frame
//! is closed, unless that is the sending link, whose frame is then refused (and its link closed,
//! as a full link outbox is). A link with a small backlog is never the one, however slowly its
//! peer reads; of the links holding much, a peer that stopped reading goes before one that reads.

use std::{
    collections::HashMap,
    net::{Shutdown, TcpStream},
    sync::{
        Arc, Mutex, OnceLock, Weak,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Instant,
};

use crate::lock;

/// Bytes all links of one PDPair's engines on this agent hold, at most (give or take one frame
/// per sender racing another): two links' worth, 64 MiB. Side-channel frames are control
/// messages (registrations, block lists), not KV: links that read hold little.
pub const OUTBOX_BUDGET: usize = 2 * crate::agent::LINK_OUTBOX;

/// Bytes all links of every pair on this agent hold, at most: pairs are as many as engines
/// registered with it claim (a tenant's pods may name pairs of their own), so past two pairs'
/// worth (128 MiB) the same rule runs across all of them. Within the memory the agent keeps for
/// itself under its limit ([`crate::agent::AGENT_OWN_MEMORY`], 256 MiB): at 1 GiB, as it was, the
/// outboxes alone could take an agent of the chart's 1 GiB limit past it.
pub const AGENT_OUTBOX_BUDGET: usize = 2 * OUTBOX_BUDGET;

/// Bytes of frames being read on all links of one PDPair's engines on this agent, at most (a
/// frame's length is charged before its body is read): four of the largest frames.
pub const INBOX_BUDGET: usize = 4 * crate::wire::MAX_FRAME;

/// Bytes of frames being read on all links of every pair on this agent, at most.
pub const AGENT_INBOX_BUDGET: usize = 2 * INBOX_BUDGET;

/// A frame of at most this many bytes for a link holding nothing is queued whatever the budgets
/// hold (its writer is keeping up); a larger one makes room like any other. Frames being read
/// have no such pass: a link's reader holds at most one, so links x this would be unbounded.
pub const FREE_FRAME: usize = 64 << 10;

/// Every pair's budget on this agent, and the agent's over them all.
#[derive(Debug)]
pub struct Budgets {
    budget: usize,
    /// Of frames being read, not queued ([`Budgets::inbound`]).
    inbound: bool,
    by_pair: Mutex<HashMap<String, Weak<Outboxes>>>,
    all: Arc<Outboxes>,
}

impl Budgets {
    /// `budget` bytes for each pair, `total` for all of them.
    pub fn new(budget: usize, total: usize) -> Budgets {
        Budgets {
            budget,
            inbound: false,
            by_pair: Mutex::new(HashMap::new()),
            all: Outboxes::new(total),
        }
    }

    /// Budgets of frames being read (each link's reader charges the one it reads), not queued:
    /// no frame goes free, and the messages say so.
    pub fn inbound(budget: usize, total: usize) -> Budgets {
        Budgets {
            budget,
            inbound: true,
            by_pair: Mutex::new(HashMap::new()),
            all: Arc::new(Outboxes {
                inbound: true,
                ..Outboxes::unbound(total)
            }),
        }
    }

    /// `pdpair`'s budget (its links keep it).
    pub fn of(&self, pdpair: &str) -> Arc<Outboxes> {
        let mut all = lock(&self.by_pair);
        if let Some(o) = all.get(pdpair).and_then(Weak::upgrade) {
            return o;
        }
        all.retain(|_, o| o.strong_count() > 0);
        let o = Arc::new(Outboxes {
            parent: Some(self.all.clone()),
            inbound: self.inbound,
            ..Outboxes::unbound(self.budget)
        });
        all.insert(pdpair.to_owned(), Arc::downgrade(&o));
        o
    }
}

/// One pair's budget of queued bytes (or the agent's, over every pair's).
#[derive(Debug)]
pub struct Outboxes {
    budget: usize,
    /// Counts frames being read ([`Budgets::inbound`]).
    inbound: bool,
    /// The agent's budget, which this one's bytes count against too.
    parent: Option<Arc<Outboxes>>,
    total: AtomicUsize,
    queues: Mutex<Vec<Weak<Queue>>>,
}

/// One link's outbox, as the budget sees it.
#[derive(Debug)]
pub struct Queue {
    queued: AtomicUsize,
    /// Nothing more is queued (the link is closing once what is queued is written, or closed).
    stopped: AtomicBool,
    /// Its socket is shut down: what it holds is being dropped.
    shut: AtomicBool,
    /// When its writer last finished a frame, or its outbox was last empty (microseconds since
    /// [`epoch`]).
    progress: AtomicU64,
    /// A handle on the link's stream, to shut it down when the link is closed.
    stream: Arc<TcpStream>,
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

impl Charge {
    /// The frame was written: its link made progress.
    pub fn written(self) {
        self.queue.progress.store(now(), Ordering::SeqCst);
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.queue.queued.fetch_sub(self.len, Ordering::SeqCst);
        for o in self.outboxes.levels() {
            o.total.fetch_sub(self.len, Ordering::SeqCst);
        }
    }
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Microseconds since the process's first call (a clock links compare).
pub fn now() -> u64 {
    u64::try_from(epoch().elapsed().as_micros()).unwrap_or(u64::MAX)
}

impl Queue {
    /// Bytes queued on this link.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Whether nothing more is queued on the link (closing or closed).
    pub fn stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Whether the link was shut down (closed now, not once its queue is written).
    pub fn shut(&self) -> bool {
        self.shut.load(Ordering::SeqCst)
    }

    /// Whether the link closes once what is queued is written (stopped, not shut down).
    pub fn draining(&self) -> bool {
        self.stopped() && !self.shut()
    }

    /// Nothing more is queued; the link closes once what is queued is written.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
    }

    /// Closes the link now: its writer's next write and its reader fail, and it ends.
    pub fn close(&self) {
        self.stop();
        self.shut.store(true, Ordering::SeqCst);
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// It made progress now (an inbox: a frame read whole).
    pub fn touch(&self) {
        self.progress.store(now(), Ordering::SeqCst);
    }

    /// When its writer last finished a frame, or its outbox was last empty (microseconds).
    pub fn progress(&self) -> u64 {
        self.progress.load(Ordering::SeqCst)
    }
}

impl Outboxes {
    pub fn new(budget: usize) -> Arc<Outboxes> {
        Arc::new(Outboxes::unbound(budget))
    }

    /// This budget and the agent's over it, which a link's bytes count against both.
    fn levels(&self) -> impl Iterator<Item = &Outboxes> {
        std::iter::once(self).chain(self.parent.as_deref())
    }

    fn unbound(budget: usize) -> Outboxes {
        Outboxes {
            budget,
            inbound: false,
            parent: None,
            total: AtomicUsize::new(0),
            queues: Mutex::new(Vec::new()),
        }
    }

    /// Bytes queued in every outbox.
    pub fn total(&self) -> usize {
        self.total.load(Ordering::SeqCst)
    }

    /// The outbox of a link over `stream` (a handle the budget may shut down) to `peer`.
    pub fn queue(&self, stream: impl Into<Arc<TcpStream>>, peer: String) -> Arc<Queue> {
        let stream = stream.into();
        let q = Arc::new(Queue {
            queued: AtomicUsize::new(0),
            stopped: AtomicBool::new(false),
            shut: AtomicBool::new(false),
            progress: AtomicU64::new(now()),
            stream,
            peer,
        });
        for o in self.levels() {
            let mut queues = lock(&o.queues);
            queues.retain(|w| w.strong_count() > 0);
            queues.push(Arc::downgrade(&q));
        }
        q
    }

    /// Room for a frame of `len` bytes on `queue`, which may hold at most `per_link`: the
    /// charge, or why there is none (the caller closes the link). Over the budget, of the links
    /// holding at least an equal share, the one longest without progress is closed to make
    /// room, unless that is `queue`.
    pub fn charge(self: &Arc<Self>, queue: &Arc<Queue>, len: usize, per_link: usize) -> Result<Charge, String> {
        let mine = queue.queued();
        if mine + len > per_link {
            return Err(format!("a peer let {per_link} bytes pile up"));
        }
        if mine == 0 {
            // Nothing waits: its writer is keeping up.
            queue.progress.store(now(), Ordering::SeqCst);
        }
        // A large frame makes room even for a link holding nothing: otherwise each of an
        // insider's links, reading a few bytes per write timeout, held one 16 MiB frame past
        // every budget.
        if mine > 0 || len > FREE_FRAME || self.inbound {
            for o in self.levels() {
                if o.total() + len > o.budget {
                    o.make_room(queue, len)?;
                }
            }
        }
        queue.queued.fetch_add(len, Ordering::SeqCst);
        for o in self.levels() {
            o.total.fetch_add(len, Ordering::SeqCst);
        }
        Ok(Charge {
            queue: queue.clone(),
            outboxes: self.clone(),
            len,
        })
    }

    /// What this budget's links hold, for messages.
    fn what(&self, held: usize) -> String {
        match self.inbound {
            true => format!("are reading {held} bytes of frames from their peers"),
            false => format!("hold {held} bytes for their peers"),
        }
    }

    /// Whose links this budget counts, for messages.
    fn whose(&self) -> &'static str {
        if self.parent.is_some() {
            "this pair's"
        } else {
            "all the agent's"
        }
    }

    fn make_room(&self, queue: &Arc<Queue>, len: usize) -> Result<(), String> {
        let holding: Vec<Arc<Queue>> = {
            let mut queues = lock(&self.queues);
            queues.retain(|w| w.strong_count() > 0);
            queues
                .iter()
                .filter_map(Weak::upgrade)
                .filter(|q| !q.shut() && q.queued() > 0)
                .collect()
        };
        // Shut links' frames are being dropped (their writers fail at once): not counted. Links
        // closing once written still hold theirs, and may be closed now.
        let held: usize = holding.iter().map(|q| q.queued()).sum();
        if held + len <= self.budget {
            return Ok(());
        }
        // Among the links holding at least an equal share, the one longest without progress: a
        // link with a small backlog is never the one (however slowly its peer reads), and a peer
        // that reads just enough to look alive cannot keep much.
        let share = held / holding.len().max(1);
        let stalest = holding
            .iter()
            .filter(|q| q.queued() >= share)
            .min_by_key(|q| q.progress());
        match stalest {
            Some(q) if !Arc::ptr_eq(q, queue) => {
                let idle_ms = now().saturating_sub(q.progress()) / 1000;
                tracing::warn!(
                    peer = %q.peer,
                    held = q.queued(),
                    idle_ms,
                    "{} links {}, over the {} budget; closed the one of those holding the most that made no progress for longest",
                    self.whose(),
                    self.what(held),
                    self.budget
                );
                q.close();
                Ok(())
            }
            _ => Err(format!(
                "{} links {}, over the {} budget, and of those holding the most this peer's has made no progress for longest",
                self.whose(),
                self.what(held),
                self.budget
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

    fn tick() {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }

    #[test]
    fn a_large_frame_for_a_link_holding_nothing_makes_room_too() {
        // Links each holding one large frame their peers never finish reading: the budget
        // bounds them all the same, however many links there are.
        let mib = 1 << 20;
        let o = Outboxes::new(4 * mib);
        let streams: Vec<_> = (0..8).map(|_| stream()).collect();
        let queues: Vec<_> = streams
            .iter()
            .enumerate()
            .map(|(i, (s, _))| o.queue(s.try_clone().expect("clone"), format!("l{i}")))
            .collect();
        let mut held = Vec::new();
        for q in &queues {
            held.push(o.charge(q, mib, 32 * mib).expect("made room"));
            tick();
        }
        let open = queues.iter().filter(|q| !q.shut()).count();
        assert_eq!(open, 4, "the links longest without progress were closed");
        assert!(queues[..4].iter().all(|q| q.shut()), "the oldest went first");
        // A small frame for an idle link is queued whatever the budget holds.
        let (s, _peer) = stream();
        let idle = o.queue(s, "idle".into());
        held.push(o.charge(&idle, FREE_FRAME, 32 * mib).expect("small"));
        assert_eq!(queues.iter().filter(|q| !q.shut()).count(), 4, "nothing closed for it");
    }

    #[test]
    fn over_the_budget_the_link_longest_without_progress_is_closed_and_a_link_holding_nothing_gets_its_frame() {
        let o = Outboxes::new(100);
        let (a, _a) = stream();
        let (b, _b) = stream();
        let (c, _c) = stream();
        let (qa, qb, qc) = (o.queue(a, "a".into()), o.queue(b, "b".into()), o.queue(c, "c".into()));
        let a1 = o.charge(&qa, 60, 1000).expect("a");
        tick();
        let b1 = o.charge(&qb, 30, 1000).expect("b");
        tick();
        // c holds nothing: its frame is queued even though the budget is full.
        let c1 = o.charge(&qc, 20, 1000).expect("a link holding nothing");
        assert_eq!(o.total(), 110);
        // c again, over the budget: a has gone longest without progress and is closed.
        let c2 = o.charge(&qc, 20, 1000).expect("c makes room");
        assert!(qa.shut() && !qb.shut() && !qc.shut());
        drop(a1); // a's writer fails: its frames are dropped
        tick();
        c1.written(); // c's writer keeps up; b's does not
        assert_eq!(o.total(), 50);
        let err = o.charge(&qb, 60, 1000).expect_err("b has made no progress for longest");
        assert!(err.contains("this peer's has made no progress for longest"), "{err}");
        let c3 = o.charge(&qc, 60, 1000).expect("c makes room again");
        assert!(qb.shut(), "b closed for it");
        drop((b1, c2, c3));
        assert_eq!(
            (o.total(), qa.queued(), qb.queued(), qc.queued()),
            (0, 0, 0, 0),
            "charges released"
        );
        assert!(
            o.charge(&qc, 1001, 1000).expect_err("per link").contains("1000 bytes"),
            "the per-link bound still holds"
        );
    }

    #[test]
    fn of_the_links_holding_much_the_one_without_progress_goes() {
        // Two links hold as much; one's peer reads (a frame was written lately), the other's
        // stopped a while ago: the stalled one goes.
        let o = Outboxes::new(100);
        let (x, _x) = stream();
        let (y, _y) = stream();
        let (z, _z) = stream();
        let (qx, qy, qz) = (
            o.queue(x, "stalled".into()),
            o.queue(y, "reading".into()),
            o.queue(z, "z".into()),
        );
        let _x1 = o.charge(&qx, 40, 1000).expect("x");
        tick();
        let y1 = o.charge(&qy, 20, 1000).expect("y");
        let _y2 = o.charge(&qy, 20, 1000).expect("y");
        let _y3 = o.charge(&qy, 20, 1000).expect("y");
        tick();
        y1.written();
        let _z1 = o.charge(&qz, 20, 1000).expect("z");
        let _z2 = o.charge(&qz, 20, 1000).expect("z makes room");
        assert!(
            qx.shut() && !qy.shut(),
            "the stalled link went, not the one whose peer reads"
        );
    }

    #[test]
    fn a_link_with_a_small_backlog_keeps_its_place_against_peers_that_look_alive_holding_much() {
        // Insiders read a byte now and then (their links finish a frame lately) while holding
        // most of the budget; a real peer's link holds a little, its last frame a while ago.
        let o = Outboxes::new(100);
        let (r, _r) = stream();
        let (a, _a) = stream();
        let (b, _b) = stream();
        let (qr, qa, qb) = (
            o.queue(r, "real".into()),
            o.queue(a, "a".into()),
            o.queue(b, "b".into()),
        );
        let _r1 = o.charge(&qr, 5, 1000).expect("r");
        let _r2 = o.charge(&qr, 5, 1000).expect("r");
        tick();
        let mut insiders = Vec::new();
        for q in [&qa, &qb] {
            let first = o.charge(q, 1, 1000).expect("insider");
            insiders.push(o.charge(q, 44, 1000).expect("insider"));
            tick();
            first.written(); // "alive"
        }
        let _r3 = o.charge(&qr, 5, 1000).expect("the real peer's frame");
        assert!(!qr.shut() && (qa.shut() || qb.shut()), "an insider went");
    }

    #[test]
    fn one_pairs_links_do_not_take_another_pairs_place() {
        // An insider of pair A holds A's whole budget with links that read nothing: pair B's
        // links, holding bytes too, neither lose their place nor are refused.
        let budgets = Budgets::new(100, 1000);
        let (a, b) = (budgets.of("team-a/llama"), budgets.of("team-b/llama"));
        assert!(Arc::ptr_eq(&a, &budgets.of("team-a/llama")), "one budget per pair");
        let (s1, _s1) = stream();
        let (s2, _s2) = stream();
        let (qa, qb) = (a.queue(s1, "insider".into()), b.queue(s2, "b".into()));
        let _a1 = a.charge(&qa, 100, 1000).expect("a fills its budget");
        tick();
        let _b1 = b.charge(&qb, 60, 1000).expect("b");
        let _b2 = b.charge(&qb, 30, 1000).expect("b is within its own budget");
        assert!(!qa.shut() && !qb.shut());
        drop(a);
        assert!(!Arc::ptr_eq(&b, &budgets.of("team-a/llama")));
    }

    #[test]
    fn many_pairs_together_hold_at_most_the_agents_budget() {
        // A tenant's pods may name pairs of their own, each with its budget: the agent's bounds
        // them all, by the same rule across pairs.
        let budgets = Budgets::new(100, 150);
        let pairs: Vec<Arc<Outboxes>> = (0..3).map(|i| budgets.of(&format!("tenant/pair-{i}"))).collect();
        let mut held = Vec::new();
        let mut queues = Vec::new();
        for (i, o) in pairs.iter().enumerate() {
            let (s, peer) = stream();
            let q = o.queue(s, format!("stalled-{i}"));
            held.push(o.charge(&q, 1, 1000).expect("first"));
            for _ in 0..6 {
                // Each pair's own budget is not over: only the agent's can say no.
                if let Ok(c) = o.charge(&q, 10, 1000) {
                    held.push(c);
                }
            }
            queues.push((q, peer));
            tick();
        }
        let open: usize = queues.iter().filter(|(q, _)| !q.shut()).map(|(q, _)| q.queued()).sum();
        assert!(open <= 150 + 10, "the pairs' open links hold {open}");
        assert!(queues[0].0.shut(), "the first pair's stalled link gave way");
        drop(held);
        assert_eq!(budgets.all.total(), 0, "released in the agent's total too");
    }

    #[test]
    fn a_link_closing_once_written_still_counts_and_can_be_closed_now() {
        // A link closing after its last frames (a failure sent before it goes) stops taking
        // frames but still holds its bytes, as long as its peer lets them sit.
        let o = Outboxes::new(100);
        let (a, _a) = stream();
        let (b, _b) = stream();
        let (qa, qb) = (o.queue(a, "a".into()), o.queue(b, "b".into()));
        let _a1 = o.charge(&qa, 90, 1000).expect("a");
        qa.stop();
        tick();
        let _b1 = o.charge(&qb, 10, 1000).expect("b");
        let _b2 = o.charge(&qb, 10, 1000).expect("b, a closed for it");
        assert!(qa.shut(), "the stopped link was still counted, and closed");
    }
}
