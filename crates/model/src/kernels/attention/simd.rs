//! The f32 AVX-512 kernels: the register-blocked k-major product behind
//! `gemm_km` and the 16 x 16 register transpose.
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
                            1 => micro::<$mr, 1>(k, alpha, ap, lda, bp, ldb, beta, cp, rsc, mask),
                            2 => micro::<$mr, 2>(k, alpha, ap, lda, bp, ldb, beta, cp, rsc, mask),
                            3 => micro::<$mr, 3>(k, alpha, ap, lda, bp, ldb, beta, cp, rsc, mask),
                            _ => micro::<$mr, 4>(k, alpha, ap, lda, bp, ldb, beta, cp, rsc, mask),
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

/// [`super::transpose::transpose`] for f32: 16 x 16 blocks transposed in
/// registers (`vmath::avx512::transpose16`, shared with the GEMM's
/// packing), the edges element by element.
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
        super::transpose::transpose_edges(dst, ld, src, rs, rows, cols, rf, cf);
    }
}
