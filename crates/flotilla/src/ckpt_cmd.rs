//! `flotilla ckpt ...`: listing, showing and verifying checkpoints, and the save/load benchmark.
//!
//! `ls`, `show` and `verify` are small and live here; the benchmark has its own module.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ckpt::names::DirState;
use ckpt::{Checkpoint, StepCheck, Verify, open_latest, verify_step};
use serde_json::json;

use crate::data_prepare_cmd::{advance, byte_bar};
use crate::{ckpt_bench_cmd, ckpt_convert_cmd, ckpt_policy_cmd};

/// The `flotilla ckpt` subcommands.
#[derive(clap::Subcommand)]
pub enum CkptCommand {
    /// List every step directory: committed steps and uncommitted leftovers.
    Ls(LsArgs),
    /// Summarise the manifest of the newest committed step (or `--step N`).
    Show(ShowArgs),
    /// Read and checksum every piece of one step, or of every committed step.
    Verify(VerifyArgs),
    /// Save and load bandwidth against the disk's sequential write and read bandwidth.
    Bench(ckpt_bench_cmd::Args),
    /// Convert a step: to a consolidated Hugging Face model, or resharded for N ranks.
    Convert(ckpt_convert_cmd::ConvertArgs),
    /// Retention (--keep-last, --keep-every) and removal of uncommitted leftovers.
    Gc(ckpt_policy_cmd::GcArgs),
    /// Young/Daly checkpoint interval and expected loss from pause, MTBF and restart time.
    Interval(ckpt_policy_cmd::IntervalArgs),
}

/// Options of `flotilla ckpt ls`.
#[derive(clap::Args)]
pub struct LsArgs {
    /// Checkpoint root (holding `step-<N>` directories).
    root: PathBuf,
    /// One JSON array of the step directories (state, tensors, pieces, bytes, world, run).
    #[arg(long)]
    json: bool,
}

/// Options of `flotilla ckpt show`.
#[derive(clap::Args)]
pub struct ShowArgs {
    /// Checkpoint root (holding `step-<N>` directories).
    root: PathBuf,
    /// Step to show (default: the newest loadable committed step).
    #[arg(long)]
    step: Option<u64>,
    /// Print the whole manifest as JSON.
    #[arg(long)]
    json: bool,
}

/// Options of `flotilla ckpt verify`.
#[derive(clap::Args)]
pub struct VerifyArgs {
    /// Checkpoint root (holding `step-<N>` directories).
    root: PathBuf,
    /// Step to verify (default: every committed step).
    #[arg(long)]
    step: Option<u64>,
    /// One JSON object (each step's outcome and the failed steps) instead of lines.
    #[arg(long)]
    json: bool,
    /// Hide the progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    no_progress: bool,
}

/// Runs one `flotilla ckpt` subcommand.
pub fn run(command: CkptCommand) -> Result<()> {
    match command {
        CkptCommand::Ls(a) => ls(&a),
        CkptCommand::Show(a) => show(a),
        CkptCommand::Verify(a) => verify(a),
        CkptCommand::Bench(a) => ckpt_bench_cmd::run(a),
        CkptCommand::Convert(a) => ckpt_convert_cmd::run(a),
        CkptCommand::Gc(a) => ckpt_policy_cmd::run_gc(a),
        CkptCommand::Interval(a) => ckpt_policy_cmd::run_interval(a),
    }
}

/// `flotilla ckpt ls`: one line (or JSON object) per step directory.
fn ls(a: &LsArgs) -> Result<()> {
    let dirs = ckpt::names::step_dirs(&a.root)
        .with_context(|| format!("reading checkpoint root {}", a.root.display()))?;
    let mut rows = vec![];
    for d in &dirs {
        let mut row = json!({"dir": d.name, "step": d.step, "state": d.state});
        match d.state {
            DirState::Committed => match Checkpoint::open(&a.root, d.step, Verify::ManifestOnly) {
                Ok(c) => {
                    let mut summary = c.manifest().summary_json();
                    (summary["dir"], summary["state"]) = (json!(d.name), json!(d.state));
                    row = summary;
                }
                Err(e) => (row["state"], row["error"]) = ("bad".into(), e.to_string().into()),
            },
            DirState::NoMarker => row["note"] = "no COMMIT marker".into(),
            DirState::Staging => row["note"] = "staging directory".into(),
            DirState::Deleting => row["note"] = "being deleted (gc removes it)".into(),
        }
        rows.push(row);
    }
    if a.json {
        println!("{}", serde_json::Value::from(rows));
        return Ok(());
    }
    println!(
        "{:<24} {:<12} {:>8} {:>8} {:>14} {:>6}  RUN",
        "DIR", "STATE", "TENSORS", "PIECES", "BYTES", "WORLD"
    );
    let text = |v: &serde_json::Value| v.as_str().map_or_else(|| v.to_string(), str::to_string);
    for (d, r) in dirs.iter().zip(&rows) {
        let name = &d.name;
        match (d.state, r.get("error")) {
            (DirState::Committed, None) => println!(
                "{name:<24} {:<12} {:>8} {:>8} {:>14} {:>6}  {}",
                "committed",
                r["tensors"],
                r["pieces"],
                r["bytes"],
                r["world"],
                text(&r["run"])
            ),
            (DirState::Committed, Some(e)) => println!("{name:<24} {:<12} {}", "BAD", text(e)),
            (DirState::Deleting, _) => {
                println!("{name:<24} {:<12} {}", "deleting", text(&r["note"]))
            }
            _ => println!("{name:<24} {:<12} {}", "uncommitted", text(&r["note"])),
        }
    }
    if dirs.is_empty() {
        println!("(no step directories in {})", a.root.display());
    }
    Ok(())
}

