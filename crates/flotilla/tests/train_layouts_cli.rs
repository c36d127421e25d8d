//! Every layout honours the run loop's features through the binary (issue 27, "one engine":
//! nothing silently ignored). DP2 x TP2, PP2 x DP2 and PP2 x TP2 runs each write `--metrics`
//! JSON lines (a record per step, MFU against the given peak), `--save` a model that
//! `flotilla generate` loads, and `--export-hf` a Hugging Face directory; each prints MFU on
//! its step lines and the planner beside its end. Before the one run loop the mesh runs
//! ignored all three flags.

#[path = "support/cli.rs"]
mod cli;

use cli::{MICRO, flotilla};
use std::sync::{Mutex, MutexGuard};

/// One job at a time: 4 workers on a 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const STEPS: u64 = 3;

/// Runs `flotilla train` with [`MICRO`] on two blocks and one thread per worker, every step
/// logged, no forecast, then `layout` and `extra`; asserts it succeeds and returns stdout.
fn train_ok(layout: &[&str], extra: &[&str]) -> String {
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(layout);
    args.extend_from_slice(&["--layers", "2", "--threads", "1", "--log-every", "1"]);
    args.extend_from_slice(&["--no-plan"]);
    args.extend_from_slice(extra);
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "flotilla {args:?} failed:\n{out}\n{err}");
    out
}

/// The step lines of `out` up to their learning rate (step, loss).
fn losses(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| l.split(" lr ").next().unwrap_or(l).to_string())
        .collect()
}

/// Trains `layout` for [`STEPS`] with metrics, a saved model and an export in `dir`; checks
/// each output.
fn outputs_of(layout: &[&str]) {
    let _one = serial();
    let tmp = tempfile::tempdir().unwrap();
    let (metrics, saved, hf) = (
        tmp.path().join("m.jsonl"),
        tmp.path().join("saved"),
        tmp.path().join("hf"),
    );
    let steps = STEPS.to_string();
    let out = train_ok(
        layout,
        &[
            "--steps",
            &steps,
            "--max-restarts",
            "0",
            "--metrics",
            metrics.to_str().unwrap(),
            "--save",
            saved.to_str().unwrap(),
            "--export-hf",
            hf.to_str().unwrap(),
        ],
    );
    assert!(
        out.contains(&format!("step      {STEPS}/{STEPS} loss")),
        "{out}"
    );
    assert!(out.contains(" MFU "), "MFU on the step lines:\n{out}");
    assert!(
        out.contains("; planner "),
        "the planner beside the end:\n{out}"
    );
    assert!(out.contains("# saved to "), "{out}");
    assert!(out.contains("# exported Hugging Face layout to "), "{out}");
    // One record per step, then the summary; MFU measured against the given peak.
    let text = std::fs::read_to_string(&metrics).unwrap();
    let records: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<&serde_json::Value> = records
        .iter()
        .filter(|r| r.get("step").is_some() && r.get("loss").is_some())
        .collect();
    assert_eq!(steps.len(), STEPS as usize, "{text}");
    for r in &steps {
        let mfu = r["mfu"].as_f64().unwrap();
        assert!(mfu > 0.0 && mfu < 1.0, "mfu {mfu} in {r}");
        assert_eq!(r["world"].as_u64(), Some(4), "{r}");
    }
    // The saved model loads and generates; the export holds a config and the weights.
    let (ok, gen_out, err) = flotilla(&[
        "generate",
        "--model",
        saved.to_str().unwrap(),
        "--prompt",
        "1 2 3",
        "--tokens",
        "5",
        "--temperature",
        "0",
    ]);
    assert!(ok, "generate failed:\n{gen_out}\n{err}");
    assert!(!gen_out.trim().is_empty());
    for f in ["config.json", "model.safetensors"] {
        assert!(hf.join(f).is_file(), "{f} missing from the export");
    }
}

#[test]
fn dp2_x_tp2_writes_metrics_a_saved_model_and_an_export() {
    outputs_of(&[
        "--nproc",
        "4",
        "--tp",
        "2",
        "--batch",
        "2",
        "--grad-accum",
        "2",
    ]);
}

#[test]
fn pp2_x_dp2_writes_metrics_a_saved_model_and_an_export() {
    outputs_of(&[
        "--nproc",
        "4",
        "--pp",
        "2",
        "--batch",
        "2",
        "--grad-accum",
        "2",
    ]);
}

#[test]
fn pp2_x_tp2_writes_metrics_a_saved_model_and_an_export() {
    outputs_of(&[
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
    ]);
}

