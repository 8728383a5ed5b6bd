//! Which prefill engine holds which side-channel address on this agent, kept in a file in the
//! pool directory so that it outlives the agent. An agent that restarts while its engines keep
//! running loses their listeners; each engine then registers again naming the address it had
//! (`RegisterPool.address`), which decode engines still dial. Without this record, whichever
//! engine registered first could name any of those addresses and take it: another pair's
//! decode engines then dialled a stranger, which refused them, until the owner was told its
//! new address. With it, an address held when the agent stopped goes back only to the engine
//! (PDPair and engine name) that held it, for [`KEPT_FOR`] after the agent starts; another
//! engine naming it gets a new port.

use std::{
    collections::HashMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Mutex,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use crate::lock;

/// How long after the agent starts an address held when it last stopped stays its engine's
/// alone: the node's engines register again well within it (the connector retries every few
/// seconds), and an engine that never comes back does not keep its port from others for good.
pub const KEPT_FOR: Duration = Duration::from_secs(600);

/// The most bytes of the record read back (a claim is under 1 KiB, and an agent holds at most
/// [`super::MAX_ENGINES`] engines): a larger file is ignored.
const MAX_RECORD: u64 = 1 << 20;

/// One address held by one engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Claim {
    address: SocketAddr,
    pdpair: String,
    engine: String,
}

/// Who holds each address: `now` for an engine registered since the agent started, else one
/// read back from the record (held when the agent last stopped).
#[derive(Debug)]
pub(crate) struct Claims {
    path: PathBuf,
    /// Until when claims read back are kept ([`KEPT_FOR`] after the agent started).
    kept_until: Instant,
    held: Mutex<HashMap<SocketAddr, (String, String, bool)>>,
}

impl Claims {
    /// The record of the agent named `agent` in `dir`, read back (a missing, unreadable or
    /// malformed one is an empty record, and the agent says so when it is not missing).
    pub(crate) fn load(dir: &Path, agent: &str) -> Claims {
        let name: String = agent
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let path = dir.join(format!("side-channels-{name}.json"));
        Claims::from_file(path, Instant::now() + KEPT_FOR)
    }

