//! One structured error enum for the whole crate.
//!
//! Every error that concerns stored data names the step, the file and, where there is one, the
//! tensor, plus what disagreed (expected against actual), so a rejected version always says
//! exactly which byte range of which file could not be trusted.

use std::path::PathBuf;

/// Errors of the checkpoint library.
#[derive(Debug, thiserror::Error)]
pub enum CkptError {
    /// The checkpoint benchmark ([`crate::bench`]) failed: a check that disagreed, a lost
    /// thread, or an error with what it was doing.
    #[error("checkpoint bench: {0}")]
    Bench(String),
    // === Filesystem ===
    /// An I/O operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done (`open`, `read`, `fsync`, `rename`, ...).
        op: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A path inside a checkpoint is a symbolic link, which could escape the checkpoint directory.
    #[error("refusing symbolic link {}", path.display())]
    Symlink {
        /// The offending path.
        path: PathBuf,
    },
    /// Another live job holds the checkpoint directory's lock ([`crate::DirLock`]).
    #[error(
        "checkpoint directory {} is in use by another job ({holder}); two jobs sharing \
         one directory would overwrite each other's steps",
        dir.display()
    )]
    Locked {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The holder as its lock file records it (host, process id, since when).
        holder: String,
    },
    /// A path inside a checkpoint is a directory, FIFO, device or socket, not a regular file.
    #[error("refusing non-regular file {}", path.display())]
    NotAFile {
        /// The offending path.
        path: PathBuf,
    },
    /// A file name recorded in a manifest is not a plain relative file name.
    #[error("step {step}: unsafe file name {name:?}: {reason}")]
    UnsafeFileName {
        /// Step whose manifest names the file.
        step: u64,
        /// The name as recorded.
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },

    // === Manifest and commit marker ===
    /// The manifest (or a part of it not tied to one tensor) is malformed.
    #[error("step {step}: invalid manifest {}: {reason}", path.display())]
    Manifest {
        /// Step of the manifest.
        step: u64,
        /// Path of the manifest file (or the directory it would live in).
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor entry or one of its pieces is malformed.
    #[error("step {step}: tensor {tensor:?}, file {file:?}: {reason}")]
    Piece {
        /// Step of the manifest.
        step: u64,
        /// Logical tensor name.
        tensor: String,
        /// Piece file name (empty when the problem is the tensor entry itself).
        file: String,
        /// What is wrong.
        reason: String,
    },
    /// The commit marker is missing, unreadable or inconsistent.
    #[error("step {step}: commit marker {}: {reason}", path.display())]
    Marker {
        /// Step the marker belongs to.
        step: u64,
        /// Path of the marker.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The manifest bytes do not hash to the value recorded in the commit marker.
    #[error(
        "step {step}: manifest {} checksum mismatch: marker says {expected}, file hashes to {actual}",
        path.display()
    )]
    ManifestChecksum {
        /// Step of the manifest.
        step: u64,
        /// Path of the manifest.
        path: PathBuf,
        /// Hex xxh3-128 from the commit marker.
        expected: String,
        /// Hex xxh3-128 of the bytes on disk.
        actual: String,
    },

    /// A rank file's safetensors header does not hash to what the manifest records, or (at
    /// commit) does not describe the file's pieces.
    #[error("step {step}: rank file {}: safetensors header: {reason}", path.display())]
    Header {
        /// Step of the checkpoint.
        step: u64,
        /// Path of the rank file.
        path: PathBuf,
        /// What disagreed.
        reason: String,
    },

    // === Piece data ===
    /// A piece's bytes do not hash to the value recorded in the manifest.
    #[error(
        "step {step}: tensor {tensor:?}: file {file:?} bytes {offset}..+{bytes}: checksum mismatch: \
         manifest says {expected}, data hashes to {actual}"
    )]
    PieceChecksum {
        /// Step of the checkpoint.
        step: u64,
        /// Logical tensor name.
        tensor: String,
        /// Piece file name.
        file: String,
        /// Byte offset of the piece in the file.
        offset: u64,
        /// Byte length of the piece.
        bytes: u64,
        /// Hex xxh3-128 recorded in the manifest.
        expected: String,
        /// Hex xxh3-128 of the bytes read.
        actual: String,
    },
    /// A piece file is shorter than the byte range the manifest records.
    #[error(
        "step {step}: tensor {tensor:?}: file {file:?} has {actual} bytes, piece needs {needed}"
    )]
    FileTooShort {
        /// Step of the checkpoint.
        step: u64,
        /// Logical tensor name.
        tensor: String,
        /// Piece file name.
        file: String,
        /// Bytes the piece's range needs (offset + length).
        needed: u64,
        /// Bytes the file has.
        actual: u64,
    },

    // === Caller input ===
    /// A slice does not fit the tensor it addresses.
    #[error("tensor {tensor:?}: slice {slice} does not fit shape {shape:?}")]
    SliceOutOfBounds {
        /// Logical tensor name.
        tensor: String,
        /// The slice, formatted.
        slice: String,
        /// The tensor's global shape.
        shape: Vec<u64>,
    },
    /// Two slices handed to the copy routine have different numbers of dimensions.
    #[error("slices {src} and {dst} have different numbers of dimensions")]
    RankMismatch {
        /// The source slice, formatted.
        src: String,
        /// The destination slice, formatted.
        dst: String,
    },
    /// A buffer's length does not match the slice it is said to hold.
    #[error("{what}: buffer has {actual} bytes, slice needs {expected}")]
    BufferSize {
        /// Which buffer.
        what: &'static str,
        /// Bytes the slice needs.
        expected: u64,
        /// Bytes the buffer has.
        actual: u64,
    },
    /// A size exceeds one of the crate's hard caps, or overflows.
    #[error("{what}: {size} exceeds the limit of {limit}")]
    SizeLimit {
        /// What was being sized.
        what: String,
        /// The size asked for (saturated on overflow).
        size: u64,
        /// The cap.
        limit: u64,
    },
    /// The checkpoint has no tensor of that name.
    #[error("step {step}: no tensor named {tensor:?}")]
    UnknownTensor {
        /// Step of the checkpoint.
        step: u64,
        /// The name asked for.
        tensor: String,
    },

    // === Versions ===
    /// No committed step could be loaded; each rejected step is listed with its reason.
    #[error("no loadable committed step in {}{}", dir.display(), rejected_suffix(.rejected))]
    NoCommittedStep {
        /// The checkpoint root.
        dir: PathBuf,
        /// Steps that were committed but rejected, newest first, with the reason.
        rejected: Vec<(u64, String)>,
    },
    /// A step is already committed, so it cannot be written again.
    #[error("step {step} is already committed in {}", dir.display())]
    AlreadyCommitted {
        /// The step.
        step: u64,
        /// The checkpoint root.
        dir: PathBuf,
    },

    // === Writer state ===
    /// A fault-injection point fired (tests only; files are left as a crash would leave them).
    #[error("injected failure at {point:?} (step {step})")]
    InjectedFailure {
        /// The point that fired.
        point: crate::writer::FailPoint,
        /// Step being written.
        step: u64,
    },
    /// A rank writer was used after an earlier failure.
    #[error("rank {rank} writer for step {step} already failed; start a new one")]
    WriterPoisoned {
        /// The rank.
        rank: u32,
        /// Step being written.
        step: u64,
    },
    /// A tensor read from a checkpoint does not have the size its destination needs.
    #[error("tensor {tensor:?}: {actual} bytes where {expected} are needed")]
    TensorSize {
        /// The tensor.
        tensor: String,
        /// Bytes the destination holds.
        expected: u64,
        /// Bytes read.
        actual: u64,
    },
    /// An asynchronous save was started while an earlier one was still in flight or not yet
    /// collected with `AsyncSaver::wait`.
    #[error(
        "cannot start saving step {step}: the save of step {previous} is still pending; call wait() first"
    )]
    SaveInFlight {
        /// Step whose save was refused.
        step: u64,
        /// Step still pending.
        previous: u64,
    },
    /// Waiting for an asynchronous save timed out (the save stays in flight).
    #[error("the save of step {step} did not finish within {timeout:?}")]
    SaveTimeout {
        /// Step being saved.
        step: u64,
        /// How long was waited.
        timeout: std::time::Duration,
    },
    /// The background thread of an asynchronous save ended without reporting (it panicked).
    #[error("the background thread saving step {step} died without a result")]
    SaveThreadDied {
        /// Step being saved.
        step: u64,
    },
    /// A rank's piece list did not arrive at the coordinator in time.
    #[error("step {step}: rank {rank}'s piece list {} did not arrive within {timeout:?}", path.display())]
    HandoffTimeout {
        /// Step being committed.
        step: u64,
        /// The missing rank.
        rank: u32,
        /// Where its list was expected.
        path: PathBuf,
        /// How long was waited.
        timeout: std::time::Duration,
    },
    /// A retention, GC or interval setting is out of range.
    #[error("invalid checkpoint policy: {0}")]
    Policy(#[from] crate::policy::PolicyError),
    /// Serialising the manifest or marker failed.
    #[error("serialising {what}: {source}")]
    Serialize {
        /// What was being serialised.
        what: &'static str,
        /// The serde error.
        source: serde_json::Error,
    },
}

fn rejected_suffix(rejected: &[(u64, String)]) -> String {
    rejected
        .iter()
        .map(|(step, why)| format!("; step {step} rejected: {why}"))
        .collect()
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, CkptError>;

/// Builds an `Io` error closure for `map_err`.
pub(crate) fn io_err(
    op: &'static str,
    path: &std::path::Path,
) -> impl FnOnce(std::io::Error) -> CkptError {
    let path = path.to_path_buf();
    move |source| CkptError::Io { op, path, source }
}
