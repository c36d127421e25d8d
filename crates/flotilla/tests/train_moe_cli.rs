//! The model with experts, split over the data-parallel ranks, through the binary under the
//! one run loop (issue 27): `--experts 4 --top-k 2 --nproc 2 --ep 2` (DP2 x EP2) trains with
//! `--metrics` (a record per step) and prints the losses of `--nproc 1 --experts 4` on the
//! same global batch, and DP4 with two EP groups of two trains; DP2 x TP2 x EP2 trains the
//! same losses and its checkpoint resumes under DP2 x EP2; a checkpoint at step 2 resumed to step 4 prints the straight run's step
//! lines (also resumed by EP 1, accumulating the global batch); what is not built with experts
//! is refused before any step, exit 78, naming the flag.

#[path = "support/cli.rs"]
mod cli;

use cli::{MICRO, flotilla};
use std::sync::{Mutex, MutexGuard};

/// One job at a time: 2 workers on a 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const STEPS: u64 = 4;

/// EP 2 over 2 workers, 2 rows each.
const EP2: &[&str] = &["--nproc", "2", "--ep", "2", "--batch", "2"];
/// EP 1 in one process, the same global batch of 4 rows.
const EP1: &[&str] = &["--nproc", "1", "--batch", "4"];

/// `train` of the micro MoE model (4 experts, top-2, untied head, clipped) for `steps` with
/// `extra`; stdout. The schedule is constant unless `extra` sets one (a schedule's length is
/// `--steps`, part of the config a checkpoint must match).
fn train(extra: &[&str], steps: u64) -> String {
    let steps = steps.to_string();
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&[
        "--untied",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--threads",
        "1",
        "--lr",
        "1e-3",
        "--grad-clip",
        "1.0",
        "--log-every",
        "1",
        "--no-plan",
        "--max-restarts",
        "0",
        "--steps",
        &steps,
    ]);
    args.extend_from_slice(extra);
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "flotilla {args:?} failed:\n{out}\n{err}");
    out
}

/// The step lines up to the throughput (step, loss, lr, |g|).
fn step_lines(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| l.split(" tokens/s").next().unwrap().to_string())
        .collect()
}

/// The printed losses.
fn losses(out: &str) -> Vec<f64> {
    step_lines(out)
        .iter()
        .map(|l| {
            let at = l.find(" loss ").unwrap() + 6;
            l[at..].split_whitespace().next().unwrap().parse().unwrap()
        })
        .collect()
}

#[test]
fn dp2_x_ep2_writes_metrics_and_trains_the_losses_of_ep1() {
    let _one = serial();
    let tmp = tempfile::tempdir().unwrap();
    let metrics = tmp.path().join("m.jsonl");
    // A cosine schedule over the run's steps, after one warmup step.
    let cosine = ["--schedule", "cosine", "--warmup", "1"];
    let mut args = EP2.to_vec();
    args.extend_from_slice(&cosine);
    args.extend_from_slice(&["--metrics", metrics.to_str().unwrap()]);
    let ep2 = train(&args, STEPS);
    println!("{ep2}");
    let l2 = losses(&ep2);
    assert_eq!(l2.len(), STEPS as usize, "{ep2}");
    assert!(l2.iter().all(|l| l.is_finite() && *l > 0.0), "{l2:?}");
    assert!(l2[3] < l2[0], "the loss falls: {l2:?}");
    assert!(ep2.contains("# moe: 4 experts, top-2"), "{ep2}");
    assert!(ep2.contains("assignments dropped by capacity"), "{ep2}");
    assert!(ep2.contains(" MFU "), "{ep2}");
    let text = std::fs::read_to_string(&metrics).unwrap();
    let records: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<_> = records.iter().filter(|r| r["kind"] == "step").collect();
    assert_eq!(steps.len(), STEPS as usize, "{text}");
    for (r, l) in steps.iter().zip(&l2) {
        assert_eq!(r["world"].as_u64(), Some(2), "{r}");
        let loss = r["loss"].as_f64().unwrap();
        assert!((loss - l).abs() < 1e-4, "{r} vs {l}");
        // Tokens are the whole group's: 2 ranks x 2 rows x 32.
        assert_eq!(r["tokens"].as_u64(), Some(128), "{r}");
    }
    assert!(records.iter().any(|r| r["kind"] == "summary"), "{text}");
    let mut args = EP1.to_vec();
    args.extend_from_slice(&cosine);
    let ep1 = train(&args, STEPS);
    println!("{ep1}");
    let fmt = |v: &[f64]| v.iter().map(|l| format!("{l:.4}")).collect::<Vec<_>>();
    assert_eq!(fmt(&losses(&ep1)), fmt(&l2), "EP1 vs EP2 losses");
    // Four ranks in two EP groups of two (each routing its half of the global batch).
    let mut args = vec!["--nproc", "4", "--ep", "2", "--batch", "1"];
    args.extend_from_slice(&cosine);
    let dp4 = train(&args, STEPS);
    assert!(
        dp4.contains("# moe: 4 experts, top-2, capacity factor 1.25, ep 2"),
        "{dp4}"
    );
    let l4 = losses(&dp4);
    assert!(l4.len() == STEPS as usize && l4[3] < l4[0], "{dp4}");
}

