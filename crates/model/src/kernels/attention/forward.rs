//! Attention forward: per (sequence, kv head) task, query tiles against
//! key tiles with an online softmax (see the module docs).
use super::transpose::transpose;
use super::{Tiles, check_dims, check_len, gemm_km, key_chunks};
use crate::real::Real;
use crate::threads::{SharedMut, Threads, part_range};

/// Attention forward.
///
/// out: (N, H*D) overwritten; lse: (B, H, T) overwritten with the
/// log-sum-exp of the scaled, masked scores of each query (the backward
/// needs it); qkv: (N, (H+2K)*D), N = B*T.
///
/// Preconditions (asserted): `K > 0`, `H % K == 0`, slices at least as
/// long as the shapes above.
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd<T: Real>(
    th: &Threads,
    out: &mut [T],
    lse: &mut [T],
    qkv: &[T],
    b: usize,
    t: usize,
    h: usize,
    k: usize,
    d: usize,
) {
    attention_fwd_tiled(th, out, lse, qkv, b, t, h, k, d, Tiles::FWD);
}

/// [`attention_fwd`] with explicit tile sizes (tests force small tiles to
/// exercise the online-softmax rescaling; benchmarks tune them).
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd_tiled<T: Real>(
    th: &Threads,
    out: &mut [T],
    lse: &mut [T],
    qkv: &[T],
    b: usize,
    t: usize,
    h: usize,
    k: usize,
    d: usize,
    tiles: Tiles,
) {
    check_dims("attention_fwd", qkv.len(), b, t, h, k, d);
    let n = b * t;
    let hd = h * d;
    check_len("attention_fwd", "out", out.len(), n * hd);
    check_len("attention_fwd", "lse", lse.len(), b * h * t);
    if n == 0 || h == 0 || d == 0 {
        return;
    }
    let tq = tiles.q.clamp(1, t);
    let tk = tiles.k.clamp(1, t);
    let w = (h + 2 * k) * d;
    let group = h / k;
    let scale = T::one() / T::of(d as f64).sqrt();
    // Tasks share the transposed K across a group's query heads; a group is
    // split only when there are too few (sequence, kv head) pairs.
    let parts = group.min((2 * th.n()).div_ceil(b * k)).max(1);
    let out_s = SharedMut::new(&mut out[..n * hd]);
    let lse_s = SharedMut::new(&mut lse[..b * h * t]);
    th.run(b * k * parts, |task| {
        let part = task % parts;
        let g = (task / parts) % k;
        let bi = task / (parts * k);
        let heads = part_range(group, parts, part);
        let row0 = bi * t;
        // Kᵀ (D x T), and V copied contiguous (T x D): 2 % faster than
        // reading its rows W apart.
        let mut kt = vec![T::zero(); d * t];
        transpose(&mut kt, t, &qkv[row0 * w + (h + g) * d..], w, t, d);
        let mut vc = Vec::with_capacity(t * d);
        for r in 0..t {
            let at = (row0 + r) * w + (h + k + g) * d;
            vc.extend_from_slice(&qkv[at..at + d]);
        }
        let mut qt = vec![T::zero(); d * tq];
        // Scores / probabilities, query-contiguous: s[c*m + r].
        let mut s = vec![T::zero(); tk * tq];
        let mut o = vec![T::zero(); tq * d];
        let (mut mx, mut l, mut alpha) = (
            vec![T::zero(); tq],
            vec![T::zero(); tq],
            vec![T::zero(); tq],
        );
        for j in g * group + heads.start..g * group + heads.end {
            for i0 in (0..t).step_by(tq) {
                let i1 = (i0 + tq).min(t);
                let m = i1 - i0;
                transpose(&mut qt, m, &qkv[(row0 + i0) * w + j * d..], w, m, d);
                mx[..m].fill(T::neg_infinity());
                l[..m].fill(T::zero());
                o[..m * d].fill(T::zero());
                for j0 in (0..i1).step_by(tk) {
                    let nk = (j0 + tk).min(i1) - j0;
                    // Sᵀ = scale·K·Qᵀ, rows r0.. of each chunk only.
                    for (c0, c1, r0) in key_chunks(j0, nk, i0, tiles.diag) {
                        // SAFETY: kt is D x T (j0+c1 <= T), qt is D x m, s
                        // holds nk x m; distinct buffers.
                        unsafe {
                            gemm_km(
                                c1 - c0,
                                m - r0,
                                d,
                                scale,
                                kt.as_ptr().add(j0 + c0),
                                t,
                                qt.as_ptr().add(r0),
                                m,
                                T::zero(),
                                s.as_mut_ptr().add(c0 * m + r0),
                                m,
                            );
                        }
                    }
                    // Key j0+c is visible to tile rows first(c)..m.
                    let first = |c: usize| (j0 + c).saturating_sub(i0).min(m);
                    // New running max (vectorised over the queries).
                    alpha[..m].copy_from_slice(&mx[..m]);
                    for c in 0..nk {
                        let lo = first(c);
                        for (a, &x) in alpha[lo..m].iter_mut().zip(&s[c * m + lo..c * m + m]) {
                            *a = if x > *a { x } else { *a };
                        }
                    }
                    // alpha <- e^{m_old - m_new}, mx <- m_new, l <- l·alpha
                    // (every row sees key 0 in the first tile, so m_new is
                    // finite and alpha is 0 there).
                    for r in 0..m {
                        let m_new = alpha[r];
                        alpha[r] = (mx[r] - m_new).exp_k();
                        mx[r] = m_new;
                        l[r] *= alpha[r];
                    }
                    // P = e^{S - m}, zero where masked; l += rowsum(P).
                    for c in 0..nk {
                        let lo = first(c);
                        let col = &mut s[c * m..(c + 1) * m];
                        col[..lo].fill(T::zero());
                        for ((x, &mr), lr) in
                            col[lo..].iter_mut().zip(&mx[lo..m]).zip(&mut l[lo..m])
                        {
                            let p = (*x - mr).exp_k();
                            *x = p;
                            *lr += p;
                        }
                    }
                    if j0 > 0 {
                        for (orow, &a) in o.chunks_exact_mut(d).zip(&alpha[..m]) {
                            orow.iter_mut().for_each(|x| *x *= a);
                        }
                    }
                    // O += P·V (P is zero above each chunk's first row).
                    for (c0, c1, r0) in key_chunks(j0, nk, i0, tiles.diag) {
                        // SAFETY: s holds P (nk x m, k-major for this
                        // product); vc is T x D (j0+c1 <= T); o is m x D.
                        unsafe {
                            gemm_km(
                                m - r0,
                                d,
                                c1 - c0,
                                T::one(),
                                s.as_ptr().add(c0 * m + r0),
                                m,
                                vc.as_ptr().add((j0 + c0) * d),
                                d,
                                T::one(),
                                o.as_mut_ptr().add(r0 * d),
                                d,
                            );
                        }
                    }
                }
                // SAFETY: lse entries (bi, j, i0..i1) belong to this task only.
                let lse_t = unsafe { lse_s.slice((bi * h + j) * t + i0..(bi * h + j) * t + i1) };
                for r in 0..m {
                    let inv = T::one() / l[r];
                    let at = (row0 + i0 + r) * hd + j * d;
                    // SAFETY: out row row0+i0+r, columns of head j belong to
                    // this task only (one task per sequence and query head).
                    let dst = unsafe { out_s.slice(at..at + d) };
                    for (x, &y) in dst.iter_mut().zip(&o[r * d..(r + 1) * d]) {
                        *x = y * inv;
                    }
                    lse_t[r] = mx[r] + l[r].ln();
                }
            }
        }
    });
}
