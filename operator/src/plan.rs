//! The plan: the children a PDPair should have, as pure functions of the PDPair.
//!
//! Apply sends these with server-side apply under one field manager, so applying an unchanged
//! plan is a no-op on the API server (no new resourceVersion, no rollout).

use std::collections::BTreeMap;

use k8s_openapi::{
    api::{
        apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment},
        core::v1::{
            Container, EnvVar, EnvVarSource, HostPathVolumeSource, ObjectFieldSelector, PodTemplateSpec, Secret,
            SecretVolumeSource, Volume, VolumeMount,
        },
    },
    apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference},
};
use kube::Resource;
use pdpair_api::{PDPair, Role};
use sha2::{Digest, Sha256};

use crate::names::{self, ANNOTATION_GEOMETRY, LABEL_NAME, LABEL_ROLE};

/// Labels that select a pool's pods (and mark its Deployment).
pub fn pool_labels(pair: &str, role: Role) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_NAME.to_owned(), pair.to_owned()),
        (LABEL_ROLE.to_owned(), role.as_str().to_owned()),
    ])
}

/// The owner reference that makes a child belong to (and be collected with) its PDPair.
fn owner(pair: &PDPair) -> Option<OwnerReference> {
    pair.controller_owner_ref(&())
}

/// A hash of what the engine must be restarted for: the pool's KV geometry and parallelism, and
/// the pair's transfer mode and checksum policy.
pub fn geometry_hash(pair: &PDPair, role: Role) -> String {
    let pool = match role {
        Role::Prefill => &pair.spec.prefill,
        Role::Decode => &pair.spec.decode,
    };
    let canonical = serde_json::json!({
        "mode": pair.spec.transfer.mode,
        "checksum": pair.spec.transfer.checksum,
        "parallelism": pool.parallelism,
        "kv": pool.kv,
    });
    let digest = Sha256::digest(canonical.to_string().as_bytes());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The Deployment the pool should have now: its template's, while the pair passes the rule
/// table; `None` for a bring-your-own pool and for every pool of an incompatible pair (an
/// incompatible pair must not run: the controller deletes what it had).
pub fn planned_deployment(pair: &PDPair, role: Role, wiring: &Wiring) -> Option<Deployment> {
    pdpair_api::check(&pair.spec)
        .allowed()
        .then(|| deployment(pair, role, wiring))
        .flatten()
}

/// How this installation's node agents are reached, for the engine pods the operator renders.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Wiring {
    /// The group that owns the agents' engine socket (mode 0660; the chart's
    /// `agent.socketGroup`): engine pods get it as their `fsGroup` when they set none (which also
    /// makes the pairing key readable to them), or as a supplemental group when they set another.
    pub socket_group: Option<i64>,
    /// Where the agents' engine socket directory is on the node (the chart's `agent.socketDir`;
    /// `None`: [`names::AGENT_SOCKET_DIR`]): engine pods mount it at
    /// [`names::AGENT_SOCKET_DIR`] whatever it is, where `PDPAIR_AGENT_SOCKET` points.
    pub socket_dir: Option<String>,
}

/// The Deployment for a pool with a template; `None` for a bring-your-own pool (and for a
/// PDPair without a name or uid, which one the API server stored always has).
pub fn deployment(pair: &PDPair, role: Role, wiring: &Wiring) -> Option<Deployment> {
    let name = pair.metadata.name.as_deref()?;
    let uid = pair.metadata.uid.as_deref()?;
    let pool = match role {
        Role::Prefill => &pair.spec.prefill,
        Role::Decode => &pair.spec.decode,
    };
    let template = pool.template.as_ref()?;
    let labels = pool_labels(name, role);
    Some(Deployment {
        metadata: ObjectMeta {
            name: Some(names::deployment_name(name, role)),
            namespace: pair.metadata.namespace.clone(),
            labels: Some(labels.clone()),
            owner_references: owner(pair).map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(pool.replicas),
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                ..LabelSelector::default()
            },
            template: engine_template(pair, (name, uid), role, template, labels, wiring),
            strategy: pool.rollout.as_ref().map(strategy),
            ..DeploymentSpec::default()
        }),
        status: None,
    })
}

