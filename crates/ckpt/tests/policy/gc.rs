//! Garbage collection of crash leftovers: what is collected, what is in flight, and what is
//! never touched (damaged commits, symlinks, names outside the patterns).
use std::collections::BTreeSet;

use ckpt::policy::{EntryKind, GcMode, gc, preview_gc, trash_dir_name};
use ckpt::{Verify, list_committed, open_latest, tmp_dir_name};

use super::{leftover, names, save_step, set};

// ---------------------------------------------------------------------------------------------
// Garbage collection
// ---------------------------------------------------------------------------------------------

#[test]
fn gc_collects_old_leftovers_and_keeps_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    save_step(root, 100);
    save_step(root, 200);
    leftover(root, &tmp_dir_name(150), 1000); // abandoned staging
    leftover(root, "step-120", 500); // crash between rename and marker
    leftover(root, &tmp_dir_name(200), 10); // staging of a step that committed anyway
    leftover(root, &tmp_dir_name(300), 2000); // in flight
    leftover(root, "step-250", 30); // in flight, between rename and marker
    // Names outside the patterns, some deceptively close.
    for other in [
        "step-007.tmp",
        "step-150.bak",
        "checkpoints",
        "step-x",
        "step-1.tmp.old",
    ] {
        leftover(root, other, 1);
    }
    std::fs::write(root.join("step-99.tmp.txt"), b"file").unwrap();

    let dry = preview_gc(root, GcMode::default()).unwrap();
    let mut expected_removed = vec![
        (120, EntryKind::NoMarker, 500),
        (150, EntryKind::Staging, 1000),
        (200, EntryKind::Staging, 10),
    ];
    let got: Vec<_> = dry
        .removed
        .iter()
        .map(|r| (r.step, r.kind, r.bytes))
        .collect();
    assert_eq!(got, expected_removed);
    assert_eq!(dry.bytes_freed(), 1510);
    assert_eq!(
        dry.in_flight,
        [root.join("step-250"), root.join(tmp_dir_name(300))]
    );
    let before = names(root);
    assert!(before.contains("step-150.tmp"));

    let report = gc(root, GcMode::default()).unwrap();
    assert_eq!(report, dry);
    let after = names(root);
    for gone in ["step-120", "step-150.tmp", "step-200.tmp"] {
        assert!(!after.contains(gone), "{gone} should be gone");
    }
    for kept in [
        "step-100",
        "step-200",
        "step-250",
        "step-300.tmp",
        "step-007.tmp",
        "step-150.bak",
        "checkpoints",
        "step-x",
        "step-1.tmp.old",
        "step-99.tmp.txt",
    ] {
        assert!(after.contains(kept), "{kept} should be kept");
    }
    assert_eq!(list_committed(root).unwrap(), [100, 200]);

    // With no job running, everything uncommitted goes.
    let report = gc(root, GcMode::AllUncommitted).unwrap();
    expected_removed = vec![
        (250, EntryKind::NoMarker, 30),
        (300, EntryKind::Staging, 2000),
    ];
    let got: Vec<_> = report
        .removed
        .iter()
        .map(|r| (r.step, r.kind, r.bytes))
        .collect();
    assert_eq!(got, expected_removed);
    assert!(report.in_flight.is_empty());
    assert_eq!(list_committed(root).unwrap(), [100, 200]);
    assert!(
        open_latest(root, Verify::AllPieces)
            .unwrap()
            .rejected
            .is_empty()
    );
}

#[test]
fn gc_with_nothing_committed_keeps_every_save() {
    let dir = tempfile::tempdir().unwrap();
    leftover(dir.path(), &tmp_dir_name(0), 10);
    leftover(dir.path(), "step-3", 10);
    let report = gc(dir.path(), GcMode::default()).unwrap();
    assert!(report.removed.is_empty());
    assert_eq!(report.in_flight.len(), 2);
    assert_eq!(names(dir.path()), set(&["step-0.tmp", "step-3"]));
}

#[test]
fn gc_leaves_damaged_commits_alone() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    save_step(root, 1);
    save_step(root, 2);
    std::fs::write(root.join("step-1").join("COMMIT"), b"garbage").unwrap();
    let report = gc(root, GcMode::AllUncommitted).unwrap();
    assert!(report.removed.is_empty());
    assert_eq!(report.skipped.len(), 1);
    assert_eq!(report.skipped[0].path, root.join("step-1"));
    assert!(root.join("step-1").join("manifest.json").exists());
}

#[cfg(unix)]
#[test]
fn gc_never_follows_symlinks() {
    use std::os::unix::fs::symlink;

    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    save_step(&root, 10);
    let outside = dir.path().join("precious");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("data"), vec![1u8; 64]).unwrap();
    let precious_file = dir.path().join("precious.bin");
    std::fs::write(&precious_file, b"do not delete").unwrap();

    // Top-level links bearing step names: neither followed nor removed.
    symlink(&outside, root.join(tmp_dir_name(5))).unwrap();
    symlink(&outside, root.join("step-6")).unwrap();
    symlink(&outside, root.join(trash_dir_name(7))).unwrap();
    // A link inside a leftover: the leftover goes, the link target stays.
    let left = leftover(&root, &tmp_dir_name(8), 3);
    symlink(&outside, left.join("escape")).unwrap();
    symlink(&precious_file, left.join("escape-file")).unwrap();
    // A regular file bearing a step name.
    std::fs::write(root.join(tmp_dir_name(9)), b"f").unwrap();

    for mode in [GcMode::UpToNewestCommitted, GcMode::AllUncommitted] {
        let report = gc(&root, mode).unwrap();
        let skipped: BTreeSet<_> = report.skipped.iter().map(|s| s.path.clone()).collect();
        let expected: BTreeSet<_> = ["step-5.tmp", "step-6", "step-7.deleting", "step-9.tmp"]
            .iter()
            .map(|n| root.join(n))
            .collect();
        assert_eq!(skipped, expected, "{mode:?}");
    }
    assert!(!left.exists());
    assert_eq!(std::fs::read(outside.join("data")).unwrap(), vec![1u8; 64]);
    assert_eq!(std::fs::read(&precious_file).unwrap(), b"do not delete");
    assert!(std::fs::symlink_metadata(root.join("step-6")).is_ok());
    assert_eq!(list_committed(&root).unwrap(), [10]);
}
