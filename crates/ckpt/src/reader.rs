//! Finding committed steps, opening one with full verification, falling back past bad ones, and
//! assembling any slice of any tensor from the pieces that overlap it.
//!
//! A step exists for a reader only if `step-<N>/COMMIT` is a regular file. Opening a step reads
//! the marker, checks the manifest's length and xxh3-128 against it, parses and validates the
//! manifest, and (with [`Verify::AllPieces`]) reads and checks every piece. Piece bytes are
//! checked every time they are read, not only the first time: a piece is read whole into memory,
//! hashed, and only then copied from, so no byte that failed (or skipped) verification is ever
//! used, even if the file changed after an earlier check.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{CkptError, Result, io_err};
use crate::fsio::{checksum_hex, file_len, is_real_dir, open_read, read_capped, read_range};
use crate::layout::{Slice, copy_overlap};
use crate::manifest::{
    COMMIT_FILE, CommitMarker, FORMAT, MANIFEST_FILE, MAX_MANIFEST_BYTES, MAX_MARKER_BYTES,
    Manifest, Piece,
};

/// Name of the directory of a step: `step-<N>`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step}")
}

/// Parses a canonical `step-<N>` directory name (decimal, no sign, no leading zeros).
fn parse_step_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    let canonical = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    if canonical { digits.parse().ok() } else { None }
}

/// How much of a step [`Checkpoint::open`] checks up front.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// Marker and manifest only; each piece is still verified when read.
    ManifestOnly,
    /// Also read and verify every piece, so a corrupt piece rejects the step at open time (and
    /// [`open_latest`] falls back past it).
    AllPieces,
}

/// A step that was committed but could not be loaded.
#[derive(Debug)]
pub struct Rejected {
    /// The step.
    pub step: u64,
    /// Why it was rejected (names file, tensor and what disagreed).
    pub error: CkptError,
}

/// The result of [`open_latest`]: the checkpoint loaded plus every newer committed step that was
/// rejected, newest first (exactly what was lost).
#[derive(Debug)]
pub struct Opened {
    /// The newest loadable step.
    pub checkpoint: Checkpoint,
    /// Newer committed steps that failed verification, newest first.
    pub rejected: Vec<Rejected>,
}

/// Every step directory under `root` that has a commit marker, with the parsed marker or the
/// reason it is unusable, ascending by step.
fn scan(root: &Path) -> Result<Vec<(u64, Result<CommitMarker>)>> {
    let entries = std::fs::read_dir(root).map_err(io_err("read dir", root))?;
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err("read dir", root))?;
        let Some(step) = entry.file_name().to_str().and_then(parse_step_name) else {
            continue;
        };
        let dir = entry.path();
        let marker = dir.join(COMMIT_FILE);
        if is_real_dir(&dir) && std::fs::symlink_metadata(&marker).is_ok() {
            found.push((step, read_marker(&marker, step)));
        }
    }
    found.sort_by_key(|(step, _)| *step);
    Ok(found)
}

fn read_marker(path: &Path, step: u64) -> Result<CommitMarker> {
    let bad = |reason: String| CkptError::Marker {
        step,
        path: path.to_path_buf(),
        reason,
    };
    let bytes = read_capped(path, MAX_MARKER_BYTES)?;
    let marker: CommitMarker =
        serde_json::from_slice(&bytes).map_err(|e| bad(format!("unparsable: {e}")))?;
    if marker.format != FORMAT {
        return Err(bad(format!(
            "format {:?}, expected {FORMAT:?}",
            marker.format
        )));
    }
    if marker.step != step {
        return Err(bad(format!("records step {}", marker.step)));
    }
    if marker.manifest_bytes > MAX_MANIFEST_BYTES {
        return Err(bad(format!(
            "manifest size {} over the cap",
            marker.manifest_bytes
        )));
    }
    Ok(marker)
}

/// Steps under `root` whose commit marker is present and well-formed, ascending.
pub fn list_committed(root: &Path) -> Result<Vec<u64>> {
    Ok(scan(root)?
        .into_iter()
        .filter_map(|(step, marker)| marker.ok().map(|_| step))
        .collect())
}

/// Opens the newest committed step that passes verification, falling back step by step and
/// reporting each newer step it had to reject.
pub fn open_latest(root: &Path, verify: Verify) -> Result<Opened> {
    let mut rejected = Vec::new();
    for (step, marker) in scan(root)?.into_iter().rev() {
        match marker.and_then(|m| Checkpoint::open_with_marker(root, step, &m, verify)) {
            Ok(checkpoint) => {
                return Ok(Opened {
                    checkpoint,
                    rejected,
                });
            }
            Err(error) => rejected.push(Rejected { step, error }),
        }
    }
    Err(CkptError::NoCommittedStep {
        dir: root.to_path_buf(),
        rejected: rejected
            .into_iter()
            .map(|r| (r.step, r.error.to_string()))
            .collect(),
    })
}

/// Reads one piece whole from `step_dir` and checks its length and checksum before returning it.
pub(crate) fn read_verified_piece(step_dir: &Path, step: u64, piece: &Piece) -> Result<Vec<u8>> {
    let path = step_dir.join(&piece.file);
    let mut file = open_read(&path)?;
    let actual = file_len(&file, &path)?;
    let needed = piece.offset.saturating_add(piece.bytes);
    if actual < needed {
        return Err(CkptError::FileTooShort {
            step,
            tensor: piece.tensor.clone(),
            file: piece.file.clone(),
            needed,
            actual,
        });
    }
    let bytes = read_range(&mut file, &path, piece.offset, piece.bytes)?;
    let sum = checksum_hex(&bytes);
    if sum != piece.xxh3_128 {
        return Err(CkptError::PieceChecksum {
            step,
            tensor: piece.tensor.clone(),
            file: piece.file.clone(),
            offset: piece.offset,
            bytes: piece.bytes,
            expected: piece.xxh3_128.clone(),
            actual: sum,
        });
    }
    Ok(bytes)
}

