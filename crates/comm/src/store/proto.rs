//! Wire protocol of the store: length-prefixed binary frames over TCP (after the handshake of
//! [`super::auth`]). All integers are little endian.
//!
//! ```text
//! frame     := len:u32 body[len]                       len <= MAX_FRAME_LEN
//! request   := op:u8 generation:u64 args
//!   SET 1          key value
//!   GET 2          key
//!   WAIT 3         timeout_ms:u64 count:u32 key*count  count <= MAX_WAIT_KEYS
//!   ADD 4          key delta:i64
//!   COMPARE_SET 5  key opt_bytes(expected) bytes(new)
//!   DELETE 6       key
//!   NUM_KEYS 7     -
//!   GENERATION 8   -                                   (not fenced)
//!   BUMP 9         expected:u64                        (not fenced)
//! key       := len:u32 utf8[len]                       1 <= len <= MAX_KEY_LEN
//! bytes     := len:u32 [len]                           len <= MAX_VALUE_LEN
//! opt_bytes := 0:u8 | 1:u8 bytes
//! response  := 0:u8 reply | 1:u8 got:u64 current:u64 (generation mismatch)
//!            | 2:u8 count:u32 key*count (wait timed out; the missing keys)
//!            | 3:u8 bytes(utf8 message) (request failed)
//! reply     := 0:u8 (unit) | 1:u8 opt_bytes | 2:u8 count:u32 bytes*count
//!            | 3:u8 i64 | 4:u8 u64 | 5:u8 bool:u8
//! ```
//!
//! Every length is checked against its limit and against the bytes actually left in the frame
//! before anything is allocated, and a frame body is read in chunks as it arrives, so a hostile
//! length field can never size an allocation. A request that does not decode ends the connection.

use std::io::{ErrorKind, Read};

use crate::error::{CommError, Result};

/// Largest key, in bytes.
pub const MAX_KEY_LEN: usize = 4 << 10;
/// Largest value, in bytes.
pub const MAX_VALUE_LEN: usize = 64 << 20;
/// Largest frame body (request or response), in bytes: one maximal value plus headroom.
pub const MAX_FRAME_LEN: usize = MAX_VALUE_LEN + (64 << 10);
/// Most keys one `wait` may name.
pub const MAX_WAIT_KEYS: usize = 16 << 10;
/// Frame bodies are read (and their buffer grown) at most this many bytes at a time.
const READ_CHUNK: usize = 64 << 10;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_WAIT: u8 = 3;
const OP_ADD: u8 = 4;
const OP_COMPARE_SET: u8 = 5;
const OP_DELETE: u8 = 6;
const OP_NUM_KEYS: u8 = 7;
const OP_GENERATION: u8 = 8;
const OP_BUMP: u8 = 9;

const ST_OK: u8 = 0;
const ST_GENERATION: u8 = 1;
const ST_WAIT_TIMEOUT: u8 = 2;
const ST_ERROR: u8 = 3;

const R_UNIT: u8 = 0;
const R_VALUE: u8 = 1;
const R_VALUES: u8 = 2;
const R_INT: u8 = 3;
const R_U64: u8 = 4;
const R_BOOL: u8 = 5;

