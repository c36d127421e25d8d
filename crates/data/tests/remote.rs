//! Datasets in object storage (feature `s3`), against a real local S3-compatible server (moto,
//! started by each test; `FLOTILLA_S3_SERVER` or `moto_server` on PATH, else the test fails
//! with instructions) and a `file://` remote: the same batches as from the local directory,
//! with a cache too small for the dataset (shards let go and fetched again), a corrupted
//! remote shard named, and a shard let go by another process fetched again.
#![cfg(feature = "s3")]

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::write_dataset;
use data::cache::{self, CacheConfig};
use data::{Dataset, Loader, LoaderConfig};
use objstore::test_server::{BUCKET, S3Server};

/// Sets the process's `AWS_*` variables to reach `server` (the library reads them as the
/// binary does). Every test of this file sets the same names, each to its own server, so the
/// tests run one at a time under a lock.
fn reach(server: &S3Server) -> std::sync::MutexGuard<'static, ()> {
    static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = ENV.lock().unwrap_or_else(|p| p.into_inner());
    for (k, v) in server.env() {
        // SAFETY: the tests that read or write these variables hold `ENV`; no other thread
        // of this test binary touches the environment.
        unsafe { std::env::set_var(k, v) };
    }
    guard
}

/// Four shards of 3 documents each, ~24 KiB per shard.
fn local(dir: &Path) -> Arc<Dataset> {
    let docs: Vec<Vec<u64>> = (0..4).map(|s| vec![4000 + s * 17, 3000, 5000]).collect();
    write_dataset(dir, &docs)
}

/// The first `steps` batches' token rows of `ds` (2 workers, window 64, 8 rows of 32).
fn rows(ds: Arc<Dataset>, steps: usize) -> Vec<Vec<u32>> {
    let mut c = LoaderConfig::new(32, 8, 7);
    c.workers = 2;
    c.shuffle_window = 64;
    c.timeout = Duration::from_secs(60);
    let mut l = Loader::new(vec![ds], &c, None).unwrap();
    (0..steps)
        .flat_map(|_| {
            let b = l.next().unwrap();
            (0..b.rows()).map(|i| b.row(i)).collect::<Vec<_>>()
        })
        .collect()
}

fn cache_in(dir: &Path, max_bytes: u64) -> CacheConfig {
    CacheConfig {
        dir: Some(dir.to_path_buf()),
        max_bytes,
        hedge: true,
    }
}

/// Batches read: an epoch of the test dataset (about 187 batches).
const STEPS: usize = 200;

/// Uploads, then reads the dataset back through caches large and small: every batch equals
/// the local directory's, and the small cache lets shards go and fetches them again.
fn same_batches_as_local(url: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let ds = local(&tmp.path().join("local"));
    let want = rows(ds.clone(), STEPS);
    let uploaded = cache::upload(ds.dir(), url, false).unwrap();
    assert!(uploaded > ds.manifest().bytes, "{uploaded}");

    let big = cache_in(&tmp.path().join("cache"), 1 << 30);
    let remote = Arc::new(cache::open(Path::new(url), &big).unwrap());
    assert_eq!(remote.manifest(), ds.manifest());
    assert_eq!(rows(remote.clone(), STEPS), want);
    for i in 0..remote.num_shards() {
        remote.shard(i).unwrap();
    }
    let s = remote.fetch_stats().unwrap();
    assert_eq!((s.shards, s.bytes, s.evicted), (4, ds.manifest().bytes, 0));
    assert!(s.requests >= 4 && s.latency[1] >= s.latency[0], "{s:?}");

    // Opened again: every shard is in the cache, nothing is downloaded.
    let again = Arc::new(cache::open(Path::new(url), &big).unwrap());
    assert_eq!(rows(again.clone(), STEPS), want);
    assert_eq!(again.fetch_stats().unwrap().shards, 0);

    // A budget of one shard: shards are let go and fetched again, the batches do not change.
    let one = ds.manifest().shards[0].bytes;
    let small = cache_in(&tmp.path().join("small"), one);
    let tight = Arc::new(cache::open(Path::new(url), &small).unwrap());
    assert_eq!(rows(tight.clone(), STEPS), want);
    // A second loader over the same dataset: the first one's shards are let go with it, so
    // the ones the cache let go are fetched again.
    assert_eq!(rows(tight.clone(), STEPS), want);
    let s = tight.fetch_stats().unwrap();
    assert!(s.evicted > 0 && s.shards > 4, "{s:?}");
    let on_disk: u64 = std::fs::read_dir(tight.dir())
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".fts"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(
        on_disk <= 2 * one,
        "{on_disk} bytes of shards cached, budget {one}"
    );
}

