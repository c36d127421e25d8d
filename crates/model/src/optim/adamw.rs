//! AdamW (decoupled weight decay) over one flat f32 parameter buffer.
//!
//! The arithmetic follows PyTorch's single-tensor `torch.optim.AdamW`
//! (`foreach=False`) on CPU operation for operation, so the same inputs give
//! the same f32 results bit for bit:
//!
//! ```text
//! param.mul_(1 - lr*wd)                                  (decayed elements only)
//! exp_avg.lerp_(grad, 1 - beta1)                         fma(w, g - m, m)
//! exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
//!                                                        fma((1 - beta2) * g, g, v * beta2)
//! step_size = lr / (1 - beta1**step)                     (f64, like Python)
//! denom = exp_avg_sq.sqrt() / sqrt(1 - beta2**step) + eps
//! param.addcdiv_(exp_avg, denom, value=-step_size)
//! ```
//!
//! Scalars are computed in f64 (as Python floats) and rounded to f32 once,
//! where PyTorch's kernels round them.
use crate::error::{ModelError, Result};
use crate::threads::{SharedMut, Threads};
use std::ops::Range;

/// Smallest number of elements one thread updates per step.
const MIN_PER_THREAD: usize = 1 << 14;

/// AdamW hyperparameters (the defaults are `torch.optim.AdamW`'s).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Decay rate of the first moment, in `[0, 1)`.
    pub beta1: f64,
    /// Decay rate of the second moment, in `[0, 1)`.
    pub beta2: f64,
    /// Added to the denominator for stability, `> 0`.
    pub eps: f64,
    /// Decoupled weight decay, `>= 0`, applied only inside the decay ranges.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

fn bad(field: &'static str, value: impl std::fmt::Display, reason: &str) -> ModelError {
    ModelError::Optim {
        field,
        value: value.to_string(),
        reason: reason.into(),
    }
}

impl AdamWConfig {
    /// Check every field, naming the first bad one.
    pub fn validate(&self) -> Result<()> {
        for (field, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(b.is_finite() && (0.0..1.0).contains(&b)) {
                return Err(bad(field, b, "must be in [0, 1)"));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(bad("eps", self.eps, "must be finite and > 0"));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(bad(
                "weight_decay",
                self.weight_decay,
                "must be finite and >= 0",
            ));
        }
        Ok(())
    }
}

/// The per-step f32 scalars of the update, rounded where PyTorch rounds them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Coeffs {
    /// `1 - lr*wd` (multiplies decayed parameters).
    decay: f32,
    /// Lerp weight `1 - beta1`.
    w1: f32,
    /// `beta2`.
    b2: f32,
    /// `1 - beta2`.
    w2: f32,
    /// `sqrt(1 - beta2^step)`.
    bc2_sqrt: f32,
    /// `eps`.
    eps: f32,
    /// `-lr / (1 - beta1^step)`.
    neg_step: f32,
}

impl Coeffs {
    fn new(cfg: &AdamWConfig, lr: f32, step: u64) -> Self {
        let lr = f64::from(lr);
        let t = step as f64;
        // Python: `beta**step` with a float step (C pow) and `x**0.5`.
        let bc1 = 1.0 - cfg.beta1.powf(t);
        let bc2 = 1.0 - cfg.beta2.powf(t);
        let step_size = lr / bc1;
        Self {
            decay: (1.0 - lr * cfg.weight_decay) as f32,
            w1: (1.0 - cfg.beta1) as f32,
            b2: cfg.beta2 as f32,
            w2: (1.0 - cfg.beta2) as f32,
            bc2_sqrt: bc2.powf(0.5) as f32,
            eps: cfg.eps as f32,
            neg_step: (-step_size) as f32,
        }
    }
}

/// Update `p`, `m`, `v` in place from `g` (all the same length).
///
/// `decayed` says whether weight decay applies to this segment.
#[inline]
pub(crate) fn update(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &Coeffs,
    decayed: bool,
) {
    // PyTorch's vectorised lerp: |w| < 0.5 ? fma(w, g - m, m) : fma(w - 1, g - m, g).
    match (decayed, k.w1 < 0.5) {
        (true, true) => update_loop::<true, true>(p, g, m, v, k),
        (true, false) => update_loop::<true, false>(p, g, m, v, k),
        (false, true) => update_loop::<false, true>(p, g, m, v, k),
        (false, false) => update_loop::<false, false>(p, g, m, v, k),
    }
}