/// One store operation, borrowing its keys and values (from the caller, or from the frame body).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op<'a> {
    /// Store `value` under `key`.
    Set { key: &'a str, value: &'a [u8] },
    /// Read `key`.
    Get { key: &'a str },
    /// Block until all `keys` exist (at most `timeout_ms`), then read them.
    Wait { keys: Vec<&'a str>, timeout_ms: u64 },
    /// Add `delta` to the decimal integer stored under `key` (absent = 0).
    Add { key: &'a str, delta: i64 },
    /// Set `key` to `new` if its current value equals `expected` (`None` = absent).
    CompareSet {
        key: &'a str,
        expected: Option<&'a [u8]>,
        new: &'a [u8],
    },
    /// Remove `key`.
    Delete { key: &'a str },
    /// Count the keys.
    NumKeys,
    /// Read the store's generation (not fenced).
    Generation,
    /// Compare-and-swap the generation from `expected` to `expected + 1` (not fenced).
    BumpGeneration { expected: u64 },
}

impl Op<'_> {
    /// Name of the operation, for errors and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Set { .. } => "set",
            Op::Get { .. } => "get",
            Op::Wait { .. } => "wait",
            Op::Add { .. } => "add",
            Op::CompareSet { .. } => "compare_set",
            Op::Delete { .. } => "delete",
            Op::NumKeys => "num_keys",
            Op::Generation => "generation",
            Op::BumpGeneration { .. } => "bump_generation",
        }
    }

    /// Whether the request's generation stamp must equal the store's generation.
    pub fn is_fenced(&self) -> bool {
        !matches!(self, Op::Generation | Op::BumpGeneration { .. })
    }
}

/// A request: an operation stamped with the client's generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request<'a> {
    /// The client's generation (fencing stamp).
    pub generation: u64,
    /// What to do.
    pub op: Op<'a>,
}

/// The payload of a successful response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Nothing (set).
    Unit,
    /// A value or its absence (get, compare_set).
    Value(Option<Vec<u8>>),
    /// One value per waited key, in order (wait).
    Values(Vec<Vec<u8>>),
    /// A signed integer (add).
    Int(i64),
    /// An unsigned integer (num_keys, generation, bump_generation).
    U64(u64),
    /// A flag (delete).
    Bool(bool),
}

/// The server's answer to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// The request was applied.
    Ok(Reply),
    /// Rejected, not applied: the stamp `got` is not the store's generation `current` (for
    /// `bump_generation`, `got` is the caller's expected generation).
    GenerationMismatch { got: u64, current: u64 },
    /// A wait timed out; these keys were still missing.
    WaitTimeout { missing: Vec<String> },
    /// The request failed (bad argument, non-integer value for add, ...).
    Error(String),
}

fn malformed(what: impl std::fmt::Display) -> CommError {
    CommError::Store(format!("malformed store message: {what}"))
}

// ---------------------------------------------------------------------------------------------
// Encoding

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_len(out: &mut Vec<u8>, len: usize, limit: usize, what: &str) -> Result<()> {
    if len > limit {
        return Err(CommError::InvalidArgument(format!(
            "{what} of {len} bytes exceeds the store limit of {limit} bytes"
        )));
    }
    put_u32(out, len as u32);
    Ok(())
}

fn put_key(out: &mut Vec<u8>, key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(CommError::InvalidArgument(
            "store keys must not be empty".into(),
        ));
    }
    put_len(out, key.len(), MAX_KEY_LEN, "key")?;
    out.extend_from_slice(key.as_bytes());
    Ok(())
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) -> Result<()> {
    put_len(out, bytes.len(), MAX_VALUE_LEN, "value")?;
    out.extend_from_slice(bytes);
    Ok(())
}

fn put_opt_bytes(out: &mut Vec<u8>, bytes: Option<&[u8]>) -> Result<()> {
    match bytes {
        None => out.push(0),
        Some(b) => {
            out.push(1);
            put_bytes(out, b)?;
        }
    }
    Ok(())
}

/// Starts a frame: a length placeholder, patched by [`finish_frame`].
fn start_frame(capacity: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + capacity);
    out.extend_from_slice(&[0; 4]);
    out
}

fn finish_frame(mut out: Vec<u8>) -> Result<Vec<u8>> {
    let body = out.len() - 4;
    if body > MAX_FRAME_LEN {
        return Err(CommError::InvalidArgument(format!(
            "store message of {body} bytes exceeds the frame limit of {MAX_FRAME_LEN} bytes"
        )));
    }
    out[..4].copy_from_slice(&(body as u32).to_le_bytes());
    Ok(out)
}

