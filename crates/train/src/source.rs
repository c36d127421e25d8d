//! Where training batches come from: the built-in corpora, text files, or token datasets
//! through the data loader.
use std::sync::Arc;

use crate::config::DataSpec;
use crate::error::Result;
use data::{
    Loader, LoaderMetrics, MarkovCorpus, TextCorpus, TokenWindows, load_tokens, validate_ids,
};

/// This process's share of each global batch: `batch` rows, rank `rank` of `world`
/// data-parallel ranks (rows `rank * batch ..` of the global batch of `world * batch` rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    /// Rows per rank (the micro-batch).
    pub batch: usize,
    /// Data-parallel ranks.
    pub world: usize,
    /// This rank.
    pub rank: usize,
}

impl Share {
    /// One process taking whole batches of `batch` rows.
    pub fn whole(batch: usize) -> Share {
        Share {
            batch,
            world: 1,
            rank: 0,
        }
    }
}

/// A deterministic stream of (inputs, targets) batches, of which this rank takes its
/// [`Share`]: the data loader reads only its rows; the built-in corpora generate the global
/// batch and keep this rank's rows, so N ranks see exactly the rows one process would.
pub struct Source {
    kind: Kind,
    share: Share,
    /// Global-batch buffers of the built-in corpora when `world > 1`.
    global: (Vec<u32>, Vec<u32>),
}

/// Where the rows come from.
enum Kind {
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
    /// The source of `cfg`'s data for this rank's `share`, from the start (no resume): every
    /// engine that draws the same batches on every rank passes `Share::whole(cfg.batch)`.
    pub fn for_config(cfg: &crate::config::TrainConfig, share: Share) -> Result<Self> {
        Self::new(
            &cfg.data,
            cfg.model.vocab,
            cfg.seq_len,
            share,
            cfg.seed,
            None,
        )
    }

    /// Build the source for `spec`, with a model vocabulary of `vocab`, for this rank's `share`;
    /// a token-dataset source continues from `resume` when given (the other sources ignore it).
    pub fn new(
        spec: &DataSpec,
        vocab: usize,
        seq_len: usize,
        share: Share,
        seed: u64,
        resume: Option<&data::LoaderState>,
    ) -> Result<Self> {
        let kind = Kind::new(spec, vocab, seq_len, share, seed, resume)?;
        Ok(Self::of_kind(kind, seq_len, share))
    }

    /// The rows of the Markov `corpus`'s stream from where it stands, for `share` (a
    /// held-out split: the chain of the training data, a stream of its own).
    pub fn markov(corpus: MarkovCorpus, seq_len: usize, share: Share) -> Self {
        let row = vec![0; seq_len + 1];
        Self::of_kind(Kind::Markov { corpus, row }, seq_len, share)
    }

    fn of_kind(kind: Kind, seq_len: usize, share: Share) -> Self {
        let global = match (&kind, share.world) {
            (Kind::Loader { .. }, _) | (_, 1) => (Vec::new(), Vec::new()),
            _ => {
                let n = share.batch * share.world * seq_len;
                (vec![0; n], vec![0; n])
            }
        };
        Source {
            kind,
            share,
            global,
        }
    }

    /// The source of `spec` for `share` at a checkpoint's global row cursor `rows`: from the
    /// loader's state `resume` for token datasets, else by skipping the `rows` rows the saving
    /// run consumed (on any number of ranks); with the cursor split into whole global batches
    /// of `share.batch x share.world` rows drawn and the rows before them.
    pub(crate) fn resumed_at(
        spec: &DataSpec,
        vocab: usize,
        seq_len: usize,
        share: Share,
        seed: u64,
        resume: Option<&data::LoaderState>,
        rows: u64,
    ) -> Result<(Self, u64, u64)> {
        let mut source = Self::new(spec, vocab, seq_len, share, seed, resume)?;
        if resume.is_none() {
            source.skip_rows(rows, seq_len)?;
        }
        let per = (share.batch * share.world).max(1) as u64;
        Ok((source, rows / per, rows % per))
    }

    /// The loader's metrics (data stall, batch latency), when reading datasets.
    pub fn loader_metrics(&self) -> Option<&LoaderMetrics> {
        self.kind.loader_metrics()
    }

    /// The loader's state (its position), when reading datasets.
    pub fn loader_state(&mut self) -> Option<data::LoaderState> {
        self.kind.loader_state()
    }

