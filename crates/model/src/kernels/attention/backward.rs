//! Attention backward: P recomputed from the forward's log-sum-exp, then
//! dV, dP, dS, dK and dQ per tile, plus the backward-only helpers.
use super::transpose::transpose;
use super::{Tiles, check_dims, check_len, gemm_km, key_chunks};
use crate::real::Real;
use crate::threads::{SharedMut, Threads};

/// Attention backward.
///
/// dqkv: (N, (H+2K)*D) OVERWRITTEN (`=`, not `+=`) with the gradient of
/// the loss with respect to qkv; dout: (N, H*D); qkv: (N, (H+2K)*D);
/// out: (N, H*D) and lse: (B, H, T) as written by
/// [`attention_fwd`](super::attention_fwd).
///
/// Preconditions (asserted): as [`attention_fwd`](super::attention_fwd).
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd<T: Real>(
    th: &Threads,
    dqkv: &mut [T],
    dout: &[T],
    qkv: &[T],
    out: &[T],
    lse: &[T],
    b: usize,
    t: usize,
    h: usize,
    k: usize,
    d: usize,
) {
    attention_bwd_tiled(th, dqkv, dout, qkv, out, lse, b, t, h, k, d, Tiles::BWD);
}

/// [`attention_bwd`] with explicit tile sizes.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_tiled<T: Real>(
    th: &Threads,
    dqkv: &mut [T],
    dout: &[T],
    qkv: &[T],
    out: &[T],
    lse: &[T],
    b: usize,
    t: usize,
    h: usize,
    k: usize,
    d: usize,
    tiles: Tiles,
) {
    check_dims("attention_bwd", qkv.len(), b, t, h, k, d);
    let n = b * t;
    let hd = h * d;
    let w = (h + 2 * k) * d;
    check_len("attention_bwd", "dqkv", dqkv.len(), n * w);
    check_len("attention_bwd", "dout", dout.len(), n * hd);
    check_len("attention_bwd", "out", out.len(), n * hd);
    check_len("attention_bwd", "lse", lse.len(), b * h * t);
    if n == 0 || d == 0 {
        return;
    }
    if h == 0 {
        dqkv[..n * w].fill(T::zero());
        return;
    }
    let tq = tiles.q.clamp(1, t);
    let tk = tiles.k.clamp(1, t);
    let group = h / k;
    let scale = T::one() / T::of(d as f64).sqrt();
    let ds = SharedMut::new(&mut dqkv[..n * w]);
    th.run(b * k, |task| {
        let g = task % k;
        let bi = task / k;
        let row0 = bi * t;
        let k_base = row0 * w + (h + g) * d;
        let v_base = row0 * w + (h + k + g) * d;
        // Zero dK and dV of kv head g (accumulated over the group's heads
        // and query tiles); dQ is initialised by its first product.
        for i in row0..row0 + t {
            for at in [i * w + (h + g) * d, i * w + (h + k + g) * d] {
                // SAFETY: these ranges of row i belong to this task only.
                unsafe { ds.slice(at..at + d) }.fill(T::zero());
            }
        }
        // K and V transposed (D x T), Q and dO tiles transposed (D x m).
        // (Contiguous copies of the row-major operands and accumulators
        // were measured too: slower, the copies cost more than they save.)
        let mut kt = vec![T::zero(); d * t];
        let mut vt = vec![T::zero(); d * t];
        transpose(&mut kt, t, &qkv[k_base..], w, t, d);
        transpose(&mut vt, t, &qkv[v_base..], w, t, d);
        let mut qt = vec![T::zero(); d * tq];
        let mut dot = vec![T::zero(); d * tq];
        // P and dP / dS key-contiguous (p[r*nk + c]), dS query-contiguous.
        let mut p = vec![T::zero(); tq * tk];
        let mut dp = vec![T::zero(); tq * tk];
        let mut dst = vec![T::zero(); tq * tk];
        let mut di = vec![T::zero(); tq];
        for j in g * group..(g + 1) * group {
            let lse_h = &lse[(bi * h + j) * t..(bi * h + j + 1) * t];
            for i0 in (0..t).step_by(tq) {
                let i1 = (i0 + tq).min(t);
                let m = i1 - i0;
                let (q_off, o_off) = ((row0 + i0) * w + j * d, (row0 + i0) * hd + j * d);
                for (r, dr) in di[..m].iter_mut().enumerate() {
                    let a = o_off + r * hd;
                    *dr = row_dot(&dout[a..a + d], &out[a..a + d]);
                }
                transpose(&mut qt, m, &qkv[q_off..], w, m, d);
                transpose(&mut dot, m, &dout[o_off..], hd, m, d);
                let q_ptr = qkv[q_off..].as_ptr();
                let do_ptr = dout[o_off..].as_ptr();
                let k_ptr = qkv[k_base..].as_ptr();
                // SAFETY (pointer): dQ rows i0..i1 of head j, owned by this task.
                let dq_ptr = unsafe { ds.ptr().add(q_off) };
                for j0 in (0..i1).step_by(tk) {
                    let nk = (j0 + tk).min(i1) - j0;
                    // SAFETY (pointers): dK / dV rows j0.. of kv head g, owned by this task.
                    let dk_ptr = unsafe { ds.ptr().add(k_base + j0 * w) };
                    let dv_ptr = unsafe { ds.ptr().add(v_base + j0 * w) };
                    let chunks = || key_chunks(j0, nk, i0, tiles.diag);
                    // S = scale·Q·Kᵀ, rows r0.. of each chunk only.
                    for (c0, c1, r0) in chunks() {
                        // SAFETY (this and the products below): every view
                        // is in bounds (check_dims, the length asserts, the
                        // scratch sizes with m <= tq, nk <= tk); outputs are
                        // scratch or dqkv regions this task owns, aliasing
                        // no input.
                        unsafe {
                            gemm_km(
                                m - r0,
                                c1 - c0,
                                d,
                                scale,
                                qt.as_ptr().add(r0),
                                m,
                                kt.as_ptr().add(j0 + c0),
                                t,
                                T::zero(),
                                p.as_mut_ptr().add(r0 * nk + c0),
                                nk,
                            );
                        }
                    }
                    // P = exp(S - lse), zero where masked.
                    for r in 0..m {
                        let qi = i0 + r;
                        let valid = visible_keys(qi, j0, nk);
                        let row = &mut p[r * nk..(r + 1) * nk];
                        exp_shift(&mut row[..valid], lse_h[qi]);
                        row[valid..].fill(T::zero());
                    }
                    for (c0, c1, r0) in chunks() {
                        // SAFETY: as above.
                        unsafe {
                            // dV += Pᵀ·dO
                            gemm_km(
                                c1 - c0,
                                d,
                                m - r0,
                                T::one(),
                                p.as_ptr().add(r0 * nk + c0),
                                nk,
                                do_ptr.add(r0 * hd),
                                hd,
                                T::one(),
                                dv_ptr.add(c0 * w),
                                w,
                            );
                            // dP = dO·Vᵀ
                            gemm_km(
                                m - r0,
                                c1 - c0,
                                d,
                                T::one(),
                                dot.as_ptr().add(r0),
                                m,
                                vt.as_ptr().add(j0 + c0),
                                t,
                                T::zero(),
                                dp.as_mut_ptr().add(r0 * nk + c0),
                                nk,
                            );
                        }
                    }
                    // dS = P∘(dP − Di) where visible, 0 elsewhere (the masked
                    // part of dp was not computed).
                    for r in 0..m {
                        let qi = i0 + r;
                        let valid = visible_keys(qi, j0, nk);
                        let dir = di[r];
                        let row = &mut dp[r * nk..(r + 1) * nk];
                        for (x, &pv) in row[..valid].iter_mut().zip(&p[r * nk..r * nk + valid]) {
                            *x = pv * (*x - dir);
                        }
                        row[valid..].fill(T::zero());
                    }
                    transpose(&mut dst, m, &dp, nk, m, nk);
                    for (c0, c1, r0) in chunks() {
                        // The first chunk of the first key tile covers every
                        // row: it initialises dQ.
                        let beta = if j0 == 0 && c0 == 0 {
                            T::zero()
                        } else {
                            T::one()
                        };
                        // SAFETY: as above.
                        unsafe {
                            // dK += scale·dSᵀ·Q
                            gemm_km(
                                c1 - c0,
                                d,
                                m - r0,
                                scale,
                                dp.as_ptr().add(r0 * nk + c0),
                                nk,
                                q_ptr.add(r0 * w),
                                w,
                                T::one(),
                                dk_ptr.add(c0 * w),
                                w,
                            );
                            // dQ (+)= scale·dS·K
                            gemm_km(
                                m - r0,
                                d,
                                c1 - c0,
                                scale,
                                dst.as_ptr().add(c0 * m + r0),
                                m,
                                k_ptr.add((j0 + c0) * w),
                                w,
                                beta,
                                dq_ptr.add(r0 * w),
                                w,
                            );
                        }
                    }
                }
            }
        }
    });
}

/// `Σ a∘b` with 16 partial sums (vectorised, fixed order).
#[inline]
fn row_dot<T: Real>(a: &[T], b: &[T]) -> T {
    const LANES: usize = 16;
    let mut acc = [T::zero(); LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let mut s = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .fold(T::zero(), |s, (&x, &y)| s + x * y);
    for (xa, xb) in ca.zip(cb) {
        for ((acc, &x), &y) in acc.iter_mut().zip(xa).zip(xb) {
            *acc += x * y;
        }
    }
    for a in acc {
        s += a;
    }
    s
}

/// `x = e^(x - shift)` in place.
#[inline]
fn exp_shift<T: Real>(x: &mut [T], shift: T) {
    if let (Some(xs), Some(sh)) = (crate::kernels::vmath::as_f32_mut(x), shift.to_f32())
        && crate::kernels::vmath::exp_shift(xs, sh)
    {
        return;
    }
    for v in x {
        *v = (*v - shift).exp_k();
    }
}

/// How many keys of the tile starting at `j0` (`nk` wide) query `qi` sees
/// under the causal mask.
#[inline]
fn visible_keys(qi: usize, j0: usize, nk: usize) -> usize {
    if qi >= j0 { (qi + 1 - j0).min(nk) } else { 0 }
}