/// Opens `step`, or the newest loadable committed step (reporting rejected newer ones on
/// stderr).
pub(crate) fn open_step(root: &Path, step: Option<u64>, verify: Verify) -> Result<Checkpoint> {
    match step {
        Some(n) => Checkpoint::open(root, n, verify)
            .with_context(|| format!("opening step {n} of {}", root.display())),
        None => {
            let opened = open_latest(root, verify)?;
            for r in &opened.rejected {
                eprintln!("warning: skipped committed step {}: {}", r.step, r.error);
            }
            Ok(opened.checkpoint)
        }
    }
}

/// `flotilla ckpt show`: the manifest summary or the manifest as JSON.
fn show(a: ShowArgs) -> Result<()> {
    let c = open_step(&a.root, a.step, Verify::ManifestOnly)?;
    let m = c.manifest();
    if a.json {
        println!("{}", serde_json::to_string_pretty(m)?);
        return Ok(());
    }
    println!("dir:         {}", c.dir().display());
    println!("run id:      {}", m.run_id);
    println!("step:        {}", m.step);
    println!("world size:  {}", m.world_size);
    println!("layout:      {}", m.layout);
    println!("config hash: {}", m.config_hash);
    println!(
        "tensors:     {} ({} pieces, {} bytes)",
        m.tensors.len(),
        m.pieces.len(),
        m.piece_bytes()
    );
    println!(
        "  {:<40} {:<5} {:<20} {:>14} {:>6}",
        "NAME", "DTYPE", "SHAPE", "BYTES", "PIECES"
    );
    for t in &m.tensors {
        let pieces = m.pieces.iter().filter(|p| p.tensor == t.name).count();
        let bytes = t
            .byte_size()
            .map_or_else(|e| e.to_string(), |b| b.to_string());
        println!(
            "  {:<40} {:<5} {:<20} {:>14} {:>6}",
            t.name,
            format!("{:?}", t.dtype),
            format!("{:?}", t.shape),
            bytes,
            pieces
        );
    }
    println!("state:       {}", serde_json::to_string_pretty(c.state())?);
    Ok(())
}

/// Prints one step's verification line.
fn report_step(c: &StepCheck) {
    match &c.result {
        Ok(()) => println!(
            "ok   step-{}: {} bytes in {:.3} s: {:.2} GB/s",
            c.step,
            c.bytes,
            c.elapsed.as_secs_f64(),
            c.gb_per_s()
        ),
        Err(e) => println!("BAD  step-{}: {e}", c.step),
    }
}

/// `flotilla ckpt verify`: every piece of one step, or of every committed step.
fn verify(a: VerifyArgs) -> Result<()> {
    let steps: Vec<u64> = match a.step {
        Some(n) => vec![n],
        None => ckpt::names::step_dirs(&a.root)
            .with_context(|| format!("reading checkpoint root {}", a.root.display()))?
            .into_iter()
            .filter(|d| d.state == DirState::Committed)
            .map(|d| d.step)
            .collect(),
    };
    if steps.is_empty() {
        bail!("no committed step in {}", a.root.display());
    }
    let bar = byte_bar(a.no_progress)?;
    let checks: Vec<StepCheck> = (steps.iter())
        .map(|&step| {
            bar.set_message(format!("step-{step}"));
            let c = verify_step(&a.root, step, advance(&bar));
            if !a.json {
                bar.suspend(|| report_step(&c));
            }
            c
        })
        .collect();
    bar.finish_and_clear();
    let bad: Vec<String> = (checks.iter().filter(|c| c.result.is_err()))
        .map(|c| format!("step-{}", c.step))
        .collect();
    if a.json {
        let steps: Vec<_> = checks.iter().map(StepCheck::to_json).collect();
        println!("{}", json!({"root": a.root, "steps": steps, "failed": bad}));
    }
    if !bad.is_empty() {
        bail!(
            "{} of {} committed steps of {} failed verification: {}",
            bad.len(),
            steps.len(),
            a.root.display(),
            bad.join(", ")
        );
    }
    Ok(())
}