/// The step lines of a `layout` run of [`STEPS`] steps (no outputs).
fn step_lines(layout: &[&str]) -> Vec<String> {
    let _one = serial();
    let steps = STEPS.to_string();
    losses(&train_ok(
        layout,
        &["--steps", &steps, "--max-restarts", "0"],
    ))
}

#[test]
fn pp2_x_dp2_with_zero1_trains_the_losses_of_pp2_x_dp2() {
    let pp_dp = [
        "--nproc",
        "4",
        "--pp",
        "2",
        "--batch",
        "2",
        "--grad-accum",
        "2",
    ];
    let plain = step_lines(&pp_dp);
    let mut zero1 = pp_dp.to_vec();
    zero1.extend_from_slice(&["--zero", "1"]);
    assert_eq!(plain.len(), STEPS as usize);
    assert_eq!(
        step_lines(&zero1),
        plain,
        "ZeRO-1 inside the stages is exact"
    );
}

/// Recompute under DP x TP: every block keeps only its output and runs forward again (its
/// all-reduces too) in the backward, so the losses are the plain run's, bit for bit.
#[test]
fn dp2_x_tp2_with_recompute_trains_the_losses_of_dp2_x_tp2() {
    let dp_tp = ["--nproc", "4", "--tp", "2", "--batch", "2"];
    let plain = step_lines(&dp_tp);
    let mut recompute = dp_tp.to_vec();
    recompute.push("--recompute");
    assert_eq!(plain.len(), STEPS as usize);
    assert_eq!(step_lines(&recompute), plain, "recompute is exact");
}

/// `--sp`: DP2 x TP2 with sequence parallelism trains the losses of DP2 x TP2 (within float
/// summation order) and prints its activations per layer, measured from the arena, within 10%
/// of the planner's term for this engine and below the run without it.
#[test]
fn dp2_x_tp2_with_sequence_parallelism_trains_and_saves_activation_memory() {
    let _one = serial();
    let dp_tp = ["--nproc", "4", "--tp", "2", "--batch", "2"];
    let extra = ["--steps", "3", "--max-restarts", "0"];
    let plain = train_ok(&dp_tp, &extra);
    let mut sp = dp_tp.to_vec();
    sp.push("--sp");
    let with = train_ok(&sp, &extra);
    let (a, b) = (loss_values(&with), loss_values(&plain));
    assert_eq!(a.len(), 3, "{with}");
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-4 * y.abs(), "--sp loss {x} vs {y}");
    }
    // "...: X MB measured; planner Y MB for this engine, published formula Z MB"
    let mb = |out: &str| -> (f64, f64) {
        let line = out
            .lines()
            .find(|l| l.starts_with("# activations per layer"))
            .unwrap_or_else(|| panic!("no activation line:\n{out}"));
        let nums: Vec<f64> = line
            .split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter_map(|w| w.parse().ok())
            .collect();
        let n = nums.len();
        (nums[n - 3], nums[n - 2])
    };
    let (on, on_plan) = mb(&with);
    let (off, _) = mb(&plain);
    assert!((on - on_plan).abs() <= 0.1 * on_plan, "{with}");
    assert!(on < off, "--sp {on} MB vs {off} MB without:\n{with}");
}

/// DP2 x TP2 sets the planner's forecast beside the measurement component by component, its
/// tensor-parallel sums priced as their own line (the mesh runs' other figures: tokens/s,
/// state, activations).
#[test]
fn dp2_x_tp2_prints_the_forecast_beside_the_measurement() {
    let _one = serial();
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&["--nproc", "4", "--tp", "2", "--batch", "2", "--layers", "2"]);
    args.extend_from_slice(&["--threads", "1", "--steps", "3", "--max-restarts", "0"]);
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "{out}\n{err}");
    for needle in [
        "# plan beside measured, per step",
        "tensor-parallel sums over tp 2 (all-reduces of (N, C))",
        "# step forecast ",
        "# activations per layer and micro-batch (tp 2, sequence parallel off)",
    ] {
        assert!(out.contains(needle), "no {needle:?} in:\n{out}");
    }
}

