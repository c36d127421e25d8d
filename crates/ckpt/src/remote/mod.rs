//! Remote storage and staged mode (feature `s3`).
//!
//! A remote store mirrors the local layout under a prefix:
//!
//! ```text
//! <prefix>/step-100/<piece files>   every file the manifest names
//! <prefix>/step-100/manifest.json
//! <prefix>/step-100/COMMIT          put last, byte-identical to the local marker
//! ```
//!
//! A remote step exists for a reader only if its `COMMIT` object parses and records its own step.
//! The stores are S3-compatible object stores (`s3://bucket/prefix`) or another directory
//! (`file:///path`), both through the `object_store` crate behind the small synchronous
//! [`RemoteStore`] facade.
//!
//! * [`upload_step`] copies one locally committed step: it verifies every piece with the local
//!   reader first, puts every piece file (multipart above a threshold) and the manifest, then
//!   the `COMMIT` object last, as a single-key put. A crash anywhere before that last put
//!   leaves no remote `COMMIT`, so remote readers never see the step.
//! * [`fetch_step`] / [`fetch_latest`] download a remote step into a local cache directory
//!   through `step-<N>.tmp`, verify every checksum with the ordinary local reader, and publish
//!   it as `step-<N>` with `COMMIT` written last; [`fetch_latest`] falls back past steps that
//!   fail and reports each one it rejected.
//! * [`Stager`] runs uploads on a background thread ("staged mode"): the training loop commits
//!   to a fast local directory, hands the step to the stager and goes on. Each step's status
//!   records *locally committed* and *durably committed* separately, in memory and, once the
//!   remote `COMMIT` put has succeeded, in `<local root>/step-<N>/REMOTE` ([`read_record`]).

mod fetch;
mod stager;
mod upload;

pub use fetch::{
    Fetched, RemoteRejected, fetch_latest, fetch_step, list_remote_committed, list_remote_markers,
};
pub use objstore::{RemoteOptions, RemoteStore, StoreError};
pub use stager::{
    REMOTE_RECORD_FILE, RemoteRecord, StageState, StageStatus, Stager, StagerConfig, read_record,
};
pub use upload::{UploadFailPoint, UploadReport, upload_step, upload_step_with_fail_point};

use crate::error::CkptError;

/// Result alias of the remote module.
pub type Result<T> = std::result::Result<T, RemoteError>;

/// Errors of remote storage, fetching and staging.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// A local checkpoint operation (reading, verifying, writing the cache) failed.
    #[error(transparent)]
    Ckpt(#[from] CkptError),
    /// The stager's settings are unusable.
    #[error("remote config: {0}")]
    Config(String),
    /// The stager's thread could not be started.
    #[error("starting the stager thread: {0}")]
    Runtime(std::io::Error),
    /// The object store failed: a request, a key, an object's size, a local file
    /// (`flotilla-objstore`).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A remote object's content does not match what the step's marker or manifest records.
    #[error("step {step}: remote object {key:?}: {reason}")]
    Corrupt {
        /// The step.
        step: u64,
        /// The object key, relative to the store's prefix.
        key: String,
        /// What disagreed.
        reason: String,
    },
    /// The remote already holds a different committed version of this step.
    #[error("step {step}: the remote already holds a different committed version")]
    RemoteConflict {
        /// The step.
        step: u64,
    },
    /// No remote committed step could be fetched; each rejected step is listed with its reason.
    #[error("no fetchable committed step in {url}{}", rejected_suffix(.rejected))]
    NoRemoteCommittedStep {
        /// The remote.
        url: String,
        /// Steps rejected, newest first, with the reason.
        rejected: Vec<(u64, String)>,
    },
    /// A fault-injection point fired (tests only; the remote is left as a crash would leave it).
    #[error("injected upload failure {point:?} (step {step})")]
    InjectedFailure {
        /// The point that fired.
        point: UploadFailPoint,
        /// The step being uploaded.
        step: u64,
    },
    /// The stager's queue stayed full for the whole enqueue timeout.
    #[error("staging step {step}: queue full ({capacity} steps) for {waited_ms} ms")]
    QueueFull {
        /// The step that was refused.
        step: u64,
        /// The queue's capacity.
        capacity: usize,
        /// How long the request waited.
        waited_ms: u128,
    },
    /// A wait ran out of time.
    #[error("step {step}: not durably committed after {waited_ms} ms")]
    Timeout {
        /// The step.
        step: u64,
        /// How long the call waited.
        waited_ms: u128,
    },
    /// The stager knows nothing about this step.
    #[error("step {step} was never staged")]
    UnknownStep {
        /// The step.
        step: u64,
    },
    /// The upload of a staged step failed; the step is still committed locally.
    #[error("staging step {step} failed: {reason}")]
    UploadFailed {
        /// The step.
        step: u64,
        /// The error, formatted.
        reason: String,
    },
    /// The stager is shutting down or its thread is gone.
    #[error("the stager is stopped")]
    Stopped,
}

fn rejected_suffix(rejected: &[(u64, String)]) -> String {
    rejected
        .iter()
        .map(|(step, why)| format!("; step {step} rejected: {why}"))
        .collect()
}

pub(crate) use crate::names::parse_step_name;

/// Key of `file` of `step`, relative to the store's prefix: `step-<N>/<file>`.
pub(crate) fn object_key(step: u64, file: &str) -> String {
    format!("{}/{file}", crate::reader::step_dir_name(step))
}
