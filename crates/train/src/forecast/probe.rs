//! The kernel probe: how long this machine takes for one unit of the model (the embeddings,
//! one transformer block, the head with the loss), forward and backward, and for the update of
//! one parameter. The forecast multiplies these out to the whole model (`L` blocks, `P`
//! parameters), the way per-layer profiles feed Megatron-style estimators; the step itself is
//! never timed here.
//!
//! The probe builds a two-block model of the run's shape (same width, heads, FFN, vocabulary,
//! sequence and micro-batch) and runs it unit by unit. Every rank probes at once (after a
//! barrier) so that the cores are shared as in training.

use crate::config::TrainConfig;
use crate::error::Result;
use model::Threads;
use model::init::init_params;
use model::layout::Unit;
use model::model::Model;
use model::optim::AdamW;
use model::optim::clip::grad_sum_sq;
use std::time::Instant;

/// What the probe measured: per unit kind (embeddings, block, head) the median forward and
/// backward seconds and their spread over the repetitions, and the per-parameter and per-byte
/// costs of the work around them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct UnitTimes {
    /// Forward seconds of the embeddings, one block, the head with the loss.
    pub fwd: [f64; 3],
    /// Backward seconds, same order (a block's includes its recomputed forward, if any).
    pub bwd: [f64; 3],
    /// Standard deviation of `fwd` over the repetitions: the noise that makes ranks wait for
    /// each other at every collective.
    pub fwd_sd: [f64; 3],
    /// Standard deviation of `bwd`.
    pub bwd_sd: [f64; 3],
    /// Seconds per parameter of the update: zeroing the gradient, its squared norm, AdamW.
    pub update_per_param: f64,
    /// Seconds per byte of a memory copy (staging buffers of the collectives).
    pub copy_per_byte: f64,
    /// Seconds per byte of first touching fresh pages (a new zeroed buffer, or pages a ZeRO
    /// window handed back): the page faults, beyond the copy itself.
    pub fault_per_byte: f64,
}

/// Index of `unit`'s kind in [`UnitTimes`]' arrays (embeddings 0, block 1, head 2).
pub fn kind(unit: Unit) -> usize {
    match unit {
        Unit::Embed => 0,
        Unit::Block(_) => 1,
        Unit::Head => 2,
    }
}

/// Number of values in [`UnitTimes::to_vec`].
pub const VALUES: usize = 15;

impl UnitTimes {
    /// Every value in one vector (for a collective reduction over the ranks).
    pub fn to_vec(&self) -> Vec<f64> {
        let mut v = Vec::with_capacity(VALUES);
        for a in [self.fwd, self.bwd, self.fwd_sd, self.bwd_sd] {
            v.extend_from_slice(&a);
        }
        v.extend_from_slice(&[
            self.update_per_param,
            self.copy_per_byte,
            self.fault_per_byte,
        ]);
        v
    }

    /// The inverse of [`UnitTimes::to_vec`]; `None` unless `v` has [`VALUES`] values.
    pub fn from_slice(v: &[f64]) -> Option<UnitTimes> {
        if v.len() != VALUES {
            return None;
        }
        let three = |i: usize| [v[i], v[i + 1], v[i + 2]];
        Some(UnitTimes {
            fwd: three(0),
            bwd: three(3),
            fwd_sd: three(6),
            bwd_sd: three(9),
            update_per_param: v[12],
            copy_per_byte: v[13],
            fault_per_byte: v[14],
        })
    }

    /// Forward seconds of `unit`.
    pub fn forward(&self, unit: Unit) -> f64 {
        self.fwd[kind(unit)]
    }

    /// Backward seconds of `unit`.
    pub fn backward(&self, unit: Unit) -> f64 {
        self.bwd[kind(unit)]
    }

    /// Variance of the forward of `unit`.
    pub fn forward_var(&self, unit: Unit) -> f64 {
        self.fwd_sd[kind(unit)].powi(2)
    }

    /// Variance of the backward of `unit`.
    pub fn backward_var(&self, unit: Unit) -> f64 {
        self.bwd_sd[kind(unit)].powi(2)
    }
}

/// Blocks in the probe's model: two, so that a block runs after another as in the real one
/// (caches and TLBs hold the previous block's data, not its own from the pass before).
pub const PROBE_BLOCKS: usize = 2;

/// Probes the units of `cfg`'s model with `th`: one untimed pass, then `reps` timed ones.
pub fn measure(cfg: &TrainConfig, th: &Threads, reps: usize, tp: usize) -> Result<UnitTimes> {
    measure_kinds(cfg, th, reps, tp, [true; 3])
}

