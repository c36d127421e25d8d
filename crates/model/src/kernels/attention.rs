//! Causal multi-head self-attention with grouped key/value heads (GQA),
//! forward and backward, tiled with an online softmax (FlashAttention-2).
//!
//! Layout. `qkv` is the fused projection output, one row per token (N rows,
//! sequence `bi` owning rows `bi*T..(bi+1)*T`), each row
//! `[q head 0..H | k head 0..K | v head 0..K]` with D values per head
//! (PyTorch's `qkv.split([H*D, K*D, K*D], -1)` then `.view(B, T, heads, D)`).
//! Query head `j` reads kv head `j / (H/K)`. Scores are scaled by
//! `1/sqrt(D)`; query position `i` attends keys `0..=i`.
//!
//! Forward. One task per (sequence, kv head) — or per part of its group of
//! query heads when there are fewer such pairs than twice the threads. Per
//! query head and query tile of `tiles.q` rows it walks the key tiles of
//! `tiles.k` keys up to the diagonal (fully masked tiles are never
//! visited): `S = scale·Q·Kᵀ`, online softmax (running max `m` and sum `l`
//! per query, the accumulator rescaled by `e^{m_old - m_new}`), `O += P·V`;
//! then `out = O / l`, `lse = m + ln l`. Scratch per task: Kᵀ and a copy
//! of V (D x T each), the score tile and the accumulator,
//! O(T·D + tiles.q·(tiles.k + D)).
//!
//! Backward. One task per (sequence, kv head): it owns every element of
//! `dqkv` it writes (dQ of the H/K query heads of the group, dK and dV of
//! the kv head), so no two tasks write the same element. Per query head,
//! query tile and key tile, P is recomputed from `lse`, then five products:
//! `dV += Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P∘(dP − Di)` (`Di = rowsum(dO∘O)`),
//! `dK += scale·dSᵀ·Q`, `dQ += scale·dS·K`, accumulated straight into the
//! strided rows of `dqkv`. Scratch per task: Kᵀ, Vᵀ (D x T) and three
//! tiles.q x tiles.k tiles.
//!
//! Determinism: every output element is computed by one task in a fixed
//! order that does not depend on the thread count, so results are
//! bit-identical for any number of threads.
//!
//! Masking: a key tile that crosses the diagonal is cut into `tiles.diag`
//! wide column chunks and each chunk's products skip the query rows that
//! see none of its keys, so only a thin band of masked scores is computed.
//!
//! Products. Every product is arranged so that both operands are
//! contiguous along their non-contracted dimension ("k-major"), using
//! transposed copies of K, V and of the Q, dO and dS tiles. That is what
//! lets `gemm_km` run without packing: with f32 and AVX-512 it is a
//! register-blocked kernel that reads the operands in place (1.2-1.45x
//! matrixmultiply on these shapes, which must copy both operands into
//! panels on every call); otherwise it is `T::gemm`.
//!
//! Cost (useful, causal): forward 2·B·H·T²·D flops, backward 2.5x that.
//! Measured (examples/attention_bench.rs, B=8 T=256 D=64, 2 threads, f32):
//! 1.2-2x faster than PyTorch 2.15's CPU flash attention forward and
//! backward at H=4..6, K=2..6.
use crate::real::{GemmInit, Real};
use crate::threads::{SharedMut, Threads, part_range};

/// Tile sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiles {
    /// Query rows per tile.
    pub q: usize,
    /// Keys per tile (the online softmax rescales once per key tile).
    pub k: usize,
    /// Width of the column chunks a key tile is cut into where it crosses
    /// the diagonal: each chunk's products skip the query rows that cannot
    /// see any of its keys, so at most a `diag`-wide band of masked scores
    /// is computed instead of the tile's whole upper triangle.
    pub diag: usize,
}

impl Tiles {
    /// The forward's tiles, chosen by measurement
    /// (`cargo run --release -p flotilla-model --example attention_bench`).
    pub const FWD: Tiles = Tiles {
        q: 64,
        k: 128,
        diag: 16,
    };
    /// The backward's tiles, chosen by measurement.
    pub const BWD: Tiles = Tiles {
        q: 32,
        k: 64,
        diag: 16,
    };
}

