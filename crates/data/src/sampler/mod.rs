//! The global order of training sequences: a pure function of (seed, position).
//!
//! A dataset's tokens are cut, shard by shard, into sequences of `seq_len + 1` tokens (inputs and
//! the targets shifted by one; consecutive sequences share one token). The tail of each shard
//! shorter than a sequence is not used (less than `seq_len` tokens per shard).
//!
//! **Two-level shuffle** (000 L319, L975-977), keyed by (seed, source, epoch): the shard order is
//! permuted, then the sequences, laid out in that shard order, are permuted within consecutive
//! windows of `window` sequences (the bounded shuffle buffer: a reader touches at most the
//! shards that one window spans). Both permutations are [`Permutation`]s, so the sequence at any
//! position is computed directly; nothing is replayed.
//!
//! **Epochs**: global position `c` of a source is epoch `c / N`, position `c % N` within it, where
//! `N` is the source's sequence count; every epoch yields every sequence exactly once.
//!
//! **Mixtures**: weights become integers summing to a period `M`; each period of `M` global
//! positions holds exactly `w_i` samples of source `i`, in an order permuted per period. Each
//! source advances through its own epochs at its own pace.
//!
//! **Ranks** never enter the order: global batch `s` is positions `[s G, (s+1) G)`, and rank `r`
//! of `W` takes the contiguous `G / W` of them at `s G + r G / W` (disjoint and complete, the
//! seeds' DistributedSampler rules, 000 L1669). A run resumed on another world size therefore
//! continues the same global sequence. The stream has no last batch: batches run on across epoch
//! boundaries, so nothing is padded or dropped.

mod permutation;

pub use permutation::{Permutation, derive_key};

use crate::error::{DataError, Result};

/// Tags that keep the permutations of different purposes independent.
const TAG_SHARDS: u64 = 1;
const TAG_WINDOW: u64 = 2;
const TAG_MIXTURE: u64 = 3;

/// Integer weights of a mixture sum to about this (weights are kept to 0.1 %).
const MIXTURE_PERIOD: f64 = 1000.0;

/// Where one training sequence lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SampleRef {
    /// Index of the dataset in the mixture (0 for a single dataset).
    pub source: u32,
    /// Shard within that dataset.
    pub shard: u32,
    /// Sequence within that shard: tokens `[index * seq_len, index * seq_len + seq_len + 1)`.
    pub index: u64,
}

/// The sequences of one dataset at one sequence length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SequenceSpace {
    per_shard: Vec<u64>,
    total: u64,
}

impl SequenceSpace {
    /// Sequences of `seq_len + 1` tokens in shards of `shard_tokens` tokens.
    pub fn new(shard_tokens: &[u64], seq_len: usize) -> SequenceSpace {
        let t = seq_len.max(1) as u64;
        let per_shard: Vec<u64> = shard_tokens
            .iter()
            .map(|&n| if n > t { (n - 1) / t } else { 0 })
            .collect();
        let total = per_shard.iter().sum();
        SequenceSpace { per_shard, total }
    }

    /// Sequences in all shards: the length of one epoch.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Sequences in each shard.
    pub fn per_shard(&self) -> &[u64] {
        &self.per_shard
    }
}

/// One source's order within one epoch.
#[derive(Clone, Debug)]
struct EpochOrder {
    epoch: u64,
    /// Shards in the order of this epoch.
    shard_order: Vec<u32>,
    /// `prefix[k]`: sequences in the first `k` shards of `shard_order`.
    prefix: Vec<u64>,
    /// The window permutation last used, with its window index.
    window: Option<(u64, Permutation)>,
}

/// The global sequence order of a (possibly weighted) mixture of datasets.
///
/// Cheap to clone; each clone caches the epoch and window it last looked at, so sequential
/// lookups cost a few hashes each.
#[derive(Clone, Debug)]
pub struct Sampler {
    spaces: Vec<SequenceSpace>,
    seed: u64,
    window: u64,
    weights: Vec<u64>,
    /// `cum[i]`: sum of weights before source `i`; `cum[len]` is the period.
    cum: Vec<u64>,
    epochs: Vec<Option<EpochOrder>>,
    period: Option<(u64, Vec<u32>, Vec<u64>)>,
}

