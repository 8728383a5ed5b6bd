//! The decode side of an engine: asking prefill agents for KV (dialling, authenticating,
//! handshaking, registering requests), heartbeats, receiving completions and verifying them
//! against the checksums, and (pull) reading prefill's blocks.

use std::{
    net::TcpStream,
    sync::{Arc, atomic::Ordering},
    thread,
    time::{Duration, Instant},
};

use pdpair_api::{
    ChecksumPolicy,
    checksum::{BlockSums, Outcome, compare_request},
};

use super::*;
use crate::{
    engine_api::PromptDigest,
    protocol::{self, HandshakeError, MemoryDesc, Message, Reason, Registration, Session},
    transport::{
        OpError,
        plan::{BlockShape, Item, Plan, in_batches, pieces},
        stream::Access,
    },
    wire::{self, Opener},
};

impl Engine {
    /// Decode needs nothing of `request` from `prefill` (a full local prefix hit, or an abort
    /// before it asked): prefill frees the request's blocks at once, and neither side counts a
    /// failure. The engine hears `Released` once prefill confirmed it.
    pub(super) fn release(
        self: &Arc<Self>,
        request: String,
        prefills: Vec<String>,
        prompt: Option<PromptDigest>,
        release_token: Option<crate::engine_api::ReleaseToken>,
    ) {
        if self.role_is(Role::Decode, "Release", &request) {
            // One of the name still linking its ranks stands, as for an `ExpectKv`.
            if lock(&self.linking).contains_key(&request) {
                return self.refuse_taken(request, LINKING);
            }
            let want = Want {
                prompt,
                release_token,
                ..Want::default()
            };
            self.ask(request, prefills, want, true);
        }
    }

    /// Decode's engine queues `request` (no blocks for it yet): ask `prefills` to hold its blocks
    /// one more lease. Best effort, no answer: sent when the link is up (it is dialled when not,
    /// for the next renewal), so an engine renews more often than the lease. Each prefill once,
    /// however many ways it is spelled, and at most [`crate::engine_api::MAX_RENEW_PREFILLS`].
    pub(super) fn renew(self: &Arc<Self>, request: String, prefills: Vec<String>, prompt: Option<PromptDigest>) {
        if !self.role_is(Role::Decode, "Renew", &request) {
            return;
        }
        for prefill in renewed(&prefills, |p| self.dialable().check(p)) {
            self.renew_at(&request, prefill, prompt.clone());
        }
    }

    /// [`Engine::renew`] at one prefill (checked, in its one spelling).
    fn renew_at(self: &Arc<Self>, request: &str, prefill: String, prompt: Option<PromptDigest>) {
        let request = request.to_owned();
        let mut peers = lock(&self.peers);
        match peers.get(&prefill) {
            Some(Slot::Connected(link)) => {
                let link = link.clone();
                drop(peers);
                link.used.store(crate::outboxes::now(), Ordering::SeqCst);
                link.send(&Message::Renew { request, prompt });
            }
            Some(Slot::Connecting(_)) => {}
            None => {
                // Best effort: not while the engine's dials are at their bound, nor where no
                // prefill listens.
                if self.remembered(&prefill).is_none()
                    && dialling(&peers) < super::MAX_DIALS
                    && self.room_for_link(&mut peers).is_ok()
                {
                    peers.insert(prefill.clone(), Slot::Connecting(Vec::new()));
                    drop(peers);
                    self.spawn_connect(prefill);
                }
            }
        }
    }

    /// Decode's engine gives up `request` (an abort): stop expecting it, tell every prefill that
    /// may still write into its blocks (a `Release`, which also frees prefill's blocks), and
    /// answer `Cancelled` once each of them has ended: a completion, a failure, a
    /// `ReleaseDone`, its link lost, or (pull) our own read of it done. Until then the engine
    /// must not reuse the blocks; after it nothing writes them.
    pub(super) fn cancel_decode(self: &Arc<Self>, request: String) {
        let down = {
            // Locks in this order everywhere: linking, pending, cancelled.
            let mut linking = lock(&self.linking);
            let mut pending = lock(&self.pending);
            match self.wind_down(&mut pending, &request, Ending::Cancelled, None) {
                Some(down) => down,
                None => {
                    drop(pending);
                    if let Some(cancelled) = linking.get_mut(&request) {
                        // Still linking to its ranks: answered when that ends.
                        *cancelled = true;
                        return;
                    }
                    drop(linking);
                    if let Some(c) = lock(&self.cancelled).get_mut(&request) {
                        // Ending already: a failure not said yet becomes the cancel's answer;
                        // a cancel's answer is coming.
                        c.ending = Ending::Cancelled;
                        return;
                    }
                    return self.event(AgentEvent::Cancelled { request });
                }
            }
        };
        self.tell_writers(down);
    }

    /// Takes `request` out of `pending` (whose lock the caller holds, so a prefill's answer
    /// arriving meanwhile is counted, not dropped as foreign) to end it with `ending`, but only
    /// once no prefill writes into its blocks: an engine that hears an answer reuses them at
    /// once, and a prefill still pushing (or our read of another rank) would write into another
    /// request's KV. The prefills that may still write are recorded here; [`Engine::tell_writers`]
    /// then asks them to stop. `ended`: a prefill known to write nothing more (its read or its
    /// link just ended). None when the request is not pending.
    fn wind_down(
        &self,
        pending: &mut HashMap<String, Pending>,
        request: &str,
        ending: Ending,
        ended: Option<&str>,
    ) -> Option<WindDown> {
        let p = pending.remove(request)?;
        let writers: Vec<String> = p
            .prefills
            .iter()
            .filter(|a| p.waits_on(a) && Some(a.as_str()) != ended)
            .cloned()
            .collect();
        let now = if writers.is_empty() {
            // Its windows close while the name is still held (a new request of the name is
            // refused until then), so none it opens is closed by this one's answer.
            self.close_windows(request);
            Some(ending)
        } else {
            lock(&self.cancelled).insert(
                request.to_owned(),
                Cancelling {
                    held: super::decode_held(p.blocks.len(), p.prefills.len()),
                    waiting: writers.clone(),
                    reading: p.reading.iter().filter(|a| writers.contains(a)).cloned().collect(),
                    links: p.links.clone(),
                    prompt: p.prompt.clone(),
                    release_token: p.release_token.clone(),
                    deadline: Instant::now() + self.handshake_timeout() + self.lease(),
                    ending,
                },
            );
            None
        };
        Some(WindDown {
            request: request.to_owned(),
            writers,
            reading: p.reading,
            prompt: p.prompt,
            release_token: p.release_token,
            now,
        })
    }

    /// After [`Engine::wind_down`], with no lock held: answers the engine when no prefill may
    /// write, or sends a `Release` to each one that may (its `ReleaseDone`, or the end of a push
    /// running, answers), and answers for those that cannot (not linked, nothing sent).
    fn tell_writers(&self, down: WindDown) {
        let WindDown {
            request,
            writers,
            reading,
            prompt,
            release_token,
            now,
        } = down;
        if let Some(ending) = now {
            return self.end_quietly(request, ending);
        }
        let pull = self.settings.mode == pdpair_api::TransferMode::Pull;
        let mut notify = Vec::new();
        let mut waiting = Vec::new();
        {
            let mut peers = lock(&self.peers);
            for addr in writers.iter().cloned() {
                match peers.get_mut(&addr) {
                    // Pull, our read of it running (linked or not): its end answers.
                    _ if pull && reading.contains(&addr) => waiting.push(addr),
                    Some(Slot::Connected(link)) => {
                        notify.push(link.clone());
                        waiting.push(addr);
                    }
                    // Still dialling: the registration was not sent. The queued request goes
                    // out as a `Release` instead (prefill frees its blocks), and its
                    // `ReleaseDone` (or the dial failing) answers.
                    Some(Slot::Connecting(queue)) if queue.contains(&request) => waiting.push(addr),
                    _ => {}
                }
            }
        }
        // The prefills that will not write (no link, no queued registration) are answered now;
        // the last answer, from them or from a prefill meanwhile, answers the engine.
        for addr in writers.iter().filter(|a| !waiting.contains(*a)) {
            self.cancel_answered(addr, &request);
        }
        for link in notify {
            self.release_cancelled(&link, &request, prompt.clone(), release_token.clone());
        }
    }

