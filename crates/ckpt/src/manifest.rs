//! The manifest (`manifest.json`) and the commit marker (`COMMIT`), and the validation every
//! manifest passes before any piece is read.
//!
//! Validation is purely structural and happens before any piece byte is allocated or read:
//! file names are plain names inside the step directory; every piece lies inside its tensor's
//! shape and its byte length equals its element count times the element size; byte ranges stay
//! under [`MAX_FILE_BYTES`] and do not overlap within a file; the pieces of a tensor are
//! pairwise disjoint and their volumes add up to the tensor's, i.e. they cover it exactly
//! (partial coverage is refused, so every element a reader asks for exists).

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use crate::error::{CkptError, Result};
use crate::header::{HeaderSum, check_manifest_headers};
use crate::layout::{MAX_NDIM, Slice, TensorMeta};

/// Value of [`Manifest::format`].
pub const FORMAT: &str = "flotilla-ckpt";
/// Value of [`Manifest::version`] this crate writes and reads.
pub const VERSION: u32 = 2;
/// Name of the manifest inside a step directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Name of the commit marker inside a step directory; written last.
pub const COMMIT_FILE: &str = "COMMIT";
/// Name of the staging record a step directory gets once it is durable in a remote store
/// (feature `s3`); reserved so no piece file can take it.
pub const REMOTE_RECORD_FILE: &str = "REMOTE";
/// Largest manifest accepted (256 MiB), checked before reading it.
pub const MAX_MANIFEST_BYTES: u64 = 1 << 28;
/// Largest commit marker accepted, checked before reading it.
pub const MAX_MARKER_BYTES: u64 = 4096;
/// Largest end offset of a piece within its file (16 TiB).
pub const MAX_FILE_BYTES: u64 = 1 << 44;
/// Most pieces one tensor may be split into (bounds the pairwise overlap check).
pub const MAX_PIECES_PER_TENSOR: usize = 1 << 16;
/// Smallest checksum chunk a manifest may declare (4 KiB).
pub const MIN_CHUNK_BYTES: u64 = 1 << 12;
/// Largest checksum chunk a manifest may declare (1 GiB).
pub const MAX_CHUNK_BYTES: u64 = 1 << 30;
/// Checksum chunk the writer uses (4 MiB): a partial read verifies only the chunks it touches.
pub const DEFAULT_CHUNK_BYTES: u64 = 4 << 20;
/// Longest file name accepted.
const MAX_NAME_LEN: usize = 255;

/// One stored piece of a logical tensor: a box of it, stored row-major at a byte range of a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// Name of the logical tensor.
    pub tensor: String,
    /// Plain file name inside the step directory.
    pub file: String,
    /// Byte offset of the piece in the file.
    pub offset: u64,
    /// Byte length of the piece.
    pub bytes: u64,
    /// Where the piece sits in the global tensor.
    pub slice: Slice,
    /// Hex xxh3-128 of each consecutive [`Manifest::chunk_bytes`]-sized chunk of the piece's
    /// bytes (the last one shorter), so a reader that needs part of a piece reads and verifies
    /// only the chunks covering that part.
    pub chunks: Vec<String>,
}

impl Piece {
    /// Number of checksum chunks a piece of `bytes` bytes has with chunks of `chunk_bytes`.
    pub fn chunk_count(bytes: u64, chunk_bytes: u64) -> u64 {
        bytes.div_ceil(chunk_bytes.max(1))
    }
}

