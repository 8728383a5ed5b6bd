//! Leader election with a coordination.k8s.io Lease: every replica serves the webhook; only the
//! holder reconciles. Losing a held lease is fatal (the caller exits), so two replicas never
//! reconcile at once for longer than one renew period.

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
    loop {
        let round = try_acquire(&api, &cfg).await;
        let was_leader = *state.borrow();
        match round {
            Ok(Round::Leader) => {
                last_renewal = Some(std::time::Instant::now());
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
                if was_leader && last_renewal.is_none_or(|t| t.elapsed() >= cfg.duration) {
                    return LeaseError::Lost {
                        name: cfg.name,
                        why: format!("renewals failed for a whole lease duration: {e}"),
                    };
                }
            }
        }
        tokio::time::sleep(cfg.renew_every).await;
    }
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

async fn try_acquire(api: &Api<Lease>, cfg: &LeaseConfig) -> Result<Round, kube::Error> {
    let duration_secs = i32::try_from(cfg.duration.as_secs()).unwrap_or(i32::MAX).max(1);
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
    let expired = match (&spec.renew_time, spec.lease_duration_seconds) {
        (Some(renewed), Some(secs)) => renewed.0 + SignedDuration::from_secs(i64::from(secs)) < Timestamp::now(),
        _ => true,
    };
    if holder != cfg.identity && !holder.is_empty() && !expired {
        return Ok(Round::Follower(holder));
    }
    if holder != cfg.identity {
        spec.acquire_time = Some(now());
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
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
