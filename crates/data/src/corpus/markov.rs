//! A seeded first-order Markov chain over token ids, with its exact entropy rate.

use rand_chacha::ChaCha8Rng;

use crate::error::{DataError, Result};
use crate::rng::{below, stream_rng, table_rng, unit_f64};

/// Upper bound on `vocab * branching`, so a bad argument cannot ask for gigabytes of table.
/// 2^24 transitions take 320 MiB (a `u32` id, an `f64` probability and its running sum each).
pub const MAX_TRANSITIONS: usize = 1 << 24;

/// Power iteration stops when the L1 change of `pi` per step falls below this.
const STATIONARY_TOL: f64 = 1e-13;
/// Power iteration gives up refining after this many steps.
const STATIONARY_MAX_ITERS: usize = 20_000;

/// A seeded first-order Markov chain over token ids, with its exact entropy rate.
///
/// Each token `i` has `branching` distinct successors with fixed probabilities. One successor is
/// `i`'s next token on a random Hamiltonian cycle through the whole vocabulary, which makes the
/// chain irreducible: it has exactly one stationary distribution `pi`, every stream visits every
/// token, and the empirical statistics of any long stream converge to `pi`'s. The other
/// successors are distinct random tokens. Successor `k` (in the order drawn) gets weight
/// `u_k / (k + 1)` with `u_k` uniform in `[0.5, 1.5)`, normalised: a Zipf-like fall-off with
/// per-token jitter.
///
/// The entropy rate `H = sum_i pi_i * H(P_i)` (nats per token) is the lowest cross-entropy any
/// next-token predictor can reach on the stream; `ln(vocab)` is the loss of a uniform guess.
#[derive(Debug, Clone)]
pub struct MarkovCorpus {
    vocab: usize,
    branching: usize,
    /// (vocab, branching): successor ids of each token.
    succ: Vec<u32>,
    /// (vocab, branching): probabilities matching `succ`.
    prob: Vec<f64>,
    /// (vocab, branching): running sums of `prob` per row, the last forced to 1.
    cum: Vec<f64>,
    rng: ChaCha8Rng,
    state: u32,
}

impl MarkovCorpus {
    /// Builds the chain for `(vocab, seed, branching)` and starts a stream from `seed`.
    ///
    /// # Errors
    /// [`DataError::InvalidArgument`] naming `vocab` (must be at least 2) or `branching` (must be
    /// in `1..=vocab`, with `vocab * branching <=` [`MAX_TRANSITIONS`]).
    pub fn new(vocab: usize, seed: u64, branching: usize) -> Result<Self> {
        if vocab < 2 {
            return Err(invalid("vocab", vocab, "must be at least 2".into()));
        }
        if branching == 0 || branching > vocab {
            let req = format!("must satisfy 1 <= branching <= vocab ({vocab})");
            return Err(invalid("branching", branching, req));
        }
        if vocab
            .checked_mul(branching)
            .is_none_or(|n| n > MAX_TRANSITIONS)
        {
            let req = format!("vocab ({vocab}) * branching must be at most {MAX_TRANSITIONS}");
            return Err(invalid("branching", branching, req));
        }
        let (succ, prob) = build_table(vocab, branching, seed);
        let mut cum = Vec::with_capacity(prob.len());
        for row in prob.chunks_exact(branching) {
            let mut acc = 0.0;
            for &p in row {
                acc += p;
                cum.push(acc);
            }
            // Rounding may leave the sum at 1 - 1e-16; a draw of u in that gap must still land.
            if let Some(last) = cum.last_mut() {
                *last = 1.0;
            }
        }
        let mut corpus = MarkovCorpus {
            vocab,
            branching,
            succ,
            prob,
            cum,
            rng: stream_rng(seed),
            state: 0,
        };
        corpus.reseed(seed);
        Ok(corpus)
    }

    /// Restarts the stream from `stream_seed`, keeping the chain. Gives disjoint-looking streams
    /// of the same language, e.g. per rank or for a validation split.
    pub fn reseed(&mut self, stream_seed: u64) {
        self.rng = stream_rng(stream_seed);
        // vocab <= MAX_TRANSITIONS < 2^32, so the start fits in u32.
        self.state = below(&mut self.rng, self.vocab as u64) as u32;
    }

    /// Vocabulary size: every generated id is below it.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Successors per token.
    pub fn branching(&self) -> usize {
        self.branching
    }

    /// Successors of `token` and their probabilities, or `None` if `token >= vocab`.
    pub fn successors(&self, token: u32) -> Option<(&[u32], &[f64])> {
        let row = self.row(token as usize)?;
        Some((&self.succ[row.clone()], &self.prob[row]))
    }

