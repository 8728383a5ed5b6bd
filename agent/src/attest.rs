//! Engines bound to their Pods: who is on the other end of an engine connection.
//!
//! An engine's registration names its PDPair, role and Pod; none of that is taken on trust. The
//! agent reads the connecting process's id from the socket (`SO_PEERCRED`, taken by the kernel
//! at connect) as it accepts the connection, finds the Pod UID and container in that process's cgroup path as the kubelet lays
//! it out (`/kubepods/<qos>/pod<uid>/<container>` with the cgroupfs driver,
//! `kubepods-<qos>-pod<uid>.slice/cri-containerd-<container>.scope` with systemd), as node
//! agents such as SPIRE's Kubernetes workload attestor do, then reads the Pod the registration
//! names from the API server: the registration is accepted only when that Pod has this UID, runs
//! on this agent's node, and carries the labels of the PDPair and role it registers for. The
//! agent still needs no access to Secrets: a wrong key only fails that engine's own handshakes.
//!
//! Outside a cluster (loopback, tests) there is no Pod to check: attestation is off, and the
//! agent says so in its log at start.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client};

use crate::engine_api::PoolRegistration;

/// The Pod (and container) a process runs in, from its cgroup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodIdentity {
    /// The Pod's UID.
    pub uid: String,
    /// The container id, when the path names one.
    pub container: Option<String>,
}

/// The Pod UID and container in a `/proc/<pid>/cgroup` text, from the first line whose path has a
/// kubelet Pod segment. `None` for a process outside any Pod.
pub fn parse_cgroup(text: &str) -> Option<PodIdentity> {
    text.lines().find_map(|line| {
        // hierarchy-id:controllers:path (cgroup v2: "0::path").
        let path = line.splitn(3, ':').nth(2)?;
        let mut segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        // In a cgroup namespace of its own (cgroup v2's default for containers that are not
        // privileged, as the agent's), another process's path is relative to the agent's own
        // cgroup: `/../../kubepods-burstable-pod<uid>.slice/...`, or with cgroupfs under a
        // common `kubepods`, `/../../burstable/pod<uid>/...`. No cgroup can be named `..`.
        let relative = segments.first() == Some(&"..");
        segments.retain(|s| *s != "..");
        let kubelets = |s: &&str| {
            s.starts_with("kubepods")
                || (relative && (matches!(*s, "burstable" | "besteffort") || pod_uid(s).is_some()))
        };
        if !segments.first().is_some_and(kubelets) {
            return None;
        }
        // The Pod's segment is where the kubelet puts it: right after its own (`kubepods`, a QoS
        // class, their systemd slices), not anywhere below. A Pod that may make cgroups of its
        // own (privileged) could otherwise nest one named as another Pod's under its container
        // and be taken for that Pod (its own segment, a static Pod's uid without dashes, did not
        // parse, and the search went on down).
        let kubelet_own =
            |s: &str| pod_uid(s).is_none() && (s.starts_with("kubepods") || matches!(s, "burstable" | "besteffort"));
        let at = segments.iter().position(|s| !kubelet_own(s))?;
        let uid = pod_uid(segments[at])?;
        let container = segments.get(at + 1).map(|c| container_id(c));
        Some(PodIdentity { uid, container })
    })
}

/// `pod<uid>` (cgroupfs) or `kubepods[-<qos>]-pod<uid_with_underscores>.slice` (systemd).
fn pod_uid(segment: &str) -> Option<String> {
    let raw = match segment.strip_suffix(".slice") {
        Some(slice) => slice.rsplit_once("-pod")?.1.replace('_', "-"),
        None => segment.strip_prefix("pod")?.to_owned(),
    };
    let uid_like = raw.len() == 36
        && raw.chars().enumerate().all(|(i, c)| {
            if [8, 13, 18, 23].contains(&i) {
                c == '-'
            } else {
                c.is_ascii_hexdigit()
            }
        });
    uid_like.then_some(raw)
}

