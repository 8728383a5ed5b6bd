//! The PDPair controller: observe -> plan -> apply -> status.
//!
//! Every replica runs the watches (a successor's caches are warm where they had time to list);
//! only the Lease holder reconciles, once its caches have listed. Reconcile is idempotent: server-side apply of the planned children under one field
//! manager, the pairing Secret created once, and status written only when it changed. Events are
//! published on condition transitions, computed against the status this replica last wrote, so a
//! stale cache never repeats them.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::{Stream, StreamExt};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{Pod, Secret},
    },
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{Patch, PatchParams, PostParams},
    runtime::{
        Controller, WatchStreamExt,
        controller::Action,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use pdpair_api::{PDEndpoint, PDPair, PDPairStatus, Role};
use tokio::sync::watch;

use crate::{
    events::{Kind, Publisher},
    metrics::Metrics,
    names::{self, LABEL_NAME, LABEL_ROLE, MANAGER},
    plan,
    status::{self, Observed, PodCounts, ReadyPod},
};

/// A failed reconcile step. Messages name the object and the action.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The PDPair lacks a namespace or name.
    #[error("PDPair without namespace, name or uid")]
    MissingMeta,
    /// Server-side apply of a Deployment failed.
    #[error("applying Deployment {name}: {source}")]
    ApplyDeployment {
        /// Deployment name.
        name: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// Deleting a Deployment the PDPair no longer plans failed.
    #[error("pruning Deployment {name}: {source}")]
    PruneDeployment {
        /// Deployment name.
        name: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// Reading or creating the pairing Secret failed.
    #[error("ensuring Secret {name}: {source}")]
    EnsureSecret {
        /// Secret name.
        name: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// The OS random source failed.
    #[error("generating a pairing key: {0}")]
    Random(String),
    /// Writing status failed.
    #[error("patching status of PDPair {name}: {source}")]
    PatchStatus {
        /// PDPair name.
        name: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
}

impl Error {
    /// The API call that failed, where one did.
    fn api_source(&self) -> Option<&kube::Error> {
        match self {
            Error::MissingMeta | Error::Random(_) => None,
            Error::ApplyDeployment { source, .. }
            | Error::PruneDeployment { source, .. }
            | Error::EnsureSecret { source, .. }
            | Error::PatchStatus { source, .. } => Some(source),
        }
    }

    /// What an `ApplyFailed` Event of this error is remembered by: the request that failed and
    /// the API server's code and reason, not its message (which may name values that change
    /// with every reconcile, so the same refusal would be told each time).
    fn told_as(&self) -> String {
        let what = match self {
            Error::ApplyDeployment { name, .. } => format!("apply {name}"),
            Error::PruneDeployment { name, .. } => format!("prune {name}"),
            Error::EnsureSecret { name, .. } => format!("secret {name}"),
            Error::PatchStatus { name, .. } => format!("status {name}"),
            other => return other.to_string(),
        };
        match self.api_source() {
            Some(kube::Error::Api(s)) => format!("{what}: {} {}", s.code, s.reason),
            _ => self.to_string(),
        }
    }

    /// Whether the API server refused the request for what it holds ([`refused`]).
    fn refused(&self) -> bool {
        matches!(self.api_source(), Some(kube::Error::Api(s)) if refused(s))
    }

    /// A bounded label for metrics and the retry decision.
    pub fn category(&self) -> &'static str {
        let Some(source) = self.api_source() else {
            return match self {
                Error::MissingMeta => "invalid",
                _ => "internal",
            };
        };
        match source {
            kube::Error::Api(s) if s.code == 409 => "conflict",
            kube::Error::Api(s) if s.code == 400 || s.code == 422 => "invalid",
            kube::Error::Api(s) if s.code == 403 || s.code == 401 => "forbidden",
            kube::Error::Api(s) if s.code == 404 => "not-found",
            _ => "transient",
        }
    }
}

/// What reconcile needs.
pub struct Context {
    client: Client,
    pods: Store<Pod>,
    endpoints: Store<PDEndpoint>,
    /// The PDPairs' Deployments, as the controller's watch of them sees them.
    deployments: Store<Deployment>,
    leader: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    events: Publisher,
    /// The controller's own store of PDPairs: what is remembered of one goes with it.
    pairs: Store<PDPair>,
    remembered: Remembered,
    /// What engine pods need to reach their node agent.
    wiring: plan::Wiring,
}

/// What this replica remembers of PDPairs between reconciles, at most as many of each as there
/// are PDPairs: a PDPair's is forgotten once it is gone from the controller's store (a deleted
/// PDPair is never reconciled again, so nothing else would drop it).
#[derive(Debug, Default)]
struct Remembered {
    /// What this replica did for each PDPair, by uid.
    pairs: Mutex<HashMap<String, Memory>>,
    /// Consecutive failures by object, for per-object backoff.
    failures: Mutex<HashMap<ObjectRef<PDPair>, u32>>,
}

/// What this replica did for one PDPair.
#[derive(Debug, Default)]
struct Memory {
    /// The status it last wrote: the baseline for transitions.
    written: Option<PDPairStatus>,
    /// When it last sent a status patch ([`COUNTERS_EVERY`]).
    written_at: Option<Instant>,
    /// The plan it last applied: a changed plan is dry-run first, and an unchanged one is not
    /// applied again to a Deployment no one changed since.
    applied: Option<Applied>,
    /// The plan whose dry run the API server last refused, when, and what status says of it:
    /// the same plan is not sent again before [`APPLY_RETRY`] (every PDEndpoint write reconciles
    /// the pair, and each sent a GET and a dry run of the Deployment).
    refused: Option<(u64, Instant, String)>,
    /// When to ask for the pairing Secret again: a [`RESYNC`] after it was found or made (made
    /// again, if it went, then; not at every reconcile), [`SECRET_RETRY`] after it was refused.
    secret: Option<Instant>,
    /// The refusal last told in a `SecretRefused` Event: the same one again is not (a full
    /// quota refuses a create of a Secret that exists, 403 rather than 409, at every try).
    secret_refused: Option<String>,
    /// The error last told in an `ApplyFailed` Event for a reconcile the API server refused as
    /// invalid (`Error::told_as`): the same one again is not (every PDEndpoint write reconciles
    /// the pair, and each published one).
    invalid_told: Option<String>,
    /// Pods of an earlier geometry seen lately (by name), and when last: their PDEndpoints
    /// outlive them a moment (the garbage collector removes them after the pod), and compared
    /// with the new geometry then, the end of every rollout read as a mismatch.
    earlier: HashMap<String, Instant>,
    /// The Events its conditions' changes may still make ([`PAIR_EVENTS_BURST`]).
    events: Option<crate::webhook::EventBudget>,
}

/// Events a pair's condition changes make at once after a quiet spell; then one each
/// [`PAIR_EVENT_EVERY`]. Conditions read PDEndpoints, which node agents write: one flipping an
/// endpoint's news made two Events a write (the condition's and Ready's), in that namespace.
const PAIR_EVENTS_BURST: f64 = 16.0;
/// See [`PAIR_EVENTS_BURST`].
const PAIR_EVENT_EVERY: Duration = Duration::from_secs(15);

/// A pair's budget of Events for its conditions' changes, full.
fn pair_event_budget(now: Instant) -> crate::webhook::EventBudget {
    crate::webhook::EventBudget::of(PAIR_EVENTS_BURST, 1.0 / PAIR_EVENT_EVERY.as_secs_f64(), now)
}

/// How many of `changes` condition changes of the pair `uid` make Events now: what its budget
/// ([`pair_event_budget`], kept with what is remembered of the pair) allows; the rest are counted
/// in `pdpair_operator_condition_events_dropped_total`.
fn events_allowed(remembered: &Remembered, metrics: &Metrics, uid: &str, changes: usize, now: Instant) -> usize {
    let mut told = 0;
    remembered.note(uid, |m| {
        let budget = m.events.get_or_insert_with(|| pair_event_budget(now));
        told = (0..changes).take_while(|_| budget.take(now)).count();
    });
    for _ in told..changes {
        metrics.condition_event_dropped();
    }
    told
}

/// A plan applied: its [`fingerprint`], and the resourceVersion each Deployment had once
/// applied (by name).
#[derive(Debug, Clone, Default, PartialEq)]
struct Applied {
    plan: u64,
    versions: HashMap<String, String>,
}

impl Remembered {
    /// Forgets the PDPairs no longer in `pairs` (by uid: one deleted and made again under its
    /// name is another), once more are remembered than `pairs` holds: each map stays within
    /// the PDPairs there are, and the check costs a reconcile nothing until then.
    fn forget_gone(&self, pairs: &Store<PDPair>) {
        let live = pairs.len();
        let over = |n: Option<usize>| n.is_some_and(|n| n > live);
        let remembered = self.pairs.lock().ok().map(|m| m.len());
        let failures = self.failures.lock().ok().map(|f| f.len());
        if !(over(remembered) || over(failures)) {
            return;
        }
        let uids: HashSet<String> = pairs.state().iter().filter_map(|p| p.uid()).collect();
        if let Ok(mut m) = self.pairs.lock() {
            m.retain(|uid, _| uids.contains(uid));
        }
        if let Ok(mut f) = self.failures.lock() {
            f.retain(|pair, _| pairs.get(pair).is_some());
        }
    }

    /// What `read` takes from `uid`'s memory (`None` when there is none).
    fn recall<T>(&self, uid: &str, read: impl FnOnce(&Memory) -> Option<T>) -> Option<T> {
        self.pairs.lock().ok().and_then(|m| m.get(uid).and_then(read))
    }

    /// Changes `uid`'s memory (made empty first where there is none).
    fn note(&self, uid: &str, change: impl FnOnce(&mut Memory)) {
        if let Ok(mut m) = self.pairs.lock() {
            change(m.entry(uid.to_owned()).or_default());
        }
    }

    /// Whether `uid`'s pairing Secret is not to be asked for yet ([`Memory::secret`]).
    fn secret_fresh(&self, uid: &str) -> bool {
        self.recall(uid, |m| m.secret).is_some_and(|next| Instant::now() < next)
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}

/// Resync period for healthy objects.
const RESYNC: Duration = Duration::from_secs(300);

/// How often a PDPair's status is written at most when only its transfer counters changed.
const COUNTERS_EVERY: Duration = Duration::from_secs(5);

/// How soon a pairing Secret the API server refused is asked for again.
const SECRET_RETRY: Duration = Duration::from_secs(30);

/// How soon pools' Deployments the API server refused (or another's of their name) are tried
/// again, without a change to the PDPair.
const APPLY_RETRY: Duration = Duration::from_secs(30);

async fn reconcile(pair: Arc<PDPair>, ctx: Arc<Context>) -> Result<Action, Error> {
    if !*ctx.leader.borrow() {
        return Ok(Action::await_change());
    }
    // Until every watch has delivered its first list, its store holds nothing, not what
    // exists: a new leader (a restart, a failover) that reconciled then wrote every healthy
    // pair not ready (no pods, no engines), with a Warning Event each, and back a moment later.
    if !caches_ready(&ctx).await {
        return Ok(Action::requeue(CACHES_RETRY));
    }
    ctx.remembered.forget_gone(&ctx.pairs);
    let started = Instant::now();
    let result = reconcile_leader(&pair, &ctx).await;
    ctx.metrics.reconciled(started.elapsed().as_secs_f64());
    match &result {
        Ok(_) => {
            if let Ok(mut f) = ctx.remembered.failures.lock() {
                f.remove(&ObjectRef::from(pair.as_ref()));
            }
            if let Some(uid) = &pair.metadata.uid {
                ctx.remembered.note(uid, |m| m.invalid_told = None);
            }
        }
        Err(e) if e.category() == "invalid" => {
            // Retrying cannot help: wait for the user to change the object, and tell them, once
            // for the same error.
            ctx.metrics.reconcile_error(e.category());
            tracing::warn!(error = %e, name = %pair.name_any(), "PDPair cannot be applied; waiting for a change");
            let (note, told_as) = (format!("{e}"), e.told_as());
            let uid = pair.metadata.uid.clone().unwrap_or_default();
            if ctx.remembered.recall(&uid, |m| m.invalid_told.clone()).as_deref() != Some(told_as.as_str()) {
                ctx.events
                    .publish(&pair.object_ref(&()), Kind::Warning, "ApplyFailed", "Reconcile", &note)
                    .await;
                ctx.remembered.note(&uid, |m| m.invalid_told = Some(told_as));
            }
            return Ok(Action::await_change());
        }
        Err(_) => {}
    }
    result
}

async fn reconcile_leader(pair: &PDPair, ctx: &Context) -> Result<Action, Error> {
    let (Some(ns), Some(name)) = (pair.namespace(), pair.metadata.name.clone()) else {
        return Err(Error::MissingMeta);
    };
    if pair.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change()); // owner references let the garbage collector finish
    }
    let verdict = pdpair_api::check(&pair.spec);
    // Without a uid nothing is planned (the Secret's name holds it), and a pool not planned
    // would read as a removed template: its Deployment would be pruned.
    let Some(uid) = pair.uid() else {
        return Err(Error::MissingMeta);
    };
    // Every PDEndpoint heartbeat reconciles the pair: the Secret is asked for (a create, 409
    // when it is there) at most once a resync, not at each.
    // A create the API server refuses (a quota on Secrets, a policy) is told in a Warning Event
    // (once per refusal, not per try) and tried again in [`SECRET_RETRY`]; the rest goes on, so
    // status keeps telling what runs (the pods, which do not start where it does not exist: a
    // full quota refuses the create of one that does, too).
    if verdict.allowed() && !ctx.remembered.secret_fresh(&uid) {
        match ensure_secret(pair, &ctx.client, &ns, &name).await {
            // Made, or there (409): its name holds this PDPair's uid, so it is this PDPair's.
            Ok(()) => {
                ctx.metrics.secret_ensured();
                ctx.remembered.note(&uid, |m| {
                    m.secret = Some(Instant::now() + RESYNC);
                    m.secret_refused = None;
                });
            }
            Err(e) if e.refused() => {
                ctx.metrics.reconcile_error(e.category());
                tracing::warn!(error = %e, name = %name, "the pairing Secret was refused; trying again later");
                let note = format!(
                    "{e}; where it does not exist yet, the pools' pods do not start until it does (asked again every {}s)",
                    SECRET_RETRY.as_secs()
                );
                let told = ctx.remembered.recall(&uid, |m| m.secret_refused.clone());
                if told.as_deref() != Some(note.as_str()) {
                    ctx.events
                        .publish(
                            &pair.object_ref(&()),
                            Kind::Warning,
                            "SecretRefused",
                            "Reconcile",
                            &note,
                        )
                        .await;
                }
                ctx.remembered.note(&uid, |m| {
                    m.secret = Some(Instant::now() + SECRET_RETRY);
                    m.secret_refused = Some(note);
                });
            }
            Err(e) => return Err(e),
        }
    }
    // An incompatible spec (stored before the webhook was installed, or with it bypassed) gets no
    // children: an incompatible pair must not run, so what it had goes. Status says why. A pool
    // whose template was removed (now brought by the user) loses its Deployment the same way.
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &ns);
    // The Deployment `dname` as the watch last saw it.
    let seen = |dname: &str| ctx.deployments.get(&ObjectRef::<Deployment>::new(dname).within(&ns));
    // While the create of the pairing Secret is refused (a quota on Secrets), a pool that runs
    // keeps the Secret its pods mount: one an earlier operator named otherwise (`<name>-pairing`)
    // was rolled to pods mounting one that does not exist, which never started.
    let secret_refused = ctx
        .remembered
        .recall(&uid, |m| m.secret_refused.as_ref().map(drop))
        .is_some();
    let planned: Vec<(Role, String, Option<Deployment>)> = [Role::Prefill, Role::Decode]
        .into_iter()
        .map(|role| {
            let dname = names::deployment_name(&name, role);
            let mut d = plan::planned_deployment(pair, role, &ctx.wiring);
            if secret_refused
                && let Some(d) = d.as_mut()
                && let Some(live) = seen(&dname).filter(|l| controlled_by(&l.metadata, &uid))
                && let Some(kept) = plan::keep_pairing_secret(d, &live, &name)
            {
                tracing::info!(deployment = %dname, secret = %kept, "the pairing Secret is refused: the pool keeps the one it mounts");
            }
            (role, dname, d)
        })
        .collect();
    // Both pools' Deployments are dry-run before either is applied (whenever the plan changed):
    // one the API server refuses (a field of the template the webhook does not check) must not
    // leave the other pool rolled to a new geometry beside the old one. Neither is applied, and
    // status says why.
    let fingerprint = fingerprint(&planned);
    let before: Option<Applied> = ctx
        .remembered
        .recall(&uid, |m| m.applied.clone())
        .filter(|a| a.plan == fingerprint);
    let checked = before.is_some();
    let mut versions = before.as_ref().map(|a| a.versions.clone()).unwrap_or_default();
    let mut apply_refused = None;
    // A template stored past the webhook that is not a pod template: nothing is applied, or
    // pruned (its pool is not bring-your-own), and status says what is wrong in it.
    if let Some((field, why)) = pair.spec.template_errors().into_iter().next() {
        apply_refused = Some(format!(
            "neither pool's Deployment was applied (the pools run what they ran before): {field} is not a pod template: {why}"
        ));
    }
    let checked = checked || apply_refused.is_some();
    // Refused lately, unchanged since: told again, not sent again.
    let refused_lately = ctx
        .remembered
        .recall(&uid, |m| m.refused.clone())
        .filter(|(plan, at, _)| *plan == fingerprint && at.elapsed() < APPLY_RETRY);
    let mut dry_run_refused = None;
    // When to send it again: the rest of APPLY_RETRY since it was.
    let mut retry_in = APPLY_RETRY;
    if !checked && let Some((_, at, why)) = refused_lately {
        apply_refused = Some(why);
        retry_in = APPLY_RETRY.saturating_sub(at.elapsed());
    } else if !checked {
        for (_, dname, d) in &planned {
            let Some(d) = d else { continue };
            // A Deployment of that name someone else made is not taken over (a force-apply
            // would merge our template into theirs, and a removed template would then prune it).
            let existing = deployments
                .get_metadata_opt(dname)
                .await
                .map_err(|source| Error::ApplyDeployment {
                    name: dname.clone(),
                    source,
                })?;
            if let Some(existing) = existing
                && !controlled_by(&existing.metadata, &uid)
            {
                // Not remembered: once theirs goes (its watch event reconciles the pair), ours is
                // made then, not at the next retry.
                apply_refused = Some(not_ours(dname));
                break;
            }
            let params = PatchParams::apply(MANAGER).force().dry_run();
            match deployments.patch(dname, &params, &Patch::Apply(d)).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if refused(&s) => {
                    dry_run_refused = Some(format!(
                        "neither pool's Deployment was applied (the pools run what they ran before): Deployment {dname}: {}",
                        s.message
                    ));
                    break;
                }
                Err(source) => {
                    return Err(Error::ApplyDeployment {
                        name: dname.clone(),
                        source,
                    });
                }
            }
        }
    }
    if dry_run_refused.is_some() {
        apply_refused.clone_from(&dry_run_refused);
    }
    // The plan's check above runs when the plan changed; a Deployment the watch sees as no
    // longer this PDPair's since (its controller reference removed, or another's made under the
    // name) is not taken over either, and neither pool is applied.
    if apply_refused.is_none()
        && let Some((_, dname, _)) = planned
            .iter()
            .find(|(_, dname, d)| d.is_some() && seen(dname).is_some_and(|s| !controlled_by(&s.metadata, &uid)))
    {
        apply_refused = Some(not_ours(dname));
    }
    for (role, dname, d) in &planned {
        if apply_refused.is_some() {
            break;
        }
        let (role, dname) = (*role, dname.clone());
        let seen = seen(&dname);
        match d {
            // The same plan, applied to the Deployment as it still is: nothing to send (the
            // pair's reconciles come with every PDEndpoint heartbeat, and each one applied both
            // Deployments again).
            Some(_)
                if checked
                    && seen
                        .as_ref()
                        .and_then(|s| s.resource_version())
                        .is_some_and(|v| versions.get(&dname) == Some(&v)) => {}
            Some(d) => match deployments
                .patch(&dname, &PatchParams::apply(MANAGER).force(), &Patch::Apply(d))
                .await
            {
                Ok(applied) => {
                    ctx.metrics.deployment_applied();
                    match applied.resource_version() {
                        Some(v) => versions.insert(dname.clone(), v),
                        None => versions.remove(&dname),
                    };
                }
                // Refused after its dry run passed (the world changed in between).
                Err(kube::Error::Api(s)) if refused(&s) => {
                    apply_refused = Some(format!(
                        "Deployment {dname} was refused after its dry run passed (a pool before it was applied): {}",
                        s.message
                    ));
                }
                Err(source) => return Err(Error::ApplyDeployment { name: dname, source }),
            },
            None => {
                let why = if verdict.allowed() {
                    format!("spec.{role}.template was removed")
                } else {
                    "the pair is incompatible".to_owned()
                };
                // Nothing to prune where the watch sees no Deployment of the name (one made
                // since brings its own reconcile).
                if seen.is_some() && prune(&deployments, &dname, &uid).await? {
                    let note = format!("deleted Deployment {dname}: {why}");
                    ctx.events
                        .publish(&pair.object_ref(&()), Kind::Normal, "Pruned", "Reconcile", &note)
                        .await;
                }
            }
        }
    }
    let pods_of = |role: Role| -> Vec<Arc<Pod>> {
        ctx.pods
            .state()
            .into_iter()
            .filter(|p| {
                p.namespace().as_deref() == Some(ns.as_str())
                    && p.labels().get(LABEL_NAME) == Some(&name)
                    && p.labels().get(LABEL_ROLE).map(String::as_str) == Some(role.as_str())
            })
            .collect()
    };
    // A pool run from the pair's template counts the pods of its geometry; one the user brings
    // (no template), every pod.
    let templated = |role: Role| {
        planned
            .iter()
            .any(|(r, _, d)| *r == role && d.is_some())
            .then(|| plan::geometry_hash(pair, role))
    };
    let prefill_pods = pods_of(Role::Prefill);
    let decode_pods = pods_of(Role::Decode);
    let endpoints: Vec<Arc<PDEndpoint>> = ctx
        .endpoints
        .state()
        .into_iter()
        .filter(|e| e.namespace().as_deref() == pair.namespace().as_deref() && e.spec.pdpair == name)
        .filter(|e| {
            let pods = match e.spec.role {
                Role::Prefill => &prefill_pods,
                Role::Decode => &decode_pods,
            };
            speaks_for_a_pod(e, pods)
        })
        .collect();
    let mut endpoint_refs: Vec<&PDEndpoint> = endpoints.iter().map(AsRef::as_ref).collect();
    endpoint_refs.sort_by_key(|e| e.metadata.name.clone());
    let (prefill_geometry, decode_geometry) = (templated(Role::Prefill), templated(Role::Decode));
    let observed = Observed {
        prefill: PodCounts::of(prefill_pods.iter().map(AsRef::as_ref), prefill_geometry.as_deref()),
        decode: PodCounts::of(decode_pods.iter().map(AsRef::as_ref), decode_geometry.as_deref()),
        endpoints: endpoint_refs,
        earlier_pods: earlier_pods(
            &ctx.remembered,
            &uid,
            [
                (prefill_pods.as_slice(), prefill_geometry.as_deref()),
                (decode_pods.as_slice(), decode_geometry.as_deref()),
            ],
        ),
        apply_refused: apply_refused.clone(),
        // Only where every engine registers (nothing of them is folded otherwise).
        ready_pods: if pair.spec.transfer.connector == pdpair_api::Connector::Pdpair {
            [
                (Role::Prefill, &prefill_pods, &prefill_geometry),
                (Role::Decode, &decode_pods, &decode_geometry),
            ]
            .into_iter()
            .flat_map(|(role, pods, geometry)| ReadyPod::of(role, pods.iter().map(AsRef::as_ref), geometry.as_deref()))
            .collect()
        } else {
            Vec::new()
        },
    };
    let mut baseline = pair.clone();
    if let Some(written) = ctx.remembered.recall(&uid, |m| m.written.clone()) {
        baseline.status = Some(written);
    }
    let now = status_now();
    let (new_status, transitions) = status::compute(&baseline, &observed, &now);
    // Conditions that change with time alone (an endpoint going stale, news leaving its window)
    // are looked at again then, not at the resync.
    let time_due = status::changes_in(pair, &observed.endpoints, &observed.ready_pods, &now)
        .map(|d| d.max(Duration::from_secs(1)));
    // Every PDEndpoint write reconciles its pair, and a busy engine's counters change with each:
    // a change of counters alone is written at most every COUNTERS_EVERY (the rest at once), or
    // forty busy engines made forty status patches a second, each sent to every watcher.
    let counters_due = ctx.remembered.recall(&uid, |m| {
        let (last, at) = (m.written.as_ref()?, m.written_at?);
        status::only_counters_differ(last, &new_status)
            .then(|| COUNTERS_EVERY.checked_sub(at.elapsed()))
            .flatten()
    });
    let write = pair.status.as_ref() != Some(&new_status) && counters_due.is_none();
    if write {
        ctx.metrics.status_written();
        let api: Api<PDPair> = Api::namespaced(ctx.client.clone(), pair.namespace().as_deref().unwrap_or_default());
        let body = serde_json::json!({
            "apiVersion": "pdpair.dev/v1alpha1",
            "kind": "PDPair",
            "status": new_status,
        });
        api.patch_status(&name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(&body))
            .await
            .map_err(|source| Error::PatchStatus {
                name: name.clone(),
                source,
            })?;
    }
    ctx.remembered.note(&uid, |m| {
        m.applied = apply_refused.is_none().then_some(Applied {
            plan: fingerprint,
            versions,
        });
        if let Some(why) = dry_run_refused {
            m.refused = Some((fingerprint, Instant::now(), why));
        } else if apply_refused.is_none() {
            m.refused = None;
        }
        // Held back: the last written stays the baseline until the write.
        if counters_due.is_none() {
            m.written = Some(new_status);
        }
        if write {
            m.written_at = Some(Instant::now());
        }
    });
    let reference = pair.object_ref(&());
    let told = events_allowed(&ctx.remembered, &ctx.metrics, &uid, transitions.len(), Instant::now());
    for t in transitions.into_iter().take(told) {
        let kind = if t.warning { Kind::Warning } else { Kind::Normal };
        let from = t.from.as_deref().unwrap_or("unset");
        let note = format!("{} {from} -> {}: {}", t.type_, t.to_status, t.message);
        ctx.events.publish(&reference, kind, &t.reason, &t.type_, &note).await;
    }
    // The Secret's next check (sooner than a resync after a refusal, or for a young pair whose
    // Secret was found), whatever reconciled the pair since (a requeue replaces the one before
    // it).
    let secret_retry = ctx
        .remembered
        .recall(&uid, |m| m.secret)
        .filter(|_| verdict.allowed())
        .map(|next| {
            next.saturating_duration_since(Instant::now())
                .max(Duration::from_secs(1))
        });
    // A refused apply is tried again in [`APPLY_RETRY`] (a quota raised, a policy changed, an
    // RBAC rule restored during an upgrade), not at the resync.
    let apply_retry = (apply_refused.is_some() && verdict.allowed()).then_some(retry_in.max(Duration::from_secs(1)));
    let counters_due = counters_due.map(|d| d.max(Duration::from_millis(100)));
    Ok(
        match secret_retry
            .into_iter()
            .chain(apply_retry)
            .chain(counters_due)
            .chain(time_due)
            .min()
        {
            Some(wait) => Action::requeue(wait),
            None if verdict.allowed() => Action::requeue(RESYNC),
            None => Action::await_change(),
        },
    )
}

