//! How the operator's HTTP servers (the TLS webhook and the plain admin port) take connections:
//! at most [`MAX_CONNECTIONS`] at once per server and [`MAX_PER_SOURCE`] from one address (more
//! from it are closed at once; when all are taken, a connection from an address holding fewer
//! takes the place of the oldest of the address holding the most, which is closed),
//! [`HEADER_TIMEOUT`] for a request's headers, [`REQUEST_TIMEOUT`] for its body and answer, and
//! [`CONNECTION_LIFETIME`] for a connection in all. A slow or idle client holds one connection
//! slot for a bounded time and never delays another, and pods holding idle connections, however
//! many, do not keep the API server from the webhook nor the kubelet from the probes.

use std::{net::IpAddr, sync::Arc, time::Duration};

use axum::{Router, extract::Request, http::StatusCode, middleware::Next, response::IntoResponse};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::conn::auto,
    service::TowerToHyperService,
};
use pdpair_api::budget::{self, Budget, Connection, Slot};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpListener,
    sync::Notify,
};

/// Connections served at once, per server.
pub const MAX_CONNECTIONS: usize = 256;
/// Connections served at once from one address, per server.
pub const MAX_PER_SOURCE: usize = 64;
/// Time a client has to send a request's headers.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Time a request's body and answer may take once its headers are in.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest one connection is kept (the API server reconnects).
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(300);

/// The connection budget of one server ([`pdpair_api::budget`]: the node agent's rule).
#[derive(Debug, Clone)]
pub struct Limits(Arc<Budget<IpAddr, Closer>>);

impl Default for Limits {
    fn default() -> Self {
        Limits(Budget::new(MAX_CONNECTIONS, MAX_PER_SOURCE))
    }
}

/// What tells a served connection to close: it ends when notified ([`Permit::evicted`]).
#[derive(Debug, Clone)]
struct Closer(Arc<Notify>);

impl Connection for Closer {
    fn handle(&self) -> std::io::Result<Self> {
        Ok(self.clone())
    }
    fn shut(&self) {
        self.0.notify_one();
    }
}

/// One connection's slot, given back when dropped.
#[derive(Debug)]
pub struct Permit {
    _slot: Slot<IpAddr, Closer>,
    closed: Closer,
}

impl Permit {
    /// Completes when the connection was told to close to make room for another address's.
    pub async fn evicted(&self) {
        self.closed.0.notified().await;
    }
}

impl Limits {
    /// A slot for one more connection from `source`, or `None` when that address holds
    /// [`MAX_PER_SOURCE`], or the server is full and no address holds more than `source` would
    /// with this one. When full, the oldest connection of the address holding the most is told
    /// to close ([`Permit::evicted`]) and its slot is this one's.
    pub fn admit(&self, source: IpAddr) -> Option<Permit> {
        let closed = Closer(Arc::new(Notify::new()));
        let (slot, _) = self.0.admit(budget::source(source), &closed).ok()?;
        Some(Permit { _slot: slot, closed })
    }

