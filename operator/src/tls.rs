//! The webhook's TLS: certificates generated for local mode, loaded from files, and reloaded
//! when the files change, without a restart (cert-manager and the chart rotate them in place).

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::Duration,
};

use axum::Router;
use rustls::{
    RootCertStore, ServerConfig,
    crypto::ring as provider,
    server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier, danger::ClientCertVerifier},
    sign::CertifiedKey,
};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// TLS errors; messages name the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The PEM did not hold a usable certificate or key.
    #[error("{path}: {message}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Certificate generation failed.
    #[error("generating the webhook certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// Files of a generated certificate set.
#[derive(Clone, Debug)]
pub struct CertFiles {
    /// The serving certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA that signed it (PEM), for the webhook configuration's caBundle.
    pub ca_pem: String,
}

/// Generates a CA and a serving certificate for `hosts` (IP addresses or DNS names) into `dir`.
pub fn generate(dir: &Path, hosts: &[String]) -> Result<CertFiles, TlsError> {
    let io = |action, path: &Path| {
        let path = path.to_path_buf();
        move |source| TlsError::Io { action, path, source }
    };
    std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
    let ca_key = rcgen::KeyPair::generate()?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "pdpair-operator webhook CA");
    ca_params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key)?;
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "pdpair-operator webhook");
    for host in hosts {
        let san = match host.parse::<IpAddr>() {
            Ok(ip) => rcgen::SanType::IpAddress(ip),
            Err(_) => rcgen::SanType::DnsName(host.clone().try_into()?),
        };
        params.subject_alt_names.push(san);
    }
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &ca)?;
    let files = CertFiles {
        cert: dir.join("tls.crt"),
        key: dir.join("tls.key"),
        ca_pem: ca.pem(),
    };
    // Key first, then certificate: a reloader that sees the new certificate finds its key.
    write_private(&files.key, &key.serialize_pem()).map_err(io("writing", &files.key))?;
    std::fs::write(&files.cert, cert.pem()).map_err(io("writing", &files.cert))?;
    let ca_path = dir.join("ca.crt");
    std::fs::write(&ca_path, &files.ca_pem).map_err(io("writing", &ca_path))?;
    Ok(files)
}

fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(text.as_bytes())?;
    std::fs::rename(tmp, path)
}

/// Reads a certificate chain and key into a rustls CertifiedKey.
pub fn load(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let (cert_pem, key_pem) = read_pair(cert, key)?;
    parse(cert, key, &cert_pem, &key_pem)
}

/// The bytes of the certificate and key files.
fn read_pair(cert: &Path, key: &Path) -> Result<(Vec<u8>, Vec<u8>), TlsError> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Io {
            action: "reading",
            path: path.to_path_buf(),
            source,
        })
    };
    Ok((read(cert)?, read(key)?))
}

/// A certificate chain and key (the PEM bytes of the files `cert` and `key`, named in errors)
/// into a rustls CertifiedKey.
fn parse(cert: &Path, key: &Path, cert_pem: &[u8], key_pem: &[u8]) -> Result<CertifiedKey, TlsError> {
    let chain: Vec<_> = rustls_pemfile::certs(&mut &cert_pem[..])
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Pem {
            path: cert.to_path_buf(),
            message: e.to_string(),
        })?;
    if chain.is_empty() {
        return Err(TlsError::Pem {
            path: cert.to_path_buf(),
            message: "no CERTIFICATE block".into(),
        });
    }
    let private = rustls_pemfile::private_key(&mut &key_pem[..])
        .map_err(|e| TlsError::Pem {
            path: key.to_path_buf(),
            message: e.to_string(),
        })?
        .ok_or_else(|| TlsError::Pem {
            path: key.to_path_buf(),
            message: "no PRIVATE KEY block".into(),
        })?;
    let signing = provider::sign::any_supported_type(&private).map_err(|e| TlsError::Pem {
        path: key.to_path_buf(),
        message: e.to_string(),
    })?;
    let certified = CertifiedKey::new(chain, signing);
    // A key from another pair (a rotation caught between its two writes, or files copied by
    // hand one at a time) would load and then fail every handshake: refuse it, so the last
    // good pair stays.
    // (A key whose public half rustls cannot tell is taken as before, as rustls itself does.)
    match certified.keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => Ok(certified),
        Err(e) => Err(TlsError::Pem {
            path: key.to_path_buf(),
            message: format!("not the key of the certificate in {}: {e}", cert.display()),
        }),
    }
}

