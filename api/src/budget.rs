//! A budget of connections by source: bounded per source and in all, and fair when full. A
//! connection from a source holding fewer than the source that holds the most takes the place of
//! that source's oldest one (which is shut down). So a few sources holding places open, slowly,
//! cannot keep another out; it takes as many sources as the budget has places, each holding one.
//!
//! The node agent's unproven connections (its side channel before `AuthOk`, its KV stream before
//! the admission proof, its engine socket before `Register`, its admin port) and the operator's
//! HTTP servers (a connection told to close through a `Notify`) share this rule.

use std::{
    collections::{HashMap, VecDeque},
    hash::Hash,
    net::{IpAddr, Shutdown, TcpStream},
    os::unix::net::UnixStream,
    sync::{Arc, Mutex},
};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The source a connection from `ip` counts against: the address, an IPv4 address mapped into
/// IPv6 as its IPv4 (one host, one source, however it connects). Not an IPv6 address's /64: that
/// is one network segment (SLAAC hands every host on a link the same /64, and a cloud's IPv6
/// subnet is one), so keyed by it every node of a subnet shared one source's places.
pub fn source(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// A connection a budget can hold a handle to and shut down.
pub trait Connection: Sized {
    /// Another handle on the same connection.
    fn handle(&self) -> std::io::Result<Self>;
    /// Ends its reads and writes, on every handle.
    fn shut(&self);
}

impl Connection for TcpStream {
    fn handle(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn shut(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

impl Connection for UnixStream {
    fn handle(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn shut(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

/// The budget of one listener: connections by source (an address; for the engine socket, the
/// Pod a process runs in).
#[derive(Debug)]
pub struct Budget<K = IpAddr, C = TcpStream> {
    total: usize,
    per_source: usize,
    state: Mutex<State<K, C>>,
}

#[derive(Debug)]
struct State<K, C> {
    next: u64,
    /// By source, oldest first: each connection's id and a handle to shut it down.
    held: HashMap<K, VecDeque<(u64, C)>>,
    count: usize,
}

impl<K, C> Default for State<K, C> {
    fn default() -> Self {
        State {
            next: 0,
            held: HashMap::new(),
            count: 0,
        }
    }
}

/// Why a connection got no slot.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// Its source holds as many as one source may.
    Source,
    /// Every slot is taken, and no source holds more than its source would.
    Full,
    /// The connection could not be kept (its handle could not be duplicated).
    Handle,
}

/// One unproven connection's place in the budget, given back when dropped (proved, or ended).
#[derive(Debug)]
pub struct Slot<K: Hash + Eq + Clone = IpAddr, C: Connection = TcpStream> {
    budget: Arc<Budget<K, C>>,
    source: K,
    id: u64,
}

impl<K: Hash + Eq + Clone, C: Connection> Budget<K, C> {
    /// A budget of `total` connections, at most `per_source` from one source.
    pub fn new(total: usize, per_source: usize) -> Arc<Budget<K, C>> {
        Arc::new(Budget {
            total,
            per_source,
            state: Mutex::new(State::default()),
        })
    }

    /// A slot for `conn` from `source`, taking the place of another source's oldest connection
    /// when every slot is taken and that source holds more than `source` would with this one.
    /// Returns the slot and whether a connection was shut down to make room.
    pub fn admit(self: &Arc<Self>, source: K, conn: &C) -> Result<(Slot<K, C>, bool), Refused> {
        let mut s = lock(&self.state);
        let here = s.held.get(&source).map_or(0, VecDeque::len);
        if here >= self.per_source {
            return Err(Refused::Source);
        }
        // Duplicated first: a connection that cannot be kept makes no one else's room.
        let handle = conn.handle().map_err(|_| Refused::Handle)?;
        let mut evicted = false;
        if s.count >= self.total {
            let victim = s
                .held
                .iter()
                .filter(|(_, q)| q.len() > here + 1)
                .max_by_key(|(_, q)| q.len())
                .map(|(source, _)| source.clone());
            let Some(victim) = victim else {
                return Err(Refused::Full);
            };
            let oldest = s.held.get_mut(&victim).and_then(VecDeque::pop_front);
            if s.held.get(&victim).is_some_and(VecDeque::is_empty) {
                s.held.remove(&victim);
            }
            if let Some((_, c)) = oldest {
                // Its thread's reads and writes fail at once, and it ends; its slot is gone.
                c.shut();
                s.count -= 1;
                evicted = true;
            }
        }
        let id = s.next;
        s.next += 1;
        s.held.entry(source.clone()).or_default().push_back((id, handle));
        s.count += 1;
        Ok((
            Slot {
                budget: self.clone(),
                source,
                id,
            },
            evicted,
        ))
    }

    /// Connections holding a slot now.
    pub fn held(&self) -> usize {
        lock(&self.state).count
    }
}

impl<K: Hash + Eq + Clone, C: Connection> Slot<K, C> {
    /// Whether its connection was shut down to make room for another (counted `Busy` then:
    /// its own failure that follows is not another refusal).
    pub fn evicted(&self) -> bool {
        let s = lock(&self.budget.state);
        !s.held
            .get(&self.source)
            .is_some_and(|q| q.iter().any(|(id, _)| *id == self.id))
    }
}

impl<K: Hash + Eq + Clone, C: Connection> Drop for Slot<K, C> {
    fn drop(&mut self) {
        let mut s = lock(&self.budget.state);
        let Some(q) = s.held.get_mut(&self.source) else {
            return;
        };
        let Some(i) = q.iter().position(|(id, _)| *id == self.id) else {
            return; // shut down to make room: counted out then
        };
        q.remove(i);
        if q.is_empty() {
            s.held.remove(&self.source);
        }
        s.count -= 1;
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io::Read,
        net::{Ipv4Addr, TcpListener},
    };

    use super::*;

    fn conn(listener: &TcpListener) -> (TcpStream, TcpStream) {
        let c = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (s, _) = listener.accept().expect("accept");
        (c, s)
    }

    fn ip(i: u8) -> IpAddr {
        Ipv4Addr::new(10, 0, 0, i).into()
    }

    #[test]
    fn a_mapped_ipv4_is_its_ipv4_and_ipv6_hosts_of_one_subnet_are_sources_of_their_own() {
        let at = |a: &str| source(a.parse().expect("ip"));
        assert_eq!(at("::ffff:10.0.0.7"), at("10.0.0.7"));
        assert_eq!(at("10.0.0.7"), "10.0.0.7".parse::<IpAddr>().expect("ip"));
        assert_ne!(at("10.0.0.7"), at("10.0.0.8"));
        // Two nodes of one /64 (SLAAC, a cloud subnet).
        assert_ne!(at("2001:db8:1:2::1"), at("2001:db8:1:2::2"));
    }

    #[test]
    fn a_full_budget_makes_room_for_a_source_holding_fewer_by_shutting_the_biggest_oldest() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
        let b = Budget::new(4, 3);
        let mut kept = Vec::new();
        // Source 1 holds three (its cap), source 2 one: full.
        for source in [1, 1, 1, 2] {
            let (c, s) = conn(&listener);
            kept.push((b.admit(ip(source), &s).expect("admitted"), c, s));
        }
        let (_c, s) = conn(&listener);
        assert_eq!(b.admit(ip(1), &s).err(), Some(Refused::Source));
        // Source 3 holds none: source 1's oldest makes room, and is shut down.
        let (_c3, s3) = conn(&listener);
        let (slot3, evicted) = b.admit(ip(3), &s3).expect("room made");
        assert!(evicted);
        let mut byte = [0u8; 1];
        assert_eq!(
            (&kept[0].1).read(&mut byte).expect("eof"),
            0,
            "the oldest of source 1 was shut down"
        );
        assert_eq!(b.held(), 4);
        // Now sources hold 2, 1, 1: a fourth source finds no one holding more than it would.
        let (_c4, s4) = conn(&listener);
        let (slot4, evicted) = b.admit(ip(4), &s4).expect("source 1 still holds 2 > 1");
        assert!(evicted);
        let (_c5, s5) = conn(&listener);
        assert_eq!(
            b.admit(ip(5), &s5).err(),
            Some(Refused::Full),
            "everyone holds one: fair"
        );
        // Slots come back when dropped, the shut-down one counted once.
        drop(kept);
        drop(slot3);
        assert_eq!(b.held(), 1);
        drop(slot4);
        assert_eq!(b.held(), 0);
    }
}