/// PP2 x TP2 with sequence parallelism (each stage's TP ranks keep half the rows and send the
/// next stage only those) and recompute: the losses of PP2 x TP2 within float summation order.
#[test]
fn pp2_x_tp2_with_sequence_parallelism_and_recompute_trains_the_plain_losses() {
    let _one = serial();
    let pp_tp = ["--nproc", "4", "--tp", "2", "--pp", "2", "--batch", "2"];
    let extra = ["--steps", "3", "--max-restarts", "0", "--grad-accum", "2"];
    let plain = train_ok(&pp_tp, &extra);
    let mut sp = pp_tp.to_vec();
    sp.extend_from_slice(&["--sp", "--recompute"]);
    let with = train_ok(&sp, &extra);
    let (a, b) = (loss_values(&with), loss_values(&plain));
    assert_eq!(a.len(), 3, "{with}");
    for (x, y) in a.iter().zip(&b) {
        assert!(
            (x - y).abs() <= 1e-4 * y.abs(),
            "--sp --recompute loss {x} vs {y}"
        );
    }
}

/// The state line's three measured and three planned megabytes.
fn state_mb(out: &str) -> ([f64; 3], [f64; 3]) {
    let line = out
        .lines()
        .find(|l| l.starts_with("# state per rank (largest):"))
        .unwrap_or_else(|| panic!("no state line in:\n{out}"));
    let nums: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse().ok())
        .collect();
    // params, grads, optimizer, then the planner's three.
    let n = nums.len();
    (
        [nums[n - 6], nums[n - 5], nums[n - 4]],
        [nums[n - 3], nums[n - 2], nums[n - 1]],
    )
}

/// Losses of `out`'s step lines, as numbers.
fn loss_values(out: &str) -> Vec<f64> {
    losses(out)
        .iter()
        .filter_map(|l| {
            l.split("loss ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

#[test]
fn dp2_x_tp2_with_zero1_and_zero3_hold_the_planners_state() {
    let _one = serial();
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let ck = ck.to_str().unwrap();
    let run_to = |zero: &str, steps: &str, ck: Option<&str>| -> String {
        let layout = ["--nproc", "4", "--tp", "2", "--zero", zero, "--batch", "2"];
        let mut extra = vec!["--grad-accum", "2", "--steps", steps, "--max-restarts", "0"];
        if let Some(dir) = ck {
            extra.extend_from_slice(&["--ckpt-dir", dir, "--ckpt-every", "2"]);
        }
        train_ok(&layout, &extra)
    };
    let plain = run_to("0", "3", None);
    let zero1 = run_to("1", "3", None);
    assert_eq!(
        losses(&zero1),
        losses(&plain),
        "ZeRO-1 over the replicas is exact"
    );
    let (measured, planned) = state_mb(&zero1);
    let (whole, _) = state_mb(&plain);
    // The optimizer state halves over the two replicas; each figure within 5% of the planner's.
    assert!(
        (measured[2] - whole[2] / 2.0).abs() <= 0.01 * whole[2],
        "{zero1}"
    );
    for (m, p) in measured.iter().zip(&planned) {
        assert!(
            (m - p).abs() <= 0.05 * p,
            "measured {m} MB vs planner {p} MB:\n{zero1}"
        );
    }
    // ZeRO-3 over the replicas (FSDP x TP): parameters, gradients and optimizer state halve
    // over the two replicas, each within 5% of the planner's; the losses are the plain run's
    // within float summation order.
    let zero3 = run_to("3", "3", None);
    let (measured, planned) = state_mb(&zero3);
    for (m, p) in measured.iter().zip(&planned) {
        assert!(
            (m - p).abs() <= 0.05 * p,
            "ZeRO-3: measured {m} MB vs planner {p} MB:\n{zero3}"
        );
    }
    let (a, b) = (loss_values(&zero3), loss_values(&plain));
    assert_eq!(a.len(), 3, "{zero3}");
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-4 * y.abs(), "ZeRO-3 loss {x} vs {y}");
    }
    // A ZeRO-1 checkpoint (each rank writing its owned parts) resumes to the straight run.
    run_to("1", "2", Some(ck));
    let resumed = run_to("1", "3", Some(ck));
    assert!(
        resumed.contains(&format!("# resumed from {ck} step 2")),
        "{resumed}"
    );
    assert_eq!(losses(&resumed), losses(&plain)[2..], "{resumed}");
}

/// ZeRO-1 inside tensor-parallel pipeline stages (PP2 x TP2 x DP2, eight workers): each
/// replica of a TP rank keeps half of that rank's moments; AdamW is elementwise, so every step
/// line is the plain run's, bit for bit, and a save at step 2 (the replicas' moment shards
/// written whole) resumes to the straight run's step 3.
#[test]
fn pp2_x_tp2_x_dp2_with_zero1_trains_and_resumes_the_plain_losses() {
    let _one = serial();
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let ck = ck.to_str().unwrap();
    let mesh = [
        "--nproc",
        "8",
        "--pp",
        "2",
        "--tp",
        "2",
        "--batch",
        "2",
        "--grad-accum",
        "2",
    ];
    // Each step's loss, learning rate and gradient norm, as printed.
    let lines = |out: &str| -> Vec<String> {
        out.lines()
            .filter(|l| l.starts_with("step "))
            .filter_map(|l| l.split(" loss ").nth(1))
            .map(|l| l.split(" tokens/s").next().unwrap_or(l).to_string())
            .collect()
    };
    let plain = lines(&train_ok(&mesh, &["--steps", "3", "--max-restarts", "0"]));
    let mut zero1 = mesh.to_vec();
    zero1.extend_from_slice(&["--zero", "1", "--max-restarts", "0", "--ckpt-dir", ck]);
    let first = lines(&train_ok(&zero1, &["--steps", "2"]));
    assert_eq!(first[..], plain[..2], "ZeRO-1's first two steps");
    let out = train_ok(&zero1, &["--steps", "3"]);
    assert!(
        out.contains(&format!("# resumed from {ck} step 2")),
        "{out}"
    );
    assert_eq!(lines(&out), plain[2..], "the resumed third step");
}

/// `--bf16` in pipeline stages (PP2 x DP2 and PP2 x TP2): each stage keeps f32 master
/// weights of its ranges and computes with their bf16 values, as the data-parallel trainer
/// does, so both train DP4's bf16 losses (within bf16's rounding of differently ordered
/// sums); a bf16 pipeline save (the master weights) resumes to its straight run's step lines.
#[test]
fn pipelines_train_in_bf16_and_resume() {
    let _one = serial();
    let lines = |out: &str| -> Vec<String> {
        out.lines()
            .filter(|l| l.starts_with("step "))
            .filter_map(|l| l.split(" loss ").nth(1))
            .map(|l| l.split(" tokens/s").next().unwrap_or(l).to_string())
            .collect()
    };
    let dp4 = ["--nproc", "4", "--batch", "2", "--bf16"];
    let want = loss_values(&train_ok(&dp4, &["--steps", "3", "--max-restarts", "0"]));
    let pp2_dp2 = [
        "--nproc",
        "4",
        "--pp",
        "2",
        "--batch",
        "2",
        "--grad-accum",
        "2",
    ];
    let pp2_tp2 = ["--nproc", "4", "--pp", "2", "--tp", "2", "--batch", "2"];
    for layout in [
        &pp2_dp2[..],
        &[&pp2_tp2[..], &["--grad-accum", "4"]].concat(),
    ] {
        let mut bf16 = layout.to_vec();
        bf16.extend_from_slice(&["--bf16", "--max-restarts", "0"]);
        let straight = train_ok(&bf16, &["--steps", "3"]);
        let got = loss_values(&straight);
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 2e-3,
                "{layout:?}: {got:?} vs DP4 bf16 {want:?}"
            );
        }
        let tmp = tempfile::tempdir().unwrap();
        let ck = tmp.path().join("ck");
        let ck = ck.to_str().unwrap();
        bf16.extend_from_slice(&["--ckpt-dir", ck]);
        train_ok(&bf16, &["--steps", "2"]);
        let resumed = train_ok(&bf16, &["--steps", "3"]);
        assert!(
            resumed.contains(&format!("# resumed from {ck} step 2")),
            "{resumed}"
        );
        assert_eq!(lines(&resumed), lines(&straight)[2..], "{layout:?}");
    }
}

