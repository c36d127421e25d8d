//! `flotilla train --ckpt-dir`: a run interrupted after a checkpoint and started again resumes
//! from it and ends exactly where an uninterrupted run ends.
#[path = "support/cli.rs"]
mod cli;

use cli::{MICRO, flotilla, loss_at};

/// `train` on the built-in corpus for `steps` steps with `extra` arguments; returns stdout.
fn train(steps: &str, extra: &[&str]) -> String {
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&["--steps", steps, "--log-every", "1"]);
    args.extend_from_slice(extra);
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "train failed: {err}\n{out}");
    out
}

#[test]
fn an_interrupted_run_resumes_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ckpt");
    let ck = ck.to_str().unwrap();
    let straight = train("6", &[]);

    // "Killed" after step 4: the run was told to stop there, having saved steps 2 and 4.
    let first = train("4", &["--ckpt-dir", ck, "--ckpt-every", "2"]);
    assert!(first.contains("no checkpoint in"), "{first}");
    assert!(first.contains("# checkpoint step 2:") && first.contains("# checkpoint step 4:"));
    let second = train("6", &["--ckpt-dir", ck, "--ckpt-every", "2", "--ckpt-sync"]);
    assert!(second.contains("step 4"), "{second}");
    assert!(
        !second.contains(&format!("step {:>6}/6 loss", 4)),
        "{second}"
    );
    for step in 5..=6 {
        assert_eq!(
            loss_at(&second, step, 6),
            loss_at(&straight, step, 6),
            "step {step}"
        );
    }
    assert_eq!(
        ckpt::list_committed(std::path::Path::new(ck)).unwrap(),
        vec![2, 4, 6]
    );

    // Starting again at the end resumes at step 6 and has nothing left to do or save.
    let again = train("6", &["--ckpt-dir", ck]);
    assert!(
        again.contains("resumed from") && again.contains("step 6"),
        "{again}"
    );

    // A corrupt newest step is reported and the run resumes from the one before it.
    let file = std::path::Path::new(ck)
        .join("step-6")
        .join(ckpt::rank_file_name(0));
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let resumed = train("6", &["--ckpt-dir", ck]);
    assert!(resumed.contains("rejected (lost): step 6"), "{resumed}");
    assert!(
        resumed.contains("resumed from") && resumed.contains("step 4"),
        "{resumed}"
    );
    assert_eq!(loss_at(&resumed, 6, 6), loss_at(&straight, 6, 6));
    // The corrupt step was set aside (kept for inspection, invisible to readers) and step 6
    // committed afresh.
    assert!(std::path::Path::new(ck).join("step-6.rejected").is_dir());
    assert_eq!(
        ckpt::list_committed(std::path::Path::new(ck)).unwrap(),
        vec![2, 4, 6]
    );
}

#[test]
fn convert_exports_hf_and_reshards_offline() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let (ck, direct, converted, resharded) = (
        path("ckpt"),
        path("direct"),
        path("converted"),
        path("resharded"),
    );
    train("3", &["--ckpt-dir", &ck, "--export-hf", &direct]);
    let (ok, out, err) = flotilla(&["ckpt", "convert", &ck, "--hf", &converted]);
    assert!(ok, "{err}");
    assert!(out.contains("step 3 exported"), "{out}");
    // The checkpoint's weights are the trained weights: the same bytes as the direct export.
    for file in ["model.safetensors", "config.json"] {
        let a = std::fs::read(dir.path().join("direct").join(file)).unwrap();
        let b = std::fs::read(dir.path().join("converted").join(file)).unwrap();
        assert!(a == b, "{file} differs");
    }
    let (ok, out, err) = flotilla(&[
        "ckpt",
        "convert",
        &ck,
        "--reshard",
        "3",
        "--out",
        &resharded,
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("rewritten for 3 ranks"), "{out}");
    let (ok, out, err) = flotilla(&["ckpt", "verify", &resharded]);
    assert!(ok && out.contains("ok   step-3"), "{out}{err}");
    // Bad requests are refused by name.
    let (ok, _, err) = flotilla(&["ckpt", "convert", &ck]);
    assert!(!ok && err.contains("--hf"), "{err}");
    let (ok, _, err) = flotilla(&[
        "ckpt", "convert", &resharded, "--step", "9", "--hf", &converted,
    ]);
    assert!(!ok && err.contains('9'), "{err}");
}

#[test]
fn automatic_interval_saves_and_reports_its_plan() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ckpt");
    let out = train(
        "3",
        &[
            "--ckpt-dir",
            ck.to_str().unwrap(),
            "--ckpt-auto-mtbf",
            "1e-15",
        ],
    );
    assert!(out.contains("Young/Daly, expected loss"), "{out}");
    assert_eq!(ckpt::list_committed(&ck).unwrap(), vec![1, 2, 3]);
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&["--steps", "2", "--ckpt-auto-mtbf", "100"]);
    let (ok, _, err) = flotilla(&args);
    assert!(!ok && err.contains("--ckpt-dir"), "{err}");
}