/// `<id>`, or the id inside `cri-containerd-<id>.scope` / `docker-<id>.scope`.
fn container_id(segment: &str) -> String {
    let s = segment.strip_suffix(".scope").unwrap_or(segment);
    s.rsplit_once('-').map_or(s, |(_, id)| id).to_owned()
}

/// The Pod identity of process `pid` (read now; the caller took the pid from the socket).
pub fn pod_of_pid(pid: i32) -> Result<PodIdentity, String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map_err(|e| format!("cannot read the engine process's cgroup (pid {pid}): {e}"))?;
    parse_cgroup(&text).ok_or_else(|| format!("the engine process (pid {pid}) is not in a Pod's cgroup"))
}

/// The Pod identity of the process at the other end of an engine connection, read as it is
/// accepted: that process's cgroup now, not seconds later when it registers. The process is the
/// one the kernel recorded at connect, held by a pidfd while its cgroup is read: `SO_PEERPIDFD`
/// (Linux 6.5) names that very process, so one that connected and exited, its pid since taken by
/// another Pod's process, is refused; only where the kernel has no `SO_PEERPIDFD` does the pid
/// from `SO_PEERCRED` get opened (`pidfd_open`), which cannot tell the two apart.
#[allow(unsafe_code)]
pub fn pod_of_peer(stream: &std::os::unix::net::UnixStream) -> Result<PodIdentity, String> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let pid = crate::memory::pool::peer_pid(stream).ok_or("cannot read the engine's process id (SO_PEERCRED)")?;
    let exited = || format!("the engine process (pid {pid}) exited as it connected");
    let pidfd = match peer_pidfd(stream) {
        Ok(fd) => Some(fd),
        // The kernel has no SO_PEERPIDFD: the pid, as it is now.
        Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => {
            // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
            let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
            if raw >= 0 {
                // SAFETY: a descriptor pidfd_open just returned, owned by nothing else.
                Some(unsafe { OwnedFd::from_raw_fd(raw as i32) })
            } else {
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::ESRCH) => return Err(exited()),
                    // A kernel without pidfd_open (before 5.3), or a seccomp profile without
                    // it: the pid, unchecked.
                    Some(libc::ENOSYS | libc::EPERM) => None,
                    // Out of descriptors or memory, say: refused, not taken unchecked.
                    _ => return Err(format!("cannot hold the engine process (pid {pid}, pidfd_open): {e}")),
                }
            }
        }
        // The process that connected is gone (reaped): its pid may be another's.
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ESRCH)) => return Err(exited()),
        Err(e) => return Err(format!("cannot hold the engine process (pid {pid}, SO_PEERPIDFD): {e}")),
    };
    // Read, then checked: the process still running after the read is the one read. (And one
    // that has exited is told as that, whatever the read found of the pid's new holder.)
    let identity = pod_of_pid(pid);
    if let Some(fd) = pidfd {
        let mut poll = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait. A pidfd polls readable once its process exited.
        let ready = unsafe { libc::poll(&mut poll, 1, 0) };
        if ready != 0 {
            return Err(exited());
        }
    }
    identity
}

/// Linux's `SO_PEERPIDFD` (6.5): a pidfd of the process that connected a Unix socket.
const SO_PEERPIDFD: libc::c_int = 77;

