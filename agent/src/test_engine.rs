//! `pdpair-agent test-engine`: the synthetic engine as a Pod's engine, for clusters without a GPU.
//! It takes everything from the environment the operator gives engine containers
//! (`PDPAIR_NAME`, `PDPAIR_NAMESPACE`, `PDPAIR_ROLE`, `PDPAIR_AGENT_SOCKET`,
//! `PDPAIR_PAIRING_KEY_FILE`, `PDPAIR_UID`, `PDPAIR_KV`, `PDPAIR_PARALLELISM`, `PDPAIR_POD_NAME`) and leaves the
//! transfer settings to the agent, which reads them from the PDPair.
//!
//! - prefill: registers and offers request `--request` (the synthetic pattern of `--tokens`
//!   tokens) again and again: each time it is read (or its lease expires, which is routine) it is
//!   offered anew;
//! - decode, without `--prefill`: registers and stays (its PDEndpoint shows the engine);
//! - decode with `--prefill ADDR`: one request from that prefill engine, every received byte
//!   checked; prints the final event as JSON with `bad_tokens` and exits 0 only when it was
//!   `RequestDone` with no wrong byte (run it with `kubectl exec` in a decode Pod).

use std::{io::Write, path::PathBuf};

use pdpair_api::{KvGeometry, Parallelism, Role};

use crate::{
    cli::UsageError,
    engine_api::{AgentEvent, EngineRequest, PoolRegistration},
    synthetic::SyntheticEngine,
    wire::hex_bytes,
};

/// Arguments of `pdpair-agent test-engine`.
#[derive(Clone, Debug, clap::Args)]
pub struct TestEngineArgs {
    /// Blocks in the pool.
    #[arg(long = "num-blocks", default_value_t = 16)]
    pub num_blocks: u32,
    /// The request prefill offers and decode asks for.
    #[arg(long, default_value = "probe")]
    pub request: String,
    /// Tokens of the request.
    #[arg(long, default_value_t = 100)]
    pub tokens: u64,
    /// Decode: the prefill engine's side-channel address (its PDEndpoint's spec.address): run
    /// one request and exit.
    #[arg(long)]
    pub prefill: Option<String>,
}

