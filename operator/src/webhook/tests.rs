use std::sync::{Arc, Mutex};

use axum::body::Body;
use http_body_util::BodyExt;
use kube::core::{
    DynamicObject,
    admission::{AdmissionRequest, AdmissionReview},
};
use tower::ServiceExt;

use super::*;

fn manifest(file: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(format!("{}/../examples/{file}", env!("CARGO_MANIFEST_DIR"))).expect("example");
    let yaml: serde_yaml::Value = serde_yaml::from_str(&text).expect("yaml");
    let mut v = serde_json::to_value(yaml).expect("json");
    v["metadata"]["namespace"] = "team-a".into();
    v
}

fn review_json(
    operation: &str,
    object: Option<serde_json::Value>,
    old: Option<serde_json::Value>,
    dry_run: bool,
) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "0df28fbd-5f5f-4e3a-a3fc-9f0e4dd4b5f6",
            "kind": {"group": "pdpair.dev", "version": "v1alpha1", "kind": "PDPair"},
            "resource": {"group": "pdpair.dev", "version": "v1alpha1", "resource": "pdpairs"},
            "requestKind": {"group": "pdpair.dev", "version": "v1alpha1", "kind": "PDPair"},
            "requestResource": {"group": "pdpair.dev", "version": "v1alpha1", "resource": "pdpairs"},
            "name": object.as_ref().and_then(|o| o["metadata"]["name"].as_str()).unwrap_or(""),
            "namespace": "team-a",
            "operation": operation,
            "userInfo": {"username": "alice"},
            "object": object,
            "oldObject": old,
            "dryRun": dry_run,
        }
    })
}

fn request(v: serde_json::Value) -> AdmissionRequest<DynamicObject> {
    let review: AdmissionReview<DynamicObject> = serde_json::from_value(v).expect("valid review");
    review.try_into().expect("has a request")
}

#[test]
fn compatible_pair_is_allowed() {
    let out = review(&request(review_json(
        "CREATE",
        Some(manifest("vllm-push-64-64.yaml")),
        None,
        false,
    )));
    assert!(out.response.allowed);
    assert!(out.denial.is_none());
    assert_eq!(out.response.uid, "0df28fbd-5f5f-4e3a-a3fc-9f0e4dd4b5f6");
}

#[test]
fn push_16_64_is_denied_with_every_violation_and_both_values() {
    let out = review(&request(review_json(
        "CREATE",
        Some(manifest("vllm-push-16-64.yaml")),
        None,
        false,
    )));
    assert!(!out.response.allowed);
    assert_eq!(out.reason, "KernelBlockSizeMismatch");
    let msg = &out.response.result.message;
    assert!(
        msg.contains("KernelBlockSizeMismatch spec.decode.kv.kernelBlockSize")
            && msg.contains("16")
            && msg.contains("64"),
        "{msg}"
    );
    let causes = &out.response.result.details.as_ref().expect("details").causes;
    assert_eq!(causes[0].reason, "KernelBlockSizeMismatch");
    assert_eq!(causes[0].field, "spec.decode.kv.kernelBlockSize");
    let denial = out.denial.expect("denial for the event");
    assert_eq!(
        (denial.namespace.as_deref(), denial.name.as_str()),
        (Some("team-a"), "vllm-push-16-64")
    );
    assert_eq!(denial.message, *msg);
    assert_eq!(denial.reference().kind.as_deref(), Some("PDPair"));
}

#[test]
fn update_to_incompatible_is_denied_but_spec_preserving_update_is_allowed() {
    let good = manifest("vllm-push-64-64.yaml");
    let mut bad = good.clone();
    bad["spec"]["decode"]["kv"]["blockSize"] = 16.into();
    bad["spec"]["decode"]["kv"]["kernelBlockSize"] = 16.into();
    let out = review(&request(review_json(
        "UPDATE",
        Some(bad.clone()),
        Some(good.clone()),
        false,
    )));
    assert!(!out.response.allowed);
    // Only labels changed on an object whose stored spec is already bad: not a new decision.
    let mut relabelled = bad.clone();
    relabelled["metadata"]["labels"] = serde_json::json!({"team": "a"});
    let out = review(&request(review_json("UPDATE", Some(relabelled), Some(bad), false)));
    assert!(out.response.allowed);
}