/// Serves the certificate currently on disk; [`Reloader::watch`] swaps it when the files change.
#[derive(Debug)]
pub struct Reloader {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
    /// The files' bytes served (compared, not their mtimes: a rotation that keeps mtimes, as
    /// some volume mounts do, is still seen).
    stamp: RwLock<Vec<u8>>,
    /// The files' bytes last found unusable: tried and warned about once, not every poll.
    broken: RwLock<Vec<u8>>,
}

/// What [`Reloader::reload_if_changed`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reload {
    /// The files are the ones served, or the broken ones already warned about.
    Unchanged,
    /// New files, loaded and served from now.
    Reloaded,
    /// New files that cannot be loaded (warned about): the last good pair is kept.
    Broken,
}

impl Reloader {
    /// Loads the files once; fails when they are not usable.
    pub fn new(cert: PathBuf, key: PathBuf) -> Result<Arc<Reloader>, TlsError> {
        let (cert_pem, key_pem) = read_pair(&cert, &key)?;
        let loaded = parse(&cert, &key, &cert_pem, &key_pem)?;
        let stamp = [cert_pem, key_pem].concat();
        Ok(Arc::new(Reloader {
            cert,
            key,
            current: RwLock::new(Arc::new(loaded)),
            stamp: RwLock::new(stamp),
            broken: RwLock::new(Vec::new()),
        }))
    }

    /// Reloads when the files' contents changed. A broken new pair is logged once (it was
    /// warned about every poll, every second, until fixed) and the old one is kept, so a
    /// half-written rotation never takes the webhook down.
    /// The bytes compared are the bytes parsed (a good pair read once and failing to read
    /// again was taken for a broken one, and never tried again until the files changed).
    pub fn reload_if_changed(&self) -> Reload {
        let files = read_pair(&self.cert, &self.key);
        // Files that cannot be read are one broken content, warned about once until readable.
        let now = files
            .as_ref()
            .map(|(c, k)| [c.as_slice(), k].concat())
            .unwrap_or_default();
        if self.stamp.read().is_ok_and(|s| *s == now) || self.broken.read().is_ok_and(|b| *b == now) {
            return Reload::Unchanged;
        }
        match files.and_then(|(c, k)| parse(&self.cert, &self.key, &c, &k)) {
            Ok(loaded) => {
                if let (Ok(mut cur), Ok(mut st)) = (self.current.write(), self.stamp.write()) {
                    *cur = Arc::new(loaded);
                    *st = now;
                }
                tracing::info!(cert = %self.cert.display(), "reloaded the webhook certificate");
                Reload::Reloaded
            }
            Err(e) => {
                if let Ok(mut b) = self.broken.write() {
                    *b = now;
                }
                tracing::warn!(error = %e, "the webhook certificate changed but cannot be loaded; keeping the old one");
                Reload::Broken
            }
        }
    }

    /// Polls the files every `every`, forever.
    pub async fn watch(self: Arc<Self>, every: Duration) {
        every_tick(every, || {
            self.reload_if_changed();
        })
        .await
    }
}

/// Runs `reload` every `every`, forever (the certificate's and the client CAs' watches).
async fn every_tick(every: Duration, reload: impl Fn()) {
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        reload();
    }
}

impl ResolvesServerCert for Reloader {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok().map(|c| Arc::clone(&c))
    }
}

