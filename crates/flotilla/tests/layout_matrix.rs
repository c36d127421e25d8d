//! The layout x feature matrix through the binary (issue 27, "one engine", first must-show).
//!
//! Every layout of the matrix trains the same global batch of 8 rows of 32 tokens a step from
//! one `flotilla data prepare` dataset, and each run of a layout:
//! - saves asynchronous checkpoints (the default) every 2 steps, writes `--metrics` JSON lines
//!   (one record per step), prints the data stall and the planner's forecast beside the
//!   measurement;
//! - `--save`s a model that `flotilla generate` loads, and (dense models) `--export-hf`s a
//!   directory that Hugging Face Transformers loads with our logits (`scripts/hf_check.py`, when
//!   `FLOTILLA_HF_CHECK_PYTHON` names a Python with torch and transformers; CI sets it); an MoE
//!   model's Hugging Face export is refused with the reason;
//! - is run again under `--chaos kill@random`, recovers, and saves the same bytes as the
//!   undisturbed run (its twin);
//! - resumes from its last checkpoint under a different layout, which trains on.

#[path = "support/cli.rs"]
mod cli;

use cli::flotilla;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// One job at a time: up to 4 workers on a 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The model every layout trains: two blocks (one per pipeline stage), 32 wide.
const MODEL: &[&str] = &[
    "--config",
    "tiny",
    "--layers",
    "2",
    "--d-model",
    "32",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--threads",
    "1",
    "--peak-gflops",
    "100",
    "--no-progress",
    "--log-every",
    "1",
];

/// The MoE feed-forward of the MoE layouts (4 experts, top-2; the head untied).
const MOE: &[&str] = &[
    "--experts",
    "4",
    "--top-k",
    "2",
    "--capacity-factor",
    "2",
    "--untied",
];

const STEPS: u64 = 4;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The dataset every run reads: a small corpus through `flotilla data prepare` (byte tokens).
fn dataset() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("layout_matrix");
        std::fs::create_dir_all(&dir).unwrap();
        let corpus = dir.join("corpus.txt");
        let text: String = (0..400)
            .map(|i| {
                format!(
                    "Document {i}: the quick brown fox jumps over the lazy dog {} times.\n\n",
                    i * 7 % 13
                )
            })
            .collect();
        std::fs::write(&corpus, text).unwrap();
        let out = dir.join("ds");
        let (ok, stdout, stderr) = flotilla(&[
            "data",
            "prepare",
            s(&corpus),
            "-o",
            s(&out),
            "--tokenizer",
            "byte",
            "--shard-size",
            "4KiB",
            "--force",
            "--no-progress",
        ]);
        assert!(ok, "data prepare failed:\n{stdout}\n{stderr}");
        out
    })
}

/// `flotilla train` with [`MODEL`], `layout`, the dataset and `extra`; (success, stdout,
/// stderr).
fn train(layout: &[&str], extra: &[&str]) -> (bool, String, String) {
    let mut args = vec!["train"];
    args.extend_from_slice(MODEL);
    args.extend_from_slice(layout);
    args.extend_from_slice(&["--dataset", s(dataset())]);
    args.extend_from_slice(extra);
    flotilla(&args)
}

fn train_ok(layout: &[&str], extra: &[&str]) -> String {
    let (ok, out, err) = train(layout, extra);
    assert!(
        ok,
        "flotilla train {layout:?} {extra:?} failed:\n{out}\n{err}"
    );
    out
}

/// A Python that can run `scripts/hf_check.py`, if `FLOTILLA_HF_CHECK_PYTHON` names one.
fn hf_python() -> Option<String> {
    let py = std::env::var("FLOTILLA_HF_CHECK_PYTHON")
        .ok()
        .filter(|s| !s.is_empty())?;
    let probe = Command::new(&py)
        .args(["-c", "import torch, transformers, safetensors"])
        .output();
    if probe.is_ok_and(|o| o.status.success()) {
        Some(py)
    } else {
        eprintln!("FLOTILLA_HF_CHECK_PYTHON={py} cannot import transformers: HF check skipped");
        None
    }
}