    fn from_file(path: PathBuf, kept_until: Instant) -> Claims {
        let read = || -> Result<Vec<Claim>, String> {
            let file = std::fs::File::open(&path).map_err(|e| e.to_string())?;
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::Read::take(file, MAX_RECORD + 1), &mut text)
                .map_err(|e| e.to_string())?;
            if text.len() as u64 > MAX_RECORD {
                return Err(format!("over {MAX_RECORD} bytes"));
            }
            serde_json::from_str(&text).map_err(|e| e.to_string())
        };
        let claims = match read() {
            Ok(claims) => claims,
            Err(_) if !path.exists() => Vec::new(),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "the record of the engines' side-channel addresses is unreadable; starting without it");
                Vec::new()
            }
        };
        let held = claims
            .into_iter()
            .take(super::MAX_ENGINES)
            .map(|c| (c.address, (c.pdpair, c.engine, false)))
            .collect();
        Claims {
            path,
            kept_until,
            held: Mutex::new(held),
        }
    }

    /// Whether engine `engine` of `pdpair` may listen at `at`: no other engine holds it, or
    /// held it when the agent stopped less than [`KEPT_FOR`] ago.
    pub(crate) fn allows(&self, at: SocketAddr, pdpair: &str, engine: &str) -> bool {
        match lock(&self.held).get(&at) {
            Some((p, e, now)) if (p.as_str(), e.as_str()) != (pdpair, engine) => {
                !*now && Instant::now() >= self.kept_until
            }
            _ => true,
        }
    }

    /// Engine `engine` of `pdpair` listens at `at` now.
    pub(crate) fn hold(&self, at: SocketAddr, pdpair: &str, engine: &str) {
        let mut held = lock(&self.held);
        held.insert(at, (pdpair.to_owned(), engine.to_owned(), true));
        self.save(&mut held);
    }

    /// Engine `engine` of `pdpair` left `at` (its engine went): anyone may have it.
    pub(crate) fn release(&self, at: SocketAddr, pdpair: &str, engine: &str) {
        let mut held = lock(&self.held);
        if held
            .get(&at)
            .is_some_and(|(p, e, _)| (p.as_str(), e.as_str()) == (pdpair, engine))
        {
            held.remove(&at);
            self.save(&mut held);
        }
    }

    /// Writes the record (whole, then renamed over the old one): what is held now, and what
    /// was held before the agent started while it is still kept.
    fn save(&self, held: &mut HashMap<SocketAddr, (String, String, bool)>) {
        let kept = Instant::now() < self.kept_until;
        held.retain(|_, (_, _, now)| *now || kept);
        let claims: Vec<Claim> = held
            .iter()
            .map(|(address, (pdpair, engine, _))| Claim {
                address: *address,
                pdpair: pdpair.clone(),
                engine: engine.clone(),
            })
            .collect();
        let tmp = self.path.with_extension("json.tmp");
        // A new file of its own (a link left there is removed, not written through).
        let _ = std::fs::remove_file(&tmp);
        let write = |bytes: Vec<u8>| {
            use std::{io::Write, os::unix::fs::OpenOptionsExt};
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW)
                .mode(0o600)
                .open(&tmp)
                .and_then(|mut f| f.write_all(&bytes))
                .map_err(|e| e.to_string())
        };
        let written = serde_json::to_vec(&claims)
            .map_err(|e| e.to_string())
            .and_then(write)
            .and_then(|()| std::fs::rename(&tmp, &self.path).map_err(|e| e.to_string()));
        if let Err(e) = written {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot write the record of the engines' side-channel addresses; after a restart another engine may take one");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 5], port))
    }

    #[test]
    fn an_address_held_when_the_agent_stopped_goes_back_only_to_its_engine_for_a_while() {
        let dir = std::env::temp_dir().join(format!("pdpair-claims-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let before = Claims::load(&dir, "node/1");
        before.hold(addr(40000), "team-a/p", "p0");
        before.hold(addr(40001), "team-b/q", "q0");
        before.release(addr(40001), "team-b/q", "q0");
        // Another engine's release of an address it does not hold changes nothing.
        before.release(addr(40000), "team-b/q", "q0");
        assert!(!before.allows(addr(40000), "team-b/q", "q0"), "held now by another");
        drop(before);
        // The agent restarts: the record is read back.
        let after = Claims::load(&dir, "node/1");
        assert!(after.allows(addr(40000), "team-a/p", "p0"), "its engine");
        assert!(!after.allows(addr(40000), "team-b/q", "q0"), "another pair's engine");
        assert!(
            !after.allows(addr(40000), "team-a/p", "p1"),
            "another engine of the pair"
        );
        assert!(
            after.allows(addr(40001), "team-b/q", "x"),
            "released before the restart"
        );
        assert!(after.allows(addr(40002), "team-b/q", "q0"), "never held");
        // Past KEPT_FOR an engine that never came back no longer keeps it.
        let path = dir.join("side-channels-node_1.json");
        let late = Claims::from_file(path.clone(), Instant::now());
        assert!(late.allows(addr(40000), "team-b/q", "q0"));
        // And a record that is not one is ignored (the agent starts without it).
        std::fs::write(&path, b"{not json").expect("write");
        assert!(Claims::load(&dir, "node/1").allows(addr(40000), "team-b/q", "q0"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_record_is_written_as_a_file_of_its_own_not_through_a_link_left_in_its_place() {
        // The agent runs as root: a link at the record's temporary name, left by whoever could
        // write the directory, had the agent write the record over any file it points to.
        let dir = std::env::temp_dir().join(format!("pdpair-claims-link-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let victim = dir.join("victim");
        std::fs::write(&victim, b"precious").expect("victim");
        std::os::unix::fs::symlink(&victim, dir.join("side-channels-node_1.json.tmp")).expect("link");
        let claims = Claims::load(&dir, "node/1");
        claims.hold(addr(40000), "team-a/p", "p0");
        assert_eq!(std::fs::read(&victim).expect("victim"), b"precious");
        assert!(
            !Claims::load(&dir, "node/1").allows(addr(40000), "team-b/q", "q0"),
            "recorded"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
