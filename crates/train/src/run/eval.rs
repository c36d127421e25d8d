//! `--eval-every N`: the validation loss on a held-out split, every N steps and after the last.
//!
//! The held-out split is defined by the data and the seed alone, so it is the same for every
//! layout, world size and restart:
//! - the Markov corpus: the same chain (same seed) with its stream restarted from
//!   `seed ^` [`HELD_OUT_SEED`] ([`data::MarkovCorpus::reseed`]), rows the training stream
//!   does not draw in that order;
//! - the grammar corpus: a separate text of the same grammar generated from
//!   `seed ^ HELD_OUT_SEED` (at most [`HELD_OUT_BYTES`]), its windows drawn from that seed.
//!
//! Each evaluation takes the first `batches x batch` rows of that split, the same rows every
//! time (a fixed validation set), on every rank; the ranks' losses are averaged. Text files
//! and token datasets have no held-out split defined yet, and the pipeline and MoE engines no
//! forward-only pass under the run loop: [`check`] refuses those before any worker starts.
use comm::group::ProcessGroup;

use super::config::{RunConfig, refused};
use super::engine::Engine;
use crate::config::{DataSpec, TrainConfig};
use crate::error::{Context, Result};
use crate::source::{Share, Source};

/// Mixed into the seed to make the held-out stream ("HELDOUT" in ASCII).
pub const HELD_OUT_SEED: u64 = 0x48_454C_444F_5554;
/// Largest held-out text of the grammar corpus, bytes.
pub const HELD_OUT_BYTES: usize = 1 << 20;

/// Refuses `--eval-every` where no held-out split or forward-only pass is built (with why).
pub fn check(cfg: &RunConfig) -> Result<()> {
    if cfg.eval_every == 0 {
        return Ok(());
    }
    if cfg.eval_batches == 0 {
        return Err(refused(
            "--eval-batches 0: evaluate at least one batch".into(),
        ));
    }
    if cfg.layout.pp > 1 {
        return Err(refused(format!(
            "--eval-every with --pp {}: a forward-only pass through the pipeline stages is not \
             built yet",
            cfg.layout.pp
        )));
    }
    held_out_spec(&cfg.train.data).map(|_| ())
}

/// The held-out split's data: the built-in corpora only (see the module docs).
fn held_out_spec(spec: &DataSpec) -> Result<DataSpec> {
    match spec {
        DataSpec::Markov { .. } => Ok(spec.clone()),
        DataSpec::Grammar { bytes, tokenizer } => Ok(DataSpec::Grammar {
            bytes: (*bytes).min(HELD_OUT_BYTES),
            tokenizer: *tokenizer,
        }),
        DataSpec::Text { .. } | DataSpec::Dataset { .. } => Err(refused(
            "--eval-every with --data files or --dataset: no held-out split of them is defined \
             yet (the built-in corpora have one, docs/OBSERVE.md)"
                .into(),
        )),
    }
}

/// The run's evaluation schedule.
pub(super) struct HeldOut {
    every: u64,
    batches: usize,
}

impl HeldOut {
    /// The schedule of `cfg`, if it evaluates.
    pub(super) fn of(cfg: &RunConfig) -> Option<HeldOut> {
        (cfg.eval_every > 0).then_some(HeldOut {
            every: cfg.eval_every,
            batches: cfg.eval_batches,
        })
    }

    /// Whether step `step` of `steps` is evaluated.
    pub(super) fn due(&self, step: u64, steps: u64) -> bool {
        step.is_multiple_of(self.every) || step == steps
    }

    /// The held-out loss of `engine` now, averaged over the ranks of `world` (collective),
    /// and the rows each rank evaluated.
    pub(super) fn loss(
        &self,
        engine: &mut Engine,
        train: &TrainConfig,
        world: Option<&ProcessGroup>,
    ) -> Result<(f64, usize)> {
        let spec = held_out_spec(&train.data)?;
        let share = Share::whole(train.batch);
        let seed = train.seed ^ HELD_OUT_SEED;
        let mut source = match spec {
            // The same chain as training (its seed), a stream of its own.
            DataSpec::Markov { branching } => {
                let mut corpus = data::MarkovCorpus::new(train.model.vocab, train.seed, branching)?;
                corpus.reseed(seed);
                Source::markov(corpus, train.seq_len, share)
            }
            other => Source::new(&other, train.model.vocab, train.seq_len, share, seed, None)?,
        };
        let loss = match engine {
            Engine::Data(t) | Engine::Tensor(t) => t.eval_loss_on(&mut source, self.batches)?,
            _ => {
                return Err(refused(
                    "--eval-every: this engine has no forward-only pass".into(),
                ));
            }
        };
        let mut v = [loss];
        if let Some(g) = world {
            g.all_reduce(&mut v, comm::ReduceOp::Sum)
                .ctx(|| "averaging the validation loss over the ranks".into())?;
            v[0] /= g.size() as f64;
        }
        Ok((v[0], self.batches * train.batch))
    }
}
