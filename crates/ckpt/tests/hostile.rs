//! Hostile manifests (re-sealed with a matching commit marker, so only validation stands in the
//! way) are refused before any piece is read, and nothing outside the checkpoint is followed.

mod common;

use std::path::Path;

use ckpt::{Checkpoint, CkptError, Verify, list_committed, open_latest, step_dir_name};
use common::{fixture, rewrite_manifest, save};
use serde_json::{Value, json};

/// A committed step 1 with the fixture, saved by 4 ranks.
fn committed() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    save(dir.path(), 1, &fixture(), 4, 1);
    dir
}

fn open_err(root: &Path) -> CkptError {
    Checkpoint::open(root, 1, Verify::AllPieces).unwrap_err()
}

/// Applies `edit` to a fresh checkpoint and returns the open error.
fn refused(edit: impl FnOnce(&mut Value)) -> CkptError {
    let dir = committed();
    rewrite_manifest(dir.path(), 1, edit);
    let err = open_err(dir.path());
    // The step is rejected as a whole and the loader reports it.
    let latest = open_latest(dir.path(), Verify::ManifestOnly).unwrap_err();
    assert!(
        matches!(latest, CkptError::NoCommittedStep { ref rejected, .. } if rejected.len() == 1)
    );
    err
}

#[test]
fn resealed_unmodified_manifest_still_loads() {
    let dir = committed();
    rewrite_manifest(dir.path(), 1, |_| {});
    Checkpoint::open(dir.path(), 1, Verify::AllPieces).unwrap();
}

#[test]
fn path_traversal_and_absolute_paths_are_refused() {
    for name in [
        "../secret.bin",
        "/etc/passwd",
        "sub/rank-00000.safetensors",
        "..",
        ".",
        "",
        "a\\b",
        "COMMIT",
    ] {
        let dir = committed();
        // A byte-identical copy outside the step directory: following the path would "work".
        let step = dir.path().join(step_dir_name(1));
        std::fs::copy(
            step.join("rank-00000.safetensors"),
            dir.path().join("secret.bin"),
        )
        .unwrap();
        rewrite_manifest(dir.path(), 1, |m| {
            for p in m["pieces"].as_array_mut().unwrap() {
                if p["file"] == "rank-00000.safetensors" {
                    p["file"] = json!(name);
                }
            }
        });
        let err = open_err(dir.path());
        assert!(
            matches!(err, CkptError::UnsafeFileName { name: ref n, .. } if n == name),
            "{name}: {err}"
        );
    }
}

#[cfg(unix)]
#[test]
fn symlinked_piece_file_is_refused() {
    let dir = committed();
    let step = dir.path().join(step_dir_name(1));
    let outside = dir.path().join("outside.bin");
    std::fs::rename(step.join("rank-00002.safetensors"), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, step.join("rank-00002.safetensors")).unwrap();
    assert!(matches!(open_err(dir.path()), CkptError::Symlink { .. }));
}

#[cfg(unix)]
#[test]
fn symlinked_step_directory_is_not_a_step() {
    let dir = committed();
    std::os::unix::fs::symlink(dir.path().join(step_dir_name(1)), dir.path().join("step-9"))
        .unwrap();
    assert_eq!(list_committed(dir.path()).unwrap(), vec![1]);
    assert!(Checkpoint::open(dir.path(), 9, Verify::ManifestOnly).is_err());
    assert_eq!(
        open_latest(dir.path(), Verify::ManifestOnly)
            .unwrap()
            .checkpoint
            .step(),
        1
    );
}

/// Index of the first piece of tensor `name`.
fn first_piece(m: &Value, name: &str) -> usize {
    m["pieces"]
        .as_array()
        .unwrap()
        .iter()
        .position(|p| p["tensor"] == name)
        .unwrap()
}

fn piece_reason(err: &CkptError) -> &str {
    match err {
        CkptError::Piece { reason, .. } => reason,
        other => panic!("expected a piece error, got {other}"),
    }
}

#[test]
fn overlapping_pieces_are_refused() {
    let err = refused(|m| {
        let i = first_piece(m, "b");
        let mut dup = m["pieces"][i].clone();
        // Same slice stored again at the end of its file: byte ranges are fine, coverage is not.
        dup["offset"] = json!(1u64 << 20);
        m["pieces"].as_array_mut().unwrap().push(dup);
    });
    assert!(piece_reason(&err).contains("overlaps"), "{err}");
}