/// Encodes a request as a whole frame (length prefix included). Oversized keys, values or
/// frames are [`CommError::InvalidArgument`].
pub fn encode_request(req: &Request<'_>) -> Result<Vec<u8>> {
    let hint = match &req.op {
        Op::Set { key, value } => key.len() + value.len(),
        Op::CompareSet { key, expected, new } => {
            key.len() + new.len() + expected.map_or(0, <[u8]>::len)
        }
        _ => 0,
    };
    let mut out = start_frame(32 + hint.min(MAX_FRAME_LEN));
    let (code, generation) = (op_code(&req.op), req.generation);
    out.push(code);
    put_u64(&mut out, generation);
    match &req.op {
        Op::Set { key, value } => {
            put_key(&mut out, key)?;
            put_bytes(&mut out, value)?;
        }
        Op::Get { key } | Op::Delete { key } => put_key(&mut out, key)?,
        Op::Wait { keys, timeout_ms } => {
            put_u64(&mut out, *timeout_ms);
            put_len(&mut out, keys.len(), MAX_WAIT_KEYS, "wait key count")?;
            for key in keys {
                put_key(&mut out, key)?;
            }
        }
        Op::Add { key, delta } => {
            put_key(&mut out, key)?;
            out.extend_from_slice(&delta.to_le_bytes());
        }
        Op::CompareSet { key, expected, new } => {
            put_key(&mut out, key)?;
            put_opt_bytes(&mut out, *expected)?;
            put_bytes(&mut out, new)?;
        }
        Op::NumKeys | Op::Generation => {}
        Op::BumpGeneration { expected } => put_u64(&mut out, *expected),
    }
    finish_frame(out)
}

fn op_code(op: &Op<'_>) -> u8 {
    match op {
        Op::Set { .. } => OP_SET,
        Op::Get { .. } => OP_GET,
        Op::Wait { .. } => OP_WAIT,
        Op::Add { .. } => OP_ADD,
        Op::CompareSet { .. } => OP_COMPARE_SET,
        Op::Delete { .. } => OP_DELETE,
        Op::NumKeys => OP_NUM_KEYS,
        Op::Generation => OP_GENERATION,
        Op::BumpGeneration { .. } => OP_BUMP,
    }
}

/// Encodes a response as a whole frame. A response that would exceed the frame limit (e.g. a
/// wait on many large values) is replaced by an [`Response::Error`] saying so.
pub fn encode_response(resp: &Response) -> Vec<u8> {
    match try_encode_response(resp) {
        Ok(frame) => frame,
        Err(e) => {
            let fallback = Response::Error(format!("reply too large: {e}"));
            // A short error message always fits.
            try_encode_response(&fallback).unwrap_or_default()
        }
    }
}

fn try_encode_response(resp: &Response) -> Result<Vec<u8>> {
    let mut out = start_frame(64);
    match resp {
        Response::Ok(reply) => {
            out.push(ST_OK);
            match reply {
                Reply::Unit => out.push(R_UNIT),
                Reply::Value(v) => {
                    out.push(R_VALUE);
                    put_opt_bytes(&mut out, v.as_deref())?;
                }
                Reply::Values(vs) => {
                    out.push(R_VALUES);
                    let total: usize = vs.iter().map(|v| 4 + v.len()).sum();
                    if total > MAX_FRAME_LEN {
                        return Err(CommError::InvalidArgument(format!(
                            "{total} bytes of values exceed the frame limit of {MAX_FRAME_LEN} bytes"
                        )));
                    }
                    out.reserve(total + 4);
                    put_len(&mut out, vs.len(), MAX_WAIT_KEYS, "value count")?;
                    for v in vs {
                        put_bytes(&mut out, v)?;
                    }
                }
                Reply::Int(i) => {
                    out.push(R_INT);
                    out.extend_from_slice(&i.to_le_bytes());
                }
                Reply::U64(u) => {
                    out.push(R_U64);
                    put_u64(&mut out, *u);
                }
                Reply::Bool(b) => {
                    out.push(R_BOOL);
                    out.push(u8::from(*b));
                }
            }
        }
        Response::GenerationMismatch { got, current } => {
            out.push(ST_GENERATION);
            put_u64(&mut out, *got);
            put_u64(&mut out, *current);
        }
        Response::WaitTimeout { missing } => {
            out.push(ST_WAIT_TIMEOUT);
            put_len(&mut out, missing.len(), MAX_WAIT_KEYS, "missing key count")?;
            for key in missing {
                put_key(&mut out, key)?;
            }
        }
        Response::Error(msg) => {
            out.push(ST_ERROR);
            // Keep error messages short; cut at a char boundary.
            let mut end = msg.len().min(MAX_KEY_LEN);
            while !msg.is_char_boundary(end) {
                end -= 1;
            }
            put_bytes(&mut out, &msg.as_bytes()[..end])?;
        }
    }
    finish_frame(out)
}

