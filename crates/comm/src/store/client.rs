//! The store client: one authenticated connection, shared by `&self` methods behind a mutex.
//!
//! Every call has a deadline: a per-request I/O timeout ([`DEFAULT_TIMEOUT`], see
//! [`StoreClient::with_timeout`]), or for [`StoreClient::wait`] the wait's own timeout plus
//! [`WAIT_MARGIN`]. A call that fails on the wire drops the connection (its state is unknown,
//! e.g. a late reply may still be in flight); the next call reconnects. A failed call is never
//! retried, since `add` and `compare_set` are not idempotent.
//!
//! A client and its clones follow one endpoint: [`StoreClient::redirect`] moves all of them to
//! another store (the launcher's failover to a standby store, after the one it used was lost);
//! each reconnects there at its next call.

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::auth::{Secret, client_handshake};
use super::proto::{self, MAX_FRAME_LEN, Op, Reply, Request, Response};
use crate::error::{CommError, Result};

/// Default timeout of one request (and of the handshake).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Extra socket read time granted to a `wait` beyond its own timeout.
pub const WAIT_MARGIN: Duration = Duration::from_secs(5);
/// Longest single TCP connect attempt while retrying.
const MAX_ATTEMPT: Duration = Duration::from_secs(5);
/// Backoff between connection attempts: starts here, doubles, capped at `MAX_BACKOFF`.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// A connection to a [`super::StoreServer`], usable from many threads (`&self`).
///
/// Calls on one client are serialized on its connection, so a thread blocked in
/// [`StoreClient::wait`] holds up the others: give waiting threads their own
/// [`StoreClient::try_clone`].
#[derive(Debug)]
pub struct StoreClient {
    /// The store this client and its clones talk to ([`StoreClient::redirect`] moves them all).
    target: Arc<Mutex<SocketAddr>>,
    secret: Secret,
    generation: AtomicU64,
    timeout: Duration,
    /// The open connection and the address it reaches; `None` after a failed exchange; the
    /// next call reconnects (also when the target moved).
    conn: Mutex<Option<(SocketAddr, TcpStream)>>,
}

impl StoreClient {
    /// Connects and authenticates to the store at `addr`, stamping requests with `generation`.
    /// Retries (with backoff) until `connect_timeout` passes, since the store may not be up yet;
    /// an authentication failure is not retried.
    pub fn connect(
        addr: SocketAddr,
        secret: &Secret,
        generation: u64,
        connect_timeout: Duration,
    ) -> Result<StoreClient> {
        let stream = open(addr, secret, connect_timeout, DEFAULT_TIMEOUT)?;
        Ok(StoreClient {
            target: Arc::new(Mutex::new(addr)),
            secret: secret.clone(),
            generation: AtomicU64::new(generation),
            timeout: DEFAULT_TIMEOUT,
            conn: Mutex::new(Some((addr, stream))),
        })
    }

    /// Sets the per-request I/O timeout (default [`DEFAULT_TIMEOUT`]; at least 1 ms).
    pub fn with_timeout(mut self, timeout: Duration) -> StoreClient {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// A second, independently authenticated connection with the same settings, following the
    /// same endpoint (a [`StoreClient::redirect`] of either moves both).
    pub fn try_clone(&self) -> Result<StoreClient> {
        let addr = self.addr();
        let stream = open(addr, &self.secret, self.timeout, self.timeout)?;
        Ok(StoreClient {
            target: Arc::clone(&self.target),
            secret: self.secret.clone(),
            generation: AtomicU64::new(self.stamp()),
            timeout: self.timeout,
            conn: Mutex::new(Some((addr, stream))),
        })
    }

    /// The store's address.
    pub fn addr(&self) -> SocketAddr {
        *lock(&self.target)
    }

    /// Moves this client and its clones to the store at `addr` (same secret): each one's next
    /// call connects there. Stamps are not changed (see [`StoreClient::set_generation`]).
    pub fn redirect(&self, addr: SocketAddr) {
        *lock(&self.target) = addr;
    }

    /// The per-request I/O timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The generation this client stamps on its requests.
    pub fn stamp(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Changes the generation stamped on later requests (e.g. after joining a new generation).
    pub fn set_generation(&self, generation: u64) {
        self.generation.store(generation, Ordering::SeqCst);
    }

    /// Stores `value` under `key`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        match self.call(Op::Set { key, value }, self.timeout)? {
            Reply::Unit => Ok(()),
            other => Err(unexpected("set", &other)),
        }
    }

