//! A trained model on disk: `model.safetensors` (Flotilla names, config in
//! the metadata) and `flotilla.json` (how its tokens were made).
use anyhow::{Context, Result};
use model::config::ModelConfig;
use model::layout::Layout;
use serde::{Deserialize, Serialize};
use std::path::Path;
use train::{DataSpec, TrainConfig};

/// The sidecar describing the training data.
#[derive(Serialize, Deserialize, Debug)]
pub struct Sidecar {
    /// Tokenizer name (byte, gpt2), or none for the Markov corpus.
    pub tokenizer: Option<String>,
    /// Steps trained.
    pub steps: u64,
    /// Seed.
    pub seed: u64,
}

/// Write `dir/model.safetensors` and `dir/flotilla.json`.
pub fn save(dir: &Path, cfg: &TrainConfig, layout: &Layout, params: &[f32]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    model::interop::save_flotilla(dir.join("model.safetensors"), &cfg.model, layout, params)?;
    let tokenizer = match &cfg.data {
        DataSpec::Markov { .. } => None,
        DataSpec::Grammar { tokenizer, .. } | DataSpec::Text { tokenizer, .. } => {
            Some(tokenizer.to_string())
        }
        // The tokenizer the dataset was prepared with, as its manifest names it.
        DataSpec::Dataset { dirs, .. } => dirs
            .first()
            .and_then(|d| data::Manifest::read(d).ok())
            .map(|m| m.tokenizer),
    };
    let side = Sidecar {
        tokenizer,
        steps: cfg.steps,
        seed: cfg.seed,
    };
    let path = dir.join("flotilla.json");
    std::fs::write(&path, serde_json::to_string_pretty(&side)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// Read a directory written by [`save`].
pub fn load(dir: &Path) -> Result<(ModelConfig, Vec<f32>, Sidecar)> {
    let (cfg, params) = model::interop::load_flotilla_with_config(dir.join("model.safetensors"))?;
    let path = dir.join("flotilla.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let side: Sidecar =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok((cfg, params, side))
}
