//! Integrity of each rank file's safetensors header.
//!
//! The header (the 8-byte little-endian length prefix and the JSON after it, padding included)
//! lies before every piece, so no chunk checksum covers it: a damaged header would still pass
//! every piece check while a tool reading the file as safetensors breaks. So [`crate::commit`]
//! reads each rank file's header back, checks that it describes exactly the pieces the manifest
//! records for that file (name, dtype, shape and data offsets of each), and records its length
//! and xxh3-128 in [`Manifest::headers`]; every open ([`crate::Checkpoint::open`], both
//! [`crate::Verify`] modes) hashes the header bytes again and rejects the step on any
//! difference, naming the file.
//!
//! Manifests written before this check existed have no `headers` field; they still load, with
//! their headers unchecked (the pieces are still checked chunk by chunk).

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{CkptError, Result, io_err};
use crate::fsio::{checksum_hex, file_len, open_read};
use crate::layout::{DType, Slice, TensorMeta};
use crate::manifest::{Manifest, Piece, is_hex128};
use crate::rank_file::piece_key;

/// Largest rank-file header accepted, length prefix included (128 MiB; safetensors itself
/// refuses headers over 100 MB).
pub const MAX_HEADER_BYTES: u64 = 1 << 27;

/// Name of the safetensors header's metadata entry (not a piece).
const METADATA_KEY: &str = "__metadata__";

/// What a manifest records about one rank file's header.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeaderSum {
    /// Bytes from the start of the file to the first data byte: the 8-byte length prefix plus
    /// the JSON header and its padding.
    pub bytes: u64,
    /// Hex xxh3-128 of those bytes.
    pub xxh3_128: String,
}

/// One piece's entry in a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HeaderEntry {
    /// Safetensors dtype name (`F32`, `BF16`, ...).
    dtype: String,
    /// The piece's own shape.
    shape: Vec<u64>,
    /// Start and end of the piece relative to the first data byte.
    data_offsets: [u64; 2],
}

impl HeaderEntry {
    /// The entry of a piece of `dtype` covering `slice`, `bytes` long at `rel` bytes past the
    /// header.
    pub(crate) fn new(dtype: DType, slice: &Slice, rel: u64, bytes: u64) -> Self {
        HeaderEntry {
            dtype: safetensors_dtype(dtype).to_string(),
            shape: slice.0.iter().map(|e| e.len).collect(),
            data_offsets: [rel, rel.saturating_add(bytes)],
        }
    }
}

/// The safetensors dtype name of a [`DType`].
fn safetensors_dtype(dtype: DType) -> &'static str {
    match dtype {
        DType::F64 => "F64",
        DType::F32 => "F32",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        DType::I64 => "I64",
        DType::I32 => "I32",
        DType::I16 => "I16",
        DType::I8 => "I8",
        DType::U8 => "U8",
        DType::Bool => "BOOL",
    }
}

fn bad(step: u64, path: &Path, reason: String) -> CkptError {
    CkptError::Header {
        step,
        path: path.to_path_buf(),
        reason,
    }
}

/// Reads the header of the rank file at `path` as its length prefix says (capped at
/// [`MAX_HEADER_BYTES`] and at the file's length).
fn read_header(step: u64, path: &Path) -> Result<Vec<u8>> {
    let file = open_read(path)?;
    let len = file_len(&file, path)?;
    let mut prefix = [0u8; 8];
    if len < 8 {
        return Err(bad(step, path, format!("file has {len} bytes, no header")));
    }
    file.read_exact_at(&mut prefix, 0)
        .map_err(io_err("read", path))?;
    let total = u64::from_le_bytes(prefix).saturating_add(8);
    if total > MAX_HEADER_BYTES.min(len) {
        let reason = format!(
            "length prefix says {total} bytes, the file has {len} and the cap is {MAX_HEADER_BYTES}"
        );
        return Err(bad(step, path, reason));
    }
    let mut bytes = vec![0u8; total as usize];
    file.read_exact_at(&mut bytes, 0)
        .map_err(io_err("read", path))?;
    Ok(bytes)
}

