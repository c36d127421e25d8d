//! One structured error enum for the whole crate (candle style).
//!
//! Every error that ends a collective names the op (kind, sequence number, bytes), the group and the
//! rank(s) it was waiting for, so a stuck or failed job always says *who* and *what*.

use std::fmt;
use std::time::Duration;

/// Identity of one collective call, carried by every op-level error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpDesc {
    /// Name of the group the op ran on (`world`, `tp0`, ...).
    pub group: String,
    /// Operation kind (`all_reduce`, ...).
    pub kind: &'static str,
    /// Group-wide sequence number of the op.
    pub seq: u64,
    /// Bytes of this rank's input buffer.
    pub bytes: usize,
    /// Algorithm that was running.
    pub algo: &'static str,
}

impl fmt::Display for OpDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} #{} ({} bytes, {}) on group '{}'",
            self.kind, self.seq, self.bytes, self.algo, self.group
        )
    }
}

/// Errors of the communication library.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    // === Op-level failures ===
    /// The op did not complete within its timeout.
    #[error("timeout after {timeout:?} in {op}: waiting for {}{}", ranks(.missing), cause_suffix(.cause))]
    Timeout {
        op: Box<OpDesc>,
        timeout: Duration,
        /// Group ranks whose transfers were still incomplete.
        missing: Vec<usize>,
        /// Root cause published by another rank, if any.
        cause: Option<String>,
    },
    /// A peer closed its connection or died during an op.
    #[error("peer rank {peer} lost during {op}: {detail}{}", cause_suffix(.cause))]
    PeerLost {
        op: Box<OpDesc>,
        peer: usize,
        detail: String,
        cause: Option<String>,
    },
    /// Two ranks called different collectives (or sizes, dtypes) at the same sequence number.
    #[error("mismatched collective at {op}: rank {peer} {theirs}, this rank {ours}")]
    Mismatch {
        op: Box<OpDesc>,
        peer: usize,
        ours: String,
        theirs: String,
    },
    /// The group was aborted earlier; no further op can run on it.
    #[error("group '{group}' is aborted: {reason}")]
    Aborted { group: String, reason: String },

    // === Wire-level failures ===
    /// A frame was malformed, truncated, too large or from another group or generation.
    #[error("bad frame from rank {peer}: {reason}")]
    BadFrame { peer: usize, reason: String },
    /// A message stamped with an older generation (fencing).
    #[error("stale generation: message from generation {got}, current generation is {current}")]
    StaleGeneration { got: u64, current: u64 },

    // === Rendezvous and auth ===
    /// The rendezvous store refused or failed a request.
    #[error("store: {0}")]
    Store(String),
    /// Authentication (HMAC challenge-response) failed.
    #[error("authentication failed: {0}")]
    Auth(String),

    /// A collective's result failed its closed-form check (`bench comm --check`).
    #[error("wrong result: {0}")]
    WrongResult(String),

    // === Caller errors ===
    /// Invalid arguments (buffer sizes, ranks, dtypes).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Invalid configuration (env var, option).
    #[error("invalid configuration: {0}")]
    Config(String),

    // === System ===
    /// I/O error with context.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn ranks(r: &[usize]) -> String {
    match r {
        [] => "earlier ops on this rank".to_string(),
        [one] => format!("rank {one}"),
        many => format!(
            "ranks {}",
            many.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn cause_suffix(cause: &Option<String>) -> String {
    match cause {
        Some(c) => format!(" (root cause: {c})"),
        None => String::new(),
    }
}

impl CommError {
    /// Wraps an I/O error with a description of what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        CommError::Io {
            context: context.into(),
            source,
        }
    }

    /// Ranks this error blames (missing or lost peers), if any.
    pub fn culprits(&self) -> Vec<usize> {
        match self {
            CommError::Timeout { missing, .. } => missing.clone(),
            CommError::PeerLost { peer, .. } | CommError::Mismatch { peer, .. } => vec![*peer],
            CommError::BadFrame { peer, .. } => vec![*peer],
            _ => Vec::new(),
        }
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, CommError>;
