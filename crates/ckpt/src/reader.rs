//! Finding committed steps, opening one with full verification, falling back past bad ones, and
//! assembling any slice of any tensor from the pieces that overlap it.
//!
//! A step exists for a reader only if `step-<N>/COMMIT` is a regular file. Opening a step reads
//! the marker, checks the manifest's length and xxh3-128 against it, parses and validates the
//! manifest, hashes every rank file's safetensors header against the manifest's record (either
//! mode; see [`crate::header`]) and (with [`Verify::AllPieces`]) reads and checks every piece.
//! Piece bytes are checked every time they are read, not only the first time: the checksum
//! chunks covering the bytes wanted are read into memory, hashed, and only then copied from, so
//! no byte that failed (or skipped) verification is ever used, even if the file changed after
//! an earlier check. A resharding load reads only the rows of each piece it needs, rounded out
//! to whole chunks.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{CkptError, Result, io_err};
use crate::fsio::{checksum_hex, file_len, is_real_dir, open_read, read_capped};
use crate::header::verify_headers;
use crate::layout::{Extent, Slice, copy_overlap};
use crate::manifest::{
    COMMIT_FILE, CommitMarker, MANIFEST_FILE, MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, Manifest, Piece,
};
use crate::names::parse_step_name;
pub use crate::names::step_dir_name;

/// How much of a step [`Checkpoint::open`] checks up front.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// Marker, manifest and rank file headers only; each piece is still verified when read.
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

/// The outcome of [`verify_step`]: one committed step opened and every piece read and checked
/// (`flotilla ckpt verify`).
#[derive(Debug)]
pub struct StepCheck {
    /// The step.
    pub step: u64,
    /// Bytes of its pieces ([`Manifest::piece_bytes`]; 0 if the manifest did not open).
    pub bytes: u64,
    /// `Ok` if marker, manifest, headers and every piece agree; else the first disagreement.
    pub result: Result<()>,
    /// Time the check took.
    pub elapsed: Duration,
}

impl StepCheck {
    /// Checking rate in GB/s (10^9 bytes).
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e9 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// `{"step", "ok", "bytes", "seconds", "gb_per_s", "error"}` (`error` null when ok), as
    /// `flotilla ckpt verify --json` prints each step.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "step": self.step,
            "ok": self.result.is_ok(),
            "bytes": self.bytes,
            "seconds": self.elapsed.as_secs_f64(),
            "gb_per_s": self.gb_per_s(),
            "error": self.result.as_ref().err().map(|e| e.to_string()),
        })
    }
}

/// Opens committed step `step` under `root` and reads and checks every piece of it, calling
/// `progress(bytes_done, bytes_total)` after each piece. A failure is in the result, not an
/// error of this function, so a caller checking many steps goes on past a bad one.
pub fn verify_step(root: &Path, step: u64, progress: impl FnMut(u64, u64)) -> StepCheck {
    let start = Instant::now();
    let mut bytes = 0;
    let result = Checkpoint::open(root, step, Verify::ManifestOnly).and_then(|c| {
        bytes = c.manifest.piece_bytes();
        c.verify_pieces(progress)
    });
    StepCheck {
        step,
        bytes,
        result,
        elapsed: start.elapsed(),
    }
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
    CommitMarker::parse(&bytes, step).map_err(bad)
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

/// Sets committed step `step` aside after it failed to load, so that it is invisible to readers
/// but kept for inspection and a new save of the same step can commit: renames `step-<N>` to
/// `step-<N>.rejected` (or `.rejected.2`, `.3`, ... if taken) and fsyncs the root. Returns the
/// new path.
pub fn quarantine(root: &Path, step: u64) -> Result<PathBuf> {
    let dir = root.join(step_dir_name(step));
    let mut target = root.join(format!("{}.rejected", step_dir_name(step)));
    let mut n = 1;
    while std::fs::symlink_metadata(&target).is_ok() {
        n += 1;
        target = root.join(format!("{}.rejected.{n}", step_dir_name(step)));
    }
    std::fs::rename(&dir, &target).map_err(io_err("rename", &dir))?;
    crate::fsio::fsync_dir(root)?;
    Ok(target)
}

/// Reads bytes `range` of `piece` (relative to the piece's start) from `step_dir` into `dst`
/// (exactly `range` long), verifying every checksum chunk it touches against the manifest:
/// chunks wholly inside the range are read straight into `dst` and hashed there; the at most two
/// that straddle its ends are read whole into a scratch buffer, hashed, and the needed part
/// copied. On error `dst` may hold unverified bytes and must be discarded. The file's length is
/// checked first.
pub(crate) fn read_piece_into(
    step_dir: &Path,
    step: u64,
    piece: &Piece,
    chunk_bytes: u64,
    range: Range<u64>,
    dst: &mut [u8],
) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let path = step_dir.join(&piece.file);
    let file = open_read(&path)?;
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
    let verify = |index: u64, bytes: &[u8]| -> Result<()> {
        let sum = checksum_hex(bytes);
        let expected = piece
            .chunks
            .get(index as usize)
            .map(String::as_str)
            .unwrap_or("");
        if sum == expected {
            return Ok(());
        }
        Err(CkptError::PieceChecksum {
            step,
            tensor: piece.tensor.clone(),
            file: piece.file.clone(),
            offset: piece.offset + index * chunk_bytes,
            bytes: bytes.len() as u64,
            expected: expected.to_string(),
            actual: sum,
        })
    };
    let mut scratch = Vec::new();
    let mut pos = range.start;
    while pos < range.end {
        let index = pos / chunk_bytes;
        let (start, end) = (
            index * chunk_bytes,
            ((index + 1) * chunk_bytes).min(piece.bytes),
        );
        let take = end.min(range.end);
        let out = &mut dst[(pos - range.start) as usize..(take - range.start) as usize];
        if start == pos && end == take {
            file.read_exact_at(out, piece.offset + start)
                .map_err(io_err("read", &path))?;
            verify(index, out)?;
        } else {
            scratch.resize((end - start) as usize, 0);
            file.read_exact_at(&mut scratch, piece.offset + start)
                .map_err(io_err("read", &path))?;
            verify(index, &scratch)?;
            out.copy_from_slice(&scratch[(pos - start) as usize..(take - start) as usize]);
        }
        pos = take;
    }
    Ok(())
}