/// Checks that `header` (prefix included) lists exactly `pieces`, each with its dtype, shape
/// and data offsets, besides the metadata entry.
fn check_describes(
    step: u64,
    path: &Path,
    header: &[u8],
    pieces: &[&Piece],
    tensors: &HashMap<&str, &TensorMeta>,
) -> Result<()> {
    let bad = |reason: String| bad(step, path, reason);
    let data_start = header.len() as u64;
    let mut entries: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(header.get(8..).unwrap_or_default())
            .map_err(|e| bad(format!("unparsable JSON: {e}")))?;
    entries.remove(METADATA_KEY);
    for p in pieces {
        let key = piece_key(&p.tensor, &p.slice);
        let (Some(meta), Some(rel)) = (
            tensors.get(p.tensor.as_str()),
            p.offset.checked_sub(data_start),
        ) else {
            return Err(bad(format!(
                "piece {key:?} at byte {} overlaps the header",
                p.offset
            )));
        };
        let want = HeaderEntry::new(meta.dtype, &p.slice, rel, p.bytes);
        let got = entries
            .remove(&key)
            .ok_or_else(|| bad(format!("no entry for piece {key:?}")))?;
        let got: HeaderEntry = serde_json::from_value(got)
            .map_err(|e| bad(format!("entry {key:?} unparsable: {e}")))?;
        if got != want {
            return Err(bad(format!(
                "entry {key:?} is {got:?}, the piece needs {want:?}"
            )));
        }
    }
    match entries.keys().next() {
        Some(extra) => Err(bad(format!("entry {extra:?} is no piece of the manifest"))),
        None => Ok(()),
    }
}

/// Pieces of `pieces` grouped by file name.
fn by_file(pieces: &[Piece]) -> BTreeMap<&str, Vec<&Piece>> {
    let mut files: BTreeMap<&str, Vec<&Piece>> = BTreeMap::new();
    for p in pieces {
        files.entry(p.file.as_str()).or_default().push(p);
    }
    files
}

/// For [`crate::commit`]: reads every piece file's header in `dir`, checks that it describes
/// exactly the file's pieces and returns each file's [`HeaderSum`].
pub(crate) fn sum_headers(
    dir: &Path,
    step: u64,
    pieces: &[Piece],
    tensors: &[TensorMeta],
) -> Result<BTreeMap<String, HeaderSum>> {
    let tensors: HashMap<&str, &TensorMeta> =
        tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut sums = BTreeMap::new();
    for (file, pieces) in by_file(pieces) {
        let path = dir.join(file);
        let header = read_header(step, &path)?;
        check_describes(step, &path, &header, &pieces, &tensors)?;
        let sum = HeaderSum {
            bytes: header.len() as u64,
            xxh3_128: checksum_hex(&header),
        };
        sums.insert(file.to_string(), sum);
    }
    Ok(sums)
}

/// Structural checks of [`Manifest::headers`] (part of [`Manifest::validate`]): none at all
/// (a manifest from before header hashes), or exactly one per piece file, each a hex xxh3-128
/// of at least the length prefix, at most [`MAX_HEADER_BYTES`] and ending at or before the
/// file's first piece.
pub(crate) fn check_manifest_headers(m: &Manifest, path: &Path) -> Result<()> {
    if m.headers.is_empty() {
        return Ok(());
    }
    let files = by_file(&m.pieces);
    let reason = |file: &str, why: String| CkptError::Manifest {
        step: m.step,
        path: path.to_path_buf(),
        reason: format!("header of file {file:?}: {why}"),
    };
    if let Some(file) = files.keys().find(|f| !m.headers.contains_key(**f)) {
        return Err(reason(file, "not recorded".into()));
    }
    for (file, sum) in &m.headers {
        let Some(first) = files
            .get(file.as_str())
            .and_then(|p| p.iter().map(|p| p.offset).min())
        else {
            return Err(reason(file, "recorded for a file without pieces".into()));
        };
        if !(8..=MAX_HEADER_BYTES.min(first)).contains(&sum.bytes) {
            let why = format!(
                "{} bytes, not between 8 and the first piece's offset {first} (cap {MAX_HEADER_BYTES})",
                sum.bytes
            );
            return Err(reason(file, why));
        }
        if !is_hex128(&sum.xxh3_128) {
            let why = format!("checksum {:?} is not 32 lowercase hex digits", sum.xxh3_128);
            return Err(reason(file, why));
        }
    }
    Ok(())
}

/// Hashes every rank file header in `dir` that the (validated) manifest records and compares
/// it with the record.
pub(crate) fn verify_headers(dir: &Path, m: &Manifest) -> Result<()> {
    for (file, sum) in &m.headers {
        let path = dir.join(file);
        let f = open_read(&path)?;
        let len = file_len(&f, &path)?;
        if len < sum.bytes {
            let reason = format!("file has {len} bytes, its header {}", sum.bytes);
            return Err(bad(m.step, &path, reason));
        }
        let mut bytes = vec![0u8; sum.bytes as usize];
        f.read_exact_at(&mut bytes, 0)
            .map_err(io_err("read", &path))?;
        let actual = checksum_hex(&bytes);
        if actual != sum.xxh3_128 {
            let reason = format!(
                "checksum mismatch: bytes 0..{} hash to {actual}, the manifest records {}",
                sum.bytes, sum.xxh3_128
            );
            return Err(bad(m.step, &path, reason));
        }
    }
    Ok(())
}
