//! A minimal HTTP/1.1 responder for the metrics endpoint (`flotilla train --metrics-port`):
//! `GET /metrics` (or `/`) answers the [`Source`]'s figures in the OpenMetrics text format
//! ([`crate::metrics::encode`]); anything else is a 404 or 405.
//!
//! One thread accepts and answers one connection at a time: a request is read up to
//! [`MAX_REQUEST`] bytes within [`IO_TIMEOUT`], the answer written within the same timeout,
//! and the connection closed. The thread blocks in `accept` (no polling); dropping the
//! [`Endpoint`] wakes it with a connection of its own and joins it.
use crate::error::{LaunchError, Result};
use crate::metrics::{Board, Publisher, Source, StepFigures, encode};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// Longest a request may take to arrive, and its answer to be written.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest request head read (request line and headers).
pub const MAX_REQUEST: usize = 8 << 10;
/// The content type of the OpenMetrics text format, which Prometheus scrapes.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A serving endpoint; stops when dropped.
pub struct Endpoint {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Endpoint {
    /// Binds `addr` (port 0 picks a free one) and serves `source` until dropped.
    pub fn serve(addr: SocketAddr, source: Arc<dyn Source + Send + Sync>) -> Result<Endpoint> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| LaunchError::io(format!("--metrics-port: binding {addr}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| LaunchError::io("--metrics-port: the bound address", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("metrics-http".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stopping.load(Ordering::Acquire) {
                        break;
                    }
                    // A failed accept or exchange concerns that client only.
                    if let Ok(mut s) = conn {
                        let _ = answer(&mut s, source.as_ref());
                    }
                }
            })
            .map_err(|e| LaunchError::io("starting the metrics endpoint thread", e))?;
        Ok(Endpoint {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The address served (the port chosen when 0 was asked).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        // If the wake-up cannot connect the thread is left blocked rather than waited for.
        if TcpStream::connect_timeout(&wake, IO_TIMEOUT).is_ok()
            && let Some(t) = self.thread.take()
        {
            let _ = t.join();
        }
    }
}

/// Where a rank's step figures go under `--metrics-port`.
pub enum Live {
    /// Nowhere (no endpoint).
    Off,
    /// To the endpoint this process serves (one process, no agent).
    Served(Board, Endpoint),
    /// To the store, for the agent's endpoint.
    Store(Publisher),
}

impl Live {
    /// A one-process run's figures, served on `port` of every interface (printed), if asked.
    pub fn serve(port: Option<u16>) -> Result<Live> {
        let Some(port) = port else {
            return Ok(Live::Off);
        };
        let board = Board::new(1);
        let at = SocketAddr::from(([0, 0, 0, 0], port));
        let ep = Endpoint::serve(at, Arc::new(board.clone()))?;
        println!(
            "# metrics endpoint: http://{}/metrics (Prometheus / OpenMetrics text)",
            ep.addr()
        );
        Ok(Live::Served(board, ep))
    }

    /// A worker's figures, published to the store of `rdv` for the agent when `on`.
    pub fn publish(on: bool, rdv: &comm::group::Rendezvous, rank: usize) -> Result<Live> {
        Ok(match on {
            true => Live::Store(Publisher::start(rdv, rank)?),
            false => Live::Off,
        })
    }

    /// Counts `rank`'s step `s` in.
    pub fn add_step(&mut self, rank: usize, s: StepFigures) {
        match self {
            Live::Off => {}
            Live::Served(b, _) => b.add_step(rank, s),
            Live::Store(p) => p.add_step(s),
        }
    }
}

/// Reads one request from `s` and answers it.
fn answer(s: &mut TcpStream, source: &(dyn Source + Send + Sync)) -> std::io::Result<()> {
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    let head = match read_head(s)? {
        Some(h) => h,
        None => {
            return respond(
                s,
                "400 Bad Request",
                "text/plain",
                "request head too large or cut\n",
            );
        }
    };
    let mut words = head.lines().next().unwrap_or("").split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics" | "/") => match source.snapshot().and_then(|snap| encode(&snap)) {
            Ok(body) => respond(s, "200 OK", CONTENT_TYPE, &body),
            Err(e) => respond(
                s,
                "503 Service Unavailable",
                "text/plain",
                &format!("{e}\n"),
            ),
        },
        ("GET", _) => respond(
            s,
            "404 Not Found",
            "text/plain",
            "the metrics are at /metrics\n",
        ),
        _ => respond(s, "405 Method Not Allowed", "text/plain", "GET only\n"),
    }
}

/// The request head (up to the blank line), or None if it exceeds [`MAX_REQUEST`] or the
/// connection closes first.
fn read_head(s: &mut TcpStream) -> std::io::Result<Option<String>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while buf.len() < MAX_REQUEST {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.windows(2).any(|w| w == b"\n\n") {
            return Ok(Some(String::from_utf8_lossy(&buf).into_owned()));
        }
    }
    Ok(None)
}

fn respond(s: &mut TcpStream, status: &str, ctype: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    s.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: SocketAddr, request: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(request).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn serves_metrics_and_refuses_the_rest() {
        let board = Board::new(1);
        let ep = Endpoint::serve("127.0.0.1:0".parse().unwrap(), Arc::new(board.clone())).unwrap();
        board.add_step(
            0,
            StepFigures {
                step: 7,
                ..StepFigures::default()
            },
        );
        let r = get(ep.addr(), b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(
            r.contains("openmetrics-text") && r.contains("\nflotilla_step 7.0\n"),
            "{r}"
        );
        assert!(get(ep.addr(), b"GET /x HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get(ep.addr(), b"POST / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        let huge = vec![b'a'; MAX_REQUEST];
        assert!(get(ep.addr(), &huge).starts_with("HTTP/1.1 400"));
        // A client that sends nothing is dropped after the timeout; the next one is served.
        let idle = TcpStream::connect(ep.addr()).unwrap();
        let r = get(ep.addr(), b"GET / HTTP/1.0\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        drop(idle);
        drop(ep);
    }
}
