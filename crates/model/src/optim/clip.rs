//! Global gradient norm, gradient clipping (as `torch.nn.utils.clip_grad_norm_`)
//! and the finiteness check the training loop applies to losses and norms.
//!
//! The norm sums squares in f64 over fixed blocks of [`NORM_BLOCK`]
//! elements and adds the block sums in order, so the result depends only on
//! the data: it is bit-identical for every thread count.
use crate::error::{ModelError, Result};
use crate::threads::{SharedMut, Threads, part_range};

/// Elements per partial sum of [`grad_norm`].
pub const NORM_BLOCK: usize = 1 << 14;

/// Lanes of the in-block accumulation (lets the compiler vectorise it).
const LANES: usize = 8;

/// Sum of squares of `xs` in f64, in a fixed lane order.
fn sum_sq(xs: &[f32]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            let x = f64::from(x);
            *a += x * x;
        }
    }
    for (a, &x) in acc.iter_mut().zip(chunks.remainder()) {
        let x = f64::from(x);
        *a += x * x;
    }
    // Pairwise, fixed order.
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// The global L2 norm of `grads`, accumulated in f64 (deterministic: the
/// same for every thread count). NaN or infinite when a gradient is.
pub fn grad_norm(th: &Threads, grads: &[f32]) -> f64 {
    grad_sum_sq(th, grads).sqrt()
}

/// The sum of squares of `grads` in f64, over fixed blocks of
/// [`NORM_BLOCK`] (deterministic for every thread count): the squared
/// [`grad_norm`], or one shard's part of a global norm that is summed over
/// ranks (ZeRO).
pub fn grad_sum_sq(th: &Threads, grads: &[f32]) -> f64 {
    let blocks = grads.len().div_ceil(NORM_BLOCK);
    if blocks <= 1 {
        return sum_sq(grads);
    }
    let mut partial = vec![0.0f64; blocks];
    let parts = th.n().min(blocks);
    let out = SharedMut::new(&mut partial);
    th.run(parts, |i| {
        let bs = part_range(blocks, parts, i);
        // SAFETY: the block ranges of different parts are disjoint.
        let dst = unsafe { out.slice(bs.clone()) };
        for (d, b) in dst.iter_mut().zip(bs) {
            let end = ((b + 1) * NORM_BLOCK).min(grads.len());
            *d = sum_sq(&grads[b * NORM_BLOCK..end]);
        }
    });
    partial.iter().sum::<f64>()
}

/// The factor `torch.nn.utils.clip_grad_norm_` scales gradients of global
/// norm `norm` by to clip them to `max_norm` (`max_norm / (norm + 1e-6)`),
/// or `None` when no clipping applies (the norm is within the bound, or is
/// not finite).
pub fn clip_coef(norm: f64, max_norm: f64) -> Option<f32> {
    if !norm.is_finite() {
        return None;
    }
    let coef = max_norm / (norm + 1e-6);
    (coef < 1.0).then_some(coef as f32)
}

/// Multiplies `grads` by `c` in parallel.
pub fn scale_grads(th: &Threads, grads: &mut [f32], c: f32) {
    let g = SharedMut::new(grads);
    th.ranges(g.len(), NORM_BLOCK, |r| {
        // SAFETY: the ranges of `th.ranges` are disjoint.
        for x in unsafe { g.slice(r) } {
            *x *= c;
        }
    });
}

/// Clip `grads` to global L2 norm `max_norm` the way
/// `torch.nn.utils.clip_grad_norm_` does: multiply by
/// `max_norm / (norm + 1e-6)` when that is below 1 (i.e. when the norm
/// exceeds `max_norm`). Returns the norm before clipping.
///
/// A non-finite norm leaves the gradients untouched (check the returned
/// norm with [`check_finite`]); so does a `max_norm` that is NaN. Validate
/// `max_norm` once with [`check_max_norm`].
pub fn clip_grad_norm(th: &Threads, grads: &mut [f32], max_norm: f64) -> f64 {
    let norm = grad_norm(th, grads);
    if let Some(c) = clip_coef(norm, max_norm) {
        scale_grads(th, grads, c);
    }
    norm
}

/// Check a clipping threshold: finite and `> 0`.
pub fn check_max_norm(max_norm: f64) -> Result<()> {
    if max_norm.is_finite() && max_norm > 0.0 {
        Ok(())
    } else {
        Err(ModelError::Optim {
            field: "max_grad_norm",
            value: max_norm.to_string(),
            reason: "must be finite and > 0".into(),
        })
    }
}

/// `Ok(())` when `value` is finite, else [`ModelError::NonFinite`] naming
/// `what` and the step.
pub fn check_finite(what: &'static str, step: u64, value: f64) -> Result<()> {
    if value.is_finite() {
        Ok(())
    } else {
        Err(ModelError::NonFinite { what, step, value })
    }
}