/// Checks shared by forward and backward; these guard the raw-pointer
/// products, so they are real asserts (a few per call), not debug-only.
fn check_dims(what: &str, qkv: usize, b: usize, t: usize, h: usize, k: usize, d: usize) {
    assert!(
        k > 0 && h.is_multiple_of(k),
        "{what}: query heads {h} must be a positive multiple of kv heads {k}"
    );
    assert!(
        qkv >= b * t * (h + 2 * k) * d,
        "{what}: qkv has {qkv} elements, need {}",
        b * t * (h + 2 * k) * d
    );
}

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
    assert!(
        out.len() >= n * hd,
        "attention_fwd: out has {} elements, need {}",
        out.len(),
        n * hd
    );
    assert!(
        lse.len() >= b * h * t,
        "attention_fwd: lse has {} elements, need {}",
        lse.len(),
        b * h * t
    );
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

/// Attention backward.
///
/// dqkv: (N, (H+2K)*D) OVERWRITTEN (`=`, not `+=`) with the gradient of
/// the loss with respect to qkv; dout: (N, H*D); qkv: (N, (H+2K)*D);
/// out: (N, H*D) and lse: (B, H, T) as written by [`attention_fwd`].
///
/// Preconditions (asserted): as [`attention_fwd`].
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
    assert!(
        dqkv.len() >= n * w,
        "attention_bwd: dqkv has {} elements, need {}",
        dqkv.len(),
        n * w
    );
    assert!(
        dout.len() >= n * hd,
        "attention_bwd: dout has {} elements, need {}",
        dout.len(),
        n * hd
    );
    assert!(
        out.len() >= n * hd,
        "attention_bwd: out has {} elements, need {}",
        out.len(),
        n * hd
    );
    assert!(
        lse.len() >= b * h * t,
        "attention_bwd: lse has {} elements, need {}",
        lse.len(),
        b * h * t
    );
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

/// The column chunks of key tile `j0..j0+nk` seen from query tile rows
/// `i0..`, as `(c0, c1, r0)`: columns `c0..c1` of the tile are visible to
/// tile rows `r0..` only (rows above see none of those keys). Keys left of
/// the query tile form one chunk visible to all rows; the rest is cut into
/// `diag`-wide chunks starting at key `i0`, so `r0` steps by `diag`.
fn key_chunks(
    j0: usize,
    nk: usize,
    i0: usize,
    diag: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    let cd = nk.min(i0.saturating_sub(j0));
    let diag = diag.max(1);
    let full = (cd > 0).then_some((0, cd, 0));
    full.into_iter().chain(
        (cd..nk)
            .step_by(diag)
            .map(move |c0| (c0, (c0 + diag).min(nk), j0 + c0 - i0)),
    )
}

/// `C = alpha·A·B + beta·C` for `A` (m x k), `B` (k x n), `C` (m x n), with
/// both operands k-major: `A[i][p] = a[p*lda + i]`, `B[p][j] = b[p*ldb + j]`,
/// and `C[i][j] = c[i*rsc + j]`. With `beta == 0`, C is not read.
///
/// # Safety
/// `a` valid for reads of `(k-1)*lda + m` elements, `b` of `(k-1)*ldb + n`,
/// `c` for reads and writes of `(m-1)*rsc + n`; C overlaps neither A nor B.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn gemm_km<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    alpha: T,
    a: *const T,
    lda: usize,
    b: *const T,
    ldb: usize,
    beta: T,
    c: *mut T,
    rsc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    debug_assert!(lda >= m && ldb >= n && rsc >= n);
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
        // T is f32, so these conversions are exact.
        let (alpha, beta) = (
            alpha.to_f32().unwrap_or(f32::NAN),
            beta.to_f32().unwrap_or(f32::NAN),
        );
        // SAFETY: T is f32 (same layout); the contract is forwarded.
        unsafe {
            simd::gemm_km_f32(
                m,
                n,
                k,
                alpha,
                a.cast(),
                lda,
                b.cast(),
                ldb,
                beta,
                c.cast(),
                rsc,
            )
        };
        return;
    }
    // SAFETY: the contract is forwarded (A has row stride 1, column stride
    // lda; B row stride ldb, column stride 1).
    unsafe {
        T::gemm(
            m,
            k,
            n,
            alpha,
            a,
            1,
            lda as isize,
            b,
            ldb as isize,
            1,
            GemmInit::Beta(beta),
            c,
            rsc as isize,
            1,
        )
    }
}