    /// The engine hears how `request` ended, nothing writing its blocks any more; its windows
    /// were closed while its name was still held ([`Engine::close_windows`]), so this touches
    /// none (a new request of the name may have opened its own since).
    fn end_quietly(&self, request: String, ending: Ending) {
        match ending {
            Ending::Cancelled => self.answer(&AgentEvent::Cancelled { request }),
            Ending::Failed(reasons, message, peer) => self.fail_quietly_with(request, reasons, message, peer),
        }
    }

    /// Fails `request` (when still pending) once no other prefill writes into its blocks;
    /// `ended` (the prefill whose failure this is) writes nothing more.
    fn fail_pending(&self, request: &str, reasons: Vec<Reason>, message: String, ended: Option<&str>) {
        self.fail_if_pending(request, reasons, message, ended);
    }

    /// [`Engine::fail_pending`]; whether it was pending.
    fn fail_if_pending(&self, request: &str, reasons: Vec<Reason>, message: String, ended: Option<&str>) -> bool {
        let down = {
            let mut pending = lock(&self.pending);
            if !pending.contains_key(request) {
                return false;
            }
            let ending = Ending::Failed(reasons, message, ended.map(str::to_owned));
            self.wind_down(&mut pending, request, ending, ended)
        };
        if let Some(down) = down {
            self.tell_writers(down);
        }
        true
    }

    /// Tells `link`'s prefill that cancelled `request` is not wanted (its `ReleaseDone`, or the
    /// end of a push running, answers); a link that is gone writes nothing more.
    fn release_cancelled(
        &self,
        link: &Link,
        request: &str,
        prompt: Option<PromptDigest>,
        release_token: Option<crate::engine_api::ReleaseToken>,
    ) {
        // A registration that went out was on the link whose loss ends its writes; one that
        // never did (queued while dialling) has only this link.
        if let Some(c) = lock(&self.cancelled).get_mut(request) {
            c.links.sent_unless_known(&link.addr, link.id);
        }
        if !link.send(&Message::Release {
            request: request.to_owned(),
            prompt,
            token: release_token,
        }) {
            self.cancel_answered(&link.addr, request);
        }
    }

    /// `from` will not write into ending `request` any more (its answer came, its link went, or
    /// it was never sent anything); the engine hears how the request ended when no prefill is
    /// left. False when `request` is not an ending one waiting on `from`, or (pull) when our own
    /// read of `from`'s blocks runs: only that read's end answers for it
    /// ([`Engine::read_ended`]), never the prefill's messages or its link.
    fn cancel_answered(&self, from: &str, request: &str) -> bool {
        self.answered(from, request, false)
    }

    /// Our read of `from`'s blocks into ending `request` ended (or never started).
    fn read_ended(&self, from: &str, request: &str) -> bool {
        self.answered(from, request, true)
    }

    fn answered(&self, from: &str, request: &str, by_read: bool) -> bool {
        let mut cancelled = lock(&self.cancelled);
        let Some(c) = cancelled.get_mut(request) else {
            return false;
        };
        let Some(i) = c.waiting.iter().position(|a| a == from) else {
            return false;
        };
        if !by_read && c.reading.iter().any(|a| a == from) {
            return false;
        }
        c.waiting.swap_remove(i);
        if c.waiting.is_empty() {
            self.close_windows(request);
            if let Some(c) = cancelled.remove(request) {
                drop(cancelled);
                self.end_quietly(request.to_owned(), c.ending);
            }
        }
        true
    }

    pub(super) fn expect_kv(self: &Arc<Self>, request: String, prefills: Vec<String>, want: Want) {
        if !self.accept_request(
            Role::Decode,
            "ExpectKv",
            &request,
            &want.blocks,
            (want.first_token, want.num_tokens),
        ) {
            return;
        }
        if let Err(why) = self.check_event("ExpectKv", want.event) {
            return self.refuse(request, vec![Reason::InvalidRequest], why);
        }
        if lock(&self.linking).contains_key(&request) {
            return self.refuse_taken(request, LINKING);
        }
        self.ask(request, prefills, want, false);
    }

