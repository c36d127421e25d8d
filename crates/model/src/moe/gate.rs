//! The router's kernels, llm.c style (outputs first, then inputs, then
//! sizes): softmax over the E logits of each token, top-k with a
//! deterministic tie-break, the gate weights, the auxiliary
//! load-balancing loss, and their backwards.
//!
//! The logits themselves are a bias-free linear, `logits = x · Wgᵀ`
//! (x (N, C), Wg (E, C)), computed with the model crate's matmul kernels.
//!
//! Callers check the lengths; every function here indexes within
//! `n·e` / `n·k` of its buffers.
use crate::real::Real;

/// Row-wise softmax: `probs[t] = softmax(logits[t])`, max-subtracted.
///
/// probs, logits: (N, E).
pub fn softmax_fwd<T: Real>(probs: &mut [T], logits: &[T], n: usize, e: usize) {
    for t in 0..n {
        let row = &logits[t * e..(t + 1) * e];
        let out = &mut probs[t * e..(t + 1) * e];
        let max = row.iter().copied().fold(T::neg_infinity(), T::max);
        let mut sum = T::zero();
        for (o, &l) in out.iter_mut().zip(row) {
            *o = (l - max).exp();
            sum += *o;
        }
        for o in out.iter_mut() {
            *o /= sum;
        }
    }
}

/// Softmax backward, overwriting:
/// `dlogits[t, i] = p[t, i] · (dprobs[t, i] − Σ_j p[t, j] · dprobs[t, j])`.
///
/// dlogits, dprobs, probs: (N, E).
pub fn softmax_bwd<T: Real>(dlogits: &mut [T], dprobs: &[T], probs: &[T], n: usize, e: usize) {
    for t in 0..n {
        let (p, dp) = (&probs[t * e..(t + 1) * e], &dprobs[t * e..(t + 1) * e]);
        let dot: T = p.iter().zip(dp).map(|(&a, &b)| a * b).sum();
        for ((d, &pi), &dpi) in dlogits[t * e..(t + 1) * e].iter_mut().zip(p).zip(dp) {
            *d = pi * (dpi - dot);
        }
    }
}

/// Top-k choice and gate weights of every token.
///
/// choice: (N, k) expert indices, best first; a strictly larger probability
/// wins, so ties go to the lowest expert index. gate: (N, k): k = 1 the top
/// probability, k = 2 the two top probabilities over their sum.
/// probs: (N, E).
pub fn top_k_fwd<T: Real>(
    choice: &mut [usize],
    gate: &mut [T],
    probs: &[T],
    n: usize,
    e: usize,
    k: usize,
) {
    for t in 0..n {
        let p = &probs[t * e..(t + 1) * e];
        let mut sum = T::zero();
        for j in 0..k {
            let mut best: Option<usize> = None;
            for (i, &pi) in p.iter().enumerate() {
                if choice[t * k..t * k + j].contains(&i) {
                    continue;
                }
                if best.is_none_or(|b| pi > p[b]) {
                    best = Some(i);
                }
            }
            // k <= E (validated), so every j finds an expert.
            let b = best.unwrap_or(0);
            choice[t * k + j] = b;
            gate[t * k + j] = p[b];
            sum += p[b];
        }
        if k > 1 {
            for g in &mut gate[t * k..(t + 1) * k] {
                *g /= sum;
            }
        }
    }
}

/// Gate backward, accumulating into `dprobs` (N, E) from `dgate` (N, k).
///
/// k = 1: `g = p_c`, so `dp_c += dg`.
/// k = 2: in the forward `g_j = p_{c_j} / s` with `s = p_{c_1} + p_{c_2}`,
/// so `dp_{c_i} += dg_i / s − (Σ_j dg_j · p_{c_j}) / s²`.
pub fn top_k_bwd<T: Real>(
    dprobs: &mut [T],
    dgate: &[T],
    choice: &[usize],
    probs: &[T],
    n: usize,
    e: usize,
    k: usize,
) {
    for t in 0..n {
        let (c, dg) = (&choice[t * k..(t + 1) * k], &dgate[t * k..(t + 1) * k]);
        if k == 1 {
            dprobs[t * e + c[0]] += dg[0];
            continue;
        }
        let p = [probs[t * e + c[0]], probs[t * e + c[1]]];
        let s = p[0] + p[1];
        let dot = dg[0] * p[0] + dg[1] * p[1];
        for (j, &i) in c.iter().enumerate() {
            dprobs[t * e + i] += dg[j] / s - dot / (s * s);
        }
    }
}

/// Column sums of the router probabilities: `psum[i] = Σ_t probs[t, i]`
/// (so `P_i = psum[i] / N_global` once summed over the EP group).
///
/// psum: (E), probs: (N, E).
pub fn prob_sums<T: Real>(psum: &mut [T], probs: &[T], n: usize, e: usize) {
    psum[..e].fill(T::zero());
    for t in 0..n {
        for (s, &p) in psum.iter_mut().zip(&probs[t * e..(t + 1) * e]) {
            *s += p;
        }
    }
}

/// The Switch auxiliary loss `aux = E · Σ_i f_i · P_i` with
/// `f_i = routed[i] / (N_global · k)` and `P_i = psum[i] / N_global`.
///
/// routed, psum: (E), summed over the EP group.
pub fn aux_loss<T: Real>(routed: &[usize], psum: &[T], n_global: usize, k: usize) -> T {
    if n_global == 0 {
        return T::zero();
    }
    let e = routed.len();
    let nk = T::of((n_global * k) as f64);
    let ng = T::of(n_global as f64);
    let sum: T = routed
        .iter()
        .zip(psum)
        .map(|(&r, &p)| T::of(r as f64) / nk * (p / ng))
        .sum();
    T::of(e as f64) * sum
}

/// Aux-loss backward, accumulating into `dprobs` (N, E):
/// in the forward `aux = E · Σ_i f_i · (1/N_global) Σ_t p[t, i]` with `f_i`
/// a constant (a count), so `dp[t, i] += weight · E · f_i / N_global`.
pub fn aux_loss_bwd<T: Real>(
    dprobs: &mut [T],
    routed: &[usize],
    n_global: usize,
    k: usize,
    weight: T,
    n: usize,
) {
    let e = routed.len();
    if n_global == 0 || weight == T::zero() {
        return;
    }
    let nk = T::of((n_global * k) as f64);
    let scale = weight * T::of(e as f64) / T::of(n_global as f64);
    let d: Vec<T> = routed
        .iter()
        .map(|&r| scale * (T::of(r as f64) / nk))
        .collect();
    for t in 0..n {
        for (dp, &di) in dprobs[t * e..(t + 1) * e].iter_mut().zip(&d) {
            *dp += di;
        }
    }
}