/// Whether the API server refused a request for what it holds (invalid: 400, 422; forbidden by
/// a quota, a policy webhook, RBAC or a namespace being deleted: 403; 404...), so that sending it
/// again unchanged gets the same answer and status must say so. Not: a conflict (409), too many
/// requests (429), a timeout (408), the operator's own credentials (401), or the server's
/// trouble (5xx).
fn refused(s: &kube::core::Status) -> bool {
    (400..500).contains(&s.code) && ![401, 408, 409, 429].contains(&s.code)
}

/// Why neither pool was applied when Deployment `dname` is not this PDPair's.
fn not_ours(dname: &str) -> String {
    format!(
        "neither pool's Deployment was applied: Deployment {dname} exists and is not this PDPair's (it has no controller reference to it); remove it, or rename the PDPair"
    )
}

/// Whether the PDPair `owner_uid` is the controller of an object.
fn controlled_by(meta: &kube::api::ObjectMeta, owner_uid: &str) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.kind == "PDPair" && o.uid == owner_uid)
}

/// A digest of the planned Deployments (within this process: it only says whether the plan
/// changed since it was last applied).
fn fingerprint(planned: &[(Role, String, Option<Deployment>)]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (_, name, d) in planned {
        name.hash(&mut h);
        serde_json::to_string(d).unwrap_or_default().hash(&mut h);
    }
    h.finish()
}

