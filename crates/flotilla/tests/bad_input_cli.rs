//! Hostile or mistaken command lines through the binary (issue 29, "Bad input"): each is
//! refused within a deadline, naming the flag, with nothing trained and nothing created.
//! Range errors are clap's usage errors (exit 2, before anything starts); a configuration the
//! train command refuses exits with the refusal code (78), before any worker starts.

#[path = "support/cli.rs"]
mod cli;

use cli::{MICRO, run_to_with_deadline, run_with_deadline};
use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

/// How long one refused command may take before the test calls it hung.
const DEADLINE: Duration = Duration::from_secs(30);

/// clap's exit code for a usage error.
const USAGE: i32 = 2;
/// `flotilla train`'s exit code for a configuration it refuses (`launch::EXIT_REFUSED`).
const REFUSED: i32 = 78;

/// `flotilla train` with [`MICRO`] and `extra`.
fn train(extra: &[&str]) -> Vec<String> {
    ["train"]
        .iter()
        .chain(MICRO)
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}

/// Runs `args` in a scratch directory and asserts it exits with `code` within [`DEADLINE`],
/// naming every one of `named` on stderr and training no step; returns stderr.
fn refused(args: &[String], code: i32, named: &[&str]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let (status, out, err) = run_with_deadline(tmp.path(), &argv, DEADLINE);
    assert_eq!(status.code(), Some(code), "{argv:?}: {status}\n{err}");
    for n in named {
        assert!(err.contains(n), "{argv:?}: no {n:?} in:\n{err}");
    }
    assert!(!err.contains("panicked"), "{argv:?}:\n{err}");
    assert!(
        !out.lines().any(|l| l.starts_with("step ")),
        "{argv:?} trained:\n{out}"
    );
    err
}

/// `refused` for a usage error of `flag`, whose message names `range`.
fn out_of_range(args: &[&str], flag: &str, range: &str) {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    refused(&args, USAGE, &[&format!("'{flag} <"), range]);
}

#[test]
fn zero_tensor_and_pipeline_degrees_are_refused() {
    for flag in ["--tp", "--pp"] {
        let args = train(&["--nproc", "2", flag, "0"]);
        refused(&args, USAGE, &[&format!("'{flag} <"), "1..=65536"]);
    }
}

#[test]
fn peak_gflops_must_be_a_finite_positive_number() {
    for bad in ["0", "NaN", "inf", "-1"] {
        let args = train(&["--peak-gflops", bad]);
        refused(&args, USAGE, &["'--peak-gflops <", "(0, inf)"]);
    }
}

#[test]
fn data_stress_rate_must_be_finite_and_not_negative() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-dataset");
    let ds = missing.to_str().unwrap();
    for bad in ["NaN", "inf", "-5"] {
        out_of_range(
            &["data", "stress", "--dataset", ds, "--rate", bad],
            "--rate",
            "[0, inf)",
        );
    }
    // 0 is valid (unpaced): the command goes on to open the dataset, and fails there.
    let (status, _, err) = run_with_deadline(
        tmp.path(),
        &["data", "stress", "--dataset", ds, "--rate", "0"],
        DEADLINE,
    );
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        !err.contains("--rate") && err.contains("no-dataset"),
        "{err}"
    );
}

#[test]
fn every_subcommand_range_checks_its_numbers() {
    let cases: &[(&[&str], &str, &str)] = &[
        (&["train", "--threads", "100000"], "--threads", "1..=1024"),
        (&["train", "--batch", "0"], "--batch", "1.."),
        (&["train", "--layers", "0"], "--layers", "1.."),
        (&["train", "--grad-clip", "NaN"], "--grad-clip", "(0, inf)"),
        (
            &["train", "--weight-decay", "-1"],
            "--weight-decay",
            "[0, inf)",
        ),
        (
            &["train", "--min-lr-ratio", "2"],
            "--min-lr-ratio",
            "[0, 1]",
        ),
        (
            &["train", "--heartbeat-timeout-s", "0"],
            "--heartbeat-timeout-s",
            "(0, 1000000000]",
        ),
        (
            &["train", "--watchdog-s", "inf"],
            "--watchdog-s",
            "(0, 1000000000]",
        ),
        (&["train", "--job-timeout-s", "0"], "--job-timeout-s", "1.."),
        (
            &["train", "--ckpt-dir", "x", "--ckpt-auto-mtbf", "NaN"],
            "--ckpt-auto-mtbf",
            "(0, inf)",
        ),
        (&["train", "--workers", "100000"], "--workers", "1..=1024"),
        (&["train", "--weights", "1,NaN"], "--weights", "(0, inf)"),
        (
            &["train", "--data-timeout", "0"],
            "--data-timeout",
            "(0, 1000000000]",
        ),
        (
            &["data", "stress", "--duration", "NaN"],
            "--duration",
            "(0, 1000000000]",
        ),
        (
            &["data", "stress", "--global-batch", "0"],
            "--global-batch",
            "1..",
        ),
        (&["data", "bench", "--epochs", "0"], "--epochs", "(0, inf)"),
        (
            &["data", "bench", "--resume-at", "1"],
            "--resume-at",
            "[0, 1)",
        ),
        (
            &["data", "prepare", "x", "-o", "y", "--threads", "5000"],
            "--threads",
            "0..=1024",
        ),
        (
            &["data", "verify", "x", "--threads", "5000"],
            "--threads",
            "0..=1024",
        ),
        (
            &["bench", "comm", "--target-seconds", "0"],
            "--target-seconds",
            "(0, 1000000000]",
        ),
        (&["bench", "comm", "--rounds", "0"], "--rounds", "1.."),
        (&["bench", "model", "--gemm", "0"], "--gemm", "1..=16384"),
        (
            &["bench", "model", "--gemm-reps", "0"],
            "--gemm-reps",
            "1..",
        ),
        (
            &["generate", "--model", "m", "--temperature", "NaN"],
            "--temperature",
            "[0, inf)",
        ),
        (
            &["generate", "--model", "m", "--threads", "100000"],
            "--threads",
            "1..=1024",
        ),
        (
            &["plan", "--model", "gpt2", "--nodes", "0"],
            "--nodes",
            "1..",
        ),
        (
            &["plan", "--model", "gpt2", "--nodes", "1", "--tokens", "inf"],
            "--tokens",
            "(0, inf)",
        ),
        (
            &["ckpt", "bench", "--dir", "x", "--ranks", "0"],
            "--ranks",
            "1..=1024",
        ),
    ];
    for (args, flag, range) in cases {
        out_of_range(args, flag, range);
    }
}

