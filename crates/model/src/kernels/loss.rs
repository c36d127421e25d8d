//! Fused softmax + cross-entropy over the vocabulary.
//!
//! The forward never materialises the probabilities: per row it takes the
//! max (one pass), then `Σ e^{x - max}` (a second pass, the row is still in
//! cache) and keeps the log-sum-exp. The backward turns the logits buffer
//! into the logits' gradient in place in one pass, so no (N, V)
//! probability buffer is needed. Row-wise: bit-identical for any thread
//! count.
//!
//! Cost: forward 2 reads of (N, V); backward 1 read-modify-write of
//! (N, V), one `exp_k` per element in each.
//!
//! Buffers may be longer than their shapes (only the prefix is used);
//! shorter ones panic with an index error.
use crate::kernels::residual::{max_of, min_rows, par_rows, sum_map};
use crate::real::Real;
use crate::threads::{SharedMut, Threads};

/// Cross-entropy forward:
/// `lse[i] = log Σ_j e^{logits[i, j]}` (max-subtracted, numerically
/// stable) and `losses[i] = lse[i] - logits[i, targets[i]]`, evaluated as
/// `(max - logits[i, targets[i]]) + log Σ_j e^{logits[i, j] - max}`.
///
/// losses: (N), lse: (N) (saved for the backward), logits: (N, V),
/// targets: (N) ids below V (validated by the caller).
pub fn cross_entropy_fwd<T: Real>(
    th: &Threads,
    losses: &mut [T],
    lse: &mut [T],
    logits: &[T],
    targets: &[u32],
    n: usize,
    v: usize,
) {
    if n == 0 || v == 0 {
        return;
    }
    let (logits, targets) = (&logits[..n * v], &targets[..n]);
    let sl = SharedMut::new(&mut losses[..n]);
    let ss = SharedMut::new(&mut lse[..n]);
    th.ranges(n, min_rows(v), |r| {
        // SAFETY: row ranges of different parts are disjoint and in bounds.
        let (losses, lse) = unsafe { (sl.slice(r.clone()), ss.slice(r.clone())) };
        let rows = logits[r.start * v..r.end * v]
            .chunks_exact(v)
            .zip(&targets[r.clone()]);
        for ((row, &tgt), (loss, l)) in rows.zip(losses.iter_mut().zip(lse.iter_mut())) {
            debug_assert!(
                (tgt as usize) < v,
                "target {tgt} outside the vocabulary ({v})"
            );
            let m = max_of(row);
            let s = sum_map(row, |x| (x - m).exp_k());
            let ln_s = s.ln();
            *l = m + ln_s;
            // (m - x_t) + ln s rather than lse - x_t: exact subtraction of
            // nearby logits, so large logits lose no precision in f32.
            *loss = (m - row[tgt as usize]) + ln_s;
        }
    });
}

/// Cross-entropy backward, in place and overwriting:
/// `dlogits[i, j] = (softmax(logits[i])_j - [j == targets[i]]) * scale`,
/// with `softmax_j = e^{logits_j - lse}`. `scale` is the upstream gradient
/// of each row's loss (`1/N` for a mean loss).
///
/// dlogits: (N, V), holding the logits on entry; lse: (N) from
/// [`cross_entropy_fwd`]; targets: (N).
pub fn cross_entropy_bwd<T: Real>(
    th: &Threads,
    dlogits: &mut [T],
    lse: &[T],
    targets: &[u32],
    n: usize,
    v: usize,
    scale: T,
) {
    if n == 0 || v == 0 {
        return;
    }
    let (lse, targets) = (&lse[..n], &targets[..n]);
    par_rows(th, &mut dlogits[..n * v], v, |first, block| {
        let rows = block
            .chunks_exact_mut(v)
            .zip(&lse[first..])
            .zip(&targets[first..]);
        for ((row, &l), &tgt) in rows {
            debug_assert!(
                (tgt as usize) < v,
                "target {tgt} outside the vocabulary ({v})"
            );
            for x in row.iter_mut() {
                *x = (*x - l).exp_k() * scale;
            }
            row[tgt as usize] -= scale;
        }
    });
}

/// The mean of `losses`, summed in f64 in index order (0.0 when empty).
pub fn mean_loss<T: Real>(losses: &[T]) -> f64 {
    if losses.is_empty() {
        return 0.0;
    }
    let mut s = 0.0f64;
    for x in losses {
        s += x.to_f64().unwrap_or(f64::NAN);
    }
    s / losses.len() as f64
}