/// Who may call the webhook, from `--webhook-client-ca`: only callers presenting a certificate
/// for client authentication signed by one of the file's CAs (the API server, given one in its
/// `WebhookAdmissionConfiguration`). Anyone who can reach the port could otherwise send forged
/// AdmissionReviews, each denial of which records a `Rejected` Event on whatever PDPair name
/// and namespace it names. `Err` names the file when it holds no usable CA certificate.
pub fn client_verifier(ca: &Path) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    let pem = std::fs::read(ca).map_err(|source| TlsError::Io {
        action: "reading",
        path: ca.to_path_buf(),
        source,
    })?;
    verifier_of(ca, &pem)
}

/// [`client_verifier`] of `pem`, read from `ca`.
fn verifier_of(ca: &Path, pem: &[u8]) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    let bad = |message: String| TlsError::Pem {
        path: ca.to_path_buf(),
        message,
    };
    let mut roots = RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut &*pem) {
        let cert = cert.map_err(|e| bad(e.to_string()))?;
        roots
            .add(cert)
            .map_err(|e| bad(format!("not a usable CA certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(bad("no CERTIFICATE block: the webhook would accept no caller".into()));
    }
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::new(provider::default_provider()))
        .build()
        .map_err(|e| bad(e.to_string()))
}

/// The webhook callers' CAs, from `--webhook-client-ca`, read again when the file changes (a
/// ConfigMap update, a rotation by hand): a CA added is trusted, and one removed no longer, for
/// connections accepted from then on, without a restart. A changed file that holds no usable CA
/// (half written, emptied) is logged and the last good CAs are kept.
#[derive(Debug)]
pub struct ClientCa {
    path: PathBuf,
    stamp: RwLock<Vec<u8>>,
    current: RwLock<Arc<dyn ClientCertVerifier>>,
}

impl ClientCa {
    /// Reads the file once; fails, naming it, when it holds no usable CA ([`client_verifier`]).
    pub fn new(path: PathBuf) -> Result<Arc<ClientCa>, TlsError> {
        let stamp = std::fs::read(&path).map_err(|source| TlsError::Io {
            action: "reading",
            path: path.clone(),
            source,
        })?;
        let verifier = verifier_of(&path, &stamp)?;
        Ok(Arc::new(ClientCa {
            path,
            stamp: RwLock::new(stamp),
            current: RwLock::new(verifier),
        }))
    }

    /// The verifier for the CAs read last.
    pub fn current(&self) -> Arc<dyn ClientCertVerifier> {
        match self.current.read() {
            Ok(v) => Arc::clone(&v),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// Reads the file again when its bytes changed; returns whether the CAs changed.
    pub fn reload_if_changed(&self) -> bool {
        let now = std::fs::read(&self.path).unwrap_or_default();
        if self.stamp.read().is_ok_and(|s| *s == now) {
            return false;
        }
        // The bytes compared are the bytes used (a file still being written is read whole next
        // time it changes), and seen once, usable or not: a broken file is warned about once.
        let verifier = verifier_of(&self.path, &now);
        if let Ok(mut s) = self.stamp.write() {
            *s = now;
        }
        match verifier {
            Ok(verifier) => {
                if let Ok(mut cur) = self.current.write() {
                    *cur = verifier;
                }
                tracing::info!(ca = %self.path.display(), "reloaded the webhook's client CAs");
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "the webhook's client CA file changed but holds no usable CA; keeping the last good one");
                false
            }
        }
    }

    /// Polls the file every `every`, forever.
    pub async fn watch(self: Arc<Self>, every: Duration) {
        every_tick(every, || {
            self.reload_if_changed();
        })
        .await
    }
}

/// The webhook's TLS settings: `resolver`'s certificate; with `clients`, callers must present a
/// certificate it accepts.
fn acceptor(resolver: &Arc<Reloader>, clients: Option<Arc<dyn ClientCertVerifier>>) -> Result<TlsAcceptor, TlsError> {
    let builder = ServerConfig::builder_with_provider(Arc::new(provider::default_provider()))
        .with_safe_default_protocol_versions()?;
    let builder = match clients {
        Some(verifier) => builder.with_client_cert_verifier(verifier),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(Arc::clone(resolver) as Arc<dyn ResolvesServerCert>);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Serves `router` over TLS on `listener` until the process ends; with `clients`, only to
/// callers holding a certificate of its CAs as they are when each connection is accepted
/// ([`ClientCa`]). Each failed handshake is counted in `metrics`.
pub async fn serve(
    listener: TcpListener,
    resolver: Arc<Reloader>,
    clients: Option<Arc<ClientCa>>,
    router: Router,
    metrics: Arc<crate::metrics::Metrics>,
) -> Result<(), TlsError> {
    let mut built_with = clients.as_ref().map(|c| c.current());
    let mut acceptor = acceptor(&resolver, built_with.clone())?;
    let limits = crate::server::Limits::default();
    loop {
        // The connection budget is taken before the TLS handshake: a flood of handshakes holds
        // at most MAX_CONNECTIONS slots, each for at most 10 s.
        let (tcp, peer, permit) = limits.accept(&listener, "webhook").await;
        // The CAs as they are now: built again only when they changed.
        let now = clients.as_ref().map(|c| c.current());
        let changed = match (&now, &built_with) {
            (Some(a), Some(b)) => !Arc::ptr_eq(a, b),
            _ => false,
        };
        if changed {
            match self::acceptor(&resolver, now.clone()) {
                Ok(a) => (acceptor, built_with) = (a, now),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot build the webhook's TLS settings for the new client CAs; keeping the last")
                }
            }
        }
        let acceptor = acceptor.clone();
        let router = router.clone();
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let handshake = tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp));
            let handshake = tokio::select! {
                done = handshake => done,
                // Closed for another address's connection before its handshake ended.
                () = permit.evicted() => return,
            };
            let tls = match handshake {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    metrics.webhook_tls_failed();
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    metrics.webhook_tls_failed();
                    return;
                }
            };
            crate::server::serve_connection(tls, router, permit).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf_der(r: &Reloader) -> Vec<u8> {
        r.current
            .read()
            .expect("lock")
            .cert
            .first()
            .map(|c| c.as_ref().to_vec())
            .expect("a certificate")
    }

    #[test]
    fn reloads_a_rotated_certificate_and_keeps_the_old_one_on_a_broken_rotation() {
        let dir = std::env::temp_dir().join(format!("pdpair-tls-test-{}", std::process::id()));
        let files = generate(&dir, &["127.0.0.1".into(), "localhost".into()]).expect("generate");
        let r = Reloader::new(files.cert.clone(), files.key.clone()).expect("load");
        let first = leaf_der(&r);
        assert_eq!(r.reload_if_changed(), Reload::Unchanged, "nothing changed yet");
        // Rotate in place, as cert-manager does.
        let rotated = generate(&dir, &["127.0.0.1".into()]).expect("regenerate");
        assert_eq!(r.reload_if_changed(), Reload::Reloaded);
        let second = leaf_der(&r);
        assert_ne!(first, second);
        assert_ne!(files.ca_pem, rotated.ca_pem);
        // A broken certificate file: keep serving the last good one, and say so once, not at
        // every poll.
        std::fs::write(&files.cert, "not a certificate").expect("write");
        assert_eq!(r.reload_if_changed(), Reload::Broken);
        assert_eq!(r.reload_if_changed(), Reload::Unchanged, "warned about once");
        assert_eq!(leaf_der(&r), second);
        // Broken another way: said again.
        std::fs::write(&files.cert, "still not a certificate").expect("write");
        assert_eq!(r.reload_if_changed(), Reload::Broken);
        // A whole new pair: taken.
        generate(&dir, &["127.0.0.1".into()]).expect("regenerate");
        assert_eq!(r.reload_if_changed(), Reload::Reloaded);
        assert_ne!(leaf_der(&r), second);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_key_of_another_certificate_is_refused_and_the_last_good_pair_kept() {
        let dir = std::env::temp_dir().join(format!("pdpair-tls-mismatch-{}", std::process::id()));
        let other = dir.join("other");
        let files = generate(&dir, &["127.0.0.1".into()]).expect("generate");
        let r = Reloader::new(files.cert.clone(), files.key.clone()).expect("load");
        let first = leaf_der(&r);
        // A rotation caught between its key and its certificate: the new key, the old certificate.
        let rotated = generate(&other, &["127.0.0.1".into()]).expect("generate another");
        std::fs::copy(&rotated.key, &files.key).expect("copy the key");
        assert_eq!(
            r.reload_if_changed(),
            Reload::Broken,
            "a key that is not the certificate's was taken"
        );
        assert_eq!(leaf_der(&r), first);
        let e = load(&files.cert, &files.key).expect_err("mismatched pair");
        let text = e.to_string();
        assert!(
            text.contains("tls.key") && text.contains("not the key of the certificate"),
            "{e}"
        );
        assert!(Reloader::new(files.cert.clone(), files.key.clone()).is_err());
        // The certificate follows: the pair is whole again and taken.
        std::fs::copy(&rotated.cert, &files.cert).expect("copy the certificate");
        assert_eq!(r.reload_if_changed(), Reload::Reloaded);
        assert_ne!(leaf_der(&r), first);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_client_ca_file_is_taken_only_with_a_ca_in_it_and_its_errors_name_it() {
        let dir = std::env::temp_dir().join(format!("pdpair-tls-client-ca-{}", std::process::id()));
        let files = generate(&dir, &["127.0.0.1".into()]).expect("generate");
        let ca = dir.join("client-ca.crt");
        std::fs::write(&ca, &files.ca_pem).expect("write");
        assert!(client_verifier(&ca).is_ok(), "a CA certificate");
        for (content, why) in [("", "no CERTIFICATE block"), ("not pem at all", "no CERTIFICATE block")] {
            std::fs::write(&ca, content).expect("write");
            let e = client_verifier(&ca).map(drop).expect_err(content).to_string();
            assert!(e.contains(why) && e.contains("client-ca.crt"), "{e}");
        }
        let e = client_verifier(&dir.join("missing.crt"))
            .map(drop)
            .expect_err("missing")
            .to_string();
        assert!(e.contains("missing.crt"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A client certificate (for client authentication) and its key, from a new CA; the CA's PEM.
    fn client_identity() -> (
        (
            Vec<rustls::pki_types::CertificateDer<'static>>,
            rustls::pki_types::PrivateKeyDer<'static>,
        ),
        String,
    ) {
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate().expect("key")).expect("CA");
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(vec!["kube-apiserver".to_string()]).expect("params");
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &ca).expect("signed");
        let key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).expect("key der");
        ((vec![cert.der().clone()], key), ca.pem())
    }

    /// An HTTP GET of `/` at `at` over TLS (trusting `server_ca`), presenting `client` or no
    /// certificate: the answer's status line, or `None` when the handshake or the exchange failed.
    async fn get(
        at: std::net::SocketAddr,
        server_ca: &str,
        client: Option<(
            Vec<rustls::pki_types::CertificateDer<'static>>,
            rustls::pki_types::PrivateKeyDer<'static>,
        )>,
    ) -> Option<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut roots = RootCertStore::empty();
        for c in rustls_pemfile::certs(&mut server_ca.as_bytes()) {
            roots.add(c.expect("CA")).expect("root");
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(provider::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots);
        let config = match client {
            Some((chain, key)) => builder.with_client_auth_cert(chain, key).expect("client auth"),
            None => builder.with_no_client_auth(),
        };
        let tcp = tokio::net::TcpStream::connect(at).await.ok()?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .ok()?;
        tls.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut answer = Vec::new();
        tls.read_to_end(&mut answer).await.ok()?;
        String::from_utf8_lossy(&answer).lines().next().map(str::to_owned)
    }

    #[tokio::test]
    async fn with_a_client_ca_only_callers_holding_its_certificate_are_served() {
        let dir = std::env::temp_dir().join(format!("pdpair-tls-clients-{}", std::process::id()));
        let files = generate(&dir, &["127.0.0.1".into()]).expect("generate");
        let (api_server, ca) = client_identity();
        let (stranger, _) = client_identity();
        let ca_file = dir.join("client-ca.crt");
        std::fs::write(&ca_file, ca).expect("write");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let at = listener.local_addr().expect("addr");
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let router = Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let server = tokio::spawn(serve(
            listener,
            Reloader::new(files.cert.clone(), files.key.clone()).expect("load"),
            Some(ClientCa::new(ca_file.clone()).expect("client CA")),
            router,
            Arc::clone(&metrics),
        ));
        assert_eq!(get(at, &files.ca_pem, None).await, None, "no certificate");
        assert_eq!(
            get(at, &files.ca_pem, Some(stranger)).await,
            None,
            "another CA's certificate"
        );
        assert_eq!(
            get(at, &files.ca_pem, Some(api_server)).await.as_deref(),
            Some("HTTP/1.1 200 OK"),
            "the API server's"
        );
        // Counted once the server's side of each failed handshake ends (just after the client's).
        let counted = || {
            metrics
                .render()
                .contains("pdpair_operator_webhook_tls_failures_total 2")
        };
        for _ in 0..100 {
            if counted() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(counted(), "{}", metrics.render());
        server.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_changed_client_ca_file_is_trusted_for_new_connections_and_a_broken_one_keeps_the_last() {
        let dir = std::env::temp_dir().join(format!("pdpair-tls-client-rotation-{}", std::process::id()));
        let files = generate(&dir, &["127.0.0.1".into()]).expect("generate");
        let (old, old_ca) = client_identity();
        let (new, new_ca) = client_identity();
        let ca_file = dir.join("client-ca.crt");
        std::fs::write(&ca_file, &old_ca).expect("write");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let at = listener.local_addr().expect("addr");
        let router = Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let clients = ClientCa::new(ca_file.clone()).expect("client CA");
        let server = tokio::spawn(serve(
            listener,
            Reloader::new(files.cert.clone(), files.key.clone()).expect("load"),
            Some(Arc::clone(&clients)),
            router,
            Arc::new(crate::metrics::Metrics::new()),
        ));
        let ok = Some("HTTP/1.1 200 OK");
        let copy = |(chain, key): &(
            Vec<rustls::pki_types::CertificateDer<'static>>,
            rustls::pki_types::PrivateKeyDer<'static>,
        )| { (chain.clone(), key.clone_key()) };
        assert_eq!(get(at, &files.ca_pem, Some(copy(&old))).await.as_deref(), ok);
        assert!(!clients.reload_if_changed(), "nothing changed yet");
        // The old CA replaced by the new one, as an edited ConfigMap or a rotation by hand.
        std::fs::write(&ca_file, &new_ca).expect("write");
        assert!(clients.reload_if_changed());
        assert_eq!(
            get(at, &files.ca_pem, Some(copy(&new))).await.as_deref(),
            ok,
            "the new CA's"
        );
        assert_eq!(get(at, &files.ca_pem, Some(copy(&old))).await, None, "the removed CA's");
        // Half written or emptied: the last good CA stays.
        std::fs::write(&ca_file, "").expect("write");
        assert!(!clients.reload_if_changed());
        assert_eq!(get(at, &files.ca_pem, Some(copy(&new))).await.as_deref(), ok);
        assert_eq!(get(at, &files.ca_pem, Some(old)).await, None);
        server.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn load_names_the_file_on_error() {
        let e = load(Path::new("/nonexistent/tls.crt"), Path::new("/nonexistent/tls.key")).expect_err("missing");
        assert!(e.to_string().contains("/nonexistent/tls.crt"), "{e}");
    }
}
