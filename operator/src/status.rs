//! Status computation: from the PDPair, its pods and its PDEndpoints to `status`, as a pure
//! function. Conditions keep their lastTransitionTime while their status stays the same, so an
//! unchanged world gives an identical status and the controller writes nothing.

use std::collections::BTreeSet;

use k8s_openapi::{
    api::core::v1::Pod,
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
};
use pdpair_api::{
    Connector, KvGeometry, PDEndpoint, PDPair, PDPairStatus, Parallelism, PoolStatus, Role, TransferStatus, Verdict,
};

use crate::names::{ANNOTATION_GEOMETRY, conditions as ct, reasons};

/// Pods of one pool as the controller counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodCounts {
    /// Pods that are not terminating nor ended (phase Failed or Succeeded: an evicted pod stays
    /// until it is collected, and runs nothing).
    pub replicas: i32,
    /// Of those, the Ready ones.
    pub ready: i32,
    /// Pods not counted above: of an earlier geometry, still running while their Deployment
    /// rolls to the pair's new one.
    pub earlier: i32,
}

impl PodCounts {
    /// Counts pods, skipping terminating ones; where the pool runs from the pair's template,
    /// only those of its `geometry` ([`crate::plan::geometry_hash`], the pod template's
    /// annotation): in a rollout to a new geometry the old pods, Ready as they may be, run the
    /// geometry the pair no longer declares (and prefill and decode roll each on their own).
    pub fn of<'a>(pods: impl IntoIterator<Item = &'a Pod>, geometry: Option<&str>) -> PodCounts {
        let mut counts = PodCounts::default();
        for pod in pods {
            match counted(pod, geometry) {
                Counted::Gone => {}
                Counted::Earlier => counts.earlier += 1,
                Counted::Current { ready } => {
                    counts.replicas += 1;
                    if ready.is_some() {
                        counts.ready += 1;
                    }
                }
            }
        }
        counts
    }
}

/// How [`PodCounts::of`] counts a pod.
enum Counted {
    /// Terminating, or ended (phase Failed or Succeeded).
    Gone,
    /// Of an earlier geometry.
    Earlier,
    /// Counted: `ready` with when it turned Ready (or, not said, when the pod was made), where
    /// it is.
    Current { ready: Option<Option<Time>> },
}

fn counted(pod: &Pod, geometry: Option<&str>) -> Counted {
    let ended = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Failed" || p == "Succeeded");
    if pod.metadata.deletion_timestamp.is_some() || ended {
        return Counted::Gone;
    }
    if of_earlier_geometry(pod, geometry) {
        return Counted::Earlier;
    }
    let ready = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready" && c.status == "True"))
        .map(|c| {
            c.last_transition_time
                .clone()
                .or_else(|| pod.metadata.creation_timestamp.clone())
        });
    Counted::Current { ready }
}

/// A Ready pod of a pool, of the geometry the pool runs ([`PodCounts::of`]'s Ready ones).
#[derive(Clone, Debug, PartialEq)]
pub struct ReadyPod {
    pub role: Role,
    pub name: String,
    /// When it turned Ready (or was made, where that is not said).
    pub since: Option<Time>,
}

impl ReadyPod {
    /// Whether an engine of it (its role, in it) has one of the `live` endpoints.
    fn registered_in(&self, live: &[&PDEndpoint]) -> bool {
        live.iter().any(|e| e.spec.role == self.role && e.spec.pod == self.name)
    }

    /// `role`'s Ready pods among `pods`, as [`PodCounts::of`] counts them.
    pub fn of<'a>(role: Role, pods: impl IntoIterator<Item = &'a Pod>, geometry: Option<&str>) -> Vec<ReadyPod> {
        pods.into_iter()
            .filter_map(|pod| match counted(pod, geometry) {
                Counted::Current { ready: Some(since) } => Some(ReadyPod {
                    role,
                    name: pod.metadata.name.clone().unwrap_or_default(),
                    since,
                }),
                _ => None,
            })
            .collect()
    }
}

/// Whether `pod` runs from a template of another geometry than `geometry` (the pool's current
/// [`crate::plan::geometry_hash`]; `None`: a pool the user brings, whose pods all count).
pub fn of_earlier_geometry(pod: &Pod, geometry: Option<&str>) -> bool {
    geometry.is_some_and(|want| {
        pod.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_GEOMETRY))
            .map(String::as_str)
            != Some(want)
    })
}

/// Whether `a` and `b` differ in the transfer counters alone (the sums of the engines'
/// counters, which change with every transfer), not in a condition, a count of pods or of
/// engines.
pub fn only_counters_differ(a: &PDPairStatus, b: &PDPairStatus) -> bool {
    let mut same = a.clone();
    if let (Some(t), Some(theirs)) = (same.transfer.as_mut(), b.transfer.as_ref()) {
        t.counters = theirs.counters.clone();
    }
    a != b && same == *b
}

/// What the controller observed about a PDPair's world.
#[derive(Clone, Debug, Default)]
pub struct Observed<'a> {
    /// Prefill pods.
    pub prefill: PodCounts,
    /// Decode pods.
    pub decode: PodCounts,
    /// The pair's PDEndpoints.
    pub endpoints: Vec<&'a PDEndpoint>,
    /// Pods (by name) of an earlier geometry, still running while their Deployment rolls to the
    /// pair's new one: their engines run the geometry the pair declared before, which is not a
    /// mismatch.
    pub earlier_pods: std::collections::BTreeSet<String>,
    /// The API server refused a pool's Deployment as planned: what was (not) applied, and its
    /// message.
    pub apply_refused: Option<String>,
    /// Both pools' Ready pods ([`ReadyPod::of`]).
    pub ready_pods: Vec<ReadyPod>,
}

/// A condition whose status changed, for an Event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    /// Condition type.
    pub type_: String,
    /// Previous status, `None` when the condition is new.
    pub from: Option<String>,
    /// The condition as it is now.
    pub to_status: String,
    /// Its reason.
    pub reason: String,
    /// Its message.
    pub message: String,
    /// Whether the new state is bad news (a Warning Event).
    pub warning: bool,
}