/// A pidfd of the process at the other end of `stream`, as the kernel recorded it at connect.
#[allow(unsafe_code)]
fn peer_pidfd(stream: &std::os::unix::net::UnixStream) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a valid socket fd, an out-buffer of `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&raw mut fd).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if fd < 0 {
        return Err(std::io::Error::other(format!("SO_PEERPIDFD gave descriptor {fd}")));
    }
    // SAFETY: a descriptor the kernel just made for us, owned by nothing else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Checks engine registrations against the Pods they run in.
pub struct Attestor {
    runtime: tokio::runtime::Runtime,
    client: Client,
    node: String,
}

impl std::fmt::Debug for Attestor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Attestor(node {})", self.node)
    }
}

/// The longest a Pod lookup may take.
const LOOKUP: Duration = Duration::from_secs(5);

impl Attestor {
    /// An attestor reading Pods with this client configuration, for the agent on `node`.
    pub fn new(config: kube::Config, node: String) -> Result<Attestor, String> {
        // Engine sessions call in from their own threads at once: a multi-thread runtime.
        let (runtime, client) = crate::api_client::on(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("attest"),
            config,
        )?;
        Ok(Attestor { runtime, client, node })
    }

    /// Accepts `reg` from a process of Pod `identity` ([`pod_of_peer`], read when the
    /// connection was accepted) only when that Pod is the one the registration names, on this
    /// node, labelled for the registration's PDPair and role. `Err` names what differs.
    pub fn check(&self, reg: &PoolRegistration, identity: Result<PodIdentity, String>) -> Result<PodIdentity, String> {
        let identity = identity?;
        let Some(name) = reg.pod.as_deref().filter(|p| !p.is_empty()) else {
            return Err("engine attestation is on: the registration must name its Pod (pod)".into());
        };
        let (namespace, pair) = pdpair_name(&reg.pdpair)?;
        pdpair_api::check_dns1123_subdomain("pod", name)?;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let found = self
            .runtime
            .block_on(async { tokio::time::timeout(LOOKUP, pods.get_opt(name)).await })
            .map_err(|_| format!("looking up Pod {namespace}/{name} took over {LOOKUP:?}"))?
            .map_err(|e| {
                // The API server's answer (a 403 naming the agent's account and what it may
                // read, say) goes to the agent's log, not to the engine.
                tracing::warn!(pod = %format!("{namespace}/{name}"), error = %e, "engine attestation: looking up the Pod failed");
                format!("looking up Pod {namespace}/{name} failed (the node agent's log says why)")
            })?;
        // A Pod that does not exist reads as one of another UID: an engine learns nothing of
        // other namespaces' Pods (whether one exists, its UID) from a refusal.
        let Some(pod) = found else {
            return Err(not_its_pod(namespace, name, &identity));
        };
        check_pod(&pod, &identity, (namespace, name), reg.role, pair, &self.node).map(|()| identity)
    }
}

impl Attestor {
    /// The PDPair `namespace/name` (its spec's transfer settings fill and check an engine's).
    pub fn pdpair(&self, pdpair: &str) -> Result<pdpair_api::PDPair, String> {
        let (namespace, name) = pdpair_name(pdpair)?;
        let pairs: Api<pdpair_api::PDPair> = Api::namespaced(self.client.clone(), namespace);
        self.runtime
            .block_on(async { tokio::time::timeout(LOOKUP, pairs.get_opt(name)).await })
            .map_err(|_| format!("looking up PDPair {namespace}/{name} took over {LOOKUP:?}"))?
            .map_err(|e| format!("looking up PDPair {namespace}/{name}: {e}"))?
            .ok_or_else(|| format!("PDPair {namespace}/{name} (the registration's pdpair) does not exist"))
    }
}

/// A registration's `pdpair` (`namespace/name`, or `name` in `default`) as the namespace and
/// name, each a Kubernetes name: they go into the API server's URLs, where `..` or a `/` could
/// name another object than the registration does.
pub(crate) fn pdpair_name(pdpair: &str) -> Result<(&str, &str), String> {
    let (namespace, name) = pdpair.split_once('/').unwrap_or(("default", pdpair));
    pdpair_api::check_dns1123_label("pdpair's namespace", namespace)?;
    pdpair_api::check_dns1123_subdomain("pdpair's name", name)?;
    Ok((namespace, name))
}

/// The refusal of a registration naming Pod `namespace/name`, which is not the engine process's
/// (whether it exists or not, and its UID, are not said).
fn not_its_pod(namespace: &str, name: &str, identity: &PodIdentity) -> String {
    format!(
        "Pod {namespace}/{name} (the registration's pod) is not the engine process's Pod: it runs in the Pod of UID {}",
        identity.uid
    )
}

/// The checks on the Pod found, pure (for tests): the one the registration names (`at`:
/// namespace and name), in the engine process's Pod, on this node, labelled for its pair and
/// role.
pub fn check_pod(
    pod: &Pod,
    identity: &PodIdentity,
    at: (&str, &str),
    role: pdpair_api::Role,
    pair: &str,
    node: &str,
) -> Result<(), String> {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    if (namespace, name) != at {
        return Err(format!(
            "the API server answered for Pod {}/{}: Pod {namespace}/{name}",
            at.0, at.1
        ));
    }
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    if uid != identity.uid {
        return Err(not_its_pod(namespace, name, identity));
    }
    // A Pod being deleted takes no new engines (its labels, read now, may be gone any moment).
    if pod.metadata.deletion_timestamp.is_some() {
        return Err(format!("Pod {name} is being deleted: no engine of it registers"));
    }
    let on = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or_default();
    if on != node {
        return Err(format!(
            "Pod {name} is on node {on:?}, not on this agent's node {node:?}"
        ));
    }
    let label = |key: &str| {
        pod.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(key))
            .map(String::as_str)
            .unwrap_or_default()
    };
    if label("pdpair.dev/name") != pair {
        return Err(format!(
            "Pod {name} is labelled pdpair.dev/name={:?}; it cannot register for PDPair {pair}",
            label("pdpair.dev/name")
        ));
    }
    if label("pdpair.dev/role") != role.as_str() {
        return Err(format!(
            "Pod {name} is labelled pdpair.dev/role={:?}; it cannot register as {role}",
            label("pdpair.dev/role")
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "8dbc8b9e-6c2c-4d5a-9d4e-5f7a1b2c3d4e";

    #[test]
    fn kubelet_cgroup_layouts_give_the_pod_and_container() {
        let cgroupfs = format!(
            "12:pids:/kubepods/besteffort/pod{UID}/0123abcd\n11:memory:/kubepods/besteffort/pod{UID}/0123abcd\n"
        );
        assert_eq!(
            parse_cgroup(&cgroupfs),
            Some(PodIdentity {
                uid: UID.into(),
                container: Some("0123abcd".into())
            })
        );
        let guaranteed = format!("3:cpu,cpuacct:/kubepods/pod{UID}/ffee\n");
        assert_eq!(parse_cgroup(&guaranteed).map(|p| p.uid), Some(UID.into()));
        let systemd = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-77aa.scope\n",
            UID.replace('-', "_")
        );
        assert_eq!(
            parse_cgroup(&systemd),
            Some(PodIdentity {
                uid: UID.into(),
                container: Some("77aa".into())
            })
        );
    }

    #[test]
    fn processes_outside_pods_and_lookalike_paths_have_no_pod() {
        assert_eq!(parse_cgroup("0::/user.slice/user-0.slice/session-1.scope\n"), None);
        assert_eq!(parse_cgroup("12:pids:/\n"), None);
        // A pod segment outside the kubelet's hierarchy, and a malformed UID.
        assert_eq!(parse_cgroup(&format!("12:pids:/mine/pod{UID}/x\n")), None);
        assert_eq!(parse_cgroup("12:pids:/kubepods/besteffort/podnot-a-uid/x\n"), None);
        // Relative (a private cgroup namespace): still only the kubelet's hierarchy.
        assert_eq!(parse_cgroup(&format!("0::/../../mine/pod{UID}/x\n")), None);
        assert_eq!(parse_cgroup("0::/../../../system.slice/containerd.service\n"), None);
        assert_eq!(parse_cgroup(&format!("0::/mine/../pod{UID}/x\n")), None);
        // A Pod segment below where the kubelet puts it: under a static Pod's own (its uid has
        // no dashes, so it does not parse), or under a container, made by a Pod that may make
        // cgroups. It named another Pod's uid and was taken for that Pod.
        let static_pod = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            parse_cgroup(&format!("0::/kubepods/besteffort/pod{static_pod}/c0/pod{UID}/x\n")),
            None
        );
        assert_eq!(
            parse_cgroup(&format!(
                "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{static_pod}.slice/c0/pod{UID}/x\n"
            )),
            None
        );
        assert_eq!(parse_cgroup(&format!("0::/kubepods/besteffort/c0/pod{UID}/x\n")), None);
    }

    #[test]
    fn paths_relative_to_the_agents_own_cgroup_namespace_give_the_pod() {
        // cgroup v2 gives a container that is not privileged a cgroup namespace of its own: the
        // agent reads other processes' paths relative to its own cgroup.
        let u = UID.replace('-', "_");
        for (text, container) in [
            (
                format!("0::/../../kubepods-besteffort-pod{u}.slice/cri-containerd-77aa.scope\n"),
                "77aa",
            ),
            (
                format!(
                    "0::/../../../kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-77aa.scope\n"
                ),
                "77aa",
            ),
            (format!("0::/../../pod{UID}/0123abcd\n"), "0123abcd"),
            (format!("0::/../../burstable/pod{UID}/0123abcd\n"), "0123abcd"),
        ] {
            assert_eq!(
                parse_cgroup(&text),
                Some(PodIdentity {
                    uid: UID.into(),
                    container: Some(container.into())
                }),
                "{text}"
            );
        }
    }

    fn pod(uid: &str, node: &str, pair: &str, role: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": uid, "labels": {"pdpair.dev/name": pair, "pdpair.dev/role": role}},
            "spec": {"nodeName": node, "containers": []}
        }))
        .expect("pod")
    }

    #[test]
    fn a_registration_is_bound_to_the_pods_uid_node_pair_and_role() {
        let me = PodIdentity {
            uid: UID.into(),
            container: None,
        };
        let decode = pdpair_api::Role::Decode;
        assert_eq!(
            check_pod(&pod(UID, "n", "x", "decode"), &me, AT, decode, "x", "n"),
            Ok(())
        );
        let e = check_pod(&pod("other", "n", "x", "decode"), &me, AT, decode, "x", "n").expect_err("uid");
        // The Pod named is not said to exist, nor its UID: as for one that does not exist.
        assert_eq!(e, not_its_pod(AT.0, AT.1, &me), "{e}");
        assert!(!e.contains("other"), "{e}");
        let e = check_pod(&pod(UID, "m", "x", "decode"), &me, AT, decode, "x", "n").expect_err("node");
        assert!(e.contains("node"), "{e}");
        let e = check_pod(&pod(UID, "n", "y", "decode"), &me, AT, decode, "x", "n").expect_err("pair");
        assert!(e.contains("pdpair.dev/name"), "{e}");
        let e = check_pod(
            &pod(UID, "n", "x", "decode"),
            &me,
            AT,
            pdpair_api::Role::Prefill,
            "x",
            "n",
        )
        .expect_err("role");
        assert!(e.contains("pdpair.dev/role") && e.contains("prefill"), "{e}");
        let mut going = pod(UID, "n", "x", "decode");
        going.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
        let e = check_pod(&going, &me, AT, decode, "x", "n").expect_err("deleted");
        assert!(e.contains("being deleted"), "{e}");
        // Whatever the API server answered for: another namespace's Pod, or another name.
        for at in [("other", "p"), ("ns", "q")] {
            let e = check_pod(&pod(UID, "n", "x", "decode"), &me, at, decode, "x", "n").expect_err("elsewhere");
            assert!(e.contains("answered for"), "{e}");
        }
    }

    const AT: (&str, &str) = ("ns", "p");

    #[test]
    fn names_that_go_into_the_api_servers_urls_must_be_kubernetes_names() {
        // A registration's pod and pdpair are the engine's: `..` or `/` in them could have the
        // lookup name another object than the registration does.
        assert_eq!(pdpair_name("team-a/llama.8b"), Ok(("team-a", "llama.8b")));
        assert_eq!(pdpair_name("llama"), Ok(("default", "llama")));
        for bad in [
            "victim/../x",
            "ns/a/b",
            "../ns/x",
            "Ns/x",
            "ns/",
            "/x",
            "ns/-x",
            "ns./x",
            "",
        ] {
            let e = pdpair_name(bad).expect_err(bad);
            assert!(e.contains("is not a Kubernetes name"), "{bad}: {e}");
        }
        let e = pdpair_name(&format!("{}/x", "n".repeat(64))).expect_err("long namespace");
        assert!(e.contains("at most 63"), "{e}");
    }
}
