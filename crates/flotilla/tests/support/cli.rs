//! Running the built `flotilla` binary from integration tests.
#![allow(dead_code)]

use std::process::Command;

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
