//! `flotilla ckpt gc` and `flotilla ckpt interval`, driven through the built binary.

#[path = "support/cli.rs"]
mod cli;

use std::collections::BTreeSet;
use std::path::Path;

use ckpt::{CheckpointMeta, DType, RankWriter, Slice, TensorMeta, commit, list_committed};
use cli::flotilla;

/// Commits step `step` under `root` through the public writer API (the only place that knows
/// it): one rank, one 8-byte tensor.
fn save_step(root: &Path, step: u64) {
    let w = TensorMeta {
        name: "w".into(),
        dtype: DType::U8,
        shape: vec![8],
    };
    let data = [step as u8; 8];
    let rows = Slice::new(&[(0, 8)]);
    let pieces = RankWriter::write_all(root, step, 0, &[(&w, &rows, &data)]).unwrap();
    let meta = CheckpointMeta {
        run_id: "policy-cli".into(),
        world_size: 1,
        layout: serde_json::json!("single"),
        config_hash: "0".into(),
        tensors: vec![w],
        state: serde_json::json!({}),
    };
    commit(root, step, pieces, meta).unwrap();
}

fn names(root: &Path) -> BTreeSet<String> {
    std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

/// The line of `out` mentioning the entry `name` (as the last component of a path).
fn line_for<'a>(out: &'a str, name: &str) -> &'a str {
    let sep = format!("{}{name} ", std::path::MAIN_SEPARATOR);
    out.lines()
        .find(|l| l.contains(&sep))
        .unwrap_or_else(|| panic!("no line for {name} in:\n{out}"))
}

/// The number after `key` on the line starting with `label`.
fn number_after(out: &str, label: &str, key: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no {label} line in:\n{out}"));
    let rest = &line[line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len()..];
    let token: String = rest
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    token
        .parse()
        .unwrap_or_else(|_| panic!("number after {key} in {line}"))
}

#[test]
fn gc_dry_run_retention_and_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    for step in [100, 200, 300, 400] {
        save_step(root, step);
    }
    let abandoned = root.join("step-150.tmp");
    std::fs::create_dir(&abandoned).unwrap();
    std::fs::write(abandoned.join("rank-00000.bin"), [0u8; 1000]).unwrap();
    let in_flight = root.join("step-500.tmp");
    std::fs::create_dir(&in_flight).unwrap();
    std::fs::write(in_flight.join("rank-00000.bin"), [0u8; 77]).unwrap();
    std::fs::write(root.join("README"), b"not a step").unwrap();
    let r = root.to_str().unwrap();
    let before = names(root);

    let (ok, out, err) = flotilla(&[
        "ckpt",
        "gc",
        r,
        "--keep-last",
        "2",
        "--keep-every",
        "200",
        "--dry-run",
    ]);
    assert!(ok, "{err}");
    assert_eq!(names(root), before, "dry run removes nothing");
    assert!(
        line_for(&out, "step-100").starts_with("would remove"),
        "{out}"
    );
    assert!(line_for(&out, "step-150.tmp").starts_with("would remove"));
    assert!(line_for(&out, "step-150.tmp").contains(" 1000 bytes"));
    assert!(line_for(&out, "step-500.tmp").starts_with("kept"));
    assert!(
        out.contains("keeping 3 committed step(s) [200, 300, 400], deleting 1"),
        "{out}"
    );
    assert!(out.contains("total: would remove 2 directories"), "{out}");
    assert!(!out.contains("README"));

    let (ok, out, err) = flotilla(&["ckpt", "gc", r, "--keep-last", "2", "--keep-every", "200"]);
    assert!(ok, "{err}");
    assert!(line_for(&out, "step-100").starts_with("removed"), "{out}");
    assert_eq!(list_committed(root).unwrap(), [200, 300, 400]);
    assert_eq!(
        names(root),
        ["README", "step-200", "step-300", "step-400", "step-500.tmp"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    );

    // Only GC, with no job running: the newer staging directory goes too; committed steps stay.
    let (ok, out, err) = flotilla(&["ckpt", "gc", r, "--all-uncommitted"]);
    assert!(ok, "{err}");
    assert!(
        line_for(&out, "step-500.tmp").contains(" 77 bytes"),
        "{out}"
    );
    assert!(
        out.contains("total: removed 1 directories, 77 bytes"),
        "{out}"
    );
    assert_eq!(list_committed(root).unwrap(), [200, 300, 400]);
    assert!(!in_flight.exists());

    // Nothing left to do.
    let (ok, out, _) = flotilla(&["ckpt", "gc", r]);
    assert!(ok);
    assert!(
        out.contains("total: removed 0 directories, 0 bytes"),
        "{out}"
    );
}