/// Deletes the Deployment `name` when this PDPair (`owner_uid`) controls it; a Deployment of that
/// name that someone else owns is left alone. `Ok(true)` when one was deleted.
async fn prune(deployments: &Api<Deployment>, name: &str, owner_uid: &str) -> Result<bool, Error> {
    let err = |source| Error::PruneDeployment {
        name: name.to_owned(),
        source,
    };
    let Some(existing) = deployments.get_metadata_opt(name).await.map_err(err)? else {
        return Ok(false);
    };
    if !controlled_by(&existing.metadata, owner_uid) || existing.metadata.deletion_timestamp.is_some() {
        return Ok(false);
    }
    // Only the object we looked at (its uid), its ReplicaSets and pods after it.
    let params = kube::api::DeleteParams {
        preconditions: existing.metadata.uid.clone().map(|uid| kube::api::Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..kube::api::DeleteParams::background()
    };
    match deployments.delete(name, &params).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(false), // gone, or replaced
        Err(source) => Err(err(source)),
    }
}

/// Creates the pair's pairing Secret, unless it is there (409).
async fn ensure_secret(pair: &PDPair, client: &Client, ns: &str, name: &str) -> Result<(), Error> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let sname = names::secret_name(name, pair.uid().as_deref().unwrap_or_default());
    // Created once, never rotated behind the engines' backs: a create that finds one (409) is
    // done. The operator may create Secrets but not read them (it needs nothing in them, and
    // a `get` on every Secret of the cluster is more than it needs).
    let mut key = [0u8; names::PAIRING_KEY_LEN];
    getrandom::fill(&mut key).map_err(|e| Error::Random(e.to_string()))?;
    let Some(secret) = plan::pairing_secret(pair, &key) else {
        return Err(Error::MissingMeta);
    };
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()), // made before, or by a concurrent reconcile
        Err(source) => Err(Error::EnsureSecret { name: sname, source }),
    }
}

