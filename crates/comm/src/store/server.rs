//! The store server: one thread per connection over a `HashMap` guarded by a `Mutex`, with a
//! `Condvar` for blocking waits, and a generation counter used to fence off stale clients.
//!
//! Life of a connection: accept (refused beyond [`ServerOptions::max_connections`]) → handshake
//! under [`ServerOptions::handshake_timeout`] (a refused or silent client is dropped before a single
//! request byte is read) → request/response loop until the client closes, sends something
//! malformed, or the server shuts down. [`StoreServer::shutdown`] (also run on drop) wakes the
//! blocking `accept` with `shutdown(2)` on the listening socket, shuts down every live connection
//! and wakes every waiter, then joins all threads.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::auth::{Secret, server_handshake};
use super::proto::{self, MAX_FRAME_LEN, Op, Reply, Request, Response};
use crate::error::{CommError, Result};

/// Longest wait a client may ask for; longer timeouts are clamped.
pub const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// Tunables of a [`StoreServer`].
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// How long a new connection may take to complete the handshake before it is dropped.
    pub handshake_timeout: Duration,
    /// Most connections served at once; further ones are closed on accept.
    pub max_connections: usize,
    /// Timeout of each write to a client (a client that stops reading is dropped).
    pub write_timeout: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            handshake_timeout: Duration::from_secs(10),
            max_connections: 4096,
            write_timeout: Duration::from_secs(30),
        }
    }
}

/// The key-value state and the generation.
#[derive(Debug, Default)]
struct State {
    kv: HashMap<String, Vec<u8>>,
    generation: u64,
    shutting_down: bool,
}

/// One live connection: a handle to its socket (to shut it down) and its thread.
struct Conn {
    stream: TcpStream,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled on every change a waiter may care about (new key, generation bump, shutdown).
    changed: Condvar,
    secret: Secret,
    options: ServerOptions,
    stopping: AtomicBool,
    conns: Mutex<HashMap<u64, Conn>>,
    live: AtomicUsize,
    next_id: AtomicU64,
}

/// A running store server. Dropping it shuts it down.
pub struct StoreServer {
    local_addr: SocketAddr,
    listener: Arc<TcpListener>,
    shared: Arc<Shared>,
    accept_thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("local_addr", &self.local_addr)
            .field(
                "live_connections",
                &self.shared.live.load(Ordering::Relaxed),
            )
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving with default options.
    pub fn bind(addr: SocketAddr, secret: Secret) -> Result<StoreServer> {
        StoreServer::bind_with(addr, secret, ServerOptions::default())
    }

    /// Binds `addr` and starts serving with the given options.
    pub fn bind_with(
        addr: SocketAddr,
        secret: Secret,
        options: ServerOptions,
    ) -> Result<StoreServer> {
        if options.max_connections == 0
            || options.handshake_timeout.is_zero()
            || options.write_timeout.is_zero()
        {
            return Err(CommError::InvalidArgument(format!(
                "store server needs max_connections > 0 and non-zero timeouts, got {options:?}"
            )));
        }
        let listener = TcpListener::bind(addr)
            .map_err(|e| CommError::io(format!("binding the store server to {addr}"), e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| CommError::io("reading the store server's address", e))?;
        let listener = Arc::new(listener);
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            secret,
            options,
            stopping: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            live: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
        });
        let accept_thread = {
            let (listener, shared) = (Arc::clone(&listener), Arc::clone(&shared));
            std::thread::Builder::new()
                .name("flotilla-store-accept".into())
                .spawn(move || accept_loop(&listener, &shared))
                .map_err(|e| CommError::io("spawning the store accept thread", e))?
        };
        tracing::info!("store server listening on {local_addr}");
        Ok(StoreServer {
            local_addr,
            listener,
            shared,
            accept_thread: Mutex::new(Some(accept_thread)),
        })
    }

    /// The address the server listens on (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Number of connections being served right now.
    pub fn live_connections(&self) -> usize {
        self.shared.live.load(Ordering::SeqCst)
    }

    /// The store's current generation.
    pub fn generation(&self) -> u64 {
        lock(&self.shared.state).generation
    }

    /// Raises the store's generation to `generation` if it is below (never lowers it) and
    /// returns the generation now. This is how a standby store takes over a job whose store was
    /// lost (`launch`'s failover, 001 section 12.7): started at a generation above any the lost
    /// store reached, it refuses every request a worker or agent of an older generation still
    /// stamps, so nothing left over from before the loss can act on it.
    pub fn fence(&self, generation: u64) -> u64 {
        let mut st = lock(&self.shared.state);
        if st.generation < generation {
            st.generation = generation;
            self.shared.changed.notify_all();
            tracing::info!("store generation fenced to {generation}");
        }
        st.generation
    }

    /// Stops the server: no new connections, every live connection closed, every pending wait
    /// answered with an error; returns once all server threads have exited. Idempotent.
    pub fn shutdown(&self) {
        let accept_thread = lock(&self.accept_thread).take();
        let Some(accept_thread) = accept_thread else {
            return;
        };
        self.shared.stopping.store(true, Ordering::SeqCst);
        {
            let mut st = lock(&self.shared.state);
            st.shutting_down = true;
            self.shared.changed.notify_all();
        }
        // Wake the blocking accept(2): shutdown(2) on a listening socket makes it fail at once
        // (Linux); a connection to ourselves covers platforms where it does not.
        // SAFETY: the fd belongs to `self.listener`, which is alive for this whole call.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        let _ = TcpStream::connect_timeout(&wake_addr(self.local_addr), Duration::from_millis(200));
        let _ = accept_thread.join();

        // The accept loop is gone, so no connection can be added any more.
        let conns: Vec<Conn> = lock(&self.shared.conns).drain().map(|(_, c)| c).collect();
        for conn in &conns {
            let _ = conn.stream.shutdown(std::net::Shutdown::Both);
        }
        for conn in conns {
            if let Some(thread) = conn.thread {
                let _ = thread.join();
            }
        }
        tracing::info!("store server on {} shut down", self.local_addr);
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Where to connect to reach our own listener (loopback when bound to the unspecified address).
fn wake_addr(local: SocketAddr) -> SocketAddr {
    let ip = match local.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, local.port())
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    loop {
        let accepted = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match accepted {
            Ok((stream, peer)) => admit(shared, stream, peer),
            Err(e) => match e.kind() {
                std::io::ErrorKind::Interrupted | std::io::ErrorKind::ConnectionAborted => {}
                _ => {
                    // E.g. out of file descriptors: back off instead of spinning on the error.
                    tracing::warn!("store accept failed: {e}; retrying in 50 ms");
                    std::thread::sleep(Duration::from_millis(50));
                }
            },
        }
    }
}

