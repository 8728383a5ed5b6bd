//! Where a decode agent dials, and how many dials it has in flight to one host: a decode
//! engine names its prefill engines' addresses, and its agent, on the host's network, dials
//! them. [`Dialable`] refuses what no prefill engine listens at; [`DialGate`] keeps a burst of
//! new links within what a prefill agent accepts from one source before authentication.

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr, TcpListener},
    ops::RangeInclusive,
    sync::{Condvar, Mutex},
    time::{Duration, Instant},
};

use crate::lock;

/// Whether the kernel picks `port` for port 0: in `range` (`net.ipv4.ip_local_port_range`,
/// which IPv6 uses too; Linux's default where unreadable) and not in `reserved`
/// (`net.ipv4.ip_local_reserved_ports`: `8080,9000-9100`; unreadable: none).
fn ephemeral(port: u16, range: &str, reserved: &str) -> bool {
    let mut bounds = range.split_whitespace().map(str::parse::<u16>);
    let (low, high) = match (bounds.next(), bounds.next()) {
        (Some(Ok(l)), Some(Ok(h))) => (l, h),
        _ => (32768, 60999),
    };
    (low..=high).contains(&port) && !reserved_port(port, reserved)
}

/// Whether `reserved` (`net.ipv4.ip_local_reserved_ports`: `8080,9000-9100`) holds `port`.
fn reserved_port(port: u16, reserved: &str) -> bool {
    reserved.trim().split(',').filter(|s| !s.is_empty()).any(|part| {
        let mut ends = part.trim().splitn(2, '-').map(str::parse::<u16>);
        match (ends.next(), ends.next()) {
            (Some(Ok(a)), None) => port == a,
            (Some(Ok(a)), Some(Ok(b))) => (a..=b).contains(&port),
            // Unreadable: taken as reserving everything, so nothing is bound by request.
            _ => true,
        }
    })
}

/// Ports Kubernetes' own node and control-plane services listen at: a side-channel range may
/// hold none (a decode agent would dial them at an engine's word, on any node).
const NODE_SERVICE_PORTS: [(u16, &str); 11] = [
    (2379, "etcd"),
    (2380, "etcd's peers"),
    (2381, "etcd's metrics"),
    (6443, "the API server"),
    (10248, "the kubelet's health"),
    (10249, "kube-proxy's metrics"),
    (10250, "the kubelet"),
    (10255, "the kubelet's read-only port"),
    (10256, "kube-proxy's health"),
    (10257, "kube-controller-manager"),
    (10259, "kube-scheduler"),
];

/// Kubernetes' default NodePort range: on a node's host network any Service is reached there.
const NODE_PORTS: RangeInclusive<u16> = 30000..=32767;

/// Whether `range` may be the side-channel ports: from 1024 (ports below are services' by
/// definition), not reversed, holding none of [`NODE_SERVICE_PORTS`]. `Err` names the range and
/// says why.
pub fn check_side_channel_ports(range: &RangeInclusive<u16>) -> Result<(), String> {
    let (low, high) = (*range.start(), *range.end());
    side_channel_ports_refused(range).map_or(Ok(()), |why| {
        Err(format!("side-channel port range {low}-{high}: {why}"))
    })
}

/// Why `range` may not be the side-channel ports ([`check_side_channel_ports`]).
fn side_channel_ports_refused(range: &RangeInclusive<u16>) -> Option<String> {
    let (low, high) = (*range.start(), *range.end());
    if low < 1024 {
        return Some(format!(
            "starts at {low}, below 1024, where services listen (an engine could make its agent dial one)"
        ));
    }
    if low > high {
        return Some(format!("{low} is above {high}"));
    }
    NODE_SERVICE_PORTS
        .iter()
        .find(|(p, _)| range.contains(p))
        .map(|(port, what)| {
            format!("holds {port}, where {what} listens (an engine could make its agent dial it on any node)")
        })
}

/// `--side-channel-ports`: `LOW-HIGH`, from 1024 (ports below are services' by definition:
/// a range holding them would let an engine make its agent dial one) to 65535.
pub fn parse_side_channel_ports(text: &str) -> Result<RangeInclusive<u16>, String> {
    let bad = |why: &str| format!("side-channel port range {text:?}: {why}");
    let (low, high) = text
        .trim()
        .split_once('-')
        .ok_or_else(|| bad("expected LOW-HIGH, as 40000-40999"))?;
    let port = |s: &str| {
        s.trim()
            .parse::<u16>()
            .map_err(|_| bad(&format!("{s:?} is not a port (1024-65535)")))
    };
    let range = port(low)?..=port(high)?;
    match side_channel_ports_refused(&range) {
        Some(why) => Err(bad(&why)),
        None => Ok(range),
    }
}

