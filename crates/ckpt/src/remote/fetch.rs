//! Listing remote committed steps and fetching one into a local cache directory, verified by the
//! ordinary local reader before it becomes visible there.
//!
//! A fetch of step `N` into `cache`:
//!
//! 1. reads the remote `COMMIT` (at most [`MAX_MARKER_BYTES`]) and checks format and step;
//! 2. downloads the manifest only if its size is the marker's, checks its xxh3-128 against the
//!    marker, parses and validates it; every file name passes [`check_file_name`], so a hostile
//!    manifest cannot direct a write outside the cache;
//! 3. checks each piece file's remote size against the manifest's byte ranges *before*
//!    downloading it, then streams it into `cache/step-N.tmp/step-N/`;
//! 4. writes manifest and marker there and opens that copy with [`Verify::AllPieces`], so
//!    every checksum is checked;
//! 5. removes the marker from the copy, renames the copy to `cache/step-N` and writes `COMMIT`
//!    there last (tmp file, fsync, rename, dir fsync).
//!
//! A failure anywhere leaves `cache/step-N` uncommitted, so local readers of the cache never
//! see a version that did not verify. One fetcher per cache directory at a time.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::Path;

use super::{RemoteError, RemoteStore, Result, StoreError, object_key, parse_step_name};
use crate::error::io_err;
use crate::fsio::{checksum_hex, fsync_dir, is_real_dir, write_atomic};
use crate::manifest::{
    COMMIT_FILE, CommitMarker, MANIFEST_FILE, MAX_MARKER_BYTES, Manifest, check_file_name,
};
use crate::reader::{Checkpoint, Verify, step_dir_name};
use crate::writer::tmp_dir_name;

/// Bytes a remote piece file may have past the end of its last piece (the local writer leaves
/// none; a little slack keeps room for a trailer without allowing unbounded downloads).
const MAX_TRAILING_BYTES: u64 = 1 << 20;

/// A remote committed step that could not be fetched.
#[derive(Debug)]
pub struct RemoteRejected {
    /// The step.
    pub step: u64,
    /// Why (names the object and what disagreed).
    pub error: RemoteError,
}

/// The result of [`fetch_latest`]: the fetched, verified checkpoint (opened from the cache) and
/// every newer remote committed step that was rejected, newest first.
#[derive(Debug)]
pub struct Fetched {
    /// The newest step that fetched and verified, opened from the cache.
    pub checkpoint: Checkpoint,
    /// Newer remote committed steps that failed, newest first.
    pub rejected: Vec<RemoteRejected>,
}

/// Reads and checks the remote marker of `step`; returns it with its exact bytes.
fn remote_marker(store: &RemoteStore, step: u64) -> Result<MarkerAndBytes> {
    let key = object_key(step, COMMIT_FILE);
    let bytes = store.get_object(&key, MAX_MARKER_BYTES)?;
    let bad = |reason: String| RemoteError::Corrupt {
        step,
        key: key.clone(),
        reason,
    };
    let marker = CommitMarker::parse(&bytes, step).map_err(|e| bad(format!("marker {e}")))?;
    Ok((marker, bytes))
}

/// A checked commit marker with its exact bytes.
type MarkerAndBytes = (CommitMarker, Vec<u8>);

/// Every remote step that has a `COMMIT` object, ascending, with the checked marker or the
/// reason it is unusable.
fn scan(store: &RemoteStore) -> Result<Vec<(u64, Result<MarkerAndBytes>)>> {
    let mut steps: Vec<u64> = store
        .list_dirs()?
        .iter()
        .filter_map(|d| parse_step_name(d))
        .collect();
    steps.sort_unstable();
    let mut found = Vec::new();
    for step in steps {
        if store.object_size(&object_key(step, COMMIT_FILE))?.is_some() {
            found.push((step, remote_marker(store, step)));
        }
    }
    Ok(found)
}

/// Every remote step with a `COMMIT` object, ascending, with its parsed marker or why the marker
/// is unusable (wrong step, unparsable, oversized, unreadable).
pub fn list_remote_markers(store: &RemoteStore) -> Result<Vec<(u64, Result<CommitMarker>)>> {
    Ok(scan(store)?
        .into_iter()
        .map(|(step, m)| (step, m.map(|(marker, _)| marker)))
        .collect())
}