/// Registers a new connection and starts its thread (or drops it when at capacity).
fn admit(shared: &Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
    let max = shared.options.max_connections;
    if shared.live.fetch_add(1, Ordering::SeqCst) >= max {
        shared.live.fetch_sub(1, Ordering::SeqCst);
        tracing::warn!("store refusing {peer}: already serving {max} connections");
        return;
    }
    let registered = match stream.try_clone() {
        Ok(s) => s,
        Err(e) => {
            shared.live.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("store dropping {peer}: {e}");
            return;
        }
    };
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    // Register before spawning, so that a thread that finishes at once still finds its entry.
    lock(&shared.conns).insert(
        id,
        Conn {
            stream: registered,
            thread: None,
        },
    );
    let thread_shared = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name("flotilla-store-conn".into())
        .spawn(move || {
            let _guard = ConnGuard {
                shared: &thread_shared,
                id,
            };
            serve(&thread_shared, stream, peer);
        });
    match spawned {
        Ok(handle) => {
            if let Some(conn) = lock(&shared.conns).get_mut(&id) {
                conn.thread = Some(handle);
            }
        }
        Err(e) => {
            lock(&shared.conns).remove(&id);
            shared.live.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("store dropping {peer}: cannot spawn a thread: {e}");
        }
    }
}

