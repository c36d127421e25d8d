//! The typed training config.
use crate::error::{Result, TrainError};
use data::TokenizerKind;
use model::config::ModelConfig;
use model::optim::{AdamWConfig, Schedule};
use std::path::PathBuf;

/// Where training tokens come from.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSpec {
    /// The built-in Markov corpus over the model's vocabulary, where each
    /// token has `branching` likely successors (known entropy rate).
    Markov {
        /// Successors per token.
        branching: usize,
    },
    /// The built-in English-like grammar corpus, `bytes` long, tokenized.
    Grammar {
        /// Corpus size in bytes.
        bytes: usize,
        /// Tokenizer.
        tokenizer: TokenizerKind,
    },
    /// Token datasets on disk (`flotilla data prepare`), read by the data loader with its
    /// deterministic elastic shuffle. The loader's `seq_len`, `global_batch` and `seed` are
    /// replaced by the training config's `seq_len`, `batch` and `seed`.
    Dataset {
        /// The dataset directories (a weighted mixture when more than one).
        dirs: Vec<PathBuf>,
        /// Workers, prefetch, shuffle window, mixture weights, timeout.
        loader: data::LoaderConfig,
    },
    /// Plain-text files, tokenized.
    Text {
        /// The files.
        paths: Vec<PathBuf>,
        /// Tokenizer.
        tokenizer: TokenizerKind,
    },
}

/// Everything a single-process training run needs.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// The model.
    pub model: ModelConfig,
    /// Sequences per micro-batch (B), per data-parallel rank.
    pub batch: usize,
    /// Micro-batches per optimizer step (gradient accumulation): gradients of `grad_accum`
    /// forward/backward passes are summed, and data-parallel ranks communicate only after the
    /// last one (file 000, "数据并行": accumulation trades memory for communication).
    pub grad_accum: usize,
    /// Tokens per sequence (T), at most `model.seq_len`.
    pub seq_len: usize,
    /// Optimizer steps.
    pub steps: u64,
    /// Peak learning rate.
    pub lr: f32,
    /// Learning-rate schedule.
    pub schedule: Schedule,
    /// AdamW settings.
    pub adamw: AdamWConfig,
    /// Weight-decay every tensor (torch's default) instead of matrices and
    /// embeddings only.
    pub decay_all: bool,
    /// Global gradient-norm clip; `None` disables clipping.
    pub grad_clip: Option<f64>,
    /// Seed of the initialisation and of the data stream.
    pub seed: u64,
    /// Compute threads.
    pub threads: usize,
    /// Recompute each block's activations in the backward.
    pub recompute: bool,
    /// Keep parameters and gradients in bf16 with f32 master weights.
    pub bf16: bool,
    /// Training data.
    pub data: DataSpec,
}

impl TrainConfig {
    /// Defaults around `model`: batch 8 of full-length sequences, AdamW
    /// (lr 3e-4, wd 0.1, as the peer benchmark), warmup then cosine.
    pub fn new(model: ModelConfig, steps: u64) -> Self {
        let seq_len = model.seq_len;
        Self {
            model,
            batch: 8,
            grad_accum: 1,
            seq_len,
            steps,
            lr: 3e-4,
            schedule: Schedule::Constant,
            adamw: AdamWConfig {
                weight_decay: 0.1,
                ..AdamWConfig::default()
            },
            decay_all: true,
            grad_clip: None,
            seed: 1234,
            threads: 1,
            recompute: false,
            bf16: false,
            data: DataSpec::Markov { branching: 4 },
        }
    }

    /// The name of the tokenizer that made the run's tokens (byte, gpt2, or a dataset's
    /// manifest's, e.g. `hf:<hash>`), or `None` for the Markov corpus.
    pub fn tokenizer_name(&self) -> Option<String> {
        match &self.data {
            DataSpec::Markov { .. } => None,
            DataSpec::Grammar { tokenizer, .. } | DataSpec::Text { tokenizer, .. } => {
                Some(tokenizer.to_string())
            }
            // The tokenizer the dataset was prepared with, as its manifest names it.
            DataSpec::Dataset { dirs, loader } => dirs
                .first()
                .and_then(|d| data::cache::read_manifest(d, &loader.cache).ok())
                .map(|m| m.tokenizer),
        }
    }

    /// Check every setting; the error names the first bad field.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        let bad = |field: &'static str, value: String, reason: &str| {
            Err(TrainError::Config {
                field,
                value,
                reason: reason.to_string(),
            })
        };
        if self.batch == 0 {
            return bad("batch", "0".into(), "must be positive");
        }
        if self.grad_accum == 0 {
            return bad("grad_accum", "0".into(), "must be positive");
        }
        if self.seq_len == 0 || self.seq_len > self.model.seq_len {
            return bad(
                "seq_len",
                self.seq_len.to_string(),
                &format!("must be in 1..={}", self.model.seq_len),
            );
        }
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("lr", self.lr.to_string(), "must be finite and >= 0");
        }
        if self.threads == 0 {
            return bad("threads", "0".into(), "must be positive");
        }
        if let Some(c) = self.grad_clip
            && !(c.is_finite() && c > 0.0)
        {
            return bad("grad_clip", c.to_string(), "must be finite and positive");
        }
        self.adamw.validate()?;
        self.schedule.validate()?;
        match &self.data {
            DataSpec::Markov { branching } if *branching == 0 || *branching > self.model.vocab => {
                bad(
                    "branching",
                    branching.to_string(),
                    &format!("must be in 1..={}", self.model.vocab),
                )
            }
            DataSpec::Grammar { tokenizer, .. } | DataSpec::Text { tokenizer, .. }
                if tokenizer.vocab_size() > self.model.vocab =>
            {
                bad(
                    "vocab",
                    self.model.vocab.to_string(),
                    &format!(
                        "the {} tokenizer needs a vocabulary of at least {}",
                        tokenizer,
                        tokenizer.vocab_size()
                    ),
                )
            }
            DataSpec::Text { paths, .. } if paths.is_empty() => {
                bad("data", "[]".into(), "no text files given")
            }
            DataSpec::Dataset { dirs, .. } if dirs.is_empty() => {
                bad("data", "[]".into(), "no dataset directories given")
            }
            _ => Ok(()),
        }
    }

    /// Tokens trained per step by one rank, B x T x grad_accum.
    pub fn tokens_per_step(&self) -> usize {
        self.micro_tokens() * self.grad_accum
    }

    /// Tokens in one micro-batch of one rank (B x T).
    pub fn micro_tokens(&self) -> usize {
        self.batch * self.seq_len
    }
}
