//! `flotilla train --nproc 2`: two worker processes train on halves of each global batch and
//! end where one process on the whole batch ends; checkpoints and resume work across ranks.
#[path = "support/cli.rs"]
mod cli;

use cli::{MICRO, flotilla, loss_at};

/// `train` with MICRO's model on the built-in corpus, one thread per process and `extra`
/// (which must set --batch); returns stdout.
fn train(extra: &[&str]) -> String {
    let mut args = vec!["train"];
    let mut micro = MICRO.iter();
    while let Some(&arg) = micro.next() {
        if arg == "--threads" || arg == "--batch" {
            micro.next();
        } else {
            args.push(arg);
        }
    }
    args.extend_from_slice(&["--log-every", "1", "--threads", "1"]);
    args.extend_from_slice(extra);
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "train failed: {err}\n{out}");
    out
}

#[test]
fn two_workers_match_one_process_and_resume_together() {
    // 2 ranks x 2 rows against 1 process x 4 rows.
    let one = train(&["--steps", "4", "--batch", "4"]);
    let two = train(&[
        "--steps",
        "4",
        "--batch",
        "2",
        "--nproc",
        "2",
        "--bucket-mb",
        "0.05",
    ]);
    assert!(two.contains("comm") && two.contains("(2 ranks)"), "{two}");
    // The summary splits the wait: exposed after the slowest rank, and waiting for it.
    let done = two
        .lines()
        .find(|l| l.starts_with("# done: "))
        .expect("summary");
    assert!(
        done.contains("% after the slowest rank's compute, ")
            && done.contains("% waiting for slower ranks"),
        "{done}"
    );
    // The planner's forecast beside the measurement, per component (issue 7).
    for row in [
        "# plan beside measured",
        "#   compute",
        "#   exposed comm",
        "#   step",
    ] {
        assert!(two.contains(row), "{row}: {two}");
    }
    assert!(two.contains("# step forecast "), "{two}");
    assert_eq!(
        two.matches("step      4/4").count(),
        1,
        "only rank 0 prints: {two}"
    );
    // And with gradient accumulation: 2 ranks x 2 micro-batches of 1 row.
    let accum = train(&[
        "--steps",
        "4",
        "--batch",
        "1",
        "--grad-accum",
        "2",
        "--nproc",
        "2",
    ]);
    for step in 1..=4 {
        let parse = |out: &str| loss_at(out, step, 4).parse::<f64>().unwrap();
        let (a, b, c) = (parse(&one), parse(&two), parse(&accum));
        assert!((a - b).abs() < 1e-3, "step {step}: {a} vs {b}");
        assert!(
            (a - c).abs() < 1e-3,
            "step {step}: {a} vs {c} (accumulated)"
        );
    }

    // Checkpointed by rank 0, resumed by both: the resumed run ends where the straight one does.
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ckpt");
    let ck = ck.to_str().unwrap();
    let dp = ["--batch", "2", "--nproc", "2"];
    let straight = train(&[&["--steps", "6"][..], &dp].concat());
    train(
        &[
            &["--steps", "3", "--ckpt-dir", ck, "--ckpt-every", "3"][..],
            &dp,
        ]
        .concat(),
    );
    let resumed = train(&[&["--steps", "6", "--ckpt-dir", ck][..], &dp].concat());
    assert!(
        resumed.contains("resumed from") && resumed.contains("step 3"),
        "{resumed}"
    );
    for step in 4..=6 {
        assert_eq!(
            loss_at(&resumed, step, 6),
            loss_at(&straight, step, 6),
            "step {step}"
        );
    }
}

#[test]
fn bad_process_counts_are_refused() {
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&["--nproc", "0"]);
    let (ok, _, err) = flotilla(&args);
    assert!(
        !ok && err.contains("'--nproc <") && err.contains("1..=1024"),
        "{err}"
    );
}

#[test]
fn zero_stages_train_like_data_parallel_and_resume_across_stages() {
    // Two ranks: every ZeRO stage sums like data parallel, so the printed losses agree.
    let dp = ["--steps", "3", "--batch", "2", "--nproc", "2"];
    let plain = train(&dp);
    for stage in ["1", "2", "3"] {
        let z = train(&[&dp[..], &["--zero", stage]].concat());
        for step in 1..=3 {
            assert_eq!(
                loss_at(&z, step, 3),
                loss_at(&plain, step, 3),
                "ZeRO-{stage} step {step}"
            );
        }
        let line = format!("# state per rank (ZeRO-{stage}): parameters");
        assert!(z.contains(&line), "{z}");
        assert!(z.contains("(reduce-scatter + all-gather,"), "{z}");
    }
    // Saved under ZeRO-3, resumed under plain data parallel, ends like the straight run.
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ckpt");
    let ck = ck.to_str().unwrap();
    let saved = ["--batch", "2", "--nproc", "2", "--ckpt-dir", ck];
    train(&[&saved[..], &["--steps", "2", "--zero", "3"]].concat());
    let resumed = train(&[&saved[..], &["--steps", "3"]].concat());
    assert!(resumed.contains("resumed from"), "{resumed}");
    assert_eq!(loss_at(&resumed, 3, 3), loss_at(&plain, 3, 3));
    // ZeRO needs data-parallel ranks.
    let (ok, _, err) = flotilla(&["train", "--nproc", "1", "--zero", "2", "--steps", "1"]);
    assert!(!ok && err.contains("--zero 2"), "{err}");
}