/// The f32 AVX-512 kernels.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
mod simd {
    use std::arch::x86_64::*;

    /// Rows of C per micro-tile; its columns are up to 4 vectors of 16.
    const MR: usize = 6;

    /// [`super::gemm_km`] for f32: C is cut into MR x 64 micro-tiles, each
    /// accumulated in registers over the whole k (24 accumulators, 4 loads of
    /// B and MR broadcasts of A per step), edges handled with masks.
    ///
    /// # Safety
    /// As [`super::gemm_km`].
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gemm_km_f32(
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        beta: f32,
        c: *mut f32,
        rsc: usize,
    ) {
        for j0 in (0..n).step_by(64) {
            let nn = (n - j0).min(64);
            let nv = nn.div_ceil(16);
            let rem = nn - (nv - 1) * 16;
            let mask: u16 = if rem == 16 {
                u16::MAX
            } else {
                (1u16 << rem) - 1
            };
            let mut i0 = 0;
            while i0 < m {
                let mr = (m - i0).min(MR);
                // SAFETY: the micro-tile (i0.., j0..) lies inside A, B, C.
                unsafe {
                    let (ap, bp, cp) = (a.add(i0), b.add(j0), c.add(i0 * rsc + j0));
                    macro_rules! tile {
                        ($mr:literal) => {
                            match nv {
                                1 => {
                                    micro::<$mr, 1>(k, alpha, ap, lda, bp, ldb, beta, cp, rsc, mask)
                                }
                                2 => {
                                    micro::<$mr, 2>(k, alpha, ap, lda, bp, ldb, beta, cp, rsc, mask)
                                }
                                3 => {
                                    micro::<$mr, 3>(k, alpha, ap, lda, bp, ldb, beta, cp, rsc, mask)
                                }
                                _ => {
                                    micro::<$mr, 4>(k, alpha, ap, lda, bp, ldb, beta, cp, rsc, mask)
                                }
                            }
                        };
                    }
                    match mr {
                        6 => tile!(6),
                        5 => tile!(5),
                        4 => tile!(4),
                        3 => tile!(3),
                        2 => tile!(2),
                        _ => tile!(1),
                    }
                }
                i0 += mr;
            }
        }
    }

