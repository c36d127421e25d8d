//! A trained model on disk (`flotilla train --save`, read by `flotilla generate`):
//! `model.safetensors` (Flotilla names, config in the metadata) and `flotilla.json` (how its
//! tokens were made, and the model file's length and xxh3-128).
//!
//! Both files are read as regular files of bounded size ([`data::fsread`]), and the model
//! file is checked against the sidecar's checksum before it is parsed, so a damaged byte
//! anywhere in it (header, metadata or weights) is refused naming the file instead of loading
//! different weights. Saves from before the checksum have none and load unchecked.
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use model::config::ModelConfig;
use model::layout::Layout;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Name of the model file in a saved model's directory.
pub const MODEL_FILE: &str = "model.safetensors";
/// Name of the sidecar in a saved model's directory.
pub const SIDECAR_FILE: &str = "flotilla.json";
/// Largest sidecar read (1 MiB), checked before reading.
pub const MAX_SIDECAR_BYTES: u64 = 1 << 20;

/// The sidecar describing the training data.
#[derive(Serialize, Deserialize, Debug)]
pub struct Sidecar {
    /// Tokenizer name (byte, gpt2), or none for the Markov corpus.
    pub tokenizer: Option<String>,
    /// Steps trained.
    pub steps: u64,
    /// Seed.
    pub seed: u64,
    /// Length of the model file in bytes (absent in saves from before checksums).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_bytes: Option<u64>,
    /// Hex xxh3-128 of the model file (absent in saves from before checksums).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_xxh3_128: Option<String>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Write `dir/model.safetensors` and `dir/flotilla.json` (with the model file's checksum, of
/// the bytes read back from disk).
pub fn save(dir: &Path, cfg: &TrainConfig, layout: &Layout, params: &[f32]) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let model_path = dir.join(MODEL_FILE);
    model::interop::save_flotilla(&model_path, &cfg.model, layout, params)?;
    let written = data::fsread::read_bounded(&model_path, model::interop::MAX_TENSOR_FILE_BYTES)?;
    let side = Sidecar {
        tokenizer: cfg.tokenizer_name(),
        steps: cfg.steps,
        seed: cfg.seed,
        model_bytes: Some(written.len() as u64),
        model_xxh3_128: Some(ckpt::checksum_hex(&written)),
    };
    let path = dir.join(SIDECAR_FILE);
    let text = serde_json::to_string_pretty(&side).map_err(|e| TrainError::Io {
        path: path.clone(),
        source: e.into(),
    })?;
    std::fs::write(&path, text).map_err(io(&path))
}

/// Read a directory written by [`save`], the model file verified against the sidecar's
/// checksum first.
///
/// # Errors
/// [`TrainError::Data`] for a file that is not regular or is over its cap;
/// [`TrainError::SavedModel`] naming the model file when its length or checksum is not the
/// sidecar's; [`TrainError::Io`] for an unreadable sidecar; the model crate's error for a
/// file that does not parse.
pub fn load(dir: &Path) -> Result<(ModelConfig, Vec<f32>, Sidecar)> {
    let path = dir.join(SIDECAR_FILE);
    let text = data::fsread::read_bounded(&path, MAX_SIDECAR_BYTES)?;
    let side: Sidecar = serde_json::from_slice(&text).map_err(|e| TrainError::Io {
        path: path.clone(),
        source: e.into(),
    })?;
    let model_path = dir.join(MODEL_FILE);
    let bytes = data::fsread::read_bounded(&model_path, model::interop::MAX_TENSOR_FILE_BYTES)?;
    let damaged = |reason: String| TrainError::SavedModel {
        path: model_path.clone(),
        reason,
    };
    if let Some(want) = side.model_bytes
        && want != bytes.len() as u64
    {
        return Err(damaged(format!(
            "{} bytes, {SIDECAR_FILE} records {want} (truncated or replaced)",
            bytes.len()
        )));
    }
    if let Some(want) = &side.model_xxh3_128 {
        let have = ckpt::checksum_hex(&bytes);
        if &have != want {
            return Err(damaged(format!(
                "xxh3-128 {have}, {SIDECAR_FILE} records {want} (damaged)"
            )));
        }
    }
    let file = model::interop::TensorFile::from_bytes(model_path.display().to_string(), bytes)?;
    let (cfg, params) = model::interop::load_flotilla_file(&file)?;
    Ok((cfg, params, side))
}