/// Everything a checkpoint records about one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Always [`VERSION`].
    pub version: u32,
    /// Identifier of the training run.
    pub run_id: String,
    /// Training step this checkpoint captures.
    pub step: u64,
    /// Number of ranks that saved it.
    pub world_size: u32,
    /// Free-form description of the saving layout (mesh, parallel degrees, ...).
    pub layout: serde_json::Value,
    /// Hash of the training configuration, compared by the caller on resume.
    pub config_hash: String,
    /// Size of the checksum chunks of every piece (a power of two between [`MIN_CHUNK_BYTES`]
    /// and [`MAX_CHUNK_BYTES`]).
    pub chunk_bytes: u64,
    /// Every logical tensor.
    pub tensors: Vec<TensorMeta>,
    /// Every stored piece.
    pub pieces: Vec<Piece>,
    /// Each piece file's safetensors header (length prefix and JSON, which no chunk checksum
    /// covers), by file name: its length and xxh3-128, recorded by [`crate::commit`] after
    /// checking that the header describes the file's pieces, and checked on every open (see
    /// [`crate::header`]).
    ///
    /// Backward compatible: a manifest written before header hashes has no `headers` field; it
    /// deserializes to an empty map and still loads, its headers unchecked. An empty map is
    /// not written, so such a manifest also serializes as before.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, HeaderSum>,
    /// Non-tensor state: optimizer step, scheduler, RNG states, data-loader state, user metadata.
    pub state: serde_json::Value,
}

/// Content of the commit marker: ties the step to the exact manifest bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitMarker {
    /// Always [`FORMAT`].
    pub format: String,
    /// The committed step.
    pub step: u64,
    /// Length of `manifest.json`.
    pub manifest_bytes: u64,
    /// Hex xxh3-128 of `manifest.json`.
    pub manifest_xxh3_128: String,
}

impl CommitMarker {
    /// Parses a marker's bytes and checks them against the `step` it was found under: format,
    /// step and a manifest size under [`MAX_MANIFEST_BYTES`]. The error is the reason, for the
    /// caller to wrap with where the marker came from (local file or remote object).
    pub fn parse(bytes: &[u8], step: u64) -> std::result::Result<CommitMarker, String> {
        let marker: CommitMarker =
            serde_json::from_slice(bytes).map_err(|e| format!("unparsable: {e}"))?;
        if marker.format != FORMAT {
            return Err(format!("format {:?}, expected {FORMAT:?}", marker.format));
        }
        if marker.step != step {
            return Err(format!("records step {}", marker.step));
        }
        if marker.manifest_bytes > MAX_MANIFEST_BYTES {
            return Err(format!(
                "manifest size {} over the cap",
                marker.manifest_bytes
            ));
        }
        Ok(marker)
    }
}

/// Refuses anything but a plain, relative file name that stays inside the step directory.
pub fn check_file_name(step: u64, name: &str) -> Result<()> {
    let reason = if name.is_empty() {
        Some("empty")
    } else if name.len() > MAX_NAME_LEN {
        Some("too long")
    } else if name.starts_with('/') {
        Some("absolute path")
    } else if name.contains(['/', '\\']) {
        Some("contains a path separator")
    } else if name == "." || name == ".." {
        Some("is a directory reference")
    } else if name.contains('\0') || name.chars().any(char::is_control) {
        Some("contains control characters")
    } else if [MANIFEST_FILE, COMMIT_FILE, REMOTE_RECORD_FILE].contains(&name)
        || name.ends_with(".tmp")
    {
        Some("reserved name")
    } else {
        None
    };
    match reason {
        None => Ok(()),
        Some(reason) => Err(CkptError::UnsafeFileName {
            step,
            name: name.to_string(),
            reason,
        }),
    }
}

