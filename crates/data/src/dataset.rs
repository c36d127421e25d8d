//! An opened dataset: its manifest and lazily mapped, verified-before-first-use shards.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use crate::cache::{FetchStats, ShardFetch};
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
/// The dataset keeps the shards used most recently mapped, up to [`KEEP_MAPPED_BYTES`] of
/// shard files (least recently used let go first); any other shard stays mapped only while a
/// reader holds it. So a dataset that fits the budget is mapped (and its page tables
/// populated) once per process, not once per epoch, and a dataset of thousands of shards never
/// has them all mapped. A shard mapped again later is checked cheaply (header, length, end
/// marker) but not re-hashed: shards are immutable, and each is hashed once per process.
pub struct Dataset {
    dir: PathBuf,
    manifest: Manifest,
    slots: Vec<Mutex<Slot>>,
    /// Shards whose hash has been checked in this process.
    verified: std::sync::atomic::AtomicUsize,
    recent: Mutex<Recent<Shard>>,
    /// A remote dataset's fetcher: brings each shard into `dir` before it is mapped
    /// ([`crate::cache`]); `None` for a local directory.
    fetch: Option<Box<dyn ShardFetch>>,
}

/// Shard-file bytes a dataset keeps mapped after their readers let go.
///
/// Mapping a shard again costs its page tables again: `MADV_POPULATE_READ` takes about 1.6 ms
/// per 64 MiB shard on the Zen 5 machine, and unmapping flushes TLBs on every core that ran a
/// reader. Keeping a 2 GB dataset mapped across epochs took the loader (one worker, four
/// epochs) from 11.2-12.0 to 13.5-14.0 GB/s there (docs/PERFORMANCE.md, ninth look). The
/// price is page tables:
/// at most 1/512 of the mapped bytes (128 MiB for 64 GiB) with 4 KiB pages.
pub const KEEP_MAPPED_BYTES: u64 = 64 << 30;

/// The shards kept mapped, most recently used first (number, handle, bytes), and their total
/// bytes.
struct Recent<T> {
    shards: std::collections::VecDeque<(usize, Arc<T>, u64)>,
    bytes: u64,
}

impl<T> Default for Recent<T> {
    fn default() -> Self {
        Recent {
            shards: Default::default(),
            bytes: 0,
        }
    }
}

