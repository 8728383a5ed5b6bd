//! Where a TCP listener binds: `HOST:PORT`, or `:PORT` for every address of the host in both
//! families. The one piece of I/O in this crate, shared by the operator's and the agent's ports.

use std::{
    fmt,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener},
    str::FromStr,
};

/// A listener's address as the command line gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListenAddr {
    /// `:PORT`: every address, IPv6 and IPv4 (IPv4 alone where the kernel has no IPv6), so one
    /// setting serves IPv4, IPv6 and dual-stack clusters alike.
    AnyAddress(u16),
    /// `HOST:PORT` (`[V6]:PORT`): that address only.
    Addr(SocketAddr),
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(port) = s.strip_prefix(':') {
            return port
                .parse()
                .map(ListenAddr::AnyAddress)
                .map_err(|_| format!("{s:?} is not :PORT with a port in 0-65535"));
        }
        s.parse()
            .map(ListenAddr::Addr)
            .map_err(|_| format!("{s:?} is neither HOST:PORT ([IPV6]:PORT) with an IP address nor :PORT"))
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::AnyAddress(port) => write!(f, ":{port}"),
            ListenAddr::Addr(addr) => addr.fmt(f),
        }
    }
}

impl ListenAddr {
    /// Binds a listener (blocking mode; `tokio::net::TcpListener::from_std` wants it
    /// non-blocking). `:PORT` takes an IPv6 socket that also accepts IPv4, whatever
    /// `net.ipv6.bindv6only` says, and falls back to IPv4 where the kernel has no IPv6.
    pub fn bind(&self) -> std::io::Result<TcpListener> {
        let port = match *self {
            ListenAddr::Addr(addr) => return TcpListener::bind(addr),
            ListenAddr::AnyAddress(port) => port,
        };
        use socket2::{Domain, Protocol, Socket, Type};
        let v6 = match Socket::new(Domain::IPV6, Type::STREAM, Some(Protocol::TCP)) {
            Ok(s) => s,
            // No IPv6 in this kernel (ipv6.disable=1).
            Err(e) if e.raw_os_error() == Some(EAFNOSUPPORT) => {
                return TcpListener::bind((Ipv4Addr::UNSPECIFIED, port));
            }
            Err(e) => return Err(e),
        };
        v6.set_only_v6(false)?;
        v6.set_reuse_address(true)?;
        v6.bind(&SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)).into())?;
        v6.listen(1024)?;
        Ok(v6.into())
    }
}

/// Linux's EAFNOSUPPORT: no such address family.
const EAFNOSUPPORT: i32 = 97;

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpStream;

    #[test]
    fn parses_any_address_and_host_port_and_names_a_bad_value() {
        assert_eq!(":8080".parse(), Ok(ListenAddr::AnyAddress(8080)));
        assert_eq!(
            "127.0.0.1:9".parse(),
            Ok(ListenAddr::Addr(SocketAddr::from(([127, 0, 0, 1], 9))))
        );
        assert_eq!(
            "[::1]:9".parse(),
            Ok(ListenAddr::Addr(SocketAddr::from((Ipv6Addr::LOCALHOST, 9))))
        );
        for bad in [":", ":70000", "localhost:80", "8080", "0.0.0.0"] {
            let e = bad.parse::<ListenAddr>().expect_err(bad);
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
        assert_eq!(ListenAddr::AnyAddress(80).to_string(), ":80");
    }

    /// A probe, Prometheus or the API server reaches `:PORT` over either family: an IPv6-only
    /// cluster's Pod IP is IPv6, and an IPv4 one's IPv4.
    #[test]
    fn any_address_accepts_ipv4_and_ipv6() {
        let listener = ListenAddr::AnyAddress(0).bind().expect("bind");
        let port = listener.local_addr().expect("addr").port();
        for peer in [
            SocketAddr::from(([127, 0, 0, 1], port)),
            SocketAddr::from((Ipv6Addr::LOCALHOST, port)),
        ] {
            let _client = TcpStream::connect(peer).unwrap_or_else(|e| panic!("{peer}: {e}"));
            let (_, from) = listener.accept().expect("accept");
            assert_eq!(
                from.is_ipv4() || from.ip().to_canonical().is_ipv4(),
                peer.is_ipv4(),
                "{from}"
            );
        }
    }

    #[test]
    fn an_address_binds_only_that_address() {
        let listener = ListenAddr::Addr(SocketAddr::from(([127, 0, 0, 1], 0)))
            .bind()
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        assert!(TcpStream::connect((Ipv6Addr::LOCALHOST, port)).is_err());
        TcpStream::connect((Ipv4Addr::LOCALHOST, port)).expect("IPv4");
    }
}
