//! Saving a step: each rank writes its pieces with a [`RankWriter`], then one coordinator calls
//! [`commit`] with every rank's piece list.
//!
//! Commit protocol (each arrow is durable before the next begins):
//!
//! 1. every rank writes `step-<N>.tmp/rank-<r>.bin`, fsyncs it and the directory, and reads
//!    its pieces back, checking each against the xxh3-128 taken from its buffer (ranks verify
//!    in parallel, each on its own disk);
//! 2. the coordinator validates the assembled manifest and checks that every piece file is a
//!    regular file long enough for its pieces;
//! 3. it writes `step-<N>.tmp/manifest.json` (tmp file, fsync, rename, dir fsync);
//! 4. it renames `step-<N>.tmp` to `step-<N>` and fsyncs the root;
//! 5. it writes `step-<N>/COMMIT` last (tmp file, fsync, rename, dir fsync). The marker records
//!    the manifest's length and xxh3-128, so the step is exactly that manifest or nothing.
//!
//! A crash anywhere before the rename in step 5 leaves no `COMMIT`, so readers never see the
//! step. [`FailPoint`] stops the writer at each of these points for tests.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{CkptError, Result, io_err};
use crate::fsio::{checksum_hex, file_len, fsync_dir, open_read, write_atomic};
use crate::layout::{Slice, TensorMeta};
use crate::manifest::{COMMIT_FILE, CommitMarker, FORMAT, MANIFEST_FILE, Manifest, Piece, VERSION};
use crate::reader::{read_verified_piece, step_dir_name};

/// Name of the staging directory of a step: `step-<N>.tmp`.
pub fn tmp_dir_name(step: u64) -> String {
    format!("step-{step}.tmp")
}

/// Where a writer stops abruptly in fault-injection tests, leaving files as a crash would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailPoint {
    /// [`RankWriter::write_piece`] writes half of the piece, then stops.
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

/// Refuses to write a step whose commit marker already exists.
fn ensure_not_committed(root: &Path, step: u64) -> Result<()> {
    let marker = root.join(step_dir_name(step)).join(COMMIT_FILE);
    if std::fs::symlink_metadata(marker).is_ok() {
        return Err(CkptError::AlreadyCommitted {
            step,
            dir: root.to_path_buf(),
        });
    }
    Ok(())
}

/// Writes one rank's pieces of one step into its own file, `step-<N>.tmp/rank-<r>.bin`.
#[derive(Debug)]
pub struct RankWriter {
    step: u64,
    rank: u32,
    dir: PathBuf,
    file_name: String,
    file: File,
    offset: u64,
    pieces: Vec<Piece>,
    fail: Option<FailPoint>,
    poisoned: bool,
}

impl RankWriter {
    /// Creates (truncating) this rank's data file in the step's staging directory.
    pub fn create(root: &Path, step: u64, rank: u32) -> Result<Self> {
        ensure_not_committed(root, step)?;
        let dir = root.join(tmp_dir_name(step));
        std::fs::create_dir_all(&dir).map_err(io_err("create dir", &dir))?;
        let file_name = format!("rank-{rank:05}.bin");
        let path = dir.join(&file_name);
        let file = File::create(&path).map_err(io_err("create", &path))?;
        Ok(RankWriter {
            step,
            rank,
            dir,
            file_name,
            file,
            offset: 0,
            pieces: Vec::new(),
            fail: None,
            poisoned: false,
        })
    }

    /// Arms a fail point (only [`FailPoint::MidPiece`] concerns a rank writer).
    pub fn with_fail_point(mut self, point: FailPoint) -> Self {
        self.fail = Some(point);
        self
    }

    /// Appends one piece: `data` holds the elements of `slice` of `tensor`, row-major.
    pub fn write_piece(&mut self, tensor: &TensorMeta, slice: &Slice, data: &[u8]) -> Result<()> {
        if self.poisoned {
            return Err(CkptError::WriterPoisoned {
                rank: self.rank,
                step: self.step,
            });
        }
        slice.check_fits(&tensor.name, &tensor.shape)?;
        let bytes = slice.byte_size(tensor.dtype, &tensor.name)?;
        if bytes == 0 {
            return Err(CkptError::Piece {
                step: self.step,
                tensor: tensor.name.clone(),
                file: self.file_name.clone(),
                reason: format!("empty slice {slice}: tensors without elements need no pieces"),
            });
        }
        if bytes != data.len() as u64 {
            return Err(CkptError::BufferSize {
                what: "piece data",
                expected: bytes,
                actual: data.len() as u64,
            });
        }
        let path = self.dir.join(&self.file_name);
        if self.fail == Some(FailPoint::MidPiece) {
            self.poisoned = true;
            self.file
                .write_all(&data[..data.len() / 2])
                .map_err(io_err("write", &path))?;
            return Err(CkptError::InjectedFailure {
                point: FailPoint::MidPiece,
                step: self.step,
            });
        }
        if let Err(e) = self.file.write_all(data) {
            self.poisoned = true;
            return Err(io_err("write", &path)(e));
        }
        self.pieces.push(Piece {
            tensor: tensor.name.clone(),
            file: self.file_name.clone(),
            offset: self.offset,
            bytes,
            slice: slice.clone(),
            xxh3_128: checksum_hex(data),
        });
        self.offset += bytes;
        Ok(())
    }

    /// Makes the file durable and returns this rank's piece list for [`commit`].
    pub fn finish(self) -> Result<Vec<Piece>> {
        if self.poisoned {
            return Err(CkptError::WriterPoisoned {
                rank: self.rank,
                step: self.step,
            });
        }
        let path = self.dir.join(&self.file_name);
        self.file.sync_all().map_err(io_err("fsync", &path))?;
        fsync_dir(&self.dir)?;
        // Read back what is now durable and check every piece against the checksum taken from
        // the caller's buffer: each rank verifies its own file, in parallel with the others
        // (and where only it can: on a node-local disk), before the coordinator may commit.
        for piece in &self.pieces {
            read_verified_piece(&self.dir, self.step, piece)?;
        }
        Ok(self.pieces)
    }
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
    let manifest = Manifest {
        format: FORMAT.to_string(),
        version: VERSION,
        run_id: meta.run_id,
        step,
        world_size: meta.world_size,
        layout: meta.layout,
        config_hash: meta.config_hash,
        tensors: meta.tensors,
        pieces,
        state: meta.state,
    };
    let manifest_path = tmp.join(MANIFEST_FILE);
    manifest.validate(&manifest_path)?;
    // The ranks verified their pieces' bytes after fsync (`RankWriter::finish`); here every
    // file must exist as a regular file long enough for every piece recorded in it.
    check_piece_files(&tmp, step, &manifest.pieces)?;
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
