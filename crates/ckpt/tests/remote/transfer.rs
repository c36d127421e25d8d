//! Uploading and fetching: the round trip, a crash at every point of an upload, and the
//! checks that need no server (bad URLs, an empty remote).
use ckpt::remote::{
    RemoteError, RemoteOptions, RemoteStore, UploadFailPoint, fetch_latest, fetch_step,
    list_remote_committed, upload_step, upload_step_with_fail_point,
};
use ckpt::{Checkpoint, Verify, list_committed, step_dir_name};

use super::remotes::Remote;
use super::{assert_content, save, step_files};

on_both!(round_trip, crash_during_staging);

// ---------------------------------------------------------------------------------------------
// Scenarios.

fn round_trip(remote: &Remote) {
    let local = tempfile::tempdir().unwrap();
    save(local.path(), 10, 10, true);
    save(local.path(), 20, 20, false);
    let store = remote.store("run");
    for step in [10, 20] {
        let report = upload_step(&store, local.path(), step).unwrap();
        assert_eq!(report.objects, step_files(local.path(), step).len());
        assert!(!report.already_durable);
    }
    // Uploading again is a no-op.
    assert!(
        upload_step(&store, local.path(), 20)
            .unwrap()
            .already_durable
    );
    assert_eq!(list_remote_committed(&store).unwrap(), vec![10, 20]);

    let cache = tempfile::tempdir().unwrap();
    let fetched = fetch_latest(&store, cache.path()).unwrap();
    assert!(fetched.rejected.is_empty(), "{:?}", fetched.rejected);
    assert_eq!(fetched.checkpoint.step(), 20);
    assert_content(&fetched.checkpoint, 20);
    let older = fetch_step(&store, 10, cache.path()).unwrap();
    assert_content(&older, 10);
    assert_eq!(list_committed(cache.path()).unwrap(), vec![10, 20]);
    for step in [10, 20] {
        for file in step_files(local.path(), step) {
            let dir = step_dir_name(step);
            let a = std::fs::read(local.path().join(&dir).join(&file)).unwrap();
            let b = std::fs::read(cache.path().join(&dir).join(&file)).unwrap();
            assert!(
                a == b,
                "step {step} file {file} differs after the round trip"
            );
        }
    }
    // A second fetch into the same cache reuses the verified copy.
    assert_content(&fetch_step(&store, 10, cache.path()).unwrap(), 10);
}

fn crash_during_staging(remote: &Remote) {
    let local = tempfile::tempdir().unwrap();
    save(local.path(), 1, 1, false);
    save(local.path(), 2, 2, true);
    let objects = step_files(local.path(), 2).len();
    let points = (0..objects).flat_map(|k| {
        [
            UploadFailPoint::AfterObjects(k),
            UploadFailPoint::MidObject(k),
        ]
    });
    for (i, point) in points.enumerate() {
        let store = remote.store(&format!("crash-{i}"));
        upload_step(&store, local.path(), 1).unwrap();
        let err = upload_step_with_fail_point(&store, local.path(), 2, point).unwrap_err();
        assert!(
            matches!(err, RemoteError::InjectedFailure { point: p, step: 2 } if p == point),
            "{point:?}: {err}"
        );
        // The remote never shows step 2; readers of the remote load step 1.
        assert_eq!(list_remote_committed(&store).unwrap(), vec![1], "{point:?}");
        let cache = tempfile::tempdir().unwrap();
        let fetched = fetch_latest(&store, cache.path()).unwrap();
        assert_eq!(fetched.checkpoint.step(), 1, "{point:?}");
        assert!(
            fetched.rejected.is_empty(),
            "{point:?}: {:?}",
            fetched.rejected
        );
        assert_content(&fetched.checkpoint, 1);
        assert!(fetch_step(&store, 2, cache.path()).is_err(), "{point:?}");
        assert_eq!(list_committed(cache.path()).unwrap(), vec![1], "{point:?}");
        // The local commit is untouched, and a retry over the remote debris succeeds.
        assert_content(
            &Checkpoint::open(local.path(), 2, Verify::AllPieces).unwrap(),
            2,
        );
        upload_step(&store, local.path(), 2).unwrap();
        assert_eq!(
            list_remote_committed(&store).unwrap(),
            vec![1, 2],
            "{point:?}"
        );
        assert_content(&fetch_step(&store, 2, cache.path()).unwrap(), 2);
    }
}

// ---------------------------------------------------------------------------------------------
// Without a server.

#[test]
fn bad_urls_are_refused() {
    for url in [
        "http://bucket/x",
        "s3://",
        "s3:///prefix",
        "file://relative/dir",
    ] {
        let err = RemoteStore::open(url, &RemoteOptions::default()).unwrap_err();
        assert!(
            matches!(err, ckpt::remote::StoreError::Config(_)),
            "{url}: {err}"
        );
    }
    let tiny_parts = RemoteOptions {
        part_size: Some(1 << 20),
        ..RemoteOptions::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    assert!(RemoteStore::open(&url, &tiny_parts).is_err());
}

#[test]
fn empty_remote_has_nothing_to_fetch() {
    let remote = Remote::file();
    let store = remote.store("empty");
    assert!(list_remote_committed(&store).unwrap().is_empty());
    let cache = tempfile::tempdir().unwrap();
    let err = fetch_latest(&store, cache.path()).unwrap_err();
    assert!(
        matches!(err, RemoteError::NoRemoteCommittedStep { .. }),
        "{err}"
    );
}