#[test]
fn s3_dataset_gives_the_local_batches_through_large_and_small_caches() {
    let server = S3Server::start();
    let _env = reach(&server);
    same_batches_as_local(&format!("s3://{BUCKET}/corpus/v1"));
}

#[test]
fn file_remote_gives_the_local_batches() {
    let remote = tempfile::tempdir().unwrap();
    same_batches_as_local(&format!("file://{}", remote.path().join("r").display()));
}

#[test]
fn a_corrupt_remote_shard_is_named_and_a_changed_snapshot_empties_the_cache() {
    let server = S3Server::start();
    let _env = reach(&server);
    let tmp = tempfile::tempdir().unwrap();
    let ds = local(&tmp.path().join("local"));
    let url = format!("s3://{BUCKET}/bad");
    cache::upload(ds.dir(), &url, false).unwrap();
    // Shard 1 replaced remotely by bytes of the same length, one flipped.
    let store = objstore::RemoteStore::open(&url, &objstore::RemoteOptions::default()).unwrap();
    let name = &ds.manifest().shards[1].file;
    let mut bytes = std::fs::read(ds.dir().join(name)).unwrap();
    bytes[100] ^= 0xff;
    store.put_object(name, bytes).unwrap();
    let c = cache_in(&tmp.path().join("cache"), 1 << 30);
    let remote = cache::open(Path::new(&url), &c).unwrap();
    remote.shard(0).unwrap();
    let err = remote.shard(1).err().unwrap().to_string();
    assert!(err.contains(name.as_str()), "{err}");

    // A new snapshot under the same URL: the old shard files are removed from the cache.
    let other = local(&tmp.path().join("other"));
    drop(other);
    let docs: Vec<Vec<u64>> = vec![vec![100, 200]];
    let fresh = write_dataset(&tmp.path().join("fresh"), &docs);
    assert!(cache::upload(fresh.dir(), &url, false).is_err());
    cache::upload(fresh.dir(), &url, true).unwrap();
    let reopened = cache::open(Path::new(&url), &c).unwrap();
    assert_eq!(reopened.manifest(), fresh.manifest());
    let left: Vec<String> = std::fs::read_dir(reopened.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["manifest.json".to_string()]);
}

#[test]
fn a_shard_let_go_by_another_process_is_fetched_again_and_no_url_needs_a_server_to_be_refused() {
    let remote = tempfile::tempdir().unwrap();
    let url = format!("file://{}", remote.path().join("r").display());
    let tmp = tempfile::tempdir().unwrap();
    let ds = local(&tmp.path().join("local"));
    cache::upload(ds.dir(), &url, false).unwrap();
    let c = cache_in(&tmp.path().join("cache"), 1 << 30);
    let a = cache::open(Path::new(&url), &c).unwrap();
    let b = cache::open(Path::new(&url), &c).unwrap();
    let first = a.shard(2).unwrap();
    drop(first);
    // "Another process" (b, same cache directory) has the file; a's copy goes away.
    std::fs::remove_file(a.shard_path(2)).unwrap();
    let again = b.shard(2).unwrap();
    assert_eq!(again.info().tokens, ds.manifest().shards[2].tokens);
    assert_eq!(b.fetch_stats().unwrap().shards, 1);

    for bad in ["s3://", "file://relative"] {
        let err = cache::open(Path::new(bad), &c).err().unwrap().to_string();
        assert!(err.contains(bad), "{bad}: {err}");
    }
}