    /// One micro-tile: `C[R x 16·NV] = alpha·Σ_p a_p ⊗ b_p + beta·C`, the
    /// last vector of each row limited to the lanes in `mask`.
    ///
    /// # Safety
    /// `a` readable at `p*lda + i` (p < k, i < R), `b` at `p*ldb + j` and
    /// `c` at `i*rsc + j` for the columns j selected by the vectors / mask.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn micro<const R: usize, const NV: usize>(
        k: usize,
        alpha: f32,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        beta: f32,
        c: *mut f32,
        rsc: usize,
        mask: u16,
    ) {
        // SAFETY: the accesses are the ones the contract allows; masked
        // loads and stores do not touch the lanes outside the mask.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); NV]; R];
            let (mut ap, mut bp) = (a, b);
            for _ in 0..k {
                let mut bv = [_mm512_setzero_ps(); NV];
                for (v, x) in bv.iter_mut().enumerate() {
                    *x = if v + 1 == NV {
                        _mm512_maskz_loadu_ps(mask, bp.add(16 * v))
                    } else {
                        _mm512_loadu_ps(bp.add(16 * v))
                    };
                }
                for (i, row) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(*ap.add(i));
                    for (x, &bvv) in row.iter_mut().zip(&bv) {
                        *x = _mm512_fmadd_ps(av, bvv, *x);
                    }
                }
                // Wrapping: after the last step the pointers may pass the
                // end of their buffers (they are not dereferenced then).
                ap = ap.wrapping_add(lda);
                bp = bp.wrapping_add(ldb);
            }
            let alv = _mm512_set1_ps(alpha);
            let bev = _mm512_set1_ps(beta);
            for (i, row) in acc.iter().enumerate() {
                for (v, &x) in row.iter().enumerate() {
                    let cp = c.add(i * rsc + 16 * v);
                    let mk = if v + 1 == NV { mask } else { u16::MAX };
                    let mut r = _mm512_mul_ps(alv, x);
                    if beta != 0.0 {
                        r = _mm512_fmadd_ps(bev, _mm512_maskz_loadu_ps(mk, cp), r);
                    }
                    _mm512_mask_storeu_ps(cp, mk, r);
                }
            }
        }
    }

    /// [`super::transpose`] for f32: 16 x 16 blocks transposed in registers
    /// (`vmath::avx512::transpose16`, shared with the GEMM's packing), the
    /// edges element by element.
    ///
    /// # Safety
    /// `src` valid for reads of `(rows-1)*rs + cols` elements, `dst` for
    /// writes of `(cols-1)*ld + rows`, not overlapping.
    pub(super) unsafe fn transpose_f32(
        dst: *mut f32,
        ld: usize,
        src: *const f32,
        rs: usize,
        rows: usize,
        cols: usize,
    ) {
        let (rf, cf) = (rows / 16 * 16, cols / 16 * 16);
        // SAFETY: every access stays inside the blocks the contract covers.
        unsafe {
            for r0 in (0..rf).step_by(16) {
                for c0 in (0..cf).step_by(16) {
                    let s = src.add(r0 * rs + c0);
                    let mut r = [_mm512_setzero_ps(); 16];
                    for (i, x) in r.iter_mut().enumerate() {
                        *x = _mm512_loadu_ps(s.add(i * rs));
                    }
                    let r = crate::kernels::vmath::avx512::transpose16(&r);
                    let dd = dst.add(c0 * ld + r0);
                    for (i, x) in r.iter().enumerate() {
                        _mm512_storeu_ps(dd.add(i * ld), *x);
                    }
                }
            }
            let dst = std::slice::from_raw_parts_mut(dst, (cols - 1) * ld + rows);
            let src = std::slice::from_raw_parts(src, (rows - 1) * rs + cols);
            super::transpose_edges(dst, ld, src, rs, rows, cols, rf, cf);
        }
    }
}

/// `dst[c * ld + r] = src[r * rs + c]` for `r < rows`, `c < cols`: the
/// transpose of a strided `rows x cols` block. f32 with AVX-512 goes
/// through 16 x 16 register transposes (0.13 ns per element against 0.5 for
/// the portable 8 x 8 blocks, measured on the build machine).
fn transpose<T: Real>(dst: &mut [T], ld: usize, src: &[T], rs: usize, rows: usize, cols: usize) {
    if rows == 0 || cols == 0 {
        return;
    }
    // Bounds for the unchecked path.
    assert!(
        ld >= rows && dst.len() >= (cols - 1) * ld + rows,
        "transpose: destination too short"
    );
    assert!(
        rs >= cols && src.len() >= (rows - 1) * rs + cols,
        "transpose: source too short"
    );
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
        // SAFETY: T is f32 (same layout); bounds asserted above; dst is a
        // &mut slice, so it cannot overlap src.
        unsafe {
            simd::transpose_f32(
                dst.as_mut_ptr().cast(),
                ld,
                src.as_ptr().cast(),
                rs,
                rows,
                cols,
            )
        };
        return;
    }
    const BS: usize = 8;
    let (rf, cf) = (rows / BS * BS, cols / BS * BS);
    for r0 in (0..rf).step_by(BS) {
        for c0 in (0..cf).step_by(BS) {
            let mut blk = [[T::zero(); BS]; BS];
            for (i, row) in blk.iter_mut().enumerate() {
                row.copy_from_slice(&src[(r0 + i) * rs + c0..][..BS]);
            }
            for jj in 0..BS {
                let out = &mut dst[(c0 + jj) * ld + r0..][..BS];
                for (i, x) in out.iter_mut().enumerate() {
                    *x = blk[i][jj];
                }
            }
        }
    }
    transpose_edges(dst, ld, src, rs, rows, cols, rf, cf);
}