/// The ports prefill engines' side channels listen at.
#[derive(Debug)]
enum Ports {
    /// Any the kernel hands out for port 0: `net.ipv4.ip_local_port_range` here, taken to be the
    /// prefill node's too (where one differs, its engines' ports may be refused, and the message
    /// names the range).
    Kernel(String),
    /// The agents' own range (`--side-channel-ports`), the same on every node: a prefill agent
    /// binds a free port of it, a decode agent dials no other.
    Configured(RangeInclusive<u16>),
}

/// Where a decode agent dials, at its engine's word: only where a prefill engine's side channel
/// can listen, which is at its agent's listen host on a port of the side-channel range: the
/// agents' own where set, else one the kernel hands out ([`super::side_channel_listener`]). An engine naming anything else is refused before a connection
/// is tried: the agent sits on the host's network, and would otherwise reach, or tell its
/// engine whether it can reach, what the engine's own network may not: the node's loopback
/// services, the cloud's metadata address (link-local), a service's port anywhere.
#[derive(Debug)]
pub(crate) struct Dialable {
    /// This agent's listen host: loopback is dialled only when this agent listens there too
    /// (one host's agents, as in tests and local runs).
    own: IpAddr,
    ports: Ports,
    /// `net.ipv4.ip_local_reserved_ports` here, left out of either range.
    reserved: String,
}

impl Dialable {
    /// This host's policy for an agent listening at `own`, its side channels on `configured`
    /// ports where given, else on those the kernel hands out (reads the port sysctls now: the
    /// agent does so once, as it starts).
    pub(crate) fn here(own: IpAddr, configured: Option<RangeInclusive<u16>>) -> Dialable {
        let read = |name: &str| std::fs::read_to_string(format!("/proc/sys/net/ipv4/{name}")).unwrap_or_default();
        Dialable {
            own,
            ports: match configured {
                Some(range) => Ports::Configured(range),
                None => Ports::Kernel(read("ip_local_port_range")),
            },
            reserved: read("ip_local_reserved_ports"),
        }
    }

    /// Whether a prefill engine's side channel may listen at `port`.
    pub(super) fn side_channel_port(&self, port: u16) -> bool {
        match &self.ports {
            Ports::Kernel(range) => ephemeral(port, range, &self.reserved),
            Ports::Configured(range) => range.contains(&port) && !reserved_port(port, &self.reserved),
        }
    }

