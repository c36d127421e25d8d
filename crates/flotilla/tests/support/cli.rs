//! Running the built `flotilla` binary from integration tests.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, channel};
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

/// The step a pre-empted run said it stops after (`# stop requested (SIGTERM): stopping after
/// step N`).
pub fn stop_step(out: &str) -> u64 {
    let tag = "# stop requested (SIGTERM): stopping after step ";
    let at = out
        .find(tag)
        .unwrap_or_else(|| panic!("no stop in:\n{out}"));
    out[at + tag.len()..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no step after {tag:?} in:\n{out}"))
}

/// `train` with [`MICRO`] less the flags `drop` (and their values), for the caller to set.
pub fn train_micro_without(drop: &[&str]) -> Vec<String> {
    let mut args = vec!["train".to_string()];
    let mut micro = MICRO.iter();
    while let Some(&arg) = micro.next() {
        if drop.contains(&arg) {
            micro.next();
        } else {
            args.push(arg.into());
        }
    }
    args
}

/// `train` with [`MICRO`] as one worker of one thread on node `node` of a job whose store is
/// at `rdzv` (a host of its own, e.g. a network namespace); the caller adds the rest.
pub fn micro_on_node(node: usize, rdzv: &str) -> Vec<String> {
    let mut args = train_micro_without(&["--threads", "--nproc"]);
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

/// A running `flotilla`, its stdout lines arriving on a channel (and kept).
pub struct Running {
    /// The process.
    pub child: Child,
    lines: Receiver<String>,
    /// Its stdout so far.
    pub out: String,
}

impl Running {
    /// Starts `cmd` with stdout and stderr piped.
    pub fn start(cmd: &mut Command) -> Running {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start flotilla");
        let (tx, lines) = channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Running {
            child,
            lines,
            out: String::new(),
        }
    }

    /// Waits (at most two minutes) for a stdout line starting with `prefix`; the line.
    pub fn wait_for(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if let Ok(line) = self.lines.recv_timeout(Duration::from_millis(200)) {
                self.out.push_str(&line);
                self.out.push('\n');
                if line.starts_with(prefix) {
                    return line;
                }
            }
        }
        panic!("no line starting {prefix:?} within 2 min:\n{}", self.out);
    }

    /// Waits (at most two minutes) for the exit: (code, stdout, stderr, time taken).
    pub fn finish(mut self) -> (Option<i32>, String, String, Duration) {
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "no exit:\n{}",
                self.out
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let took = t0.elapsed();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.out.push_str(&line);
            self.out.push('\n');
        }
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            std::io::Read::read_to_string(&mut e, &mut err).unwrap();
        }
        (status.code(), self.out, err, took)
    }
}
