//! `flotilla ckpt ls / show / verify / bench`, driven through the built binary.

#[path = "support/cli.rs"]
mod cli;

use std::path::Path;

use ckpt::{CheckpointMeta, DType, RankWriter, Slice, TensorMeta, commit, tmp_dir_name};
use cli::flotilla;

/// Commits step `step` under `root`: two ranks each save half the rows of `w` and of `b`.
fn save_step(root: &Path, step: u64) {
    let w = TensorMeta {
        name: "layers.0.w".into(),
        dtype: DType::F32,
        shape: vec![4, 3],
    };
    let b = TensorMeta {
        name: "layers.0.b".into(),
        dtype: DType::U8,
        shape: vec![4],
    };
    let mut pieces = Vec::new();
    for rank in 0..2u64 {
        let w_data: Vec<u8> = (0..24).map(|i| (i + 24 * rank + step) as u8).collect();
        let b_data = [rank as u8, 9];
        let (ws, bs) = (
            Slice::new(&[(2 * rank, 2), (0, 3)]),
            Slice::new(&[(2 * rank, 2)]),
        );
        let mine = [(&w, &ws, &w_data[..]), (&b, &bs, &b_data[..])];
        pieces.extend(RankWriter::write_all(root, step, rank as u32, &mine).unwrap());
    }
    let meta = CheckpointMeta {
        run_id: "cli-test".into(),
        world_size: 2,
        layout: serde_json::json!({"dp": 2}),
        config_hash: "abc123".into(),
        tensors: vec![w, b],
        state: serde_json::json!({"optimizer_step": step}),
    };
    commit(root, step, pieces, meta).unwrap();
}

fn root_arg(root: &Path) -> &str {
    root.to_str().unwrap()
}

/// The line of `ls` output for directory `name`.
fn ls_line<'a>(out: &'a str, name: &str) -> &'a str {
    out.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .unwrap_or_else(|| panic!("no line for {name} in:\n{out}"))
}

#[test]
fn ls_show_verify_and_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    save_step(root, 5);
    save_step(root, 10);
    // Leftovers of crashed saves: a staging directory and a published one without COMMIT.
    std::fs::create_dir(root.join(tmp_dir_name(20))).unwrap();
    std::fs::create_dir(root.join("step-15")).unwrap();

    let (ok, out, err) = flotilla(&["ckpt", "ls", root_arg(root)]);
    assert!(ok, "{err}");
    let line = ls_line(&out, "step-10");
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(fields[1..], ["committed", "2", "4", "52", "2", "cli-test"]);
    assert!(ls_line(&out, "step-5").contains("committed"));
    assert!(ls_line(&out, "step-15").contains("uncommitted"), "{out}");
    assert!(
        ls_line(&out, "step-20.tmp").contains("uncommitted"),
        "{out}"
    );

    let (ok, out, err) = flotilla(&["ckpt", "ls", root_arg(root), "--json"]);
    assert!(ok, "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    let names: Vec<&str> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["dir"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["step-5", "step-10", "step-15", "step-20.tmp"]);
    let r = &rows[1];
    assert_eq!(
        (&r["state"], &r["tensors"], &r["pieces"]),
        (&"committed".into(), &2.into(), &4.into())
    );
    assert_eq!(
        (&r["bytes"], &r["world"], &r["run"]),
        (&52.into(), &2.into(), &"cli-test".into())
    );
    assert_eq!(
        (&rows[2]["state"], &rows[3]["state"]),
        (&"no_marker".into(), &"staging".into())
    );

    let (ok, out, err) = flotilla(&["ckpt", "show", root_arg(root), "--json"]);
    assert!(ok, "{err}");
    let manifest: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(manifest["step"], 10, "newest committed step by default");
    let names: Vec<&str> = manifest["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["layers.0.w", "layers.0.b"]);

    let (ok, out, err) = flotilla(&["ckpt", "show", root_arg(root), "--step", "5"]);
    assert!(ok, "{err}");
    for want in [
        "cli-test",
        "abc123",
        "layers.0.w",
        "F32",
        "[4, 3]",
        "optimizer_step",
    ] {
        assert!(out.contains(want), "{want} missing from:\n{out}");
    }
    assert!(out.contains("step:        5"), "{out}");

    let (ok, out, err) = flotilla(&["ckpt", "verify", root_arg(root)]);
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("ok   step-5") && out.contains("ok   step-10"),
        "{out}"
    );

    // Flip one byte of rank 1's file of step 10.
    let piece = root.join("step-10").join("rank-00001.safetensors");
    let mut bytes = std::fs::read(&piece).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&piece, bytes).unwrap();

    let (ok, out, err) = flotilla(&["ckpt", "verify", root_arg(root), "--step", "10"]);
    assert!(!ok, "corrupt step verified: {out}");
    assert!(out.contains("rank-00001.safetensors"), "{out}");
    assert!(err.contains("step-10"), "{err}");

    let (ok, out, err) = flotilla(&["ckpt", "verify", root_arg(root)]);
    assert!(!ok, "corrupt step verified: {out}");
    assert!(out.contains("ok   step-5"), "{out}");
    assert!(
        out.contains("BAD  step-10") && out.contains("rank-00001.safetensors"),
        "{out}"
    );
    assert!(err.contains("1 of 2") && err.contains("step-10"), "{err}");

    // An uncommitted step is refused by name.
    let (ok, _, err) = flotilla(&["ckpt", "show", root_arg(root), "--step", "15"]);
    assert!(!ok && err.contains("15"), "{err}");
}

#[test]
fn verify_and_show_refuse_an_empty_root() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, _, err) = flotilla(&["ckpt", "verify", root_arg(dir.path())]);
    assert!(!ok && err.contains("no committed step"), "{err}");
    let (ok, _, err) = flotilla(&["ckpt", "show", root_arg(dir.path())]);
    assert!(!ok && err.contains("no loadable committed step"), "{err}");
}

#[test]
fn bench_prints_positive_figures() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "ckpt",
        "bench",
        "--dir",
        root_arg(dir.path()),
        "--size",
        "4MiB",
        "--ranks",
        "4",
        "--reshard-ranks",
        "3",
        "--rounds",
        "1",
        "--json",
    ];
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "{out}");
    let r: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(r["bytes"], 4 << 20);
    assert_eq!(r["ranks"], 4);
    assert_eq!(r["reshard_ranks"], 3);
    for key in [
        "disk_write_gbps",
        "disk_read_gbps",
        "save_gbps",
        "async_pause_s",
        "async_total_gbps",
        "load_same_gbps",
        "load_reshard_gbps",
        "save_over_disk_write",
        "load_over_disk_read",
        "reshard_over_same",
    ] {
        let v = r[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing: {out}"));
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
    // Everything the benchmark wrote is gone.
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn bench_refuses_a_size_too_small_for_the_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "ckpt",
        "bench",
        "--dir",
        root_arg(dir.path()),
        "--size",
        "64KiB",
    ];
    let (ok, _, err) = flotilla(&args);
    assert!(
        !ok && err.contains("--size") && err.contains("too small"),
        "{err}"
    );
}
