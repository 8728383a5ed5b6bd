//! Prometheus metrics, built once in `run` and passed down. Labels are bounded: outcomes, rule
//! reasons and error categories, never object names.

use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

/// The operator's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: IntCounter,
    reconcile_errors: IntCounterVec,
    reconcile_duration: Histogram,
    admissions: IntCounterVec,
    leader: IntGauge,
    unsynced_scopes: IntGauge,
    events_dropped: IntCounter,
    condition_events_dropped: IntCounter,
    deployment_applies: IntCounter,
    secrets_ensured: IntCounter,
    webhook_tls_failures: IntCounter,
    status_writes: IntCounter,
}

impl Metrics {
    /// Registers every metric under the `pdpair_operator_` prefix.
    pub fn new() -> Metrics {
        let registry = Registry::new_custom(Some("pdpair_operator".into()), None).expect("valid prefix");
        let reconciles = IntCounter::new("reconciles_total", "Reconciles of PDPairs").expect("valid metric");
        let secrets_ensured = IntCounter::new(
            "pairing_secret_checks_total",
            "Creates of a pair's pairing Secret sent (answered 409 when it exists)",
        )
        .expect("valid metric");
        let deployment_applies = IntCounter::new(
            "deployment_applies_total",
            "Server-side applies of pools' Deployments (not counting dry runs)",
        )
        .expect("valid metric");
        let status_writes = IntCounter::new(
            "status_writes_total",
            "Patches of a PDPair's status sent (a change of counters alone at most every 5 s per pair)",
        )
        .expect("valid metric");
        let webhook_tls_failures = IntCounter::new(
            "webhook_tls_failures_total",
            "Connections to the webhook port whose TLS handshake failed or timed out (with --webhook-client-ca: also every caller without a client certificate from that CA)",
        )
        .expect("valid metric");
        let reconcile_errors = IntCounterVec::new(
            Opts::new("reconcile_errors_total", "Failed reconciles, by error category"),
            &["category"],
        )
        .expect("valid metric");
        let reconcile_duration = Histogram::with_opts(
            HistogramOpts::new("reconcile_duration_seconds", "Time spent in one reconcile")
                .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]),
        )
        .expect("valid metric");
        let admissions = IntCounterVec::new(
            Opts::new(
                "admission_decisions_total",
                "Admission reviews, by outcome and first rule reason",
            ),
            &["outcome", "reason"],
        )
        .expect("valid metric");
        let leader = IntGauge::new("leader", "1 while this replica holds the leader Lease").expect("valid metric");
        let unsynced_scopes = IntGauge::new(
            "watch_scopes_unsynced",
            "Namespaces watched (1 for the whole cluster) whose watches have not delivered their first list yet",
        )
        .expect("valid metric");
        let events_dropped = IntCounter::new(
            "admission_events_dropped_total",
            "Rejected Events not recorded because denials came faster than the Event budget",
        )
        .expect("valid metric");
        let condition_events_dropped = IntCounter::new(
            "condition_events_dropped_total",
            "Events of PDPair condition changes not recorded because one pair's conditions changed faster than its Event budget",
        )
        .expect("valid metric");
        for m in [
            Box::new(reconciles.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(reconcile_errors.clone()),
            Box::new(reconcile_duration.clone()),
            Box::new(admissions.clone()),
            Box::new(leader.clone()),
            Box::new(unsynced_scopes.clone()),
            Box::new(events_dropped.clone()),
            Box::new(condition_events_dropped.clone()),
            Box::new(deployment_applies.clone()),
            Box::new(secrets_ensured.clone()),
            Box::new(webhook_tls_failures.clone()),
            Box::new(status_writes.clone()),
        ] {
            registry.register(m).expect("metrics registered once");
        }
        Metrics {
            registry,
            reconciles,
            reconcile_errors,
            reconcile_duration,
            admissions,
            leader,
            unsynced_scopes,
            events_dropped,
            condition_events_dropped,
            deployment_applies,
            secrets_ensured,
            webhook_tls_failures,
            status_writes,
        }
    }

    /// Counts a PDPair status patch sent.
    pub fn status_written(&self) {
        self.status_writes.inc();
    }

    /// Counts a webhook connection whose TLS handshake failed.
    pub fn webhook_tls_failed(&self) {
        self.webhook_tls_failures.inc();
    }

    /// Counts a denial whose Event was not recorded (over the budget).
    pub fn event_dropped(&self) {
        self.events_dropped.inc();
    }

    /// Counts a condition change whose Event was not recorded (over its pair's budget).
    pub fn condition_event_dropped(&self) {
        self.condition_events_dropped.inc();
    }

    /// Counts a reconcile and its duration.
    pub fn reconciled(&self, seconds: f64) {
        self.reconciles.inc();
        self.reconcile_duration.observe(seconds);
    }

    /// Counts a Deployment applied.
    pub fn deployment_applied(&self) {
        self.deployment_applies.inc();
    }

    /// Counts a create of a pairing Secret sent.
    pub fn secret_ensured(&self) {
        self.secrets_ensured.inc();
    }

    /// Counts a failed reconcile.
    pub fn reconcile_error(&self, category: &str) {
        self.reconcile_errors.with_label_values(&[category]).inc();
    }

    /// Counts an admission decision.
    pub fn admission(&self, outcome: &str, reason: &str) {
        self.admissions.with_label_values(&[outcome, reason]).inc();
    }

    /// Sets how many watch scopes have not had their first list.
    pub fn set_unsynced_scopes(&self, n: usize) {
        self.unsynced_scopes.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Sets the leader gauge.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding into a Vec cannot fail for the text format.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
