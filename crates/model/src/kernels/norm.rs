//! Normalisation layers: LayerNorm (GPT-2) and RMSNorm (Llama), forward and
//! backward.
//!
//! Forwards are row-wise (bit-identical for any thread count). Backwards
//! accumulate `dinp += ...` (dinp is the residual stream's gradient) and
//! the parameter gradients `dweight += ...`, `dbias += ...`; the parameter
//! sums over rows are made deterministic by giving each part of a fixed row
//! partition (it depends only on the thread count and N*C) its own partial
//! sums, which are then added into the gradient in part order.
//!
//! Cost per row of C: forward ~2 reads of the row (kept in L1) and 1
//! write, backward 2 reads of `inp` and `dout` and a read-modify-write of
//! `dinp`. All memory-bound.
//!
//! Buffers may be longer than their shapes (only the prefix is used);
//! shorter ones panic with an index error.
use crate::kernels::residual::{min_rows, sum_map, sum_map2, sum_map3};
use crate::real::Real;
use crate::threads::{SharedMut, Threads, part_range};

/// LayerNorm forward (PyTorch `nn.LayerNorm` over the last dimension,
/// biased variance):
/// `mean = Σx/C`, `rstd = 1/sqrt(Σ(x-mean)²/C + eps)`,
/// `out = (x - mean) * rstd * weight + bias`.
///
/// out: (N, C), mean: (N), rstd: (N) (saved for the backward), inp: (N, C),
/// weight: (C), bias: (C) or None (no bias).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_fwd<T: Real>(
    th: &Threads,
    out: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
    inp: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    n: usize,
    c: usize,
    eps: T,
) {
    if n == 0 || c == 0 {
        return;
    }
    let (inp, weight) = (&inp[..n * c], &weight[..c]);
    let bias = bias.map(|b| &b[..c]);
    let so = SharedMut::new(&mut out[..n * c]);
    let sm = SharedMut::new(&mut mean[..n]);
    let sr = SharedMut::new(&mut rstd[..n]);
    let inv_c = T::one() / T::of(c as f64);
    th.ranges(n, min_rows(c), |r| {
        // SAFETY: row ranges of different parts are disjoint and in bounds.
        let (out, mean, rstd) = unsafe {
            (
                so.slice(r.start * c..r.end * c),
                sm.slice(r.clone()),
                sr.slice(r.clone()),
            )
        };
        let rows = inp[r.start * c..r.end * c].chunks_exact(c);
        for (((x, y), m_out), r_out) in rows.zip(out.chunks_exact_mut(c)).zip(mean).zip(rstd) {
            (*m_out, *r_out) = layernorm_row(y, x, weight, bias, inv_c, eps);
        }
    });
}

/// One row of [`layernorm_fwd`]; returns (mean, rstd). Row kernels are
/// separate functions so their slices arrive as distinct references
/// (LLVM then knows outputs and inputs do not alias and vectorises).
#[inline]
fn layernorm_row<T: Real>(
    y: &mut [T],
    x: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    inv_c: T,
    eps: T,
) -> (T, T) {
    let m = sum_map(x, |v| v) * inv_c;
    let var = sum_map(x, |v| (v - m) * (v - m)) * inv_c;
    let s = T::one() / (var + eps).sqrt();
    match bias {
        Some(b) => {
            for (((o, &v), &w), &bb) in y.iter_mut().zip(x).zip(weight).zip(b) {
                *o = (v - m) * s * w + bb;
            }
        }
        None => {
            for ((o, &v), &w) in y.iter_mut().zip(x).zip(weight) {
                *o = (v - m) * s * w;
            }
        }
    }
    (m, s)
}

