//! Publishes one PDEndpoint per registered engine that names its Pod, owned by that Pod, and
//! keeps its status current: at most one status write per endpoint per second, and a heartbeat
//! every 30 s when nothing changed. The agent writes only PDEndpoints (spec and status, field
//! manager `pdpair-agent`) and reads Pods; it never reads Secrets.

use std::{
    sync::{Arc, Weak, mpsc},
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::core::v1::Pod,
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use pdpair_api::{Failure, PDEndpoint, PDEndpointSpec, PDEndpointStatus, Rejection};

use super::{Engine, EngineStats, SeenFailure, SeenRejection};

const MANAGER: &str = "pdpair-agent";
const HEARTBEAT: Duration = Duration::from_secs(30);

/// Hands engines to the publishing thread.
#[derive(Debug, Clone)]
pub struct Publisher {
    tx: mpsc::Sender<Weak<Engine>>,
    /// Unix seconds of the last call the API server answered (0: none yet).
    api_ok: Arc<std::sync::atomic::AtomicI64>,
}

/// How often the publisher checks the API server answers, and how stale that may be for
/// `/readyz`.
const API_PROBE: Duration = Duration::from_secs(5);
const API_STALE_SECS: i64 = 30;
/// The longest one API call may take.
const API_TIMEOUT: Duration = Duration::from_secs(10);

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

struct Entry {
    engine: Weak<Engine>,
    created: bool,
    last: Option<EngineStats>,
    at: Instant,
}

impl Publisher {
    /// Starts the publishing thread with this client configuration; `node` is the agent's node.
    pub fn start(config: kube::Config, node: String) -> Result<Publisher, String> {
        let (tx, rx) = mpsc::channel::<Weak<Engine>>();
        let (runtime, client) = crate::api_client::on(&mut tokio::runtime::Builder::new_current_thread(), config)?;
        let api_ok = Arc::new(std::sync::atomic::AtomicI64::new(0));
        let ok = api_ok.clone();
        std::thread::Builder::new()
            .name("publish".into())
            .spawn(move || runtime.block_on(run(client, node, rx, ok)))
            .map_err(|e| format!("starting the publisher: {e}"))?;
        Ok(Publisher { tx, api_ok })
    }

    /// Whether the API server answered within the last 30 s (for `/readyz`).
    pub fn api_reachable(&self) -> bool {
        let at = self.api_ok.load(std::sync::atomic::Ordering::Relaxed);
        at > 0 && unix_now() - at <= API_STALE_SECS
    }

    /// Publishes this engine from now on (until it goes away).
    pub(super) fn add(&self, engine: &Arc<Engine>) {
        let _ = self.tx.send(Arc::downgrade(engine));
    }
}

async fn run(
    client: Client,
    node: String,
    rx: mpsc::Receiver<Weak<Engine>>,
    api_ok: Arc<std::sync::atomic::AtomicI64>,
) {
    let mut entries: Vec<Entry> = Vec::new();
    let mut probed: Option<Instant> = None;
    loop {
        if probed.is_none_or(|at| at.elapsed() >= API_PROBE) {
            probed = Some(Instant::now());
            match tokio::time::timeout(API_TIMEOUT, client.apiserver_version()).await {
                Ok(Ok(_)) => api_ok.store(unix_now(), std::sync::atomic::Ordering::Relaxed),
                Ok(Err(e)) => tracing::warn!(error = %e, "the API server did not answer"),
                Err(_) => tracing::warn!("the API server did not answer within {API_TIMEOUT:?}"),
            }
        }
        loop {
            match rx.try_recv() {
                Ok(engine) => entries.push(Entry {
                    engine,
                    created: false,
                    last: None,
                    at: Instant::now(),
                }),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
        entries.retain(|e| {
            e.engine
                .upgrade()
                .is_some_and(|e| !e.closed.load(std::sync::atomic::Ordering::SeqCst))
        });
        for entry in &mut entries {
            match tokio::time::timeout(API_TIMEOUT, sync(&client, &node, entry)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "publishing a PDEndpoint failed; retrying"),
                Err(_) => tracing::warn!("publishing a PDEndpoint took over {API_TIMEOUT:?}; retrying"),
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The endpoint's name: `<pod>-<engine>-<hash>`, a DNS subdomain, the Pod's name said once where
/// the engine's is it or starts with it (the test engine's is its Pod's, as `make demo` runs it:
/// `<pod>-<pod>-...`; the vLLM connector's `<pod>-<engine_id>-r<rank>`). The readable part
/// alone is not one-to-one (pod `a` with engine `b-c` and pod `a-b` with engine `c`, `X` and
/// `x`, or engine `e` and `<pod>-e` of one Pod, read the same), and an engine whose name matched
/// another's endpoint would overwrite it (its address, pair and owner): the hash of both exact
/// names keeps them apart.
pub fn endpoint_name(pod: &str, engine: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::new()
        .chain_update(pod.as_bytes())
        .chain_update([0])
        .chain_update(engine.as_bytes())
        .finalize();
    // 64 bits: finding another pair of names with the same hash takes about 2^64 tries.
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let raw = match engine.strip_prefix(pod) {
        Some(rest) if !pod.is_empty() && (rest.is_empty() || rest.len() > 1 && rest.starts_with('-')) => {
            engine.to_owned()
        }
        _ => format!("{pod}-{engine}"),
    }
    .to_lowercase();
    let cleaned: String = raw
        .chars()
        .map(|c| {
            // No dots: each dot-separated label would have to begin and end alphanumeric.
            if c.is_ascii_alphanumeric() || c == '-' { c } else { '-' }
        })
        .collect();
    let readable: String = cleaned
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .chars()
        .take(253 - 1 - hash.len())
        .collect();
    let readable = readable.trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    match readable {
        "" => hash,
        _ => format!("{readable}-{hash}"),
    }
}

/// The namespace and name of a registration's PDPair, and its Pod's name, each a Kubernetes
/// name: they go into the API server's URLs. Checked here too, not only by attestation, which
/// `--no-attest` leaves out while publishing goes on.
fn where_published(pdpair: &str, pod: &str) -> Result<(String, String), String> {
    let (namespace, name) = crate::attest::pdpair_name(pdpair)?;
    pdpair_api::check_dns1123_subdomain("pod", pod)?;
    Ok((namespace.to_owned(), name.to_owned()))
}

async fn sync(client: &Client, node: &str, entry: &mut Entry) -> Result<(), kube::Error> {
    let Some(engine) = entry.engine.upgrade() else {
        return Ok(());
    };
    let Some(pod_name) = engine.reg.pod.clone() else {
        return Ok(());
    };
    let (namespace, pair) = match where_published(&engine.reg.pdpair, &pod_name) {
        Ok(at) => at,
        Err(why) => {
            tracing::warn!(engine = %engine.reg.engine, "not publishing a PDEndpoint: {why}");
            return Ok(());
        }
    };
    let name = endpoint_name(&pod_name, &engine.reg.engine);
    let api: Api<PDEndpoint> = Api::namespaced(client.clone(), &namespace);
    if !entry.created {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        let pod = pods.get(&pod_name).await?;
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: pod_name.clone(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            ..OwnerReference::default()
        };
        let endpoint = PDEndpoint {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(namespace.clone()),
                labels: Some(
                    [
                        ("pdpair.dev/name".to_owned(), pair.clone()),
                        ("pdpair.dev/role".to_owned(), engine.reg.role.as_str().to_owned()),
                    ]
                    .into(),
                ),
                owner_references: Some(vec![owner]),
                ..ObjectMeta::default()
            },
            spec: PDEndpointSpec {
                pdpair: pair,
                role: engine.reg.role,
                pod: pod_name,
                node: node.to_owned(),
                address: engine.address.clone(),
                parallelism: engine.reg.parallelism.clone(),
                kv: engine.reg.kv.clone(),
                pool_memory: match engine.device {
                    Some(_) => pdpair_api::PoolMemory::Gpu,
                    None => pdpair_api::PoolMemory::Host,
                },
                // The engine's words, shown to whoever reads the PDEndpoint: printable and short.
                staging: engine.reg.staging.as_deref().map(crate::reason::peer_text),
                tensor_rank: i32::try_from(engine.reg.tensor_rank).ok(),
                instance: engine.reg.instance.clone(),
                pod_engines: engine.reg.pod_engines.and_then(|n| i32::try_from(n).ok()),
            }
            .bounded(),
            status: None,
        };
        api.patch(&name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(&endpoint))
            .await?;
        entry.created = true;
        tracing::info!(endpoint = %name, %namespace, "published a PDEndpoint");
    }
    let stats = engine.stats();
    if entry.last.as_ref() == Some(&stats) && entry.at.elapsed() < HEARTBEAT {
        return Ok(());
    }
    let status = status_of(&stats);
    let body = serde_json::json!({ "apiVersion": "pdpair.dev/v1alpha1", "kind": "PDEndpoint", "status": status });
    if let Err(e) = api
        .patch_status(&name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(&body))
        .await
    {
        if matches!(&e, kube::Error::Api(s) if s.code == 404) {
            // Deleted meanwhile (by hand, say) while its engine lives: made again at the next
            // round (its status was patched into nothing for good, and the operator took the
            // engine for gone).
            entry.created = false;
        }
        return Err(e);
    }
    entry.last = Some(stats);
    entry.at = Instant::now();
    Ok(())
}

/// A Kubernetes time from unix seconds.
fn unix_time(at: i64) -> Time {
    Time(Timestamp::from_second(at).unwrap_or(Timestamp::UNIX_EPOCH))
}

/// The PDEndpoint status of what an engine's agent observed (cut to what the CRD takes).
fn status_of(stats: &EngineStats) -> PDEndpointStatus {
    let rejection = |r: &SeenRejection| Rejection {
        time: unix_time(r.at),
        peer: r.peer.clone(),
        reasons: crate::reason::names(&r.reasons),
        message: r.message.clone(),
        resolved: r.resolved.map(unix_time),
    };
    let failure = |f: &SeenFailure| Failure {
        time: unix_time(f.at),
        reasons: crate::reason::names(&f.reasons),
        message: f.message.clone(),
        peer: f.peer.clone(),
        resolved: f.resolved.map(unix_time),
    };
    PDEndpointStatus {
        counters: stats.counters.clone(),
        last_rejection: stats.last_rejection.as_ref().map(rejection),
        last_success: stats.last_success.map(unix_time),
        last_failure: stats.last_failure.as_ref().map(failure),
        earlier_rejections: stats.earlier_rejections.iter().map(rejection).collect(),
        earlier_failures: stats.earlier_failures.iter().map(failure).collect(),
        paths: stats.paths.clone(),
        last_heartbeat: Some(Time(Timestamp::now())),
        registered: Some(unix_time(stats.registered)),
    }
    .bounded()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engines_earlier_news_is_published_beside_its_last() {
        use crate::reason::Reason;
        let failure = |at: i64, peer: &str| SeenFailure {
            at,
            reasons: vec![Reason::ChecksumMismatch],
            message: format!("with {peer}"),
            peer: Some(peer.to_owned()),
            resolved: None,
        };
        let rejection = |at: i64, peer: &str| SeenRejection {
            at,
            peer: peer.to_owned(),
            reasons: vec![Reason::Unauthenticated],
            message: format!("by {peer}"),
            resolved: Some(at + 1),
        };
        let stats = EngineStats {
            last_failure: Some(failure(20, "10.0.0.1:7000")),
            earlier_failures: vec![failure(10, "10.0.0.2:7000"), failure(11, "10.0.0.3:7000")],
            last_rejection: Some(rejection(21, "10.0.0.4:7000")),
            earlier_rejections: vec![rejection(12, "10.0.0.5:7000")],
            ..EngineStats::default()
        };
        let status = status_of(&stats);
        let failures: Vec<_> = status
            .failures()
            .map(|f| (f.time.0.as_second(), f.peer.clone(), f.reasons.clone()))
            .collect();
        let named = |peer: &str| Some(peer.to_owned());
        assert_eq!(
            failures,
            [
                (20, named("10.0.0.1:7000"), vec!["ChecksumMismatch".to_owned()]),
                (11, named("10.0.0.3:7000"), vec!["ChecksumMismatch".to_owned()]),
                (10, named("10.0.0.2:7000"), vec!["ChecksumMismatch".to_owned()]),
            ],
            "the last, then the earlier ones newest first"
        );
        let rejections: Vec<_> = status
            .rejections()
            .map(|r| (r.peer.as_str(), r.resolved.as_ref().map(|t| t.0.as_second())))
            .collect();
        assert_eq!(rejections, [("10.0.0.4:7000", Some(22)), ("10.0.0.5:7000", Some(13))]);
    }

    #[test]
    fn endpoint_names_are_dns_subdomains_and_one_to_one() {
        let name = endpoint_name("llama-decode-7f9c-abcde", "decode-0");
        assert!(name.starts_with("llama-decode-7f9c-abcde-decode-0-"), "{name}");
        assert!(endpoint_name("Pod_A", "rank:1").starts_with("pod-a-rank-1-"));
        // The Pod's name once where the engine's starts with it (the vLLM connector's names).
        let vllm = endpoint_name("decode-7f9c-abcde", "decode-7f9c-abcde-3a1f_dp0-r1");
        assert!(vllm.starts_with("decode-7f9c-abcde-3a1f-dp0-r1-"), "{vllm}");
        assert!(endpoint_name("p", "p-").starts_with("p-p-"));
        let demo = endpoint_name("prefill-7f9c-abcde", "prefill-7f9c-abcde");
        assert_eq!(demo.len(), "prefill-7f9c-abcde-".len() + 16, "{demo}");
        // Names that read the same stay apart.
        for (a, b) in [
            (("a", "b-c"), ("a-b", "c")),
            (("pod", "X"), ("pod", "x")),
            (("pod", "e_1"), ("pod", "e-1")),
            (("p", &"e".repeat(300)), ("p", &"e".repeat(301))),
            (("pod", "e"), ("pod", "pod-e")),
            (("pod", "pod"), ("pod", "pod-pod")),
        ] {
            assert_ne!(endpoint_name(a.0, a.1), endpoint_name(b.0, b.1), "{a:?} and {b:?}");
        }
        for (pod, engine) in [("p", &"e".repeat(400)[..]), ("-", "_"), ("Pod.", ".x.")] {
            let name = endpoint_name(pod, engine);
            assert!(name.len() <= 253, "{name}");
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{name}"
            );
            assert!(name.starts_with(|c: char| c.is_ascii_alphanumeric()), "{name}");
            assert!(name.ends_with(|c: char| c.is_ascii_alphanumeric()), "{name}");
        }
        assert_eq!(
            where_published("team-a/llama", "vllm-0"),
            Ok(("team-a".to_owned(), "llama".to_owned()))
        );
        assert_eq!(
            where_published("llama", "vllm-0"),
            Ok(("default".to_owned(), "llama".to_owned()))
        );
        // With --no-attest nothing else checks them before they go into a URL.
        for (pdpair, pod) in [("victim/../x", "p"), ("team-a/llama", "../../x/pods/p"), ("a/b/c", "p")] {
            assert!(where_published(pdpair, pod).is_err(), "{pdpair} {pod}");
        }
    }
}
