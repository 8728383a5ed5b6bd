//! Leader election with a coordination.k8s.io Lease: every replica serves the webhook; only the
//! holder reconciles. Losing a held lease is fatal (the caller exits). The holder counts its
//! lease from when its last successful renewal was sent and gives it up one renew period before
//! it runs out (its renew deadline, as client-go's), so it has stopped before another replica
//! can take the lease: a round that gets no answer within a renew period, or by the deadline,
//! fails (a renewal stuck on a half-open connection kept the old holder leading until the
//! client's read timeout, minutes after another replica took over; and checked only as each
//! round ended, a holder whose renewals failed led up to a renew period past its lease).

use std::time::Duration;

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::{SignedDuration, Timestamp},
};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use tokio::sync::watch;

/// Lease settings.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// Lease name.
    pub name: String,
    /// This replica's identity.
    pub identity: String,
    /// How long a lease is valid without renewal.
    pub duration: Duration,
    /// How often the holder renews (and others retry).
    pub renew_every: Duration,
}

/// Why leadership ended.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Another replica took the lease, or renewals failed for a whole lease duration.
    #[error("lost the leader lease {name}: {why}")]
    Lost {
        /// Lease name.
        name: String,
        /// What happened.
        why: String,
    },
}

enum Round {
    Leader,
    Follower(String),
}

