//! Datasets in object storage, read through a bounded local cache (the seeds' storage tiers:
//! 000 storage chapter, 004 28.4: object store, local NVMe cache, read-ahead, hedged requests).
//!
//! A dataset is named by a directory or by a URL: `s3://bucket/prefix` (any S3-compatible
//! server; credentials and endpoint from the usual `AWS_*` variables) or `file:///dir` (another
//! directory reached through the same object-store code). A URL's shards are downloaded into
//! the cache directory when first needed, with ranged GETs several in flight and hedged
//! (`flotilla-objstore`), verified like local shards (every byte hashed before its first token
//! is used, and again after any new download), and let go least recently used first once the
//! cache holds more than its budget. The loader's verify-ahead thread walks the sample order
//! ahead of the readers, so the next shards are fetched while the current ones are read: that
//! is the read-ahead. Same bytes, same order: a run from a URL is bit-identical to the same run
//! from a local copy.
//!
//! Remote datasets need the `s3` feature; without it a URL is refused with
//! [`crate::DataError::FeatureDisabled`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::dataset::Dataset;
use crate::error::Result;
use crate::manifest::Manifest;

/// Where and how much a remote dataset may keep locally.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheConfig {
    /// Cache directory (each dataset URL gets its own subdirectory); `None`: the system's
    /// temporary directory's `flotilla-data-cache`.
    pub dir: Option<PathBuf>,
    /// Most bytes of shard files kept in a dataset's cache directory (at least one shard is
    /// always kept). A shard let go while a reader still maps it frees its disk blocks when
    /// the reader lets go.
    pub max_bytes: u64,
    /// Hedge slow ranged reads (a second copy after the recent latencies' 95th percentile).
    pub hedge: bool,
}

impl Default for CacheConfig {
    /// The temporary directory, 16 GiB, hedged.
    fn default() -> Self {
        CacheConfig {
            dir: None,
            max_bytes: 16 << 30,
            hedge: true,
        }
    }
}

impl CacheConfig {
    /// The cache directory of dataset `url`: `<dir>/<url with / and : replaced>`.
    pub fn dir_for(&self, url: &str) -> PathBuf {
        let base = self
            .dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("flotilla-data-cache"));
        let name: String = url
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        base.join(name)
    }
}

/// Whether `path` names a dataset in object storage (`s3://` or `file://`).
pub fn is_remote(path: &Path) -> bool {
    path.to_str()
        .is_some_and(|s| s.starts_with("s3://") || s.starts_with("file://"))
}

/// What a remote dataset's fetches did so far.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FetchStats {
    /// Shard files downloaded (a shard let go and needed again counts twice).
    pub shards: u64,
    /// Bytes downloaded.
    pub bytes: u64,
    /// Ranged GETs made (hedges not counted).
    pub requests: u64,
    /// Requests hedged, and how many of those the second copy answered first.
    pub hedged: (u64, u64),
    /// Request latency quantiles as the reader saw them: P50, P99, maximum.
    pub latency: [Duration; 3],
    /// Time spent downloading (summed over the threads that fetched).
    pub seconds: f64,
    /// Shard files let go to stay within the budget.
    pub evicted: u64,
}

impl FetchStats {
    /// One line for a person: shards, bytes, rate, requests, hedges, latency quantiles.
    pub fn line(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        format!(
            "fetched {} shards, {:.1} MB in {:.2} s ({:.1} MB/s per fetching thread), {} ranged GETs, \
             {} hedged ({} won by the hedge), latency P50 {:.1} ms P99 {:.1} ms max {:.1} ms, {} let go",
            self.shards,
            self.bytes as f64 / 1e6,
            self.seconds,
            self.bytes as f64 / 1e6 / self.seconds.max(1e-9),
            self.requests,
            self.hedged.0,
            self.hedged.1,
            ms(self.latency[0]),
            ms(self.latency[1]),
            ms(self.latency[2]),
            self.evicted
        )
    }

    /// The same figures as JSON (latencies in milliseconds).
    pub fn to_json(&self) -> serde_json::Value {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        serde_json::json!({
            "shards": self.shards, "bytes": self.bytes, "seconds": self.seconds,
            "requests": self.requests, "hedged": self.hedged.0, "hedges_won": self.hedged.1,
            "latency_p50_ms": ms(self.latency[0]), "latency_p99_ms": ms(self.latency[1]),
            "latency_max_ms": ms(self.latency[2]), "evicted": self.evicted,
        })
    }
}