    /// Fills `out` with the next `out.len()` tokens of the stream; successive calls continue it.
    pub fn fill(&mut self, out: &mut [u32]) {
        let b = self.branching;
        for slot in out {
            let base = self.state as usize * b;
            let u = unit_f64(&mut self.rng);
            let cum = &self.cum[base..base + b];
            // First successor whose running sum exceeds u; the last sum is 1 > u.
            let k = cum.partition_point(|&c| c <= u).min(b - 1);
            self.state = self.succ[base + k];
            *slot = self.state;
        }
    }

    /// Exact entropy rate of the chain in nats per token: the best achievable loss.
    ///
    /// Computes the stationary distribution by power iteration (a few hundred passes over the
    /// table for well-mixing chains), so call it once, not per step. Zero when `branching == 1`.
    pub fn entropy_rate_nats(&self) -> f64 {
        if self.branching == 1 {
            // Every row is a certainty: the stream is a fixed cycle.
            return 0.0;
        }
        let pi = self.stationary();
        let row_entropy = self.prob.chunks_exact(self.branching).map(|row| {
            row.iter()
                .filter(|&&p| p > 0.0)
                .map(|&p| -p * p.ln())
                .sum::<f64>()
        });
        pi.iter().zip(row_entropy).map(|(p, h)| p * h).sum()
    }

    /// Loss of a uniform guess over the vocabulary, `ln(vocab)` nats: the loss at initialisation.
    pub fn uniform_nats(&self) -> f64 {
        (self.vocab as f64).ln()
    }

    /// Stationary distribution by power iteration on the lazy chain `(I + P) / 2`.
    ///
    /// The lazy chain has the same stationary distribution as `P` and is aperiodic, so the
    /// iteration converges even if `P` itself is periodic (e.g. a pure cycle).
    fn stationary(&self) -> Vec<f64> {
        let v = self.vocab;
        let b = self.branching;
        let mut pi = vec![1.0 / v as f64; v];
        let mut next = vec![0.0; v];
        for _ in 0..STATIONARY_MAX_ITERS {
            next.iter_mut().zip(&pi).for_each(|(n, &p)| *n = 0.5 * p);
            for (i, &p) in pi.iter().enumerate() {
                let half = 0.5 * p;
                let row = i * b..(i + 1) * b;
                for (&j, &q) in self.succ[row.clone()].iter().zip(&self.prob[row]) {
                    next[j as usize] += half * q;
                }
            }
            let delta: f64 = next.iter().zip(&pi).map(|(a, b)| (a - b).abs()).sum();
            std::mem::swap(&mut pi, &mut next);
            if delta < STATIONARY_TOL {
                break;
            }
        }
        pi
    }

    fn row(&self, token: usize) -> Option<std::ops::Range<usize>> {
        (token < self.vocab).then(|| token * self.branching..(token + 1) * self.branching)
    }
}

/// Draws the successor table: `(succ, prob)`, each (vocab, branching).
fn build_table(vocab: usize, branching: usize, seed: u64) -> (Vec<u32>, Vec<f64>) {
    let mut rng = table_rng(seed);
    // A random Hamiltonian cycle: order[k] -> order[k + 1], wrapping.
    let mut order: Vec<u32> = (0..vocab as u32).collect();
    shuffle_prefix(&mut order, vocab, &mut rng);
    let mut cycle_next = vec![0u32; vocab];
    for k in 0..vocab {
        cycle_next[order[k] as usize] = order[(k + 1) % vocab];
    }

    // `perm` stays a permutation of 0..vocab; a partial Fisher-Yates over it draws `branching`
    // distinct tokens in O(branching) per row, whatever state earlier rows left it in.
    let mut perm = order;
    let mut succ = Vec::with_capacity(vocab * branching);
    let mut prob = Vec::with_capacity(vocab * branching);
    for &forced in &cycle_next {
        shuffle_prefix(&mut perm, branching, &mut rng);
        let mut row: Vec<u32> = perm[..branching].to_vec();
        // Put the cycle successor into the row at a random slot, unless already drawn.
        if !row.contains(&forced) {
            let slot = below(&mut rng, branching as u64) as usize;
            row[slot] = forced;
        }
        let weights: Vec<f64> = (0..branching)
            .map(|k| (0.5 + unit_f64(&mut rng)) / (k + 1) as f64)
            .collect();
        let total: f64 = weights.iter().sum();
        succ.extend_from_slice(&row);
        prob.extend(weights.iter().map(|w| w / total));
    }
    (succ, prob)
}

/// Moves `k` uniformly drawn distinct elements of `xs` into `xs[..k]` (partial Fisher-Yates).
fn shuffle_prefix(xs: &mut [u32], k: usize, rng: &mut ChaCha8Rng) {
    let n = xs.len();
    for i in 0..k.min(n) {
        let j = i + below(rng, (n - i) as u64) as usize;
        xs.swap(i, j);
    }
}

fn invalid(field: &'static str, value: usize, requirement: String) -> DataError {
    DataError::InvalidArgument {
        field,
        value: value as u64,
        requirement,
    }
}