#[test]
fn object_that_is_not_a_pdpair_is_denied_naming_the_field() {
    let mut obj = manifest("vllm-push-64-64.yaml");
    obj["spec"]["prefill"]["kv"]["layers"] = "many".into();
    let out = review(&request(review_json("CREATE", Some(obj), None, false)));
    assert!(!out.response.allowed);
    assert_eq!(out.reason, "Malformed");
    assert!(
        out.response.result.message.contains("spec.prefill.kv.layers"),
        "{}",
        out.response.result.message
    );
    assert!(out.denial.is_none());
    let out = review(&request(review_json("CREATE", None, None, false)));
    assert!(!out.response.allowed);
}

#[test]
fn delete_is_allowed() {
    let out = review(&request(review_json(
        "DELETE",
        None,
        Some(manifest("vllm-push-16-64.yaml")),
        false,
    )));
    assert!(out.response.allowed);
}

#[derive(Default)]
struct Recorded(Mutex<Vec<Denial>>);

impl DenialSink for Arc<Recorded> {
    fn denied(&self, denial: Denial) {
        if let Ok(mut v) = self.0.lock() {
            v.push(denial);
        }
    }
}

fn app(recorded: &Arc<Recorded>, metrics: &Arc<Metrics>) -> Router {
    router(WebhookState {
        metrics: Arc::clone(metrics),
        sink: Arc::new(Arc::clone(recorded)),
    })
}

async fn post(app: Router, body: impl Into<Body>) -> (StatusCode, serde_json::Value) {
    let req = axum::http::Request::post(names::WEBHOOK_PATH)
        .header("content-type", "application/json")
        .body(body.into())
        .expect("request");
    let resp = app.oneshot(req).await.expect("infallible");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

#[tokio::test]
async fn an_update_of_a_large_pair_is_reviewed_not_refused_for_its_size() {
    // An UPDATE carries the object twice: a PDPair of 1.25 MiB made a 2.5 MB review, past axum's
    // default body limit (413, and the API server refused the write).
    let recorded = Arc::new(Recorded::default());
    let metrics = Arc::new(Metrics::new());
    let mut pair = manifest("vllm-push-64-64.yaml");
    pair["metadata"]["annotations"] = serde_json::json!({"example.com/big": "x".repeat(1_250_000)});
    let mut changed = pair.clone();
    changed["metadata"]["labels"] = serde_json::json!({"team": "a"});
    let review = review_json("UPDATE", Some(changed), Some(pair), false).to_string();
    assert!(review.len() > 2_500_000, "{}", review.len());
    let (status, body) = post(app(&recorded, &metrics), review).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["response"]["allowed"], true, "{body}");
}

#[tokio::test]
async fn router_answers_reviews_records_denials_and_survives_garbage() {
    let recorded = Arc::new(Recorded::default());
    let metrics = Arc::new(Metrics::new());
    let bad = review_json("CREATE", Some(manifest("vllm-push-16-64.yaml")), None, false);
    let (status, body) = post(app(&recorded, &metrics), bad.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["kind"], "AdmissionReview");
    assert_eq!(body["response"]["allowed"], false);
    assert_eq!(body["response"]["uid"], "0df28fbd-5f5f-4e3a-a3fc-9f0e4dd4b5f6");
    assert_eq!(recorded.0.lock().expect("lock").len(), 1);
    // A dry run is answered the same but records nothing.
    let dry = review_json("CREATE", Some(manifest("vllm-push-16-64.yaml")), None, true);
    let (_, body) = post(app(&recorded, &metrics), dry.to_string()).await;
    assert_eq!(body["response"]["allowed"], false);
    assert_eq!(recorded.0.lock().expect("lock").len(), 1);
    // Garbage: an error response, and the router keeps serving.
    for garbage in [
        "",
        "{",
        "null",
        "[1,2]",
        "{\"kind\":\"AdmissionReview\"}",
        "\u{0}\u{1}binary",
    ] {
        let (status, body) = post(app(&recorded, &metrics), garbage.to_owned()).await;
        assert!(
            status == StatusCode::BAD_REQUEST || body["response"]["allowed"] == false,
            "{garbage:?} got {status} {body}"
        );
    }
    let good = review_json("CREATE", Some(manifest("vllm-push-64-64.yaml")), None, false);
    let (_, body) = post(app(&recorded, &metrics), good.to_string()).await;
    assert_eq!(body["response"]["allowed"], true);
    let text = metrics.render();
    assert!(
        text.contains(
            "pdpair_operator_admission_decisions_total{outcome=\"denied\",reason=\"KernelBlockSizeMismatch\"} 2"
        ),
        "{text}"
    );
    assert!(
        text.contains("pdpair_operator_admission_decisions_total{outcome=\"allowed\",reason=\"\"} 1"),
        "{text}"
    );
    assert!(text.contains("outcome=\"error\",reason=\"Malformed\""), "{text}");
}

