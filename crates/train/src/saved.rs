//! A trained model on disk (`flotilla train --save`, read by `flotilla generate`):
//! `model.safetensors` (Flotilla names, config in the metadata) and `flotilla.json` (how its
//! tokens were made).
use crate::config::{DataSpec, TrainConfig};
use crate::error::{Result, TrainError};
use model::config::ModelConfig;
use model::layout::Layout;
use serde::{Deserialize, Serialize};
use std::path::Path;

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

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Write `dir/model.safetensors` and `dir/flotilla.json`.
pub fn save(dir: &Path, cfg: &TrainConfig, layout: &Layout, params: &[f32]) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
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
    let text = serde_json::to_string_pretty(&side).map_err(|e| TrainError::Io {
        path: path.clone(),
        source: e.into(),
    })?;
    std::fs::write(&path, text).map_err(io(&path))
}

/// Read a directory written by [`save`].
pub fn load(dir: &Path) -> Result<(ModelConfig, Vec<f32>, Sidecar)> {
    let (cfg, params) = model::interop::load_flotilla_with_config(dir.join("model.safetensors"))?;
    let path = dir.join("flotilla.json");
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    let side: Sidecar = serde_json::from_str(&text).map_err(|e| TrainError::Io {
        path: path.clone(),
        source: e.into(),
    })?;
    Ok((cfg, params, side))
}