/// Runs forever, publishing leadership on `state`; returns only when a held lease is lost.
pub async fn run(api: Api<Lease>, cfg: LeaseConfig, state: watch::Sender<bool>) -> LeaseError {
    let mut last_renewal: Option<std::time::Instant> = None;
    let renew_deadline = cfg.duration.saturating_sub(cfg.renew_every);
    // What the holder has left before its renew deadline.
    let left = |last: Option<std::time::Instant>| last.map(|t| renew_deadline.saturating_sub(t.elapsed()));
    loop {
        let sent = std::time::Instant::now();
        let was_leader = *state.borrow();
        // The holder's round ends by its renew deadline, answered or not, and leaves half of
        // what it has left for another try (one that hung took it all: 200 ms at least).
        let limit = match left(last_renewal) {
            Some(left) if was_leader => cfg
                .renew_every
                .min((left / 2).max(Duration::from_millis(200)))
                .min(left),
            _ => cfg.renew_every,
        };
        let round = match tokio::time::timeout(limit, try_acquire(&api, &cfg)).await {
            Ok(round) => round.map_err(|e| e.to_string()),
            Err(_) => Err(format!("no answer within {limit:?}")),
        };
        let mut failed = false;
        match round {
            Ok(Round::Leader) => {
                last_renewal = Some(sent);
                if !was_leader {
                    tracing::info!(lease = %cfg.name, identity = %cfg.identity, "became leader");
                    let _ = state.send(true);
                }
            }
            Ok(Round::Follower(holder)) => {
                if was_leader {
                    return LeaseError::Lost {
                        name: cfg.name,
                        why: format!("now held by {holder}"),
                    };
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, lease = %cfg.name, "lease round failed");
                failed = true;
                if was_leader && last_renewal.is_none_or(|t| t.elapsed() >= renew_deadline) {
                    return LeaseError::Lost {
                        name: cfg.name,
                        why: format!(
                            "renewals failed until the renew deadline ({renew_deadline:?} of the {:?} lease): {e}",
                            cfg.duration
                        ),
                    };
                }
            }
        }
        // Rounds a renew period apart, from when each was sent. A holder whose renewal failed
        // tries again sooner, a third of what it has left (200 ms at least), so it gets several
        // tries before its deadline (one slow or failed round used to cost it the lease).
        let pause = match left(last_renewal) {
            Some(left) if failed && was_leader => (left / 3).max(Duration::from_millis(200)).min(left),
            _ => cfg.renew_every.saturating_sub(sent.elapsed()),
        };
        tokio::time::sleep(pause).await;
    }
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// Whether a lease renewed at `renewed` for `secs` has run out at `now`. A renewal further
/// ahead of `now` than the lease and clocks' skew ([`crate::status::SKEW_SECONDS`]) is not
/// taken (whoever wrote it, a replica's clock or a Lease editor, would keep the lease from
/// every replica until then: in year 9999 adding the duration panicked every replica).
fn expired(renewed: Option<&MicroTime>, secs: Option<i32>, now: Timestamp) -> bool {
    let (Some(renewed), Some(secs)) = (renewed, secs) else {
        return true;
    };
    let lease = SignedDuration::from_secs(i64::from(secs));
    let ahead = lease.checked_add(SignedDuration::from_secs(crate::status::SKEW_SECONDS));
    match (
        renewed.0.checked_add(lease),
        ahead.and_then(|a| now.checked_add(a).ok()),
    ) {
        (Ok(until), Some(latest)) => until < now || renewed.0 > latest,
        _ => true,
    }
}

async fn try_acquire(api: &Api<Lease>, cfg: &LeaseConfig) -> Result<Round, kube::Error> {
    // Rounded up: others wait at least as long as this replica counts itself the holder.
    let duration_secs = i32::try_from(cfg.duration.as_secs() + u64::from(cfg.duration.subsec_nanos() > 0))
        .unwrap_or(i32::MAX)
        .max(1);
    let Some(mut lease) = api.get_opt(&cfg.name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(cfg.name.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(cfg.identity.clone()),
                lease_duration_seconds: Some(duration_secs),
                acquire_time: Some(now()),
                renew_time: Some(now()),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        return match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(Round::Leader),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(Round::Follower("another replica".into())),
            Err(e) => Err(e),
        };
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let expired = expired(spec.renew_time.as_ref(), spec.lease_duration_seconds, Timestamp::now());
    if holder != cfg.identity && !holder.is_empty() && !expired {
        return Ok(Round::Follower(holder));
    }
    if holder != cfg.identity {
        spec.acquire_time = Some(now());
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
        spec.holder_identity = Some(cfg.identity.clone());
    }
    spec.renew_time = Some(now());
    spec.lease_duration_seconds = Some(duration_secs);
    // replace() carries the resourceVersion we read: a concurrent taker makes this a 409.
    match api.replace(&cfg.name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(Round::Leader),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(Round::Follower("a concurrent writer".into())),
        Err(e) => Err(e),
    }
}

/// Gives the lease up on shutdown so a successor takes over at once instead of after expiry.
pub async fn release(api: &Api<Lease>, cfg: &LeaseConfig) {
    let Ok(Some(lease)) = api.get_opt(&cfg.name).await else {
        return;
    };
    if lease.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) != Some(cfg.identity.as_str()) {
        return;
    }
    let patch = serde_json::json!({
        "metadata": { "resourceVersion": lease.metadata.resource_version },
        "spec": { "holderIdentity": null, "renewTime": null }
    });
    if let Err(e) = api
        .patch(&cfg.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        tracing::warn!(error = %e, "could not release the leader lease");
    } else {
        tracing::info!(lease = %cfg.name, "released the leader lease");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An API server on loopback that answers the first `answered` requests (a lease GET: not
    /// found; a create: the lease sent, taken) and then takes requests without ever answering,
    /// as a half-open connection does. Also the requests it was sent.
    fn api_answering(answered: usize) -> (String, crate::test_api::Seen) {
        let count = std::sync::atomic::AtomicUsize::new(0);
        crate::test_api::serve(move |r| {
            if count.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= answered {
                return None;
            }
            Some(if r.method == "GET" {
                crate::test_api::status(404, "NotFound", "not found")
            } else {
                (201, r.body.clone())
            })
        })
    }

    #[test]
    fn a_lease_runs_out_after_its_duration_and_a_renewal_from_far_ahead_is_not_taken() {
        let now: Timestamp = "2026-12-07T00:00:00Z".parse().expect("time");
        let at = |s: i64| Some(MicroTime(now + SignedDuration::from_secs(s)));
        assert!(!expired(at(-10).as_ref(), Some(15), now), "renewed 10 s ago for 15 s");
        assert!(expired(at(-16).as_ref(), Some(15), now), "renewed 16 s ago for 15 s");
        assert!(!expired(at(60).as_ref(), Some(15), now), "a minute ahead: clocks' skew");
        assert!(expired(at(3600).as_ref(), Some(15), now), "an hour ahead");
        assert!(
            expired(Some(&MicroTime(Timestamp::MAX)), Some(15), now),
            "the last instant (overflowed)"
        );
        assert!(
            expired(Some(&MicroTime(Timestamp::MIN)), Some(i32::MIN), now),
            "the first instant"
        );
        assert!(
            expired(None, Some(15), now) && expired(at(0).as_ref(), None, now),
            "half a lease"
        );
    }

    #[tokio::test]
    async fn a_failed_renewal_is_tried_again_before_the_deadline_and_leadership_goes_on() {
        // One renewal answered 500 (an API server restarting): the holder tries again within
        // its renew deadline and goes on leading (with the deadline alone, the next round came
        // at the deadline and the holder gave up at once, from a review).
        // And one that gets no answer (a half-open connection) leaves time for another: with
        // the round's whole time to the deadline, it cost the lease.
        let count = std::sync::atomic::AtomicUsize::new(0);
        let (url, _) = crate::test_api::serve(move |r| {
            let n = count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(match (n, r.method.as_str()) {
                (0, _) => crate::test_api::status(404, "NotFound", "not found"),
                (1, _) => (201, r.body.clone()),
                (2, _) => crate::test_api::status(500, "InternalError", "etcd is restarting"),
                (3, _) => return None,
                (_, "GET") => {
                    let lease = Lease {
                        metadata: ObjectMeta {
                            name: Some("pdpair-test".into()),
                            resource_version: Some("1".into()),
                            ..ObjectMeta::default()
                        },
                        spec: Some(LeaseSpec {
                            holder_identity: Some("me".into()),
                            lease_duration_seconds: Some(6),
                            renew_time: Some(now()),
                            ..LeaseSpec::default()
                        }),
                    };
                    (200, serde_json::to_vec(&lease).expect("json"))
                }
                _ => (200, r.body.clone()),
            })
        });
        let client = kube::Client::try_from(kube::Config::new(url.parse().expect("url"))).expect("client");
        let api: Api<Lease> = Api::namespaced(client, "default");
        let cfg = LeaseConfig {
            name: "pdpair-test".into(),
            identity: "me".into(),
            duration: Duration::from_millis(6000),
            renew_every: Duration::from_millis(2000),
        };
        let (tx, rx) = watch::channel(false);
        let ran = tokio::time::timeout(Duration::from_secs(8), run(api, cfg, tx)).await;
        assert!(ran.is_err(), "leadership ended: {:?}", ran.map(|e| e.to_string()));
        assert!(*rx.borrow(), "it leads on");
    }

    #[tokio::test]
    async fn a_renewal_that_gets_no_answer_ends_leadership_before_the_lease_runs_out() {
        // By its renew deadline (the lease less a renew period), before another replica may
        // take the lease: checked only as each round ended, it led on up to a renew period
        // past the lease (from a review).
        let (url, bodies) = api_answering(2);
        let url: hyper::Uri = url.parse().expect("url");
        let client = kube::Client::try_from(kube::Config::new(url)).expect("client");
        let api: Api<Lease> = Api::namespaced(client, "default");
        let cfg = LeaseConfig {
            name: "pdpair-test".into(),
            identity: "me".into(),
            duration: Duration::from_millis(3500),
            renew_every: Duration::from_millis(1000),
        };
        let (tx, mut rx) = watch::channel(false);
        let led = tokio::spawn(async move {
            rx.changed().await.expect("it led");
            std::time::Instant::now()
        });
        let lost = tokio::time::timeout(Duration::from_secs(20), run(api, cfg, tx))
            .await
            .expect("leadership ended while the renewal hung");
        let led = led.await.expect("it led first");
        assert!(lost.to_string().contains("renew deadline"), "{lost}");
        // Its lease was taken as it began leading (the create's answer): it stops 2.5 s on,
        // a renew period before others may take it at 3.5 s (4 s: next).
        assert!(led.elapsed() < Duration::from_millis(3500), "{:?}", led.elapsed());
        // The lease it took says 4 s, not 3: others wait at least as long as it counts itself
        // the holder.
        let created: Lease = serde_json::from_slice(&bodies.lock().expect("lock")[1].body).expect("the lease created");
        assert_eq!(created.spec.and_then(|s| s.lease_duration_seconds), Some(4));
    }
}
