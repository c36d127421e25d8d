//! The dataset manifest: which shards make a dataset, their hashes, and its snapshot id.
//!
//! `manifest.json` is written last and atomically (temporary file, `fsync`, rename, directory
//! `fsync`), so a directory with a manifest holds a complete dataset, and an interrupted
//! `prepare` leaves none. The snapshot id is the SHA-256 of the manifest's own content (shard
//! names, sizes, counts and hashes, tokenizer, preprocessing version): the seeds' dataset
//! snapshot (000 L993: per-shard hashes plus preprocessing version), one string that names
//! exactly these bytes.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{DataError, Result};
use crate::fsread::read_bounded;
use crate::shard::{ShardInfo, hex128};

/// File name of the manifest inside a dataset directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The `format` field's value.
pub const FORMAT: &str = "flotilla-dataset";
/// Largest manifest read, so a foreign file cannot make us allocate without bound.
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;

/// One shard as the manifest records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// File name inside the dataset directory (no directory part).
    pub file: String,
    /// File length in bytes.
    pub bytes: u64,
    /// Token ids.
    pub tokens: u64,
    /// Documents.
    pub docs: u64,
    /// The shard's checksum, 32 hex digits (see [`crate::shard`]).
    pub xxh3_128: String,
}

impl ShardEntry {
    /// The checksum as a number.
    pub fn checksum(&self) -> Option<u128> {
        u128::from_str_radix(&self.xxh3_128, 16).ok()
    }
}

/// A dataset's manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Manifest format version (1).
    pub version: u32,
    /// Tokenizer name (`byte`, `gpt2`, `hf:<hash>`).
    pub tokenizer: String,
    /// Vocabulary size: every id is below it.
    pub vocab_size: u32,
    /// The end-of-text id appended to every document, if any.
    pub eot: Option<u32>,
    /// Bytes per token id in the shards.
    pub token_bytes: u32,
    /// What produced the shards (tool version and options), part of the snapshot.
    pub preprocessing: String,
    /// The shards, in dataset order.
    pub shards: Vec<ShardEntry>,
    /// Total token ids.
    pub tokens: u64,
    /// Total documents.
    pub docs: u64,
    /// Total bytes of the shard files.
    pub bytes: u64,
    /// SHA-256 (hex) of everything above.
    pub snapshot: String,
}

impl Manifest {
    /// A manifest for `shards` (written into `dir`), with totals and snapshot id filled in.
    pub fn new(
        tokenizer: &str,
        vocab_size: u32,
        eot: Option<u32>,
        preprocessing: &str,
        shards: &[ShardInfo],
    ) -> Manifest {
        let entries: Vec<ShardEntry> = shards
            .iter()
            .map(|s| ShardEntry {
                file: s
                    .path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                bytes: s.bytes,
                tokens: s.tokens,
                docs: s.docs,
                xxh3_128: hex128(s.checksum),
            })
            .collect();
        let mut m = Manifest {
            format: FORMAT.into(),
            version: 1,
            tokenizer: tokenizer.into(),
            vocab_size,
            eot,
            token_bytes: crate::shard::token_width(vocab_size),
            preprocessing: preprocessing.into(),
            tokens: entries.iter().map(|e| e.tokens).sum(),
            docs: entries.iter().map(|e| e.docs).sum(),
            bytes: entries.iter().map(|e| e.bytes).sum(),
            shards: entries,
            snapshot: String::new(),
        };
        m.snapshot = m.compute_snapshot();
        m
    }

    /// SHA-256 over the canonical JSON of every field but `snapshot`.
    pub fn compute_snapshot(&self) -> String {
        let mut unsigned = self.clone();
        unsigned.snapshot.clear();
        let json = serde_json::to_vec(&unsigned).expect("a manifest always serialises");
        let digest = Sha256::digest(&json);
        digest.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Writes `dir/manifest.json` atomically.
    ///
    /// # Errors
    /// [`DataError::Io`] naming the file that failed.
    pub fn write_atomic(&self, dir: &Path) -> Result<PathBuf> {
        let path = dir.join(MANIFEST_FILE);
        let tmp = dir.join(format!("{MANIFEST_FILE}.tmp"));
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |source| DataError::Io { path: p, source }
        };
        let mut json = serde_json::to_vec_pretty(self).expect("a manifest always serialises");
        json.push(b'\n');
        let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(&json).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        drop(f);
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        // The rename is durable only once the directory entry is.
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io(dir))?;
        Ok(path)
    }

    /// Reads and checks `dir/manifest.json`.
    ///
    /// # Errors
    /// As [`read_bounded`] (with [`MAX_MANIFEST_BYTES`]) if it cannot be read, is not a regular
    /// file (a FIFO does not block; a link to a device is refused) or is too large;
    /// [`DataError::BadManifest`] naming the problem if it is not JSON of this format, inconsistent (totals, a shard name with a
    /// directory part) or its snapshot id does not match its content (edited by hand).
    pub fn read(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST_FILE);
        let bad = |problem: String| DataError::BadManifest {
            path: path.clone(),
            problem,
        };
        let bytes = read_bounded(&path, MAX_MANIFEST_BYTES)?;
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        m.check().map_err(bad)?;
        Ok(m)
    }

    fn check(&self) -> std::result::Result<(), String> {
        if self.format != FORMAT || self.version != 1 {
            return Err(format!(
                "format {:?} version {}, expected {FORMAT:?} version 1",
                self.format, self.version
            ));
        }
        if self.shards.is_empty() {
            return Err("lists no shards".into());
        }
        for s in &self.shards {
            let plain = Path::new(&s.file).file_name().map(|n| n.to_string_lossy());
            if plain.as_deref() != Some(s.file.as_str()) {
                return Err(format!("shard name {:?} is not a plain file name", s.file));
            }
            if s.checksum().is_none() || s.xxh3_128.len() != 32 {
                return Err(format!(
                    "shard {} has checksum {:?}, expected 32 hex digits",
                    s.file, s.xxh3_128
                ));
            }
        }
        // Checked: a hostile manifest's counts could overflow the sums.
        let sum = |f: fn(&ShardEntry) -> u64| -> Option<u64> {
            self.shards.iter().map(f).try_fold(0u64, u64::checked_add)
        };
        let totals = match (sum(|s| s.tokens), sum(|s| s.docs), sum(|s| s.bytes)) {
            (Some(t), Some(d), Some(b)) => (t, d, b),
            _ => return Err("the shards' counts overflow 64 bits".into()),
        };
        if totals != (self.tokens, self.docs, self.bytes) {
            return Err(format!(
                "totals (tokens, docs, bytes) = {:?} but the shards sum to {totals:?}",
                (self.tokens, self.docs, self.bytes)
            ));
        }
        let snapshot = self.compute_snapshot();
        if snapshot != self.snapshot {
            return Err(format!(
                "snapshot id {} does not match its content (hash {snapshot}): edited after writing?",
                self.snapshot
            ));
        }
        Ok(())
    }
}
