//! The agent's Prometheus metrics (prefix `pdpair_agent_`). Labels are bounded: outcomes, roles
//! and stable reason codes, never request ids or addresses.

use std::time::Duration;

use pdpair_api::{Role, checksum::Outcome};

use crate::reason::Reason;
use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

/// `ucx_software_rma_dropped_total`, read at each scrape from the count UCX's callbacks keep
/// (process-wide, as UCX's handlers are; they have no `Metrics`).
#[derive(Debug)]
struct SoftwareRma;

impl SoftwareRma {
    fn counter() -> IntCounter {
        IntCounter::new(
            "ucx_software_rma_dropped_total",
            "UCX software puts, gets, atomics and rendezvous messages peers sent this agent outside the shared memory it registered, dropped (UCX carries them out at any address the sender names; pdpair agents never send them)",
        )
        .expect("valid metric")
    }
}

impl prometheus::core::Collector for SoftwareRma {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        static DESC: std::sync::OnceLock<prometheus::core::Desc> = std::sync::OnceLock::new();
        vec![DESC.get_or_init(|| prometheus::core::Collector::desc(&Self::counter())[0].clone())]
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let c = Self::counter();
        c.inc_by(crate::transport::ucx::software_rma::dropped_so_far());
        prometheus::core::Collector::collect(&c)
    }
}

/// The agent's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    handshakes: IntCounterVec,
    transfers: IntCounterVec,
    paths: IntCounterVec,
    bytes: IntCounterVec,
    failures: IntCounterVec,
    checksums: IntCounterVec,
    leases: IntCounterVec,
    foreign: IntCounterVec,
    frames_refused: IntCounterVec,
    transfer_seconds: Histogram,
    reject_seconds: Histogram,
    /// Engines registered now.
    pub registrations: IntGauge,
    /// Requests of force-closed endpoints UCX still holds (see `transport::ucx_thread::Orphan`).
    pub orphaned_requests: IntGauge,
    /// Bytes of released pools kept mapped for those requests.
    pub orphaned_bytes: IntGauge,
}

fn counter(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
}

fn histogram(name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)).expect("valid metric")
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Metrics {
        let registry = Registry::new_custom(Some("pdpair_agent".into()), None).expect("valid prefix");
        let m = Metrics {
            handshakes: counter(
                "handshakes_total",
                "Side-channel handshakes by outcome (accepted or a reason)",
                &["outcome"],
            ),
            transfers: counter("transfers_total", "Completed KV transfers by role", &["role"]),
            paths: counter(
                "transfer_paths_total",
                "Completed KV transfers by the path they took (counted by the side that moved the bytes)",
                &["kind", "backend"],
            ),
            bytes: counter("transfer_bytes_total", "KV bytes moved by role", &["role"]),
            failures: counter(
                "request_failures_total",
                "Failed requests by role and reason",
                &["role", "reason"],
            ),
            checksums: counter(
                "checksum_outcomes_total",
                "KV checksum outcomes on decode",
                &["outcome"],
            ),
            leases: counter("lease_expiries_total", "Prefill holds that expired", &[]),
            frames_refused: counter(
                "engine_frames_refused_total",
                "Engine connections closed because a large frame got no room in time (frame_budget), or its body did not come in time",
                &[],
            ),
            foreign: counter(
                "foreign_answers_total",
                "Answers (Complete, Ready, Failed, Released) ignored because the link does not own the request",
                &[],
            ),
            transfer_seconds: histogram(
                "transfer_duration_seconds",
                "Time from posting a request's WRITEs to their flush",
                vec![0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0],
            ),
            reject_seconds: histogram(
                "handshake_rejection_seconds",
                "Time from dialling a prefill agent to its rejection",
                vec![0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25],
            ),
            registrations: IntGauge::new("open_registrations", "Engines registered with this agent")
                .expect("valid metric"),
            orphaned_requests: IntGauge::new(
                "orphaned_requests",
                "Requests of force-closed UCX endpoints (a deadline, a failure) that UCX has not completed yet",
            )
            .expect("valid metric"),
            orphaned_bytes: IntGauge::new(
                "orphaned_bytes",
                "Bytes of released engine pools kept mapped (as zero pages) until UCX completes the orphaned requests that name them, or, over shared memory, for answers to peers' software gets (for the agent's life)",
            )
            .expect("valid metric"),
            registry,
        };
        for c in [
            Box::new(m.handshakes.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.transfers.clone()),
            Box::new(m.paths.clone()),
            Box::new(m.bytes.clone()),
            Box::new(m.failures.clone()),
            Box::new(m.checksums.clone()),
            Box::new(m.leases.clone()),
            Box::new(m.foreign.clone()),
            Box::new(m.frames_refused.clone()),
            Box::new(SoftwareRma),
            Box::new(m.transfer_seconds.clone()),
            Box::new(m.reject_seconds.clone()),
            Box::new(m.registrations.clone()),
            Box::new(m.orphaned_requests.clone()),
            Box::new(m.orphaned_bytes.clone()),
        ] {
            m.registry.register(c).expect("registered once");
        }
        m
    }

    /// Counts an accepted handshake (`outcome="accepted"`).
    pub fn handshake_accepted(&self) {
        self.handshakes.with_label_values(&["accepted"]).inc();
    }

    /// Counts a refused or failed handshake under its reason (a closed set).
    pub fn handshake_refused(&self, reason: Reason) {
        self.handshakes.with_label_values(&[reason.as_str()]).inc();
    }

    /// Handshakes accepted so far.
    pub fn handshakes_accepted(&self) -> u64 {
        self.handshakes.with_label_values(&["accepted"]).get()
    }

    /// Handshakes refused or failed for `reason` so far.
    pub fn handshakes_refused(&self, reason: Reason) -> u64 {
        self.handshakes.with_label_values(&[reason.as_str()]).get()
    }

    /// Counts an answer ignored because its link does not own the request.
    pub fn foreign_answer(&self) {
        self.foreign.with_label_values::<&str>(&[]).inc();
    }

    /// Counts a completed transfer.
    pub fn transfer_done(&self, role: Role, bytes: u64) {
        self.transfers.with_label_values(&[role.as_str()]).inc();
        self.bytes.with_label_values(&[role.as_str()]).inc_by(bytes);
    }

    /// Counts a transfer this agent moved over `path`.
    pub fn transfer_path(&self, path: &pdpair_api::TransferPath) {
        self.paths
            .with_label_values(&[path.kind.as_str(), path.backend.as_str()])
            .inc();
    }

    /// Counts a failed request.
    pub fn request_failed(&self, role: Role, reason: Reason) {
        self.failures.with_label_values(&[role.as_str(), reason.as_str()]).inc();
    }

    /// Counts a checksum outcome.
    pub fn checksum(&self, outcome: Outcome) {
        self.checksums.with_label_values(&[&format!("{outcome:?}")]).inc();
    }

    /// Counts an engine connection closed for a frame with no room, or whose body did not come.
    pub fn engine_frames_refused(&self) {
        self.frames_refused.with_label_values::<&str>(&[]).inc();
    }

    /// Counts an expired lease.
    pub fn lease_expired(&self) {
        self.leases.with_label_values::<&str>(&[]).inc();
    }

    /// Observes a transfer's duration.
    pub fn transfer_latency(&self, d: Duration) {
        self.transfer_seconds.observe(d.as_secs_f64());
    }

    /// Observes how long a rejection took.
    pub fn reject_latency(&self, d: Duration) {
        self.reject_seconds.observe(d.as_secs_f64());
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