/// A pool's `rollout` as its Deployment's `RollingUpdate` strategy (what it leaves out,
/// Kubernetes defaults).
fn strategy(rollout: &pdpair_api::Rollout) -> DeploymentStrategy {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    DeploymentStrategy {
        type_: Some("RollingUpdate".to_owned()),
        rolling_update: Some(RollingUpdateDeployment {
            max_surge: rollout.max_surge.map(IntOrString::Int),
            max_unavailable: rollout.max_unavailable.map(IntOrString::Int),
        }),
    }
}

/// The user's template with what the engine needs to reach its node agent added.
fn engine_template(
    pair: &PDPair,
    (name, uid): (&str, &str),
    role: Role,
    template: &PodTemplateSpec,
    labels: BTreeMap<String, String>,
    wiring: &Wiring,
) -> PodTemplateSpec {
    let mut template = template.clone();
    let meta = template.metadata.get_or_insert_with(ObjectMeta::default);
    meta.labels.get_or_insert_with(BTreeMap::new).extend(labels);
    meta.annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(ANNOTATION_GEOMETRY.to_owned(), geometry_hash(pair, role));
    let namespace = pair.metadata.namespace.clone().unwrap_or_default();
    let pool = match role {
        Role::Prefill => &pair.spec.prefill,
        Role::Decode => &pair.spec.decode,
    };
    let env = [
        ("PDPAIR_NAME", name.to_owned()),
        ("PDPAIR_NAMESPACE", namespace),
        ("PDPAIR_ROLE", role.as_str().to_owned()),
        ("PDPAIR_AGENT_SOCKET", names::AGENT_SOCKET.to_owned()),
        ("PDPAIR_PAIRING_KEY_FILE", names::PAIRING_KEY_FILE.to_owned()),
        // Whose key the engine must find beside it (`pdpair-uid`). The Secret's name holds the
        // uid too, so the one mounted is this PDPair's; the engine checks it all the same, and
        // waits for the kubelet to bring the right one rather than pair with another key.
        ("PDPAIR_UID", uid.to_owned()),
        // The declared geometry: a connector reports what it observes and takes from this only
        // what the engine cannot tell (the model's name as the PDPair spells it, the backend).
        ("PDPAIR_KV", serde_json::to_string(&pool.kv).unwrap_or_default()),
        (
            "PDPAIR_PARALLELISM",
            serde_json::to_string(&pool.parallelism).unwrap_or_default(),
        ),
    ];
    let spec = template.spec.get_or_insert_with(Default::default);
    if let Some(gid) = wiring.socket_group {
        let security = spec.security_context.get_or_insert_with(Default::default);
        match security.fs_group {
            None => security.fs_group = Some(gid),
            Some(own) if own != gid => {
                let groups = security.supplemental_groups.get_or_insert_with(Vec::new);
                if !groups.contains(&gid) {
                    groups.push(gid);
                }
            }
            Some(_) => {}
        }
    }
    if pair.spec.transfer.connector == pdpair_api::Connector::Pdpair
        && let Some(engine) = spec.containers.first_mut()
    {
        set_kv_transfer_config(engine, role);
    }
    for container in &mut spec.containers {
        add_engine_wiring(container, &env);
        // The Pod's own name, for the engine's registration (the agent attests it).
        let vars = container.env.get_or_insert_with(Vec::new);
        vars.retain(|v| v.name != "PDPAIR_POD_NAME");
        vars.push(EnvVar {
            name: "PDPAIR_POD_NAME".into(),
            value: None,
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: "metadata.name".into(),
                    api_version: None,
                }),
                ..EnvVarSource::default()
            }),
        });
    }
    // An init container (a native sidecar included) may mount the two volumes, but read-only as
    // the engines do: one writing the agent's socket directory could put its own socket in the
    // agent's place for every engine on the node.
    for container in spec.init_containers.iter_mut().flatten() {
        for mount in container.volume_mounts.iter_mut().flatten() {
            if mount.name == "pdpair-agent" || mount.name == "pdpair-pairing" {
                mount.read_only = Some(true);
            }
        }
    }
    let volumes = spec.volumes.get_or_insert_with(Vec::new);
    volumes.retain(|v| v.name != "pdpair-agent" && v.name != "pdpair-pairing");
    volumes.push(Volume {
        name: "pdpair-agent".into(),
        host_path: Some(HostPathVolumeSource {
            path: wiring
                .socket_dir
                .clone()
                .unwrap_or_else(|| names::AGENT_SOCKET_DIR.into()),
            type_: Some("DirectoryOrCreate".into()),
        }),
        ..Volume::default()
    });
    volumes.push(Volume {
        name: "pdpair-pairing".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(names::secret_name(name, uid)),
            default_mode: Some(0o400),
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    });
    template
}