#[test]
fn what_a_mesh_engine_does_not_build_is_refused_before_spawning() {
    for (layout, want) in [
        (
            &["--nproc", "4", "--pp", "2", "--zero", "2"][..],
            "--zero 2 with --pp 2",
        ),
        (
            &["--nproc", "4", "--pp", "2", "--zero", "1", "--bf16"][..],
            "--zero 1 with --bf16 and --pp 2",
        ),
    ] {
        let mut args = vec!["train"];
        args.extend_from_slice(MICRO);
        args.extend_from_slice(layout);
        // Two blocks, so a two-stage pipeline is itself fine.
        args.extend_from_slice(&["--layers", "2", "--steps", "1"]);
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
}

/// Flips the last byte of `file` (tensor data: a chunk checksum fails on read).
fn damage(file: &std::path::Path) {
    let mut bytes = std::fs::read(file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x55;
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn a_mesh_run_falls_back_past_a_damaged_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let ck_s = ck.to_str().unwrap();
    let dp_tp = [
        "--nproc",
        "4",
        "--tp",
        "2",
        "--batch",
        "2",
        "--grad-accum",
        "2",
    ];
    let mut first = dp_tp.to_vec();
    // Synchronous saves here (every rank agreeing on each write); the others are asynchronous.
    first.extend_from_slice(&["--ckpt-dir", ck_s, "--ckpt-every", "2", "--ckpt-sync"]);
    step_lines(&first);
    // Step 3 is the last of the first run; its rank 3 file is damaged.
    let newest = ck.join("step-3").join("rank-00003.safetensors");
    assert!(newest.is_file(), "{newest:?}");
    damage(&newest);
    let _one = serial();
    let extra = [
        "--steps",
        "4",
        "--max-restarts",
        "0",
        "--ckpt-dir",
        ck_s,
        "--ckpt-every",
        "2",
    ];
    let out = train_ok(&dp_tp, &extra);
    assert!(
        out.contains("# checkpoint rejected (lost): step 3"),
        "{out}"
    );
    assert!(
        out.contains(&format!("# resumed from {ck_s} step 2")),
        "{out}"
    );
    assert!(
        out.contains("step      3/4 loss") && out.contains("step      4/4 loss"),
        "{out}"
    );
}

/// Trains `layout` for 6 steps with asynchronous checkpoints every 2 steps and `--save`, with
/// `extra` flags; returns stdout and the saved model's bytes.
fn saved_model(layout: &[&str], extra: &[&str]) -> (String, Vec<u8>) {
    let tmp = tempfile::tempdir().unwrap();
    let (ck, saved) = (tmp.path().join("ck"), tmp.path().join("saved"));
    let mut args = vec!["--steps", "6", "--ckpt-every", "2"];
    args.extend_from_slice(&["--ckpt-dir", ck.to_str().unwrap()]);
    args.extend_from_slice(&["--save", saved.to_str().unwrap()]);
    args.extend_from_slice(extra);
    let out = train_ok(layout, &args);
    let bytes = std::fs::read(saved.join("model.safetensors")).unwrap();
    (out, bytes)
}

#[test]
fn mesh_runs_killed_at_random_end_bit_identical_to_their_twins() {
    let _one = serial();
    for layout in [
        &[
            "--nproc",
            "4",
            "--pp",
            "2",
            "--batch",
            "2",
            "--grad-accum",
            "2",
        ][..],
        &["--nproc", "4", "--tp", "2", "--zero", "1", "--batch", "2"][..],
    ] {
        let (_, twin) = saved_model(layout, &["--max-restarts", "0"]);
        let chaos = [
            "--chaos",
            "kill@random",
            "--chaos-seed",
            "11",
            "--max-restarts",
            "3",
        ];
        let (out, killed) = saved_model(layout, &chaos);
        assert!(
            out.contains("restart 1/3"),
            "{layout:?}: no restart:\n{out}"
        );
        assert!(
            killed == twin,
            "{layout:?}: the recovered run's parameters differ from its twin's:\n{out}"
        );
    }
}

#[test]
fn mesh_runs_read_a_token_dataset_and_report_the_stall() {
    let _one = serial();
    let tmp = tempfile::tempdir().unwrap();
    let ds = tmp.path().join("ds");
    let (ok, _, err) = flotilla(&[
        "data",
        "synth",
        "--out",
        ds.to_str().unwrap(),
        "--tokens",
        "2e5",
        "--vocab",
        "257",
        "--shard-size",
        "64KiB",
        "--doc-tokens",
        "1000",
        "--no-progress",
    ]);
    assert!(ok, "{err}");
    for layout in [
        &[
            "--nproc",
            "4",
            "--pp",
            "2",
            "--batch",
            "2",
            "--grad-accum",
            "2",
        ][..],
        &["--nproc", "4", "--tp", "2", "--batch", "2"][..],
    ] {
        let out = train_ok(layout, &["--steps", "3", "--dataset", ds.to_str().unwrap()]);
        assert!(out.contains("# data: stall"), "{layout:?}:\n{out}");
    }
}

/// `examples/3d.toml` (dp 2 x pp 2 x tp 2 with sequence parallelism and ZeRO-1, eight
/// workers) runs on this machine, shortened to one step of shorter rows.
#[test]
fn the_3d_example_runs() {
    let _one = serial();
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/3d.toml");
    let args = [
        "train",
        "--config",
        file,
        "--steps",
        "1",
        "--seq-len",
        "32",
        "--no-plan",
    ];
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "{out}\n{err}");
    assert!(
        out.contains("# mesh: dp 2 x pp 2 x tp 2 over 8 workers"),
        "{out}"
    );
    assert!(out.contains("step      1/1 loss "), "{out}");
}
