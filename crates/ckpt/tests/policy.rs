//! Checkpoint policy: retention plans and deletes, garbage collection of crash leftovers, and
//! the Young/Daly interval with the seed test vectors.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ckpt::policy::{
    EntryKind, Formula, GcMode, IntervalPlanner, PauseAverage, Retention, apply, cluster_mtbf,
    daly_interval, expected_loss_fraction, gc, interval_steps, preview, preview_gc, trash_dir_name,
    young_interval,
};
use ckpt::{
    CheckpointMeta, DType, RankWriter, Slice, TensorMeta, Verify, commit, list_committed,
    open_latest, step_dir_name, tmp_dir_name,
};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Commits step `step` under `root` through the public writer API: one rank, one 16-byte
/// tensor. The only place that knows the writer API.
fn save_step(root: &Path, step: u64) {
    let w = TensorMeta {
        name: "w".into(),
        dtype: DType::U8,
        shape: vec![16],
    };
    let data: Vec<u8> = (0..16).map(|i| (i as u64 + step) as u8).collect();
    let rows = Slice::new(&[(0, 16)]);
    let pieces = RankWriter::write_all(root, step, 0, &[(&w, &rows, &data)]).unwrap();
    let meta = CheckpointMeta {
        run_id: "policy-test".into(),
        world_size: 1,
        layout: serde_json::json!("single"),
        config_hash: "0".into(),
        tensors: vec![w],
        state: serde_json::json!({"optimizer_step": step}),
    };
    commit(root, step, pieces, meta).unwrap();
}

/// A directory `root/name` holding one file of `bytes` bytes.
fn leftover(root: &Path, name: &str, bytes: usize) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("rank-00000.bin"), vec![7u8; bytes]).unwrap();
    dir
}