    /// A new listener for a prefill engine's side channel at `host`: port 0 (the kernel picks),
    /// or a free port of the agents' range, tried from a random one on.
    pub(super) fn listen(&self, host: IpAddr) -> io::Result<TcpListener> {
        let Ports::Configured(range) = &self.ports else {
            return TcpListener::bind(SocketAddr::new(host, 0));
        };
        let (low, count) = (*range.start(), u32::from(*range.end() - *range.start()) + 1);
        let mut seed = [0u8; 4];
        getrandom::fill(&mut seed).map_err(|e| io::Error::other(format!("no randomness: {e}")))?;
        let first = u32::from_le_bytes(seed) % count;
        for i in 0..count {
            let port = u32::from(low) + (first + i) % count;
            let port = u16::try_from(port).map_err(|_| io::Error::other("port past 65535"))?;
            if reserved_port(port, &self.reserved) {
                continue;
            }
            match TcpListener::bind(SocketAddr::new(host, port)) {
                Ok(l) => return Ok(l),
                Err(e) if e.kind() == io::ErrorKind::AddrInUse => continue,
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("port {port} of the side-channel range: {e}"),
                    ));
                }
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "every port of the side-channel range {}-{} (--side-channel-ports) is in use",
                range.start(),
                range.end()
            ),
        ))
    }

    /// Why an agent never listens at `ip`, if it does not: not a unicast address, link-local,
    /// or loopback where this agent does not listen.
    fn not_an_agents(&self, ip: IpAddr) -> Option<&'static str> {
        let ip = ip.to_canonical();
        match ip {
            _ if ip.is_unspecified() || ip.is_multicast() => Some("not a unicast address"),
            IpAddr::V4(v4) if v4.is_broadcast() => Some("not a unicast address"),
            IpAddr::V4(v4) if v4.is_link_local() => Some("link-local (where clouds serve instance metadata)"),
            IpAddr::V6(v6) if v6.is_unicast_link_local() => Some("link-local"),
            _ if ip.is_loopback() && !self.own.to_canonical().is_loopback() => {
                Some("this node's loopback, and this agent does not listen there")
            }
            _ => None,
        }
    }

    /// `Err` naming `sock` and why, when a peer's KV stream (a handshake's `pdpair-tcp:` address)
    /// cannot be there: at an agent's listen host, on a port from 1024 that is none of
    /// Kubernetes' node services' (a stream listens at a port the kernel of its own node hands
    /// out, whose range this node cannot know). A peer holding the pair's key must not make this
    /// agent, on the host's network, connect to this node's loopback services, the metadata
    /// address or a node service, and learn from the refusal whether one listens.
    pub(crate) fn check_stream(&self, sock: SocketAddr) -> Result<(), String> {
        if let Some(why) = self.not_an_agents(sock.ip()) {
            return Err(format!(
                "the peer's KV stream {sock} is {why}: streams listen at their agents' hosts"
            ));
        }
        let port = sock.port();
        if port < 1024 {
            return Err(format!(
                "the peer's KV stream {sock}: port {port} is below 1024, where services listen"
            ));
        }
        if let Some((_, what)) = NODE_SERVICE_PORTS.iter().find(|(p, _)| *p == port) {
            return Err(format!(
                "the peer's KV stream {sock}: port {port} is {what}'s, not a KV stream's"
            ));
        }
        if NODE_PORTS.contains(&port) {
            return Err(format!(
                "the peer's KV stream {sock}: port {port} is in Kubernetes' NodePort range {}-{}, where any Service is reached from the host's network",
                NODE_PORTS.start(),
                NODE_PORTS.end()
            ));
        }
        Ok(())
    }

    /// `Err` naming `addr` and why, when it is not dialled.
    pub(crate) fn check(&self, addr: &str) -> Result<SocketAddr, String> {
        let sock: SocketAddr = addr
            .parse()
            .map_err(|_| format!("prefill address {addr:?} is not an IP address and port"))?;
        if let Some(why) = self.not_an_agents(sock.ip()) {
            return Err(format!(
                "prefill address {addr:?} is {why}: prefill engines listen at their agents' hosts"
            ));
        }
        if !self.side_channel_port(sock.port()) {
            return Err(match &self.ports {
                Ports::Kernel(range) => format!(
                    "prefill address {addr:?}: port {} is not one the kernel hands out (net.ipv4.ip_local_port_range {:?}, less ip_local_reserved_ports {:?}), where every prefill engine's side channel listens",
                    sock.port(),
                    range.trim(),
                    self.reserved.trim()
                ),
                Ports::Configured(range) => format!(
                    "prefill address {addr:?}: port {} is not in the agents' side-channel port range {}-{} (--side-channel-ports) less ip_local_reserved_ports {:?}, where every prefill engine's side channel listens",
                    sock.port(),
                    range.start(),
                    range.end(),
                    self.reserved.trim()
                ),
            });
        }
        Ok(sock)
    }
}

/// Dials from one agent in flight to one prefill host at once, at most: half the places a
/// prefill agent keeps for connections from one source before they authenticate
/// ([`super::MAX_UNAUTHENTICATED_PER_SOURCE`]; it closes more at once, before reading a byte).
/// Without it a burst of new links from one node (a decode engine asked for the KV of twelve
/// prefill engines on one node, or a node's engines starting together) had all past the
/// eighth reset by the prefill agent, and their requests failed with `HandshakeFailed`. Half:
/// the other half is left for this node's other agents and for a dial the prefill agent has
/// not yet seen authenticate after this side finished.
pub const DIALS_PER_HOST: usize = super::MAX_UNAUTHENTICATED_PER_SOURCE / 2;

