//! How the operator's HTTP servers (the TLS webhook and the plain admin port) take connections:
//! at most [`MAX_CONNECTIONS`] at once per server (more are closed at once), [`HEADER_TIMEOUT`] for a
//! request's headers, [`REQUEST_TIMEOUT`] for its body and answer, and [`CONNECTION_LIFETIME`]
//! for a connection in all. A slow or idle client holds one connection slot for a bounded time
//! and never delays another.

use std::{sync::Arc, time::Duration};

use axum::{Router, extract::Request, http::StatusCode, middleware::Next, response::IntoResponse};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::conn::auto,
    service::TowerToHyperService,
};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpListener,
    sync::{OwnedSemaphorePermit, Semaphore},
};

/// Connections served at once, per server.
pub const MAX_CONNECTIONS: usize = 256;
/// Time a client has to send a request's headers.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Time a request's body and answer may take once its headers are in.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest one connection is kept (the API server reconnects).
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(300);

/// The connection budget of one server.
#[derive(Debug, Clone)]
pub struct Limits(Arc<Semaphore>);

impl Default for Limits {
    fn default() -> Self {
        Limits(Arc::new(Semaphore::new(MAX_CONNECTIONS)))
    }
}

impl Limits {
    /// A slot for one more connection, or `None` when the server is full.
    pub fn admit(&self) -> Option<OwnedSemaphorePermit> {
        Arc::clone(&self.0).try_acquire_owned().ok()
    }

    /// The next connection `listener` accepts within the budget, with its slot: a connection
    /// past the budget is closed at once, a failed accept logged (as `what`'s) and retried.
    pub async fn accept(
        &self,
        listener: &TcpListener,
        what: &str,
    ) -> (tokio::net::TcpStream, std::net::SocketAddr, OwnedSemaphorePermit) {
        loop {
            match listener.accept().await {
                Ok((tcp, peer)) => match self.admit() {
                    Some(permit) => return (tcp, peer, permit),
                    None => drop(tcp), // full: closed
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
/// ends).
pub async fn serve_connection<I>(io: I, router: Router, permit: OwnedSemaphorePermit)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    let service = TowerToHyperService::new(bounded(router));
    let served = tokio::time::timeout(CONNECTION_LIFETIME, builder.serve_connection(TokioIo::new(io), service)).await;
    if let Ok(Err(e)) = served {
        tracing::debug!(error = %e, "connection ended with an error");
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

    #[tokio::test]
    async fn connections_past_the_cap_are_closed_at_once() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(serve_plain(listener, Router::new()));
        let mut conns = Vec::new();
        for _ in 0..MAX_CONNECTIONS + 20 {
            conns.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut closed = 0;
        for c in &mut conns {
            let mut b = [0u8; 1];
            if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(5), c.read(&mut b)).await {
                closed += 1;
            }
        }
        assert_eq!(closed, 20, "exactly the connections past the cap are closed");
    }
}
