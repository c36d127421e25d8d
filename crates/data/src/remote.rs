//! A dataset in object storage (feature `s3`): the manifest downloaded into the cache
//! directory, and the [`ShardFetch`] that brings each shard there when it is first needed
//! (see [`crate::cache`]).
//!
//! Several processes (the ranks of one host) may share a cache directory: each download goes
//! to a file of its own and is renamed into place (the copies are byte-identical, so the last
//! rename wins harmlessly), and a shard another process let go between this one's fetch and
//! its mapping is fetched again.

use std::collections::VecDeque;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use objstore::{Hedge, LatencyWindow, RangedRead, RemoteOptions, RemoteStore, StoreError};

use crate::cache::{CacheConfig, FetchStats, ShardFetch};
use crate::dataset::Dataset;
use crate::error::{DataError, Result};
use crate::manifest::{MANIFEST_FILE, MAX_MANIFEST_BYTES, Manifest};

/// Request latencies kept for the statistics (the most recent).
const KEPT_LATENCIES: usize = 1 << 16;

/// Suffix of downloads in progress (removed when a dataset is opened).
const PART: &str = ".part-";

fn remote_err(url: &str) -> impl FnOnce(StoreError) -> DataError {
    let url = url.to_string();
    move |e| DataError::Remote {
        url,
        reason: e.to_string(),
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DataError {
    let path = path.to_path_buf();
    move |source| DataError::Io { path, source }
}

/// Opens the dataset at `url` through `cache`: downloads its manifest (a changed manifest
/// empties the dataset's cache directory first) and returns a dataset whose shards are
/// fetched on first use.
///
/// # Errors
/// [`DataError::Remote`] when the store cannot be opened or the manifest read; the
/// manifest's own errors ([`Manifest::read`]); [`DataError::Io`] for the cache directory.
pub(crate) fn open(url: &str, cache: &CacheConfig) -> Result<Dataset> {
    let (store, dir, manifest) = cached_manifest(url, cache)?;
    let fetch = RemoteShards::new(store, url, &dir, &manifest, cache)?;
    Ok(Dataset::with_fetch(&dir, manifest, Some(Box::new(fetch))))
}

/// The manifest of the dataset at `url`, downloaded into its cache directory as [`open`] does,
/// without scanning the cache's shard files (what the run's set-up reads before the loader).
///
/// # Errors
/// As [`open`].
pub(crate) fn read_manifest(url: &str, cache: &CacheConfig) -> Result<Manifest> {
    Ok(cached_manifest(url, cache)?.2)
}

/// Downloads the manifest of `url` into its cache directory (emptying the directory when the
/// manifest changed); the store, the directory and the manifest.
fn cached_manifest(url: &str, cache: &CacheConfig) -> Result<(RemoteStore, PathBuf, Manifest)> {
    let store = RemoteStore::open(url, &RemoteOptions::default()).map_err(remote_err(url))?;
    let bytes = store
        .get_object(MANIFEST_FILE, MAX_MANIFEST_BYTES)
        .map_err(remote_err(url))?;
    let dir = cache.dir_for(url);
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let local = dir.join(MANIFEST_FILE);
    let cached = crate::fsread::read_bounded(&local, MAX_MANIFEST_BYTES).ok();
    if cached.as_deref() != Some(bytes.as_slice()) {
        // Another snapshot: none of the cached shard files belongs to it.
        for entry in std::fs::read_dir(&dir).map_err(io_err(&dir))? {
            let path = entry.map_err(io_err(&dir))?.path();
            std::fs::remove_file(&path).map_err(io_err(&path))?;
        }
        let tmp = dir.join(format!("{MANIFEST_FILE}{PART}{}", std::process::id()));
        std::fs::write(&tmp, &bytes).map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &local).map_err(io_err(&local))?;
    }
    let manifest = Manifest::read(&dir)?;
    Ok((store, dir, manifest))
}

/// The cache's shards, most recently used last, and their bytes.
#[derive(Default)]
struct Lru {
    order: VecDeque<(usize, u64)>,
    bytes: u64,
}

impl Lru {
    fn touch(&mut self, i: usize, bytes: u64) {
        match self.order.iter().position(|(j, _)| *j == i) {
            Some(at) => {
                let e = self.order.remove(at).expect("found above");
                self.order.push_back(e);
            }
            None => {
                self.order.push_back((i, bytes));
                self.bytes += bytes;
            }
        }
    }

    fn remove(&mut self, i: usize) {
        if let Some(at) = self.order.iter().position(|(j, _)| *j == i) {
            let (_, b) = self.order.remove(at).expect("found above");
            self.bytes -= b;
        }
    }
}

/// Downloads, counts and lets go of one remote dataset's shard files.
struct RemoteShards {
    store: RemoteStore,
    url: String,
    dir: PathBuf,
    files: Vec<String>,
    total: u64,
    max_bytes: u64,
    read: RangedRead,
    window: LatencyWindow,
    lru: Mutex<Lru>,
    stats: Mutex<(FetchStats, VecDeque<Duration>)>,
    next_part: AtomicU64,
}

impl RemoteShards {
    /// Removes downloads a crash left behind and counts the shard files already cached.
    fn new(
        store: RemoteStore,
        url: &str,
        dir: &Path,
        manifest: &Manifest,
        cache: &CacheConfig,
    ) -> Result<Self> {
        for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
            let path = entry.map_err(io_err(dir))?.path();
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            if name.is_some_and(|n| n.contains(PART)) {
                // Best effort: another process's download in flight may own it.
                let _ = std::fs::remove_file(&path);
            }
        }
        let mut lru = Lru::default();
        for (i, s) in manifest.shards.iter().enumerate() {
            if std::fs::metadata(dir.join(&s.file)).is_ok_and(|m| m.len() == s.bytes) {
                lru.touch(i, s.bytes);
            }
        }
        let hedge = if cache.hedge {
            Hedge::default()
        } else {
            Hedge::Off
        };
        Ok(RemoteShards {
            store,
            url: url.to_string(),
            dir: dir.to_path_buf(),
            files: manifest.shards.iter().map(|s| s.file.clone()).collect(),
            total: manifest.bytes,
            max_bytes: cache.max_bytes,
            read: RangedRead {
                hedge,
                ..RangedRead::default()
            },
            window: LatencyWindow::default(),
            lru: Mutex::new(lru),
            stats: Mutex::default(),
            next_part: AtomicU64::new(0),
        })
    }

    fn lru(&self) -> std::sync::MutexGuard<'_, Lru> {
        self.lru.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Downloads `file` (`bytes` long) into the cache through a file of this call's own,
    /// renamed into place once complete.
    fn download(&self, file: &str, bytes: u64) -> Result<()> {
        let n = self.next_part.fetch_add(1, Ordering::Relaxed);
        let part = self
            .dir
            .join(format!("{file}{PART}{}-{n}", std::process::id()));
        let began = Instant::now();
        let got = File::create(&part)
            .map_err(io_err(&part))
            .and_then(|f| {
                self.store
                    .read_ranged(file, bytes, (&f, &part), &self.read, &self.window)
                    .map_err(remote_err(&self.url))
            })
            .and_then(|got| {
                let path = self.dir.join(file);
                std::fs::rename(&part, &path).map_err(io_err(&path))?;
                Ok(got)
            });
        let got = match got {
            Ok(got) => got,
            Err(e) => {
                let _ = std::fs::remove_file(&part);
                return Err(e);
            }
        };
        let mut stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        let (s, latencies) = &mut *stats;
        s.shards += 1;
        s.bytes += got.bytes;
        s.requests += got.requests;
        s.hedged.0 += got.hedged;
        s.hedged.1 += got.hedges_won;
        s.seconds += began.elapsed().as_secs_f64();
        for d in got.latencies {
            if latencies.len() == KEPT_LATENCIES {
                latencies.pop_front();
            }
            latencies.push_back(d);
        }
        Ok(())
    }
}