/// The names directly under `root`, sorted.
fn names(root: &Path) -> BTreeSet<String> {
    std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn close(actual: f64, expected: f64, tol: f64) {
    assert!(
        (actual - expected).abs() <= tol,
        "{actual} is not within {tol} of {expected}"
    );
}

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

// ---------------------------------------------------------------------------------------------
// Interval: seed test vectors
// ---------------------------------------------------------------------------------------------

/// 004 eq. 28.25 (004_fff1170a72f11f87.txt line 361): C = 60 s, M = 24 h gives τ* ≈ 3220 s
/// ≈ 53.7 min; at τ* the pause and lost-work terms are each ≈ 1.86% (line 363).
#[test]
fn young_matches_eq_28_25() {
    let tau = young_interval(60.0, 86_400.0).unwrap();
    close(tau, 3219.94, 0.005);
    assert_eq!(tau.round(), 3220.0);
    close(tau / 60.0, 53.7, 0.05);
    let w = expected_loss_fraction(tau, 60.0, 86_400.0, 0.0).unwrap();
    close(60.0 / tau, 0.0186, 0.00005);
    close(tau / (2.0 * 86_400.0), 0.0186, 0.00005);
    close(w, 2.0 * 0.018634, 0.000005);
    // R_f / M adds on top.
    let w_r = expected_loss_fraction(tau, 60.0, 86_400.0, 864.0).unwrap();
    close(w_r - w, 0.01, 1e-12);
    // Exercise 28.11 (notes/004_001.md TV-K3): M / 4 halves τ*.
    close(young_interval(60.0, 21_600.0).unwrap(), tau / 2.0, 1e-9);
}

/// Daly's correction for the same inputs: 3180.06 s (notes/004_001.md line 575).
#[test]
fn daly_matches_notes() {
    close(daly_interval(60.0, 86_400.0).unwrap(), 3180.06, 0.005);
    // Fallback for C >= 2M: τ = M.
    assert_eq!(daly_interval(200.0, 100.0).unwrap(), 100.0);
    assert_eq!(daly_interval(200.0, 99.0).unwrap(), 99.0);
    // Just below the boundary it is still positive and below M.
    let t = daly_interval(199.9, 100.0).unwrap();
    assert!(t > 0.0 && t < 100.0, "{t}");
}

/// 000 E56 / pitfall P10 (000_7a796c6865dceb08.txt line 2863; notes/000_part2.md lines
/// 681-689, 956): 1,024 GPUs at 50,000 h MTBF each give 48.8 h; a 5 min write gives
/// τ_opt ≈ 171.2 min and a 5.8% tax; every 15 min costs 33.6%.
#[test]
fn young_daly_e56_p10() {
    let m = cluster_mtbf(50_000.0 * 3600.0, 1024).unwrap();
    close(m / 3600.0, 48.83, 0.005);
    let c = 5.0 * 60.0;
    let tau = young_interval(c, m).unwrap();
    close(tau / 60.0, 171.16, 0.01);
    let w_opt = expected_loss_fraction(tau, c, m, 0.0).unwrap();
    close(w_opt, 0.0584, 0.0001);
    let w_15 = expected_loss_fraction(15.0 * 60.0, c, m, 0.0).unwrap();
    close(w_15, 0.3359, 0.0001);
    // The daily loss quoted with them ($13,638 at an implied $2 per GPU-hour).
    close((w_15 - w_opt) * 1024.0 * 24.0 * 2.0, 13_638.0, 1.0);
}

#[test]
fn interval_inputs_are_validated_by_name() {
    for (result, name) in [
        (young_interval(0.0, 1.0), "c_secs"),
        (young_interval(1.0, -1.0), "mtbf_secs"),
        (young_interval(f64::NAN, 1.0), "c_secs"),
        (daly_interval(1.0, f64::INFINITY), "mtbf_secs"),
        (expected_loss_fraction(0.0, 1.0, 1.0, 0.0), "tau_secs"),
        (expected_loss_fraction(1.0, 1.0, 1.0, -1.0), "restart_secs"),
        (cluster_mtbf(-5.0, 3), "per_device_mtbf_secs"),
        (cluster_mtbf(5.0, 0), "devices"),
    ] {
        let err = result.unwrap_err();
        assert_eq!(err.what, name);
        assert!(err.to_string().starts_with(name), "{err}");
    }
    assert_eq!(interval_steps(0.0, 1.0).unwrap_err().what, "interval_secs");
    assert_eq!(interval_steps(10.0, 0.0).unwrap_err().what, "step_secs");
    assert!(expected_loss_fraction(1.0, 1.0, 1.0, 0.0).is_ok());
}

#[test]
fn interval_in_steps() {
    assert_eq!(interval_steps(3219.94, 1.5).unwrap(), 2147);
    assert_eq!(interval_steps(1.0, 10.0).unwrap(), 1, "at least one step");
    assert_eq!(interval_steps(1e300, 1e-300).unwrap(), u64::MAX);
}

// ---------------------------------------------------------------------------------------------
// IntervalPlanner
// ---------------------------------------------------------------------------------------------

#[test]
fn planner_uses_priors_then_measurements() {
    let mut p = IntervalPlanner::new(60.0, 86_400.0).unwrap();
    close(p.interval(), 3219.94, 0.005);
    let t0 = Instant::now();
    assert!(!p.is_due(t0, t0 + Duration::from_secs(3000)));
    assert!(p.is_due(t0, t0 + Duration::from_secs(3221)));
    assert!(
        !p.is_due(t0 + Duration::from_secs(10), t0),
        "clock before last: not due"
    );
    assert_eq!(p.interval_steps(2.0).unwrap(), 1610);

    // Measured pauses replace the prior: mean of 20 and 40 is 30.
    p.record_pause(20.0).unwrap();
    p.record_pause(40.0).unwrap();
    assert_eq!(p.pause(), 30.0);
    close(p.interval(), (2.0f64 * 30.0 * 86_400.0).sqrt(), 1e-9);

    // Run time without failures keeps the prior MTBF; then 2 failures in 43,200 s give 21,600.
    p.record_run_time(43_200.0).unwrap();
    assert_eq!(p.mtbf(), 86_400.0);
    p.record_failure();
    p.record_failure();
    assert_eq!(p.mtbf(), 21_600.0);
    close(p.interval(), (2.0f64 * 30.0 * 21_600.0).sqrt(), 1e-9);
    assert!(p.is_due(t0, t0 + Duration::from_secs(1139)));
    assert!(!p.is_due(t0, t0 + Duration::from_secs(1137)));
    close(
        p.expected_loss_fraction(),
        expected_loss_fraction(p.interval(), 30.0, 21_600.0, 0.0).unwrap(),
        1e-12,
    );
}

#[test]
fn planner_ewma_daly_and_restart() {
    let mut p = IntervalPlanner::new(1.0, 86_400.0)
        .unwrap()
        .with_average(PauseAverage::Ewma(0.5))
        .unwrap()
        .with_formula(Formula::Daly)
        .with_restart(864.0)
        .unwrap();
    p.record_pause(100.0).unwrap();
    assert_eq!(p.pause(), 100.0, "first measurement taken as is");
    p.record_pause(20.0).unwrap();
    assert_eq!(p.pause(), 60.0);
    close(p.interval(), 3180.06, 0.005);
    let w = p.expected_loss_fraction();
    close(
        w,
        60.0 / p.interval() + p.interval() / 172_800.0 + 0.01,
        1e-12,
    );
}

#[test]
fn planner_refuses_bad_input() {
    assert_eq!(
        IntervalPlanner::new(0.0, 1.0).unwrap_err().what,
        "pause_prior_secs"
    );
    assert_eq!(
        IntervalPlanner::new(1.0, f64::NAN).unwrap_err().what,
        "mtbf_prior_secs"
    );
    let p = IntervalPlanner::new(1.0, 1.0).unwrap();
    for alpha in [0.0, 1.5, f64::NAN, -0.1] {
        let err = p
            .clone()
            .with_average(PauseAverage::Ewma(alpha))
            .unwrap_err();
        assert_eq!(err.what, "ewma_alpha");
    }
    assert!(p.clone().with_average(PauseAverage::Ewma(1.0)).is_ok());
    assert_eq!(
        p.clone().with_restart(-1.0).unwrap_err().what,
        "restart_secs"
    );
    let mut q = p.clone();
    assert_eq!(q.record_pause(-3.0).unwrap_err().what, "pause_secs");
    assert_eq!(
        q.record_run_time(f64::INFINITY).unwrap_err().what,
        "run_secs"
    );
    assert_eq!(q, p, "refused input changes nothing");
    assert_eq!(p.interval_steps(0.0).unwrap_err().what, "step_secs");
}