struct Cond {
    type_: &'static str,
    status: &'static str,
    reason: String,
    message: String,
}

/// The most characters of a condition's message. Endpoints' text folds into them (each field
/// bounded by the PDEndpoint CRD), and a status past what etcd stores was never written.
pub const MAX_MESSAGE: usize = 4096;

impl Cond {
    fn new(type_: &'static str, status: &'static str, reason: &str, message: String) -> Cond {
        Cond {
            type_,
            status,
            reason: reason.to_owned(),
            message,
        }
    }
}

/// A condition's message as status keeps it: control characters escaped (endpoints' text is
/// whoever wrote them) and cut to [`MAX_MESSAGE`]. Every condition goes through it as it is
/// written (some messages are added to after they are made).
fn tidy(message: &str) -> String {
    let escaped: String = message
        .chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect();
    pdpair_api::clamp_text(&escaped, MAX_MESSAGE)
}

/// The status the PDPair should have, and the transitions from `old`.
pub fn compute(pair: &PDPair, observed: &Observed<'_>, now: &Time) -> (PDPairStatus, Vec<Transition>) {
    let old = pair.status.as_ref();
    let generation = pair.metadata.generation;
    // What the pair's engines say is taken from live endpoints only: one whose agent has not
    // written it for STALE_SECONDS speaks for an engine (or agent) that is gone, as one left by
    // an engine restarted under a new name in the same Pod, or by an evicted Pod, is (their old
    // geometry, rejections and paths held the pair's conditions, and their counters its totals).
    // Whether each role still has a live one is `missing_engines`' to say.
    let live: Vec<&PDEndpoint> = observed.endpoints.iter().copied().filter(|e| !stale(e, now)).collect();
    let geometry = geometry_condition(pair, &live, &observed.earlier_pods);
    let prefill = pool_condition(
        ct::PREFILL_READY,
        Role::Prefill,
        pair.spec.prefill.replicas,
        observed.prefill,
    );
    let decode = pool_condition(
        ct::DECODE_READY,
        Role::Decode,
        pair.spec.decode.replicas,
        observed.decode,
    );
    let transfer = match missing_engines(pair, &observed.endpoints, now) {
        Some(msg) => Cond::new(ct::TRANSFER_READY, "Unknown", reasons::NO_ENDPOINTS, msg),
        None => {
            let news = transfer_condition(&live, now);
            let unregistered = [
                unregistered_pods(pair, &observed.ready_pods, &live, now),
                partly_registered(pair, &observed.endpoints, now),
            ];
            let unregistered: Vec<String> = unregistered.into_iter().flatten().collect();
            match (!unregistered.is_empty()).then(|| unregistered.join("; ")) {
                // What else is news, said after it.
                Some(msg) if news.status == "False" => Cond::new(
                    ct::TRANSFER_READY,
                    "False",
                    reasons::NOT_REGISTERED,
                    format!("{msg}; and {}", news.message),
                ),
                Some(msg) => Cond::new(ct::TRANSFER_READY, "False", reasons::NOT_REGISTERED, msg),
                None => news,
            }
        }
    };
    let path = path_condition(pair, &live, now);
    let applied = match &observed.apply_refused {
        Some(why) => Cond::new(ct::POOLS_APPLIED, "False", reasons::APPLY_FAILED, why.clone()),
        None => Cond::new(
            ct::POOLS_APPLIED,
            "True",
            reasons::APPLIED,
            "the pools' Deployments are as the spec plans them".to_owned(),
        ),
    };
    // With pdpair's connector every engine registers with its node agent: pods Ready without
    // any (a template that does not start vLLM with it, an agent gone or refusing it) are not a
    // ready pair.
    let registered = pair.spec.transfer.connector != Connector::Pdpair
        || (transfer.reason != reasons::NO_ENDPOINTS && transfer.reason != reasons::NOT_REGISTERED);
    let ready = ready_condition(&geometry, &applied, &prefill, &decode, (&transfer, registered), &path);
    let mut conditions = Vec::new();
    let mut transitions = Vec::new();
    for mut c in [geometry, applied, prefill, decode, transfer, path, ready] {
        c.message = tidy(&c.message);
        let previous = old.and_then(|s| s.conditions.iter().find(|p| p.type_ == c.type_));
        let changed = previous.is_none_or(|p| p.status != c.status);
        let warning = c.status == "False"
            && matches!(
                c.type_,
                ct::GEOMETRY_COMPATIBLE | ct::POOLS_APPLIED | ct::TRANSFER_READY | ct::TRANSFER_PATH
            );
        // New conditions start quietly unless they bring bad news; changes always speak.
        if previous.is_some_and(|p| p.status != c.status) || (previous.is_none() && warning) {
            transitions.push(Transition {
                type_: c.type_.to_owned(),
                from: previous.map(|p| p.status.clone()),
                to_status: c.status.to_owned(),
                reason: c.reason.clone(),
                message: c.message.clone(),
                warning,
            });
        }
        let last_transition_time = match previous {
            Some(p) if !changed => p.last_transition_time.clone(),
            _ => now.clone(),
        };
        conditions.push(Condition {
            type_: c.type_.to_owned(),
            status: c.status.to_owned(),
            reason: c.reason,
            message: c.message,
            observed_generation: generation,
            last_transition_time,
        });
    }
    let mut totals = TransferStatus {
        endpoints: live.len() as i32,
        ..TransferStatus::default()
    };
    for e in &live {
        if let Some(s) = &e.status {
            totals.counters.add(&s.counters);
        }
    }
    let status = PDPairStatus {
        observed_generation: generation,
        conditions,
        prefill: Some(PoolStatus {
            replicas: observed.prefill.replicas,
            ready_replicas: observed.prefill.ready,
        }),
        decode: Some(PoolStatus {
            replicas: observed.decode.replicas,
            ready_replicas: observed.decode.ready,
        }),
        transfer: Some(totals),
    };
    (status, transitions)
}

