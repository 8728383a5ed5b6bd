//! A Kubernetes API server stand-in on loopback for unit tests: HTTP/1.1, a thread per
//! connection, each request answered by a function of it, or left unanswered (as a half-open
//! connection is).

use std::{
    io::{BufRead, BufReader, Read, Write},
    sync::{Arc, Mutex},
    time::Duration,
};

/// One request as the stand-in read it.
#[derive(Clone, Debug)]
pub struct Request {
    /// `GET`, `PATCH`, ...
    pub method: String,
    /// The path and query.
    pub target: String,
    /// The body.
    pub body: Vec<u8>,
}

/// The requests the stand-in read, in order.
pub type Seen = Arc<Mutex<Vec<Request>>>;

/// Serves `answer`'s (status, JSON body) for each request (`None`: none, ever) at the returned
/// URL; every request read is kept in the returned list.
pub fn serve(answer: impl Fn(&Request) -> Option<(u16, Vec<u8>)> + Send + Sync + 'static) -> (String, Seen) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let seen: Seen = Arc::default();
    let kept = seen.clone();
    let answer = Arc::new(answer);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            // Each connection on a thread of its own: one left unanswered holds only itself.
            let (answer, kept) = (answer.clone(), kept.clone());
            std::thread::spawn(move || {
                let mut writer = stream.try_clone().expect("clone");
                let mut reader = BufReader::new(stream);
                loop {
                    let mut head = Vec::new();
                    let mut length = 0usize;
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            break;
                        }
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                        if line == "\r\n" {
                            break;
                        }
                        head.push(line);
                    }
                    let Some(first) = head.first() else { break };
                    let mut body = vec![0u8; length];
                    if reader.read_exact(&mut body).is_err() {
                        break;
                    }
                    let mut words = first.split_whitespace();
                    let request = Request {
                        method: words.next().unwrap_or_default().to_owned(),
                        target: words.next().unwrap_or_default().to_owned(),
                        body,
                    };
                    kept.lock().expect("lock").push(request.clone());
                    let Some((status, reply)) = answer(&request) else {
                        std::thread::sleep(Duration::from_secs(600));
                        return;
                    };
                    let header = format!(
                        "HTTP/1.1 {status} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        if status < 300 { "OK" } else { "Refused" },
                        reply.len()
                    );
                    if writer
                        .write_all(header.as_bytes())
                        .and_then(|()| writer.write_all(&reply))
                        .is_err()
                    {
                        break;
                    }
                }
            });
        }
    });
    (url, seen)
}

/// A Kubernetes `Status` of `code` and `reason`, as the API server refuses a request.
pub fn status(code: u16, reason: &str, message: &str) -> (u16, Vec<u8>) {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure",
        "reason": reason, "message": message, "code": code,
    });
    (code, body.to_string().into_bytes())
}