fn error_policy(pair: Arc<PDPair>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconcile_error(error.category());
    let attempts = ctx
        .remembered
        .failures
        .lock()
        .map(|mut f| {
            let n = f.entry(ObjectRef::from(pair.as_ref())).or_insert(0);
            *n = n.saturating_add(1);
            *n
        })
        .unwrap_or(1);
    let delay = Duration::from_millis(500)
        .saturating_mul(1u32 << attempts.min(10))
        .min(Duration::from_secs(300));
    tracing::warn!(error = %error, category = error.category(), name = %pair.name_any(), attempts, ?delay, "reconcile failed; backing off");
    Action::requeue(delay)
}

/// Streams `()` each time this replica becomes leader, to reconcile everything then.
fn on_leadership(leader: watch::Receiver<bool>) -> impl Stream<Item = ()> + Send {
    futures::stream::unfold((leader, false), |(mut rx, mut was)| async move {
        loop {
            let now = *rx.borrow_and_update();
            let rising = now && !was;
            was = now;
            if rising {
                return Some(((), (rx, was)));
            }
            rx.changed().await.ok()?;
        }
    })
}

/// How long a pod of an earlier geometry is remembered after it was last seen
/// ([`Memory::earlier`]).
const EARLIER_KEPT: Duration = Duration::from_secs(120);

