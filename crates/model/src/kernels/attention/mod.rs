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
mod backward;
mod forward;
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
mod simd;
mod transpose;

pub use backward::{attention_bwd, attention_bwd_tiled};
pub use forward::{attention_fwd, attention_fwd_tiled};

use crate::real::{GemmInit, Real};

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
    check_len(what, "qkv", qkv, b * t * (h + 2 * k) * d);
}

/// Asserts that buffer `name` of `what` holds at least `need` elements.
fn check_len(what: &str, name: &str, len: usize, need: usize) {
    assert!(
        len >= need,
        "{what}: {name} has {len} elements, need {need}"
    );
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
}