impl Sampler {
    /// The order over `spaces` mixed by `weights` (one per space), shuffled by `seed` with a
    /// shuffle window of `window` sequences.
    ///
    /// # Errors
    /// [`DataError::InvalidArgument`] for no sources, a weight count that differs from the
    /// source count, a weight that is not finite and positive, a zero window, or a source
    /// without a single sequence.
    pub fn new(
        spaces: Vec<SequenceSpace>,
        weights: &[f64],
        seed: u64,
        window: u64,
    ) -> Result<Sampler> {
        let invalid = |field, value, requirement: String| DataError::InvalidArgument {
            field,
            value,
            requirement,
        };
        if spaces.is_empty() || weights.len() != spaces.len() {
            return Err(invalid(
                "mixture weights",
                weights.len() as u64,
                format!(
                    "one positive weight per dataset ({} datasets)",
                    spaces.len()
                ),
            ));
        }
        if let Some(w) = weights.iter().find(|w| !(w.is_finite() && **w > 0.0)) {
            return Err(invalid(
                "mixture weight",
                0,
                format!("weights must be finite and positive, got {w}"),
            ));
        }
        if window == 0 {
            return Err(invalid("shuffle window", 0, "at least 1 sequence".into()));
        }
        if let Some(i) = spaces.iter().position(|s| s.total == 0) {
            return Err(invalid(
                "dataset",
                i as u64,
                "every dataset of a mixture needs at least one sequence".into(),
            ));
        }
        let sum: f64 = weights.iter().sum();
        let ints: Vec<u64> = if weights.len() == 1 {
            vec![1]
        } else {
            weights
                .iter()
                .map(|w| ((w / sum * MIXTURE_PERIOD).round() as u64).max(1))
                .collect()
        };
        let mut cum = vec![0];
        for w in &ints {
            cum.push(cum.last().unwrap() + w);
        }
        Ok(Sampler {
            epochs: vec![None; spaces.len()],
            spaces,
            seed,
            window,
            weights: ints,
            cum,
            period: None,
        })
    }

    /// Sequences per epoch of source `source`.
    pub fn epoch_len(&self, source: usize) -> u64 {
        self.spaces[source].total
    }

    /// The integer mixture weights (they sum to the mixing period).
    pub fn weights(&self) -> &[u64] {
        &self.weights
    }

    /// The source's own sample counter at global position `position`: how many samples of each
    /// source precede it. For a single source this is `position`.
    pub fn source_position(&mut self, position: u64) -> (u32, u64) {
        if self.weights.len() == 1 {
            return (0, position);
        }
        let m = *self.cum.last().unwrap();
        let (period, offset) = (position / m, position % m);
        if self.period.as_ref().is_none_or(|(p, _, _)| *p != period) {
            self.period = Some(self.build_period(period));
        }
        let (_, source, rank) = self.period.as_ref().unwrap();
        let s = source[offset as usize];
        (s, period * self.weights[s as usize] + rank[offset as usize])
    }

    /// For one mixing period: the source of each slot and its rank among that source's slots.
    fn build_period(&self, period: u64) -> (u64, Vec<u32>, Vec<u64>) {
        let m = *self.cum.last().unwrap();
        let perm = Permutation::new(m, derive_key(&[self.seed, TAG_MIXTURE, period]));
        let mut source = Vec::with_capacity(m as usize);
        let mut rank = Vec::with_capacity(m as usize);
        let mut seen = vec![0u64; self.weights.len()];
        for offset in 0..m {
            let slot = perm.apply(offset);
            let s = self.cum.partition_point(|&c| c <= slot) - 1;
            source.push(s as u32);
            rank.push(seen[s]);
            seen[s] += 1;
        }
        (period, source, rank)
    }

    /// The sequence at global position `position`.
    pub fn sample(&mut self, position: u64) -> SampleRef {
        let (source, k) = self.source_position(position);
        let n = self.spaces[source as usize].total;
        let (shard, index) = self.lookup(source as usize, k / n, k % n);
        SampleRef {
            source,
            shard,
            index,
        }
    }