/// How long a dial holds its place at most: one still in its handshake after this no longer
/// keeps another from dialling. A real prefill agent answers within milliseconds (and frees its
/// pre-auth place once the proof is checked), so a dial past it is stuck at something that does
/// not answer: an address a decode engine named on the prefill's host where no prefill agent
/// listens, or a prefill agent that stopped. Without it one engine naming a few such addresses
/// held every place to that host for its handshake timeout, and the node's other engines could
/// not link to the host's prefill engines meanwhile.
pub const DIAL_PLACE_HELD: Duration = Duration::from_secs(1);

/// Of those places, one owner ([`DialOwner`]) holds at most this many at once: an engine
/// naming many addresses where nothing answers cannot take every place as each goes stale.
pub const DIALS_PER_OWNER_HOST: usize = DIALS_PER_HOST / 2;

/// Whose dial it is, for the fair share of places: the engine's Pod where the agent attests its
/// engines (the ranks of one Pod share one share, so a Pod with many engines gets no more than
/// a Pod with one), otherwise the engine registration.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum DialOwner {
    Pod(std::sync::Arc<str>),
    Engine(u64),
}

/// Dials in flight per prefill host, shared by all engines of an agent (a prefill agent counts
/// them by source address, which is the node's). A free place goes to the waiting dial whose
/// owner holds the fewest fresh places, of those with the fewest dials still going (stale ones
/// too), the longest waiting among those: owners holding places (an insider's
/// engines or Pods naming addresses where nothing answers, each taking a place again as one goes
/// stale) cannot keep one holding none waiting past the next place to free, however many dials
/// they have waiting.
#[derive(Debug)]
pub(crate) struct DialGate {
    hosts: Mutex<HashMap<IpAddr, Host>>,
    freed: Condvar,
    /// [`DIAL_PLACE_HELD`] (shorter in unit tests).
    held: Duration,
    /// The next waiting dial's number (its place in line).
    tickets: std::sync::atomic::AtomicU64,
}

/// One prefill host's places.
#[derive(Debug, Default)]
struct Host {
    /// When each dial in flight took its place, and whose.
    held: Vec<(Instant, DialOwner)>,
    /// Dials waiting for a place, by owner, each owner's in the order they came (tickets
    /// rise): the choice of the next looks at each owner's first only, however many wait.
    waiting: HashMap<DialOwner, std::collections::VecDeque<u64>>,
}

impl Host {
    /// `ticket` of `owner` waits no more.
    fn leave(&mut self, owner: &DialOwner, ticket: u64) {
        if let Some(line) = self.waiting.get_mut(owner) {
            line.retain(|t| *t != ticket);
            if line.is_empty() {
                self.waiting.remove(owner);
            }
        }
    }

    /// Places taken within the last `held`, in all; and by owner, those and every dial of the
    /// owner still going (stale ones too).
    fn fresh(&self, now: Instant, held: Duration) -> (usize, HashMap<&DialOwner, (usize, usize)>) {
        let mut by: HashMap<&DialOwner, (usize, usize)> = HashMap::new();
        let mut all = 0;
        for (at, owner) in &self.held {
            let counts = by.entry(owner).or_default();
            counts.1 += 1;
            if now.duration_since(*at) < held {
                counts.0 += 1;
                all += 1;
            }
        }
        (all, by)
    }
}

impl Default for DialGate {
    fn default() -> DialGate {
        DialGate::holding(DIAL_PLACE_HELD)
    }
}

/// A place to dial one host, given back when dropped.
#[derive(Debug)]
pub(crate) struct DialPass<'a> {
    gate: &'a DialGate,
    host: IpAddr,
    since: Instant,
    owner: DialOwner,
}