/// The synthetic pattern's seed for a request: both sides derive it from the id alone.
fn seed(request: &str) -> u64 {
    request.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn env(name: &str) -> Result<String, UsageError> {
    std::env::var(name).map_err(|_| {
        UsageError(format!(
            "{name} is not set: this engine runs in a Pod the pdpair operator made"
        ))
    })
}

/// How long an engine waits for its own PDPair's pairing Secret when the one mounted is an earlier
/// PDPair's of the same name (the kubelet refreshes a mounted Secret within about 90 s).
const PAIRING_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

/// The pairing key at `path`; with `uid` (the engine's `PDPAIR_UID`) and a `pdpair-uid` file beside
/// the key (the operator writes both into the Secret), only once that file names `uid`, waiting up
/// to `wait` for the kubelet to bring it (as the vLLM connector does: a pod rendered before the
/// Secret's name held its PDPair's uid could mount a predecessor's). A Secret without the file is
/// taken as it is.
fn pairing_key(path: &std::path::Path, uid: Option<&str>, wait: std::time::Duration) -> Result<Vec<u8>, String> {
    let uid_path = path.with_file_name("pdpair-uid");
    let read_uid = || -> Result<Option<String>, String> {
        if uid.is_none() {
            return Ok(None);
        }
        match std::fs::read_to_string(&uid_path) {
            Ok(s) => Ok(Some(s.trim().to_owned())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", uid_path.display())),
        }
    };
    let until = std::time::Instant::now() + wait;
    loop {
        let before = read_uid()?;
        let key = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let after = read_uid()?;
        match (&before, &after) {
            (None, None) => return Ok(key),
            (Some(b), Some(a)) if b == a && Some(a.as_str()) == uid => return Ok(key),
            _ if std::time::Instant::now() >= until => {
                return Err(format!(
                    "the pairing key at {} is PDPair uid {}'s, not this pod's PDPair's ({}): this pod mounts another PDPair's pairing Secret (one of a PDPair of this name deleted before, mounted by a pod rendered before the Secret's name held the uid), and its own has not reached it in {} s",
                    path.display(),
                    after.as_deref().unwrap_or("(being replaced)"),
                    uid.unwrap_or_default(),
                    wait.as_secs()
                ));
            }
            _ => std::thread::sleep(std::time::Duration::from_millis(500)),
        }
    }
}

/// Runs the test engine.
pub fn run(args: &TestEngineArgs, out: &mut dyn Write) -> Result<(), UsageError> {
    let role = match env("PDPAIR_ROLE")?.as_str() {
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        other => return Err(UsageError(format!("PDPAIR_ROLE is {other:?}, not prefill or decode"))),
    };
    let kv: KvGeometry = serde_json::from_str(&env("PDPAIR_KV")?)
        .map_err(|e| UsageError(format!("PDPAIR_KV is not a kv geometry: {e}")))?;
    let parallelism: Parallelism = match std::env::var("PDPAIR_PARALLELISM") {
        Ok(p) => serde_json::from_str(&p).map_err(|e| UsageError(format!("PDPAIR_PARALLELISM: {e}")))?,
        Err(_) => Parallelism::default(),
    };
    let key_file = PathBuf::from(env("PDPAIR_PAIRING_KEY_FILE")?);
    let uid = std::env::var("PDPAIR_UID").ok().filter(|u| !u.is_empty());
    let key = pairing_key(&key_file, uid.as_deref(), PAIRING_WAIT).map_err(UsageError)?;
    let pod = env("PDPAIR_POD_NAME")?;
    let socket = PathBuf::from(env("PDPAIR_AGENT_SOCKET")?);
    let one_shot = args.prefill.is_some();
    let reg = PoolRegistration {
        api_version: crate::engine_api::API_VERSION,
        pdpair: format!("{}/{}", env("PDPAIR_NAMESPACE")?, env("PDPAIR_NAME")?),
        role,
        // Unique on the node: the Pod's name (and a second engine of a one-shot request).
        engine: crate::engine_api::engine_name_within(if one_shot {
            format!("{pod}-{}", std::process::id())
        } else {
            pod.clone()
        }),
        pod: Some(pod),
        mode: None,
        checksum: None,
        handshake_timeout_ms: None,
        lease_ms: None,
        parallelism,
        kv,
        pairing_key: hex_bytes::encode(&key),
        memory_fd: false,
        memory_path: None,
        num_blocks: args.num_blocks,
        tensor_rank: 0,
        instance: None,
        pod_engines: None,
        kv_arrangement: None,
        regions: Vec::new(),
        gpu: None,
        staging: None,
        address: None,
    };
    let mut engine = SyntheticEngine::register_as(&socket, reg).map_err(UsageError)?;
    let say = |out: &mut dyn Write, v: serde_json::Value| {
        writeln!(out, "{v}")
            .and_then(|()| out.flush())
            .map_err(|e| UsageError(format!("writing output: {e}")))
    };
    say(
        out,
        serde_json::json!({"registered": engine.address, "role": role.as_str()}),
    )?;
    let block = u64::from(engine.layout.block_size.max(1));
    let n = u32::try_from(args.tokens.div_ceil(block)).unwrap_or(u32::MAX);
    if n == 0 || n > args.num_blocks {
        return Err(UsageError(format!(
            "--tokens {} needs {n} blocks of {block}; the pool has --num-blocks {}",
            args.tokens, args.num_blocks
        )));
    }
    let blocks: Vec<u32> = (0..n).collect();
    let request = args.request.clone();
    match (role, &args.prefill) {
        (Role::Prefill, _) => loop {
            engine.fill(seed(&request), &blocks, 0, args.tokens);
            engine
                .send(&EngineRequest::KvReady {
                    release_token: None,
                    request: request.clone(),
                    blocks: blocks.clone(),
                    num_tokens: args.tokens,
                    first_token: 0,
                    prompt: Some(crate::synthetic::prompt(seed(&request), args.tokens)),
                    event: None,
                })
                .map_err(|e| UsageError(e.to_string()))?;
            loop {
                let event = engine.next_event().map_err(|e| UsageError(e.to_string()))?;
                let final_ = !matches!(event, AgentEvent::TransferStarted { .. });
                say(out, serde_json::to_value(&event).unwrap_or_default())?;
                if final_ {
                    break;
                }
            }
        },
        (Role::Decode, None) => loop {
            // Registered; nothing to ask for. Events (none expected) are logged.
            let event = engine.next_event().map_err(|e| UsageError(e.to_string()))?;
            say(out, serde_json::to_value(&event).unwrap_or_default())?;
        },
        (Role::Decode, Some(prefill)) => {
            engine.clear(&blocks);
            engine
                .send(&EngineRequest::ExpectKv {
                    request: request.clone(),
                    prefill: prefill.clone(),
                    blocks: blocks.clone(),
                    num_tokens: args.tokens,
                    first_token: 0,
                    prompt: Some(crate::synthetic::prompt(seed(&request), args.tokens)),
                    event: None,
                })
                .map_err(|e| UsageError(e.to_string()))?;
            let event = engine.next_event().map_err(|e| UsageError(e.to_string()))?;
            let bad = engine.verify(seed(&request), &blocks, 0, args.tokens);
            let mut v = serde_json::to_value(&event).unwrap_or_default();
            v["bad_tokens"] = bad.into();
            say(out, v)?;
            if matches!(event, AgentEvent::RequestDone { .. }) && bad == 0 {
                Ok(())
            } else {
                Err(UsageError(format!(
                    "the request did not arrive intact ({bad} wrong tokens)"
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::pairing_key;

    #[test]
    fn a_pairing_key_of_an_earlier_pdpair_of_the_name_is_waited_out_and_then_refused() {
        let dir = std::env::temp_dir().join(format!("pdpair-pairing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (key, uid) = (dir.join("key"), dir.join("pdpair-uid"));
        std::fs::write(&key, b"old-key").expect("key");
        std::fs::write(&uid, "uid-old").expect("uid");
        // The kubelet brings the new PDPair's Secret a moment later.
        let (k, u) = (key.clone(), uid.clone());
        let kubelet = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            std::fs::write(&k, b"new-key").expect("key");
            std::fs::write(&u, "uid-new").expect("uid");
        });
        let got = pairing_key(&key, Some("uid-new"), Duration::from_secs(20)).expect("the new key");
        assert_eq!(got, b"new-key");
        kubelet.join().expect("kubelet");
        // Never brought: refused, naming both.
        std::fs::write(&uid, "uid-old").expect("uid");
        let e = pairing_key(&key, Some("uid-new"), Duration::from_millis(300)).expect_err("an earlier pair's");
        assert!(e.contains("uid uid-old's") && e.contains("(uid-new)"), "{e}");
        // No uid asked for, or none beside the key: the key as it is.
        assert_eq!(pairing_key(&key, None, Duration::ZERO).expect("key"), b"new-key");
        std::fs::remove_file(&uid).expect("rm");
        assert_eq!(
            pairing_key(&key, Some("uid-new"), Duration::ZERO).expect("key"),
            b"new-key"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
