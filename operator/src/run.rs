//! `pdpair-operator run`: the webhook on every replica, the controller on the Lease holder, and
//! the admin port. This module only wires the parts together.

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context as _;
use k8s_openapi::api::coordination::v1::Lease;
use kube::{
    Api, Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
};
use pdpair_api::ListenAddr;
use tokio::{net::TcpListener, sync::watch};

use crate::{
    admin::{self, Health},
    controller::{self, Setup},
    events::{Kind, Publisher},
    install::{self, WebhookTarget},
    lease::{self, LeaseConfig},
    metrics::Metrics,
    names, tls,
    webhook::{self, Denial, DenialSink, WebhookState},
};

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Options of `pdpair-operator run`.
#[derive(Clone, Debug, clap::Args)]
pub struct RunOptions {
    /// Kubeconfig to use (local mode); in a cluster the service account is used.
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Address the HTTPS admission webhook listens on: HOST:PORT, or :PORT for every address
    /// (IPv6 and IPv4).
    #[arg(long, default_value = ":9443", value_name = "ADDR")]
    pub webhook_bind: ListenAddr,
    /// Base URL at which the API server reaches the webhook, e.g. https://127.0.0.1:9443 (local
    /// mode); the operator appends its own paths.
    #[arg(long, value_name = "URL")]
    pub webhook_url: Option<String>,
    /// Address of the plain-HTTP admin port (/metrics, /livez, /readyz): HOST:PORT or :PORT.
    #[arg(long, default_value = ":8080", value_name = "ADDR")]
    pub admin_bind: ListenAddr,
    /// Apply the CRDs and a ValidatingWebhookConfiguration pointing at --webhook-url.
    #[arg(long, requires = "webhook_url")]
    pub install: bool,
    /// Serving certificate (PEM); reloaded when it changes. Without it, one is generated.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// CA bundle for --install when --tls-cert is given.
    #[arg(long, value_name = "FILE")]
    pub webhook_ca: Option<PathBuf>,
    /// Serve the webhook only to callers presenting a client certificate signed by a CA in this
    /// file (PEM): the API server, configured to present one (docs/operations.md). Without it
    /// anyone who reaches the port may send AdmissionReviews.
    #[arg(long, value_name = "FILE")]
    pub webhook_client_ca: Option<PathBuf>,
    /// Where generated certificates are written.
    #[arg(long, value_name = "DIR")]
    pub cert_dir: Option<PathBuf>,
    /// Watch and reconcile only the PDPairs of these namespaces (repeat the flag, or separate
    /// with commas), each with watches of its own: the operator then needs its rights only
    /// there (the chart's `operator.watchNamespaces` binds them by RoleBindings). Unset: every
    /// namespace. The webhook validates PDPairs in every namespace either way.
    #[arg(long = "namespace", value_name = "NS", value_delimiter = ',')]
    pub namespaces: Vec<String>,
    /// Namespace of the leader Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub lease_namespace: String,
    /// This replica's identity in the Lease and in Events.
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// How long the leader Lease lasts without renewal: 2s to 5m.
    #[arg(long, default_value = "15s", value_parser = lease_duration)]
    pub lease_duration: pdpair_api::Duration,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// The group owning the node agents' engine socket (the chart's `agent.socketGroup`): engine
    /// pods the operator renders join it (`fsGroup`, or a supplemental group when the template
    /// sets another fsGroup). 0: none is added.
    #[arg(
        long = "agent-socket-group",
        env = "PDPAIR_AGENT_SOCKET_GROUP",
        default_value_t = 0,
        value_name = "GID"
    )]
    pub agent_socket_group: u32,
    /// The node agents' engine socket directory on the node (the chart's `agent.socketDir`):
    /// engine pods mount it (at /var/run/pdpair, where `PDPAIR_AGENT_SOCKET` points).
    #[arg(
        long = "agent-socket-dir",
        env = "PDPAIR_AGENT_SOCKET_DIR",
        default_value = crate::names::AGENT_SOCKET_DIR,
        value_name = "DIR",
        value_parser = absolute_dir
    )]
    pub agent_socket_dir: String,
}

