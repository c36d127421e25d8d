//! `flotilla train --tp / --pp` through the binary (issue 8): a checkpoint saved under DP4 loads
//! under DP2 x TP2, PP2 x DP2 and PP2 x TP2, and back, and training continues with the losses
//! of a run whose layout never changed. Every layout trains the same global batch of 8 rows a step:
//! DP4 with --batch 2; DP2 x TP2 and PP2 x DP2 with --batch 2 --grad-accum 2 (each replica 2
//! micro-batches of 2 rows); PP2 x TP2 (one replica, Megatron blocks inside each stage) with
//! --batch 2 --grad-accum 4; each update is the mean of the same four 2-row means (summation
//! order aside), and --grad-accum is not part of the config hash (the batch is), so the
//! checkpoints are interchangeable. Every save is asynchronous (the default): each rank's
//! pieces copied into the host buffer and written in the background, rank 0 committing. Also: bad degrees are
//! refused before any worker starts, with the equation.

#[path = "support/cli.rs"]
mod cli;

use cli::{MICRO, flotilla, loss_at};
use std::sync::{Mutex, MutexGuard};

/// One job at a time: 4 workers on a 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const STEPS: u64 = 6;
const HALF: u64 = 3;

/// The layouts, as flags after MICRO (whose --batch and --nproc they override).
const DP4: &[&str] = &["--nproc", "4", "--batch", "2"];
const DP2_TP2: &[&str] = &[
    "--nproc",
    "4",
    "--tp",
    "2",
    "--batch",
    "2",
    "--grad-accum",
    "2",
];
const PP2_TP2: &[&str] = &[
    "--nproc",
    "4",
    "--pp",
    "2",
    "--tp",
    "2",
    "--batch",
    "2",
    "--grad-accum",
    "4",
];
const PP2_DP2: &[&str] = &[
    "--nproc",
    "4",
    "--pp",
    "2",
    "--batch",
    "2",
    "--grad-accum",
    "2",
];

/// Trains `layout` up to step `steps` in `dir` (resuming from what it holds), every step
/// logged, a checkpoint at step [`HALF`] and at the end; returns stdout.
fn run(layout: &[&str], steps: u64, dir: &std::path::Path) -> String {
    let steps = steps.to_string();
    let dir = dir.to_str().unwrap();
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(layout);
    args.extend_from_slice(&[
        // Two blocks, so two pipeline stages have one each.
        "--layers",
        "2",
        "--threads",
        "1",
        "--steps",
        &steps,
        "--log-every",
        "1",
        "--ckpt-dir",
        dir,
        "--ckpt-every",
        "3",
        "--no-plan",
        "--max-restarts",
        "0",
    ]);
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "flotilla {args:?} failed:\n{out}\n{err}");
    out
}

/// The losses of steps `from..=to` of a run of `total` steps, as printed.
fn losses(out: &str, from: u64, to: u64, total: u64) -> Vec<f64> {
    (from..=to)
        .map(|s| loss_at(out, s, total).parse().unwrap())
        .collect()
}

/// Saves under `first` at step 3, resumes under `second` to step 6; the losses of steps 4-6
/// equal the straight DP4 run's within the printed precision and summation order.
fn moves(first: &[&str], second: &[&str], straight: &[f64]) {
    let dir = tempfile::tempdir().unwrap();
    let a = run(first, HALF, dir.path());
    let b = run(second, STEPS, dir.path());
    assert!(
        b.contains("# resumed from ") && b.contains(&format!(" step {HALF}")),
        "{b}"
    );
    let got = losses(&b, HALF + 1, STEPS, STEPS);
    for (i, (g, w)) in got.iter().zip(straight).enumerate() {
        assert!(
            (g - w).abs() <= 2e-4,
            "step {}: {g} after the move vs {w} straight\n--- first\n{a}\n--- second\n{b}",
            HALF + 1 + i as u64
        );
    }
}

/// The straight DP4 run's losses of steps 4-6, and the first three (for the first half).
fn straight() -> (Vec<f64>, Vec<f64>) {
    let dir = tempfile::tempdir().unwrap();
    let out = run(DP4, STEPS, dir.path());
    (
        losses(&out, 1, HALF, STEPS),
        losses(&out, HALF + 1, STEPS, STEPS),
    )
}

#[test]
fn a_dp4_checkpoint_moves_to_dp2_x_tp2_pp2_x_dp2_and_pp2_x_tp2_and_back() {
    let _serial = serial();
    let (head, tail) = straight();
    // The mesh layouts' own first halves match DP4's too.
    for layout in [DP2_TP2, PP2_DP2, PP2_TP2] {
        let dir = tempfile::tempdir().unwrap();
        let out = run(layout, HALF, dir.path());
        for (i, (g, w)) in losses(&out, 1, HALF, HALF).iter().zip(&head).enumerate() {
            assert!(
                (g - w).abs() <= 2e-4,
                "{layout:?} step {}: {g} vs {w}\n{out}",
                i + 1
            );
        }
    }
    moves(DP4, DP2_TP2, &tail);
    moves(DP4, PP2_DP2, &tail);
    moves(DP2_TP2, DP4, &tail);
    moves(PP2_DP2, DP4, &tail);
    moves(DP4, PP2_TP2, &tail);
    moves(PP2_TP2, DP4, &tail);
}

#[test]
fn bad_degrees_are_refused_before_any_worker_starts() {
    let _serial = serial();
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&["--nproc", "2", "--tp", "3", "--steps", "1"]);
    let (ok, out, err) = flotilla(&args);
    assert!(!ok, "{out}");
    assert!(
        err.contains("--tp 3 x --pp 1 = 3 does not divide the world of 2 workers"),
        "{err}"
    );
    assert!(!out.contains("step "), "{out}");
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&["--nproc", "1", "--pp", "2", "--steps", "1"]);
    let (ok, _, err) = flotilla(&args);
    assert!(
        !ok && err.contains("--tp 1 x --pp 2 = 2 does not divide the world of 1"),
        "{err}"
    );
}
