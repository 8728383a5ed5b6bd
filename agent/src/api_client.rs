//! A Kubernetes client with the runtime that drives it, for the agent's threads that call the
//! API server (the PDEndpoint publisher, engine attestation).

use kube::Client;

/// Builds `runtime` and a client for `config` on it.
pub fn on(
    runtime: &mut tokio::runtime::Builder,
    config: kube::Config,
) -> Result<(tokio::runtime::Runtime, Client), String> {
    let runtime = runtime.enable_all().build().map_err(|e| format!("runtime: {e}"))?;
    let client = {
        let _guard = runtime.enter();
        Client::try_from(config).map_err(|e| format!("Kubernetes client: {e}"))?
    };
    Ok((runtime, client))
}
