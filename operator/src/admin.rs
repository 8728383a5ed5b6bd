//! The plain-HTTP admin port: `/metrics`, `/livez`, `/readyz`.
//!
//! `/readyz` is true once the webhook's TLS is loaded: the webhook Service routes admission
//! reviews to ready replicas, and validating a PDPair needs nothing from the API server. Whether
//! every watch delivered its first list is told in its body and in a gauge, not in readiness: a
//! namespace in `--namespace` that was deleted (its RoleBinding with it) keeps its watches from
//! listing for good, and with readiness waiting on them no replica of a restarted operator was
//! ready, the webhook had no endpoints, and `failurePolicy: Fail` refused every PDPair write in
//! the cluster. A leader reconciles nothing until its own caches have listed, whatever this says.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use axum::{Router, extract::State, http::StatusCode, routing::get};

use crate::metrics::Metrics;

/// Readiness, set by the parts that own it.
#[derive(Debug)]
pub struct Health {
    /// The webhook's certificate is loaded.
    pub tls_loaded: AtomicBool,
    /// Watch scopes (namespaces, or all) whose watches have not delivered their first events
    /// (told, not waited for); the gauge `pdpair_operator_watch_scopes_unsynced` shows it.
    unsynced_scopes: std::sync::Mutex<usize>,
    metrics: Arc<Metrics>,
}

impl Health {
    /// Health of an operator watching `scopes` scopes, none listed yet.
    pub fn new(scopes: usize, metrics: Arc<Metrics>) -> Health {
        metrics.set_unsynced_scopes(scopes);
        Health {
            tls_loaded: AtomicBool::new(false),
            unsynced_scopes: std::sync::Mutex::new(scopes),
            metrics,
        }
    }

    /// Whether the replica may receive admission reviews.
    pub fn ready(&self) -> bool {
        self.tls_loaded.load(Ordering::SeqCst)
    }

    /// Whether every scope's watches have listed.
    pub fn watches_synced(&self) -> bool {
        self.unsynced_scopes.lock().is_ok_and(|n| *n == 0)
    }

    /// One scope's watches listed: the scopes left (the gauge set under the same lock, so two
    /// scopes listing at once cannot leave it behind the count).
    pub fn scope_synced(&self) -> usize {
        let Ok(mut n) = self.unsynced_scopes.lock() else {
            return usize::MAX;
        };
        *n = n.saturating_sub(1);
        self.metrics.set_unsynced_scopes(*n);
        *n
    }
}

#[derive(Clone)]
struct AdminState {
    health: Arc<Health>,
    metrics: Arc<Metrics>,
}

/// The admin router.
pub fn router(health: Arc<Health>, metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(AdminState { health, metrics })
}

async fn readyz(State(s): State<AdminState>) -> (StatusCode, String) {
    let h = &s.health;
    let synced = h.watches_synced();
    if h.ready() {
        (StatusCode::OK, format!("ready (watches_synced={synced})\n"))
    } else {
        let msg = format!(
            "not ready: tls_loaded={} watches_synced={synced}\n",
            h.tls_loaded.load(Ordering::SeqCst),
        );
        (StatusCode::SERVICE_UNAVAILABLE, msg)
    }
}

async fn metrics_text(State(s): State<AdminState>) -> ([(&'static str, &'static str); 1], String) {
    ([("content-type", "text/plain; version=0.0.4")], s.metrics.render())
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;

    async fn get(app: Router, path: &str) -> (StatusCode, String) {
        let resp = app
            .oneshot(axum::http::Request::get(path).body(Body::empty()).expect("request"))
            .await
            .expect("infallible");
        let status = resp.status();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn readyz_needs_tls_and_tells_the_watches() {
        let metrics = Arc::new(Metrics::new());
        let health = Arc::new(Health::new(2, Arc::clone(&metrics)));
        let app = || router(Arc::clone(&health), Arc::clone(&metrics));
        assert_eq!(get(app(), "/livez").await.0, StatusCode::OK);
        assert_eq!(get(app(), "/readyz").await.0, StatusCode::SERVICE_UNAVAILABLE);
        // Ready to serve reviews with the watches still listing (or never: e2e
        // operator_restart::an_operator_of_some_namespaces_runs_their_pairs_and_leaves_the_others_alone).
        health.tls_loaded.store(true, Ordering::SeqCst);
        assert_eq!(
            get(app(), "/readyz").await,
            (StatusCode::OK, "ready (watches_synced=false)\n".into())
        );
        assert_eq!(health.scope_synced(), 1);
        assert_eq!(
            get(app(), "/readyz").await,
            (StatusCode::OK, "ready (watches_synced=false)\n".into())
        );
        assert!(
            get(app(), "/metrics")
                .await
                .1
                .contains("pdpair_operator_watch_scopes_unsynced 1")
        );
        assert_eq!(health.scope_synced(), 0);
        assert!(
            get(app(), "/metrics")
                .await
                .1
                .contains("pdpair_operator_watch_scopes_unsynced 0")
        );
        assert_eq!(
            get(app(), "/readyz").await,
            (StatusCode::OK, "ready (watches_synced=true)\n".into())
        );
        metrics.set_leader(true);
        metrics.reconcile_error("transient");
        let (_, text) = get(app(), "/metrics").await;
        assert!(text.contains("pdpair_operator_leader 1"), "{text}");
        assert!(
            text.contains("pdpair_operator_reconcile_errors_total{category=\"transient\"} 1"),
            "{text}"
        );
    }
}
