//! Where training batches come from: the built-in corpora, text files, or token datasets
//! through the data loader.
use std::sync::Arc;

use crate::config::DataSpec;
use crate::error::Result;
use data::{
    Dataset, Loader, LoaderMetrics, MarkovCorpus, TextCorpus, TokenWindows, load_tokens,
    validate_ids,
};

/// A deterministic stream of (inputs, targets) batches.
pub enum Source {
    /// Rows of the Markov chain's continuing stream.
    Markov {
        /// The chain.
        corpus: MarkovCorpus,
        /// One row of T+1 tokens.
        row: Vec<u32>,
    },
    /// Random windows over a tokenized buffer.
    Windows(TokenWindows),
    /// The data loader over token datasets.
    Loader {
        /// The loader (boxed: it is much larger than the other variants).
        loader: Box<Loader>,
        /// Ids must be below this.
        vocab: usize,
    },
}

impl Source {
    /// Build the source for `spec`, with a model vocabulary of `vocab`; a token-dataset source
    /// continues from `resume` when given (the other sources ignore it).
    pub fn new(
        spec: &DataSpec,
        vocab: usize,
        seq_len: usize,
        batch: usize,
        seed: u64,
        resume: Option<&data::LoaderState>,
    ) -> Result<Self> {
        Ok(match spec {
            DataSpec::Markov { branching } => Source::Markov {
                corpus: MarkovCorpus::new(vocab, seed, *branching)?,
                row: vec![0; seq_len + 1],
            },
            DataSpec::Grammar { bytes, tokenizer } => {
                let text = TextCorpus::new(seed).generate(*bytes);
                let tokens = tokenizer.build()?.encode(&text);
                validate_ids(&tokens, vocab)?;
                Source::Windows(TokenWindows::new(tokens, seq_len, seed)?)
            }
            DataSpec::Text { paths, tokenizer } => {
                let tok = tokenizer.build()?;
                let tokens = load_tokens(paths, tok.as_ref())?;
                validate_ids(&tokens, vocab)?;
                Source::Windows(TokenWindows::new(tokens, seq_len, seed)?)
            }
            DataSpec::Dataset { dirs, loader } => {
                let datasets = dirs
                    .iter()
                    .map(|d| Dataset::open(d).map(Arc::new))
                    .collect::<data::Result<Vec<_>>>()?;
                if let Some(d) = datasets
                    .iter()
                    .find(|d| d.manifest().vocab_size as usize > vocab)
                {
                    return Err(crate::error::TrainError::Config {
                        field: "vocab",
                        value: vocab.to_string(),
                        reason: format!(
                            "dataset {} has ids up to {} (vocabulary {})",
                            d.dir().display(),
                            d.manifest().vocab_size - 1,
                            d.manifest().vocab_size
                        ),
                    });
                }
                let mut config = loader.clone();
                config.seq_len = seq_len;
                config.global_batch = batch as u64 * config.world;
                config.seed = seed;
                Source::Loader {
                    loader: Box::new(Loader::new(datasets, &config, resume)?),
                    vocab,
                }
            }
        })
    }

    /// The loader's metrics (data stall, batch latency), when reading datasets.
    pub fn loader_metrics(&self) -> Option<&LoaderMetrics> {
        match self {
            Source::Loader { loader, .. } => Some(loader.metrics()),
            _ => None,
        }
    }

    /// The loader's state (its position), when reading datasets.
    pub fn loader_state(&mut self) -> Option<data::LoaderState> {
        match self {
            Source::Loader { loader, .. } => Some(loader.state()),
            _ => None,
        }
    }

    /// The best achievable loss, when known (the Markov chain's entropy rate).
    pub fn entropy_floor(&self) -> Option<f64> {
        match self {
            Source::Markov { corpus, .. } => Some(corpus.entropy_rate_nats()),
            Source::Windows(_) | Source::Loader { .. } => None,
        }
    }

    /// Fill `inputs` and `targets` (B*T each) with the next batch.
    pub fn next_batch(
        &mut self,
        batch: usize,
        inputs: &mut [u32],
        targets: &mut [u32],
    ) -> Result<()> {
        match self {
            Source::Markov { corpus, row } => {
                let t = row.len() - 1;
                for b in 0..batch {
                    corpus.fill(row);
                    inputs[b * t..(b + 1) * t].copy_from_slice(&row[..t]);
                    targets[b * t..(b + 1) * t].copy_from_slice(&row[1..]);
                }
                Ok(())
            }
            Source::Windows(w) => Ok(w.next_batch(batch, inputs, targets)?),
            Source::Loader { loader, vocab } => {
                let b = loader.next()?;
                b.split_into(inputs, targets)?;
                validate_ids(inputs, *vocab)?;
                validate_ids(targets, *vocab)?;
                loader.recycle(b);
                Ok(())
            }
        }
    }
}
