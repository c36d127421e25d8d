//! `flotilla ckpt convert`: a committed step to a consolidated Hugging Face model, or resharded
//! offline for another number of ranks.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use ckpt::Verify;
use serde_json::json;

use crate::ckpt_cmd::open_step;
use crate::data_prepare_cmd::{advance, byte_bar};

/// Options of `flotilla ckpt convert`.
#[derive(clap::Args)]
pub struct ConvertArgs {
    /// Checkpoint root (holding `step-<N>` directories).
    root: PathBuf,
    /// Step to convert (default: the newest loadable committed step).
    #[arg(long)]
    step: Option<u64>,
    /// Write a consolidated Hugging Face model (config.json + model.safetensors) to this
    /// directory (checkpoints saved by `flotilla train`).
    #[arg(long, conflicts_with = "reshard", required_unless_present = "reshard")]
    hf: Option<PathBuf>,
    /// Rewrite the step for this many ranks (even split of dimension 0) under `--out`.
    #[arg(long, requires = "out")]
    reshard: Option<u32>,
    /// Checkpoint root to write the resharded step into.
    #[arg(long)]
    out: Option<PathBuf>,
    /// One JSON object (step, what was written and its size) instead of a line.
    #[arg(long)]
    json: bool,
    /// Hide the progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    no_progress: bool,
}

/// Runs `flotilla ckpt convert`.
pub fn run(a: ConvertArgs) -> Result<()> {
    let ckpt = open_step(&a.root, a.step, Verify::ManifestOnly)?;
    let bar = byte_bar(a.no_progress)?;
    let (line, value) = match (&a.hf, a.reshard, &a.out) {
        (Some(dir), _, _) => {
            let e = train::checkpoint::export_hf(&ckpt, dir, advance(&bar))?;
            let line = format!(
                "# step {} exported as a Hugging Face model to {} ({:.2}M parameters)",
                e.step,
                dir.display(),
                e.parameters as f64 / 1e6
            );
            (line, serde_json::to_value(e)?)
        }
        (None, Some(ranks), Some(out)) => {
            if ranks == 0 {
                bail!("--reshard 0: at least one rank is needed");
            }
            let m = ckpt::reshard_with_progress(&ckpt, out, ranks, advance(&bar)).with_context(
                || format!("resharding step {} into {}", ckpt.step(), out.display()),
            )?;
            let from = ckpt.manifest().world_size;
            let line = format!(
                "# step {} of {} ({from} ranks) rewritten for {ranks} ranks in {}: {} pieces",
                m.step,
                a.root.display(),
                out.display(),
                m.pieces.len()
            );
            let mut v = m.summary_json();
            (v["out"], v["from_world"]) = (json!(out), json!(from));
            (line, v)
        }
        _ => bail!("give --hf DIR, or --reshard N with --out DIR"),
    };
    bar.finish_and_clear();
    match a.json {
        true => println!("{value}"),
        false => println!("{line}"),
    }
    Ok(())
}
