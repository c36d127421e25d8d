//! `flotilla ckpt ...`: listing, showing and verifying checkpoints, and the save/load benchmark.
//!
//! `ls`, `show` and `verify` are small and live here; the benchmark has its own module.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use ckpt::names::DirState;
use ckpt::{Checkpoint, Manifest, Verify, open_latest};

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

/// Total bytes of all pieces of a manifest.
fn piece_bytes(m: &Manifest) -> u64 {
    m.pieces.iter().map(|p| p.bytes).sum()
}

/// `flotilla ckpt ls`: one line (or JSON object) per step directory.
fn ls(a: &LsArgs) -> Result<()> {
    let dirs = ckpt::names::step_dirs(&a.root)
        .with_context(|| format!("reading checkpoint root {}", a.root.display()))?;
    let mut rows = vec![];
    for d in &dirs {
        let mut row = serde_json::json!({"dir": d.name, "step": d.step, "state": d.state});
        match d.state {
            DirState::Committed => match Checkpoint::open(&a.root, d.step, Verify::ManifestOnly) {
                Ok(c) => {
                    let m = c.manifest();
                    row["tensors"] = m.tensors.len().into();
                    row["pieces"] = m.pieces.len().into();
                    row["bytes"] = piece_bytes(m).into();
                    row["world"] = m.world_size.into();
                    row["run"] = m.run_id.clone().into();
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

/// Opens `step`, or the newest loadable committed step (reporting rejected newer ones).
fn open_step(root: &Path, step: Option<u64>, verify: Verify) -> Result<Checkpoint> {
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
        piece_bytes(m)
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

/// Opens `step` with every piece verified; returns the bytes checked and the seconds taken.
fn verify_step(root: &Path, step: u64) -> Result<(u64, f64)> {
    let start = Instant::now();
    let c = Checkpoint::open(root, step, Verify::AllPieces)?;
    Ok((piece_bytes(c.manifest()), start.elapsed().as_secs_f64()))
}

/// Prints one verification result; returns whether it passed.
fn report_step(step: u64, result: &Result<(u64, f64)>) -> bool {
    match result {
        Ok((bytes, secs)) => {
            let gbps = *bytes as f64 / secs.max(1e-9) / 1e9;
            println!("ok   step-{step}: {bytes} bytes in {secs:.3} s: {gbps:.2} GB/s");
            true
        }
        Err(e) => {
            println!("BAD  step-{step}: {e:#}");
            false
        }
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
    let bad: Vec<String> = steps
        .iter()
        .filter(|&&step| !report_step(step, &verify_step(&a.root, step)))
        .map(|step| format!("step-{step}"))
        .collect();
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