/// What vLLM does with a request whose KV did not arrive (`kv_load_failure_policy`) where the
/// template's `--kv-transfer-config` names none: `recompute`, decode computes the prompt itself.
/// vLLM's own default, `fail`, answers the client with an error, and every agent rollout, lease
/// expiry or refused handshake would fail the requests in flight.
pub const LOAD_FAILURE_POLICY: &str = "recompute";

/// vLLM's flag that loads pdpair's connector, for a pool of `role`, with `policy` as its
/// `kv_load_failure_policy`. Its `engine_id` is the Pod's name (the kubelet expands
/// `$(PDPAIR_POD_NAME)`, which the engine env sets from the downward API): vLLM makes a new
/// random one at each start otherwise, so an engine restarted in its Pod registered under a new
/// name and published a new PDEndpoint beside the old one's, one more for each restart of a
/// crash-looping container until the Pod went.
pub fn kv_transfer_config(role: Role, policy: &str) -> String {
    let kv_role = match role {
        Role::Prefill => "kv_producer",
        Role::Decode => "kv_consumer",
    };
    let config = serde_json::json!({
        "kv_connector": "PdpairConnector",
        "kv_connector_module_path": "pdpair_vllm",
        "kv_role": kv_role,
        "kv_load_failure_policy": policy,
        "engine_id": "$(PDPAIR_POD_NAME)",
    });
    format!("--kv-transfer-config={config}")
}

/// Puts [`kv_transfer_config`] in the engine container's args, in place of any
/// `--kv-transfer-config` the template has (`--flag=value` or `--flag value`, `_` for `-` in its
/// name, and vLLM's dotted `--kv-transfer-config.FIELD value` too, which vLLM would merge over
/// ours), keeping the template's `kv_load_failure_policy` (`fail` or `recompute`; otherwise
/// [`LOAD_FAILURE_POLICY`]).
fn set_kv_transfer_config(container: &mut Container, role: Role) {
    const FLAG: &str = "--kv-transfer-config";
    let args = container.args.get_or_insert_with(Vec::new);
    let mut kept = Vec::with_capacity(args.len() + 1);
    let mut policy = LOAD_FAILURE_POLICY;
    // The flag (or dotted field, normalised) whose value is the next argument.
    let mut value_of: Option<String> = None;
    for arg in args.drain(..) {
        let (name, value) = match value_of.take() {
            Some(name) => (name, arg),
            None => {
                let (name, inline) = arg.split_once('=').map_or((arg.as_str(), None), |(n, v)| (n, Some(v)));
                let name = name.replace('_', "-");
                if name != FLAG && !name.starts_with(&format!("{FLAG}.")) {
                    kept.push(arg);
                    continue;
                }
                match inline {
                    Some(v) => (name, v.to_owned()),
                    None => {
                        value_of = Some(name);
                        continue;
                    }
                }
            }
        };
        let named = if name == FLAG {
            serde_json::from_str::<serde_json::Value>(&value).ok().and_then(|c| {
                c.get("kv_load_failure_policy")
                    .and_then(|p| p.as_str())
                    .map(str::to_owned)
            })
        } else {
            (name == format!("{FLAG}.kv-load-failure-policy")).then_some(value)
        };
        match named.as_deref() {
            Some("fail") => policy = "fail",
            Some("recompute") => policy = "recompute",
            _ => {}
        }
    }
    kept.push(kv_transfer_config(role, policy));
    *args = kept;
}