    /// The next connection `listener` accepts within the budget, with its slot: a connection
    /// past the budget is closed at once, a failed accept logged (as `what`'s) and retried.
    pub async fn accept(
        &self,
        listener: &TcpListener,
        what: &str,
    ) -> (tokio::net::TcpStream, std::net::SocketAddr, Permit) {
        loop {
            match listener.accept().await {
                Ok((tcp, peer)) => match self.admit(peer.ip()) {
                    Some(permit) => return (tcp, peer, permit),
                    None => drop(tcp), // its address's share is taken, or the server full: closed
                },
                Err(e) => {
                    tracing::warn!(error = %e, "{what} accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// `router` with every request (body included) bounded by [`REQUEST_TIMEOUT`]: past it the
/// client gets 408 and the connection is closed.
pub fn bounded(router: Router) -> Router {
    router.layer(axum::middleware::from_fn(|req: Request, next: Next| async move {
        match tokio::time::timeout(REQUEST_TIMEOUT, next.run(req)).await {
            Ok(response) => response,
            Err(_) => (StatusCode::REQUEST_TIMEOUT, "the request did not arrive in time\n").into_response(),
        }
    }))
}

/// Serves HTTP/1.1 on one accepted connection under the limits (the permit is held until it
/// ends, or until it is told to close for another address's connection).
pub async fn serve_connection<I>(io: I, router: Router, permit: Permit)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    let service = TowerToHyperService::new(bounded(router));
    let served = tokio::time::timeout(CONNECTION_LIFETIME, builder.serve_connection(TokioIo::new(io), service));
    tokio::select! {
        served = served => {
            if let Ok(Err(e)) = served {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        }
        () = permit.evicted() => tracing::debug!("closed a connection for another address's"),
    }
    drop(permit);
}

/// Serves `router` over plain TCP (the admin port) until the process ends.
pub async fn serve_plain(listener: TcpListener, router: Router) -> std::io::Result<()> {
    let limits = Limits::default();
    loop {
        let (tcp, _, permit) = limits.accept(&listener, "admin").await;
        tokio::spawn(serve_connection(tcp, router.clone(), permit));
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn get(addr: std::net::SocketAddr) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut out = String::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out)).await;
        out
    }

    #[tokio::test]
    async fn idle_and_slow_clients_hold_no_more_than_their_slot() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let router = Router::new()
            .route("/livez", axum::routing::get(|| async { "ok" }))
            .route(
                "/echo",
                axum::routing::post(|body: axum::body::Bytes| async move { body }),
            );
        tokio::spawn(serve_plain(listener, router));
        // Idle connections and one that sends headers but trickles its body.
        let mut idle = Vec::new();
        for _ in 0..50 {
            idle.push(tokio::net::TcpStream::connect(addr).await.expect("idle"));
        }
        let mut slow = tokio::net::TcpStream::connect(addr).await.expect("slow");
        slow.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nab")
            .await
            .expect("head");
        // A probe beside them is answered at once.
        assert!(get(addr).await.contains("200 OK"));
        // The slow body is cut off at the request timeout with 408.
        let mut answer = String::new();
        let _ = tokio::time::timeout(
            REQUEST_TIMEOUT + Duration::from_secs(5),
            slow.read_to_string(&mut answer),
        )
        .await;
        assert!(answer.contains("408"), "{answer:?}");
    }

    /// A connection to `addr` from the loopback address `127.0.0.<host>`.
    async fn connect_from(host: u8, addr: std::net::SocketAddr) -> tokio::net::TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.bind(([127, 0, 0, host], 0).into()).expect("bind");
        socket.connect(addr).await.expect("connect")
    }

    /// How many of `conns` the server closed.
    async fn closed(conns: &mut [tokio::net::TcpStream]) -> usize {
        let mut closed = 0;
        for c in conns {
            let mut b = [0u8; 1];
            if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(5), c.read(&mut b)).await {
                closed += 1;
            }
        }
        closed
    }

    #[tokio::test]
    async fn connections_past_an_addresss_share_are_closed_at_once() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(serve_plain(listener, Router::new()));
        let mut conns = Vec::new();
        for _ in 0..MAX_PER_SOURCE + 20 {
            conns.push(connect_from(7, addr).await);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(closed(&mut conns).await, 20, "exactly the connections past its share");
    }

    #[tokio::test]
    async fn addresses_holding_every_slot_do_not_keep_another_address_out() {
        // Pods holding idle connections filled the 256 slots, first come first served: the API
        // server could not reach the webhook (every PDPair write refused) nor the kubelet the
        // probes. A connection from an address holding fewer takes the place of the oldest of
        // the address holding the most.
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let router = Router::new().route("/livez", axum::routing::get(|| async { "ok" }));
        tokio::spawn(serve_plain(listener, router));
        let mut hogs = Vec::new();
        for host in 0..(MAX_CONNECTIONS / MAX_PER_SOURCE) as u8 {
            for _ in 0..MAX_PER_SOURCE {
                hogs.push(connect_from(10 + host, addr).await);
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(closed(&mut hogs).await, 0, "every slot held");
        assert!(get(addr).await.contains("200 OK"), "another address is answered");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            closed(&mut hogs).await,
            1,
            "the oldest of an address holding the most gave way"
        );
    }
}
