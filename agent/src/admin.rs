//! The agent's admin port: `/metrics`, `/livez`, `/readyz` over plain HTTP/1.0.
//!
//! Each connection is served on its own thread, at most [`MAX_CONNECTIONS`] at once (more are
//! closed at once), and a client has [`HEAD_TIMEOUT`] for its whole request head: an idle or
//! slow client never delays the kubelet's probes.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use crate::{agent::Agent, metrics::Metrics, wire::Deadline};

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 32;
/// Time a client has to send its request line and headers.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// The most bytes of request head read.
const MAX_HEAD: u64 = 8 << 10;

/// Serves the admin port until the process ends.
pub fn serve(listener: TcpListener, metrics: Arc<Metrics>, agent: Agent) {
    let open = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming().flatten() {
        if open.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            open.fetch_sub(1, Ordering::SeqCst);
            continue; // dropped: closed
        }
        let (held, metrics, agent) = (open.clone(), metrics.clone(), agent.clone());
        let spawned = std::thread::Builder::new().name("admin".into()).spawn(move || {
            answer(&stream, &metrics, &agent);
            held.fetch_sub(1, Ordering::SeqCst);
        });
        if spawned.is_err() {
            // Its place too: else each failure kept one, and past the bound none was answered.
            open.fetch_sub(1, Ordering::SeqCst);
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
    use std::{net::Ipv4Addr, time::Instant};

    use super::*;
    use crate::{agent::AgentConfig, transport::ucx::Transport};

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
        let cfg = AgentConfig {
            name: "a".into(),
            listen_host: Ipv4Addr::LOCALHOST.into(),
            transport: Transport::Tcp,
            stream_lanes: crate::transport::stream::DEFAULT_LANES,
            corrupt_one_byte: false,
            rejection_ttl: Duration::from_secs(30),
            publisher: None,
            pool_dir: dir.join("pools"),
            heartbeat: Duration::from_secs(1),
            attestor: None,
            ucx_probe: None,
            side_channel_ports: None,
        };
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