/// An absolute directory path, normalised without a trailing slash.
fn absolute_dir(s: &str) -> Result<String, String> {
    let trimmed = s.trim_end_matches('/');
    if !s.starts_with('/') || trimmed.is_empty() || s.split('/').any(|p| p == "..") {
        return Err(format!(
            "{s:?} is not an absolute directory path (a host path engine pods mount)"
        ));
    }
    Ok(trimmed.to_owned())
}

/// Sets up tracing: `RUST_LOG` filters (default info), text or JSON lines on stderr.
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

struct EventSink {
    publisher: Publisher,
    budget: std::sync::Mutex<webhook::EventBudget>,
    metrics: Arc<Metrics>,
}

impl DenialSink for EventSink {
    fn denied(&self, denial: Denial) {
        let allowed = self
            .budget
            .lock()
            .map(|mut b| b.take(std::time::Instant::now()))
            .unwrap_or(false);
        if !allowed {
            self.metrics.event_dropped();
            tracing::debug!("a denial's Event was not recorded: over the Event budget");
            return;
        }
        let publisher = self.publisher.clone();
        tokio::spawn(async move {
            let reference = denial.reference();
            publisher
                .publish(
                    &reference,
                    Kind::Warning,
                    names::reasons::REJECTED,
                    "Admit",
                    &denial.message,
                )
                .await;
        });
    }
}

fn identity(opts: &RunOptions) -> String {
    opts.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "localhost".into());
        format!("{}-{}", host.trim(), std::process::id())
    })
}

async fn client(opts: &RunOptions) -> anyhow::Result<Client> {
    let config = match &opts.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))?
        }
        None => Config::infer().await.context("finding cluster credentials")?,
    };
    Client::try_from(config).context("building the Kubernetes client")
}

/// Certificate files and the CA to install, generated when none were given.
fn certificates(opts: &RunOptions, identity: &str) -> anyhow::Result<(PathBuf, PathBuf, Option<String>)> {
    if let (Some(cert), Some(key)) = (&opts.tls_cert, &opts.tls_key) {
        let ca = match &opts.webhook_ca {
            Some(path) => Some(std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?),
            None => None,
        };
        return Ok((cert.clone(), key.clone(), ca));
    }
    let dir = opts
        .cert_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("pdpair-operator-{identity}")));
    let mut hosts = vec!["127.0.0.1".to_owned(), "localhost".to_owned()];
    if let Some(host) = opts.webhook_url.as_deref().and_then(url_host) {
        hosts.push(host);
    }
    hosts.sort();
    hosts.dedup();
    let files = tls::generate(&dir, &hosts)?;
    tracing::info!(dir = %dir.display(), ?hosts, "generated a webhook certificate");
    Ok((files.cert, files.key, Some(files.ca_pem)))
}

/// The host of an https URL, without brackets or port.
fn url_host(url: &str) -> Option<String> {
    let rest = url.strip_prefix("https://")?;
    let authority = rest.split('/').next()?;
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next()?
    } else {
        authority.rsplit_once(':').map_or(authority, |(h, _)| h)
    };
    (!host.is_empty()).then(|| host.to_owned())
}