/// [`read_piece_into`] a new buffer.
pub(crate) fn read_piece_range(
    step_dir: &Path,
    step: u64,
    piece: &Piece,
    chunk_bytes: u64,
    range: Range<u64>,
) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; (range.end - range.start) as usize];
    read_piece_into(step_dir, step, piece, chunk_bytes, range, &mut buf)?;
    Ok(buf)
}

/// Where `rows` (a box inside `wanted`'s dimension-0 range) starts in `wanted`'s row-major
/// buffer of `wanted_bytes`, if it is one contiguous run of it: its trailing extents equal
/// `wanted`'s (so each of its rows is a whole row of `wanted`). Scalars start at 0.
fn contiguous_offset(rows: &Slice, wanted: &Slice, wanted_bytes: u64) -> Option<u64> {
    let (Some(r0), Some(w0)) = (rows.0.first(), wanted.0.first()) else {
        return Some(0);
    };
    if rows.0[1..] != wanted.0[1..] {
        return None;
    }
    Some((r0.offset - w0.offset) * (wanted_bytes / w0.len))
}

/// The part of `piece` whose rows (dimension 0) meet `wanted`: its slice and its byte range
/// within the piece. A piece stores whole rows of its own box contiguously, so the rows a
/// reader needs are one contiguous range; scalars are read whole.
fn rows_needed(piece: &Piece, wanted: &Slice) -> Option<(Slice, Range<u64>)> {
    let (Some(have), Some(want)) = (piece.slice.0.first(), wanted.0.first()) else {
        return Some((piece.slice.clone(), 0..piece.bytes));
    };
    let start = have.offset.max(want.offset);
    let end = (have.offset + have.len).min(want.offset + want.len);
    if end <= start {
        return None;
    }
    let row_bytes = piece.bytes / have.len;
    let mut sub = piece.slice.clone();
    sub.0[0] = Extent {
        offset: start,
        len: end - start,
    };
    let rel = start - have.offset;
    Some((sub, rel * row_bytes..(rel + end - start) * row_bytes))
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
        match verify {
            Verify::AllPieces => ckpt.verify_all_pieces()?,
            Verify::ManifestOnly => ckpt.verify_headers()?,
        }
        Ok(ckpt)
    }

    /// Hashes every rank file's safetensors header and compares it with the manifest's record
    /// (a manifest from before header hashes records none; see [`crate::header`]). Part of
    /// every open.
    pub fn verify_headers(&self) -> Result<()> {
        verify_headers(&self.dir, &self.manifest)
    }

    /// Checks every rank file's header ([`Checkpoint::verify_headers`]), then reads and checks
    /// every piece of the step.
    pub fn verify_all_pieces(&self) -> Result<()> {
        self.verify_all_pieces_with_progress(|_, _| {})
    }

    /// [`Checkpoint::verify_all_pieces`], calling `progress(bytes_done, bytes_total)` after
    /// each piece (the total is [`Manifest::piece_bytes`]).
    pub fn verify_all_pieces_with_progress(&self, progress: impl FnMut(u64, u64)) -> Result<()> {
        self.verify_headers()?;
        self.verify_pieces(progress)
    }

    /// Reads and checks every piece (not the headers), reporting bytes done after each.
    fn verify_pieces(&self, mut progress: impl FnMut(u64, u64)) -> Result<()> {
        let total = self.manifest.piece_bytes();
        let mut done = 0u64;
        for piece in &self.manifest.pieces {
            self.read_piece(piece, 0..piece.bytes)?;
            done = done.saturating_add(piece.bytes);
            progress(done, total);
        }
        Ok(())
    }

    fn read_piece(&self, piece: &Piece, range: Range<u64>) -> Result<Vec<u8>> {
        read_piece_range(
            &self.dir,
            self.step(),
            piece,
            self.manifest.chunk_bytes,
            range,
        )
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
    /// every piece that overlaps it. Of each piece only the rows that meet `wanted` are read
    /// (rounded out to whole checksum chunks), and every chunk read is verified before use.
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
        let mut out = vec![0u8; bytes as usize];
        for &i in indices {
            let piece = &self.manifest.pieces[i];
            if piece.slice.overlap(wanted).is_none() {
                continue;
            }
            let Some((rows, range)) = rows_needed(piece, wanted) else {
                continue;
            };
            match contiguous_offset(&rows, wanted, bytes) {
                // Fast path (a load in the saving layout, or a re-split along dimension 0):
                // the rows needed are one run of the output, read and verified in place.
                Some(at) => {
                    let dst = &mut out[at as usize..(at + range.end - range.start) as usize];
                    read_piece_into(
                        &self.dir,
                        step,
                        piece,
                        self.manifest.chunk_bytes,
                        range,
                        dst,
                    )?;
                }
                None => {
                    let data = self.read_piece(piece, range)?;
                    copy_overlap(&data, &rows, &mut out, wanted, meta.dtype.size())?;
                }
            }
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