    /// Why a new request of this name is refused, if it is: one of the name is expected (in
    /// `pending`, whose lock the caller holds), or still ending (its answer waits for prefills
    /// that may still write into its blocks: a new one would take their late answers for its
    /// own). Not: one still linking its ranks ([`LINKING`], in `linking`).
    fn taken(&self, pending: &HashMap<String, Pending>, request: &str) -> Option<&'static str> {
        if pending.contains_key(request) {
            return Some("is already expected (ExpectKv or Release twice)");
        }
        lock(&self.cancelled)
            .contains_key(request)
            .then_some("is still ending (cancelled or failed, its answer not sent yet)")
    }

    /// Refuses a request whose name is [`Engine::taken`]: the first keeps its promise (exactly
    /// one answer for it, its windows open); this one gets its own answer.
    fn refuse_taken(&self, request: String, why: &str) {
        let message = format!("request {request} {why}; the first stands");
        self.refuse(request, vec![Reason::InvalidRequest], message);
    }

    /// Registers `request` with its prefill engines (or, `release`, tells them decode needs
    /// nothing), connecting to them first when needed.
    fn ask(self: &Arc<Self>, request: String, mut prefills: Vec<String>, want: Want, release: bool) {
        if let Err(why) = self.dialable_all(&mut prefills) {
            return self.refuse(request, vec![Reason::InvalidRequest], why);
        }
        prefills.sort();
        prefills.dedup();
        if prefills.is_empty() || prefills.len() > 1024 {
            // Each new prefill address is dialled on a thread of its own.
            return self.refuse(
                request,
                vec![Reason::InvalidRequest],
                format!("prefills names {} addresses; 1..=1024 are accepted", prefills.len()),
            );
        }
        // Before the checks below that fail (rather than refuse) a request: the first of the name
        // keeps its windows.
        let taken = self.taken(&lock(&self.pending), &request);
        if let Some(why) = taken {
            return self.refuse_taken(request, why);
        }
        for prefill in &prefills {
            if let Some((reasons, message)) = self.remembered(prefill) {
                return self.fail(
                    request,
                    reasons,
                    format!("remembered rejection by {prefill}: {message}"),
                );
            }
        }
        {
            let peers = lock(&self.peers);
            let new = prefills.iter().filter(|a| !peers.contains_key(*a)).count();
            let now = dialling(&peers);
            if new > 0 && now + new > super::MAX_DIALS {
                drop(peers);
                return self.refuse(
                    request,
                    vec![Reason::InvalidRequest],
                    format!(
                        "this engine dials {now} prefill agents already; at most {} at once",
                        super::MAX_DIALS
                    ),
                );
            }
        }
        let deadline = Instant::now() + self.handshake_timeout() + self.lease();
        let event = want.event;
        let (taken, full) = {
            // Checked again with the insert, under one lock: another thread (an
            // `ExpectKvFromPool` done linking) may have asked for the name since.
            let mut pending = lock(&self.pending);
            let taken = self.taken(&pending, &request);
            // Each prefill's link keeps its own copy of a request's block ids (its window, its
            // registration): counted once per prefill. A request that is ending still holds
            // them, and its place until its prefills answer: counted too (an engine asking and
            // cancelling again and again while a dial waits held more without end).
            let (requests, held) = {
                let cancelled = lock(&self.cancelled);
                let held = pending
                    .values()
                    .map(|p| super::decode_held(p.blocks.len(), p.prefills.len()))
                    .chain(cancelled.values().map(|c| c.held))
                    .fold(0usize, usize::saturating_add);
                (pending.len().saturating_add(cancelled.len()), held)
            };
            let full = match taken {
                None => super::live_room(requests, held, super::decode_held(want.blocks.len(), prefills.len())).err(),
                Some(_) => None,
            };
            if taken.is_none() && full.is_none() {
                pending.insert(
                    request.clone(),
                    Pending {
                        prefills: prefills.clone(),
                        parts: HashMap::new(),
                        reading: Vec::new(),
                        links: super::SentOn::default(),
                        blocks: want.blocks,
                        num_tokens: want.num_tokens,
                        first_token: want.first_token,
                        prompt: want.prompt,
                        deadline,
                        release,
                        release_token: want.release_token,
                    },
                );
            }
            (taken, full)
        };
        if let Some(why) = taken {
            return self.refuse_taken(request, why);
        }
        if let Some(why) = full {
            return self.refuse(request, vec![Reason::Busy], why);
        }
        // Nothing writes a GPU pool's blocks (prefill's push, our pull: both only after the
        // registration below) before the engine's work queued before this request (kernels that
        // may still touch blocks it now gives to it) is done: the event its ExpectKv named.
        if let (Some(device), Some(named)) = (&self.device, event)
            && let Err(e) = device.wait_written(Some(named), deadline)
        {
            return self.fail_pending(
                &request,
                vec![Reason::TransferTimeout],
                format!("the engine's event {named} before this request: {e}"),
                None,
            );
        }
        // The request is queued on every rank's slot before any dial starts: a dial that fails
        // at once (nothing listens there) winds the request down, and the ranks it finds no
        // slot of yet are answered as never asked, so their slot, made after, sent nothing (a
        // `Release` naming two ranks, one unreachable, never reached the other, which held the
        // blocks to its lease).
        // (Under one hold of the lock: so too a dial already under way that fails meanwhile.)
        let (mut links, mut dials, mut refused) = (Vec::new(), Vec::new(), None);
        {
            let mut peers = lock(&self.peers);
            for prefill in prefills {
                match peers.get_mut(&prefill) {
                    // Used now: a later rank's room for a new link must not close it.
                    Some(Slot::Connected(link)) => {
                        link.used.store(crate::outboxes::now(), Ordering::SeqCst);
                        links.push(link.clone());
                    }
                    Some(Slot::Connecting(queue)) => queue.push(request.clone()),
                    None => {
                        if let Err(why) = self.room_for_link(&mut peers) {
                            refused = Some(why);
                            break;
                        }
                        peers.insert(prefill.clone(), Slot::Connecting(vec![request.clone()]));
                        dials.push(prefill);
                    }
                }
            }
        }
        for link in links {
            self.send_registration(&link, &request);
        }
        // A failure below winds down through these dials too (what they queued goes out as a
        // `Release`).
        for prefill in dials {
            self.spawn_connect(prefill);
        }
        if let Some(why) = refused {
            self.fail_pending(&request, vec![Reason::Busy], why, None);
        }
    }

    /// `ExpectKvFromPool`: links to every prefill rank named (in a thread of its own), then
    /// asks the ranks that hold this decode rank's heads.
    pub(super) fn expect_kv_from_pool(self: &Arc<Self>, request: String, mut prefill_ranks: Vec<String>, want: Want) {
        if !self.accept_request(
            Role::Decode,
            "ExpectKvFromPool",
            &request,
            &want.blocks,
            (want.first_token, want.num_tokens),
        ) {
            return;
        }
        if let Err(why) = self.check_event("ExpectKvFromPool", want.event) {
            return self.refuse(request, vec![Reason::InvalidRequest], why);
        }
        if prefill_ranks.is_empty() || prefill_ranks.len() > 1024 {
            return self.refuse(
                request,
                vec![Reason::InvalidRequest],
                format!(
                    "prefill_ranks names {} addresses; 1..=1024 are accepted",
                    prefill_ranks.len()
                ),
            );
        }
        if let Err(why) = self.dialable_all(&mut prefill_ranks) {
            return self.refuse(request, vec![Reason::InvalidRequest], format!("prefill_ranks: {why}"));
        }
        if self.picking.fetch_add(1, Ordering::SeqCst) >= super::MAX_DIALS {
            self.picking.fetch_sub(1, Ordering::SeqCst);
            return self.refuse(
                request,
                vec![Reason::InvalidRequest],
                format!(
                    "{} ExpectKvFromPool are linking already; at most that many at once",
                    super::MAX_DIALS
                ),
            );
        }
        let taken = {
            let mut linking = lock(&self.linking);
            let taken = match linking.contains_key(&request) {
                true => Some(LINKING),
                false => self.taken(&lock(&self.pending), &request),
            };
            if taken.is_none() {
                linking.insert(request.clone(), false);
            }
            taken
        };
        if let Some(why) = taken {
            self.picking.fetch_sub(1, Ordering::SeqCst);
            return self.refuse_taken(request, why);
        }
        let e = self.clone();
        let id = request.clone();
        let started = thread::Builder::new().name("pool-links".into()).spawn(move || {
            let picked = e.pick_sources(&prefill_ranks);
            e.picking.fetch_sub(1, Ordering::SeqCst);
            match picked {
                Ok(sources) => {
                    // Pending before it stops linking: a cancel meanwhile finds it one way or
                    // the other, never neither.
                    e.ask(request.clone(), sources, want, false);
                    // Cancelled while linking: cancelled now, unless `ask` answered it already
                    // (refused it: the engine's room, a rejection remembered meanwhile), which
                    // would make the cancel's `Cancelled` a second answer (from a review).
                    // Looked at before the name is let go, in the locks' order.
                    let cancel = {
                        let mut linking = lock(&e.linking);
                        linking.remove(&request).unwrap_or(false)
                            && (lock(&e.pending).contains_key(&request) || lock(&e.cancelled).contains_key(&request))
                    };
                    if cancel {
                        e.cancel_decode(request);
                    }
                }
                Err((reasons, message)) => {
                    let mut linking = lock(&e.linking);
                    // Cancelled while linking: nothing was asked of any prefill, so that is the
                    // answer (answered under the lock, so a cancel cannot come between).
                    match linking.remove(&request) {
                        Some(true) => e.event(AgentEvent::Cancelled { request }),
                        _ => e.fail(request, reasons, message),
                    }
                }
            }
        });
        if let Err(err) = started {
            self.picking.fetch_sub(1, Ordering::SeqCst);
            lock(&self.linking).remove(&id);
            self.refuse(
                id,
                vec![Reason::InvalidRequest],
                format!("the agent cannot start a thread to link the ranks: {err}"),
            );
        }
    }

    /// The addresses, among `ranks`, of the prefill ranks this decode rank takes its heads from.
    fn pick_sources(self: &Arc<Self>, ranks: &[String]) -> Result<Vec<String>, (Vec<Reason>, String)> {
        // A rank whose heads do not line up with ours refuses the handshake (WrongTensorRank):
        // it is not a source, skip it; any other failure fails the request.
        let mut links = Vec::new();
        for addr in ranks {
            match self.linked(addr) {
                Ok(link) => links.push(link),
                Err((reasons, _)) if reasons == [Reason::WrongTensorRank] => {}
                Err(e) => return Err(e),
            }
        }
        let Some(first) = links.first().map(|l| &l.peer) else {
            return Err((
                vec![Reason::InvalidRequest],
                "no rank among prefill_ranks holds this decode rank's heads".into(),
            ));
        };
        let wanted = protocol::prefill_sources(
            &first.kv,
            &first.parallelism,
            &self.local.kv,
            &self.local.parallelism,
            self.local.tensor_rank,
        );
        wanted
            .iter()
            .map(|rank| {
                links
                    .iter()
                    .find(|l| l.peer.tensor_rank == *rank)
                    .map(|l| l.addr.clone())
                    .ok_or_else(|| {
                        (
                            vec![Reason::InvalidRequest],
                            format!(
                                "prefill rank {rank} holds this decode rank's heads but is not among prefill_ranks"
                            ),
                        )
                    })
            })
            .collect()
    }

    /// The link to `addr`, dialling it (in this thread) when there is none; waits for a dial
    /// another request started, up to the handshake timeout.
    fn linked(self: &Arc<Self>, addr: &str) -> Result<Arc<Link>, (Vec<Reason>, String)> {
        let until = Instant::now() + self.handshake_timeout();
        loop {
            if let Some((reasons, message)) = self.remembered(addr) {
                return Err((reasons, format!("remembered rejection by {addr}: {message}")));
            }
            let mut peers = lock(&self.peers);
            match peers.get(addr) {
                Some(Slot::Connected(link)) => return Ok(link.clone()),
                Some(Slot::Connecting(_)) => {}
                None => {
                    if let Err(why) = self.room_for_link(&mut peers) {
                        return Err((vec![Reason::Busy], why));
                    }
                    peers.insert(addr.to_owned(), Slot::Connecting(Vec::new()));
                    drop(peers);
                    self.clone().connect(addr.to_owned());
                    if !matches!(lock(&self.peers).get(addr), Some(Slot::Connected(_))) {
                        return Err(self
                            .remembered(addr)
                            .unwrap_or((vec![Reason::HandshakeFailed], format!("cannot reach prefill {addr}"))));
                    }
                    continue;
                }
            }
            drop(peers);
            if Instant::now() >= until {
                return Err((
                    vec![Reason::HandshakeFailed],
                    format!("no link to prefill {addr} in time"),
                ));
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Remembers a prefill agent's rejection for the rejection TTL, for at most
    /// [`MAX_REMEMBERED`] addresses (those past their TTL are forgotten first; when all are
    /// fresh this one is not remembered: an engine naming address after address would otherwise
    /// add one each without end).
    fn remember(&self, peer: String, reasons: Vec<Reason>, message: String) {
        let ttl = self.shared.cfg.rejection_ttl;
        let mut cache = lock(&self.rejections);
        if cache.len() >= MAX_REMEMBERED && !cache.contains_key(&peer) {
            cache.retain(|_, (at, ..)| at.elapsed() < ttl);
            if cache.len() >= MAX_REMEMBERED {
                return;
            }
        }
        cache.insert(peer, (Instant::now(), reasons, message));
    }

    fn remembered(&self, peer: &str) -> Option<(Vec<Reason>, String)> {
        let mut cache = lock(&self.rejections);
        match cache.get(peer) {
            Some((at, reasons, message)) if at.elapsed() < self.shared.cfg.rejection_ttl => {
                Some((reasons.clone(), message.clone()))
            }
            Some(_) => {
                cache.remove(peer);
                None
            }
            None => None,
        }
    }

    /// Room for one more prefill link ([`super::MAX_PREFILL_LINKS`]): past the bound, the
    /// connected link used least recently is closed (its reader then fails its requests as for
    /// a lost peer); `Err` when every slot is a dial in progress.
    fn room_for_link(&self, peers: &mut HashMap<String, Slot>) -> Result<(), String> {
        if peers.len() < super::MAX_PREFILL_LINKS {
            return Ok(());
        }
        let least = peers
            .iter()
            .filter_map(|(addr, slot)| match slot {
                Slot::Connected(link) => Some((addr.clone(), link.clone())),
                Slot::Connecting(_) => None,
            })
            .min_by_key(|(_, link)| link.used.load(Ordering::SeqCst));
        let Some((addr, link)) = least else {
            return Err(format!(
                "this engine dials {} prefill agents; at most {} links",
                peers.len(),
                super::MAX_PREFILL_LINKS
            ));
        };
        tracing::warn!(engine = %self.reg.engine, peer = %addr, "this engine links to {} prefill agents; closed the link used least recently", super::MAX_PREFILL_LINKS);
        peers.remove(&addr);
        link.close();
        Ok(())
    }

    fn send_registration(&self, link: &Link, request: &str) {
        link.used.store(crate::outboxes::now(), Ordering::SeqCst);
        let cancelled = lock(&self.cancelled)
            .get(request)
            .filter(|c| c.waiting.contains(&link.addr))
            .map(|c| (c.prompt.clone(), c.release_token.clone()));
        if let Some((prompt, release_token)) = cancelled {
            return self.release_cancelled(link, request, prompt, release_token);
        }
        // A request for KV must name every prefill rank holding part of this rank's heads (the
        // link's handshake told the prefill pool's parallelism): one naming fewer (a prefill
        // engine's params before all its ranks registered, or a client's crafted ones) would end
        // done with the other ranks' heads never written, and checksums do not see heads left
        // as they were (zeros add nothing).
        let short = lock(&self.pending).get(request).filter(|p| !p.release).and_then(|p| {
            let wanted = protocol::prefill_sources(
                &link.peer.kv,
                &link.peer.parallelism,
                &self.local.kv,
                &self.local.parallelism,
                self.local.tensor_rank,
            );
            (p.prefills.len() < wanted.len()).then_some((p.prefills.len(), wanted))
        });
        if let Some((named, wanted)) = short {
            let message = format!(
                "the request names {named} prefill rank(s); this decode rank's KV heads are held by {} (prefill ranks {wanted:?} of {}): name every one (ExpectKvFromPool)",
                wanted.len(),
                link.peer.parallelism.tensor
            );
            return self.fail_pending(request, vec![Reason::InvalidRequest], message, Some(&link.addr));
        }
        // Sent under the pending lock (a send only queues): a request that winds down meanwhile
        // is either not sent, or sent before the wind-down's `Release`, never after it.
        let sent = {
            let mut pending = lock(&self.pending);
            pending.get_mut(request).map(|p| {
                p.links.sent(&link.addr, link.id);
                let message = if p.release {
                    Message::Release {
                        request: request.to_owned(),
                        prompt: p.prompt.clone(),
                        token: p.release_token.clone(),
                    }
                } else {
                    self.open_window(link, request, &p.blocks);
                    Message::Register(Registration {
                        request: request.to_owned(),
                        blocks: p.blocks.clone(),
                        num_tokens: p.num_tokens,
                        first_token: p.first_token,
                        prompt: p.prompt.clone(),
                    })
                };
                link.send(&message)
            })
        };
        if sent == Some(false) {
            self.fail_pending(
                request,
                vec![Reason::PeerLost],
                format!("cannot reach prefill {}", link.addr),
                Some(&link.addr),
            );
        }
    }

    /// Dials `addr` on a thread of its own (its slot is `Connecting`); without a thread, its
    /// requests fail as for a dial that failed.
    fn spawn_connect(self: &Arc<Self>, addr: String) {
        let (e, to) = (self.clone(), addr.clone());
        if let Err(err) = super::spawn("dial", move || e.connect(to)) {
            let err = HandshakeError::from(wire::FrameError::from(err));
            self.connected(addr, Instant::now(), Err(err));
        }
    }

    fn connect(self: Arc<Self>, addr: String) {
        let started = Instant::now();
        let result = self.dial(&addr);
        self.connected(addr, started, result);
    }

    /// The end of a dial to `addr` begun at `started`.
    fn connected(self: &Arc<Self>, addr: String, started: Instant, result: Result<(Link, Opener), HandshakeError>) {
        let metrics = &self.shared.metrics;
        match result {
            Ok((link, opener)) => {
                metrics.handshake_accepted();
                lock(&self.stats).counters.handshakes_accepted += 1;
                let link = Arc::new(link);
                let queued = match lock(&self.peers).insert(addr.clone(), Slot::Connected(link.clone())) {
                    Some(Slot::Connecting(q)) => q,
                    _ => Vec::new(),
                };
                for request in queued {
                    self.send_registration(&link, &request);
                }
                // Its heartbeats come from the engine's timer ([`Engine::ping_links`]).
                let (e, reading) = (self.clone(), link.clone());
                if let Err(err) = super::spawn("prefill-link", move || e.read_prefill(reading, opener)) {
                    link.close();
                    self.lost(&link, format!("no thread to read the link: {err}"));
                }
            }
            Err(err) => {
                let reasons = err.reasons();
                for r in &reasons {
                    metrics.handshake_refused(*r);
                }
                metrics.reject_latency(started.elapsed());
                if matches!(
                    err,
                    HandshakeError::Rejected { .. } | HandshakeError::Unauthenticated(_)
                ) {
                    self.rejected(&addr, reasons.clone(), err.to_string());
                }
                tracing::info!(engine = %self.reg.engine, peer = %addr, error = %err, "handshake with prefill failed");
                if matches!(
                    err,
                    HandshakeError::Rejected { .. } | HandshakeError::Unauthenticated(_)
                ) {
                    self.remember(addr.clone(), reasons.clone(), err.to_string());
                }
                let queued = match lock(&self.peers).remove(&addr) {
                    Some(Slot::Connecting(q)) => q,
                    _ => Vec::new(),
                };
                for request in queued {
                    if self.cancel_answered(&addr, &request) {
                        continue;
                    }
                    self.fail_pending(
                        &request,
                        reasons.clone(),
                        format!("handshake with prefill {addr} failed: {err}"),
                        Some(&addr),
                    );
                }
            }
        }
    }

    /// Where this engine's agent dials ([`super::Dialable`]).
    fn dialable(&self) -> &super::Dialable {
        &self.shared.dialable
    }

    /// Rewrites `addrs` in [`one_spelling`]; `Err` naming the first this agent does not dial.
    fn dialable_all(&self, addrs: &mut [String]) -> Result<(), String> {
        let dialable = self.dialable();
        for a in addrs {
            *a = one_spelling(dialable.check(a)?);
        }
        Ok(())
    }

    fn dial(&self, addr: &str) -> Result<(Link, Opener), HandshakeError> {
        // Checked where the engine named it too; here, whatever path led to the dial.
        let sock = self.dialable().check(addr).map_err(HandshakeError::Protocol)?;
        // Held until the handshake ends: the prefill agent counts a connection against this
        // node's pre-auth places until it has authenticated ([`super::dials::DIALS_PER_HOST`]).
        let _pass = self
            .shared
            .dials
            .enter(
                sock.ip(),
                self.dial_owner.clone(),
                Instant::now() + self.handshake_timeout(),
            )
            .map_err(|m| wire::FrameError::from(io::Error::new(io::ErrorKind::TimedOut, m)))?;
        let stream = TcpStream::connect_timeout(&sock, self.handshake_timeout()).map_err(wire::FrameError::from)?;
        stream.set_nodelay(true).map_err(wire::FrameError::from)?;
        // One deadline for authentication and handshake together, however the peer paces them.
        let mut admission = None;
        let handshake_until;
        let (peer, session) = {
            let mut timed = wire::Deadline::new(&stream, self.handshake_timeout());
            handshake_until = timed.until();
            let mut session: Session = protocol::authenticate_decode(&mut timed, &self.reg.pdpair, &self.key)?;
            // Push: this prefill writes into our blocks, through our stream where we run one;
            // admitted before our handshake names the stream, so it can dial at once.
            if self.settings.mode == pdpair_api::TransferMode::Push {
                admission = Some(
                    self.transport()
                        .admit(&session.stream_key, &self.regions(), Access::Write)
                        .map_err(|e| HandshakeError::Rejected {
                            reasons: vec![Reason::TransportFailed],
                            message: e,
                        })?,
                );
            }
            // P's handshake frame, up to 4 MiB and what decoding it holds, is charged to the
            // pair's budget for frames being read, as prefill charges ours: an insider's prefill
            // answering each of many dials with one held up to 16 MiB of this agent's memory
            // each, counted nowhere (from a review).
            let shut = stream.try_clone().map_err(wire::FrameError::from)?;
            let inbox = self.inboxes.queue(shut, addr.to_owned());
            let admit = super::inbox_admit(&self.inboxes, &inbox);
            let (peer, _charged) = protocol::handshake_decode_by(&mut timed, &mut session, &self.local, admit)?;
            (peer, session)
        };
        // Heartbeats: we ping every `heartbeat` and prefill answers, so a read that waits
        // HEARTBEAT_MISSES of them means prefill is stuck; a write as long means the same.
        let silence = self.silence_limit();
        stream.set_read_timeout(Some(silence)).map_err(wire::FrameError::from)?;
        stream
            .set_write_timeout(Some(silence))
            .map_err(wire::FrameError::from)?;
        // Pull: decode reads from prefill's memory through its own endpoint.
        let ucx_peer = match self.settings.mode {
            pdpair_api::TransferMode::Pull => Some(
                self.connect_to_memory(&peer, &session.stream_key, handshake_until)
                    .map_err(|e| HandshakeError::Rejected {
                        reasons: vec![Reason::TransportFailed],
                        message: e,
                    })?,
            ),
            pdpair_api::TransferMode::Push => None,
        };
        // Which of prefill's heads are ours (pull reads just those); the handshake checked that
        // they line up.
        let heads = protocol::head_map(&peer, &self.local).unwrap_or(protocol::HeadMap {
            p_first: 0,
            count: self.layout.local_heads,
            d_first: 0,
        });
        let Session { sealer, opener, .. } = session;
        match Link::new(
            (&self.outboxes, &self.inboxes),
            stream,
            sealer,
            admission,
            peer,
            ucx_peer,
            addr.to_owned(),
            heads,
        ) {
            Ok(link) => Ok((link, opener)),
            Err(e) => {
                if let Some(id) = ucx_peer {
                    self.transport().disconnect(id);
                }
                Err(wire::FrameError::from(e).into())
            }
        }
    }

    fn silence_limit(&self) -> Duration {
        self.shared.cfg.heartbeat.min(MAX_HEARTBEAT) * HEARTBEAT_MISSES
    }

    /// Pings each prefill link every heartbeat while its reader runs (from the engine's
    /// heartbeat thread: no thread of its own per link). Prefill answers each; a link whose reader hears nothing
    /// for [`HEARTBEAT_MISSES`] of them is lost.
    pub(super) fn ping_links(&self) {
        let every = u64::try_from(self.shared.cfg.heartbeat.min(MAX_HEARTBEAT).as_micros()).unwrap_or(u64::MAX);
        let now = crate::outboxes::now();
        let due: Vec<Arc<Link>> = lock(&self.peers)
            .values()
            .filter_map(|slot| match slot {
                Slot::Connected(link) if now.saturating_sub(link.pinged.load(Ordering::SeqCst)) >= every => {
                    Some(link.clone())
                }
                _ => None,
            })
            .collect();
        for link in due {
            if !link.alive.load(Ordering::SeqCst) {
                continue;
            }
            link.pinged.store(now, Ordering::SeqCst);
            let seq = link.pings.fetch_add(1, Ordering::SeqCst) + 1;
            // A send that cannot queue closes the link; its reader then ends it.
            link.send(&Message::Ping { seq });
        }
    }

    /// Whether `request` waits on this prefill link (it is one of the request's prefills): a
    /// link may only answer for requests it was asked about, and only a request for KV with KV
    /// (`Answer::Kv`: a release asked for none, and a prefill answering one with a `Complete`
    /// made its engine hear `RequestDone`), and a release only with its `ReleaseDone`.
    /// `Answer::Read` also claims the pull read, once per link.
    fn owned_by(&self, link: &Link, request: &str, answer: Answer) -> bool {
        let mut pending = lock(&self.pending);
        let Some(p) = pending.get_mut(request) else {
            return false;
        };
        let fits = match answer {
            Answer::Kv | Answer::Read => !p.release,
            Answer::Release => p.release,
            Answer::Other => true,
        };
        if !fits {
            return false;
        }
        let reading = answer == Answer::Read;
        // Once we read (or are reading) this prefill's blocks, only that read answers.
        if !p.waits_on(&link.addr) || p.read_from(&link.addr) {
            return false;
        }
        if reading {
            p.reading.push(link.addr.clone());
        }
        true
    }

    fn read_prefill(self: Arc<Self>, link: Arc<Link>, mut opener: Opener) {
        let mut reader = match link.stream.try_clone() {
            Ok(r) => r,
            Err(_) => return self.lost(&link, "cannot read the side channel".into()),
        };
        loop {
            let frame = link.read(&mut reader, &mut opener);
            if matches!(&frame, Ok(m) if !matches!(m, Message::Ping { .. } | Message::Pong { .. })) {
                link.used.store(crate::outboxes::now(), Ordering::SeqCst);
            }
            match frame {
                // The end of a cancelled request's writes from this prefill (its Ready, in pull,
                // is answered by the Release the cancel sent).
                Ok(
                    Message::Complete { ref request, .. }
                    | Message::Failed { ref request, .. }
                    | Message::ReleaseDone { ref request },
                ) if self.cancel_answered(&link.addr, request) => {}
                Ok(Message::Ready { ref request, .. }) if lock(&self.cancelled).contains_key(request) => {}
                // Push only: in pull our own read of its blocks completes a request.
                Ok(Message::Complete { request, sums, bytes })
                    if self.settings.mode == pdpair_api::TransferMode::Push
                        && self.owned_by(&link, &request, Answer::Kv) =>
                {
                    self.complete(&link.addr, request, sums, bytes, None)
                }
                Ok(Message::Ready {
                    request,
                    blocks,
                    first_token,
                    num_tokens,
                    sums,
                }) if self.settings.mode == pdpair_api::TransferMode::Pull
                    && self.owned_by(&link, &request, Answer::Read) =>
                {
                    let (e, reading, id) = (self.clone(), link.clone(), request.clone());
                    // Counted before the link can end (this reader ends it), uncounted when the
                    // read ends however it ends (a panic included), or when it never starts (the
                    // closure dropped unrun).
                    link.reads.fetch_add(1, Ordering::SeqCst);
                    let running = ReadRunning(self.clone(), link.clone());
                    let read = move || {
                        let _running = running;
                        e.read_kv(&reading, request, blocks, first_token, num_tokens, sums);
                    };
                    if let Err(err) = super::spawn("read-kv", read) {
                        let message = format!("no thread to read prefill {}'s blocks: {err}", link.addr);
                        self.read_failed(&link, id, Reason::TransportFailed, message);
                    }
                }
                Ok(Message::Failed {
                    request,
                    reason,
                    message,
                }) if self.owned_by(&link, &request, Answer::Other) => {
                    let pending = self.fail_if_pending(
                        &request,
                        vec![reason],
                        crate::reason::peer_text(&message),
                        Some(&link.addr),
                    );
                    if !pending {
                        // Cancelled since the reader found it pending (see `complete`).
                        self.cancel_answered(&link.addr, &request);
                    }
                }
                Ok(Message::ReleaseDone { request }) if self.owned_by(&link, &request, Answer::Release) => {
                    // A release of several prefill ranks is done when each has confirmed.
                    let (all, gone) = {
                        let mut pending = lock(&self.pending);
                        match pending.get_mut(&request) {
                            Some(p) => {
                                let all = p.arrived(&link.addr, None, 0);
                                if all {
                                    // Closed while the name is held (see `complete`).
                                    self.close_windows(&request);
                                    pending.remove(&request);
                                }
                                (all, false)
                            }
                            None => (false, true),
                        }
                    };
                    if all {
                        self.answer(&AgentEvent::Released { request });
                    } else if gone {
                        // Cancelled since the reader found it pending (see `complete`).
                        self.cancel_answered(&link.addr, &request);
                    }
                }
                Ok(
                    m @ (Message::Complete { .. }
                    | Message::Ready { .. }
                    | Message::Failed { .. }
                    | Message::ReleaseDone { .. }),
                ) => {
                    // A request this link was not asked about (another prefill's, or one it
                    // already answered): ignored, so no link decides another's request.
                    self.shared.metrics.foreign_answer();
                    tracing::warn!(engine = %self.reg.engine, peer = %link.addr, message = protocol::kind(&m), "ignored an answer for a request this prefill does not own");
                }
                Ok(Message::Ping { seq }) => {
                    link.send(&Message::Pong { seq });
                }
                Ok(Message::Reject { reasons, message }) => {
                    link.alive.store(false, Ordering::SeqCst);
                    link.close();
                    return self.refused(
                        &link,
                        crate::reason::from_peer(reasons),
                        crate::reason::peer_text(&message),
                    );
                }
                Ok(_) => {}
                Err(e) => {
                    link.alive.store(false, Ordering::SeqCst);
                    // Close it: a stuck prefill must not get our later frames. Unless it closes
                    // once its queue is written (its engine went, and `finish` ended this
                    // reader): what was queued before still reaches prefill, such as the
                    // `Released` of a read whose end the engine heard just before it left
                    // (closed now, prefill held those blocks until their lease).
                    if !link.queue.draining() {
                        link.close();
                    }
                    let why = if e.timed_out() {
                        format!(
                            "silent for {:?} ({HEARTBEAT_MISSES} heartbeats unanswered)",
                            self.silence_limit()
                        )
                    } else {
                        e.to_string()
                    };
                    return self.lost(&link, why);
                }
            }
        }
    }

    /// The prefill peer refused us after the handshake (it checks its memory layout against
    /// ours): fail what waited on it with its reasons, and remember them.
    fn refused(&self, link: &Link, reasons: Vec<Reason>, message: String) {
        self.rejected(&link.addr, reasons.clone(), message.clone());
        self.remember(link.addr.clone(), reasons.clone(), message.clone());
        self.forget_link(link, reasons, format!("prefill {} refused: {message}", link.addr));
    }

    /// Pull: `link`'s connection to prefill's memory goes (once): its link ended and no read
    /// runs over it. Every decode engine that linked and left kept it before.
    fn let_go_of_memory(&self, link: &Link) {
        if let Some(id) = link.ucx_peer
            && !link.let_go.swap(true, Ordering::SeqCst)
        {
            self.transport().disconnect(id);
        }
    }

    /// Drops a prefill link (its slot, unless another link to the address holds it by now, and
    /// its connection to prefill's memory once no read runs over it) and fails the requests
    /// whose registrations went on it (each once no other prefill writes into its blocks). A link that gave way ([`Engine::room_for_link`]) may end after its
    /// engine asked that prefill again: the new link's slot and requests are not this one's.
    fn forget_link(&self, link: &Link, reasons: Vec<Reason>, message: String) {
        let addr = link.addr.as_str();
        {
            let mut peers = lock(&self.peers);
            if matches!(peers.get(addr), Some(Slot::Connected(l)) if l.id == link.id) {
                peers.remove(addr);
            }
        }
        // Pull: our connection to its memory goes with it, once no read runs over it.
        link.ended.store(true, Ordering::SeqCst);
        if link.reads.load(Ordering::SeqCst) == 0 {
            self.let_go_of_memory(link);
        }
        // A prefill whose link is gone writes nothing more into requests that are ending.
        let ending: Vec<String> = lock(&self.cancelled)
            .iter()
            .filter(|(_, c)| c.waiting.iter().any(|a| a == addr) && c.links.on(addr, link.id))
            .map(|(r, _)| r.clone())
            .collect();
        for request in ending {
            self.cancel_answered(addr, &request);
        }
        let down: Vec<WindDown> = {
            let mut pending = lock(&self.pending);
            let ids: Vec<String> = pending
                .iter()
                // A request whose read from it runs is answered by the read's end (its READs
                // may still be writing the blocks until then).
                .filter(|(_, p)| p.waits_on(addr) && !p.read_from(addr) && p.links.on(addr, link.id))
                .map(|(id, _)| id.clone())
                .collect();
            ids.into_iter()
                .filter_map(|id| {
                    let ending = Ending::Failed(reasons.clone(), message.clone(), Some(addr.to_owned()));
                    self.wind_down(&mut pending, &id, ending, Some(addr))
                })
                .collect()
        };
        for down in down {
            self.tell_writers(down);
        }
    }

    /// The prefill peer is gone: fail what waited on it (once no other prefill writes into
    /// their blocks).
    fn lost(&self, link: &Link, why: String) {
        let message = format!(
            "prefill {} ({}) went away: {why}",
            link.addr,
            crate::reason::peer_text(&link.peer.agent)
        );
        self.forget_link(link, vec![Reason::PeerLost], message);
    }

    /// A prefill rank's KV is in place (pushed to us, or read by us in `transfer_us`): verify
    /// once every rank's part is here.
    fn complete(&self, from: &str, request: String, sums: Option<BlockSums>, bytes: u64, transfer_us: Option<u64>) {
        let p = {
            let mut pending = lock(&self.pending);
            let Some(p) = pending.get_mut(&request) else {
                // Cancelled (or past its deadline) since the link's reader found it pending:
                // this ends the writes the cancel waits for (a review found it dropped, and the
                // cancel answered only at its deadline, with the link closed).
                drop(pending);
                self.cancel_answered(from, &request);
                return;
            };
            if !p.arrived(from, sums, bytes) {
                return; // more prefill ranks to come
            }
            // Its windows close while the name is still held (a new request of the name is
            // refused until then), so none it opens is closed by this one's answer, which
            // comes after the checksums are computed.
            self.close_windows(&request);
            let Some(p) = pending.remove(&request) else { return };
            p
        };
        // Each prefill's own count (push): a peer's numbers, added saturating.
        let bytes: u64 = p.parts.values().fold(0u64, |sum, (_, b)| sum.saturating_add(*b));
        // Each prefill rank summed its own heads; checksums add over heads, so the parts' sums
        // add up to decode's whole-block checksums.
        let sums = combine(p.parts.values().map(|(s, _)| s.as_ref()));
        self.shared.metrics.transfer_done(Role::Decode, bytes);
        self.transferred(bytes, p.parts.keys().map(String::as_str));
        if self.settings.checksum == ChecksumPolicy::Disabled {
            return self.answer(&AgentEvent::RequestDone {
                request,
                bytes,
                checksum: None,
                transfer_us,
            });
        }
        // A block whose checksum cannot be computed leaves the request Unverified.
        let live = self.live_blocks(&p.blocks, p.first_token, p.num_tokens);
        let ours = self
            .sums_of(&live, p.num_tokens, 0, self.layout.local_heads)
            .map(|sums| BlockSums {
                block_size: self.layout.block_size,
                first_token: p.first_token,
                sums,
            });
        let outcome = match (&sums, &ours) {
            (Some(theirs), Some(ours)) => compare_request(theirs, ours, p.num_tokens).outcome(),
            _ => Outcome::Unverified,
        };
        self.shared.metrics.checksum(outcome);
        {
            let counters = &mut lock(&self.stats).counters;
            match outcome {
                Outcome::Verified => counters.checksums_verified += 1,
                Outcome::Mismatched => counters.checksums_mismatched += 1,
                Outcome::Unverified => counters.checksums_unverified += 1,
            }
        }
        let name = format!("{outcome:?}");
        // With one prefill rank, a failure is that prefill's (with several, whose part did not
        // match is not told).
        let peer = (p.prefills.len() == 1).then(|| p.prefills[0].clone());
        match (outcome, self.settings.checksum) {
            (Outcome::Verified, _) | (_, ChecksumPolicy::FailOpen) => {
                if outcome != Outcome::Verified {
                    tracing::warn!(%request, ?outcome, "KV checksum not verified (FailOpen: accepted)");
                }
                self.answer(&AgentEvent::RequestDone {
                    request,
                    bytes,
                    checksum: Some(name),
                    transfer_us,
                });
            }
            (Outcome::Mismatched, _) => self.fail_quietly_with(
                request,
                vec![Reason::ChecksumMismatch],
                "received KV does not match prefill's checksums".into(),
                peer,
            ),
            _ => self.fail_quietly_with(
                request,
                vec![Reason::ChecksumUnverified],
                "received KV could not be verified (FailClosed)".into(),
                peer,
            ),
        }
    }

    /// Pull: read the request's KV from prefill's blocks into ours, then verify it like a push
    /// completion and release prefill's blocks.
    fn read_kv(
        &self,
        link: &Link,
        request: String,
        p_blocks: Vec<u32>,
        p_first: u64,
        num_tokens: u64,
        sums: Option<BlockSums>,
    ) {
        let Some(p) = lock(&self.pending)
            .get(&request)
            .map(|p| (p.blocks.clone(), p.first_token, p.num_tokens, p.deadline))
        else {
            // Cancelled between the Ready and this read: nothing was read, prefill's blocks are
            // free, and this prefill has ended.
            if lock(&self.cancelled).contains_key(&request) {
                link.send(&Message::Released {
                    request: request.clone(),
                    bytes: 0,
                });
                self.read_ended(&link.addr, &request);
            }
            return;
        };
        let (d_blocks, d_first, d_tokens, deadline) = p;
        let started = Instant::now();
        let outcome = if d_tokens != num_tokens {
            Err((
                Reason::TokenCountMismatch,
                format!("decode expects {d_tokens} tokens, prefill computed {num_tokens}"),
            ))
        } else if let Err(e) = crate::agent::check_tokens(p_first, num_tokens) {
            Err((Reason::InvalidRequest, format!("prefill's {e}")))
        } else {
            let p_block = u32::try_from(link.peer.kv.kernel_block_size()).unwrap_or(0);
            self.pull_plan(
                &link.peer.memory,
                link.heads,
                p_block,
                &p_blocks,
                p_first,
                &d_blocks,
                d_first,
                num_tokens,
            )
            .map_err(|m| (Reason::TokenRangeNotCovered, m))
            .and_then(|plan| match link.ucx_peer {
                Some(peer) => in_batches(plan.ops(), deadline, |ops, within, _| {
                    self.transport().get(peer, self.regions(), ops, within)
                })
                .map_err(|e| match e {
                    // The READs were cancelled and the endpoint closed: the link goes too
                    // (below, once prefill was told).
                    OpError::Timeout(_) => (Reason::TransferTimeout, format!("reading prefill's blocks: {e}")),
                    OpError::Failed(_) => (Reason::ReadFailed, format!("reading prefill's blocks failed: {e}")),
                }),
                None => Err((Reason::TransportFailed, "no UCX endpoint to prefill".into())),
            })
        };
        match outcome {
            Ok(bytes) => {
                let took = started.elapsed();
                self.moved(link);
                // This rank's part is here before prefill hears it may free its blocks: a
                // prefill that then ends (its engine done) and closes the link fails nothing.
                if let Some(p) = lock(&self.pending).get_mut(&request) {
                    p.arrived(&link.addr, sums.clone(), bytes);
                }
                link.send(&Message::Released {
                    request: request.clone(),
                    bytes,
                });
                if !self.read_ended(&link.addr, &request) {
                    self.complete(&link.addr, request, sums, bytes, Some(took.as_micros() as u64));
                }
            }
            Err((reason, message)) => self.read_failed(link, request, reason, message),
        }
    }

    /// A read over `link` ended: the last one of a link that ended lets go of prefill's memory.
    fn read_done(&self, link: &Link) {
        if link.reads.fetch_sub(1, Ordering::SeqCst) == 1 && link.ended.load(Ordering::SeqCst) {
            self.let_go_of_memory(link);
        }
    }

    /// A read of `request`'s blocks from this link failed (or never started): prefill may free
    /// them, and the request fails unless it already ended.
    fn read_failed(&self, link: &Link, request: String, reason: Reason, message: String) {
        link.send(&Message::Released {
            request: request.clone(),
            bytes: 0,
        });
        if reason == Reason::TransferTimeout {
            link.close_after_sent();
        }
        if self.read_ended(&link.addr, &request) {
            return;
        }
        self.fail_pending(&request, vec![reason], message, Some(&link.addr));
    }

    /// Pull READs, as a plan: each of our blocks (starting at `d_first`, `B_d` tokens) gathers
    /// the prefill blocks (`B_p` tokens, `B_d` a multiple) that start at its tokens, paired by
    /// absolute position. NHD blocks take each prefill block whole at its token offset; HND
    /// blocks take it head by head; adjacent reads of one layer's array are merged.
    #[allow(clippy::too_many_arguments)]
    fn pull_plan(
        &self,
        remote: &MemoryDesc,
        map: protocol::HeadMap,
        p_block: u32,
        p_blocks: &[u32],
        p_first: u64,
        d_blocks: &[u32],
        d_first: u64,
        num_tokens: u64,
    ) -> Result<Plan, String> {
        let (bd, bp) = (u64::from(self.layout.block_size), u64::from(p_block));
        if bp == 0 || bd % bp != 0 {
            return Err(format!("decode's block size {bd} is not a multiple of prefill's {bp}"));
        }
        // Which prefill block fills which part of which of ours: each takes a prefill block of
        // its own, so there are no more of them than prefill named.
        let mut items = Vec::new();
        for (i, d) in d_blocks.iter().enumerate() {
            let t = d_first + i as u64 * bd;
            if t >= num_tokens {
                break;
            }
            for j in 0..bd / bp {
                let tj = t + j * bp;
                if tj >= num_tokens {
                    break;
                }
                if tj < p_first || !(tj - p_first).is_multiple_of(bp) {
                    return Err(format!(
                        "token {tj} does not start a prefill block (prefill blocks start at {p_first})"
                    ));
                }
                let Some(pb) = p_blocks.get(((tj - p_first) / bp) as usize) else {
                    return Err(format!("token {tj} is past prefill's {} blocks", p_blocks.len()));
                };
                if *pb >= remote.num_blocks {
                    return Err(format!(
                        "prefill block {pb} is outside its {} blocks",
                        remote.num_blocks
                    ));
                }
                items.push(Item {
                    local: *d,
                    at: j as u32,
                    remote: *pb,
                });
            }
        }
        let half = self.layout.half_token() as u64;
        let nhd = self.layout.layout == pdpair_api::KvLayout::Nhd;
        let remote_heads = u32::try_from(remote.block_len / (bp * half).max(1))
            .map_err(|_| format!("prefill's block_len {} is not a block of {bp} tokens", remote.block_len))?;
        // Our heads d_first.. come from prefill's p_first.. (all of them when tensor parallelism
        // is equal); each prefill block fills the part of ours from its first token.
        let ours = |unit| BlockShape {
            tokens: self.layout.block_size,
            heads: self.layout.local_heads,
            nhd,
            unit,
        };
        self.places(
            remote,
            "prefill's",
            |local, far, len| {
                let theirs = BlockShape {
                    tokens: p_block,
                    heads: remote_heads,
                    nhd,
                    unit: far,
                };
                pieces(&ours(local), map.d_first, &theirs, map.p_first, map.count, p_block, len)
            },
            |local| bp * ours(local).token_step(),
            items,
        )
    }

    /// Cancels past their deadline: a prefill still linked that has not answered loses its link
    /// (a peer that answers heartbeats and never the `Release` would hold the engine's blocks
    /// for good); one not linked has sent nothing and writes nothing, and is answered now.
    fn expire_cancelled(&self, now: Instant) {
        let late: Vec<(String, Vec<String>, super::SentOn)> = {
            let mut cancelled = lock(&self.cancelled);
            cancelled
                .iter_mut()
                .filter(|(_, c)| c.deadline <= now)
                .map(|(request, c)| {
                    // Looked at again only if still unanswered a handshake's time later.
                    c.deadline = now + self.handshake_timeout();
                    (request.clone(), c.waiting.clone(), c.links.clone())
                })
                .collect()
        };
        for (request, waiting, links) in late {
            for addr in waiting {
                // The link the request went on, while it holds the slot (one no longer there
                // was closed: its writes ended).
                let link = match lock(&self.peers).get(&addr) {
                    Some(Slot::Connected(link)) if links.on(&addr, link.id) => Some(link.clone()),
                    _ => None,
                };
                match link {
                    Some(link) => {
                        tracing::warn!(
                            engine = %self.reg.engine, %request, prefill = %addr,
                            "a prefill has not answered a cancel by its deadline; closing its link"
                        );
                        link.close();
                    }
                    None => {
                        // Still dialling: the request is not sent when the link comes up.
                        if let Some(Slot::Connecting(queue)) = lock(&self.peers).get_mut(&addr) {
                            queue.retain(|r| r != &request);
                        }
                        self.cancel_answered(&addr, &request);
                    }
                }
            }
        }
    }

    /// Fails requests past their deadline, and ends cancels a prefill has not answered by theirs.
    pub(super) fn expire_pending(&self) {
        let now = Instant::now();
        self.expire_cancelled(now);
        let down: Vec<WindDown> = {
            let mut pending = lock(&self.pending);
            let late: Vec<(String, String)> = pending
                .iter()
                .filter(|(_, p)| p.deadline <= now)
                .map(|(request, p)| (request.clone(), p.prefills.join(", ")))
                .collect();
            late.into_iter()
                .filter_map(|(request, prefills)| {
                    let why = format!("no KV from prefill {prefills} before the deadline");
                    self.wind_down(
                        &mut pending,
                        &request,
                        Ending::Failed(vec![Reason::DeadlineExceeded], why, None),
                        None,
                    )
                })
                .collect()
        };
        for down in down {
            self.tell_writers(down);
        }
    }
}

/// How a decode request that is not pending any more ends for its engine.
#[derive(Debug)]
pub(super) enum Ending {
    /// Its engine cancelled it.
    Cancelled,
    /// It failed: reasons, message, and the prefill it failed with (its address) where one.
    Failed(Vec<Reason>, String, Option<String>),
}

/// A request [`Engine::wind_down`] took out of `pending`, and who to tell.
struct WindDown {
    request: String,
    /// The prefills that may still write into its blocks.
    writers: Vec<String>,
    /// Pull: the prefills whose blocks our own read copies (its end answers for them).
    reading: Vec<String>,
    /// Its prompt digest and release token (a release's), for the `Release`s.
    prompt: Option<PromptDigest>,
    release_token: Option<crate::engine_api::ReleaseToken>,
    /// No prefill may write: how it ends, now.
    now: Option<Ending>,
}

/// A pull read over a link, counted in [`Link::reads`] until dropped ([`Engine::read_done`]).
struct ReadRunning(Arc<Engine>, Arc<Link>);

impl Drop for ReadRunning {
    fn drop(&mut self) {
        self.0.read_done(&self.1);
    }
}

/// What a prefill's message answers ([`Engine::owned_by`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// A request for KV, with its KV (push: `Complete`).
    Kv,
    /// Pull: a request for KV, its blocks lent to our read (`Ready`), which this claims.
    Read,
    /// A release (a request that asked for nothing), confirmed (`ReleaseDone`): a registered
    /// request's `ReleaseDone` (stale, or forged) would end it while others may write.
    Release,
    /// Any request, not with KV (`Failed`).
    Other,
}

/// Why [`Engine::taken`] would say a request of the name is taken while it links its ranks.
const LINKING: &str = "is already expected (ExpectKvFromPool, linking)";

/// A decode request that is ending (cancelled, or failed) and waits for the prefills that may
/// still write into its blocks before its engine hears how.
#[derive(Debug)]
pub(super) struct Cancelling {
    /// Block ids it holds at its links (their windows), counted as a pending request's.
    pub(super) held: usize,
    /// Their addresses; each leaves when it answers (or its link goes).
    pub(super) waiting: Vec<String>,
    /// Pull: those of them whose blocks our own read copies: only its end answers for them.
    pub(super) reading: Vec<String>,
    /// The link the request went on, by address: only its loss answers for that prefill.
    pub(super) links: super::SentOn,
    /// The request's prompt digest (and a release's token), carried by the `Release`s that tell
    /// them to stop.
    pub(super) prompt: Option<PromptDigest>,
    pub(super) release_token: Option<crate::engine_api::ReleaseToken>,
    /// What the engine hears when none is left (a `Cancel` meanwhile makes it `Cancelled`).
    pub(super) ending: Ending,
    /// By when they must have answered the cancel's `Release`: a full handshake and lease from
    /// the cancel (a push running then ends within prefill's lease). A prefill still linked then
    /// loses its link, which ends its writes and answers the cancel.
    pub(super) deadline: Instant,
}

/// Adds prefill ranks' block checksums element by element; `None` when any is missing or they do
/// not cover the same blocks.
fn combine<'a>(parts: impl Iterator<Item = Option<&'a BlockSums>>) -> Option<BlockSums> {
    let mut total: Option<BlockSums> = None;
    for part in parts {
        let part = part?;
        match &mut total {
            None => total = Some(part.clone()),
            Some(t) => {
                if (t.block_size, t.first_token, t.sums.len()) != (part.block_size, part.first_token, part.sums.len()) {
                    return None;
                }
                for (a, b) in t.sums.iter_mut().zip(&part.sums) {
                    *a = a.wrapping_add(*b);
                }
            }
        }
    }
    total
}