fn verdict_condition(verdict: &Verdict, context: &str) -> Option<Cond> {
    let first = verdict.violations.first()?;
    Some(Cond::new(
        ct::GEOMETRY_COMPATIBLE,
        "False",
        first.reason.as_str(),
        format!("{context}{verdict}"),
    ))
}

fn geometry_condition<'a>(
    pair: &PDPair,
    endpoints: &[&'a PDEndpoint],
    earlier_pods: &std::collections::BTreeSet<String>,
) -> Cond {
    let declared = pdpair_api::check(&pair.spec);
    if let Some(c) = verdict_condition(&declared, "declared geometry: ") {
        return c;
    }
    // Engines of pods a rollout to a new geometry is replacing run the one declared before.
    let (earlier, endpoints): (Vec<&PDEndpoint>, Vec<&PDEndpoint>) =
        endpoints.iter().partition(|e| earlier_pods.contains(&e.spec.pod));
    for e in &endpoints {
        let pool = match e.spec.role {
            Role::Prefill => &pair.spec.prefill,
            Role::Decode => &pair.spec.decode,
        };
        let diffs = differences(&pool.parallelism, &pool.kv, &e.spec.parallelism, &e.spec.kv);
        if !diffs.is_empty() {
            let who = e.metadata.name.as_deref().unwrap_or("?");
            let message = format!(
                "PDEndpoint {who} (pod {}, {}) runs another geometry than spec.{} declares: {}",
                e.spec.pod,
                e.spec.role,
                e.spec.role,
                diffs.join(", ")
            );
            return Cond::new(
                ct::GEOMETRY_COMPATIBLE,
                "False",
                reasons::OBSERVED_GEOMETRY_MISMATCH,
                message,
            );
        }
    }
    // Every engine runs what its pool declares (up to spelling), but for what a pool leaves
    // undeclared (`engineVersion`): the agents check the engines' own geometries with the rule
    // table at every handshake, so a prefill and a decode of other vLLM versions refuse each
    // other though each matches its pool. Each distinct prefill and decode geometry is checked
    // as the agents check them.
    let geometries = |role: Role| {
        let mut seen = BTreeSet::new();
        endpoints
            .iter()
            .filter(move |e| e.spec.role == role)
            .filter(move |e| seen.insert(serde_json::to_string(&(&e.spec.parallelism, &e.spec.kv)).unwrap_or_default()))
            .copied()
            .collect::<Vec<&PDEndpoint>>()
    };
    let (prefills, decodes) = (geometries(Role::Prefill), geometries(Role::Decode));
    for p in &prefills {
        for d in &decodes {
            let pool = |e: &'a PDEndpoint| pdpair_api::rules::Pool {
                parallelism: &e.spec.parallelism,
                kv: &e.spec.kv,
            };
            let verdict =
                pdpair_api::check_pools(pair.spec.transfer.mode, pair.spec.transfer.checksum, pool(p), pool(d));
            let context = format!(
                "the engines of PDEndpoints {} (prefill, pod {}) and {} (decode, pod {}) refuse each other: ",
                p.metadata.name.as_deref().unwrap_or("?"),
                p.spec.pod,
                d.metadata.name.as_deref().unwrap_or("?"),
                d.spec.pod
            );
            if let Some(c) = verdict_condition(&verdict, &context) {
                return c;
            }
        }
    }
    let mut message = if endpoints.is_empty() {
        "declared geometry passes the rule table; no engine has reported its geometry yet".to_owned()
    } else {
        format!(
            "declared geometry passes the rule table and matches all {} registered engines",
            endpoints.len()
        )
    };
    if !earlier.is_empty() {
        message.push_str(&format!(
            "; {} more of an earlier geometry not compared, until the rollout replaces them",
            earlier.len()
        ));
    }
    Cond::new(ct::GEOMETRY_COMPATIBLE, "True", reasons::COMPATIBLE, message)
}

/// A geometry with its defaults spelled out: the kernel block size (absent means the block
/// size) and the cache dtype (`auto` means the model dtype), so two spellings of one geometry
/// compare equal.
pub fn canonical(kv: &KvGeometry) -> KvGeometry {
    KvGeometry {
        kernel_block_size: Some(kv.kernel_block_size()),
        cache_dtype: kv.resolved_cache_dtype(),
        ..kv.clone()
    }
}

/// Field-by-field differences between declared and observed geometry, as `field declared X,
/// observed Y`; only differences in meaning (see [`canonical`]). `engineVersion` counts only
/// where both say one: a pool that declares none runs whichever version its image has (the
/// vLLM connector always reports its own). An observed `parallelism.data` of 1 is not held to
/// the pool's: vLLM runs a dense model's data-parallel ranks as engines of their own, each of
/// data parallelism 1 (`reconfigure_for_independent_dp_rank`), and its connector sees no more.
pub fn differences(
    declared_par: &Parallelism,
    declared_kv: &KvGeometry,
    observed_par: &Parallelism,
    observed_kv: &KvGeometry,
) -> Vec<String> {
    let mut out = Vec::new();
    let mut observed_par = observed_par.clone();
    if observed_par.data == 1 {
        observed_par.data = declared_par.data;
    }
    let observed_par = &observed_par;
    let (mut declared_kv, mut observed_kv) = (declared_kv.clone(), observed_kv.clone());
    if declared_kv.engine_version.is_none() || observed_kv.engine_version.is_none() {
        (declared_kv.engine_version, observed_kv.engine_version) = (None, None);
    }
    let (declared_kv, observed_kv) = (&declared_kv, &observed_kv);
    for (prefix, declared, observed) in [
        (
            "parallelism",
            serde_json::to_value(declared_par),
            serde_json::to_value(observed_par),
        ),
        (
            "kv",
            serde_json::to_value(canonical(declared_kv)),
            serde_json::to_value(canonical(observed_kv)),
        ),
    ] {
        let (Ok(serde_json::Value::Object(d)), Ok(serde_json::Value::Object(o))) = (declared, observed) else {
            continue;
        };
        let keys: BTreeSet<&String> = d.keys().chain(o.keys()).collect();
        for key in keys {
            let (dv, ov) = (d.get(key), o.get(key));
            if dv != ov {
                let show = |v: Option<&serde_json::Value>| v.map_or("unset".to_owned(), ToString::to_string);
                out.push(format!("{prefix}.{key} declared {}, observed {}", show(dv), show(ov)));
            }
        }
    }
    out
}

