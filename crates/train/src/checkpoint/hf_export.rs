//! A committed training step as a consolidated Hugging Face model (`flotilla ckpt convert
//! --hf`): the `model.<entry>` tensors assembled into the flat parameter buffer, then exported
//! by `model::interop::export_hf` (byte-identical to `train --export-hf` of the same weights).

use std::path::{Path, PathBuf};

use ckpt::Checkpoint;
use model::config::ModelConfig;
use model::layout::Layout;

use super::MODEL_PREFIX;
use crate::error::{Context, Result, TrainError};

/// What [`export_hf`] wrote (`flotilla ckpt convert --hf --json` prints it).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HfExport {
    /// The step exported.
    pub step: u64,
    /// The directory written (config.json and model.safetensors).
    pub dir: PathBuf,
    /// Parameters exported.
    pub parameters: u64,
    /// Bytes of the two files written.
    pub bytes: u64,
}

/// The model config a trainer checkpoint records in its state (`state.model_config`).
///
/// # Errors
/// [`TrainError::Refused`] if the state has none (a checkpoint not saved by `flotilla
/// train`), or the model's error naming the bad key.
pub fn model_config(ckpt: &Checkpoint) -> Result<ModelConfig> {
    let map = ckpt.state()["model_config"].as_object().ok_or_else(|| {
        TrainError::Refused(format!(
            "step {} has no model config in its state: only checkpoints saved by `flotilla train` convert to Hugging Face",
            ckpt.step()
        ))
    })?;
    let label = format!(
        "{} (state.model_config)",
        ckpt.dir().join(ckpt::manifest::MANIFEST_FILE).display()
    );
    Ok(model::interop::config_from_metadata(&label, |k| {
        map.get(k).and_then(|v| v.as_str())
    })?)
}

/// Reads every `model.<entry>` tensor of `ckpt` (each verified as it is read), calling
/// `progress(bytes_read, bytes_total)` after each, and writes them to `dir` as a Hugging Face
/// model.
pub fn export_hf(
    ckpt: &Checkpoint,
    dir: &Path,
    mut progress: impl FnMut(u64, u64),
) -> Result<HfExport> {
    let cfg = model_config(ckpt)?;
    let layout = Layout::new(&cfg);
    let f32_bytes = |n: usize| (n * std::mem::size_of::<f32>()) as u64;
    let (total, mut done) = (f32_bytes(layout.total), 0u64);
    let mut params = vec![0f32; layout.total];
    for e in &layout.entries {
        let name = format!("{MODEL_PREFIX}{}", e.name);
        let what = || format!("reading {name} of step {}", ckpt.step());
        let bytes = ckpt.read_tensor(&name).ctx(what)?;
        ckpt::f32_from_bytes(&bytes, &mut params[e.range()], &name).ctx(what)?;
        done += f32_bytes(e.range().len());
        progress(done, total);
    }
    model::interop::export_hf(dir, &cfg, &params)
        .ctx(|| format!("exporting to {}", dir.display()))?;
    let files = [model::interop::HF_CONFIG, model::interop::hf::HF_WEIGHTS];
    let bytes = (files.iter()).fold(0u64, |n, f| {
        let len = std::fs::metadata(dir.join(f)).map_or(0, |m| m.len());
        n.saturating_add(len)
    });
    Ok(HfExport {
        step: ckpt.step(),
        dir: dir.to_path_buf(),
        parameters: params.len() as u64,
        bytes,
    })
}
