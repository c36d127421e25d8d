//! Damaged and forged remote objects: a flipped byte in a piece file or a manifest, and
//! manifests naming files outside the cache, are rejected and never reach the cache.
use std::path::Path;

use ckpt::manifest::{COMMIT_FILE, MANIFEST_FILE};
use ckpt::remote::{RemoteStore, fetch_latest, fetch_step, list_remote_committed, upload_step};
use ckpt::{Checkpoint, CommitMarker, Verify, checksum_hex, list_committed, step_dir_name};

use super::remotes::Remote;
use super::{assert_content, save, step_files};

on_both!(corrupt_remote_objects, hostile_remote_manifest);

/// Flips one byte of the object `file` of `step`, inside its first piece when it is a piece file.
fn flip_remote_byte(store: &RemoteStore, local: &Path, step: u64, file: &str) {
    let ckpt = Checkpoint::open(local, step, Verify::ManifestOnly).unwrap();
    let at = ckpt
        .manifest()
        .pieces
        .iter()
        .find(|p| p.file == file)
        .map_or(10, |p| p.offset + p.bytes / 2);
    let key = format!("{}/{file}", step_dir_name(step));
    let mut bytes = store.get_object(&key, 64 << 20).unwrap();
    bytes[at as usize] ^= 0x40;
    store.put_object(&key, bytes).unwrap();
}

fn corrupt_remote_objects(remote: &Remote) {
    let local = tempfile::tempdir().unwrap();
    for step in [1, 2, 3] {
        save(local.path(), step, step, false);
    }
    let store = remote.store("corrupt");
    for step in [1, 2, 3] {
        upload_step(&store, local.path(), step).unwrap();
    }
    let piece_file = step_files(local.path(), 3)[0].clone();
    flip_remote_byte(&store, local.path(), 3, &piece_file);
    flip_remote_byte(&store, local.path(), 2, MANIFEST_FILE);

    let cache = tempfile::tempdir().unwrap();
    let fetched = fetch_latest(&store, cache.path()).unwrap();
    assert_eq!(fetched.checkpoint.step(), 1);
    assert_content(&fetched.checkpoint, 1);
    let rejected: Vec<(u64, String)> = fetched
        .rejected
        .iter()
        .map(|r| (r.step, r.error.to_string()))
        .collect();
    assert_eq!(rejected.len(), 2, "{rejected:?}");
    assert_eq!(rejected[0].0, 3);
    assert!(
        rejected[0].1.contains(&piece_file) && rejected[0].1.contains("checksum"),
        "{rejected:?}"
    );
    assert_eq!(rejected[1].0, 2);
    assert!(
        rejected[1].1.contains(MANIFEST_FILE) && rejected[1].1.contains("checksum"),
        "{rejected:?}"
    );
    // Nothing that failed verification became visible in the cache.
    assert_eq!(list_committed(cache.path()).unwrap(), vec![1]);
}

/// Publishes a remote step `step` whose manifest is `manifest` (with a matching marker).
fn put_forged_step(store: &RemoteStore, step: u64, manifest: &serde_json::Value) {
    let bytes = serde_json::to_vec(manifest).unwrap();
    let marker = CommitMarker {
        format: ckpt::manifest::FORMAT.into(),
        step,
        manifest_bytes: bytes.len() as u64,
        manifest_xxh3_128: checksum_hex(&bytes),
    };
    let dir = step_dir_name(step);
    store
        .put_object(&format!("{dir}/{MANIFEST_FILE}"), bytes)
        .unwrap();
    store
        .put_object(
            &format!("{dir}/{COMMIT_FILE}"),
            serde_json::to_vec(&marker).unwrap(),
        )
        .unwrap();
}

fn hostile_remote_manifest(remote: &Remote) {
    let local = tempfile::tempdir().unwrap();
    save(local.path(), 1, 1, false);
    let store = remote.store("hostile");
    upload_step(&store, local.path(), 1).unwrap();
    let manifest_key = format!("{}/{MANIFEST_FILE}", step_dir_name(1));
    let original: serde_json::Value =
        serde_json::from_slice(&store.get_object(&manifest_key, 1 << 20).unwrap()).unwrap();
    // Step 2 names its first piece file `../x`, step 3 an absolute path; both keep the bytes
    // reachable under those names where an object key can say so.
    for (step, name) in [(2u64, "../x"), (3, "/tmp/flotilla-hostile-x")] {
        let mut forged = original.clone();
        forged["step"] = step.into();
        let first = forged["pieces"][0]["file"].as_str().unwrap().to_string();
        for piece in forged["pieces"].as_array_mut().unwrap() {
            if piece["file"] == first.as_str() {
                piece["file"] = name.into();
            }
        }
        let data = store
            .get_object(&format!("{}/{first}", step_dir_name(1)), 1 << 30)
            .unwrap();
        store
            .put_object(&format!("{}/x", step_dir_name(step)), data.clone())
            .unwrap();
        store.put_object("x", data).unwrap();
        put_forged_step(&store, step, &forged);
    }
    assert_eq!(list_remote_committed(&store).unwrap(), vec![1, 2, 3]);

    let parent = tempfile::tempdir().unwrap();
    let cache = parent.path().join("cache");
    for step in [2, 3] {
        let err = fetch_step(&store, step, &cache).unwrap_err();
        assert!(err.to_string().contains("unsafe file name"), "{err}");
    }
    let fetched = fetch_latest(&store, &cache).unwrap();
    assert_eq!(fetched.checkpoint.step(), 1);
    let steps: Vec<u64> = fetched.rejected.iter().map(|r| r.step).collect();
    assert_eq!(steps, vec![3, 2]);
    // Nothing was written outside the cache, and no forged step became visible in it.
    let outside: Vec<_> = std::fs::read_dir(parent.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(outside, vec![std::ffi::OsString::from("cache")]);
    assert!(!Path::new("/tmp/flotilla-hostile-x").exists());
    assert_eq!(list_committed(&cache).unwrap(), vec![1]);
}