#[inline(always)]
fn update_loop<const DECAY: bool, const SMALL_W1: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &Coeffs,
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    let w1m1 = k.w1 - 1.0;
    for i in 0..n {
        let gi = g[i];
        let mut pi = p[i];
        if DECAY {
            pi *= k.decay;
        }
        let mi = m[i];
        let mi = if SMALL_W1 {
            k.w1.mul_add(gi - mi, mi)
        } else {
            w1m1.mul_add(gi - mi, gi)
        };
        let vi = v[i] * k.b2;
        let vi = (k.w2 * gi).mul_add(gi, vi);
        let denom = vi.sqrt() / k.bc2_sqrt + k.eps;
        p[i] = pi + k.neg_step * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

/// Check `ranges` against `0..len` and return them sorted, merged and
/// without empty ones.
pub(crate) fn normalize_ranges(ranges: &[Range<usize>], len: usize) -> Result<Vec<Range<usize>>> {
    let mut rs = Vec::with_capacity(ranges.len());
    for r in ranges {
        if r.start > r.end || r.end > len {
            return Err(bad(
                "decay",
                format!("{r:?}"),
                &format!("range must lie within 0..{len}"),
            ));
        }
        if r.start < r.end {
            rs.push(r.clone());
        }
    }
    rs.sort_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(rs.len());
    for r in rs {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    Ok(out)
}

/// Call `f(segment, decayed)` for consecutive segments covering `chunk`,
/// split at the boundaries of the (normalised) decay ranges.
pub(crate) fn for_each_segment(
    chunk: Range<usize>,
    decay: &[Range<usize>],
    mut f: impl FnMut(Range<usize>, bool),
) {
    let mut idx = decay.partition_point(|d| d.end <= chunk.start);
    let mut pos = chunk.start;
    while pos < chunk.end {
        match decay.get(idx) {
            Some(d) if d.start <= pos => {
                let end = d.end.min(chunk.end);
                f(pos..end, true);
                pos = end;
                idx += 1;
            }
            Some(d) => {
                let end = d.start.min(chunk.end);
                f(pos..end, false);
                pos = end;
            }
            None => {
                f(pos..chunk.end, false);
                pos = chunk.end;
            }
        }
    }
}

/// One part of a state-wide AdamW step ([`AdamW::step_parts`]).
pub struct StatePart<'a> {
    /// Index of the part's first element in the state.
    pub at: usize,
    /// The part's parameters, updated in place.
    pub params: &'a mut [f32],
    /// Their gradients.
    pub grads: &'a [f32],
}

/// AdamW state for a fixed number of parameters: both moments and the
/// number of steps taken.
#[derive(Debug, Clone)]
pub struct AdamW {
    cfg: AdamWConfig,
    m: Vec<f32>,
    v: Vec<f32>,
    step: u64,
}

impl AdamW {
    /// Fresh state (zero moments, step 0) for `len` parameters.
    pub fn new(cfg: AdamWConfig, len: usize) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            cfg,
            m: vec![0.0; len],
            v: vec![0.0; len],
            step: 0,
        })
    }

    /// Restore saved state (from [`moments`](Self::moments) and
    /// [`step_count`](Self::step_count)); the moments must have equal lengths,
    /// be finite, and the second moment must be non-negative.
    pub fn from_state(cfg: AdamWConfig, m: Vec<f32>, v: Vec<f32>, step: u64) -> Result<Self> {
        cfg.validate()?;
        if v.len() != m.len() {
            return Err(ModelError::Shape {
                what: "adamw second moment",
                expected: m.len(),
                got: v.len(),
            });
        }
        if let Some(&x) = m.iter().find(|x| !x.is_finite()) {
            return Err(ModelError::NonFinite {
                what: "adamw first moment",
                step,
                value: f64::from(x),
            });
        }
        if let Some(&x) = v.iter().find(|x| !x.is_finite()) {
            return Err(ModelError::NonFinite {
                what: "adamw second moment",
                step,
                value: f64::from(x),
            });
        }
        if let Some(&x) = v.iter().find(|&&x| x < 0.0) {
            return Err(bad("second moment", x, "must be >= 0"));
        }
        Ok(Self { cfg, m, v, step })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// Number of parameters this state updates.
    pub fn len(&self) -> usize {
        self.m.len()
    }

    /// Whether it updates no parameters.
    pub fn is_empty(&self) -> bool {
        self.m.is_empty()
    }

    /// Steps taken so far (the bias corrections use `step_count()` after
    /// the increment at the start of each step, as PyTorch does).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The first and second moments (`exp_avg`, `exp_avg_sq`).
    pub fn moments(&self) -> (&[f32], &[f32]) {
        (&self.m, &self.v)
    }

    /// One AdamW step: update `params` in place from `grads` with learning
    /// rate `lr`. Weight decay applies only to elements inside the `decay`
    /// ranges (their union; order and overlap do not matter).
    ///
    /// On error nothing is changed (the step count included).
    pub fn step(
        &mut self,
        th: &Threads,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        decay: &[Range<usize>],
    ) -> Result<()> {
        if grads.len() != self.len() {
            return Err(ModelError::Shape {
                what: "adamw grads",
                expected: self.len(),
                got: grads.len(),
            });
        }
        self.step_with(th, params, lr, decay, |seg, decayed, p, m, v, k| {
            update(p, &grads[seg], m, v, k, decayed)
        })
    }

    /// One AdamW step over parts of the state, each updated where it lies:
    /// part `(at, params, grads)` holds the state's elements `at..at +
    /// params.len()`. A sharded optimizer (ZeRO-1/2) updates the pieces of
    /// the full parameter buffer its shard owns in place this way, with no
    /// contiguous copy. Elements of the state outside every part keep their
    /// moments. Weight decay applies inside the `decay` ranges (state
    /// coordinates). Each element gets exactly the update [`AdamW::step`]
    /// would give it.
    ///
    /// On error nothing is changed (the step count included).
    pub fn step_parts(
        &mut self,
        th: &Threads,
        parts: &mut [StatePart<'_>],
        lr: f32,
        decay: &[Range<usize>],
    ) -> Result<()> {
        let len = self.len();
        for p in parts.iter() {
            if p.grads.len() != p.params.len() || p.at + p.params.len() > len {
                return Err(ModelError::Shape {
                    what: "adamw part (params and grads inside the state)",
                    expected: len.saturating_sub(p.at).min(p.params.len()),
                    got: p.grads.len().max(p.params.len()),
                });
            }
        }
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(bad("lr", lr, "must be finite and >= 0"));
        }
        let decay = normalize_ranges(decay, len)?;
        let step = self.step + 1;
        let k = Coeffs::new(&self.cfg, lr, step);
        for part in parts.iter_mut() {
            let at = part.at;
            let n = part.params.len();
            let (ps, ms, vs) = (
                SharedMut::new(&mut *part.params),
                SharedMut::new(&mut self.m[at..at + n]),
                SharedMut::new(&mut self.v[at..at + n]),
            );
            let grads = part.grads;
            th.ranges(n, MIN_PER_THREAD, |chunk| {
                let global = chunk.start + at..chunk.end + at;
                for_each_segment(global, &decay, |seg, decayed| {
                    let local = seg.start - at..seg.end - at;
                    // SAFETY: the chunks of `th.ranges` are disjoint and the
                    // segments of one chunk are disjoint; the buffers outlive
                    // the call.
                    let (p, m, v) = unsafe {
                        (
                            ps.slice(local.clone()),
                            ms.slice(local.clone()),
                            vs.slice(local.clone()),
                        )
                    };
                    update(p, &grads[local], m, v, &k, decayed);
                });
            });
        }
        self.step = step;
        Ok(())
    }

    /// Validate, advance the step count and call
    /// `body(segment, decayed, params, m, v, coeffs)` over disjoint segments
    /// of the parameters in parallel (`params`, `m`, `v` are the segment's
    /// slices). Used by [`step`](Self::step) and the bf16 store.
    pub(crate) fn step_with<F>(
        &mut self,
        th: &Threads,
        params: &mut [f32],
        lr: f32,
        decay: &[Range<usize>],
        body: F,
    ) -> Result<()>
    where
        F: Fn(Range<usize>, bool, &mut [f32], &mut [f32], &mut [f32], &Coeffs) + Sync + Send,
    {
        let len = self.len();
        if params.len() != len {
            return Err(ModelError::Shape {
                what: "adamw params",
                expected: len,
                got: params.len(),
            });
        }
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(bad("lr", lr, "must be finite and >= 0"));
        }
        let decay = normalize_ranges(decay, len)?;
        let step = self.step + 1;
        let k = Coeffs::new(&self.cfg, lr, step);
        let (ps, ms, vs) = (
            SharedMut::new(params),
            SharedMut::new(&mut self.m),
            SharedMut::new(&mut self.v),
        );
        th.ranges(len, MIN_PER_THREAD, |chunk| {
            for_each_segment(chunk, &decay, |seg, decayed| {
                // SAFETY: the chunks of `th.ranges` are disjoint and the
                // segments of one chunk are disjoint; the buffers outlive
                // the call.
                let (p, m, v) = unsafe {
                    (
                        ps.slice(seg.clone()),
                        ms.slice(seg.clone()),
                        vs.slice(seg.clone()),
                    )
                };
                body(seg, decayed, p, m, v, &k);
            });
        });
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_parts_gives_each_element_the_step_update() {
        let th = Threads::new(2).unwrap();
        let n = 40_000;
        let init: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let grads: Vec<f32> = (0..n)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 32.0)
            .collect();
        let decay = [100..20_000, 30_000..35_000];
        let cfg = AdamWConfig::default();
        let (mut whole, mut a) = (init.clone(), AdamW::new(cfg, n).unwrap());
        let mut b = AdamW::new(cfg, n).unwrap();
        let mut parts_buf = init.clone();
        for _ in 0..3 {
            a.step(&th, &mut whole, &grads, 1e-2, &decay).unwrap();
            // Three parts out of order, covering everything.
            let (x, rest) = parts_buf.split_at_mut(12_345);
            let (y, z) = rest.split_at_mut(20_000);
            let mut parts = [
                StatePart {
                    at: 32_345,
                    params: z,
                    grads: &grads[32_345..],
                },
                StatePart {
                    at: 0,
                    params: x,
                    grads: &grads[..12_345],
                },
                StatePart {
                    at: 12_345,
                    params: y,
                    grads: &grads[12_345..32_345],
                },
            ];
            b.step_parts(&th, &mut parts, 1e-2, &decay).unwrap();
        }
        assert_eq!(whole, parts_buf);
        assert_eq!(a.moments(), b.moments());
        assert_eq!(a.step_count(), b.step_count());
        let mut short = vec![0f32; 3];
        let mut bad = [StatePart {
            at: n - 2,
            params: &mut short,
            grads: &grads[..3],
        }];
        assert!(b.step_parts(&th, &mut bad, 1e-2, &decay).is_err());
        assert_eq!(b.step_count(), 3);
    }

    #[test]
    fn segments_cover_chunk_and_follow_decay() {
        let decay = normalize_ranges(&[5..9, 0..2, 7..12, 20..20], 30).unwrap();
        assert_eq!(decay, vec![0..2, 5..12]);
        for chunk in [0..30, 1..6, 6..8, 12..30, 3..4, 10..10] {
            let mut pos = chunk.start;
            for_each_segment(chunk.clone(), &decay, |seg, d| {
                assert_eq!(seg.start, pos);
                assert!(seg.start < seg.end);
                for i in seg.clone() {
                    assert_eq!(d, decay.iter().any(|r| r.contains(&i)), "element {i}");
                }
                pos = seg.end;
            });
            assert_eq!(pos, chunk.end.max(chunk.start));
        }
        assert!(normalize_ranges(std::slice::from_ref(&(3..31)), 30).is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let rev = 4..3;
        assert!(normalize_ranges(std::slice::from_ref(&rev), 30).is_err());
    }
}