fn pool_condition(type_: &'static str, role: Role, desired: i32, pods: PodCounts) -> Cond {
    let mut message = format!("{}/{desired} {role} pods ready ({} exist)", pods.ready, pods.replicas);
    if pods.earlier > 0 {
        message.push_str(&format!(
            "; {} more of an earlier geometry, not counted, until the rollout replaces them",
            pods.earlier
        ));
    }
    if desired < 0 {
        // Stored past the webhook (from before the CRD's schema bounded it): no Deployment of
        // it is applied (PoolsApplied says why, where the operator runs the pool), and no count
        // of pods is ready for it.
        message.push_str(&format!("; replicas {desired} is refused: it must be 0 or more"));
        Cond::new(type_, "False", reasons::PODS_NOT_READY, message)
    } else if pods.ready >= desired {
        Cond::new(type_, "True", reasons::PODS_READY, message)
    } else {
        Cond::new(type_, "False", reasons::PODS_NOT_READY, message)
    }
}

/// How long a rejected handshake or a failed transfer counts against `TransferReady` when no
/// transfer of that engine completed after it.
pub const RECENT_SECONDS: i64 = 15 * 60;

/// Whether an outcome at `at` still counts: within [`RECENT_SECONDS`] of `now`, and no later
/// success on that engine (a success in the same second does not clear it: the agent reports
/// seconds).
fn current(at: &Time, last_success: Option<&Time>, now: &Time) -> bool {
    within(at, now, RECENT_SECONDS - 1) && last_success.is_none_or(|s| s.0.as_second() <= at.0.as_second())
}

/// Whether an agent's time `t` is at most `max_age` seconds behind `now` and at most
/// [`SKEW_SECONDS`] ahead of it (news from the future, past clocks' skew, is not news: it would
/// count until then).
fn within(t: &Time, now: &Time, max_age: i64) -> bool {
    let age = now.0.as_second().saturating_sub(t.0.as_second());
    (-SKEW_SECONDS..=max_age).contains(&age)
}

/// How far ahead of the operator's clock an agent's may be: a time further ahead is not taken
/// (one in the future kept a rejection, or an endpoint's heartbeat, current until then).
pub const SKEW_SECONDS: i64 = 300;