/// Remote steps whose `COMMIT` object parses and records the step, ascending.
pub fn list_remote_committed(store: &RemoteStore) -> Result<Vec<u64>> {
    Ok(scan(store)?
        .into_iter()
        .filter_map(|(step, m)| m.ok().map(|_| step))
        .collect())
}

/// Fetches remote committed `step` into `cache` (see the module doc) and opens it from there.
///
/// If `cache` already holds this exact version (same `COMMIT` bytes) and it verifies, nothing is
/// downloaded.
pub fn fetch_step(store: &RemoteStore, step: u64, cache: &Path) -> Result<Checkpoint> {
    let (marker, marker_bytes) = remote_marker(store, step)?;
    fetch_with_marker(store, step, &marker, &marker_bytes, cache)
}

/// Fetches the newest remote committed step that downloads and verifies, falling back step by
/// step and reporting each newer step it rejected.
pub fn fetch_latest(store: &RemoteStore, cache: &Path) -> Result<Fetched> {
    let mut rejected = Vec::new();
    for (step, marker) in scan(store)?.into_iter().rev() {
        let fetched =
            marker.and_then(|(m, bytes)| fetch_with_marker(store, step, &m, &bytes, cache));
        match fetched {
            Ok(checkpoint) => {
                return Ok(Fetched {
                    checkpoint,
                    rejected,
                });
            }
            Err(error) => rejected.push(RemoteRejected { step, error }),
        }
    }
    Err(RemoteError::NoRemoteCommittedStep {
        url: store.url().to_string(),
        rejected: rejected
            .into_iter()
            .map(|r| (r.step, r.error.to_string()))
            .collect(),
    })
}

/// Removes `path` whatever it is (a real directory recursively, anything else as a file), after
/// first removing a `COMMIT` inside it so that no half-removed directory reads as committed.
fn remove_any(path: &Path) -> Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if meta.is_dir() {
        let marker = path.join(COMMIT_FILE);
        if std::fs::symlink_metadata(&marker).is_ok() {
            std::fs::remove_file(&marker).map_err(io_err("remove", &marker))?;
            fsync_dir(path)?;
        }
        std::fs::remove_dir_all(path).map_err(io_err("remove dir", path))?;
    } else {
        std::fs::remove_file(path).map_err(io_err("remove", path))?;
    }
    Ok(())
}

/// The cached copy of `step`, if it is this exact version and verifies.
fn cached(cache: &Path, step: u64, marker_bytes: &[u8]) -> Option<Checkpoint> {
    let dir = cache.join(step_dir_name(step));
    let local = crate::fsio::read_capped(&dir.join(COMMIT_FILE), MAX_MARKER_BYTES).ok()?;
    if local != marker_bytes {
        return None;
    }
    Checkpoint::open(cache, step, Verify::AllPieces).ok()
}

/// Downloads the manifest of `step`, checked against the marker, parsed and validated.
fn remote_manifest(
    store: &RemoteStore,
    step: u64,
    marker: &CommitMarker,
    name_in_errors: &Path,
) -> Result<(Manifest, Vec<u8>)> {
    let key = object_key(step, MANIFEST_FILE);
    let size = store
        .object_size(&key)?
        .ok_or_else(|| RemoteError::from(StoreError::Missing { key: key.clone() }))?;
    if size != marker.manifest_bytes {
        return Err(StoreError::ObjectSize {
            key,
            size,
            expected: format!("{} (from the commit marker)", marker.manifest_bytes),
        }
        .into());
    }
    let bytes = store.get_object(&key, marker.manifest_bytes)?;
    let actual = checksum_hex(&bytes);
    if actual != marker.manifest_xxh3_128 {
        return Err(RemoteError::Corrupt {
            step,
            key,
            reason: format!(
                "checksum mismatch: marker says {}, object hashes to {actual}",
                marker.manifest_xxh3_128
            ),
        });
    }
    let manifest: Manifest = serde_json::from_slice(&bytes).map_err(|e| RemoteError::Corrupt {
        step,
        key: key.clone(),
        reason: format!("unparsable manifest: {e}"),
    })?;
    if manifest.step != step {
        let reason = format!("manifest records step {}", manifest.step);
        return Err(RemoteError::Corrupt { step, key, reason });
    }
    manifest.validate(name_in_errors)?;
    Ok((manifest, bytes))
}