impl DialGate {
    fn holding(held: Duration) -> DialGate {
        DialGate {
            hosts: Mutex::new(HashMap::new()),
            freed: Condvar::new(),
            held,
            tickets: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// A place for `owner` to dial `host`, waiting until fewer than [`DIALS_PER_HOST`] dials
    /// to it (and fewer than [`DIALS_PER_OWNER_HOST`] of the owner's) took theirs within the
    /// last [`DIAL_PLACE_HELD`], and no dial waiting for it goes first (the order is
    /// [`DialGate`]'s), and until `until` at most; `Err` naming the host when
    /// none was had in time.
    pub(crate) fn enter(&self, host: IpAddr, owner: DialOwner, until: Instant) -> Result<DialPass<'_>, String> {
        let host = host.to_canonical();
        let ticket = self.tickets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut hosts = lock(&self.hosts);
        hosts
            .entry(host)
            .or_default()
            .waiting
            .entry(owner.clone())
            .or_default()
            .push_back(ticket);
        loop {
            let now = Instant::now();
            let h = hosts.entry(host).or_default();
            let (all, by) = h.fresh(now, self.held);
            let holds = |o: &DialOwner| by.get(o).copied().unwrap_or((0, 0));
            // The first in line of the dials that may take a place now: of the owners holding
            // fewest places, those with fewest dials still going (a place that went stale leaves
            // its owner holding one fewer, but its dial is still going: it does not win its
            // place straight back from an owner that has none), then the longest waiting.
            let first = h
                .waiting
                .iter()
                .filter(|(o, _)| holds(o).0 < DIALS_PER_OWNER_HOST)
                .filter_map(|(o, line)| Some((holds(o), *line.front()?)))
                .min()
                .map(|(_, t)| t);
            if all < DIALS_PER_HOST && first == Some(ticket) {
                h.leave(&owner, ticket);
                h.held.push((now, owner.clone()));
                drop(hosts);
                // Another place may be free for the next in line.
                self.freed.notify_all();
                return Ok(DialPass {
                    gate: self,
                    host,
                    since: now,
                    owner,
                });
            }
            if until <= now {
                h.leave(&owner, ticket);
                if h.held.is_empty() && h.waiting.is_empty() {
                    hosts.remove(&host);
                }
                drop(hosts);
                // Whoever was behind this one may go now.
                self.freed.notify_all();
                return Err(format!(
                    "{DIALS_PER_HOST} dials to prefill host {host} are in flight already and none ended in time"
                ));
            }
            // Until a place is given back or taken, or the first of those held goes stale.
            let stale_at = h
                .held
                .iter()
                .map(|(at, _)| *at + self.held)
                .filter(|at| *at > now)
                .min()
                .unwrap_or(until);
            let wake = stale_at.min(until).saturating_duration_since(now);
            hosts = match self.freed.wait_timeout(hosts, wake) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }

    #[cfg(test)]
    fn in_flight(&self, host: IpAddr) -> usize {
        lock(&self.hosts).get(&host.to_canonical()).map_or(0, |h| h.held.len())
    }

    #[cfg(test)]
    fn waiting(&self, host: IpAddr) -> usize {
        lock(&self.hosts)
            .get(&host.to_canonical())
            .map_or(0, |h| h.waiting.values().map(|l| l.len()).sum())
    }
}

impl Drop for DialPass<'_> {
    fn drop(&mut self) {
        let mut hosts = lock(&self.gate.hosts);
        if let Some(h) = hosts.get_mut(&self.host) {
            if let Some(i) = h.held.iter().position(|(at, o)| *at == self.since && *o == self.owner) {
                h.held.swap_remove(i);
            }
            if h.held.is_empty() && h.waiting.is_empty() {
                hosts.remove(&self.host);
            }
        }
        drop(hosts);
        self.gate.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_dials_only_where_a_prefill_engine_can_listen() {
        let policy = |own: &str| Dialable {
            own: own.parse().expect("ip"),
            ports: Ports::Kernel("32768\t60999\n".into()),
            reserved: "50000\n".into(),
        };
        let node = policy("10.0.0.5");
        // A peer's KV stream: at an agent's host, a port from 1024 no node service has (its
        // node's ephemeral range may not be this one's).
        let stream = |a: &str| node.check_stream(a.parse().expect("addr"));
        for good in ["10.0.0.7:40000", "10.0.0.7:1024", "10.0.0.7:20000"] {
            assert_eq!(stream(good), Ok(()), "{good}");
        }
        for (bad, why) in [
            ("169.254.169.254:40000", "link-local"),
            ("127.0.0.1:40000", "loopback"),
            ("0.0.0.0:40000", "not a unicast address"),
            ("10.0.0.7:22", "below 1024"),
            ("10.0.0.7:10250", "the kubelet's"),
            ("10.0.0.7:2379", "etcd's"),
            ("10.0.0.7:10255", "read-only"),
            ("10.0.0.7:31000", "NodePort range"),
        ] {
            let e = stream(bad).expect_err(bad);
            assert!(e.contains(bad) && e.contains(why), "{bad}: {e}");
        }
        assert_eq!(
            policy("127.0.0.1").check_stream("127.0.0.1:40000".parse().expect("addr")),
            Ok(())
        );
        assert_eq!(
            node.check("10.0.0.7:40000").map(|a| a.to_string()),
            Ok("10.0.0.7:40000".into()),
            "another node's engine"
        );
        assert!(node.check("[2001:db8::7]:40000").is_ok(), "over IPv6");
        for (addr, why) in [
            ("10.0.0.7:22", "port 22 is not one the kernel hands out"),
            ("10.0.0.7:2379", "port 2379"),
            ("10.0.0.7:61000", "port 61000"),
            ("10.0.0.7:50000", "port 50000"),
            ("127.0.0.1:40000", "this node's loopback"),
            ("[::1]:40000", "this node's loopback"),
            ("[::ffff:127.0.0.1]:40000", "this node's loopback"),
            ("169.254.169.254:40000", "link-local"),
            ("[fe80::1]:40000", "link-local"),
            ("0.0.0.0:40000", "not a unicast address"),
            ("[::]:40000", "not a unicast address"),
            ("224.0.0.1:40000", "not a unicast address"),
            ("255.255.255.255:40000", "not a unicast address"),
            ("metadata.internal:40000", "is not an IP address and port"),
            ("10.0.0.7", "is not an IP address and port"),
        ] {
            let refused = node.check(addr).expect_err(addr);
            assert!(
                refused.contains(why) && refused.contains(&format!("{addr:?}")),
                "{addr}: {refused}"
            );
        }
        // One host's agents (tests, local runs) listen on loopback, and so do their engines.
        let local = policy("127.0.0.1");
        assert!(local.check("127.0.0.1:40000").is_ok());
        assert!(local.check("127.0.0.2:40000").is_ok());
        assert!(local.check("127.0.0.1:22").is_err(), "a service's port still");
    }

    #[test]
    fn a_side_channel_port_range_is_low_high_from_1024_and_errors_name_it() {
        assert_eq!(parse_side_channel_ports("40000-40999"), Ok(40000..=40999));
        assert_eq!(parse_side_channel_ports(" 1024 - 1024 "), Ok(1024..=1024));
        for (text, why) in [
            ("40000", "expected LOW-HIGH"),
            ("", "expected LOW-HIGH"),
            ("80-90", "below 1024"),
            ("0-65535", "below 1024"),
            ("41000-40000", "41000 is above 40000"),
            ("10000-10999", "holds 10248, where the kubelet's health listens"),
            ("10249-10249", "holds 10249, where kube-proxy's metrics listens"),
            ("10250-10250", "holds 10250, where the kubelet listens"),
            ("2000-3000", "holds 2379, where etcd listens"),
            ("x-40000", "\"x\" is not a port"),
            ("40000-70000", "\"70000\" is not a port"),
        ] {
            let e = parse_side_channel_ports(text).expect_err(text);
            assert!(e.contains(&format!("{text:?}")) && e.contains(why), "{text}: {e}");
        }
    }

    #[test]
    fn with_the_agents_range_decode_dials_only_its_ports_and_prefill_listens_only_there() {
        let host: IpAddr = "127.0.0.7".parse().expect("ip");
        let held = TcpListener::bind((host, 0)).expect("bind");
        let low = held.local_addr().expect("addr").port();
        let ours = Dialable {
            own: "10.0.0.5".parse().expect("ip"),
            ports: Ports::Configured(low..=low + 3),
            reserved: String::new(),
        };
        // Streams listen at port 0 whatever the side channels' range.
        assert_eq!(ours.check_stream("10.0.0.7:40000".parse().expect("addr")), Ok(()));
        assert!(ours.check(&format!("10.0.0.7:{}", low + 3)).is_ok());
        for port in [low - 1, low + 4, 22] {
            let addr = format!("10.0.0.7:{port}");
            let refused = ours.check(&addr).expect_err(&addr);
            assert!(
                refused.contains(&format!("{addr:?}"))
                    && refused.contains(&format!("range {low}-{} (--side-channel-ports)", low + 3)),
                "{refused}"
            );
        }
        // Prefill listens at the range's free ports, each once, and at no other.
        // One of the range's ports is reserved on this node (ip_local_reserved_ports).
        let local = Dialable {
            own: host,
            ports: Ports::Configured(low..=low + 4),
            reserved: format!("{}\n", low + 2),
        };
        let mut bound: Vec<TcpListener> = Vec::new();
        let full = loop {
            match local.listen(host) {
                Ok(l) => bound.push(l),
                Err(e) => break e,
            }
        };
        let mut ports: Vec<u16> = bound.iter().map(|l| l.local_addr().expect("addr").port()).collect();
        ports.sort_unstable();
        assert_eq!(
            ports,
            vec![low + 1, low + 3, low + 4],
            "the held and the reserved ones skipped"
        );
        assert!(
            local.check(&format!("{host}:{}", low + 2)).is_err(),
            "a reserved port is not dialled"
        );
        assert_eq!(full.kind(), io::ErrorKind::AddrInUse);
        assert!(
            full.to_string().contains("every port of the side-channel range"),
            "{full}"
        );
        drop(held);
        let again = local.listen(host).expect("the freed one");
        assert_eq!(again.local_addr().expect("addr").port(), low);
    }

    #[test]
    fn an_engine_gets_back_only_a_port_the_kernel_hands_anyone() {
        assert!(ephemeral(40000, "32768\t60999\n", "\n"));
        assert!(!ephemeral(22, "32768\t60999\n", ""), "a service's port");
        assert!(!ephemeral(61000, "32768\t60999\n", ""));
        assert!(ephemeral(40000, "", ""), "Linux's default range where unreadable");
        assert!(
            !ephemeral(40000, "32768 60999", "8080,39000-41000"),
            "reserved from the range"
        );
        assert!(!ephemeral(50000, "32768 60999", "50000"));
        assert!(ephemeral(50001, "32768 60999", "50000,52000-53000"));
        assert!(
            !ephemeral(40000, "32768 60999", "bogus"),
            "unreadable reservations reserve all"
        );
    }

    #[test]
    fn dials_to_one_host_wait_for_a_place_and_other_hosts_do_not() {
        // Places that stay fresh however slowly the test runs.
        let gate = DialGate::holding(Duration::from_secs(600));
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.7".parse().expect("ip"), "10.0.0.8".parse().expect("ip"));
        let soon = || Instant::now() + Duration::from_millis(50);
        // One owner takes what it can: part of the host's places, not all.
        let mut held = Vec::new();
        let refused = loop {
            match gate.enter(a, DialOwner::Engine(1), soon()) {
                Ok(pass) => held.push(pass),
                Err(e) => break e,
            }
        };
        assert!(refused.contains("10.0.0.7"), "{refused}");
        assert!(
            !held.is_empty() && held.len() < DIALS_PER_HOST,
            "one owner held {} of {DIALS_PER_HOST}",
            held.len()
        );
        // Another owner takes the rest.
        while let Ok(pass) = gate.enter(a, DialOwner::Engine(2), soon()) {
            held.push(pass);
        }
        assert_eq!(held.len(), DIALS_PER_HOST);
        assert!(
            gate.enter(a, DialOwner::Engine(3), soon()).is_err(),
            "no place left for anyone"
        );
        // The same host written as an IPv4-mapped IPv6 address is the same source there.
        assert!(
            gate.enter("::ffff:10.0.0.7".parse().expect("ip"), DialOwner::Engine(3), soon())
                .is_err()
        );
        assert!(
            gate.enter(b, DialOwner::Engine(1), soon()).is_ok(),
            "another host has its own places"
        );
        std::thread::scope(|s| {
            let waiting = s.spawn(|| {
                gate.enter(a, DialOwner::Engine(3), Instant::now() + Duration::from_secs(10))
                    .map(drop)
            });
            wait_for(|| gate.waiting(a) == 1);
            drop(held);
            assert_eq!(
                waiting.join().expect("waiter"),
                Ok(()),
                "a freed place goes to a waiting dial"
            );
        });
        assert_eq!(gate.in_flight(a), 0, "every pass given back");
    }

    #[test]
    fn a_freed_place_goes_to_the_waiting_owner_holding_fewest_then_to_the_longest_waiting() {
        let gate = DialGate::holding(Duration::from_secs(600));
        let a: IpAddr = "10.0.0.7".parse().expect("ip");
        let far = || Instant::now() + Duration::from_secs(10);
        let (one, two, hog, neighbour) = (
            DialOwner::Engine(1),
            DialOwner::Engine(2),
            DialOwner::Pod("insider".into()),
            DialOwner::Pod("neighbour".into()),
        );
        let _one = gate.enter(a, one.clone(), far()).expect("a place");
        let _two = gate.enter(a, two, far()).expect("a place");
        let mut hogged: Vec<_> = (0..DIALS_PER_OWNER_HOST)
            .map(|_| gate.enter(a, hog.clone(), far()).expect("a place"))
            .collect();
        assert_eq!(DIALS_PER_OWNER_HOST + 2, DIALS_PER_HOST, "every place taken");
        let (got_tx, got) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            // Owner one, holding a place already, waits first; then the neighbour, holding none.
            for (n, (who, owner)) in [("one", one), ("neighbour", neighbour)].into_iter().enumerate() {
                let (gate, got_tx) = (&gate, got_tx.clone());
                s.spawn(move || {
                    let pass = gate.enter(a, owner, far());
                    got_tx.send((who, pass.is_ok())).expect("send");
                    // Held until the test ends.
                    std::thread::sleep(Duration::from_millis(300));
                });
                wait_for(|| gate.waiting(a) == n + 1);
            }
            hogged.pop();
            assert_eq!(
                got.recv_timeout(Duration::from_secs(5)),
                Ok(("neighbour", true)),
                "the owner holding none goes first"
            );
            assert!(
                got.recv_timeout(Duration::from_millis(100)).is_err(),
                "one place freed, one taken"
            );
            hogged.pop();
            assert_eq!(got.recv_timeout(Duration::from_secs(5)), Ok(("one", true)));
        });
    }