/// One opened, verified step.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
    /// Indices into `manifest.pieces`, per tensor name.
    by_tensor: HashMap<String, Vec<usize>>,
}

impl Checkpoint {
    /// Opens committed step `step` under `root`, verifying marker and manifest (and pieces, per
    /// `verify`).
    pub fn open(root: &Path, step: u64, verify: Verify) -> Result<Self> {
        let dir = root.join(step_dir_name(step));
        let marker_path = dir.join(COMMIT_FILE);
        if !is_real_dir(&dir) || std::fs::symlink_metadata(&marker_path).is_err() {
            return Err(CkptError::Marker {
                step,
                path: marker_path,
                reason: "missing: step is not committed".into(),
            });
        }
        let marker = read_marker(&marker_path, step)?;
        Self::open_with_marker(root, step, &marker, verify)
    }

    fn open_with_marker(
        root: &Path,
        step: u64,
        marker: &CommitMarker,
        verify: Verify,
    ) -> Result<Self> {
        let dir = root.join(step_dir_name(step));
        let path = dir.join(MANIFEST_FILE);
        let bytes = read_capped(&path, MAX_MANIFEST_BYTES)?;
        let actual = checksum_hex(&bytes);
        if bytes.len() as u64 != marker.manifest_bytes || actual != marker.manifest_xxh3_128 {
            return Err(CkptError::ManifestChecksum {
                step,
                path,
                expected: format!(
                    "{} ({} bytes)",
                    marker.manifest_xxh3_128, marker.manifest_bytes
                ),
                actual: format!("{actual} ({} bytes)", bytes.len()),
            });
        }
        let manifest: Manifest =
            serde_json::from_slice(&bytes).map_err(|e| CkptError::Manifest {
                step,
                path: path.clone(),
                reason: format!("unparsable: {e}"),
            })?;
        if manifest.step != step {
            let reason = format!("records step {}", manifest.step);
            return Err(CkptError::Manifest { step, path, reason });
        }
        manifest.validate(&path)?;
        let mut by_tensor: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, p) in manifest.pieces.iter().enumerate() {
            by_tensor.entry(p.tensor.clone()).or_default().push(i);
        }
        let ckpt = Checkpoint {
            dir,
            manifest,
            by_tensor,
        };
        if verify == Verify::AllPieces {
            ckpt.verify_all_pieces()?;
        }
        Ok(ckpt)
    }

    /// Reads and checks every piece of the step.
    pub fn verify_all_pieces(&self) -> Result<()> {
        for piece in &self.manifest.pieces {
            read_verified_piece(&self.dir, self.step(), piece)?;
        }
        Ok(())
    }

    /// The step.
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    /// The step directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The verified manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The non-tensor state recorded with the step.
    pub fn state(&self) -> &serde_json::Value {
        &self.manifest.state
    }

    /// Assembles the global slice `wanted` of `tensor`, row-major in the slice's own shape, from
    /// every piece that overlaps it; each piece is read whole and verified before use.
    pub fn read_slice(&self, tensor: &str, wanted: &Slice) -> Result<Vec<u8>> {
        let step = self.step();
        let meta = self
            .manifest
            .tensor(tensor)
            .ok_or_else(|| CkptError::UnknownTensor {
                step,
                tensor: tensor.to_string(),
            })?;
        wanted.check_fits(tensor, &meta.shape)?;
        let bytes = wanted.byte_size(meta.dtype, tensor)?;
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let indices = self
            .by_tensor
            .get(tensor)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let pieces = || indices.iter().map(|&i| &self.manifest.pieces[i]);
        // Fast path: a load in the saving layout asks for exactly one stored piece, whose
        // verified bytes are the answer as they are (no second buffer, no copy).
        if let Some(piece) = pieces().find(|p| p.slice == *wanted) {
            return read_verified_piece(&self.dir, step, piece);
        }
        let mut out = vec![0u8; bytes as usize];
        for piece in pieces() {
            if piece.slice.overlap(wanted).is_none() {
                continue;
            }
            let data = read_verified_piece(&self.dir, step, piece)?;
            copy_overlap(&data, &piece.slice, &mut out, wanted, meta.dtype.size())?;
        }
        Ok(out)
    }

    /// Reads a whole tensor (the slice covering its full shape).
    pub fn read_tensor(&self, tensor: &str) -> Result<Vec<u8>> {
        let meta = self
            .manifest
            .tensor(tensor)
            .ok_or_else(|| CkptError::UnknownTensor {
                step: self.step(),
                tensor: tensor.to_string(),
            })?;
        self.read_slice(tensor, &Slice::full(&meta.shape))
    }
}

#[cfg(test)]
mod tests {
    use super::parse_step_name;

    #[test]
    fn step_names_are_canonical() {
        assert_eq!(parse_step_name("step-0"), Some(0));
        assert_eq!(parse_step_name("step-120"), Some(120));
        for bad in [
            "step-",
            "step-007",
            "step-1.tmp",
            "step--1",
            "step-+1",
            "stepx-1",
        ] {
            assert_eq!(parse_step_name(bad), None, "{bad}");
        }
    }
}