/// Brings every shard of a remote dataset into its cache (each hashed once downloaded), so a
/// measurement or a run starts warm; the fetches it made (`None` for a local directory).
///
/// # Errors
/// The first shard that cannot be fetched or verified.
pub fn warm(dataset: &Dataset) -> Result<Option<FetchStats>> {
    if dataset.fetch_stats().is_none() {
        return Ok(None);
    }
    for i in 0..dataset.num_shards() {
        dataset.shard(i)?;
    }
    Ok(dataset.fetch_stats())
}

/// A source that brings shard files into the dataset's directory before they are mapped.
pub(crate) trait ShardFetch: Send + Sync {
    /// Makes shard `i` (`file`, `bytes` long) present in the directory; `true` when it was
    /// downloaded just now (its bytes are new to this process and must be hashed again).
    fn fetch(&self, i: usize, file: &str, bytes: u64) -> Result<bool>;
    /// Whether shard `i`'s file is in the directory now.
    fn present(&self, i: usize) -> bool;
    /// Shards to let go, least recently used first, to bring the cache within its budget
    /// (never `keep`).
    fn over_budget(&self, keep: usize) -> Vec<usize>;
    /// Removes shard `i`'s file from the cache.
    fn evict(&self, i: usize);
    /// Whether the budget holds every shard (nothing is ever let go).
    fn holds_all(&self) -> bool;
    /// The cache's budget in bytes (also what the dataset keeps mapped after use, so a
    /// shard let go from the cache does not stay on disk through its mapping).
    fn max_bytes(&self) -> u64;
    /// The fetches so far.
    fn stats(&self) -> FetchStats;
}

/// Opens the dataset at `path`: a directory, or a URL read through `cache`.
///
/// # Errors
/// As [`Dataset::open`]; for a URL, [`crate::DataError::Remote`] naming it when the store fails and
/// [`crate::DataError::FeatureDisabled`] in a build without the `s3` feature.
pub fn open(path: &Path, cache: &CacheConfig) -> Result<Dataset> {
    if !is_remote(path) {
        return Dataset::open(path);
    }
    remote_open(&path.to_string_lossy(), cache)
}

/// Reads the manifest of the dataset at `path` (a directory, or a URL through `cache`).
///
/// # Errors
/// As [`open`].
pub fn read_manifest(path: &Path, cache: &CacheConfig) -> Result<Manifest> {
    if !is_remote(path) {
        return Manifest::read(path);
    }
    #[cfg(feature = "s3")]
    return crate::remote::read_manifest(&path.to_string_lossy(), cache);
    #[cfg(not(feature = "s3"))]
    Ok(remote_open(&path.to_string_lossy(), cache)?
        .manifest()
        .clone())
}

#[cfg(feature = "s3")]
fn remote_open(url: &str, cache: &CacheConfig) -> Result<Dataset> {
    crate::remote::open(url, cache)
}

#[cfg(not(feature = "s3"))]
fn remote_open(url: &str, _cache: &CacheConfig) -> Result<Dataset> {
    Err(crate::DataError::FeatureDisabled {
        what: format!("the dataset {url}"),
        feature: "s3",
    })
}

/// Uploads the dataset in directory `dir` to `url`, shards first and the manifest last (a
/// reader of the URL never sees a manifest whose shards are not all there); returns the bytes
/// uploaded (what `flotilla data prepare -o s3://...` does after preparing locally). A URL
/// that already holds a manifest is refused unless `replace`.
///
/// # Errors
/// The manifest's errors; [`crate::DataError::DatasetExists`] for a URL that holds a dataset;
/// [`crate::DataError::Remote`] naming the object whose put failed;
/// [`crate::DataError::FeatureDisabled`] in a build without the `s3` feature.
pub fn upload(dir: &Path, url: &str, replace: bool) -> Result<u64> {
    #[cfg(feature = "s3")]
    return crate::remote::upload(dir, url, replace);
    #[cfg(not(feature = "s3"))]
    {
        let _ = (dir, replace);
        Err(crate::DataError::FeatureDisabled {
            what: format!("uploading to {url}"),
            feature: "s3",
        })
    }
}