/// Whether `s` is 32 lowercase hex digits (a hex xxh3-128).
pub(crate) fn is_hex128(s: &str) -> bool {
    s.len() == 32
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl Manifest {
    /// Total bytes of every piece (the tensor data of the step, whatever its layout).
    pub fn piece_bytes(&self) -> u64 {
        self.pieces
            .iter()
            .map(|p| p.bytes)
            .fold(0, u64::saturating_add)
    }

    /// The step at a glance, as `flotilla ckpt ls --json` and `ckpt convert --json` print it:
    /// `step`, `run`, `world`, `tensors` and `pieces` (counts) and `bytes` ([`Self::piece_bytes`]).
    pub fn summary_json(&self) -> serde_json::Value {
        serde_json::json!({
            "step": self.step,
            "run": self.run_id,
            "world": self.world_size,
            "tensors": self.tensors.len(),
            "pieces": self.pieces.len(),
            "bytes": self.piece_bytes(),
        })
    }

    /// Runs every structural check; `path` names the manifest in errors.
    pub fn validate(&self, path: &Path) -> Result<()> {
        self.check_header(path)?;
        let tensors = self.tensor_index(path)?;
        for piece in &self.pieces {
            self.check_piece(piece, &tensors)?;
        }
        self.check_file_ranges()?;
        self.check_coverage(&tensors)?;
        check_manifest_headers(self, path)
    }

    /// Looks a tensor up by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorMeta> {
        self.tensors.iter().find(|t| t.name == name)
    }

    fn bad(&self, path: &Path, reason: String) -> CkptError {
        CkptError::Manifest {
            step: self.step,
            path: path.to_path_buf(),
            reason,
        }
    }

    fn bad_piece(&self, tensor: &str, file: &str, reason: String) -> CkptError {
        CkptError::Piece {
            step: self.step,
            tensor: tensor.to_string(),
            file: file.to_string(),
            reason,
        }
    }

    fn check_header(&self, path: &Path) -> Result<()> {
        if self.format != FORMAT {
            return Err(self.bad(
                path,
                format!("format {:?}, expected {FORMAT:?}", self.format),
            ));
        }
        if self.version != VERSION {
            return Err(self.bad(
                path,
                format!("version {}, expected {VERSION}", self.version),
            ));
        }
        if self.world_size == 0 {
            return Err(self.bad(path, "world_size is 0".into()));
        }
        let c = self.chunk_bytes;
        if !c.is_power_of_two() || !(MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES).contains(&c) {
            let reason = format!(
                "chunk_bytes {c} is not a power of two between {MIN_CHUNK_BYTES} and {MAX_CHUNK_BYTES}"
            );
            return Err(self.bad(path, reason));
        }
        Ok(())
    }

    /// Indexes tensors by name, refusing duplicates, too many dimensions and absurd sizes.
    fn tensor_index(&self, path: &Path) -> Result<HashMap<&str, &TensorMeta>> {
        let mut index = HashMap::with_capacity(self.tensors.len());
        for t in &self.tensors {
            if t.shape.len() > MAX_NDIM {
                let reason = format!("{} dimensions, at most {MAX_NDIM}", t.shape.len());
                return Err(self.bad_piece(&t.name, "", reason));
            }
            t.byte_size()?;
            if index.insert(t.name.as_str(), t).is_some() {
                return Err(self.bad(path, format!("tensor {:?} listed twice", t.name)));
            }
        }
        Ok(index)
    }

    fn check_piece(&self, p: &Piece, tensors: &HashMap<&str, &TensorMeta>) -> Result<()> {
        check_file_name(self.step, &p.file)?;
        let Some(meta) = tensors.get(p.tensor.as_str()) else {
            return Err(self.bad_piece(&p.tensor, &p.file, "piece of an unlisted tensor".into()));
        };
        if !p.slice.fits(&meta.shape) {
            let reason = format!("slice {} outside shape {:?}", p.slice, meta.shape);
            return Err(self.bad_piece(&p.tensor, &p.file, reason));
        }
        let want = p.slice.byte_size(meta.dtype, &p.tensor)?;
        if want == 0 {
            return Err(self.bad_piece(&p.tensor, &p.file, "empty piece".into()));
        }
        if p.bytes != want {
            let reason = format!("records {} bytes, slice {} needs {want}", p.bytes, p.slice);
            return Err(self.bad_piece(&p.tensor, &p.file, reason));
        }
        match p.offset.checked_add(p.bytes) {
            Some(end) if end <= MAX_FILE_BYTES => {}
            _ => {
                return Err(CkptError::SizeLimit {
                    what: format!("file {:?} range of tensor {:?}", p.file, p.tensor),
                    size: p.offset.saturating_add(p.bytes),
                    limit: MAX_FILE_BYTES,
                });
            }
        }
        let chunks = Piece::chunk_count(p.bytes, self.chunk_bytes);
        if p.chunks.len() as u64 != chunks {
            let reason = format!(
                "{} chunk checksums, {} bytes in chunks of {} need {chunks}",
                p.chunks.len(),
                p.bytes,
                self.chunk_bytes
            );
            return Err(self.bad_piece(&p.tensor, &p.file, reason));
        }
        if let Some(bad) = p.chunks.iter().find(|c| !is_hex128(c)) {
            let reason = format!("checksum {bad:?} is not 32 lowercase hex digits");
            return Err(self.bad_piece(&p.tensor, &p.file, reason));
        }
        Ok(())
    }

    /// Byte ranges of pieces sharing a file must not overlap (pieces are already checked to be
    /// non-empty with non-overflowing ends).
    fn check_file_ranges(&self) -> Result<()> {
        let mut by_file: HashMap<&str, Vec<&Piece>> = HashMap::new();
        for p in &self.pieces {
            by_file.entry(p.file.as_str()).or_default().push(p);
        }
        for (file, mut pieces) in by_file {
            pieces.sort_by_key(|p| p.offset);
            for w in pieces.windows(2) {
                if w[0].offset + w[0].bytes > w[1].offset {
                    let reason = format!(
                        "byte range {}..+{} overlaps tensor {:?} at {}..+{}",
                        w[1].offset, w[1].bytes, w[0].tensor, w[0].offset, w[0].bytes
                    );
                    return Err(self.bad_piece(&w[1].tensor, file, reason));
                }
            }
        }
        Ok(())
    }

    /// The pieces of each tensor are pairwise disjoint and their volumes sum to the tensor's.
    fn check_coverage(&self, tensors: &HashMap<&str, &TensorMeta>) -> Result<()> {
        let mut by_tensor: HashMap<&str, Vec<&Piece>> = HashMap::new();
        for p in &self.pieces {
            by_tensor.entry(p.tensor.as_str()).or_default().push(p);
        }
        for (name, meta) in tensors {
            let pieces = by_tensor.remove(name).unwrap_or_default();
            self.check_disjoint(name, pieces.clone())?;
            // Volumes cannot overflow: each piece fits the shape, whose volume was bounded.
            let covered: u64 = pieces.iter().filter_map(|p| p.slice.volume()).sum();
            let total = Slice::full(&meta.shape).volume().unwrap_or(u64::MAX);
            if covered != total {
                let reason = format!("pieces cover {covered} of {total} elements");
                return Err(self.bad_piece(name, "", reason));
            }
        }
        Ok(())
    }

    /// Sweep along dimension 0: only pieces whose dim-0 ranges meet are compared.
    fn check_disjoint(&self, name: &str, mut pieces: Vec<&Piece>) -> Result<()> {
        if pieces.len() > MAX_PIECES_PER_TENSOR {
            return Err(CkptError::SizeLimit {
                what: format!("pieces of tensor {name:?}"),
                size: pieces.len() as u64,
                limit: MAX_PIECES_PER_TENSOR as u64,
            });
        }
        let dim0 = |p: &Piece| {
            p.slice
                .0
                .first()
                .map_or((0, 1), |e| (e.offset, e.offset + e.len))
        };
        pieces.sort_by_key(|p| dim0(p).0);
        for (i, a) in pieces.iter().enumerate() {
            let a_end = dim0(a).1;
            for b in pieces[i + 1..].iter().take_while(|b| dim0(b).0 < a_end) {
                if a.slice.overlap(&b.slice).is_some() {
                    let reason = format!(
                        "piece {} overlaps piece {} in file {:?}",
                        b.slice, a.slice, a.file
                    );
                    return Err(self.bad_piece(name, &b.file, reason));
                }
            }
        }
        Ok(())
    }
}