#[test]
fn a_checkpoint_at_step_2_resumes_to_the_straight_runs_step_lines() {
    let _one = serial();
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let ck = ck.to_str().unwrap();
    // No aux loss and no drops: one process accumulating the global batch in two micro-batches
    // (a checkpoint fixes the rows per micro-batch) then routes as the group does.
    let same = ["--aux-loss-coef", "0", "--capacity-factor", "4"];
    let mut ep2 = EP2.to_vec();
    ep2.extend_from_slice(&same);
    let straight = step_lines(&train(&ep2, STEPS));
    let mut args = ep2.clone();
    args.extend_from_slice(&["--ckpt-dir", ck, "--ckpt-every", "2"]);
    let first = train(&args, 2);
    assert!(first.contains("# checkpoint step 2: "), "{first}");
    // A copy holding only step 2, for EP 1 to resume below.
    let tmp1 = tempfile::tempdir().unwrap();
    let ck1 = tmp1.path().join("ck");
    copy_dir(std::path::Path::new(ck), &ck1);
    let second = train(&args, STEPS);
    println!("{second}");
    assert!(
        second.contains("resumed from") && second.contains("step 2"),
        "{second}"
    );
    let resumed = step_lines(&second);
    assert_eq!(resumed, straight[2..], "EP2 resumed at step 2");
    // EP 1 on the same global batch resumes the EP 2 checkpoint's step 2 as well (the
    // checkpoint's tensors are the whole model's; each rank reads what it holds).
    let mut args = vec!["--nproc", "1", "--batch", "2", "--grad-accum", "2"];
    args.extend_from_slice(&same);
    args.extend_from_slice(&["--ckpt-dir", ck1.to_str().unwrap()]);
    let ep1 = train(&args, STEPS);
    println!("{ep1}");
    assert!(ep1.contains("step 2"), "{ep1}");
    let fmt = |v: &[f64]| v.iter().map(|l| format!("{l:.4}")).collect::<Vec<_>>();
    let want: Vec<f64> = losses(&straight.join("\n"))[2..].to_vec();
    assert_eq!(fmt(&losses(&ep1)), fmt(&want), "EP1 resumed from EP2");
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

#[test]
fn what_is_not_built_with_experts_is_refused_before_spawning() {
    let _one = serial();
    let tmp = tempfile::tempdir().unwrap();
    let saved = tmp.path().join("saved");
    let saved = saved.to_str().unwrap();
    for (extra, want) in [
        (
            &["--untied", "--nproc", "2", "--tp", "2", "--sp"][..],
            "--sp with --experts 4",
        ),
        (
            &["--nproc", "2", "--zero", "1"][..],
            "--zero 1 with --experts 4",
        ),
        (
            &["--untied", "--export-hf", saved][..],
            "--export-hf with --experts 4",
        ),
        (
            &["--untied", "--nproc", "2", "--ep", "3"][..],
            "--ep 3 must divide the data-parallel degree 2",
        ),
    ] {
        let mut args = vec!["train"];
        args.extend_from_slice(MICRO);
        args.extend_from_slice(&["--experts", "4", "--steps", "1"]);
        args.extend_from_slice(extra);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .args(&args)
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(out.status.code(), Some(78), "{args:?}: {stdout}\n{stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert!(!stdout.contains("step "), "{args:?} trained:\n{stdout}");
    }
    // A MoE flag without --experts, and a value out of range, fail at parse, naming the flag.
    for (args, want) in [
        (&["train", "--ep", "2", "--steps", "1"][..], "--ep"),
        (&["train", "--experts", "4", "--top-k", "3"][..], "--top-k"),
        (
            &["train", "--experts", "4", "--capacity-factor", "0"][..],
            "--capacity-factor",
        ),
    ] {
        let (ok, out, err) = flotilla(args);
        assert!(!ok, "{args:?} ran:\n{out}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!out.contains("step "), "{args:?} trained:\n{out}");
    }
}

#[test]
fn dp2_x_tp2_x_ep2_saves_what_dp2_x_ep2_resumes() {
    let _one = serial();
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let ck = ck.to_str().unwrap();
    // The blocks split over TP pairs, the experts whole on both and split over the replicas.
    let tp = ["--nproc", "4", "--tp", "2", "--ep", "2", "--batch", "2"];
    let straight = step_lines(&train(EP2, STEPS));
    let mut args = tp.to_vec();
    args.extend_from_slice(&["--ckpt-dir", ck, "--ckpt-every", "2"]);
    let first = train(&args, 2);
    assert!(first.contains("# moe: 4 experts, top-2"), "{first}");
    let fmt = |v: &[f64]| v.iter().map(|l| format!("{l:.4}")).collect::<Vec<_>>();
    let want: Vec<f64> = losses(&straight.join("\n"));
    assert_eq!(
        fmt(&losses(&first)),
        fmt(&want[..2]),
        "DP2 x TP2 x EP2 vs DP2 x EP2"
    );
    let mut args = EP2.to_vec();
    args.extend_from_slice(&["--ckpt-dir", ck]);
    let resumed = train(&args, STEPS);
    assert!(resumed.contains("resumed from"), "{resumed}");
    assert_eq!(fmt(&losses(&resumed)), fmt(&want[2..]), "DP2 x EP2 resumed");
}