    /// The value of `key`, or `None` if absent.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match self.call(Op::Get { key }, self.timeout)? {
            Reply::Value(v) => Ok(v),
            other => Err(unexpected("get", &other)),
        }
    }

    /// Blocks until every key exists, then returns their values in order. Fails after `timeout`
    /// with a [`CommError::Store`] naming the missing keys.
    pub fn wait<K: AsRef<str>>(&self, keys: &[K], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let keys: Vec<&str> = keys.iter().map(AsRef::as_ref).collect();
        let n = keys.len();
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let op = Op::Wait { keys, timeout_ms };
        match self.request(op, timeout.saturating_add(WAIT_MARGIN))? {
            Response::WaitTimeout { missing } => Err(CommError::Store(format!(
                "wait timed out after {timeout:?}: missing key(s) {missing:?}"
            ))),
            response => match into_reply("wait", response)? {
                Reply::Values(values) if values.len() == n => Ok(values),
                other => Err(unexpected("wait", &other)),
            },
        }
    }

    /// [`StoreClient::wait`] that reports the timeout as `None` instead of an error: for
    /// callers that wait in bounded slices and look at something else in between.
    pub fn wait_for<K: AsRef<str>>(
        &self,
        keys: &[K],
        timeout: Duration,
    ) -> Result<Option<Vec<Vec<u8>>>> {
        let keys: Vec<&str> = keys.iter().map(AsRef::as_ref).collect();
        let n = keys.len();
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let op = Op::Wait { keys, timeout_ms };
        match self.request(op, timeout.saturating_add(WAIT_MARGIN))? {
            Response::WaitTimeout { .. } => Ok(None),
            response => match into_reply("wait", response)? {
                Reply::Values(values) if values.len() == n => Ok(Some(values)),
                other => Err(unexpected("wait", &other)),
            },
        }
    }

    /// [`StoreClient::wait`] for a single key.
    pub fn wait_one(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut values = self.wait(&[key], timeout)?;
        values
            .pop()
            .ok_or_else(|| CommError::Store("wait: empty reply".into()))
    }

    /// Adds `delta` to the integer under `key` (absent counts as 0) and returns the new value.
    /// The value is stored as decimal text, so [`StoreClient::get`] returns e.g. `b"42"`.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        match self.call(Op::Add { key, delta }, self.timeout)? {
            Reply::Int(n) => Ok(n),
            other => Err(unexpected("add", &other)),
        }
    }

    /// Sets `key` to `new` if its current value equals `expected` (`None` = absent). Returns the
    /// value after the call: `new` on success, else the current value (`None` if absent).
    pub fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        new: &[u8],
    ) -> Result<Option<Vec<u8>>> {
        match self.call(Op::CompareSet { key, expected, new }, self.timeout)? {
            Reply::Value(v) => Ok(v),
            other => Err(unexpected("compare_set", &other)),
        }
    }

    /// Removes `key`; whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        match self.call(Op::Delete { key }, self.timeout)? {
            Reply::Bool(b) => Ok(b),
            other => Err(unexpected("delete", &other)),
        }
    }

    /// Number of keys in the store.
    pub fn num_keys(&self) -> Result<u64> {
        match self.call(Op::NumKeys, self.timeout)? {
            Reply::U64(n) => Ok(n),
            other => Err(unexpected("num_keys", &other)),
        }
    }

    /// The store's current generation (allowed whatever this client's stamp).
    pub fn generation(&self) -> Result<u64> {
        match self.call(Op::Generation, self.timeout)? {
            Reply::U64(n) => Ok(n),
            other => Err(unexpected("generation", &other)),
        }
    }

    /// Moves the store from generation `expected_current` to the next one and returns it (allowed
    /// whatever this client's stamp). If the store is not at `expected_current`, nothing changes:
    /// [`CommError::StaleGeneration`] when it has already moved past, else [`CommError::Store`].
    /// This client's own stamp is not changed (see [`StoreClient::set_generation`]).
    pub fn bump_generation(&self, expected_current: u64) -> Result<u64> {
        let op = Op::BumpGeneration {
            expected: expected_current,
        };
        match self.call(op, self.timeout)? {
            Reply::U64(n) => Ok(n),
            other => Err(unexpected("bump_generation", &other)),
        }
    }

    /// Sends one request and maps the server's answer to a reply or an error.
    fn call(&self, op: Op<'_>, io_timeout: Duration) -> Result<Reply> {
        let name = op.name();
        into_reply(name, self.request(op, io_timeout)?)
    }

    /// Sends one request and reads the server's answer, reconnecting first if an earlier
    /// exchange failed.
    fn request(&self, op: Op<'_>, io_timeout: Duration) -> Result<Response> {
        let name = op.name();
        // A chaos partition of this process: no request leaves until it heals.
        if crate::partition::hold(std::time::Instant::now() + io_timeout) {
            return Err(CommError::Store(format!(
                "{name}: no answer from {} within {io_timeout:?}: this process is cut off the \
                 network (chaos partition)",
                self.addr()
            )));
        }
        let frame = proto::encode_request(&Request {
            generation: self.stamp(),
            op,
        })?;
        let addr = self.addr();
        let mut conn = lock(&self.conn);
        if conn.as_ref().is_none_or(|(at, _)| *at != addr) {
            *conn = None;
            *conn = Some((addr, open(addr, &self.secret, self.timeout, self.timeout)?));
        }
        let Some((_, stream)) = conn.as_mut() else {
            return Err(CommError::Store(format!("{name}: no connection to {addr}")));
        };
        exchange(stream, &frame, io_timeout).map_err(|e| {
            // The stream may hold half a request or a late reply: never reuse it.
            *conn = None;
            annotate(e, name, addr)
        })
    }
}