#[test]
fn overlapping_byte_ranges_in_one_file_are_refused() {
    let err = refused(|m| {
        let pieces = m["pieces"].as_array_mut().unwrap();
        let file = pieces[0]["file"].clone();
        let j = (1..pieces.len())
            .find(|&j| pieces[j]["file"] == file)
            .unwrap();
        pieces[j]["offset"] = pieces[0]["offset"].clone();
    });
    assert!(piece_reason(&err).contains("byte range"), "{err}");
}

#[test]
fn out_of_range_and_missing_pieces_are_refused() {
    let err = refused(|m| {
        let i = first_piece(m, "c");
        m["pieces"][i]["slice"][0]["offset"] = json!(5);
    });
    assert!(piece_reason(&err).contains("outside shape"), "{err}");

    let err = refused(|m| {
        let i = first_piece(m, "c");
        m["pieces"].as_array_mut().unwrap().remove(i);
    });
    assert!(piece_reason(&err).contains("cover"), "{err}");

    let err = refused(|m| m["pieces"][0]["tensor"] = json!("ghost"));
    assert!(piece_reason(&err).contains("unlisted"), "{err}");

    let err = refused(|m| m["pieces"][0]["chunks"][0] = json!("../../etc"));
    assert!(piece_reason(&err).contains("hex"), "{err}");
}

#[test]
fn absurd_sizes_are_refused_before_allocation() {
    let err = refused(|m| m["pieces"][0]["bytes"] = json!(1u64 << 60));
    assert!(piece_reason(&err).contains("needs"), "{err}");

    let err = refused(|m| m["pieces"][0]["offset"] = json!(1u64 << 60));
    assert!(matches!(err, CkptError::SizeLimit { .. }), "{err}");

    let err = refused(|m| m["pieces"][0]["offset"] = json!(u64::MAX - 3));
    assert!(matches!(err, CkptError::SizeLimit { .. }), "{err}");

    let err = refused(|m| m["tensors"][0]["shape"] = json!([1u64 << 60]));
    assert!(matches!(err, CkptError::SizeLimit { .. }), "{err}");

    let err = refused(|m| m["tensors"][1]["shape"] = json!([1u64 << 62, 1u64 << 62]));
    assert!(matches!(err, CkptError::SizeLimit { .. }), "{err}");

    let err = refused(|m| m["tensors"][0]["shape"] = json!(vec![1; 17]));
    assert!(piece_reason(&err).contains("dimensions"), "{err}");
}

#[test]
fn duplicate_tensor_and_bad_header_are_refused() {
    let err = refused(|m| {
        let t = m["tensors"][0].clone();
        m["tensors"].as_array_mut().unwrap().push(t);
    });
    assert!(err.to_string().contains("listed twice"), "{err}");
    let err = refused(|m| m["version"] = json!(99));
    assert!(matches!(err, CkptError::Manifest { .. }), "{err}");
    let err = refused(|m| m["step"] = json!(2));
    assert!(matches!(err, CkptError::Manifest { .. }), "{err}");
}

#[test]
fn marker_claiming_huge_manifest_is_refused() {
    let dir = committed();
    let marker = dir.path().join(step_dir_name(1)).join("COMMIT");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&marker).unwrap()).unwrap();
    v["manifest_bytes"] = json!(1u64 << 60);
    std::fs::write(&marker, serde_json::to_vec(&v).unwrap()).unwrap();
    assert!(matches!(open_err(dir.path()), CkptError::Marker { .. }));
    assert!(list_committed(dir.path()).unwrap().is_empty());
}

#[cfg(unix)]
#[test]
fn piece_that_is_a_directory_is_refused() {
    let dir = committed();
    let step = dir.path().join(step_dir_name(1));
    std::fs::remove_file(step.join("rank-00001.safetensors")).unwrap();
    std::fs::create_dir(step.join("rank-00001.safetensors")).unwrap();
    assert!(matches!(open_err(dir.path()), CkptError::NotAFile { .. }));
}