/// The pods of `pools` (each with its current geometry hash; `None` for a pool the user brings)
/// that run an earlier template's geometry (their annotation names another hash: a pod without
/// one is not a rollout's and is compared), and those remembered from the last
/// [`EARLIER_KEPT`]; remembered for `uid` from now.
fn earlier_pods<'a>(
    remembered: &Remembered,
    uid: &str,
    pools: impl IntoIterator<Item = (&'a [Arc<Pod>], Option<&'a str>)>,
) -> std::collections::BTreeSet<String> {
    let now = Instant::now();
    let seen: Vec<String> = pools
        .into_iter()
        .flat_map(|(pods, geometry)| {
            pods.iter()
                .filter(move |p| {
                    p.annotations().contains_key(crate::names::ANNOTATION_GEOMETRY)
                        && status::of_earlier_geometry(p, geometry)
                })
                .filter_map(|p| p.metadata.name.clone())
        })
        .collect();
    let mut all = std::collections::BTreeSet::new();
    remembered.note(uid, |m| {
        for name in seen {
            m.earlier.insert(name, now);
        }
        m.earlier.retain(|_, at| now.duration_since(*at) < EARLIER_KEPT);
        all.extend(m.earlier.keys().cloned());
    });
    all
}

/// How soon a reconcile that found the watches' caches not yet filled is tried again.
const CACHES_RETRY: Duration = Duration::from_secs(1);

/// Whether the pod, PDEndpoint and Deployment caches have had their first list. Asked, not
/// waited for: a store's readiness wakes only its last waiter ([`wait_ready`]), and a new
/// leader's reconciles of every pair ask at once.
async fn caches_ready(ctx: &Context) -> bool {
    async fn listed<K>(store: &Store<K>) -> bool
    where
        K: Resource + Clone + 'static,
        K::DynamicType: Eq + std::hash::Hash + Clone,
    {
        // A store whose writer went answers at once (`Err`): nothing more will come to it.
        tokio::time::timeout(Duration::from_millis(10), store.wait_until_ready())
            .await
            .is_ok()
    }
    listed(&ctx.pods).await && listed(&ctx.endpoints).await && listed(&ctx.deployments).await
}