/// [`measure`] of the unit kinds set in `kinds` (embeddings, block, head) only: a pipeline
/// stage probes what it runs, so that the cores are shared as in its training (a light stage
/// idles while a heavy one computes). The other kinds read 0; the kernels' cost does not
/// depend on the values a skipped unit would have left.
pub fn measure_kinds(
    cfg: &TrainConfig,
    th: &Threads,
    reps: usize,
    tp: usize,
    kinds: [bool; 3],
) -> Result<UnitTimes> {
    let mut one = cfg.model.clone();
    one.layers = cfg.model.layers.min(PROBE_BLOCKS);
    // A tensor-parallel rank's compute: its blocks' shards (its sums are priced apart).
    let recompute = vec![cfg.recompute; one.layers];
    let mut m = Model::<f32>::split(&one, cfg.batch, cfg.seq_len, recompute, (tp, false))?;
    let total = m.layout().total;
    let mut params = vec![0f32; total];
    init_params(&one, m.layout(), cfg.seed, &mut params);
    let mut grads = vec![0f32; total];
    let n = cfg.batch * cfg.seq_len;
    let (tokens, targets) = probe_tokens(cfg.seed, one.vocab, n);
    let units: Vec<Unit> = m
        .layout()
        .units()
        .into_iter()
        .filter(|&u| kinds[kind(u)])
        .collect();
    let (first, last) = match (units.first(), units.last()) {
        (Some(&f), Some(&l)) => (f, l),
        _ => return Ok(UnitTimes::default()),
    };
    // A part of the model (a pipeline stage's units) starts from a residual and ends with
    // its gradient, as the stage's chunks do.
    let residual = vec![0f32; n * one.d_model];
    let targets = (last == Unit::Head).then_some(&targets[..]);
    let (mut fwd, mut bwd): ([Vec<f64>; 3], [Vec<f64>; 3]) = Default::default();
    for rep in 0..=reps.max(1) {
        match first {
            Unit::Embed => m.begin_at(first, None, Some(&tokens), targets)?,
            _ => m.begin_at(first, Some(&residual), None, targets)?,
        }
        for &u in &units {
            let t = Instant::now();
            m.forward_unit(th, &params, u)?;
            if rep > 0 {
                fwd[kind(u)].push(t.elapsed().as_secs_f64());
            }
        }
        m.begin_backward_at(last, (last != Unit::Head).then_some(&residual[..]))?;
        for &u in units.iter().rev() {
            let t = Instant::now();
            m.backward_unit(th, &params, &mut grads, u)?;
            if rep > 0 {
                bwd[kind(u)].push(t.elapsed().as_secs_f64());
            }
        }
    }
    let mut opt = AdamW::new(cfg.adamw, total)?;
    // Weight decay on every element: the most work AdamW does per element.
    let all: Vec<std::ops::Range<usize>> = std::iter::once(0..total).collect();
    let (mut update, mut copy, mut fault) = (Vec::new(), Vec::new(), Vec::new());
    let mut staging = vec![0f32; total];
    let bytes = (4 * total) as f64;
    for rep in 0..=reps.max(1) {
        let t = Instant::now();
        grads.fill(0.0);
        let sq = grad_sum_sq(th, &grads);
        opt.step(th, &mut params, &grads, 1e-9, &all)?;
        let dt = t.elapsed().as_secs_f64();
        let t = Instant::now();
        staging.copy_from_slice(&params);
        let dc = t.elapsed().as_secs_f64();
        // The same copy into a buffer just allocated, then freed: its pages are faulted in as
        // it is written and unmapped after, as a transient staging buffer's are.
        let t = Instant::now();
        let mut fresh = vec![0f32; total];
        fresh.copy_from_slice(&params);
        std::hint::black_box(&fresh);
        drop(fresh);
        let df = t.elapsed().as_secs_f64();
        std::hint::black_box((sq, &staging));
        if rep > 0 {
            update.push(dt / total as f64);
            copy.push(dc / bytes);
            fault.push((df - dc).max(0.0) / bytes);
        }
    }
    let mut t = UnitTimes {
        update_per_param: median(&mut update),
        copy_per_byte: median(&mut copy),
        fault_per_byte: median(&mut fault),
        ..UnitTimes::default()
    };
    for k in 0..3 {
        (t.fwd[k], t.fwd_sd[k]) = (median(&mut fwd[k]), sd(&fwd[k]));
        (t.bwd[k], t.bwd_sd[k]) = (median(&mut bwd[k]), sd(&bwd[k]));
    }
    Ok(t)
}

/// A fixed pseudo-random stream of `n` tokens and `n` targets below `vocab` (xorshift from
/// `seed`): a probe's input, since the kernels' cost does not depend on the values.
pub fn probe_tokens(seed: u64, vocab: usize, n: usize) -> (Vec<u32>, Vec<u32>) {
    let vocab = vocab.max(1) as u64;
    let mut x = seed | 1;
    let mut tok = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % vocab) as u32
    };
    let tokens: Vec<u32> = (0..n).map(|_| tok()).collect();
    let targets: Vec<u32> = (0..n).map(|_| tok()).collect();
    (tokens, targets)
}

/// Sample standard deviation (0 for fewer than two values).
fn sd(v: &[f64]) -> f64 {
    if v.len() < 2 {
        return 0.0;
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