    /// Waits (up to 10 s) until `done`.
    fn wait_for(done: impl Fn() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < until, "timed out");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn a_place_gone_stale_does_not_go_straight_back_to_its_owner_past_one_holding_none() {
        // Four owners hold a place each, one of them (the insider) with another dial waiting,
        // then a neighbour's. The insider's place goes stale first: it now holds as few fresh
        // places as the neighbour, and has waited longer, but its stale dial still goes: the
        // neighbour takes the place. (Insiders of four owners or more otherwise took each place
        // back as it went stale, and the neighbour waited out its handshake timeout.)
        let hold = Duration::from_millis(400);
        let gate = DialGate::holding(hold);
        let a: IpAddr = "10.0.0.7".parse().expect("ip");
        let start = Instant::now();
        let _first = gate.enter(a, DialOwner::Engine(1), start + hold).expect("a place");
        std::thread::sleep(hold / 2);
        let _others: Vec<_> = (2..=4)
            .map(|e| gate.enter(a, DialOwner::Engine(e), start + hold).expect("a place"))
            .collect();
        std::thread::scope(|s| {
            // The insider gives up before the other three places go stale (at 1.5 holds).
            let insider = s.spawn(|| gate.enter(a, DialOwner::Engine(1), start + hold * 5 / 4).map(drop));
            wait_for(|| gate.waiting(a) == 1);
            let neighbour =
                s.spawn(|| gate.enter(a, DialOwner::Pod("neighbour".into()), start + Duration::from_secs(10)));
            // Held until the insider has given up.
            let _place = neighbour.join().expect("neighbour").expect("the neighbour's place");
            assert!(
                insider.join().expect("insider").is_err(),
                "the insider got the place back"
            );
        });
    }

    #[test]
    fn dials_stuck_past_the_hold_keep_no_one_waiting() {
        let gate = DialGate::holding(Duration::from_millis(100));
        let a: IpAddr = "10.0.0.7".parse().expect("ip");
        let far = || Instant::now() + Duration::from_secs(10);
        // From before the first is taken: it goes stale 100 ms after that at the earliest.
        let asked = Instant::now();
        let stuck: Vec<DialPass<'_>> = (0..DIALS_PER_HOST)
            .map(|i| gate.enter(a, DialOwner::Engine(i as u64), far()).expect("a place"))
            .collect();
        let next = gate
            .enter(a, DialOwner::Engine(9), far())
            .expect("a place once the others are stale");
        let waited = asked.elapsed();
        assert!(
            waited >= Duration::from_millis(90) && waited < Duration::from_secs(5),
            "waited {waited:?}"
        );
        // The stuck ones still count once they end; the new one is fresh.
        assert_eq!(gate.in_flight(a), DIALS_PER_HOST + 1);
        drop(stuck);
        drop(next);
        assert_eq!(gate.in_flight(a), 0);
    }
}