    /// The best achievable loss, when known (the Markov chain's entropy rate).
    pub fn entropy_floor(&self) -> Option<f64> {
        self.kind.entropy_floor()
    }

    /// Skips the next `rows` rows of the stream (the built-in corpora: their rows come one
    /// after another whatever the batch, so a run resumed on another number of ranks continues
    /// the same stream at its global row cursor). A token-dataset source continues from its
    /// loader state instead and ignores this.
    pub fn skip_rows(&mut self, rows: u64, seq_len: usize) -> Result<()> {
        if matches!(self.kind, Kind::Loader { .. }) {
            return Ok(());
        }
        let (mut i, mut t) = (vec![0; seq_len], vec![0; seq_len]);
        for _ in 0..rows {
            self.kind.next_batch(1, &mut i, &mut t)?;
        }
        Ok(())
    }

    /// Fill `inputs` and `targets` (this rank's rows x T each) with its share of the next
    /// global batch.
    pub fn next_batch(&mut self, inputs: &mut [u32], targets: &mut [u32]) -> Result<()> {
        let Share { batch, world, rank } = self.share;
        if world == 1 || matches!(self.kind, Kind::Loader { .. }) {
            return self.kind.next_batch(batch, inputs, targets);
        }
        let (gi, gt) = &mut self.global;
        self.kind.next_batch(batch * world, gi, gt)?;
        let (n, at) = (inputs.len(), rank * inputs.len());
        inputs.copy_from_slice(&gi[at..at + n]);
        targets.copy_from_slice(&gt[at..at + n]);
        Ok(())
    }
}

impl Kind {
    fn new(
        spec: &DataSpec,
        vocab: usize,
        seq_len: usize,
        share: Share,
        seed: u64,
        resume: Option<&data::LoaderState>,
    ) -> Result<Self> {
        let batch = share.batch;
        Ok(match spec {
            DataSpec::Markov { branching } => Kind::Markov {
                corpus: MarkovCorpus::new(vocab, seed, *branching)?,
                row: vec![0; seq_len + 1],
            },
            DataSpec::Grammar { bytes, tokenizer } => {
                let text = TextCorpus::new(seed).generate(*bytes);
                let tokens = tokenizer.build()?.encode(&text);
                validate_ids(&tokens, vocab)?;
                Kind::Windows(TokenWindows::new(tokens, seq_len, seed)?)
            }
            DataSpec::Text { paths, tokenizer } => {
                let tok = tokenizer.build()?;
                let tokens = load_tokens(paths, tok.as_ref())?;
                validate_ids(&tokens, vocab)?;
                Kind::Windows(TokenWindows::new(tokens, seq_len, seed)?)
            }
            DataSpec::Dataset { dirs, loader } => {
                let datasets = dirs
                    .iter()
                    .map(|d| data::cache::open(d, &loader.cache).map(Arc::new))
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
                config.world = share.world as u64;
                config.rank = share.rank as u64;
                config.global_batch = batch as u64 * config.world;
                config.seed = seed;
                Kind::Loader {
                    loader: Box::new(Loader::new(datasets, &config, resume)?),
                    vocab,
                }
            }
        })
    }

    fn loader_metrics(&self) -> Option<&LoaderMetrics> {
        match self {
            Kind::Loader { loader, .. } => Some(loader.metrics()),
            _ => None,
        }
    }

    fn loader_state(&mut self) -> Option<data::LoaderState> {
        match self {
            Kind::Loader { loader, .. } => Some(loader.state()),
            _ => None,
        }
    }

    fn entropy_floor(&self) -> Option<f64> {
        match self {
            Kind::Markov { corpus, .. } => Some(corpus.entropy_rate_nats()),
            Kind::Windows(_) | Kind::Loader { .. } => None,
        }
    }

    /// Fill `inputs` and `targets` (`batch` x T each) with the next `batch` rows.
    fn next_batch(&mut self, batch: usize, inputs: &mut [u32], targets: &mut [u32]) -> Result<()> {
        match self {
            Kind::Markov { corpus, row } => {
                let t = row.len() - 1;
                for b in 0..batch {
                    corpus.fill(row);
                    inputs[b * t..(b + 1) * t].copy_from_slice(&row[..t]);
                    targets[b * t..(b + 1) * t].copy_from_slice(&row[1..]);
                }
                Ok(())
            }
            Kind::Windows(w) => Ok(w.next_batch(batch, inputs, targets)?),
            Kind::Loader { loader, vocab } => {
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
