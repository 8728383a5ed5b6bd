//! Why a request or a connection failed: one closed set of reasons, shared by the side channel,
//! the engine API, metrics labels and PDEndpoint status.
//!
//! On the wire a reason is its name as a string. A name this agent does not know (a newer peer,
//! or a hostile one) becomes [`Reason::Unknown`], so nothing a peer chooses can become a metric
//! label or a status value: the set of label values is fixed at compile time.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A stable failure reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// A rule of the rule table refused the pair.
    Rule(pdpair_api::Reason),
    /// Authentication failed (wrong or missing pairing secret, a replayed or forged proof).
    Unauthenticated,
    /// The peers speak different protocol versions.
    VersionMismatch,
    /// The peer serves another PDPair.
    PairMismatch,
    /// Both engines have the same role.
    RoleMismatch,
    /// Transfer mode or checksum policy differ.
    TransferSettingsMismatch,
    /// The peer's memory description does not fit its geometry, or lies outside its region.
    MemoryLayoutMismatch,
    /// The tensor-parallel ranks' heads do not line up.
    WrongTensorRank,
    /// The rule table admits the pair but this agent cannot serve it yet.
    AgentUnsupported,
    /// A request or message is malformed, out of range, or a duplicate.
    InvalidRequest,
    /// A request for the other role's engines.
    WrongRole,
    /// The connection failed before the handshake finished (I/O, timeout, framing).
    HandshakeFailed,
    /// The peer broke the protocol (an unexpected or unauthentic frame).
    ProtocolError,
    /// Too many connections are waiting to authenticate (per source or in all).
    Busy,
    /// UCX could not connect or unpack the peer's key.
    TransportFailed,
    /// Posting or completing the WRITEs failed.
    WriteFailed,
    /// Posting or completing the READs failed.
    ReadFailed,
    /// A transfer did not complete before its request's deadline and was cancelled.
    TransferTimeout,
    /// The peer went away (closed, or silent past its heartbeats).
    PeerLost,
    /// Decode got no KV before the request's deadline.
    DeadlineExceeded,
    /// Prefill held the request's blocks past the lease.
    LeaseExpired,
    /// Decode and prefill disagree on the request's token count.
    TokenCountMismatch,
    /// Decode's blocks ask for tokens prefill's blocks do not hold.
    TokenRangeNotCovered,
    /// Decode's engine and prefill's computed different prompts (their prompt digests differ,
    /// or one gave none): no KV moves.
    PromptMismatch,
    /// Received KV does not match prefill's checksums.
    ChecksumMismatch,
    /// Received KV could not be verified (FailClosed).
    ChecksumUnverified,
    /// A reason this agent does not know (sent by a peer).
    Unknown,
}

/// Every reason other than the rule table's, for parsing and documentation.
const OWN: [Reason; 26] = [
    Reason::Unauthenticated,
    Reason::VersionMismatch,
    Reason::PairMismatch,
    Reason::RoleMismatch,
    Reason::TransferSettingsMismatch,
    Reason::MemoryLayoutMismatch,
    Reason::WrongTensorRank,
    Reason::AgentUnsupported,
    Reason::InvalidRequest,
    Reason::WrongRole,
    Reason::HandshakeFailed,
    Reason::ProtocolError,
    Reason::Busy,
    Reason::TransportFailed,
    Reason::WriteFailed,
    Reason::ReadFailed,
    Reason::TransferTimeout,
    Reason::PeerLost,
    Reason::DeadlineExceeded,
    Reason::LeaseExpired,
    Reason::TokenCountMismatch,
    Reason::TokenRangeNotCovered,
    Reason::PromptMismatch,
    Reason::ChecksumMismatch,
    Reason::ChecksumUnverified,
    Reason::Unknown,
];