/// Waits until a store has had its first list.
///
/// A store's readiness is a one-shot channel that remembers only the last waker: the controller
/// waits on the PDPair store too, and whichever of us polled first is never woken. Polling again
/// every 250 ms sidesteps that.
async fn wait_ready<K>(store: &Store<K>)
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    loop {
        if let Ok(result) = tokio::time::timeout(Duration::from_millis(250), store.wait_until_ready()).await {
            if result.is_err() {
                tracing::warn!("a watch's store was dropped before its first list");
            }
            return;
        }
    }
}

/// Everything the controller needs from `run`.
#[derive(Clone)]
pub struct Setup {
    /// The API client.
    pub client: Client,
    /// Leadership, published by the lease task.
    pub leader: watch::Receiver<bool>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Event publisher.
    pub events: Publisher,
    /// What engine pods need to reach their node agent.
    pub wiring: plan::Wiring,
    /// The one namespace whose PDPairs (and their Deployments, Pods and PDEndpoints) it watches;
    /// `None`: every namespace.
    pub namespace: Option<String>,
}

/// `K`s of `namespace`, or of every namespace.
fn api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

impl std::fmt::Debug for Setup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Setup")
            .field("events", &self.events)
            .finish_non_exhaustive()
    }
}

/// Builds the controller. Returns the future that runs it and a future that resolves once every
/// watch delivered its first list.
pub fn controller(
    setup: Setup,
) -> (
    impl std::future::Future<Output = ()> + Send,
    impl std::future::Future<Output = ()> + Send,
) {
    let client = setup.client.clone();
    let ns = setup.namespace.as_deref();
    let pdpairs: Api<PDPair> = api(&client, ns);
    let deployments: Api<Deployment> = api(&client, ns);
    let (pod_reader, pod_writer) = reflector::store::<Pod>();
    let pods = reflector::reflector(
        pod_writer,
        watcher(api::<Pod>(&client, ns), watcher::Config::default().labels(LABEL_NAME)),
    )
    .default_backoff()
    .touched_objects();
    let (deployment_reader, deployment_writer) = reflector::store::<Deployment>();
    let owned = reflector::reflector(
        deployment_writer,
        watcher(deployments, watcher::Config::default().labels(LABEL_NAME)),
    )
    .default_backoff()
    .touched_objects();
    let (endpoint_reader, endpoint_writer) = reflector::store::<PDEndpoint>();
    let endpoints = reflector::reflector(
        endpoint_writer,
        watcher(api::<PDEndpoint>(&client, ns), watcher::Config::default()),
    )
    .default_backoff()
    .touched_objects();
    let controller = Controller::new(pdpairs, watcher::Config::default())
        .owns_stream(owned)
        .watches_stream(pods, |pod: Pod| {
            let name = pod.labels().get(LABEL_NAME)?.clone();
            Some(ObjectRef::<PDPair>::new(&name).within(&pod.namespace()?))
        })
        .watches_stream(endpoints, |e: PDEndpoint| {
            Some(ObjectRef::<PDPair>::new(&e.spec.pdpair).within(&e.namespace()?))
        })
        .reconcile_all_on(on_leadership(setup.leader.clone()));
    let pdpair_reader = controller.store();
    let ctx = Arc::new(Context {
        client,
        pods: pod_reader.clone(),
        endpoints: endpoint_reader.clone(),
        deployments: deployment_reader.clone(),
        leader: setup.leader,
        metrics: setup.metrics,
        events: setup.events,
        pairs: pdpair_reader.clone(),
        remembered: Remembered::default(),
        wiring: setup.wiring,
    });
    let synced = async move {
        wait_ready(&pdpair_reader).await;
        wait_ready(&pod_reader).await;
        wait_ready(&endpoint_reader).await;
        wait_ready(&deployment_reader).await;
    };
    let run = controller
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "controller event");
            }
        });
    (run, synced)
}

/// Whether PDEndpoint `e` speaks for one of `pods` (the pair's pods of the endpoint's role, from
/// the operator's own watch): the Pod it names, with the uid its owner reference gives, on the
/// node it names. Node agents write PDEndpoints, and one node's credentials may write them in
/// any namespace: an endpoint naming no such pod (forged, or left by a pod that is gone) is not
/// folded into the pair's status.
fn speaks_for_a_pod(e: &PDEndpoint, pods: &[Arc<Pod>]) -> bool {
    let Some(owner) = e
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.kind == "Pod" && o.api_version == "v1")
    else {
        return false;
    };
    pods.iter().any(|p| {
        p.metadata.name.as_deref() == Some(e.spec.pod.as_str())
            && p.metadata.uid.as_deref() == Some(owner.uid.as_str())
            && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(e.spec.node.as_str())
    })
}

/// Now, as status stores it (`Time` is written in whole seconds): a condition's
/// `lastTransitionTime` kept with its nanoseconds in the remembered baseline never equalled the
/// status read back, so every reconcile patched the status again.
fn status_now() -> Time {
    let now = Timestamp::now();
    Time(Timestamp::from_second(now.as_second()).unwrap_or(now))
}

#[cfg(test)]
mod tests {
    use kube::runtime::watcher::Event;

    use super::*;

    #[test]
    fn a_pairs_condition_changes_make_a_bounded_number_of_events() {
        let start = Instant::now();
        let mut budget = pair_event_budget(start);
        assert_eq!(
            (0..1000).filter(|_| budget.take(start)).count(),
            PAIR_EVENTS_BURST as usize
        );
        // A minute and a bit of flips, ten a second: one Event each PAIR_EVENT_EVERY.
        let told = (1..=610u64)
            .filter(|i| budget.take(start + Duration::from_millis(100 * i)))
            .count();
        assert_eq!(told, 4);
    }

    #[test]
    fn each_pair_spends_its_own_event_budget_and_what_it_drops_is_counted() {
        let (remembered, metrics) = (Remembered::default(), Metrics::new());
        let dropped = |m: &Metrics| {
            m.render()
                .lines()
                .find(|l| l.starts_with("pdpair_operator_condition_events_dropped_total "))
                .and_then(|l| l.split(' ').nth(1)?.parse::<u64>().ok())
        };
        let start = Instant::now();
        // A flapping pair: 10 changes at once, then 10 more; its budget runs out at 16.
        assert_eq!(events_allowed(&remembered, &metrics, "u1", 10, start), 10);
        assert_eq!(events_allowed(&remembered, &metrics, "u1", 10, start), 6);
        assert_eq!(dropped(&metrics), Some(4));
        // Another pair has its own, full.
        assert_eq!(events_allowed(&remembered, &metrics, "u2", 3, start), 3);
        // The first one's refills one each PAIR_EVENT_EVERY.
        assert_eq!(
            events_allowed(&remembered, &metrics, "u1", 5, start + PAIR_EVENT_EVERY),
            1
        );
        assert_eq!(dropped(&metrics), Some(8));
    }

