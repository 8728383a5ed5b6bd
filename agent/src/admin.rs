//! The agent's admin port: `/metrics`, `/livez`, `/readyz` over plain HTTP/1.0.
//!
//! Each connection is served on its own thread, at most [`MAX_CONNECTIONS`] at once and
//! [`MAX_PER_SOURCE`] from one address (more from it are closed at once; when all are taken, a
//! connection from an address holding fewer takes the place of the oldest of the address holding
//! the most: `crate::unproven`), and a client has [`HEAD_TIMEOUT`] for its whole request head: an
//! idle or slow client, or a few addresses reopening connections as fast as they close, never
//! keep the kubelet's probes out (32 idle connections reopened at once, from anywhere the chart's
//! NetworkPolicy leaves the port open to, failed the liveness probe and restarted the agent).

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream},
    sync::Arc,
    time::Duration,
};

use crate::{agent::Agent, metrics::Metrics, wire::Deadline};

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 32;
/// Connections served at once from one address.
pub const MAX_PER_SOURCE: usize = 4;
/// Time a client has to send its request line and headers.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// The most bytes of request head read.
const MAX_HEAD: u64 = 8 << 10;

/// Serves the admin port until the process ends.
pub fn serve(listener: TcpListener, metrics: Arc<Metrics>, agent: Agent) {
    let places = crate::unproven::Budget::new(MAX_CONNECTIONS, MAX_PER_SOURCE);
    loop {
        let (stream, from) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, say: retried after a moment, not in a loop at full speed.
                tracing::debug!(error = %e, "admin: accept failed");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        // Dropped (closed) without a place.
        let Ok((place, _)) = places.admit(crate::unproven::source(from.ip()), &stream) else {
            continue;
        };
        let (metrics, agent) = (metrics.clone(), agent.clone());
        // The place goes back when the thread ends, or with the closure when it never starts
        // (else each failure kept one, and past the bound none was answered).
        let spawned = std::thread::Builder::new().name("admin".into()).spawn(move || {
            answer(&stream, &metrics, &agent);
            drop(place);
        });
        if spawned.is_err() {
            tracing::warn!("admin: cannot start a thread; connection dropped");
        }
    }
}

fn answer(stream: &TcpStream, metrics: &Metrics, agent: &Agent) {
    let _ = stream.set_write_timeout(Some(HEAD_TIMEOUT));
    let mut reader = BufReader::new(Deadline::new(stream, HEAD_TIMEOUT).take(MAX_HEAD));
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    // The rest of the head, up to the blank line (within the same deadline and size bound).
    loop {
        let mut header = String::new();
        match reader.read_line(&mut header) {
            Ok(0) | Err(_) => return,
            Ok(_) if header == "\r\n" || header == "\n" => break,
            Ok(_) => {}
        }
    }
    let path = line.split_whitespace().nth(1).unwrap_or("/");
    let (status, body) = match path {
        "/metrics" => {
            agent.refresh_gauges();
            ("200 OK", metrics.render())
        }
        "/healthz" | "/livez" => ("200 OK", "ok\n".to_owned()),
        "/readyz" => match agent.ready() {
            Ok(()) => ("200 OK", "ok\n".to_owned()),
            Err(why) => ("503 Service Unavailable", format!("{why}\n")),
        },
        _ => ("404 Not Found", "not found\n".to_owned()),
    };
    let mut out = stream;
    let _ = write!(
        out,
        "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::agent::AgentConfig;

    fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(3))).expect("timeout");
        // Over the cap the server closes at once: the write or the read then fails.
        if write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").is_err() {
            return String::new();
        }
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        text
    }

    #[test]
    fn idle_clients_do_not_block_probes_and_readyz_waits_for_the_socket() {
        let dir = std::env::temp_dir().join(format!("pdpair-admin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let cfg = AgentConfig::for_tests(dir.join("pools"));
        let metrics = Arc::new(Metrics::new());
        let agent = Agent::start(cfg, metrics.clone()).expect("agent");
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let a = agent.clone();
        std::thread::spawn(move || serve(listener, metrics, a));
        // Idle clients that never send a byte, more than the connection cap.
        let idle: Vec<TcpStream> = (0..MAX_CONNECTIONS + 8)
            .filter_map(|_| TcpStream::connect(addr).ok())
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        // They hold at most the cap, and only until the head timeout; a probe gets through
        // within it.
        let started = Instant::now();
        let mut live = get(addr, "/livez");
        while !live.starts_with("HTTP/1.0 200") && started.elapsed() < HEAD_TIMEOUT * 2 {
            live = get(addr, "/livez");
        }
        assert!(live.starts_with("HTTP/1.0 200"), "{live}");
        assert!(
            started.elapsed() < HEAD_TIMEOUT + Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        drop(idle);
        // Not ready before the engine API socket is bound; ready after.
        let ready = get(addr, "/readyz");
        assert!(ready.starts_with("HTTP/1.0 503") && ready.contains("socket"), "{ready}");
        let _listener = agent.bind(&dir.join("agent.sock")).expect("bind socket");
        let ready = get(addr, "/readyz");
        assert!(ready.starts_with("HTTP/1.0 200"), "{ready}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
