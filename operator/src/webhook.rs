//! The validating admission webhook: a pure [`review`] behind a thin router.
//!
//! `review` never panics and never unwraps on the request path: a body that is not an
//! AdmissionReview gets a 400, a review without a request gets a denial, an object that is not a
//! PDPair gets a denial that names the field. A denied PDPair is returned as a [`Denial`] so the
//! server can record a Warning Event about it (even though it was never stored).

use std::sync::Arc;

use axum::{Router, body::Bytes, extract::State, http::StatusCode, response::IntoResponse, routing::post};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::core::{
    DynamicObject,
    admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation},
    response::{StatusCause, StatusDetails},
};
use pdpair_api::{PDPair, Violation};
use serde::Serialize;

use crate::{metrics::Metrics, names};

/// A PDPair the webhook denied, for the Warning Event.
#[derive(Clone, Debug, PartialEq)]
pub struct Denial {
    /// Namespace of the PDPair.
    pub namespace: Option<String>,
    /// Its name (or generateName).
    pub name: String,
    /// Its uid, when it was stored before (updates).
    pub uid: Option<String>,
    /// Why.
    pub violations: Vec<Violation>,
    /// The whole message, as the user sees it.
    pub message: String,
}

impl Denial {
    /// A reference to the PDPair for the Event's `regarding`.
    pub fn reference(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("pdpair.dev/v1alpha1".into()),
            kind: Some("PDPair".into()),
            namespace: self.namespace.clone(),
            name: Some(self.name.clone()),
            uid: self.uid.clone(),
            ..ObjectReference::default()
        }
    }
}

/// The outcome of one review, for metrics and the Event.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The response to send.
    pub response: AdmissionResponse,
    /// Set when a PDPair was denied by the rule table.
    pub denial: Option<Denial>,
    /// Metric label: the first rule reason, `Malformed` for an object that is not a PDPair, or
    /// empty when allowed.
    pub reason: &'static str,
}

fn allow(req: &AdmissionRequest<DynamicObject>) -> Outcome {
    Outcome {
        response: AdmissionResponse::from(req),
        denial: None,
        reason: "",
    }
}

fn malformed(response: AdmissionResponse, message: String) -> Outcome {
    let mut response = response.deny(message);
    response.result.reason = "BadRequest".into();
    response.result.code = 400;
    Outcome {
        response,
        denial: None,
        reason: "Malformed",
    }
}

/// A PDPair's name, at most: a label value's bound.
pub const MAX_NAME: usize = 63;

/// Why a PDPair's name (or the names its `generateName` makes) is too long, if it is: the name
/// is a label value of the pair's Deployments, pods and Secret, and part of its Events' names,
/// so a longer one is stored but never runs. The webhook and `validate` both refuse it.
pub fn name_too_long(meta: &kube::api::ObjectMeta) -> Option<String> {
    let (field, len) = match meta.name.as_deref().filter(|n| !n.is_empty()) {
        Some(name) => (name.len() > MAX_NAME).then_some(("metadata.name", name.len())),
        None => meta
            .generate_name
            .as_deref()
            .filter(|g| g.len() + 5 > MAX_NAME)
            .map(|g| ("metadata.generateName", g.len() + 5)),
    }?;
    Some(format!(
        "{field} makes a name of {len} characters; a PDPair's name is at most {MAX_NAME} (it is the value of its pods' pdpair.dev/name label)"
    ))
}

/// Parses an object of the review as a PDPair.
fn as_pdpair(object: &DynamicObject) -> Result<PDPair, String> {
    let value = serde_json::to_value(object).map_err(|e| e.to_string())?;
    serde_path_to_error::deserialize(value).map_err(|e| format!("{}: {}", e.path(), e.inner()))
}

/// Reviews one PDPair admission request.
pub fn review(req: &AdmissionRequest<DynamicObject>) -> Outcome {
    if !matches!(req.operation, Operation::Create | Operation::Update) {
        return allow(req);
    }
    let Some(object) = req.object.as_ref() else {
        return malformed(
            AdmissionResponse::from(req),
            "the admission request carries no object".into(),
        );
    };
    let pair = match as_pdpair(object) {
        Ok(pair) => pair,
        Err(e) => return malformed(AdmissionResponse::from(req), format!("not a valid PDPair: {e}")),
    };
    if req.operation == Operation::Create
        && let Some(why) = name_too_long(&pair.metadata)
    {
        return malformed(AdmissionResponse::from(req), why);
    }
    // An update that leaves the spec alone (labels, finalizers, owner references) is not a new
    // geometry decision: let it through even if the stored spec predates the webhook (its
    // templates included: a finalizer the garbage collector removes must not be refused).
    if req.operation == Operation::Update
        && let Some(old) = req.old_object.as_ref().and_then(|o| as_pdpair(o).ok())
        && old.spec == pair.spec
    {
        return allow(req);
    }
    if let Some((field, why)) = pair.spec.template_errors().into_iter().next() {
        return malformed(
            AdmissionResponse::from(req),
            format!("not a valid PDPair: {field} is not a pod template: {why}"),
        );
    }
    let verdict = pdpair_api::check_admission(&pair.spec);
    let Some(first) = verdict.violations.first() else {
        return allow(req);
    };
    let reason = first.reason.as_str();
    let name = pair
        .metadata
        .name
        .clone()
        .filter(|n| !n.is_empty())
        .or_else(|| pair.metadata.generate_name.clone())
        .unwrap_or_else(|| req.name.clone());
    let namespace = pair.metadata.namespace.clone().or_else(|| req.namespace.clone());
    let message = denial_message(&name, &verdict.violations);
    let mut response = AdmissionResponse::from(req).deny(&message);
    response.result.reason = "Invalid".into();
    response.result.code = 422;
    response.result.details = Some(StatusDetails {
        name: name.clone(),
        group: "pdpair.dev".into(),
        kind: "PDPair".into(),
        causes: verdict
            .violations
            .iter()
            .map(|v| StatusCause {
                reason: v.reason.as_str().into(),
                message: format!("{}: {}", v.reason, v.message),
                field: v.field.clone(),
            })
            .collect(),
        uid: String::new(),
        retry_after_seconds: 0,
    });
    let uid = req.old_object.as_ref().and_then(|o| o.metadata.uid.clone());
    Outcome {
        response,
        denial: Some(Denial {
            namespace,
            name,
            uid,
            violations: verdict.violations,
            message,
        }),
        reason,
    }
}