    #[test]
    fn status_time_is_what_the_api_server_gives_back() {
        let now = status_now();
        let back: Time = serde_json::from_value(serde_json::to_value(&now).expect("json")).expect("time");
        assert_eq!(back, now);
    }

    #[test]
    fn only_an_endpoint_naming_a_pod_of_the_pair_on_its_node_is_folded() {
        let pod = |name: &str, uid: &str, node: &str| {
            let mut p = Pod::default();
            p.metadata.name = Some(name.into());
            p.metadata.uid = Some(uid.into());
            p.spec = Some(k8s_openapi::api::core::v1::PodSpec {
                node_name: Some(node.into()),
                ..Default::default()
            });
            Arc::new(p)
        };
        let pods = vec![pod("decode-a", "uid-a", "node-a"), pod("decode-b", "uid-b", "node-b")];
        let pair = pair("llama", "uid-pair");
        let endpoint = |pod: &str, node: &str, owner: Option<&str>| {
            let mut e = PDEndpoint::new(
                "e",
                pdpair_api::PDEndpointSpec {
                    pdpair: "llama".into(),
                    role: Role::Decode,
                    pod: pod.into(),
                    node: node.into(),
                    address: String::new(),
                    parallelism: pair.spec.decode.parallelism.clone(),
                    kv: pair.spec.decode.kv.clone(),
                    pool_memory: Default::default(),
                    staging: None,
                    tensor_rank: None,
                    instance: None,
                    pod_engines: None,
                },
            );
            e.metadata.owner_references = owner.map(|uid| {
                vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                    api_version: "v1".into(),
                    kind: "Pod".into(),
                    name: pod.into(),
                    uid: uid.into(),
                    ..Default::default()
                }]
            });
            e
        };
        assert!(speaks_for_a_pod(&endpoint("decode-a", "node-a", Some("uid-a")), &pods));
        for (pod, node, owner, why) in [
            ("decode-a", "node-b", Some("uid-a"), "another node's"),
            ("decode-a", "node-a", Some("uid-b"), "another pod's uid"),
            ("decode-a", "node-a", None, "no owner"),
            ("decode-c", "node-a", Some("uid-a"), "no such pod"),
        ] {
            assert!(!speaks_for_a_pod(&endpoint(pod, node, owner), &pods), "{why}");
        }
    }

    fn pair(name: &str, uid: &str) -> PDPair {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/compatible-push.yaml"))
            .expect("example exists");
        let mut pair: PDPair = serde_yaml::from_str(&text).expect("example parses");
        pair.metadata.name = Some(name.into());
        pair.metadata.namespace = Some("team-a".into());
        pair.metadata.uid = Some(uid.into());
        pair
    }

    /// A leader's context on `client` and these stores (its leadership's sender gone: it stays
    /// the leader).
    fn leading(
        client: kube::Client,
        pods: Store<Pod>,
        endpoints: Store<PDEndpoint>,
        deployments: Store<Deployment>,
        pairs: Store<PDPair>,
    ) -> Arc<Context> {
        let (_, leader) = watch::channel(true);
        Arc::new(Context {
            client: client.clone(),
            pods,
            endpoints,
            deployments,
            leader,
            metrics: Arc::new(Metrics::new()),
            events: Publisher::new(client, "test".into()),
            pairs,
            remembered: Remembered::default(),
            wiring: plan::Wiring::default(),
        })
    }

    /// A leader's context on the API stand-in at `url`, its caches listed: a store whose writer
    /// went counts as listed (empty); `pair` is in its own.
    fn leading_at(url: &str, pair: &PDPair) -> Arc<Context> {
        let client = kube::Client::try_from(kube::Config::new(url.parse().expect("url"))).expect("client");
        let (pods, _) = reflector::store::<Pod>();
        let (endpoints, _) = reflector::store::<PDEndpoint>();
        let (deployments, _) = reflector::store::<Deployment>();
        let (pairs, mut pair_writer) = reflector::store::<PDPair>();
        pair_writer.apply_watcher_event(&Event::Apply(pair.clone()));
        leading(client, pods, endpoints, deployments, pairs)
    }

    #[tokio::test]
    async fn a_leader_reconciles_nothing_until_its_caches_have_had_their_first_list() {
        // A new leader's first reconciles came before the pod and PDEndpoint watches had
        // listed: on empty caches every healthy pair was written not ready, with Warning
        // Events, and back a moment later. Nothing answers at this address: any call fails.
        let url: hyper::Uri = "http://127.0.0.1:9".parse().expect("url");
        let client = kube::Client::try_from(kube::Config::new(url)).expect("client");
        let (pods, mut pod_writer) = reflector::store::<Pod>();
        let (endpoints, mut endpoint_writer) = reflector::store::<PDEndpoint>();
        let (deployments, mut deployment_writer) = reflector::store::<Deployment>();
        let (pairs, _pair_writer) = reflector::store::<PDPair>();
        let ctx = leading(client, pods, endpoints, deployments, pairs);
        let pair = Arc::new(pair("llama", "u1"));
        let action = reconcile(pair.clone(), ctx.clone()).await.expect("no call made");
        assert_eq!(action, Action::requeue(CACHES_RETRY));
        // Listed (here, empty): it goes on to the API server.
        pod_writer.apply_watcher_event(&Event::Init);
        pod_writer.apply_watcher_event(&Event::InitDone);
        endpoint_writer.apply_watcher_event(&Event::Init);
        endpoint_writer.apply_watcher_event(&Event::InitDone);
        assert_eq!(
            reconcile(pair.clone(), ctx.clone()).await.expect("no call made"),
            Action::requeue(CACHES_RETRY),
            "the Deployments' cache counts too"
        );
        deployment_writer.apply_watcher_event(&Event::Init);
        deployment_writer.apply_watcher_event(&Event::InitDone);
        assert!(reconcile(pair, ctx).await.is_err(), "the API server was called");
    }

    #[tokio::test]
    async fn a_refused_plan_is_sent_again_only_after_apply_retry_not_at_every_reconcile() {
        // A quota refuses the pools while the pair's engines write their PDEndpoints: each write
        // reconciled the pair, and each reconcile sent a GET and a dry run again.
        let pair = Arc::new(pair("llama", "u1"));
        let stored = serde_json::to_vec(pair.as_ref()).expect("json");
        let (url, seen) = crate::test_api::serve(move |r| {
            Some(match r.method.as_str() {
                "PATCH" if r.target.contains("dryRun") => {
                    crate::test_api::status(403, "Forbidden", "exceeded quota: pods")
                }
                "PATCH" if r.target.contains("/status") => (200, stored.clone()),
                "POST" => (201, r.body.clone()),
                _ => crate::test_api::status(404, "NotFound", "not found"),
            })
        });
        let ctx = leading_at(&url, &pair);
        let dry_runs = || {
            seen.lock()
                .expect("lock")
                .iter()
                .filter(|r| r.target.contains("dryRun"))
                .count()
        };
        let told = || {
            let seen = seen.lock().expect("lock");
            let last = seen
                .iter()
                .rev()
                .find(|r| r.target.contains("/status"))
                .expect("a status patch");
            let status: serde_json::Value = serde_json::from_slice(&last.body).expect("json");
            status["status"]["conditions"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == "PoolsApplied").cloned())
                .expect("PoolsApplied")
        };
        for round in 0..3 {
            let action = reconcile(pair.clone(), ctx.clone()).await.expect("reconciled");
            assert_eq!(dry_runs(), 1, "round {round}: the refused plan was dry-run once");
            let c = told();
            assert_eq!(
                (&c["status"], &c["reason"]),
                (&"False".into(), &"ApplyFailed".into()),
                "{c}"
            );
            assert!(
                c["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("exceeded quota: pods")),
                "{c}"
            );
            // Tried again when APPLY_RETRY since the refusal is up, not a whole one after each.
            let requeue = format!("{action:?}");
            assert!(
                requeue.contains("requeue_after: Some(") && !requeue.contains("requeue_after: Some(30s)") || round == 0,
                "{requeue}"
            );
        }
        // Once APPLY_RETRY has passed, it is sent again.
        ctx.remembered.note("u1", |m| {
            if let Some((_, at, _)) = m.refused.as_mut() {
                *at -= APPLY_RETRY;
            }
        });
        reconcile(pair, ctx).await.expect("reconciled");
        assert_eq!(dry_runs(), 2);
    }

    #[tokio::test]
    async fn a_reconcile_refused_as_invalid_is_told_in_one_event_not_one_each_time() {
        // A status the API server refuses (422) fails every reconcile the same way, and every
        // PDEndpoint write reconciles the pair: each published an ApplyFailed Event.
        let pair = Arc::new(pair("llama", "u1"));
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let (url, seen) = crate::test_api::serve(move |r| {
            Some(match r.method.as_str() {
                "PATCH" if r.target.contains("/status") => {
                    // Naming a value that changes with each reconcile, as the API server's may.
                    let n = calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    crate::test_api::status(422, "Invalid", &format!("status.transfer.bytes: Invalid value: {n}"))
                }
                "PATCH" => (200, r.body.clone()),
                "POST" => (201, r.body.clone()),
                _ => crate::test_api::status(404, "NotFound", "not found"),
            })
        });
        let ctx = leading_at(&url, &pair);
        let told = || {
            seen.lock()
                .expect("lock")
                .iter()
                .filter(|r| r.method == "POST" && String::from_utf8_lossy(&r.body).contains("ApplyFailed"))
                .count()
        };
        for _ in 0..3 {
            let action = reconcile(pair.clone(), ctx.clone()).await.expect("reconciled");
            assert_eq!(action, Action::await_change());
        }
        // Events are sent as they are published.
        assert_eq!(told(), 1, "ApplyFailed Events for the same error");
    }

    #[test]
    fn pods_of_an_earlier_geometry_are_those_a_rollout_replaces_and_are_remembered_a_while() {
        let pod = |name: &str, hash: Option<&str>| {
            let mut p = Pod::default();
            p.metadata.name = Some(name.into());
            if let Some(h) = hash {
                p.metadata.annotations = Some([(crate::names::ANNOTATION_GEOMETRY.to_owned(), h.to_owned())].into());
            }
            Arc::new(p)
        };
        let r = Remembered::default();
        let pods = [pod("new", Some("h2")), pod("old", Some("h1")), pod("stray", None)];
        let got = earlier_pods(&r, "u1", [(&pods[..], Some("h2"))]);
        // A pod without the annotation is no rollout's: its engine is compared.
        assert_eq!(got, ["old".to_owned()].into());
        // Gone from the pods (its PDEndpoint lingers until collected): still earlier a while.
        let got = earlier_pods(&r, "u1", [(&pods[..1], Some("h2"))]);
        assert_eq!(got, ["old".to_owned()].into());
        r.note("u1", |m| {
            let long_ago = Instant::now().checked_sub(EARLIER_KEPT + Duration::from_secs(1));
            m.earlier
                .insert("old".into(), long_ago.expect("an instant that long ago"));
        });
        assert!(earlier_pods(&r, "u1", [(&pods[..1], Some("h2"))]).is_empty());
        // A pool the user brings has no earlier geometry.
        assert!(earlier_pods(&r, "u2", [(&pods[..], None)]).is_empty());
    }

    fn remember(r: &Remembered, pair: &PDPair) {
        r.note(&pair.uid().expect("uid"), |m| {
            m.written = Some(PDPairStatus::default());
            m.applied = Some(Applied::default());
            m.secret = Some(Instant::now() + RESYNC);
        });
        r.failures.lock().expect("lock").insert(ObjectRef::from(pair), 1);
    }

    /// The uids remembered, and the names with failures counted.
    fn remembered(r: &Remembered) -> (Vec<String>, Vec<String>) {
        let sorted = |mut v: Vec<String>| {
            v.sort();
            v
        };
        (
            sorted(r.pairs.lock().expect("lock").keys().cloned().collect()),
            sorted(
                r.failures
                    .lock()
                    .expect("lock")
                    .keys()
                    .map(|o| o.name.clone())
                    .collect(),
            ),
        )
    }

    #[test]
    fn what_is_remembered_of_a_pdpair_goes_once_it_is_gone_from_the_store() {
        // Each reconcile remembers its PDPair's status, plan and failures; a deleted PDPair is
        // never reconciled again, so without the store's word they stayed for the life of the
        // operator, one set per PDPair ever made.
        let (pairs, mut writer) = reflector::store::<PDPair>();
        let (a, b) = (pair("a", "uid-a"), pair("b", "uid-b"));
        for p in [&a, &b] {
            writer.apply_watcher_event(&Event::Apply(p.clone()));
        }
        let r = Remembered::default();
        remember(&r, &a);
        remember(&r, &b);
        r.forget_gone(&pairs);
        let both = vec!["uid-a".to_string(), "uid-b".into()];
        assert_eq!(
            remembered(&r),
            (both, vec!["a".into(), "b".into()]),
            "both live: both kept"
        );
        writer.apply_watcher_event(&Event::Delete(b.clone()));
        r.forget_gone(&pairs);
        assert_eq!(
            remembered(&r),
            (vec!["uid-a".into()], vec!["a".into()]),
            "b deleted: forgotten"
        );
        // Made again under its name: another object, whose old status is no baseline for it.
        let b2 = pair("b", "uid-b2");
        writer.apply_watcher_event(&Event::Apply(b2.clone()));
        remember(&r, &b);
        remember(&r, &b2);
        r.forget_gone(&pairs);
        assert_eq!(
            remembered(&r),
            (vec!["uid-a".into(), "uid-b2".into()], vec!["a".into(), "b".into()]),
        );
    }
}