// ---------------------------------------------------------------------------------------------
// Decoding

/// A bounds-checked cursor over a frame body.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(malformed(format_args!(
                "{what} needs {n} bytes but only {left} remain"
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(a))
    }

    fn i64(&mut self, what: &str) -> Result<i64> {
        Ok(self.u64(what)? as i64)
    }

    /// A length field, checked against `limit` (the bytes themselves are checked by `take`).
    fn len(&mut self, limit: usize, what: &str) -> Result<usize> {
        let len = self.u32(what)? as usize;
        if len > limit {
            return Err(malformed(format_args!(
                "{what} of {len} exceeds the limit of {limit}"
            )));
        }
        Ok(len)
    }

    fn key(&mut self) -> Result<&'a str> {
        let len = self.len(MAX_KEY_LEN, "key length")?;
        if len == 0 {
            return Err(malformed("empty key"));
        }
        std::str::from_utf8(self.take(len, "key")?).map_err(|_| malformed("key is not UTF-8"))
    }

    fn bytes(&mut self) -> Result<&'a [u8]> {
        let len = self.len(MAX_VALUE_LEN, "value length")?;
        self.take(len, "value")
    }

    fn opt_bytes(&mut self) -> Result<Option<&'a [u8]>> {
        match self.u8("option tag")? {
            0 => Ok(None),
            1 => self.bytes().map(Some),
            t => Err(malformed(format_args!("bad option tag {t}"))),
        }
    }

    /// A count of items that take at least `min_item` bytes each (so it cannot exceed what is
    /// left) and at most `limit`.
    fn count(&mut self, limit: usize, min_item: usize, what: &str) -> Result<usize> {
        let n = self.len(limit, what)?;
        let left = self.buf.len() - self.pos;
        if n.saturating_mul(min_item) > left {
            return Err(malformed(format_args!(
                "{what} {n} cannot fit in the {left} bytes left"
            )));
        }
        Ok(n)
    }

    fn finish<T>(self, value: T) -> Result<T> {
        if self.pos != self.buf.len() {
            return Err(malformed(format_args!(
                "{} trailing bytes",
                self.buf.len() - self.pos
            )));
        }
        Ok(value)
    }
}

/// Decodes a request body (without its length prefix), borrowing keys and values from it.
/// Any malformed input is an error, never a panic, and nothing larger than the body is allocated.
pub fn decode_request(body: &[u8]) -> Result<Request<'_>> {
    let mut c = Cursor::new(body);
    let code = c.u8("op code")?;
    let generation = c.u64("generation")?;
    let op = match code {
        OP_SET => {
            let key = c.key()?;
            let value = c.bytes()?;
            Op::Set { key, value }
        }
        OP_GET => Op::Get { key: c.key()? },
        OP_WAIT => {
            let timeout_ms = c.u64("timeout")?;
            let n = c.count(MAX_WAIT_KEYS, 5, "wait key count")?;
            let mut keys = Vec::with_capacity(n);
            for _ in 0..n {
                keys.push(c.key()?);
            }
            Op::Wait { keys, timeout_ms }
        }
        OP_ADD => {
            let key = c.key()?;
            let delta = c.i64("delta")?;
            Op::Add { key, delta }
        }
        OP_COMPARE_SET => {
            let key = c.key()?;
            let expected = c.opt_bytes()?;
            let new = c.bytes()?;
            Op::CompareSet { key, expected, new }
        }
        OP_DELETE => Op::Delete { key: c.key()? },
        OP_NUM_KEYS => Op::NumKeys,
        OP_GENERATION => Op::Generation,
        OP_BUMP => Op::BumpGeneration {
            expected: c.u64("expected generation")?,
        },
        other => return Err(malformed(format_args!("unknown op code {other}"))),
    };
    c.finish(Request { generation, op })
}