/// The message a user reads in `kubectl apply`'s error and in the Event.
pub fn denial_message(name: &str, violations: &[Violation]) -> String {
    let mut out = format!("PDPair {name} is incompatible ({} violation", violations.len());
    if violations.len() != 1 {
        out.push('s');
    }
    out.push_str("): ");
    let parts: Vec<String> = violations
        .iter()
        .map(|v| format!("{} {}: {}", v.reason, v.field, v.message))
        .collect();
    out.push_str(&parts.join("; "));
    out
}

/// How many `Rejected` Events the webhook records: a token bucket of [`EventBudget::BURST`]
/// Events refilled at [`EventBudget::PER_SECOND`]. A client that sends denied reviews in a loop
/// gets every answer, but cannot flood the API server with Events.
#[derive(Debug)]
pub struct EventBudget {
    tokens: f64,
    at: std::time::Instant,
    burst: f64,
    per_second: f64,
}

impl EventBudget {
    /// Events recorded at once after a quiet spell.
    pub const BURST: f64 = 20.0;
    /// Events per second in a sustained stream of denials.
    pub const PER_SECOND: f64 = 5.0;

    /// A full budget.
    pub fn new(now: std::time::Instant) -> EventBudget {
        EventBudget::of(Self::BURST, Self::PER_SECOND, now)
    }

    /// A full budget of `burst` Events, refilled at `per_second`.
    pub fn of(burst: f64, per_second: f64, now: std::time::Instant) -> EventBudget {
        EventBudget {
            tokens: burst,
            at: now,
            burst,
            per_second,
        }
    }

    /// Whether one more Event may be recorded at `now` (and spends it).
    pub fn take(&mut self, now: std::time::Instant) -> bool {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * self.per_second;
        self.tokens = (self.tokens + refill).min(self.burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// What the server does with a denial besides answering: record the Event.
pub trait DenialSink: Send + Sync + 'static {
    /// Called once per denied, non-dry-run request.
    fn denied(&self, denial: Denial);
}

/// State of the webhook router.
#[derive(Clone)]
pub struct WebhookState {
    /// Admission metrics.
    pub metrics: Arc<Metrics>,
    /// Where denials go.
    pub sink: Arc<dyn DenialSink>,
}

impl std::fmt::Debug for WebhookState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookState").finish_non_exhaustive()
    }
}

/// The largest AdmissionReview the webhook reads: an UPDATE carries the object twice (`object`
/// and `oldObject`, managed fields included), each up to etcd's 1.5 MiB; axum's default of 2 MB
/// refused every update of a PDPair past about 1 MiB with 413, which the API server's
/// `failurePolicy: Fail` turned into a refused write. No more: without `webhook.clientCA` (the
/// chart's default) any pod may post one, and a body of small JSON values costs many times its
/// length parsed, against the operator's 256 MiB.
pub const MAX_REVIEW_BYTES: usize = 4 << 20;

/// The webhook router: `POST /validate/pdpairs`.
pub fn router(state: WebhookState) -> Router {
    Router::new()
        .route(names::WEBHOOK_PATH, post(handle))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_REVIEW_BYTES))
        .with_state(state)
}

#[derive(Serialize)]
struct ErrorBody {
    error: String,
}

async fn handle(State(state): State<WebhookState>, body: Bytes) -> axum::response::Response {
    let parsed: AdmissionReview<DynamicObject> = match serde_json::from_slice(&body) {
        Ok(review) => review,
        Err(e) => {
            state.metrics.admission("error", "Malformed");
            let body = ErrorBody {
                error: format!("not an AdmissionReview: {e}"),
            };
            return (StatusCode::BAD_REQUEST, axum::Json(body)).into_response();
        }
    };
    let req: AdmissionRequest<DynamicObject> = match parsed.try_into() {
        Ok(req) => req,
        Err(_) => {
            state.metrics.admission("error", "Malformed");
            let response = AdmissionResponse::invalid("the AdmissionReview carries no request");
            return axum::Json(response.into_review()).into_response();
        }
    };
    let outcome = review(&req);
    let label = if outcome.response.allowed {
        "allowed"
    } else if outcome.denial.is_some() {
        "denied"
    } else {
        "error"
    };
    state.metrics.admission(label, outcome.reason);
    if let Some(denial) = outcome.denial
        && !req.dry_run
    {
        tracing::info!(namespace = ?denial.namespace, name = %denial.name, reasons = ?denial.violations.iter().map(|v| v.reason.as_str()).collect::<Vec<_>>(), "denied PDPair");
        state.sink.denied(denial);
    }
    axum::Json(outcome.response.into_review()).into_response()
}

#[cfg(test)]
mod tests;
