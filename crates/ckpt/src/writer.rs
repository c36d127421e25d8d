//! Saving a step: each rank writes its pieces with a [`RankWriter`](crate::RankWriter), then one coordinator calls
//! [`commit`] with every rank's piece list.
//!
//! Commit protocol (each arrow is durable before the next begins):
//!
//! 1. every rank writes `step-<N>.tmp/rank-<r>.safetensors` with a [`RankWriter`](crate::RankWriter) (hashing
//!    each chunk of its buffers as it writes them), then fsyncs it and the directory;
//! 2. the coordinator validates the assembled manifest, checks that every piece file is a
//!    regular file long enough for its pieces whose safetensors header describes exactly them,
//!    and records each header's length and xxh3-128 in the manifest (see [`crate::header`]);
//! 3. it writes `step-<N>.tmp/manifest.json` (tmp file, fsync, rename, dir fsync);
//! 4. it renames `step-<N>.tmp` to `step-<N>` and fsyncs the root;
//! 5. it writes `step-<N>/COMMIT` last (tmp file, fsync, rename, dir fsync). The marker records
//!    the manifest's length and xxh3-128, so the step is exactly that manifest or nothing.
//!
//! A crash anywhere before the rename in step 5 leaves no `COMMIT`, so readers never see the
//! step. [`FailPoint`] stops the writer at each of these points for tests.

use std::path::{Path, PathBuf};

use crate::error::{CkptError, Result, io_err};
use crate::fsio::{checksum_hex, file_len, fsync_dir, open_read, write_atomic};
use crate::header::sum_headers;
use crate::layout::TensorMeta;
use crate::manifest::{
    COMMIT_FILE, CommitMarker, DEFAULT_CHUNK_BYTES, FORMAT, MANIFEST_FILE, Manifest, Piece, VERSION,
};
use crate::rank_file::ensure_not_committed;
use crate::reader::step_dir_name;

pub use crate::names::tmp_dir_name;

/// Where a writer stops abruptly in fault-injection tests, leaving files as a crash would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailPoint {
    /// [`RankWriter::write_piece`](crate::RankWriter::write_piece) writes half of the piece, then stops.
    MidPiece,
    /// [`commit`] verifies all pieces, then stops before writing the manifest.
    AfterPiecesBeforeManifest,
    /// [`commit`] writes half of the manifest's tmp file, then stops.
    MidManifest,
    /// [`commit`] writes the manifest, then stops before publishing the directory.
    AfterManifestBeforeRename,
    /// [`commit`] renames the directory, then stops before writing the commit marker.
    AfterRenameBeforeMarker,
    /// [`commit`] writes half of the marker's tmp file, then stops.
    MidMarker,
}

impl FailPoint {
    /// Every fail point, in protocol order.
    pub const ALL: [FailPoint; 6] = [
        FailPoint::MidPiece,
        FailPoint::AfterPiecesBeforeManifest,
        FailPoint::MidManifest,
        FailPoint::AfterManifestBeforeRename,
        FailPoint::AfterRenameBeforeMarker,
        FailPoint::MidMarker,
    ];
}

/// Everything but the pieces that a committed manifest records.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointMeta {
    /// Identifier of the training run.
    pub run_id: String,
    /// Number of ranks that saved the step.
    pub world_size: u32,
    /// Free-form description of the saving layout.
    pub layout: serde_json::Value,
    /// Hash of the training configuration.
    pub config_hash: String,
    /// Every logical tensor.
    pub tensors: Vec<TensorMeta>,
    /// Non-tensor state (optimizer step, scheduler, RNG, data loader, user metadata).
    pub state: serde_json::Value,
}

/// Verifies every piece of `step` written by all ranks, writes the manifest and atomically
/// publishes the step (see the module doc for the protocol). Returns the committed manifest.
pub fn commit(
    root: &Path,
    step: u64,
    pieces: Vec<Piece>,
    meta: CheckpointMeta,
) -> Result<Manifest> {
    commit_inner(root, step, pieces, meta, None)
}

/// [`commit`] that stops abruptly at `point`, for crash tests.
pub fn commit_with_fail_point(
    root: &Path,
    step: u64,
    pieces: Vec<Piece>,
    meta: CheckpointMeta,
    point: FailPoint,
) -> Result<Manifest> {
    commit_inner(root, step, pieces, meta, Some(point))
}