/// Decodes a response body (without its length prefix).
pub fn decode_response(body: &[u8]) -> Result<Response> {
    let mut c = Cursor::new(body);
    let resp = match c.u8("status")? {
        ST_OK => Response::Ok(match c.u8("reply kind")? {
            R_UNIT => Reply::Unit,
            R_VALUE => Reply::Value(c.opt_bytes()?.map(<[u8]>::to_vec)),
            R_VALUES => {
                let n = c.count(MAX_WAIT_KEYS, 4, "value count")?;
                let mut values = Vec::with_capacity(n);
                for _ in 0..n {
                    values.push(c.bytes()?.to_vec());
                }
                Reply::Values(values)
            }
            R_INT => Reply::Int(c.i64("integer")?),
            R_U64 => Reply::U64(c.u64("integer")?),
            R_BOOL => Reply::Bool(match c.u8("flag")? {
                0 => false,
                1 => true,
                b => return Err(malformed(format_args!("bad flag {b}"))),
            }),
            k => return Err(malformed(format_args!("unknown reply kind {k}"))),
        }),
        ST_GENERATION => Response::GenerationMismatch {
            got: c.u64("generation")?,
            current: c.u64("generation")?,
        },
        ST_WAIT_TIMEOUT => {
            let n = c.count(MAX_WAIT_KEYS, 5, "missing key count")?;
            let mut missing = Vec::with_capacity(n);
            for _ in 0..n {
                missing.push(c.key()?.to_owned());
            }
            Response::WaitTimeout { missing }
        }
        ST_ERROR => Response::Error(String::from_utf8_lossy(c.bytes()?).into_owned()),
        s => return Err(malformed(format_args!("unknown status {s}"))),
    };
    c.finish(resp)
}

/// Reads one frame body of at most `limit` bytes. `Ok(None)` on a clean end of stream before the
/// frame starts. A length over `limit` is rejected before anything is allocated, and the body is
/// read in chunks, so the buffer only grows as bytes actually arrive; a truncated frame is an
/// error.
pub fn read_frame<R: Read>(r: &mut R, limit: usize) -> Result<Option<Vec<u8>>> {
    let mut len_bytes = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len_bytes[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(malformed("stream ended inside a frame length")),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(CommError::io("reading a store frame", e)),
        }
    }
    let len = u32::from_le_bytes(len_bytes) as usize;
    if len > limit {
        return Err(malformed(format_args!(
            "frame length {len} exceeds the limit of {limit} bytes"
        )));
    }
    let mut body = Vec::with_capacity(len.min(READ_CHUNK));
    while body.len() < len {
        let start = body.len();
        let want = (len - start).min(READ_CHUNK);
        body.resize(start + want, 0);
        match r.read(&mut body[start..]) {
            Ok(0) => {
                return Err(malformed(format_args!(
                    "stream ended after {start} of {len} frame bytes"
                )));
            }
            Ok(n) => body.truncate(start + n),
            Err(e) if e.kind() == ErrorKind::Interrupted => body.truncate(start),
            Err(e) => return Err(CommError::io("reading a store frame", e)),
        }
    }
    Ok(Some(body))
}

#[cfg(test)]
#[path = "proto_tests.rs"]
mod tests;