/// The part of a transpose outside the first `rf` rows and `cf` columns.
#[allow(clippy::too_many_arguments)]
fn transpose_edges<T: Copy>(
    dst: &mut [T],
    ld: usize,
    src: &[T],
    rs: usize,
    rows: usize,
    cols: usize,
    rf: usize,
    cf: usize,
) {
    for r in 0..rows {
        let c_start = if r < rf { cf } else { 0 };
        for c in c_start..cols {
            dst[c * ld + r] = src[r * rs + c];
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The k-major product (the AVX-512 kernel for f32) against T::gemm,
    /// on shapes that hit every micro-tile size and mask.
    #[test]
    fn gemm_km_matches_matrixmultiply() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (6, 16, 3),
            (7, 17, 5),
            (13, 64, 64),
            (64, 70, 37),
            (5, 129, 2),
            (3, 3, 0),
        ] {
            let (lda, ldb, rsc) = (m + 3, n + 5, n + 2);
            let a: Vec<f32> = (0..k.max(1) * lda)
                .map(|i| ((i as f32) * 0.37).sin())
                .collect();
            let b: Vec<f32> = (0..k.max(1) * ldb)
                .map(|i| ((i as f32) * 0.11).cos())
                .collect();
            for beta in [0.0f32, 1.0, 0.5] {
                let c0: Vec<f32> = (0..m * rsc).map(|i| (i as f32 * 0.7).cos()).collect();
                let (mut c1, mut c2) = (c0.clone(), c0.clone());
                // SAFETY: the buffers are sized for the shapes above.
                unsafe {
                    gemm_km(
                        m,
                        n,
                        k,
                        0.75,
                        a.as_ptr(),
                        lda,
                        b.as_ptr(),
                        ldb,
                        beta,
                        c1.as_mut_ptr(),
                        rsc,
                    );
                    f32::gemm(
                        m,
                        k,
                        n,
                        0.75,
                        a.as_ptr(),
                        1,
                        lda as isize,
                        b.as_ptr(),
                        ldb as isize,
                        1,
                        GemmInit::Beta(beta),
                        c2.as_mut_ptr(),
                        rsc as isize,
                        1,
                    );
                }
                for i in 0..m {
                    for j in 0..rsc {
                        let (x, y) = (c1[i * rsc + j], c2[i * rsc + j]);
                        let ok = if j < n {
                            (x - y).abs() <= 1e-5 * (1.0 + y.abs())
                        } else {
                            x == c0[i * rsc + j]
                        };
                        assert!(ok, "m={m} n={n} k={k} beta={beta} at ({i},{j}): {x} vs {y}");
                    }
                }
            }
        }
    }

    #[test]
    fn transpose_matches_naive() {
        for &(rows, cols) in &[(1, 1), (16, 16), (17, 33), (64, 256), (5, 70)] {
            let rs = cols + 3;
            let src: Vec<f32> = (0..rows * rs).map(|i| i as f32).collect();
            let ld = rows + 1;
            let mut dst = vec![-1f32; cols * ld];
            transpose(&mut dst, ld, &src, rs, rows, cols);
            let src64: Vec<f64> = src.iter().map(|&x| x as f64).collect();
            let mut dst64 = vec![-1f64; cols * ld];
            transpose(&mut dst64, ld, &src64, rs, rows, cols);
            for c in 0..cols {
                for r in 0..ld {
                    let want = if r < rows { src[r * rs + c] } else { -1.0 };
                    assert_eq!(dst[c * ld + r], want);
                    assert_eq!(dst64[c * ld + r], want as f64);
                }
            }
        }
    }
}