/// LayerNorm backward, accumulating into every gradient. With
/// `xhat = (x - mean) * rstd` and `g = dout * weight`:
/// `dinp += rstd * (g - mean(g) - xhat * mean(g * xhat))`,
/// `dweight += Σ_rows dout * xhat`, `dbias += Σ_rows dout`.
///
/// dinp: (N, C), dweight: (C), dbias: (C) or None, dout: (N, C),
/// inp: (N, C), weight: (C), mean, rstd: (N) from [`layernorm_fwd`].
#[allow(clippy::too_many_arguments)]
pub fn layernorm_bwd<T: Real>(
    th: &Threads,
    dinp: &mut [T],
    dweight: &mut [T],
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: &[T],
    weight: &[T],
    mean: &[T],
    rstd: &[T],
    n: usize,
    c: usize,
) {
    if n == 0 || c == 0 {
        return;
    }
    let (dout, inp, weight, mean, rstd) = (
        &dout[..n * c],
        &inp[..n * c],
        &weight[..c],
        &mean[..n],
        &rstd[..n],
    );
    let inv_c = T::one() / T::of(c as f64);
    // Per part: [dweight partial (C) | dbias partial (C)].
    let partial = per_part_partials(th, dinp, n, c, 2 * c, |r, dx, part| {
        let (dw, db) = part.split_at_mut(c);
        let rows = inp[r.start * c..r.end * c]
            .chunks_exact(c)
            .zip(dout[r.start * c..r.end * c].chunks_exact(c));
        for (((x, dy), dx), (&m, &s)) in rows
            .zip(dx.chunks_exact_mut(c))
            .zip(mean[r.clone()].iter().zip(&rstd[r.clone()]))
        {
            layernorm_bwd_row(dx, dw, db, dy, x, weight, m, s, inv_c);
        }
    });
    add_partials(&mut dweight[..c], &partial, 2 * c, 0);
    if let Some(db) = dbias {
        add_partials(&mut db[..c], &partial, 2 * c, c);
    }
}

/// Run `f(rows, dx_rows, part)` over a fixed partition of the N rows of
/// `dinp` (N, C) (it depends only on the thread count and N*C), giving each
/// part its own zeroed `width`-long block for partial parameter-gradient
/// sums; returns the blocks, part after part.
fn per_part_partials<T: Real, F>(
    th: &Threads,
    dinp: &mut [T],
    n: usize,
    c: usize,
    width: usize,
    f: F,
) -> Vec<T>
where
    F: Fn(std::ops::Range<usize>, &mut [T], &mut [T]) + Sync + Send,
{
    let parts = th.n().min(n / min_rows(c)).max(1);
    let mut partial = vec![T::zero(); parts * width];
    let sd = SharedMut::new(&mut dinp[..n * c]);
    let sp = SharedMut::new(&mut partial);
    th.run(parts, |p| {
        let r = part_range(n, parts, p);
        // SAFETY: each part owns its rows of dinp and its own partial block.
        let (dx, part) = unsafe {
            (
                sd.slice(r.start * c..r.end * c),
                sp.slice(p * width..(p + 1) * width),
            )
        };
        f(r, dx, part)
    });
    partial
}

/// `acc[j] += Σ_parts partial[part * stride + offset + j]`, parts in order.
fn add_partials<T: Real>(acc: &mut [T], partial: &[T], stride: usize, offset: usize) {
    let len = acc.len();
    for part in partial.chunks_exact(stride) {
        for (a, &v) in acc.iter_mut().zip(&part[offset..offset + len]) {
            *a += v;
        }
    }
}

/// One row of [`layernorm_bwd`]: `dx +=`, and the part's partial sums
/// `dw +=`, `db +=`.
#[allow(clippy::too_many_arguments)]
#[inline]
fn layernorm_bwd_row<T: Real>(
    dx: &mut [T],
    dw: &mut [T],
    db: &mut [T],
    dy: &[T],
    x: &[T],
    weight: &[T],
    m: T,
    s: T,
    inv_c: T,
) {
    // mean(g) and mean(g * xhat), g = dy * w, xhat = (x - m) * s.
    let mg = sum_map2(dy, weight, |d, w| d * w) * inv_c;
    let mgx = sum_map3(dy, weight, x, |d, w, v| d * w * (v - m)) * s * inv_c;
    for ((((o, &d), &w), &v), (dwj, dbj)) in dx
        .iter_mut()
        .zip(dy)
        .zip(weight)
        .zip(x)
        .zip(dw.iter_mut().zip(db.iter_mut()))
    {
        let xh = (v - m) * s;
        *dwj += d * xh;
        *dbj += d;
        *o += s * (d * w - mg - xh * mgx);
    }
}