impl<T> Recent<T> {
    /// Puts shard `i` (of `bytes`) first, letting the least recently used go past `budget`
    /// bytes (the first one always stays).
    fn touch(&mut self, i: usize, shard: &Arc<T>, bytes: u64, budget: u64) {
        if self.shards.front().is_some_and(|(j, ..)| *j == i) {
            return;
        }
        match self.shards.iter().position(|(j, ..)| *j == i) {
            Some(at) => {
                let kept = self.shards.remove(at).expect("found above");
                self.shards.push_front(kept);
            }
            None => {
                self.bytes += bytes;
                self.shards.push_front((i, shard.clone(), bytes));
            }
        }
        while self.bytes > budget && self.shards.len() > 1 {
            let (.., old) = self.shards.pop_back().expect("more than one");
            self.bytes -= old;
        }
    }
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
        Ok(Dataset::with_fetch(dir, manifest, None))
    }

    /// A dataset over `dir` whose shards `fetch` brings in (a remote dataset's cache).
    pub(crate) fn with_fetch(
        dir: &Path,
        manifest: Manifest,
        fetch: Option<Box<dyn ShardFetch>>,
    ) -> Dataset {
        let slots = manifest
            .shards
            .iter()
            .map(|_| Mutex::new(Slot::default()))
            .collect();
        Dataset {
            dir: dir.to_path_buf(),
            manifest,
            slots,
            verified: Default::default(),
            recent: Mutex::new(Recent::default()),
            fetch,
        }
    }

    /// A remote dataset's fetches so far (`None` for a local directory).
    pub fn fetch_stats(&self) -> Option<FetchStats> {
        self.fetch.as_ref().map(|f| f.stats())
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
        let shard = self.mapped(i)?;
        self.recent.lock().unwrap_or_else(|p| p.into_inner()).touch(
            i,
            &shard,
            shard.info().bytes,
            self.fetch
                .as_ref()
                .map_or(KEEP_MAPPED_BYTES, |f| f.max_bytes().min(KEEP_MAPPED_BYTES)),
        );
        Ok(shard)
    }

    /// Shard `i`'s live mapping, or a new one (verified if it never was).
    fn mapped(&self, i: usize) -> Result<Arc<Shard>> {
        let mut slot = self.slots[i].lock().unwrap_or_else(|p| p.into_inner());
        if let Some(shard) = slot.mapped.upgrade() {
            return Ok(shard);
        }
        let (shard, fresh) = self.open_checked(i)?;
        if !slot.verified || fresh {
            shard.verify(self.manifest.shards[i].checksum())?;
        }
        if !slot.verified {
            slot.verified = true;
            self.verified
                .fetch_add(1, std::sync::atomic::Ordering::Release);
        }
        let shard = Arc::new(shard);
        slot.mapped = Arc::downgrade(&shard);
        drop(slot);
        self.make_room(i);
        Ok(shard)
    }

    /// Lets a remote dataset's least recently used shards go until its cache is within budget,
    /// skipping any whose slot another thread holds (being fetched or mapped right now); a
    /// shard still mapped keeps its pages until its readers let go.
    fn make_room(&self, keep: usize) {
        let Some(f) = &self.fetch else { return };
        for j in f.over_budget(keep) {
            if let Ok(_slot) = self.slots[j].try_lock() {
                f.evict(j);
            }
        }
    }

    /// Whether shard `i` still waits for its first verification: false once verified, and
    /// false while another thread holds its slot (it is being mapped or verified right now).
    /// A remote dataset's shard also needs it while its file is not in the cache (never
    /// fetched, or let go): that is how the verify-ahead thread reads ahead.
    pub fn needs_verification(&self, i: usize) -> bool {
        self.slots[i].try_lock().is_ok_and(|slot| {
            !slot.verified
                || self
                    .fetch
                    .as_ref()
                    .is_some_and(|f| slot.mapped.strong_count() == 0 && !f.present(i))
        })
    }

    /// Whether every shard has been verified in this process and stays in place (nothing is
    /// left to hash or fetch ahead).
    pub fn all_verified(&self) -> bool {
        self.verified.load(std::sync::atomic::Ordering::Acquire) == self.slots.len()
            && self.fetch.as_ref().is_none_or(|f| f.holds_all())
    }

    /// Maps and verifies shard `i` afresh, without caching it (what `flotilla data verify` does).
    ///
    /// # Errors
    /// As [`Dataset::shard`].
    pub fn open_verified(&self, i: usize) -> Result<Arc<Shard>> {
        let (shard, _) = self.open_checked(i)?;
        shard.verify(self.manifest.shards[i].checksum())?;
        Ok(Arc::new(shard))
    }

    /// Maps shard `i` at `path`, fetched into the cache first for a remote dataset (`true`:
    /// downloaded just now). A file another process let go of the shared cache between the
    /// fetch and the mapping is fetched again (at most three tries).
    fn fetch_and_map(&self, i: usize, path: &Path) -> Result<(Shard, bool)> {
        let Some(f) = &self.fetch else {
            return Ok((Shard::open(path)?, false));
        };
        let entry = &self.manifest.shards[i];
        let mut tries = 0;
        loop {
            let fresh = f.fetch(i, &entry.file, entry.bytes)?;
            match Shard::open(path) {
                Err(DataError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound && tries < 2 =>
                {
                    tries += 1;
                }
                opened => return Ok((opened?, fresh)),
            }
        }
    }

    /// Maps shard `i` with the cheap checks only: header, length, end marker, and agreement
    /// with the manifest (counts, tokenizer, vocabulary, footer checksum); a remote dataset's
    /// shard is fetched into the cache first (`true`: downloaded just now).
    fn open_checked(&self, i: usize) -> Result<(Shard, bool)> {
        let entry = &self.manifest.shards[i];
        let path = self.shard_path(i);
        let (shard, fresh) = self.fetch_and_map(i, &path)?;
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
        Ok((shard, fresh))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_shards_stay_mapped_within_the_budget_least_recent_out_first() {
        let mut r = Recent::default();
        let h: Vec<Arc<()>> = (0..4).map(|_| Arc::new(())).collect();
        for i in [0, 1, 2] {
            r.touch(i, &h[i], 10, 30);
        }
        r.touch(0, &h[0], 10, 30); // 0 is the most recent again
        r.touch(3, &h[3], 10, 30); // over the budget: 1, the least recent, goes
        let order: Vec<usize> = r.shards.iter().map(|(i, ..)| *i).collect();
        assert_eq!((order, r.bytes), (vec![3, 0, 2], 30));
        assert_eq!(Arc::strong_count(&h[1]), 1);
        assert_eq!(Arc::strong_count(&h[0]), 2);
        // One shard larger than the budget still stays while it is the latest.
        r.touch(1, &h[1], 100, 30);
        assert_eq!(r.shards.len(), 1);
        assert_eq!((r.shards[0].0, r.bytes), (1, 100));
    }
}