fn add_engine_wiring(container: &mut Container, env: &[(&str, String)]) {
    let vars = container.env.get_or_insert_with(Vec::new);
    vars.retain(|v| !env.iter().any(|(k, _)| *k == v.name));
    vars.extend(env.iter().map(|(k, v)| EnvVar {
        name: (*k).into(),
        value: Some(v.clone()),
        value_from: None,
    }));
    let mounts = container.volume_mounts.get_or_insert_with(Vec::new);
    mounts.retain(|m| m.name != "pdpair-agent" && m.name != "pdpair-pairing");
    // Read-only: an engine connects to the agent's socket (connect works on a read-only mount)
    // but cannot replace it or put anything beside it.
    mounts.push(VolumeMount {
        name: "pdpair-agent".into(),
        mount_path: names::AGENT_SOCKET_DIR.into(),
        read_only: Some(true),
        ..VolumeMount::default()
    });
    mounts.push(VolumeMount {
        name: "pdpair-pairing".into(),
        mount_path: names::PAIRING_DIR.into(),
        read_only: Some(true),
        ..VolumeMount::default()
    });
}

/// The pairing Secret a pod template mounts.
fn mounted_secret(d: &Deployment) -> Option<&str> {
    d.spec
        .as_ref()?
        .template
        .spec
        .as_ref()?
        .volumes
        .as_ref()?
        .iter()
        .find(|v| v.name == "pdpair-pairing")?
        .secret
        .as_ref()?
        .secret_name
        .as_deref()
}

/// Makes `planned` mount the pairing Secret that `live` (the pool's Deployment as it runs, one
/// this pair controls) mounts, where that is the one an earlier operator named for pair `pair`
/// (`<pair>-pairing`, before uids were in the name; the only other name it gives this pair's
/// Secret is the planned one, and never one patched in by hand): the name it kept, if it
/// changed anything. For a pool whose pairing Secret cannot be made yet (a quota): pods rolled
/// to mount one that does not exist would never start.
pub fn keep_pairing_secret(planned: &mut Deployment, live: &Deployment, pair: &str) -> Option<String> {
    let kept = mounted_secret(live)?.to_owned();
    if kept != names::legacy_secret_name(pair) {
        return None;
    }
    let volume = planned
        .spec
        .as_mut()?
        .template
        .spec
        .as_mut()?
        .volumes
        .as_mut()?
        .iter_mut()
        .find(|v| v.name == "pdpair-pairing")?
        .secret
        .as_mut()?;
    if volume.secret_name.as_deref() == Some(kept.as_str()) {
        return None;
    }
    volume.secret_name = Some(kept.clone());
    Some(kept)
}

/// The pairing Secret, holding `key` (fresh random bytes, made once by the caller).
pub fn pairing_secret(pair: &PDPair, key: &[u8]) -> Option<Secret> {
    let name = pair.metadata.name.as_deref()?;
    let uid = pair.metadata.uid.as_deref()?;
    Some(Secret {
        metadata: ObjectMeta {
            name: Some(names::secret_name(name, uid)),
            namespace: pair.metadata.namespace.clone(),
            labels: Some(BTreeMap::from([(LABEL_NAME.to_owned(), name.to_owned())])),
            owner_references: owner(pair).map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([
            (names::PAIRING_KEY.to_owned(), k8s_openapi::ByteString(key.to_vec())),
            (
                names::PAIRING_UID.to_owned(),
                k8s_openapi::ByteString(uid.as_bytes().to_vec()),
            ),
        ])),
        ..Secret::default()
    })
}

#[cfg(test)]
mod tests;
