//! The plain-HTTP admin port: `/metrics`, `/livez`, `/readyz`.
//!
//! `/readyz` is true only once TLS is loaded and every watch delivered its first list.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use axum::{Router, extract::State, http::StatusCode, routing::get};

use crate::metrics::Metrics;

/// Readiness flags, set by the parts that own them.
#[derive(Debug, Default)]
pub struct Health {
    /// The webhook's certificate is loaded.
    pub tls_loaded: AtomicBool,
    /// Every watch delivered its first events.
    pub watches_synced: AtomicBool,
}

impl Health {
    /// Whether the replica may receive traffic.
    pub fn ready(&self) -> bool {
        self.tls_loaded.load(Ordering::SeqCst) && self.watches_synced.load(Ordering::SeqCst)
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
    if h.ready() {
        (StatusCode::OK, "ready\n".into())
    } else {
        let msg = format!(
            "not ready: tls_loaded={} watches_synced={}\n",
            h.tls_loaded.load(Ordering::SeqCst),
            h.watches_synced.load(Ordering::SeqCst)
        );
        (StatusCode::SERVICE_UNAVAILABLE, msg)
    }
}

async fn metrics_text(State(s): State<AdminState>) -> ([(&'static str, &'static str); 1], String) {
    ([("content-type", "text/plain; version=0.0.4")], s.metrics.render())
}