#[test]
fn gc_errors() {
    let dir = tempfile::tempdir().unwrap();
    save_step(dir.path(), 1);
    let r = dir.path().to_str().unwrap();
    let (ok, _, err) = flotilla(&["ckpt", "gc", r, "--keep-every", "0"]);
    assert!(!ok);
    assert!(err.contains("keep_every = 0"), "{err}");
    let missing = dir.path().join("nope");
    let (ok, _, err) = flotilla(&["ckpt", "gc", missing.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("nope"), "{err}");
    assert_eq!(list_committed(dir.path()).unwrap(), [1]);
}

/// 004 eq. 28.25 (C = 60 s, M = 86,400 s: 3220 s) and Daly's 3180.06 s (notes/004_001.md).
#[test]
fn interval_seed_vector() {
    let (ok, out, err) = flotilla(&[
        "ckpt",
        "interval",
        "--pause",
        "60",
        "--mtbf",
        "86400",
        "--step-time",
        "2",
    ]);
    assert!(ok, "{err}");
    assert_eq!(number_after(&out, "young:", "interval"), 3219.94);
    assert_eq!(number_after(&out, "young:", "every"), 1610.0);
    assert_eq!(number_after(&out, "young:", "expected loss"), 3.727);
    assert_eq!(number_after(&out, "daly:", "interval"), 3180.06);
    assert!(!out.contains("\nevery:"), "{out}");
}

/// 000 E56 / P10 (line 2863): 1,024 GPUs × 50,000 h, 5 min writes: 171.2 min and 5.8%; every
/// 15 min: 33.6%.
#[test]
fn interval_cluster_and_fixed_every() {
    let (ok, out, err) = flotilla(&[
        "ckpt",
        "interval",
        "--pause",
        "300",
        "--device-mtbf",
        "180000000",
        "--devices",
        "1024",
        "--every",
        "900",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("(48.83 h)"), "{out}");
    assert_eq!(number_after(&out, "young:", "s ("), 171.16);
    assert_eq!(number_after(&out, "young:", "expected loss"), 5.842);
    assert_eq!(number_after(&out, "every:", "expected loss"), 33.589);
}

#[test]
fn interval_refuses_bad_input() {
    for (args, needle) in [
        (&["--pause", "0", "--mtbf", "10"][..], "--pause 0"),
        (&["--pause", "1", "--mtbf", "-5"][..], "--mtbf -5"),
        (&["--pause", "1", "--mtbf", "NaN"][..], "--mtbf NaN"),
        (
            &["--pause", "1", "--device-mtbf", "10", "--devices", "0"][..],
            "--devices 0",
        ),
        (
            &["--pause", "1", "--mtbf", "10", "--restart", "-1"][..],
            "--restart -1",
        ),
        (
            &["--pause", "1", "--mtbf", "10", "--every", "0"][..],
            "--every 0",
        ),
        (
            &["--pause", "1", "--mtbf", "10", "--step-time", "0"][..],
            "--step-time 0",
        ),
        (&["--pause", "1"][..], "--mtbf"),
        (
            &[
                "--pause",
                "1",
                "--mtbf",
                "5",
                "--device-mtbf",
                "5",
                "--devices",
                "2",
            ][..],
            "cannot be used",
        ),
        (&["--pause", "1", "--device-mtbf", "5"][..], "--devices"),
    ] {
        let mut full = vec!["ckpt", "interval"];
        full.extend_from_slice(args);
        let (ok, _, err) = flotilla(&full);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
