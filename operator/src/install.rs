//! Local-mode installation: apply the CRDs and a ValidatingWebhookConfiguration that points at
//! the operator's URL with the CA of the certificate it generated.

use std::time::Duration;

use k8s_openapi::{
    ByteString,
    api::admissionregistration::v1::{
        RuleWithOperations, ServiceReference, ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};

use crate::names::{MANAGER, WEBHOOK_CONFIG, WEBHOOK_NAME, WEBHOOK_PATH};

/// Installation failures.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// A generated CRD did not parse (a bug).
    #[error("CRD {file} does not parse: {source}")]
    Crd {
        /// The CRD file.
        file: &'static str,
        /// The cause.
        #[source]
        source: serde_yaml::Error,
    },
    /// The API server refused an apply.
    #[error("applying {what}: {source}")]
    Apply {
        /// What.
        what: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// A CRD did not become Established.
    #[error("CRD {0} not Established after 30 s")]
    NotEstablished(String),
}

/// Where the API server reaches the webhook.
#[derive(Clone, Debug)]
pub enum WebhookTarget {
    /// A base URL such as `https://127.0.0.1:9443` (local mode).
    Url(String),
    /// A Service in the cluster.
    Service {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// Port.
        port: i32,
    },
}

/// The webhook configuration for `target`, trusting `ca_pem`.
pub fn webhook_configuration(target: &WebhookTarget, ca_pem: &str) -> ValidatingWebhookConfiguration {
    let client_config = match target {
        WebhookTarget::Url(base) => WebhookClientConfig {
            url: Some(format!("{}{WEBHOOK_PATH}", base.trim_end_matches('/'))),
            ca_bundle: Some(ByteString(ca_pem.as_bytes().to_vec())),
            service: None,
        },
        WebhookTarget::Service { namespace, name, port } => WebhookClientConfig {
            url: None,
            ca_bundle: Some(ByteString(ca_pem.as_bytes().to_vec())),
            service: Some(ServiceReference {
                namespace: namespace.clone(),
                name: name.clone(),
                path: Some(WEBHOOK_PATH.into()),
                port: Some(*port),
            }),
        },
    };
    ValidatingWebhookConfiguration {
        metadata: ObjectMeta {
            name: Some(WEBHOOK_CONFIG.into()),
            ..ObjectMeta::default()
        },
        webhooks: Some(vec![ValidatingWebhook {
            name: WEBHOOK_NAME.into(),
            admission_review_versions: vec!["v1".into()],
            client_config,
            failure_policy: Some("Fail".into()),
            // A refusal records a Rejected Event, except for a dry run.
            side_effects: "NoneOnDryRun".into(),
            timeout_seconds: Some(5),
            match_policy: Some("Equivalent".into()),
            rules: Some(vec![RuleWithOperations {
                api_groups: Some(vec!["pdpair.dev".into()]),
                api_versions: Some(vec!["v1alpha1".into()]),
                operations: Some(vec!["CREATE".into(), "UPDATE".into()]),
                resources: Some(vec!["pdpairs".into()]),
                scope: Some("Namespaced".into()),
            }]),
            ..ValidatingWebhook::default()
        }]),
    }
}

/// Applies the CRDs (waiting until they are Established) and the webhook configuration.
pub async fn install(client: &Client, target: &WebhookTarget, ca_pem: &str) -> Result<(), InstallError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let params = PatchParams::apply(MANAGER).force();
    for file in crate::crd::all() {
        let crd: CustomResourceDefinition = serde_yaml::from_str(&file.yaml).map_err(|source| InstallError::Crd {
            file: file.file,
            source,
        })?;
        let name = crd.metadata.name.clone().unwrap_or_default();
        crds.patch(&name, &params, &Patch::Apply(&crd))
            .await
            .map_err(|source| InstallError::Apply {
                what: format!("CRD {name}"),
                source,
            })?;
        wait_established(&crds, &name).await?;
    }
    let hooks: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let config = webhook_configuration(target, ca_pem);
    hooks
        .patch(WEBHOOK_CONFIG, &params, &Patch::Apply(&config))
        .await
        .map_err(|source| InstallError::Apply {
            what: format!("ValidatingWebhookConfiguration {WEBHOOK_CONFIG}"),
            source,
        })?;
    tracing::info!(
        config = WEBHOOK_CONFIG,
        "installed the CRDs and the webhook configuration"
    );
    Ok(())
}

async fn wait_established(crds: &Api<CustomResourceDefinition>, name: &str) -> Result<(), InstallError> {
    for _ in 0..60 {
        let established = crds.get_opt(name).await.ok().flatten().is_some_and(|crd| {
            crd.status
                .and_then(|s| s.conditions)
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Established" && c.status == "True"))
        });
        if established {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(InstallError::NotEstablished(name.into()))
}