/// Prefill agents being dialled now.
fn dialling(peers: &HashMap<String, Slot>) -> usize {
    peers.values().filter(|s| matches!(s, Slot::Connecting(_))).count()
}

/// The prefills a `Renew` naming `prefills` renews, each once in its [`one_spelling`], at most
/// [`crate::engine_api::MAX_RENEW_PREFILLS`]: where no prefill listens (`dialable` refuses it)
/// nothing is sent nor dialled, and one prefill named in several spellings is one (a frame
/// naming it 1024 ways sent it 1024 renewals).
fn renewed(prefills: &[String], dialable: impl Fn(&str) -> Result<std::net::SocketAddr, String>) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    prefills
        .iter()
        .filter_map(|p| dialable(p).map(one_spelling).ok())
        .filter(|p| seen.insert(p.clone()))
        .take(crate::engine_api::MAX_RENEW_PREFILLS)
        .collect()
}

/// One spelling for each prefill address (an IPv4 address mapped into IPv6 is written as IPv4,
/// a port without leading zeros), the key of its link, its remembered rejection and its places
/// at the dial gate: an engine naming one prefill as `10.0.0.7:40000`, `[::ffff:10.0.0.7]:40000`
/// and `10.0.0.7:040000` got a link for each, and a rejection remembered for one spelling did
/// not keep the others from dialling again.
fn one_spelling(addr: std::net::SocketAddr) -> String {
    std::net::SocketAddr::new(addr.ip().to_canonical(), addr.port()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_renewal_goes_to_each_prefill_once_in_its_one_spelling_and_nowhere_refused() {
        let dialable = |p: &str| {
            let sock: std::net::SocketAddr = p.parse().map_err(|_| format!("{p:?}"))?;
            if sock.port() == 22 {
                return Err("a service".into());
            }
            Ok(sock)
        };
        let named: Vec<String> = [
            "10.0.0.7:40000",
            "[::ffff:10.0.0.7]:40000",
            "10.0.0.7:040000",
            "10.0.0.8:22",
            "not an address",
            "10.0.0.8:40000",
            "10.0.0.7:40000",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(renewed(&named, dialable), ["10.0.0.7:40000", "10.0.0.8:40000"]);
        // At most MAX_RENEW_PREFILLS distinct prefills, the first named.
        let many: Vec<String> = (0..crate::engine_api::MAX_RENEW_PREFILLS + 5)
            .map(|i| format!("10.1.{}.{}:40000", i / 256, i % 256))
            .collect();
        let out = renewed(&many, dialable);
        assert_eq!(out.len(), crate::engine_api::MAX_RENEW_PREFILLS);
        assert_eq!(out[..], many[..crate::engine_api::MAX_RENEW_PREFILLS]);
    }
}