impl Reason {
    /// The stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Rule(r) => r.as_str(),
            Reason::Unauthenticated => "Unauthenticated",
            Reason::VersionMismatch => "VersionMismatch",
            Reason::PairMismatch => "PairMismatch",
            Reason::RoleMismatch => "RoleMismatch",
            Reason::TransferSettingsMismatch => "TransferSettingsMismatch",
            Reason::MemoryLayoutMismatch => "MemoryLayoutMismatch",
            Reason::WrongTensorRank => "WrongTensorRank",
            Reason::AgentUnsupported => "AgentUnsupported",
            Reason::InvalidRequest => "InvalidRequest",
            Reason::WrongRole => "WrongRole",
            Reason::HandshakeFailed => "HandshakeFailed",
            Reason::ProtocolError => "ProtocolError",
            Reason::Busy => "Busy",
            Reason::TransportFailed => "TransportFailed",
            Reason::WriteFailed => "WriteFailed",
            Reason::ReadFailed => "ReadFailed",
            Reason::TransferTimeout => "TransferTimeout",
            Reason::PeerLost => "PeerLost",
            Reason::DeadlineExceeded => "DeadlineExceeded",
            Reason::LeaseExpired => "LeaseExpired",
            Reason::TokenCountMismatch => "TokenCountMismatch",
            Reason::TokenRangeNotCovered => "TokenRangeNotCovered",
            Reason::PromptMismatch => "PromptMismatch",
            Reason::ChecksumMismatch => "ChecksumMismatch",
            Reason::ChecksumUnverified => "ChecksumUnverified",
            Reason::Unknown => "Unknown",
        }
    }

    /// The reason with this name; [`Reason::Unknown`] for any other text.
    pub fn parse(name: &str) -> Reason {
        pdpair_api::Reason::ALL
            .iter()
            .map(|r| Reason::Rule(*r))
            .chain(OWN)
            .find(|r| r.as_str() == name)
            .unwrap_or(Reason::Unknown)
    }

    /// Every reason: the rule table's, then the agent's.
    pub fn all() -> impl Iterator<Item = Reason> {
        pdpair_api::Reason::ALL.iter().map(|r| Reason::Rule(*r)).chain(OWN)
    }

    /// Whether this is a refused handshake (authentication, the rule table, a geometry or memory
    /// the agents cannot pair), as opposed to a failed transfer.
    pub fn is_handshake_rejection(self) -> bool {
        matches!(
            self,
            Reason::Rule(_)
                | Reason::Unauthenticated
                | Reason::VersionMismatch
                | Reason::PairMismatch
                | Reason::RoleMismatch
                | Reason::TransferSettingsMismatch
                | Reason::MemoryLayoutMismatch
                | Reason::WrongTensorRank
                | Reason::AgentUnsupported
        )
    }
}

impl Reason {
    /// Whether a failed request for this reason is routine engine-side business (an expired
    /// lease, a deadline the engine let pass, a request the agent refused as malformed or
    /// misrouted), not news about the transfer path: counted, but not held against the pair's
    /// transfer health. Handshake rejections are neither (see [`Reason::is_handshake_rejection`]).
    pub fn is_routine(self) -> bool {
        matches!(
            self,
            Reason::InvalidRequest
                | Reason::WrongRole
                | Reason::Busy
                | Reason::DeadlineExceeded
                | Reason::LeaseExpired
                | Reason::TokenCountMismatch
                | Reason::TokenRangeNotCovered
                | Reason::PromptMismatch
        )
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<String> for Reason {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Reason {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl From<pdpair_api::Reason> for Reason {
    fn from(r: pdpair_api::Reason) -> Reason {
        Reason::Rule(r)
    }
}

impl Serialize for Reason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Reason {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Reason, D::Error> {
        // Borrowed when the input allows, owned otherwise (escaped JSON strings).
        let name = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Ok(Reason::parse(&name))
    }
}

/// The names of a list of reasons (for the engine API and status).
pub fn names(reasons: &[Reason]) -> Vec<String> {
    reasons.iter().map(|r| r.as_str().to_owned()).collect()
}

/// Reasons a peer sent: deduplicated (so a peer cannot grow a list by repeating a name) and
/// sorted, so a list from the wire holds at most one of each known reason and `Unknown`.
pub fn from_peer(reasons: impl IntoIterator<Item = Reason>) -> Vec<Reason> {
    let mut out: Vec<Reason> = reasons.into_iter().collect();
    out.sort();
    out.dedup();
    if out.is_empty() {
        out.push(Reason::Unknown);
    }
    out
}

/// The most of a peer's free text that reaches a log line, an engine or a status: printable,
/// with control characters and quotes escaped, and cut to [`MAX_PEER_TEXT`] characters.
pub fn peer_text(text: &str) -> String {
    let mut out: String = text.chars().take(MAX_PEER_TEXT).flat_map(char::escape_debug).collect();
    if text.chars().count() > MAX_PEER_TEXT {
        out.push_str("...");
    }
    out
}

/// Characters of a peer's free text kept by [`peer_text`].
pub const MAX_PEER_TEXT: usize = 300;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back_and_anything_else_is_unknown() {
        for r in Reason::all() {
            assert_eq!(Reason::parse(r.as_str()), r, "{r}");
        }
        assert_eq!(Reason::parse("Owned-By-Mallory"), Reason::Unknown);
        assert_eq!(Reason::parse(""), Reason::Unknown);
        let parsed: Vec<Reason> = serde_json::from_str(r#"["LayoutMismatch","PeerLost","x\"y"]"#).expect("json");
        assert_eq!(
            parsed,
            vec![
                Reason::Rule(pdpair_api::Reason::LayoutMismatch),
                Reason::PeerLost,
                Reason::Unknown
            ]
        );
    }

    #[test]
    fn a_million_peer_reasons_become_at_most_the_closed_set() {
        let many = (0..1_000_000).map(|i| Reason::parse(&format!("reason-{i}")));
        assert_eq!(from_peer(many), vec![Reason::Unknown]);
        let all = Reason::all().count();
        assert!(from_peer(Reason::all().chain(Reason::all())).len() == all);
    }

    #[test]
    fn peer_text_is_escaped_and_bounded() {
        let t = peer_text("a\nb\u{1b}[31m\"");
        assert!(!t.contains('\n') && !t.contains('\u{1b}'), "{t}");
        assert_eq!(peer_text(&"x".repeat(10_000)).len(), MAX_PEER_TEXT + 3);
    }
}