/// The endpoints (by name) some of whose `news` (rejections, failures: the last, then earlier
/// ones of other peers) still `counts`, each with the newest such.
fn current_news<'a, T: 'a, I: Iterator<Item = &'a T>>(
    endpoints: &[&'a PDEndpoint],
    news: impl Fn(&'a pdpair_api::PDEndpointStatus) -> I,
    counts: impl Fn(&T, &pdpair_api::PDEndpointStatus) -> bool,
) -> Vec<(String, &'a T)> {
    endpoints
        .iter()
        .filter_map(|e| {
            let s = e.status.as_ref()?;
            let n = news(s).find(|n| counts(n, s))?;
            Some((e.metadata.name.clone().unwrap_or_else(|| "?".into()), n))
        })
        .collect()
}

/// Whether news (a rejection, a failure) at `at`, with `peer` where the agent names one, still
/// stands: it is news ([`current`] but for the engine's later transfers), no transfer with
/// that same peer completed since (`resolved`), and either the peer is still the address of a
/// live endpoint among `endpoints` (an engine failing with, or rejecting, one peer and
/// transferring with another flipped `TransferReady` with each, an Event each time) or, the
/// peer gone, unnamed or not an engine of the pair, no transfer of the engine completed since.
fn news_stands(
    (at, peer, resolved): (&Time, Option<&str>, Option<&Time>),
    last_success: Option<&Time>,
    addresses: &LiveAddresses,
    now: &Time,
) -> bool {
    if !current(at, None, now) || resolved.is_some_and(|t| t.0.as_second() >= at.0.as_second()) {
        return false;
    }
    peer.is_some_and(|peer| addresses.holds(peer)) || current(at, last_success, now)
}

/// The side-channel addresses of live endpoints, each as decode's agent spells a prefill (an
/// IPv4 address mapped into IPv6 written as IPv4), gathered once per fold.
struct LiveAddresses(std::collections::HashSet<std::net::SocketAddr>);

impl LiveAddresses {
    fn spelled(a: &str) -> Option<std::net::SocketAddr> {
        a.parse::<std::net::SocketAddr>()
            .ok()
            .map(|s| std::net::SocketAddr::new(s.ip().to_canonical(), s.port()))
    }

    fn of(endpoints: &[&PDEndpoint]) -> Self {
        LiveAddresses(
            endpoints
                .iter()
                .filter_map(|e| Self::spelled(&e.spec.address))
                .collect(),
        )
    }

    /// Whether `peer` is one of them (an address that is not an IP and port never is).
    fn holds(&self, peer: &str) -> bool {
        Self::spelled(peer).is_some_and(|p| self.0.contains(&p))
    }
}

/// `TransferReady` from each engine's recent outcomes (not its lifetime counters): False while an
/// engine's latest news is a rejected handshake (a peer it cannot pair with) or a failed transfer
/// on the path (transport, peer, checksum), True once a transfer completed after it or it is older
/// than [`RECENT_SECONDS`]. Routine engine-side failures (an expired lease, a missed deadline)
/// never count: the agent does not report them as failures of the path.
/// A PDEndpoint its agent has not written for this long is stale (agents write every 30 s):
/// the agent, or its engine, is gone.
pub const STALE_SECONDS: i64 = 120;

/// Whether `e`'s agent has not written it for over [`STALE_SECONDS`]: heard of when its agent
/// last wrote its status, or, where it never did (an agent gone, or refused
/// `pdendpoints/status`, between writing the spec and the status), when it was made.
fn stale(e: &PDEndpoint, now: &Time) -> bool {
    e.status
        .as_ref()
        .and_then(|s| s.last_heartbeat.as_ref())
        .or(e.metadata.creation_timestamp.as_ref())
        .is_some_and(|t| !within(t, now, STALE_SECONDS))
}

/// How long until what [`compute`] folds from `endpoints` and `ready_pods` changes with time
/// alone, nothing written meanwhile: the soonest a live endpoint goes stale, a path or a
/// rejection or failure leaves its window, or a Ready pod without a live engine has been so
/// for [`UNREGISTERED_SECONDS`]. `None` when nothing will. (When every agent of a role died, no
/// write came to reconcile the pair, and its conditions waited for the 5-minute resync.)
pub fn changes_in(
    pair: &PDPair,
    endpoints: &[&PDEndpoint],
    ready_pods: &[ReadyPod],
    now: &Time,
) -> Option<std::time::Duration> {
    let now_s = now.0.as_second();
    let due = |t: &Time, window: i64| {
        let at = t.0.as_second().saturating_add(window).saturating_add(1);
        (within(t, now, window) && at > now_s).then_some(at - now_s)
    };
    // Stale endpoints are folded no more: nothing of theirs to wait for.
    let live: Vec<&PDEndpoint> = endpoints.iter().copied().filter(|e| !stale(e, now)).collect();
    let unregistered = ready_pods
        .iter()
        .filter(|p| !p.registered_in(&live))
        .filter_map(|p| due(p.since.as_ref()?, UNREGISTERED_SECONDS));
    live.iter()
        .flat_map(|e| {
            let heard = e
                .status
                .as_ref()
                .and_then(|s| s.last_heartbeat.as_ref())
                .or(e.metadata.creation_timestamp.as_ref())
                .and_then(|t| due(t, STALE_SECONDS));
            let s = e.status.as_ref();
            let paths = s.into_iter().flat_map(|s| {
                s.paths
                    .iter()
                    .filter_map(|p| due(p.last_used.as_ref()?, RECENT_SECONDS))
            });
            let news = s.into_iter().flat_map(|s| {
                s.rejections()
                    .map(|r| &r.time)
                    .chain(s.failures().map(|f| &f.time))
                    .filter_map(|t| due(t, RECENT_SECONDS - 1))
            });
            heard.into_iter().chain(paths).chain(news)
        })
        .chain(unregistered)
        .chain(
            partly_registered_pods(pair, endpoints, now)
                .into_iter()
                .filter_map(|p| {
                    let at = p.changed.saturating_add(UNREGISTERED_SECONDS).saturating_add(1);
                    (at > now_s).then_some(at - now_s)
                }),
        )
        .min()
        .map(|secs| std::time::Duration::from_secs(secs.unsigned_abs()))
}

/// How long a Ready pod may run with no engine registered with its node agent before, with
/// pdpair's connector, it turns `TransferReady` False: its PDEndpoint is made as its engine
/// registers, before vLLM answers its health check, but a status written a moment after the
/// Pod's is not news.
pub const UNREGISTERED_SECONDS: i64 = 60;

/// With pdpair's connector: the Ready pods with no live engine registered for over
/// [`UNREGISTERED_SECONDS`], said as a `TransferReady` message (their engines run, but no KV
/// moves to or from them: the connector is not in the image, the agent refused or could not
/// fit it, or none serves on the node); `None` when there are none.
fn unregistered_pods(pair: &PDPair, ready: &[ReadyPod], live: &[&PDEndpoint], now: &Time) -> Option<String> {
    if pair.spec.transfer.connector != Connector::Pdpair {
        return None;
    }
    let silent: Vec<String> = ready
        .iter()
        .filter(|p| {
            p.since
                .as_ref()
                .is_none_or(|t| now.0.as_second().saturating_sub(t.0.as_second()) > UNREGISTERED_SECONDS)
        })
        .filter(|p| !p.registered_in(live))
        .map(|p| format!("{} pod {}", p.role, p.name))
        .collect();
    if silent.is_empty() {
        return None;
    }
    let count = silent.len();
    let named = name_a_few(silent);
    Some(format!(
        "{} pod(s) Ready for over {UNREGISTERED_SECONDS} s have no live PDEndpoint, so no engine of theirs registered with their node agent, or their agent cannot publish it: {named} (no KV moves to or from them; the engine's log says why: the connector not loaded, the agent refused it or has no room for its pool yet, or no agent serves on the node; else the agent's: the API server unreachable or refusing it)",
        count
    ))
}

/// A Pod holding some of an engine's tensor-parallel ranks registered and not others, or fewer
/// engines registered than it runs ([`partly_registered_pods`]).
struct PartlyRegistered {
    role: Role,
    tensor: usize,
    pod: String,
    /// The ranks with fewer live endpoints in the Pod than its others.
    short: Vec<usize>,
    /// The engines short of a rank, where each endpoint of the Pod names its engine
    /// (`spec.instance`).
    engines: Vec<String>,
    /// Engines registered in the Pod and how many it runs, where fewer registered than its
    /// endpoints say it runs (`spec.podEngines`: each endpoint says it and names its engine).
    engines_short: Option<(usize, usize)>,
    /// When what counted for it last changed (unix seconds): an engine of it registered, or an
    /// endpoint went stale.
    changed: i64,
}

/// When `e` last changed what it says about its engine's registration (unix seconds): live, its
/// engine's registration (`status.registered`, or without it the endpoint's creation: an engine
/// registering again under its old name keeps its endpoint); `stale`, when it went stale (its
/// last heartbeat, or without one its creation, and [`STALE_SECONDS`]).
fn registration_changed(e: &PDEndpoint, stale: bool, now: &Time) -> Option<i64> {
    let status = e.status.as_ref();
    let agents = if stale {
        status.and_then(|s| s.last_heartbeat.as_ref())
    } else {
        status.and_then(|s| s.registered.as_ref())
    };
    // An agent's time further ahead than clocks' skew is not taken (it would hold the grace
    // open until then): the endpoint's creation, which the API server wrote, instead.
    let at = agents
        .filter(|t| within(t, now, i64::MAX))
        .or(e.metadata.creation_timestamp.as_ref())?
        .0
        .as_second();
    Some(if stale { at.saturating_add(STALE_SECONDS) } else { at })
}

/// Each rank of an engine registers with its agent on its own, naming its rank
/// (`spec.tensorRank`). Per role and tensor parallelism, the Pods whose live endpoints do not
/// count each rank alike (a rank missing, or one of two engines of the Pod short of one), where
/// each Pod is whole engines: always where the operator runs the pool; in a pool you bring,
/// which may spread an engine's ranks over several Pods, only where a Pod of it holds every
/// rank (otherwise a Pod holding some is not news). Each Pod is judged from its own endpoints
/// and its own last change. A Pod with an endpoint that names no rank (an agent before
/// `tensorRank`) or one outside the parallelism is left out. Where each live endpoint of a Pod
/// names its engine (`spec.instance`), each engine is judged on its own ranks as well: two
/// engines each short of another rank count the ranks alike, but each is short of one. Where
/// each also says how many engines the Pod runs (`spec.podEngines`: vLLM's data-parallel ranks
/// in it), a Pod with fewer engines named is short of a whole engine.
fn partly_registered_pods(pair: &PDPair, endpoints: &[&PDEndpoint], now: &Time) -> Vec<PartlyRegistered> {
    struct Held<'a> {
        counts: Vec<usize>,
        /// Each named engine's ranks.
        engines: std::collections::BTreeMap<&'a str, Vec<usize>>,
        /// A live endpoint names no engine (an engine or agent before `instance`).
        unnamed: bool,
        /// The most engines a live endpoint says the Pod runs.
        pod_engines: usize,
        /// A live endpoint does not say how many engines the Pod runs.
        unsaid: bool,
        left_out: bool,
        changed: i64,
    }
    let mut groups: std::collections::BTreeMap<(bool, usize), std::collections::BTreeMap<&str, Held>> =
        Default::default();
    for e in endpoints {
        let Some(tensor) = usize::try_from(e.spec.parallelism.tensor)
            .ok()
            .filter(|n| (1..=1024).contains(n))
        else {
            continue;
        };
        let is_stale = stale(e, now);
        let Some(changed) = registration_changed(e, is_stale, now) else {
            continue;
        };
        let held = groups
            .entry((e.spec.role == Role::Decode, tensor))
            .or_default()
            .entry(e.spec.pod.as_str())
            .or_insert_with(|| Held {
                counts: vec![0; tensor],
                engines: Default::default(),
                unnamed: false,
                pod_engines: 0,
                unsaid: false,
                left_out: false,
                changed,
            });
        held.changed = held.changed.max(changed);
        if is_stale {
            continue;
        }
        match e
            .spec
            .tensor_rank
            .and_then(|r| usize::try_from(r).ok())
            .filter(|r| *r < tensor)
        {
            Some(rank) => {
                held.counts[rank] += 1;
                match e.spec.instance.as_deref() {
                    Some(engine) => held.engines.entry(engine).or_insert_with(|| vec![0; tensor])[rank] += 1,
                    None => held.unnamed = true,
                }
                match e
                    .spec
                    .pod_engines
                    .filter(|n| (1..=pdpair_api::MAX_POD_ENGINES.min(e.spec.parallelism.data)).contains(n))
                    .and_then(|n| usize::try_from(n).ok())
                {
                    Some(n) => held.pod_engines = held.pod_engines.max(n),
                    None => held.unsaid = true,
                }
            }
            None => held.left_out = true,
        }
    }
    let mut out = Vec::new();
    for ((decode, tensor), pods) in groups {
        let role = if decode { Role::Decode } else { Role::Prefill };
        let pool = if decode { &pair.spec.decode } else { &pair.spec.prefill };
        let counted: Vec<(&str, &Held)> = pods
            .iter()
            .filter(|(_, h)| !h.left_out && h.counts.iter().any(|c| *c > 0))
            .map(|(p, h)| (*p, h))
            .collect();
        let whole_engines = pool.template.is_some() || counted.iter().any(|(_, h)| h.counts.iter().all(|c| *c > 0));
        if !whole_engines {
            continue;
        }
        for (pod, h) in counted {
            let short_in = |ranks: &[usize], r: usize| ranks[r] < ranks.iter().copied().max().unwrap_or_default();
            // Where every endpoint names its engine, each engine is judged too (an engine's own
            // word: two that name the same one count together, as unnamed ones do).
            let short_engines: Vec<(&str, &Vec<usize>)> = match h.unnamed {
                true => Vec::new(),
                false => h
                    .engines
                    .iter()
                    .filter(|(_, ranks)| (0..tensor).any(|r| short_in(ranks, r)))
                    .map(|(engine, ranks)| (*engine, ranks))
                    .collect(),
            };
            let short: Vec<usize> = (0..tensor)
                .filter(|r| short_in(&h.counts, *r) || short_engines.iter().any(|(_, ranks)| short_in(ranks, *r)))
                .collect();
            // Where every endpoint names its engine and says how many the Pod runs, a Pod
            // missing a whole engine (a data-parallel rank that never registered) is short too.
            let engines_short = (!h.unnamed && !h.unsaid && h.engines.len() < h.pod_engines)
                .then_some((h.engines.len(), h.pod_engines));
            if !short.is_empty() || engines_short.is_some() {
                out.push(PartlyRegistered {
                    role,
                    tensor,
                    pod: pod.to_owned(),
                    short,
                    engines: short_engines.iter().map(|(engine, _)| (*engine).to_owned()).collect(),
                    engines_short,
                    changed: h.changed,
                });
            }
        }
    }
    out
}