/// Transformers loads the export and computes our logits (`scripts/hf_check.py`).
fn hf_check(dir: &Path) {
    let Some(py) = hf_python() else { return };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/hf_check.py");
    let out = Command::new(py).arg(&script).arg(dir).output().unwrap();
    assert!(
        out.status.success(),
        "hf_check.py {}:\n{}\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The metrics file holds one record per step with a loss and an MFU, then the summary.
fn check_metrics(path: &Path, world: u64) {
    let text = std::fs::read_to_string(path).unwrap();
    let steps: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r.get("step").is_some() && r.get("loss").is_some())
        .collect();
    assert_eq!(steps.len(), STEPS as usize, "{text}");
    for (i, r) in steps.iter().enumerate() {
        assert_eq!(r["step"].as_u64(), Some(i as u64 + 1), "{r}");
        assert!(r["loss"].as_f64().unwrap().is_finite(), "{r}");
        assert_eq!(r["world"].as_u64(), Some(world), "{r}");
    }
}

/// `flotilla generate` loads the saved model and continues a prompt.
fn check_generate(saved: &Path) {
    let (ok, out, err) = flotilla(&[
        "generate",
        "--model",
        s(saved),
        "--prompt",
        "1 2 3",
        "--tokens",
        "4",
        "--temperature",
        "0",
    ]);
    assert!(ok, "generate {}:\n{out}\n{err}", saved.display());
    assert!(!out.trim().is_empty());
}

/// Every piece of the last step's checkpoint in `ck`: (tensor, box, chunk checksums), sorted,
/// and the run state.
fn pieces(ck: &Path) -> (Vec<String>, String) {
    let text =
        std::fs::read_to_string(ck.join(format!("step-{STEPS}")).join("manifest.json")).unwrap();
    let m: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut v: Vec<String> = m["pieces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| format!("{} {} {}", p["tensor"], p["slice"], p["chunks"]))
        .collect();
    v.sort();
    (v, m["state"].to_string())
}

/// One layout of the matrix, and the layout its checkpoint is resumed into.
struct Cell {
    layout: &'static [&'static str],
    world: u64,
    moe: bool,
    resume_into: &'static [&'static str],
}

/// Runs every feature of the matrix under `c` (see the file's doc).
fn matrix_row(c: &Cell) {
    let _one = serial();
    let tmp = tempfile::tempdir().unwrap();
    let p = |n: &str| tmp.path().join(n);
    let steps = STEPS.to_string();
    let mut layout: Vec<&str> = c.layout.to_vec();
    if c.moe {
        layout.extend_from_slice(MOE);
    }
    let common = ["--steps", &steps, "--ckpt-every", "2"];

    // The plain run: every output at once (an MoE model has no Hugging Face format: its
    // export is refused, below).
    let (ck, metrics, saved, hf) = (p("ck"), p("m.jsonl"), p("saved"), p("hf"));
    let mut extra = common.to_vec();
    extra.extend_from_slice(&["--ckpt-dir", s(&ck), "--max-restarts", "0"]);
    extra.extend_from_slice(&["--metrics", s(&metrics), "--save", s(&saved)]);
    if !c.moe {
        extra.extend_from_slice(&["--export-hf", s(&hf)]);
    }
    let out = train_ok(&layout, &extra);
    let last = format!("step {STEPS:>6}/{STEPS} loss ");
    assert!(out.contains(&last), "{out}");
    assert!(out.contains("# checkpoint step 4:"), "{out}");
    assert!(out.contains("# data: stall "), "the stall:\n{out}");
    assert!(
        out.contains("# plan beside measured") && out.contains("# step forecast "),
        "the forecast line:\n{out}"
    );
    check_metrics(&metrics, c.world);
    check_generate(&saved);
    if c.moe {
        assert!(
            out.contains("# moe: 4 experts, top-2"),
            "the routing line:\n{out}"
        );
        let mut refused = layout.clone();
        refused.extend_from_slice(&["--steps", "1", "--export-hf", s(&hf)]);
        let (ok, _, err) = train(&refused, &[]);
        assert!(
            !ok && err.contains("--export-hf") && err.contains("no export there"),
            "--export-hf of an MoE model is refused with the reason:\n{err}"
        );
        assert!(!hf.exists(), "a refused export wrote {}", hf.display());
    } else {
        assert!(hf.join("config.json").is_file() && hf.join("model.safetensors").is_file());
        hf_check(&hf);
    }

    // Killed at random, recovered: the twin's bytes (the saved model, and every piece of the
    // last checkpoint: parameters, moments, run state).
    let (ck2, saved2) = (p("ck2"), p("saved2"));
    let mut extra = common.to_vec();
    extra.extend_from_slice(&["--ckpt-dir", s(&ck2), "--save", s(&saved2)]);
    extra.extend_from_slice(&["--chaos", "kill@random", "--chaos-seed", "7"]);
    extra.extend_from_slice(&["--max-restarts", "3"]);
    let chaos = train_ok(&layout, &extra);
    assert!(chaos.contains("restart 1/3"), "no restart:\n{chaos}");
    assert!(
        pieces(&ck2) == pieces(&ck),
        "the recovered run's last checkpoint differs from its twin's:\n{chaos}"
    );
    let twin = std::fs::read(saved.join("model.safetensors")).unwrap();
    let killed = std::fs::read(saved2.join("model.safetensors")).unwrap();
    assert!(
        killed == twin,
        "the recovered run's parameters differ from its twin's:\n{chaos}"
    );

    // The plain run's checkpoint resumed under another layout, two more steps.
    let mut into: Vec<&str> = c.resume_into.to_vec();
    if c.moe {
        into.extend_from_slice(MOE);
    }
    let more = (STEPS + 2).to_string();
    let resumed = train_ok(
        &into,
        &[
            "--steps",
            &more,
            "--ckpt-dir",
            s(&ck),
            "--max-restarts",
            "0",
        ],
    );
    assert!(
        resumed.contains(&format!("# resumed from {} step {STEPS}", s(&ck))),
        "{resumed}"
    );
    assert!(
        resumed.contains(&format!("step {:>6}/{more} loss ", STEPS + 2)),
        "{resumed}"
    );
}

