//! Command-line options that build a model and a training config.
use crate::flag_range::{
    MAX_THREADS, finite_nonneg_f64, positive_f64, positive_usize, unit_interval, usize_in,
};
use crate::loader_args::LoaderArgs;
use anyhow::{Context, Result, bail};
use clap::Args;
use data::TokenizerKind;
use model::config::ModelConfig;
use model::optim::Schedule;
use std::path::PathBuf;
use train::{DataSpec, TrainConfig};

/// Model shape: a preset plus optional overrides.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Preset: tiny, small (the peer benchmark's configs), gpt2, llama-tiny.
    #[arg(long, default_value = "tiny")]
    pub config: String,
    /// Override the number of blocks.
    #[arg(long, value_parser = positive_usize())]
    pub layers: Option<usize>,
    /// Override the model width.
    #[arg(long, value_parser = positive_usize())]
    pub d_model: Option<usize>,
    /// Override the query heads.
    #[arg(long, value_parser = positive_usize())]
    pub heads: Option<usize>,
    /// Override the key/value heads.
    #[arg(long, value_parser = positive_usize())]
    pub kv_heads: Option<usize>,
    /// Override the feed-forward width.
    #[arg(long, value_parser = positive_usize())]
    pub ffn: Option<usize>,
    /// Override the vocabulary size.
    #[arg(long, value_parser = positive_usize())]
    pub vocab: Option<usize>,
    /// Override the maximum sequence length.
    #[arg(long, value_parser = positive_usize())]
    pub seq_len: Option<usize>,
    /// Give the LM head its own (V, C) matrix instead of reusing the token embedding (the
    /// GPT-2 presets tie them).
    #[arg(long)]
    pub untied: bool,
}

impl ModelArgs {
    /// The validated model config.
    pub fn build(&self) -> Result<ModelConfig> {
        let mut c = ModelConfig::preset(&self.config)?;
        if let Some(v) = self.layers {
            c.layers = v;
        }
        if let Some(v) = self.d_model {
            c.d_model = v;
            if self.ffn.is_none() && c.activation != model::config::Activation::SwiGlu {
                c.ffn = 4 * v;
            }
        }
        if let Some(v) = self.heads {
            c.heads = v;
            if self.kv_heads.is_none() && c.kv_heads > v {
                c.kv_heads = v;
            }
        }
        if let Some(v) = self.kv_heads {
            c.kv_heads = v;
        }
        if let Some(v) = self.ffn {
            c.ffn = v;
        }
        if let Some(v) = self.vocab {
            c.vocab = v;
        }
        if let Some(v) = self.seq_len {
            c.seq_len = v;
        }
        if self.untied {
            c.tied_embeddings = false;
        }
        c.validate()?;
        Ok(c)
    }
}

/// Optimisation and data options.
#[derive(Args, Clone, Debug)]
pub struct TrainArgs {
    /// Sequences per micro-batch (per process under --nproc).
    #[arg(long, default_value_t = 8, value_parser = positive_usize())]
    pub batch: usize,
    /// Micro-batches per optimizer step (gradient accumulation; data-parallel ranks
    /// communicate only after the last).
    #[arg(long, default_value_t = 1, value_parser = positive_usize())]
    pub grad_accum: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 50)]
    pub steps: u64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-4)]
    pub lr: f32,
    /// Schedule: constant, linear or cosine (warmup then decay).
    #[arg(long, default_value = "constant")]
    pub schedule: String,
    /// Warmup steps of the schedule.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Final learning rate as a fraction of the peak.
    #[arg(long, default_value_t = 0.1, value_parser = unit_interval)]
    pub min_lr_ratio: f64,
    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 0.1, value_parser = finite_nonneg_f64)]
    pub weight_decay: f64,
    /// Decay only matrices and embeddings (GPT-2 convention) instead of every tensor.
    #[arg(long)]
    pub decay_matrices_only: bool,
    /// Clip the global gradient norm to this value.
    #[arg(long, value_parser = positive_f64)]
    pub grad_clip: Option<f64>,
    /// Seed of the initialisation and the data stream.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Compute threads (default: all cores).
    #[arg(long, value_parser = usize_in(1, MAX_THREADS))]
    pub threads: Option<usize>,
    /// Recompute block activations in the backward (less memory).
    #[arg(long)]
    pub recompute: bool,
    /// Keep parameters and gradients in bf16 with f32 master weights.
    #[arg(long)]
    pub bf16: bool,
    /// Data: markov (built-in chain over the vocabulary), grammar (built-in
    /// English-like text) or text (the files given with --text).
    #[arg(long, default_value = "markov")]
    pub data: String,
    /// Successors per token of the built-in Markov corpus.
    #[arg(long, default_value_t = 4, value_parser = positive_usize())]
    pub branching: usize,
    /// Tokenizer for grammar and text data: byte or gpt2.
    #[arg(long, default_value = "byte")]
    pub tokenizer: String,
    /// Plain-text files to train on (with --data text).
    #[arg(long, num_args = 1..)]
    pub text: Vec<PathBuf>,
    /// Token datasets (--dataset DIR, repeatable) and their loader; --dataset overrides --data.
    #[command(flatten)]
    pub loader: LoaderArgs,
}

impl TrainArgs {
    /// The validated training config for `model`. With tokenized data and
    /// no explicit `--vocab`, the vocabulary becomes the tokenizer's. `seq_len`, when given,
    /// is the training sequence length (at most the model's maximum; default: the maximum).
    pub fn build(
        &self,
        mut model: ModelConfig,
        vocab_given: bool,
        seq_len: Option<usize>,
    ) -> Result<TrainConfig> {
        let tokenizer: TokenizerKind = self.tokenizer.parse().context("--tokenizer")?;
        if self.loader.given() && !vocab_given {
            let m = data::cache::read_manifest(&self.loader.datasets[0], &self.loader.cache())
                .with_context(|| format!("--dataset {}", self.loader.datasets[0].display()))?;
            model.vocab = m.vocab_size as usize;
        } else if self.data != "markov" && !vocab_given {
            model.vocab = tokenizer.vocab_size();
        }
        let mut c = TrainConfig::new(model, self.steps);
        if let Some(t) = seq_len {
            if t > c.model.seq_len {
                bail!(
                    "--seq-len {t}: the model's maximum sequence length is {}",
                    c.model.seq_len
                );
            }
            c.seq_len = t;
        }
        c.batch = self.batch;
        c.grad_accum = self.grad_accum;
        c.lr = self.lr;
        c.schedule = Schedule::parse(&self.schedule, self.warmup, self.steps, self.min_lr_ratio)?;
        c.adamw.weight_decay = self.weight_decay;
        c.decay_all = !self.decay_matrices_only;
        c.grad_clip = self.grad_clip;
        c.seed = self.seed;
        c.threads = match self.threads {
            Some(t) => t,
            None => std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
        };
        c.recompute = self.recompute;
        c.bf16 = self.bf16;
        c.data = match self.data.as_str() {
            _ if self.loader.given() => DataSpec::Dataset {
                dirs: self.loader.datasets.clone(),
                loader: self.loader.config(c.seq_len, c.batch as u64, c.seed)?,
            },
            "markov" => DataSpec::Markov {
                branching: self.branching,
            },
            "grammar" => DataSpec::Grammar {
                bytes: 4 << 20,
                tokenizer,
            },
            "text" => DataSpec::Text {
                paths: self.text.clone(),
                tokenizer,
            },
            other => bail!("--data {other}: expected markov, grammar or text (or give --dataset)"),
        };
        c.validate()?;
        Ok(c)
    }
}