    /// Samples of source `source` at global positions before `position`.
    pub fn samples_before(&mut self, source: usize, position: u64) -> u64 {
        if self.weights.len() == 1 {
            return position;
        }
        let m = *self.cum.last().unwrap();
        let (period, offset) = (position / m, position % m);
        if self.period.as_ref().is_none_or(|(p, _, _)| *p != period) {
            self.period = Some(self.build_period(period));
        }
        let slots = &self.period.as_ref().unwrap().1[..offset as usize];
        let in_period = slots.iter().filter(|&&s| s as usize == source).count() as u64;
        period * self.weights[source] + in_period
    }

    /// The epoch source `source` is in at global position `position`.
    pub fn epoch_at(&mut self, source: usize, position: u64) -> u64 {
        self.samples_before(source, position) / self.spaces[source].total
    }

    /// (shard, sequence in shard) at position `p` of `epoch` of one source.
    fn lookup(&mut self, source: usize, epoch: u64, p: u64) -> (u32, u64) {
        if self.epochs[source]
            .as_ref()
            .is_none_or(|o| o.epoch != epoch)
        {
            self.epochs[source] = Some(self.epoch_order(source, epoch));
        }
        let space = &self.spaces[source];
        let (seed, window) = (self.seed, self.window);
        let order = self.epochs[source].as_mut().unwrap();
        let w = p / window;
        let start = w * window;
        let len = window.min(space.total - start);
        if order.window.as_ref().is_none_or(|(i, _)| *i != w) {
            let key = derive_key(&[seed, source as u64, epoch, TAG_WINDOW, w]);
            order.window = Some((w, Permutation::new(len, key)));
        }
        let q = start + order.window.as_ref().unwrap().1.apply(p - start);
        // The last k with prefix[k] <= q; shards with no sequence never match.
        let k = order.prefix.partition_point(|&x| x <= q) - 1;
        let shard = order.shard_order[k];
        (shard, q - order.prefix[k])
    }

    fn epoch_order(&self, source: usize, epoch: u64) -> EpochOrder {
        let space = &self.spaces[source];
        let n = space.per_shard.len() as u64;
        let perm = Permutation::new(
            n,
            derive_key(&[self.seed, source as u64, epoch, TAG_SHARDS]),
        );
        let shard_order: Vec<u32> = (0..n).map(|i| perm.apply(i) as u32).collect();
        let mut prefix = Vec::with_capacity(shard_order.len() + 1);
        prefix.push(0);
        for &s in &shard_order {
            prefix.push(prefix.last().unwrap() + space.per_shard[s as usize]);
        }
        EpochOrder {
            epoch,
            shard_order,
            prefix,
            window: None,
        }
    }
}

/// One rank's share of each global batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankShare {
    /// Sequences per global batch (all ranks together).
    pub global_batch: u64,
    /// Data-parallel ranks.
    pub world: u64,
    /// This rank.
    pub rank: u64,
}

impl RankShare {
    /// Checks `global_batch = world x local_batch` and `rank < world`.
    ///
    /// # Errors
    /// [`DataError::InvalidArgument`] with the equation that failed.
    pub fn new(global_batch: u64, world: u64, rank: u64) -> Result<RankShare> {
        if world == 0 || global_batch == 0 || !global_batch.is_multiple_of(world) {
            return Err(DataError::InvalidArgument {
                field: "global_batch",
                value: global_batch,
                requirement: format!(
                    "global_batch = world x local_batch with local_batch >= 1; world = {world}"
                ),
            });
        }
        if rank >= world {
            return Err(DataError::InvalidArgument {
                field: "rank",
                value: rank,
                requirement: format!("rank < world = {world}"),
            });
        }
        Ok(RankShare {
            global_batch,
            world,
            rank,
        })
    }

    /// Sequences this rank takes per global batch.
    pub fn local_batch(&self) -> u64 {
        self.global_batch / self.world
    }

    /// Global positions of this rank's rows in the global batch starting at `batch_start`.
    pub fn positions(&self, batch_start: u64) -> std::ops::Range<u64> {
        let first = batch_start + self.rank * self.local_batch();
        first..first + self.local_batch()
    }
}
