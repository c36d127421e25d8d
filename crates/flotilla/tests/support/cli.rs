//! Running the built `flotilla` binary from integration tests.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Runs `flotilla args...`; returns (success, stdout, stderr).
pub fn flotilla(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(args)
        .output()
        .expect("run flotilla");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// A one-layer, 32-wide model trained on 2 threads in a blink (`train`), in
/// one process (`--nproc 1`; a later `--nproc N` overrides it).
pub const MICRO: &[&str] = &[
    "--nproc",
    "1",
    "--config",
    "tiny",
    "--layers",
    "1",
    "--d-model",
    "32",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--batch",
    "4",
    "--threads",
    "2",
    "--peak-gflops",
    "100",
    "--no-progress",
];

/// The loss `train` printed for step `step` of `total` (as printed).
pub fn loss_at(out: &str, step: u64, total: u64) -> String {
    let tag = format!("step {step:>6}/{total} loss ");
    let line = out
        .lines()
        .find(|l| l.starts_with(&tag))
        .unwrap_or_else(|| panic!("no {tag:?} in:\n{out}"));
    line[tag.len()..]
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// `train` with [`MICRO`] as one worker of one thread on node `node` of a job whose store is
/// at `rdzv` (a host of its own, e.g. a network namespace); the caller adds the rest.
pub fn micro_on_node(node: usize, rdzv: &str) -> Vec<String> {
    let mut args = vec!["train".to_string()];
    let mut micro = MICRO.iter();
    while let Some(&arg) = micro.next() {
        if arg == "--threads" || arg == "--nproc" {
            micro.next();
        } else {
            args.push(arg.into());
        }
    }
    let node = node.to_string();
    for a in [
        "--threads",
        "1",
        "--nproc",
        "1",
        "--node-rank",
        &node,
        "--rdzv",
        rdzv,
    ] {
        args.push(a.into());
    }
    args
}

/// Runs `flotilla args...` with stdin closed, `stdout` as its standard output and its standard
/// error in a file in `scratch`, killing it at `deadline`; returns (status, stderr). Fails the
/// test if it was still running then.
pub fn run_to_with_deadline(
    scratch: &Path,
    args: &[&str],
    stdout: Stdio,
    deadline: Duration,
) -> (ExitStatus, String) {
    let err_path = scratch.join("stderr.txt");
    let mut child = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("flotilla {args:?} still running after {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, std::fs::read_to_string(&err_path).unwrap())
}

/// [`run_to_with_deadline`] with the standard output in a file in `scratch`; returns (status,
/// stdout, stderr).
pub fn run_with_deadline(
    scratch: &Path,
    args: &[&str],
    deadline: Duration,
) -> (ExitStatus, String, String) {
    let out_path = scratch.join("stdout.txt");
    let stdout = std::fs::File::create(&out_path).unwrap();
    let (status, err) = run_to_with_deadline(scratch, args, stdout.into(), deadline);
    (status, std::fs::read_to_string(&out_path).unwrap(), err)
}