/// RMSNorm forward (Llama): `rstd = 1/sqrt(Σx²/C + eps)`,
/// `out = x * rstd * weight`.
///
/// out: (N, C), rstd: (N) (saved for the backward), inp: (N, C),
/// weight: (C).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_fwd<T: Real>(
    th: &Threads,
    out: &mut [T],
    rstd: &mut [T],
    inp: &[T],
    weight: &[T],
    n: usize,
    c: usize,
    eps: T,
) {
    if n == 0 || c == 0 {
        return;
    }
    let (inp, weight) = (&inp[..n * c], &weight[..c]);
    let so = SharedMut::new(&mut out[..n * c]);
    let sr = SharedMut::new(&mut rstd[..n]);
    let inv_c = T::one() / T::of(c as f64);
    th.ranges(n, min_rows(c), |r| {
        // SAFETY: row ranges of different parts are disjoint and in bounds.
        let (out, rstd) = unsafe { (so.slice(r.start * c..r.end * c), sr.slice(r.clone())) };
        let rows = inp[r.start * c..r.end * c].chunks_exact(c);
        for ((x, y), r_out) in rows.zip(out.chunks_exact_mut(c)).zip(rstd) {
            *r_out = rmsnorm_row(y, x, weight, inv_c, eps);
        }
    });
}

/// One row of [`rmsnorm_fwd`]; returns rstd.
#[inline]
fn rmsnorm_row<T: Real>(y: &mut [T], x: &[T], weight: &[T], inv_c: T, eps: T) -> T {
    let ms = sum_map(x, |v| v * v) * inv_c;
    let s = T::one() / (ms + eps).sqrt();
    for ((o, &v), &w) in y.iter_mut().zip(x).zip(weight) {
        *o = v * s * w;
    }
    s
}

/// RMSNorm backward, accumulating into both gradients. With
/// `xhat = x * rstd` and `g = dout * weight`:
/// `dinp += rstd * (g - xhat * mean(g * xhat))`,
/// `dweight += Σ_rows dout * xhat`.
///
/// dinp: (N, C), dweight: (C), dout: (N, C), inp: (N, C), weight: (C),
/// rstd: (N) from [`rmsnorm_fwd`].
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_bwd<T: Real>(
    th: &Threads,
    dinp: &mut [T],
    dweight: &mut [T],
    dout: &[T],
    inp: &[T],
    weight: &[T],
    rstd: &[T],
    n: usize,
    c: usize,
) {
    if n == 0 || c == 0 {
        return;
    }
    let (dout, inp, weight, rstd) = (&dout[..n * c], &inp[..n * c], &weight[..c], &rstd[..n]);
    let inv_c = T::one() / T::of(c as f64);
    let partial = per_part_partials(th, dinp, n, c, c, |r, dx, dw| {
        let rows = inp[r.start * c..r.end * c]
            .chunks_exact(c)
            .zip(dout[r.start * c..r.end * c].chunks_exact(c));
        for (((x, dy), dx), &s) in rows.zip(dx.chunks_exact_mut(c)).zip(&rstd[r.clone()]) {
            rmsnorm_bwd_row(dx, dw, dy, x, weight, s, inv_c);
        }
    });
    add_partials(&mut dweight[..c], &partial, c, 0);
}

/// One row of [`rmsnorm_bwd`]: `dx +=` and the part's partial `dw +=`.
#[inline]
fn rmsnorm_bwd_row<T: Real>(
    dx: &mut [T],
    dw: &mut [T],
    dy: &[T],
    x: &[T],
    weight: &[T],
    s: T,
    inv_c: T,
) {
    // mean(g * xhat) = s/C * Σ dy*w*x
    let mgx = sum_map3(dy, weight, x, |d, w, v| d * w * v) * s * inv_c;
    for (((o, &d), &w), (&v, dwj)) in dx
        .iter_mut()
        .zip(dy)
        .zip(weight)
        .zip(x.iter().zip(dw.iter_mut()))
    {
        let xh = v * s;
        *dwj += d * xh;
        *o += s * (d * w - xh * mgx);
    }
}
