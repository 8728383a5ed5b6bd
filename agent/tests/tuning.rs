//! `pdpair-agent run` re-executes itself once with the copy settings (src/tuning.rs): the running
//! agent's environment has them, and it serves.

mod common;

use common::{ProcessAgent, World};

#[test]
fn a_running_agent_has_the_copy_settings_in_its_environment() {
    let w = World::new("tuning");
    let (agent, socket) = ProcessAgent::start(&w, "tuned");
    let environ = std::fs::read(format!("/proc/{}/environ", agent.0.id())).expect("environ");
    let vars: Vec<String> = environ
        .split(|b| *b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    for want in [
        "PDPAIR_AGENT_TUNED=1",
        "GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000",
        "UCX_BUILTIN_MEMCPY_MIN=inf",
    ] {
        assert!(vars.iter().any(|v| v == want), "{want} missing from {vars:?}");
    }
    // The same process (the exec kept its pid) serves its socket.
    assert!(std::os::unix::net::UnixStream::connect(&socket).is_ok());
}