/// Pods with an engine running with some of its tensor-parallel ranks registered and others
/// not, or with fewer engines registered than they run, for over [`UNREGISTERED_SECONDS`] since
/// what counted for them last changed, said as a `TransferReady` message: KV moves for a
/// request only with every rank of an engine, so such an engine's requests move none.
fn partly_registered(pair: &PDPair, endpoints: &[&PDEndpoint], now: &Time) -> Option<String> {
    let settled: Vec<String> = partly_registered_pods(pair, endpoints, now)
        .into_iter()
        .filter(|p| now.0.as_second().saturating_sub(p.changed) > UNREGISTERED_SECONDS)
        .map(|p| {
            let mut said = Vec::new();
            if !p.short.is_empty() {
                let short: Vec<String> = p.short.iter().map(usize::to_string).collect();
                let engines = match p.engines.is_empty() {
                    true => String::new(),
                    false => format!(": engine {}", first_few(&p.engines)),
                };
                said.push(format!("rank {} of {} short{engines}", first_few(&short), p.tensor));
            }
            if let Some((registered, runs)) = p.engines_short {
                said.push(format!("{registered} of {runs} engines registered"));
            }
            format!("{} pod {} ({})", p.role, p.pod, said.join("; "))
        })
        .collect();
    if settled.is_empty() {
        return None;
    }
    let count = settled.len();
    Some(format!(
        "{count} pod(s) have had an engine partly registered (some of its tensor-parallel ranks registered and others not, or fewer of the pod's engines registered than it runs) for over {UNREGISTERED_SECONDS} s: {} (KV moves to or from none of an engine short's ranks; the log of the rank or engine short says why it did not register, or its agent's why it cannot publish it)",
        name_a_few(settled)
    ))
}