/// Every piece's file is a regular file in `dir` at least as long as the piece's byte range.
fn check_piece_files(dir: &Path, step: u64, pieces: &[Piece]) -> Result<()> {
    let mut needed: std::collections::BTreeMap<&str, (u64, &Piece)> = Default::default();
    for p in pieces {
        let end = p.offset.saturating_add(p.bytes);
        let entry = needed.entry(p.file.as_str()).or_insert((end, p));
        if end > entry.0 {
            *entry = (end, p);
        }
    }
    for (file, (end, piece)) in needed {
        let path = dir.join(file);
        let actual = file_len(&open_read(&path)?, &path)?;
        if actual < end {
            return Err(CkptError::FileTooShort {
                step,
                tensor: piece.tensor.clone(),
                file: file.to_string(),
                needed: end,
                actual,
            });
        }
    }
    Ok(())
}

fn commit_inner(
    root: &Path,
    step: u64,
    pieces: Vec<Piece>,
    meta: CheckpointMeta,
    fail: Option<FailPoint>,
) -> Result<Manifest> {
    let stop = |point: FailPoint| -> Result<()> {
        if fail == Some(point) {
            Err(CkptError::InjectedFailure { point, step })
        } else {
            Ok(())
        }
    };
    ensure_not_committed(root, step)?;
    let tmp = root.join(tmp_dir_name(step));
    let mut manifest = Manifest {
        format: FORMAT.to_string(),
        version: VERSION,
        run_id: meta.run_id,
        step,
        world_size: meta.world_size,
        layout: meta.layout,
        config_hash: meta.config_hash,
        chunk_bytes: DEFAULT_CHUNK_BYTES,
        tensors: meta.tensors,
        pieces,
        headers: Default::default(),
        state: meta.state,
    };
    let manifest_path = tmp.join(MANIFEST_FILE);
    manifest.validate(&manifest_path)?;
    // The ranks checksummed their pieces while writing and fsynced them (`RankWriter::finish`);
    // here every file must exist as a regular file long enough for every piece recorded in it,
    // with a header that describes exactly those pieces, whose hash the manifest then records.
    check_piece_files(&tmp, step, &manifest.pieces)?;
    manifest.headers = sum_headers(&tmp, step, &manifest.pieces, &manifest.tensors)?;
    stop(FailPoint::AfterPiecesBeforeManifest)?;

    let bytes = serde_json::to_vec_pretty(&manifest).map_err(|source| CkptError::Serialize {
        what: "manifest",
        source,
    })?;
    if !write_atomic(&manifest_path, &bytes, fail == Some(FailPoint::MidManifest))? {
        stop(FailPoint::MidManifest)?;
    }
    stop(FailPoint::AfterManifestBeforeRename)?;

    let published = publish_dir(root, step, &tmp)?;
    stop(FailPoint::AfterRenameBeforeMarker)?;

    let marker = CommitMarker {
        format: FORMAT.to_string(),
        step,
        manifest_bytes: bytes.len() as u64,
        manifest_xxh3_128: checksum_hex(&bytes),
    };
    let marker_bytes = serde_json::to_vec(&marker).map_err(|source| CkptError::Serialize {
        what: "commit marker",
        source,
    })?;
    let marker_path = published.join(COMMIT_FILE);
    if !write_atomic(
        &marker_path,
        &marker_bytes,
        fail == Some(FailPoint::MidMarker),
    )? {
        stop(FailPoint::MidMarker)?;
    }
    Ok(manifest)
}

/// Renames the staging directory to `step-<N>`, first removing an uncommitted leftover of an
/// earlier crashed attempt, and fsyncs the root.
fn publish_dir(root: &Path, step: u64, tmp: &Path) -> Result<PathBuf> {
    let published = root.join(step_dir_name(step));
    if std::fs::symlink_metadata(&published).is_ok() {
        // No COMMIT inside (checked by the caller), so this step never existed for a reader.
        std::fs::remove_dir_all(&published).map_err(io_err("remove stale", &published))?;
    }
    std::fs::rename(tmp, &published).map_err(io_err("rename", tmp))?;
    fsync_dir(root)?;
    Ok(published)
}
