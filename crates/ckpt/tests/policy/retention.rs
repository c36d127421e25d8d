//! Retention: plans computed from a list of committed steps, and applying them on disk
//! (including a crash in the middle of a delete).
use std::collections::BTreeSet;

use ckpt::policy::{EntryKind, GcMode, Retention, apply, gc, preview, trash_dir_name};
use ckpt::{Verify, list_committed, open_latest, step_dir_name, tmp_dir_name};
use proptest::prelude::*;

use super::{leftover, names, save_step, set};

// ---------------------------------------------------------------------------------------------
// Retention plans
// ---------------------------------------------------------------------------------------------

#[test]
fn plan_examples() {
    let steps = [100, 200, 300, 400, 500, 600];
    let r = Retention {
        keep_last: 2,
        keep_every: Some(200),
    };
    let plan = r.plan(&steps).unwrap();
    assert_eq!(plan.keep, [200, 400, 500, 600]);
    assert_eq!(plan.delete, [100, 300]);

    // keep_last 0 still keeps the newest; unsorted, duplicated input is fine.
    let r = Retention {
        keep_last: 0,
        keep_every: None,
    };
    let plan = r.plan(&[30, 10, 20, 30]).unwrap();
    assert_eq!(plan.keep, [30]);
    assert_eq!(plan.delete, [10, 20]);

    // Nothing committed: nothing to do. More to keep than there are: keep all.
    assert_eq!(r.plan(&[]).unwrap().keep, Vec::<u64>::new());
    let all = Retention {
        keep_last: 10,
        keep_every: None,
    };
    assert_eq!(all.plan(&[1, 2, 3]).unwrap().delete, Vec::<u64>::new());

    // Step 0 is a multiple of everything.
    let r = Retention {
        keep_last: 1,
        keep_every: Some(7),
    };
    assert_eq!(r.plan(&[0, 5, 9]).unwrap().keep, [0, 9]);
}

#[test]
fn plan_refuses_keep_every_zero() {
    let r = Retention {
        keep_last: 3,
        keep_every: Some(0),
    };
    let err = r.plan(&[1, 2]).unwrap_err();
    assert_eq!(err.what, "keep_every");
    assert!(err.to_string().contains("keep_every = 0"), "{err}");
}

