//! What `flotilla generate` samples from: a model saved by `flotilla train --save`, or a
//! Hugging Face GPT-2 or Llama directory, with the tokenizer that encodes its prompts.
use std::path::Path;

use data::{HfTokenizer, Tokenizer, TokenizerKind, TokenizerSpec};
use model::config::ModelConfig;

use crate::error::{Context, Result, TrainError};

/// A tokenizer the generator can share.
pub type Tok = Box<dyn Tokenizer + Send + Sync>;

/// A model to sample from: its config, its parameters and its tokenizer (None: prompts are
/// token ids).
pub struct Loaded {
    /// The model's shape.
    pub cfg: ModelConfig,
    /// Its flat parameters.
    pub params: Vec<f32>,
    /// The tokenizer of its prompts and continuations.
    pub tok: Option<Tok>,
}

/// A Hugging Face directory's model; its `tokenizer.json` when it has one, else `fallback`.
pub fn from_hf(dir: &Path, fallback: Option<&TokenizerSpec>) -> Result<Loaded> {
    let (cfg, params) = model::interop::import_hf(dir).ctx(|| format!("--hf {}", dir.display()))?;
    let own = dir.join(model::interop::HF_TOKENIZER);
    let tok: Option<Tok> = if own.is_file() {
        Some(Box::new(HfTokenizer::from_file(&own, None)?))
    } else {
        fallback.map(|t| t.build(None)).transpose()?
    };
    Ok(Loaded { cfg, params, tok })
}

/// A saved model (`--save`) with the tokenizer its sidecar names: a built-in one, or the
/// `tokenizer.json` a fine-tune (`--init-hf`) saved beside it, checked against the sidecar.
pub fn from_saved(dir: &Path) -> Result<Loaded> {
    let (cfg, params, side) = crate::saved::load(dir)?;
    let own = dir.join(model::interop::HF_TOKENIZER);
    let tok: Option<Tok> = match side.tokenizer {
        Some(name) if name.starts_with(HfTokenizer::NAME_PREFIX) => {
            let t = HfTokenizer::from_file(&own, None)
                .ctx(|| format!("the tokenizer of {}", dir.display()))?;
            if t.name() != name {
                return Err(TrainError::SavedModel {
                    path: own,
                    reason: format!(
                        "it is {}, but {} records {name}",
                        t.name(),
                        crate::saved::SIDECAR_FILE
                    ),
                });
            }
            Some(Box::new(t))
        }
        Some(name) => {
            let kind: TokenizerKind = name.parse().map_err(|e| TrainError::Config {
                field: "tokenizer in flotilla.json",
                value: name.clone(),
                reason: format!("{e}"),
            })?;
            Some(kind.build()?)
        }
        None => None,
    };
    Ok(Loaded { cfg, params, tok })
}

impl Loaded {
    /// The prompt's token ids: encoded by the tokenizer, or read as space-separated ids.
    pub fn prompt_ids(&self, prompt: &str) -> Result<Vec<u32>> {
        match &self.tok {
            Some(t) => Ok(t.try_encode(prompt)?),
            None => prompt
                .split_whitespace()
                .map(|s| {
                    s.parse::<u32>().map_err(|_| TrainError::Config {
                        field: "--prompt",
                        value: s.to_string(),
                        reason: "not a token id (the model has no tokenizer)".into(),
                    })
                })
                .collect(),
        }
    }
}