/// Runs until a signal (Ok) or a fatal error: a lost Lease, a server that stopped.
pub async fn run(opts: RunOptions) -> anyhow::Result<()> {
    let identity = identity(&opts);
    if let Some(url) = &opts.webhook_url
        && url_host(url).is_none()
    {
        anyhow::bail!("--webhook-url {url:?} must be an https:// URL with a host");
    }
    let client = client(&opts).await?;
    let metrics = Arc::new(Metrics::new());
    let tls_metrics = Arc::clone(&metrics);
    let scopes = scopes(&opts.namespaces)?;
    let health = Arc::new(Health::new(scopes.len(), Arc::clone(&metrics)));

    let clients = match &opts.webhook_client_ca {
        Some(file) => {
            let ca = tls::ClientCa::new(file.clone()).context("--webhook-client-ca")?;
            tokio::spawn(Arc::clone(&ca).watch(Duration::from_secs(1)));
            Some(ca)
        }
        None => {
            tracing::warn!(
                "the webhook serves any caller that reaches it (no --webhook-client-ca): forged reviews can record Rejected Events"
            );
            None
        }
    };
    let (cert, key, ca) = certificates(&opts, &identity)?;
    let reloader = tls::Reloader::new(cert, key).context("loading the webhook certificate")?;
    health.tls_loaded.store(true, std::sync::atomic::Ordering::SeqCst);
    tokio::spawn(Arc::clone(&reloader).watch(Duration::from_secs(1)));

    if opts.install {
        let url = opts.webhook_url.clone().unwrap_or_default();
        let ca = ca.context("--install with --tls-cert needs --webhook-ca")?;
        install::install(&client, &WebhookTarget::Url(url), &ca).await?;
    }

    let webhook_listener =
        listen(opts.webhook_bind).with_context(|| format!("binding the webhook to {}", opts.webhook_bind))?;
    let admin_listener =
        listen(opts.admin_bind).with_context(|| format!("binding the admin port to {}", opts.admin_bind))?;
    tracing::info!(webhook = %opts.webhook_bind, admin = %opts.admin_bind, %identity, "serving");

    let events = Publisher::new(client.clone(), identity.clone());
    let sink: Arc<dyn DenialSink> = Arc::new(EventSink {
        publisher: events.clone(),
        budget: std::sync::Mutex::new(webhook::EventBudget::new(std::time::Instant::now())),
        metrics: Arc::clone(&metrics),
    });
    let webhook_router = webhook::router(WebhookState {
        metrics: Arc::clone(&metrics),
        sink,
    });
    let admin_router = admin::router(Arc::clone(&health), Arc::clone(&metrics));

    let (leader_tx, leader_rx) = watch::channel(false);
    let lease_api: Api<Lease> = Api::namespaced(client.clone(), &opts.lease_namespace);
    let lease_cfg = LeaseConfig {
        name: names::LEASE_NAME.into(),
        identity: identity.clone(),
        duration: opts.lease_duration.get(),
        renew_every: (opts.lease_duration.get() / 3).max(Duration::from_millis(500)),
    };
    let leader_metrics = Arc::clone(&metrics);
    let mut leader_watch = leader_rx.clone();
    tokio::spawn(async move {
        loop {
            leader_metrics.set_leader(*leader_watch.borrow_and_update());
            if leader_watch.changed().await.is_err() {
                break;
            }
        }
    });

    let setup = Setup {
        client,
        leader: leader_rx,
        metrics,
        events,
        wiring: crate::plan::Wiring {
            socket_group: (opts.agent_socket_group != 0).then_some(i64::from(opts.agent_socket_group)),
            socket_dir: Some(opts.agent_socket_dir.clone()),
        },
        namespace: None,
    };
    let (controllers, synced): (Vec<_>, Vec<_>) = scopes
        .into_iter()
        .map(|namespace| {
            let scope = namespace.clone();
            let (run, synced) = controller::controller(Setup {
                namespace,
                ..setup.clone()
            });
            (run, (scope, synced))
        })
        .unzip();
    // Any one stopping stops the operator, as the one controller's did.
    let controller = futures::FutureExt::map(futures::future::select_all(controllers.into_iter().map(Box::pin)), drop);
    // Each scope's first lists, told (not waited for: the webhook is ready without them, and
    // a leader reconciles a scope only once its own caches have listed).
    for (scope, synced) in synced {
        let health = Arc::clone(&health);
        let scope = scope.unwrap_or_else(|| "(all namespaces)".into());
        tokio::spawn(async move {
            tokio::pin!(synced);
            let late = tokio::time::sleep(SYNC_WARNING);
            tokio::select! {
                () = &mut synced => {}
                () = late => {
                    tracing::warn!(namespace = %scope, after = ?SYNC_WARNING, "this namespace's watches have not listed yet: its PDPairs are not reconciled (does it exist, and may the operator list there?)");
                    synced.await;
                }
            }
            tracing::info!(namespace = %scope, "watches synced");
            if health.scope_synced() == 0 {
                tracing::info!("every watch synced");
            }
        });
    }

    let lease_task = lease::run(lease_api.clone(), lease_cfg.clone(), leader_tx);
    let result = tokio::select! {
        r = tls::serve(webhook_listener, reloader, clients, webhook_router, tls_metrics) => r.map_err(anyhow::Error::from).context("the webhook server stopped"),
        r = crate::server::serve_plain(admin_listener, admin_router) => r.map_err(anyhow::Error::from).context("the admin server stopped"),
        lost = lease_task => Err(anyhow::Error::from(lost)),
        () = controller => Err(anyhow::anyhow!("the controller stopped")),
        () = shutdown_signal() => {
            tracing::info!("shutting down");
            Ok(())
        }
    };
    lease::release(&lease_api, &lease_cfg).await;
    result
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// The namespaces one controller each watches: every namespace (`None`) when none is given;
/// each given one once, and each a namespace's name (an empty one would watch every namespace
/// through a malformed URL, one named twice would be reconciled twice).
fn scopes(namespaces: &[String]) -> anyhow::Result<Vec<Option<String>>> {
    if namespaces.is_empty() {
        return Ok(vec![None]);
    }
    let mut seen = std::collections::BTreeSet::new();
    for ns in namespaces {
        pdpair_api::check_dns1123_label("--namespace", ns).map_err(anyhow::Error::msg)?;
        anyhow::ensure!(seen.insert(ns.clone()), "--namespace names {ns:?} twice");
    }
    Ok(seen.into_iter().map(Some).collect())
}

/// How long a scope's watches may take to list before a warning names its namespace.
const SYNC_WARNING: Duration = Duration::from_secs(60);

/// A tokio listener at `addr`.
fn listen(addr: ListenAddr) -> std::io::Result<TcpListener> {
    let listener = addr.bind()?;
    listener.set_nonblocking(true)?;
    TcpListener::from_std(listener)
}

/// `--lease-duration`, 2 s to 5 min: shorter, one slow answer of the API server makes the
/// leader give up the Lease (it is renewed every third of it, and lost when a renewal fails for
/// that long); longer, a leader that died without releasing it holds it (nothing reconciled)
/// that long.
fn lease_duration(text: &str) -> Result<pdpair_api::Duration, String> {
    let d: pdpair_api::Duration = text.parse().map_err(|e| format!("{e}"))?;
    if !(Duration::from_secs(2)..=Duration::from_secs(300)).contains(&d.get()) {
        return Err(format!(
            "{text} is outside 2s to 5m: shorter, one slow API server answer makes the leader give up; longer, a dead leader holds the Lease that long"
        ));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_lease_duration_outside_2s_to_5m_is_refused_naming_it() {
        for ok in ["2s", "15s", "1m30s", "5m"] {
            assert_eq!(super::lease_duration(ok).expect(ok).as_str(), ok);
        }
        for bad in ["0s", "1999ms", "5m1ms", "1h"] {
            let e = super::lease_duration(bad).expect_err(bad);
            assert!(e.contains(bad) && e.contains("outside 2s to 5m"), "{e}");
        }
        assert!(super::lease_duration("soon").is_err());
    }

    #[test]
    fn namespaces_are_each_watched_once_and_must_be_namespace_names() {
        assert_eq!(super::scopes(&[]).expect("all"), vec![None]);
        let two = ["b".to_owned(), "team-a".to_owned()];
        assert_eq!(
            super::scopes(&two).expect("two"),
            vec![Some("b".to_owned()), Some("team-a".to_owned())]
        );
        for (bad, why) in [
            (vec!["a", "a"], "names \"a\" twice"),
            (vec![""], "--namespace \"\" is not a Kubernetes name (DNS-1123 label"),
            (vec!["Team"], "\"Team\" is not"),
            (vec!["a/b"], "\"a/b\" is not"),
        ] {
            let names: Vec<String> = bad.iter().map(|s| (*s).to_owned()).collect();
            let e = super::scopes(&names).expect_err(why).to_string();
            assert!(e.contains(why), "{e}");
        }
    }

    use super::url_host;

    #[test]
    fn url_host_handles_ip_dns_and_v6() {
        assert_eq!(url_host("https://127.0.0.1:9443").as_deref(), Some("127.0.0.1"));
        assert_eq!(
            url_host("https://pdpair.example.com/base").as_deref(),
            Some("pdpair.example.com")
        );
        assert_eq!(url_host("https://[::1]:9443").as_deref(), Some("::1"));
        assert_eq!(url_host("http://127.0.0.1:9443"), None);
        assert_eq!(url_host("https://"), None);
    }
}