proptest! {
    #[test]
    fn plan_properties(
        steps in proptest::collection::vec(0u64..2_000, 0..40),
        keep_last in 0usize..8,
        keep_every in proptest::option::of(1u64..300),
    ) {
        let r = Retention { keep_last, keep_every };
        let plan = r.plan(&steps).unwrap();
        let unique: BTreeSet<u64> = steps.iter().copied().collect();
        let sorted: Vec<u64> = unique.iter().copied().collect();
        // keep and delete partition the committed steps, each ascending.
        let mut both: Vec<u64> = plan.keep.iter().chain(&plan.delete).copied().collect();
        both.sort_unstable();
        prop_assert_eq!(&both, &sorted);
        prop_assert!(plan.keep.windows(2).all(|w| w[0] < w[1]));
        prop_assert!(plan.delete.windows(2).all(|w| w[0] < w[1]));
        // The newest committed step is never deleted.
        if let Some(newest) = sorted.last() {
            prop_assert!(plan.keep.contains(newest));
        }
        // A step is kept exactly when it is newest, in the last K, or a multiple of N.
        let last_k: BTreeSet<u64> = sorted.iter().rev().take(keep_last).copied().collect();
        for &s in &sorted {
            let wanted = Some(&s) == sorted.last()
                || last_k.contains(&s)
                || keep_every.is_some_and(|n| s % n == 0);
            prop_assert_eq!(plan.keep.contains(&s), wanted, "step {}", s);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Retention on disk
// ---------------------------------------------------------------------------------------------

#[test]
fn apply_deletes_unkept_steps_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    for step in [10, 20, 30, 40, 50] {
        save_step(root, step);
    }
    leftover(root, &tmp_dir_name(60), 100); // a save in flight
    std::fs::write(root.join("notes.txt"), b"keep me").unwrap();
    let r = Retention {
        keep_last: 2,
        keep_every: Some(20),
    };

    let before = names(root);
    let dry = preview(root, &r).unwrap();
    assert_eq!(dry.plan.delete, [10, 30]);
    assert!(dry.bytes_freed() > 0);
    assert_eq!(names(root), before, "preview must not delete");

    let report = apply(root, &r).unwrap();
    assert_eq!(report, dry, "apply does what preview said");
    assert!(
        report
            .removed
            .iter()
            .all(|r| r.kind == EntryKind::Committed)
    );
    assert_eq!(list_committed(root).unwrap(), [20, 40, 50]);
    assert_eq!(
        names(root),
        set(&["step-20", "step-40", "step-50", "step-60.tmp", "notes.txt"])
    );
    // The newest still loads.
    let opened = open_latest(root, Verify::AllPieces).unwrap();
    assert_eq!(opened.checkpoint.manifest().step, 50);

    // Idempotent.
    assert!(apply(root, &r).unwrap().removed.is_empty());
}

#[test]
fn apply_keeps_newest_even_with_keep_last_zero() {
    let dir = tempfile::tempdir().unwrap();
    for step in [1, 2, 3] {
        save_step(dir.path(), step);
    }
    let r = Retention {
        keep_last: 0,
        keep_every: None,
    };
    apply(dir.path(), &r).unwrap();
    assert_eq!(list_committed(dir.path()).unwrap(), [3]);
}

#[test]
fn apply_refuses_bad_policy_naming_the_value() {
    let dir = tempfile::tempdir().unwrap();
    save_step(dir.path(), 1);
    let r = Retention {
        keep_last: 1,
        keep_every: Some(0),
    };
    let err = apply(dir.path(), &r).unwrap_err().to_string();
    assert!(err.contains("keep_every = 0"), "{err}");
    assert_eq!(list_committed(dir.path()).unwrap(), [1]);
}

/// A crash after the rename to the trash name but before (or during) the removal: readers do
/// not see the step, and the collector removes the trash in every mode.
#[test]
fn crash_mid_delete_is_invisible_and_collected() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    for step in [5, 6, 7] {
        save_step(root, step);
    }
    // Simulate apply's first half for step 5, then a partial removal of its files.
    let trash = root.join(trash_dir_name(5));
    std::fs::rename(root.join(step_dir_name(5)), &trash).unwrap();
    assert!(
        trash.join("COMMIT").exists(),
        "the marker travels with the rename"
    );
    std::fs::remove_file(trash.join("manifest.json")).unwrap();

    assert_eq!(list_committed(root).unwrap(), [6, 7]);
    let opened = open_latest(root, Verify::AllPieces).unwrap();
    assert_eq!(opened.checkpoint.manifest().step, 7);
    assert!(opened.rejected.is_empty());

    for mode in [GcMode::UpToNewestCommitted, GcMode::AllUncommitted] {
        let copy = tempfile::tempdir().unwrap();
        std::fs::create_dir(copy.path().join(trash_dir_name(9))).unwrap();
        let report = gc(copy.path(), mode).unwrap();
        assert_eq!(
            report.removed.len(),
            1,
            "{mode:?}: trash is garbage even with no commit"
        );
        assert_eq!(report.removed[0].kind, EntryKind::Trash);
    }
    let report = gc(root, GcMode::default()).unwrap();
    assert_eq!(report.removed.len(), 1);
    assert_eq!(report.removed[0].path, trash);
    assert_eq!(report.removed[0].step, 5);
    assert_eq!(names(root), set(&["step-6", "step-7"]));

    // A stale trash of the same step does not block a later delete of that step.
    std::fs::create_dir(root.join(trash_dir_name(6))).unwrap();
    std::fs::write(root.join(trash_dir_name(6)).join("junk"), b"x").unwrap();
    let r = Retention {
        keep_last: 1,
        keep_every: None,
    };
    apply(root, &r).unwrap();
    assert_eq!(names(root), set(&["step-7"]));
}
