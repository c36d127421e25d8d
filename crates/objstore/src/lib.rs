//! Object storage for checkpoints and datasets (the seeds' storage tiers, 000 storage chapter
//! and 004 28.4: the object store behind a local cache).
//!
//! [`RemoteStore`] opens `s3://bucket/prefix` (any S3-compatible server) or `file:///dir`
//! through the `object_store` crate and is used synchronously: each store owns one
//! current-thread tokio runtime and blocks on it. Keys are relative to the store's prefix.
//! [`RangedRead`] downloads one object into a local file as several ranged GETs in flight at
//! once, each hedged (a second identical request once the first is slower than the recent
//! latencies' upper quantile; the first answer wins), so one slow request does not set the
//! pace of the whole download (Dean and Barroso's "tail at scale").
//!
//! Both the checkpoint crate (staged uploads, fetches) and the data crate (shards streamed
//! into a bounded cache) read and write through this one facade.

mod ranged;
mod store;
#[cfg(feature = "test-server")]
pub mod test_server;

pub use ranged::{Hedge, LatencyWindow, RangedRead, ReadStats, quantile};
pub use store::{RemoteOptions, RemoteStore};

use std::path::PathBuf;

/// Result alias of the crate.
pub type Result<T> = std::result::Result<T, StoreError>;

/// Errors of the object stores.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The remote URL or options are unusable.
    #[error("remote config: {0}")]
    Config(String),
    /// The async runtime behind the synchronous facade could not be started.
    #[error("starting the I/O runtime: {0}")]
    Runtime(std::io::Error),
    /// An object store request failed.
    #[error("remote {op} {key:?}: {source}")]
    Store {
        /// What was being done (`put`, `get`, `head`, `list`, ...).
        op: &'static str,
        /// The object key, relative to the store's prefix.
        key: String,
        /// The underlying error.
        source: Box<object_store::Error>,
    },
    /// A key is not a valid object path (empty segment, forbidden characters, ...).
    #[error("invalid remote object key {key:?}: {reason}")]
    BadKey {
        /// The key, relative to the store's prefix.
        key: String,
        /// Why it is invalid.
        reason: String,
    },
    /// A remote object that must exist does not.
    #[error("remote object {key:?} is missing")]
    Missing {
        /// The object key, relative to the store's prefix.
        key: String,
    },
    /// A remote object is larger or smaller than expected (checked before any byte of it is
    /// downloaded, and again on every ranged read).
    #[error("remote object {key:?} has {size} bytes, expected {expected}")]
    ObjectSize {
        /// The object key, relative to the store's prefix.
        key: String,
        /// Its size according to the store (or the bytes a read returned).
        size: u64,
        /// What was allowed.
        expected: String,
    },
    /// A local file could not be read or written.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// Maps an I/O error on `path` during `op` to [`StoreError::Io`].
pub(crate) fn io_err(
    op: &'static str,
    path: &std::path::Path,
) -> impl FnOnce(std::io::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Io { op, path, source }
}