#[test]
fn a_hundred_thousand_workers_are_refused_before_the_first_fork() {
    for cmd in [&["train"][..], &["bench", "comm"]] {
        let args: Vec<&str> = cmd.iter().copied().chain(["--nproc", "100000"]).collect();
        out_of_range(&args, "--nproc", "1..=1024");
    }
    out_of_range(&["train", "--nproc", "0"], "--nproc", "1..=1024");
}

#[test]
fn a_closed_stdout_ends_ckpt_ls_quietly() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ckpts");
    std::fs::create_dir(&root).unwrap();
    // `ckpt ls | head -c1` with `head` gone before the first write: the write fails for sure.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let (status, err) = run_to_with_deadline(
        tmp.path(),
        &["ckpt", "ls", root.to_str().unwrap()],
        writer.into(),
        DEADLINE,
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(status.signal(), Some(libc::SIGPIPE), "{status}: {err}");
}

/// Asserts `train` with `extra` and `--ckpt-dir` is refused (exit `code`, naming `named`)
/// without creating the directory.
fn refused_without_ckpt_dir(extra: &[&str], code: i32, named: &[&str]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let mut args = train(extra);
    args.extend(["--ckpt-dir".into(), dir.to_str().unwrap().into()]);
    let err = refused(&args, code, named);
    assert!(!dir.exists(), "{} created by a refused run", dir.display());
    err
}

#[test]
fn a_refused_run_creates_no_checkpoint_directory() {
    // Refused by the launcher before any worker starts.
    refused_without_ckpt_dir(
        &["--nproc", "2", "--tp", "3"],
        REFUSED,
        &["--tp 3", "does not divide the world of 2"],
    );
    // Refused by the workers (the training state cannot fit in memory): none creates it, and
    // the launcher exits with the refusal code too (launch::exit's table).
    refused_without_ckpt_dir(
        &["--nproc", "2", "--layers", "4", "--d-model", "200000"],
        REFUSED,
        &["refused its configuration", "not restarted"],
    );
}

#[test]
fn a_pipeline_deeper_than_the_model_is_refused_before_spawning() {
    let err = refused_without_ckpt_dir(
        &[
            "--nproc",
            "2",
            "--pp",
            "2",
            "--layers",
            "1",
            "--max-restarts",
            "3",
        ],
        REFUSED,
        &[
            "--pp 2 x 1 chunk(s) per stage = 2 pipeline chunks",
            "1 blocks (--layers)",
        ],
    );
    assert!(
        !err.contains("restart") && !err.contains("generation"),
        "{err}"
    );
}

#[test]
fn flags_in_range_still_parse() {
    let tmp = tempfile::tempdir().unwrap();
    let args = train(&["--steps", "1", "--peak-gflops", "0.5", "--grad-clip", "1"]);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let (status, out, err) = run_with_deadline(tmp.path(), &argv, Duration::from_secs(120));
    assert!(status.success(), "{err}");
    assert!(out.lines().any(|l| l.starts_with("step ")), "{out}");
}

/// Runs `flotilla args...` with `env` set, killing it at [`DEADLINE`]; returns (success,
/// stderr).
fn run_env(args: &[&str], env: (&str, &std::path::Path)) -> (bool, String) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(args)
        .env(env.0, env.1)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > DEADLINE {
            child.kill().unwrap();
            panic!("flotilla {args:?} with {env:?} still running after {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn a_fifo_or_device_as_config_or_secret_file_is_refused_in_time() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("fifo.toml");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let zero = tmp.path().join("zero.toml");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    for (file, what) in [(&fifo, "FIFO"), (&zero, "character device")] {
        let mut args = train(&["--steps", "1"]);
        args.extend(["--config".into(), file.to_str().unwrap().into()]);
        let (status, _, err) = run_with_deadline(
            tmp.path(),
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
            DEADLINE,
        );
        assert!(!status.success(), "--config {what}");
        assert!(
            err.contains(file.to_str().unwrap()) && err.contains(what),
            "{err}"
        );

        let args = train(&["--steps", "1", "--nproc", "2"]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, err) = run_env(&args, ("FLOTILLA_SECRET_FILE", file));
        assert!(!ok, "secret file {what}");
        assert!(
            err.contains(file.to_str().unwrap()) && err.contains(what),
            "{err}"
        );
    }
}