/// `names` sorted, the first [`PATHS_NAMED`] of them, and how many more there are.
fn name_a_few<S: AsRef<str> + Ord>(mut names: Vec<S>) -> String {
    names.sort_unstable();
    first_few(&names)
}

/// The first [`PATHS_NAMED`] of `items`, in their order, and how many more there are.
fn first_few<S: AsRef<str>>(items: &[S]) -> String {
    let shown: Vec<&str> = items.iter().take(PATHS_NAMED).map(AsRef::as_ref).collect();
    let mut named = shown.join(", ");
    let more = items.len().saturating_sub(PATHS_NAMED);
    if more > 0 {
        named.push_str(&format!(" and {more} more"));
    }
    named
}

/// With pdpair's connector: which role has no live engine registered (its PDEndpoints missing,
/// or stale), said as a `TransferReady` message; `None` when both have one, or the connector is
/// not pdpair's (engines the operator does not wire may not register at all).
fn missing_engines(pair: &PDPair, endpoints: &[&PDEndpoint], now: &Time) -> Option<String> {
    if pair.spec.transfer.connector != Connector::Pdpair {
        return None;
    }
    let missing: Vec<String> = [Role::Prefill, Role::Decode]
        .into_iter()
        .filter_map(|role| {
            let of_role: Vec<&&PDEndpoint> = endpoints.iter().filter(|e| e.spec.role == role).collect();
            let silent = of_role.iter().filter(|e| stale(e, now)).count();
            (silent == of_role.len()).then(|| match silent {
                0 => format!("no {role} engine has registered with a node agent"),
                n => format!("the {n} {role} engine(s) registered have not been heard of for over {STALE_SECONDS} s (their agent or engine is gone)"),
            })
        })
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "connector Pdpair: {} (is the connector in the engine's image and its --kv-transfer-config the operator's, and the node agent running on the node?)",
            missing.join("; ")
        )
    })
}

fn transfer_condition(endpoints: &[&PDEndpoint], now: &Time) -> Cond {
    if endpoints.is_empty() {
        let msg = "no engine has registered with a node agent yet".to_owned();
        return Cond::new(ct::TRANSFER_READY, "Unknown", reasons::NO_ENDPOINTS, msg);
    }
    let addresses = LiveAddresses::of(endpoints);
    let rejected = current_news(endpoints, pdpair_api::PDEndpointStatus::rejections, |r, s| {
        let news = (&r.time, Some(r.peer.as_str()), r.resolved.as_ref());
        news_stands(news, s.last_success.as_ref(), &addresses, now)
    });
    if let Some((who, r)) = rejected.first() {
        let msg = format!(
            "{} endpoint(s) rejected a handshake that still stands (its peer still registered with none transferred since, or no transfer at all since); {who}: peer {} [{}] {}",
            rejected.len(),
            r.peer,
            r.reasons.join(", "),
            r.message
        );
        return Cond::new(ct::TRANSFER_READY, "False", reasons::HANDSHAKE_REJECTED, msg);
    }
    let failed = current_news(endpoints, pdpair_api::PDEndpointStatus::failures, |f, s| {
        let news = (&f.time, f.peer.as_deref(), f.resolved.as_ref());
        news_stands(news, s.last_success.as_ref(), &addresses, now)
    });
    if let Some((who, f)) = failed.first() {
        let msg = format!(
            "{} endpoint(s) failed a KV transfer that still stands (with a peer still registered and none transferred with since, or no transfer at all since); {who}: [{}] {}",
            failed.len(),
            f.reasons.join(", "),
            f.message
        );
        return Cond::new(ct::TRANSFER_READY, "False", reasons::TRANSFER_FAILED, msg);
    }
    let msg = format!(
        "{} registered engine(s): no handshake rejection standing and no failed transfer since their last completed transfer (news older than {} min does not count)",
        endpoints.len(),
        RECENT_SECONDS / 60
    );
    Cond::new(ct::TRANSFER_READY, "True", reasons::HEALTHY, msg)
}

/// How many paths a `TransferPath` message names before it says how many more there are.
const PATHS_NAMED: usize = 3;