impl ShardFetch for RemoteShards {
    fn fetch(&self, i: usize, file: &str, bytes: u64) -> Result<bool> {
        let path = self.dir.join(file);
        let cached = std::fs::metadata(&path).is_ok_and(|m| m.len() == bytes);
        if !cached {
            self.download(file, bytes)?;
        }
        self.lru().touch(i, bytes);
        Ok(!cached)
    }

    fn present(&self, i: usize) -> bool {
        self.dir.join(&self.files[i]).exists()
    }

    fn over_budget(&self, keep: usize) -> Vec<usize> {
        let lru = self.lru();
        let mut bytes = lru.bytes;
        let mut out = vec![];
        for &(j, b) in &lru.order {
            if bytes <= self.max_bytes {
                break;
            }
            if j != keep {
                out.push(j);
                bytes -= b;
            }
        }
        out
    }

    fn evict(&self, i: usize) {
        // A file already gone (another process let it go) is no error.
        let _ = std::fs::remove_file(self.dir.join(&self.files[i]));
        self.lru().remove(i);
        self.stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .evicted += 1;
    }

    fn holds_all(&self) -> bool {
        self.total <= self.max_bytes
    }

    fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    fn stats(&self) -> FetchStats {
        let stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<Duration> = stats.1.iter().copied().collect();
        v.sort_unstable();
        FetchStats {
            latency: [0.5, 0.99, 1.0].map(|q| objstore::quantile(&v, q)),
            ..stats.0.clone()
        }
    }
}

/// Uploads the dataset in `dir` to `url`: every shard file, then `manifest.json` last, so a
/// reader of the URL sees a manifest only once every shard it names is in place (as a local
/// dataset's manifest is written last). Returns the bytes uploaded.
///
/// # Errors
/// The manifest's errors ([`Manifest::read`]); [`DataError::Remote`] naming the URL and the
/// object when a put fails.
pub fn upload(dir: &Path, url: &str, replace: bool) -> Result<u64> {
    let manifest = Manifest::read(dir)?;
    let store = RemoteStore::open(url, &RemoteOptions::default()).map_err(remote_err(url))?;
    let held = store.object_size(MANIFEST_FILE).map_err(remote_err(url))?;
    if held.is_some() && !replace {
        return Err(DataError::DatasetExists { dir: url.into() });
    }
    for s in &manifest.shards {
        store
            .upload_file(&s.file, &dir.join(&s.file), false)
            .map_err(remote_err(url))?;
    }
    let path = dir.join(MANIFEST_FILE);
    store
        .upload_file(MANIFEST_FILE, &path, false)
        .map_err(remote_err(url))?;
    Ok(manifest.bytes + std::fs::metadata(&path).map_err(io_err(&path))?.len())
}
