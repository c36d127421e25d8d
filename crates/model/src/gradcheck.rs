//! Finite-difference gradient checking on the f64 reference path.
//!
//! A kernel test builds a scalar loss `L = Σ out ⊙ w` from the forward with
//! fixed random weights `w` (which is then the upstream gradient `dout`),
//! runs the analytic backward, and compares each input's gradient with the
//! central difference `(L(x+ε) - L(x-ε)) / 2ε`.

/// Largest disagreement between an analytic and a numeric gradient.
#[derive(Clone, Copy, Debug, Default)]
pub struct GradError {
    /// Largest absolute difference.
    pub max_abs: f64,
    /// Largest relative difference, `|a-n| / max(|a|, |n|, floor)`.
    pub max_rel: f64,
    /// Index of the element with the largest relative difference.
    pub worst: usize,
}

impl GradError {
    /// Panic with a readable message when the relative error exceeds `tol`.
    pub fn assert_below(&self, tol: f64, what: &str) {
        assert!(
            self.max_rel <= tol,
            "{what}: gradient check failed: {self:?} (tolerance {tol})"
        );
    }
}

/// Central-difference gradient of `f` at `x`.
pub fn numeric_grad(x: &[f64], eps: f64, mut f: impl FnMut(&[f64]) -> f64) -> Vec<f64> {
    let mut xs = x.to_vec();
    (0..x.len())
        .map(|i| {
            let orig = xs[i];
            xs[i] = orig + eps;
            let up = f(&xs);
            xs[i] = orig - eps;
            let down = f(&xs);
            xs[i] = orig;
            (up - down) / (2.0 * eps)
        })
        .collect()
}

/// Compare two gradients; values below `floor` in magnitude count as `floor`.
pub fn compare(analytic: &[f64], numeric: &[f64], floor: f64) -> GradError {
    assert_eq!(analytic.len(), numeric.len(), "gradient lengths");
    let mut e = GradError::default();
    for (i, (&a, &n)) in analytic.iter().zip(numeric).enumerate() {
        let abs = (a - n).abs();
        let rel = abs / a.abs().max(n.abs()).max(floor);
        e.max_abs = e.max_abs.max(abs);
        if rel > e.max_rel {
            e.max_rel = rel;
            e.worst = i;
        }
    }
    e
}

/// `Σ a ⊙ b`.
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Deterministic values in `[-scale, scale]` (SplitMix64 stream from `seed`).
pub fn rand_vec(seed: u64, len: usize, scale: f64) -> Vec<f64> {
    let mut r = crate::rng::Rng::new(seed);
    (0..len)
        .map(|_| (r.uniform() * 2.0 - 1.0) * scale)
        .collect()
}

/// Checks a whole model's gradient tensor by tensor: for every entry of `layout`,
/// `max |analytic − numeric| <= tol · max |numeric|` (at least 1e-3; a per-element ratio is
/// meaningless where the true gradient is ~0, e.g. the key bias, whose gradient vanishes by
/// softmax shift invariance). Panics naming the first tensor that fails.
pub fn assert_tensors_match(
    layout: &crate::layout::Layout,
    analytic: &[f64],
    numeric: &[f64],
    tol: f64,
) {
    for e in &layout.entries {
        let r = e.range();
        let scale = r
            .clone()
            .map(|i| numeric[i].abs())
            .fold(0.0, f64::max)
            .max(1e-3);
        let err = compare(&analytic[r.clone()], &numeric[r], scale);
        assert!(
            err.max_abs <= tol * scale,
            "{}: gradient check failed: {err:?} (scale {scale:.3e})",
            e.name
        );
    }
}