/// `TransferPath` from the paths the agents that moved KV report (push: prefill's; pull:
/// decode's): Unknown until one has; False when `spec.transfer.requirePath` is set and some
/// endpoint's path to a peer is not in it (RDMA that fell back to TCP, say); else True, its
/// reason the worst class seen. The message also counts the engines that stage their KV through
/// host memory by their own account (`spec.staging`): a copy on each side the path leaves out.
/// With `spec.transfer.requireDirect`, any engine whose pool is host memory (staging, or a KV
/// cache on the CPU) turns it False (`StagingNotAllowed`), transfers or none.
fn path_condition(pair: &PDPair, endpoints: &[&PDEndpoint], now: &Time) -> Cond {
    let mut c = path_condition_of_transfers(pair, endpoints, now);
    let host = |e: &&&PDEndpoint| e.spec.pool_memory == pdpair_api::PoolMemory::Host;
    fn name<'a>(e: &&'a PDEndpoint) -> &'a str {
        e.metadata.name.as_deref().unwrap_or("?")
    }
    let staging: Vec<&str> = endpoints
        .iter()
        .filter(host)
        .filter(|e| e.spec.staging.is_some())
        .map(name)
        .collect();
    if !staging.is_empty() {
        c.message.push_str(&format!(
            "; {} of {} engine(s) stage KV through host memory ({}: their PDEndpoints' spec.staging say why)",
            staging.len(),
            endpoints.len(),
            name_a_few(staging)
        ));
    }
    let hosts: Vec<&str> = endpoints.iter().filter(host).map(name).collect();
    if pair.spec.transfer.require_direct && !hosts.is_empty() {
        let why = format!(
            "spec.transfer.requireDirect is set, but {} of {} engine(s) hand their agent a host pool, not their KV cache in GPU memory ({})",
            hosts.len(),
            endpoints.len(),
            name_a_few(hosts)
        );
        c = if c.status == "False" {
            Cond::new(ct::TRANSFER_PATH, "False", &c.reason, format!("{}; {why}", c.message))
        } else {
            Cond::new(
                ct::TRANSFER_PATH,
                "False",
                reasons::STAGING_NOT_ALLOWED,
                format!("{why}; {}", c.message),
            )
        };
    }
    c
}

fn path_condition_of_transfers(pair: &PDPair, endpoints: &[&PDEndpoint], now: &Time) -> Cond {
    // Paths used in the last RECENT_SECONDS (an agent before `lastUsed`: every path it lists): a
    // peer rescheduled away, or a path that changed, no longer speaks for the pair (a TCP path
    // to a decode that had landed on a node without RDMA held requirePath False after it went).
    let paths: Vec<(&str, &pdpair_api::TransferPath)> = endpoints
        .iter()
        .filter_map(|e| Some((e.metadata.name.as_deref().unwrap_or("?"), e.status.as_ref()?)))
        .flat_map(|(who, s)| s.paths.iter().map(move |p| (who, p)))
        .filter(|(_, p)| p.last_used.as_ref().is_none_or(|t| within(t, now, RECENT_SECONDS)))
        .collect();
    // Among classes of one rank, the later in PathKind's order: the same for any endpoint names.
    let Some(worst) = paths.iter().map(|(_, p)| p.kind).max_by_key(|k| (k.rank(), *k)) else {
        let msg = format!(
            "no node agent has reported the path of a transfer completed in the last {} min",
            RECENT_SECONDS / 60
        );
        return Cond::new(ct::TRANSFER_PATH, "Unknown", reasons::NO_TRANSFERS, msg);
    };
    let allowed = &pair.spec.transfer.require_path;
    let name = |list: &[&(&str, &pdpair_api::TransferPath)]| {
        let mut named: Vec<String> = list
            .iter()
            .take(PATHS_NAMED)
            .map(|(who, p)| format!("{who}: {}", p.describe()))
            .collect();
        if list.len() > PATHS_NAMED {
            named.push(format!("and {} more", list.len() - PATHS_NAMED));
        }
        named.join("; ")
    };
    let unmet: Vec<_> = paths
        .iter()
        .filter(|(_, p)| !allowed.is_empty() && !allowed.contains(&p.kind))
        .collect();
    if !unmet.is_empty() {
        let allowed: Vec<&str> = allowed.iter().map(|k| k.as_str()).collect();
        let msg = format!(
            "{} of {} transfer path(s) are not in spec.transfer.requirePath [{}]: {}",
            unmet.len(),
            paths.len(),
            allowed.join(", "),
            name(&unmet)
        );
        return Cond::new(ct::TRANSFER_PATH, "False", reasons::PATH_NOT_ALLOWED, msg);
    }
    let all: Vec<_> = paths.iter().collect();
    let msg = format!("{} transfer path(s): {}", paths.len(), name(&all));
    Cond::new(ct::TRANSFER_PATH, "True", worst.as_str(), msg)
}

fn ready_condition(
    geometry: &Cond,
    applied: &Cond,
    prefill: &Cond,
    decode: &Cond,
    (transfer, registered): (&Cond, bool),
    path: &Cond,
) -> Cond {
    let blockers = [
        (geometry.status != "True", reasons::GEOMETRY_INCOMPATIBLE, geometry),
        (applied.status != "True", reasons::APPLY_FAILED, applied),
        (prefill.status != "True", reasons::PREFILL_NOT_READY, prefill),
        (decode.status != "True", reasons::DECODE_NOT_READY, decode),
        (!registered, reasons::NOT_REGISTERED, transfer),
        (transfer.status == "False", reasons::TRANSFER_NOT_READY, transfer),
        (path.status == "False", path.reason.as_str(), path),
    ];
    match blockers.iter().find(|(blocked, _, _)| *blocked) {
        Some((_, reason, cause)) => Cond::new(
            ct::READY,
            "False",
            reason,
            format!("{}: {}", cause.type_, cause.message),
        ),
        None => Cond::new(
            ct::READY,
            "True",
            reasons::READY,
            "geometry compatible and both pools ready".to_owned(),
        ),
    }
}

#[cfg(test)]
mod tests;
