//! `flotilla ckpt convert`: a committed step to a consolidated Hugging Face model, or resharded
//! offline for another number of ranks.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use ckpt::{Checkpoint, Verify};
use model::config::ModelConfig;
use model::layout::Layout;
use train::checkpoint::MODEL_PREFIX;

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
}

/// Runs `flotilla ckpt convert`.
pub fn run(a: ConvertArgs) -> Result<()> {
    let ckpt = match a.step {
        Some(step) => Checkpoint::open(&a.root, step, Verify::ManifestOnly)?,
        None => {
            let opened = ckpt::open_latest(&a.root, Verify::ManifestOnly)?;
            for r in &opened.rejected {
                println!("# step {} rejected: {}", r.step, r.error);
            }
            opened.checkpoint
        }
    };
    match (&a.hf, a.reshard, &a.out) {
        (Some(dir), _, _) => to_hf(&ckpt, dir),
        (None, Some(ranks), Some(out)) => {
            if ranks == 0 {
                bail!("--reshard 0: at least one rank is needed");
            }
            let m = ckpt::reshard(&ckpt, out, ranks).with_context(|| {
                format!("resharding step {} into {}", ckpt.step(), out.display())
            })?;
            println!(
                "# step {} of {} ({} ranks) rewritten for {ranks} ranks in {}: {} pieces",
                m.step,
                a.root.display(),
                ckpt.manifest().world_size,
                out.display(),
                m.pieces.len()
            );
            Ok(())
        }
        _ => bail!("give --hf DIR, or --reshard N with --out DIR"),
    }
}

/// The model config a trainer checkpoint records in its state.
fn model_config(ckpt: &Checkpoint) -> Result<ModelConfig> {
    let map = ckpt.state()["model_config"].as_object().ok_or_else(|| {
        anyhow!(
            "step {} has no model config in its state: only checkpoints saved by `flotilla train` convert to Hugging Face",
            ckpt.step()
        )
    })?;
    let label = format!(
        "{} (state.model_config)",
        ckpt.dir().join("manifest.json").display()
    );
    Ok(model::interop::config_from_metadata(&label, |k| {
        map.get(k).and_then(|v| v.as_str())
    })?)
}

/// Assembles the flat parameter buffer from the `model.<entry>` tensors and exports it.
fn to_hf(ckpt: &Checkpoint, dir: &Path) -> Result<()> {
    let cfg = model_config(ckpt)?;
    let layout = Layout::new(&cfg);
    let mut params = vec![0f32; layout.total];
    for e in &layout.entries {
        let name = format!("{MODEL_PREFIX}{}", e.name);
        let bytes = ckpt
            .read_tensor(&name)
            .with_context(|| format!("reading {name} of step {}", ckpt.step()))?;
        ckpt::f32_from_bytes(&bytes, &mut params[e.range()], &name)?;
    }
    model::interop::export_hf(dir, &cfg, &params)
        .with_context(|| format!("exporting to {}", dir.display()))?;
    println!(
        "# step {} exported as a Hugging Face model to {} ({:.2}M parameters)",
        ckpt.step(),
        dir.display(),
        params.len() as f64 / 1e6
    );
    Ok(())
}