/// Maps a server answer to the reply, or to the error it stands for.
fn into_reply(op: &str, response: Response) -> Result<Reply> {
    match response {
        Response::Ok(reply) => Ok(reply),
        Response::GenerationMismatch { got, current } if got < current => {
            Err(CommError::StaleGeneration { got, current })
        }
        Response::GenerationMismatch { got, current } if op == "bump_generation" => {
            Err(CommError::Store(format!(
                "bump_generation: expected generation {got}, but the store is at {current}"
            )))
        }
        Response::GenerationMismatch { got, current } => Err(CommError::Store(format!(
            "{op}: request stamped with generation {got}, newer than the store's generation {current}"
        ))),
        Response::WaitTimeout { missing } => Err(CommError::Store(format!(
            "{op}: wait timed out; missing key(s) {missing:?}"
        ))),
        Response::Error(msg) => Err(CommError::Store(format!("{op}: {msg}"))),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn unexpected(op: &str, reply: &Reply) -> CommError {
    CommError::Store(format!("{op}: unexpected reply from the store: {reply:?}"))
}

fn annotate(e: CommError, op: &str, addr: SocketAddr) -> CommError {
    match e {
        CommError::Io { context, source } => {
            CommError::io(format!("store {op} to {addr}: {context}"), source)
        }
        CommError::Store(msg) => CommError::Store(format!("{op} to {addr}: {msg}")),
        other => other,
    }
}

/// Writes one request frame and reads the response, all under `timeout` per socket operation.
fn exchange(stream: &mut TcpStream, frame: &[u8], timeout: Duration) -> Result<Response> {
    let timeout = timeout.max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| CommError::io("setting socket timeouts", e))?;
    std::io::Write::write_all(stream, frame)
        .map_err(|e| CommError::io(format!("sending the request (timeout {timeout:?})"), e))?;
    match proto::read_frame(stream, MAX_FRAME_LEN) {
        Ok(Some(body)) => proto::decode_response(&body),
        Ok(None) => Err(CommError::io(
            "reading the reply",
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the store closed the connection",
            ),
        )),
        Err(CommError::Io { context, source }) => Err(CommError::io(
            format!("{context} (timeout {timeout:?})"),
            source,
        )),
        Err(e) => Err(e),
    }
}

/// Connects and authenticates, retrying with backoff until `connect_timeout` passes.
fn open(
    addr: SocketAddr,
    secret: &Secret,
    connect_timeout: Duration,
    io_timeout: Duration,
) -> Result<TcpStream> {
    let start = Instant::now();
    let deadline = start + connect_timeout;
    let mut backoff = FIRST_BACKOFF;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let remaining = deadline.saturating_duration_since(Instant::now());
        let err = match attempt(addr, secret, remaining, io_timeout) {
            Ok(stream) => return Ok(stream),
            Err(CommError::Auth(msg)) => {
                return Err(CommError::Auth(format!("store at {addr}: {msg}")));
            }
            Err(e) => e,
        };
        let now = Instant::now();
        if now >= deadline {
            let what = format!(
                "connecting to the store at {addr} (gave up after {attempts} attempt(s) in {:?})",
                start.elapsed()
            );
            return Err(match err {
                CommError::Io { context, source } => {
                    CommError::io(format!("{what}: {context}"), source)
                }
                other => CommError::Store(format!("{what}: {other}")),
            });
        }
        tracing::debug!("store at {addr} not reachable yet ({err}); retrying in {backoff:?}");
        std::thread::sleep(backoff.min(deadline - now));
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One connection attempt: TCP connect, then the handshake.
fn attempt(
    addr: SocketAddr,
    secret: &Secret,
    remaining: Duration,
    io_timeout: Duration,
) -> Result<TcpStream> {
    let connect_for = remaining.clamp(Duration::from_millis(100), MAX_ATTEMPT);
    let mut stream = TcpStream::connect_timeout(&addr, connect_for)
        .map_err(|e| CommError::io("TCP connect", e))?;
    // Bound the handshake by the connect deadline too (but give a live server at least 1 s).
    let handshake_for = io_timeout.min(remaining.max(Duration::from_secs(1)));
    stream
        .set_nodelay(true)
        .and_then(|()| stream.set_read_timeout(Some(handshake_for)))
        .and_then(|()| stream.set_write_timeout(Some(handshake_for)))
        .map_err(|e| CommError::io("configuring the socket", e))?;
    client_handshake(&mut stream, secret)?;
    Ok(stream)
}