// Each layout trains 8 rows a step: --batch rows per micro-batch per replica (2 for the dense
// models: part of the configuration a checkpoint must match), times the micro-batches
// (--grad-accum), times the data-parallel replicas.
const DP4: &[&str] = &["--nproc", "4", "--batch", "2"];
const DP2_ZERO3: &[&str] = &[
    "--nproc",
    "2",
    "--zero",
    "3",
    "--batch",
    "2",
    "--grad-accum",
    "2",
];
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
const DP2_TP2_ZERO1: &[&str] = &[
    "--nproc",
    "4",
    "--tp",
    "2",
    "--zero",
    "1",
    "--batch",
    "2",
    "--grad-accum",
    "2",
];
const DP2_TP2_ZERO3: &[&str] = &[
    "--nproc",
    "4",
    "--tp",
    "2",
    "--zero",
    "3",
    "--batch",
    "2",
    "--grad-accum",
    "2",
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
const PP2_DP2_ZERO1: &[&str] = &[
    "--nproc",
    "4",
    "--pp",
    "2",
    "--zero",
    "1",
    "--batch",
    "2",
    "--grad-accum",
    "2",
];
const PP2_TP2_SP: &[&str] = &[
    "--nproc",
    "4",
    "--pp",
    "2",
    "--tp",
    "2",
    "--sp",
    "--batch",
    "2",
    "--grad-accum",
    "4",
];
const DP2_EP2: &[&str] = &[
    "--nproc",
    "2",
    "--ep",
    "2",
    "--batch",
    "2",
    "--grad-accum",
    "2",
];
const PP2_EP2: &[&str] = &[
    "--nproc",
    "4",
    "--pp",
    "2",
    "--ep",
    "2",
    "--batch",
    "2",
    "--grad-accum",
    "2",
];
const EP1: &[&str] = &["--nproc", "1", "--batch", "2", "--grad-accum", "4"];

#[test]
fn dp4() {
    matrix_row(&Cell {
        layout: DP4,
        world: 4,
        moe: false,
        resume_into: DP2_ZERO3,
    });
}

#[test]
fn dp2_zero3() {
    matrix_row(&Cell {
        layout: DP2_ZERO3,
        world: 2,
        moe: false,
        resume_into: DP2_TP2,
    });
}

#[test]
fn dp2_tp2_zero1() {
    matrix_row(&Cell {
        layout: DP2_TP2_ZERO1,
        world: 4,
        moe: false,
        resume_into: PP2_DP2,
    });
}

#[test]
fn dp2_tp2_zero3() {
    matrix_row(&Cell {
        layout: DP2_TP2_ZERO3,
        world: 4,
        moe: false,
        resume_into: DP4,
    });
}

#[test]
fn pp2_dp2_zero1() {
    matrix_row(&Cell {
        layout: PP2_DP2_ZERO1,
        world: 4,
        moe: false,
        resume_into: PP2_TP2_SP,
    });
}

#[test]
fn pp2_tp2_sp() {
    matrix_row(&Cell {
        layout: PP2_TP2_SP,
        world: 4,
        moe: false,
        resume_into: DP2_TP2_ZERO1,
    });
}

#[test]
fn dp2_ep2_moe() {
    matrix_row(&Cell {
        layout: DP2_EP2,
        world: 2,
        moe: true,
        resume_into: EP1,
    });
}

#[test]
fn pp2_ep2_moe() {
    matrix_row(&Cell {
        layout: PP2_EP2,
        world: 4,
        moe: true,
        resume_into: DP2_EP2,
    });
}