#[test]
fn the_event_budget_bounds_events_per_second_whatever_the_denial_rate() {
    use std::time::{Duration, Instant};
    let start = Instant::now();
    let mut budget = EventBudget::new(start);
    // 10 000 denials in the same instant: the burst, then nothing.
    let at_once = (0..10_000).filter(|_| budget.take(start)).count();
    assert_eq!(at_once, EventBudget::BURST as usize);
    // A steady flood for 10 s (1000 denials a second): the refill rate, not the flood's.
    let mut recorded = 0;
    for ms in 1..=10_000u64 {
        if budget.take(start + Duration::from_millis(ms)) {
            recorded += 1;
        }
    }
    assert_eq!(recorded, (10.0 * EventBudget::PER_SECOND) as usize);
    // After a quiet spell the burst is back, no more.
    let later = start + Duration::from_secs(3600);
    assert_eq!(
        (0..1000).filter(|_| budget.take(later)).count(),
        EventBudget::BURST as usize
    );
}

#[test]
fn a_name_no_label_can_hold_is_denied_naming_the_field() {
    let mut pair = manifest("vllm-push-64-64.yaml");
    pair["metadata"]["name"] = "p".repeat(MAX_NAME).into();
    assert!(
        review(&request(review_json("CREATE", Some(pair.clone()), None, false)))
            .response
            .allowed
    );
    pair["metadata"]["name"] = "p".repeat(MAX_NAME + 1).into();
    let out = review(&request(review_json("CREATE", Some(pair.clone()), None, false)));
    assert!(!out.response.allowed);
    assert!(
        out.response
            .result
            .message
            .contains("metadata.name makes a name of 64 characters; a PDPair's name is at most 63"),
        "{}",
        out.response.result.message
    );
    // generateName's five random characters count.
    pair["metadata"]["name"] = serde_json::Value::Null;
    pair["metadata"]["generateName"] = "g".repeat(MAX_NAME - 4).into();
    let out = review(&request(review_json("CREATE", Some(pair), None, false)));
    assert!(
        !out.response.allowed
            && out
                .response
                .result
                .message
                .contains("metadata.generateName makes a name of 64"),
        "{}",
        out.response.result.message
    );
}

#[test]
fn a_template_that_is_not_a_pod_template_is_denied_naming_where() {
    let mut pair = manifest("compatible-push.yaml");
    pair["spec"]["decode"]["template"]["spec"]["containers"][0]["env"] =
        serde_json::json!([{"name": "PORT", "value": 8000}]);
    let out = review(&request(review_json("CREATE", Some(pair.clone()), None, false)));
    assert!(!out.response.allowed);
    assert_eq!(out.reason, "Malformed");
    assert!(
        out.response
            .result
            .message
            .contains("spec.decode.template is not a pod template: spec.containers[0].env[0].value"),
        "{}",
        out.response.result.message
    );
    // Stored like that (the webhook was down): a metadata-only update goes through (a label, the
    // garbage collector removing its foregroundDeletion finalizer); a spec change does not.
    let mut finalized = pair.clone();
    finalized["metadata"]["finalizers"] = serde_json::json!(["foregroundDeletion"]);
    let out = review(&request(review_json(
        "UPDATE",
        Some(pair.clone()),
        Some(finalized),
        false,
    )));
    assert!(out.response.allowed, "{}", out.response.result.message);
    let mut changed = pair.clone();
    changed["spec"]["decode"]["replicas"] = 3.into();
    let out = review(&request(review_json("UPDATE", Some(changed), Some(pair), false)));
    assert!(!out.response.allowed);
}
