//! An opened dataset: its manifest and lazily mapped, verified-before-first-use shards.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use crate::error::{DataError, Result};
use crate::manifest::Manifest;
use crate::shard::Shard;

/// A dataset directory, opened.
///
/// [`Dataset::open`] reads the manifest and `stat`s every shard (a missing or truncated shard
/// is an error here, before training starts). Each shard is mapped and fully verified (hash
/// against footer and manifest, document index) the first time [`Dataset::shard`] asks for it,
/// so no token of a shard is ever returned before its checksum has been checked.
///
/// The dataset holds shards weakly: a shard stays mapped while a reader holds it, and is
/// unmapped when the last one lets go, so a dataset of thousands of shards never has them all
/// mapped (nor their page tables populated). A shard mapped again later is checked cheaply
/// (header, length, end marker) but not re-hashed: shards are immutable, and each is hashed
/// once per process.
pub struct Dataset {
    dir: PathBuf,
    manifest: Manifest,
    slots: Vec<Mutex<Slot>>,
}

/// One shard's handle and whether its hash has been checked in this process.
#[derive(Default)]
struct Slot {
    mapped: Weak<Shard>,
    verified: bool,
}

impl Dataset {
    /// Opens the dataset in `dir`.
    ///
    /// # Errors
    /// Manifest errors ([`Manifest::read`]); [`DataError::MissingShard`] for a listed shard that
    /// is absent; [`DataError::CorruptShard`] for one whose size differs from the manifest's.
    pub fn open(dir: &Path) -> Result<Dataset> {
        let manifest = Manifest::read(dir)?;
        for entry in &manifest.shards {
            let path = dir.join(&entry.file);
            let meta = std::fs::metadata(&path).map_err(|source| DataError::MissingShard {
                path: path.clone(),
                source,
            })?;
            if meta.len() != entry.bytes {
                return Err(DataError::CorruptShard {
                    path,
                    problem: format!(
                        "the file is {} bytes, the manifest records {}{}",
                        meta.len(),
                        entry.bytes,
                        if meta.len() < entry.bytes {
                            " (truncated)"
                        } else {
                            ""
                        }
                    ),
                });
            }
        }
        let slots = manifest
            .shards
            .iter()
            .map(|_| Mutex::new(Slot::default()))
            .collect();
        Ok(Dataset {
            dir: dir.to_path_buf(),
            manifest,
            slots,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Number of shards.
    pub fn num_shards(&self) -> usize {
        self.manifest.shards.len()
    }

    /// Path of shard `i`.
    pub fn shard_path(&self, i: usize) -> PathBuf {
        self.dir.join(&self.manifest.shards[i].file)
    }

    /// Shard `i`, mapped and verified on first use (concurrent callers wait for one check).
    ///
    /// # Errors
    /// [`Shard::open`] and [`Shard::verify`] errors naming the shard, plus a check that the
    /// shard's header agrees with the manifest (tokens, documents, tokenizer, vocabulary).
    pub fn shard(&self, i: usize) -> Result<Arc<Shard>> {
        let mut slot = self.slots[i].lock().unwrap_or_else(|p| p.into_inner());
        if let Some(shard) = slot.mapped.upgrade() {
            return Ok(shard);
        }
        let shard = if slot.verified {
            Arc::new(self.open_checked(i)?)
        } else {
            let shard = self.open_verified(i)?;
            slot.verified = true;
            shard
        };
        slot.mapped = Arc::downgrade(&shard);
        Ok(shard)
    }

    /// Whether shard `i` still waits for its first verification: false once verified, and
    /// false while another thread holds its slot (it is being mapped or verified right now).
    pub fn needs_verification(&self, i: usize) -> bool {
        self.slots[i].try_lock().is_ok_and(|slot| !slot.verified)
    }

    /// Maps and verifies shard `i` afresh, without caching it (what `flotilla data verify` does).
    ///
    /// # Errors
    /// As [`Dataset::shard`].
    pub fn open_verified(&self, i: usize) -> Result<Arc<Shard>> {
        let shard = self.open_checked(i)?;
        shard.verify(self.manifest.shards[i].checksum())?;
        Ok(Arc::new(shard))
    }

    /// Maps shard `i` with the cheap checks only: header, length, end marker, and agreement
    /// with the manifest (counts, tokenizer, vocabulary, footer checksum).
    fn open_checked(&self, i: usize) -> Result<Shard> {
        let entry = &self.manifest.shards[i];
        let path = self.shard_path(i);
        let shard = Shard::open(&path)?;
        let info = shard.info();
        let m = &self.manifest;
        let disagree = (info.tokens, info.docs, info.vocab, info.tokenizer.as_str())
            != (entry.tokens, entry.docs, m.vocab_size, m.tokenizer.as_str());
        if disagree {
            return Err(DataError::CorruptShard {
                path,
                problem: format!(
                    "header (tokens {}, docs {}, vocab {}, tokenizer {}) disagrees with the manifest \
                     (tokens {}, docs {}, vocab {}, tokenizer {})",
                    info.tokens,
                    info.docs,
                    info.vocab,
                    info.tokenizer,
                    entry.tokens,
                    entry.docs,
                    m.vocab_size,
                    m.tokenizer
                ),
            });
        }
        if entry.checksum() != Some(info.checksum) {
            return Err(DataError::ChecksumMismatch {
                path,
                recorded_in: "the manifest",
                expected: entry.xxh3_128.clone(),
                actual: format!(
                    "{} (the shard's footer)",
                    crate::shard::hex128(info.checksum)
                ),
            });
        }
        Ok(shard)
    }
}