/// Writes `bytes` to a new file at `path` and fsyncs it.
fn write_new(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create_new(path).map_err(io_err("create", path))?;
    f.write_all(bytes).map_err(io_err("write", path))?;
    f.sync_all().map_err(io_err("fsync", path))?;
    Ok(())
}

/// Downloads every piece file, manifest and marker of `step` into `inner` (a fresh directory).
fn download_step(
    store: &RemoteStore,
    step: u64,
    manifest: &Manifest,
    manifest_bytes: &[u8],
    marker_bytes: &[u8],
    inner: &Path,
) -> Result<()> {
    // The extent each file must have: the end of its last piece.
    let mut needed: BTreeMap<&str, u64> = BTreeMap::new();
    for p in &manifest.pieces {
        check_file_name(step, &p.file)?;
        let end = p.offset.saturating_add(p.bytes);
        let e = needed.entry(p.file.as_str()).or_insert(0);
        *e = (*e).max(end);
    }
    for (file, end) in needed {
        let key = object_key(step, file);
        let size = store
            .object_size(&key)?
            .ok_or_else(|| RemoteError::from(StoreError::Missing { key: key.clone() }))?;
        if size < end || size - end > MAX_TRAILING_BYTES {
            return Err(StoreError::ObjectSize {
                key,
                size,
                expected: format!("{end} to {} (from the manifest)", end + MAX_TRAILING_BYTES),
            }
            .into());
        }
        let path = inner.join(file);
        let mut f = File::create_new(&path).map_err(io_err("create", &path))?;
        store.download_to(&key, size, &mut f, &path)?;
        f.sync_all().map_err(io_err("fsync", &path))?;
    }
    write_new(&inner.join(MANIFEST_FILE), manifest_bytes)?;
    write_new(&inner.join(COMMIT_FILE), marker_bytes)?;
    Ok(fsync_dir(inner)?)
}

fn fetch_with_marker(
    store: &RemoteStore,
    step: u64,
    marker: &CommitMarker,
    marker_bytes: &[u8],
    cache: &Path,
) -> Result<Checkpoint> {
    std::fs::create_dir_all(cache).map_err(io_err("create dir", cache))?;
    if let Some(hit) = cached(cache, step, marker_bytes) {
        return Ok(hit);
    }
    let tmp_root = cache.join(tmp_dir_name(step));
    remove_any(&tmp_root)?;
    let inner = tmp_root.join(step_dir_name(step));
    std::fs::create_dir_all(&inner).map_err(io_err("create dir", &inner))?;
    let result = (|| {
        let (manifest, manifest_bytes) =
            remote_manifest(store, step, marker, &inner.join(MANIFEST_FILE))?;
        download_step(
            store,
            step,
            &manifest,
            &manifest_bytes,
            marker_bytes,
            &inner,
        )?;
        // The ordinary reader checks marker, manifest and every piece of the downloaded copy.
        Checkpoint::open(&tmp_root, step, Verify::AllPieces)?;
        publish(cache, step, &tmp_root, &inner, marker_bytes)
    })();
    if result.is_err() {
        // Best effort: the debris is invisible to readers either way.
        let _ = remove_any(&tmp_root);
    }
    result
}

/// Moves the verified copy to `cache/step-N` and writes its marker there last.
fn publish(
    cache: &Path,
    step: u64,
    tmp_root: &Path,
    inner: &Path,
    marker_bytes: &[u8],
) -> Result<Checkpoint> {
    let marker = inner.join(COMMIT_FILE);
    std::fs::remove_file(&marker).map_err(io_err("remove", &marker))?;
    fsync_dir(inner)?;
    let dest = cache.join(step_dir_name(step));
    remove_any(&dest)?;
    std::fs::rename(inner, &dest).map_err(io_err("rename", inner))?;
    fsync_dir(cache)?;
    write_atomic(&dest.join(COMMIT_FILE), marker_bytes, false)?;
    if is_real_dir(tmp_root) {
        std::fs::remove_dir(tmp_root).map_err(io_err("remove dir", tmp_root))?;
    }
    // Every piece was verified above and is verified again whenever it is read.
    Ok(Checkpoint::open(cache, step, Verify::ManifestOnly)?)
}