/// Unregisters a connection when its thread ends, however it ends.
struct ConnGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for ConnGuard<'_> {
    fn drop(&mut self) {
        lock(&self.shared.conns).remove(&self.id);
        self.shared.live.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serves one connection until it closes, misbehaves or the server stops.
fn serve(shared: &Shared, mut stream: TcpStream, peer: SocketAddr) {
    let opts = &shared.options;
    let setup = stream
        .set_read_timeout(Some(opts.handshake_timeout))
        .and_then(|()| stream.set_write_timeout(Some(opts.write_timeout)))
        .and_then(|()| stream.set_nodelay(true));
    if let Err(e) = setup {
        tracing::warn!("store dropping {peer}: {e}");
        return;
    }
    if let Err(e) = server_handshake(&mut stream, &shared.secret) {
        tracing::warn!("store refused {peer}: {e}");
        return;
    }
    // Authenticated: an idle client may stay connected as long as it likes (shutdown closes it).
    if let Err(e) = stream.set_read_timeout(None) {
        tracing::warn!("store dropping {peer}: {e}");
        return;
    }
    tracing::debug!("store client {peer} authenticated");
    loop {
        let body = match proto::read_frame(&mut stream, MAX_FRAME_LEN) {
            Ok(Some(body)) => body,
            Ok(None) => break,
            Err(e) => {
                if !shared.stopping.load(Ordering::SeqCst) {
                    tracing::warn!("store dropping {peer}: {e}");
                }
                break;
            }
        };
        let (response, keep_going) = match proto::decode_request(&body) {
            Ok(req) => (shared.handle(req), true),
            Err(e) => {
                tracing::warn!("store dropping {peer}: {e}");
                (Response::Error(e.to_string()), false)
            }
        };
        drop(body);
        if let Err(e) = std::io::Write::write_all(&mut stream, &proto::encode_response(&response)) {
            tracing::debug!("store dropping {peer}: writing a reply: {e}");
            break;
        }
        if !keep_going || shared.stopping.load(Ordering::SeqCst) {
            break;
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

impl Shared {
    /// Applies one decoded request and returns the answer.
    fn handle(&self, req: Request<'_>) -> Response {
        let mut st = lock(&self.state);
        if st.shutting_down {
            return Response::Error("the store is shutting down".into());
        }
        if req.op.is_fenced() && req.generation != st.generation {
            return Response::GenerationMismatch {
                got: req.generation,
                current: st.generation,
            };
        }
        match req.op {
            Op::Set { key, value } => {
                st.kv.insert(key.to_owned(), value.to_vec());
                self.changed.notify_all();
                Response::Ok(Reply::Unit)
            }
            Op::Get { key } => Response::Ok(Reply::Value(st.kv.get(key).cloned())),
            Op::Wait { keys, timeout_ms } => {
                let timeout = Duration::from_millis(timeout_ms).min(MAX_WAIT);
                self.wait(st, &keys, req.generation, timeout)
            }
            Op::Add { key, delta } => add(&mut st, key, delta, &self.changed),
            Op::CompareSet { key, expected, new } => {
                let current = st.kv.get(key).map(Vec::as_slice);
                if current == expected {
                    st.kv.insert(key.to_owned(), new.to_vec());
                    self.changed.notify_all();
                    Response::Ok(Reply::Value(Some(new.to_vec())))
                } else {
                    Response::Ok(Reply::Value(current.map(<[u8]>::to_vec)))
                }
            }
            Op::Delete { key } => Response::Ok(Reply::Bool(st.kv.remove(key).is_some())),
            Op::NumKeys => Response::Ok(Reply::U64(st.kv.len() as u64)),
            Op::Generation => Response::Ok(Reply::U64(st.generation)),
            Op::BumpGeneration { expected } => {
                if expected != st.generation {
                    return Response::GenerationMismatch {
                        got: expected,
                        current: st.generation,
                    };
                }
                let Some(next) = st.generation.checked_add(1) else {
                    return Response::Error("the generation counter is exhausted".into());
                };
                st.generation = next;
                // Waiters of the old generation must now fail as stale.
                self.changed.notify_all();
                tracing::info!("store generation bumped to {next}");
                Response::Ok(Reply::U64(next))
            }
        }
    }

    /// Blocks (on the condition variable, never polling) until every key exists, the timeout
    /// passes, the generation moves on or the server stops.
    fn wait(
        &self,
        mut st: MutexGuard<'_, State>,
        keys: &[&str],
        generation: u64,
        timeout: Duration,
    ) -> Response {
        let start = Instant::now();
        loop {
            if st.shutting_down {
                return Response::Error("the store is shutting down".into());
            }
            if st.generation != generation {
                return Response::GenerationMismatch {
                    got: generation,
                    current: st.generation,
                };
            }
            if keys.iter().all(|k| st.kv.contains_key(*k)) {
                let values = keys.iter().filter_map(|k| st.kv.get(*k).cloned()).collect();
                return Response::Ok(Reply::Values(values));
            }
            let elapsed = start.elapsed();
            if elapsed >= timeout {
                let missing = keys
                    .iter()
                    .filter(|k| !st.kv.contains_key(**k))
                    .map(|k| (*k).to_owned())
                    .collect();
                return Response::WaitTimeout { missing };
            }
            st = self
                .changed
                .wait_timeout(st, timeout - elapsed)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// `add`: the value is kept as decimal text, so `get` returns something readable.
fn add(st: &mut State, key: &str, delta: i64, changed: &Condvar) -> Response {
    let current = match st.kv.get(key) {
        None => 0,
        Some(v) => match std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
        {
            Some(n) => n,
            None => {
                return Response::Error(format!(
                    "add: the value of key '{key}' is not a decimal integer"
                ));
            }
        },
    };
    let Some(next) = current.checked_add(delta) else {
        return Response::Error(format!(
            "add: {current} + {delta} overflows for key '{key}'"
        ));
    };
    st.kv.insert(key.to_owned(), next.to_string().into_bytes());
    changed.notify_all();
    Response::Ok(Reply::Int(next))
}

#[cfg(test)]
#[path = "server_tests.rs"]
mod tests;
