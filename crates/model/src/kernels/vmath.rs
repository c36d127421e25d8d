//! Explicit AVX-512 bodies for the f32 elementwise rows whose math is heavy: the exact GELU's
//! forward and backward (an `erf`, an `exp` and a division per element), and the shifted `exp`
//! of attention's recomputed probabilities (the cross-entropy backward's, over the logits, is
//! memory-bound: 16 lanes did not change its time).
//!
//! Why: LLVM vectorises the portable rows (`kernels::activation`) only 256 bits wide on this
//! CPU, whose tuning prefers ymm registers; 16 lanes instead of 8 halve the instruction count
//! (docs/PERFORMANCE.md has the measured ns per element).
//!
//! Same results: every function performs the portable code's operations in its order, with
//! the same constants (`real::exp_c`, `real::erf_c`) and fused multiply-adds exactly where it
//! has `mul_add`, so each element gets the same bits as the scalar path (tested). The fast path
//! is taken only for f32 slices on a CPU with AVX-512F; everything else stays portable.

use std::any::TypeId;

/// `s` viewed as `f32` when `T` is `f32`.
pub(crate) fn as_f32<T: 'static>(s: &[T]) -> Option<&[f32]> {
    (TypeId::of::<T>() == TypeId::of::<f32>())
        // SAFETY: T is f32 (same TypeId), so the slice's layout is that of [f32].
        .then(|| unsafe { &*(s as *const [T] as *const [f32]) })
}

/// `s` viewed as mutable `f32` when `T` is `f32`.
pub(crate) fn as_f32_mut<T: 'static>(s: &mut [T]) -> Option<&mut [f32]> {
    (TypeId::of::<T>() == TypeId::of::<f32>())
        // SAFETY: T is f32 (same TypeId), so the slice's layout is that of [f32].
        .then(|| unsafe { &mut *(s as *mut [T] as *mut [f32]) })
}

/// Runs `$call` (a row of [`avx512`]) and is true, or is false (nothing run) when the CPU has
/// no AVX-512F. The callers have checked the slice lengths the row relies on.
macro_rules! on_avx512 {
    ($call:expr) => {{
        #[cfg(target_arch = "x86_64")]
        let ran = std::is_x86_feature_detected!("avx512f") && {
            // SAFETY: AVX-512F is present; the lengths were checked by the caller.
            unsafe { $call };
            true
        };
        #[cfg(not(target_arch = "x86_64"))]
        let ran = false;
        ran
    }};
}

/// `out = x/2 (1 + erf(x · inv_sqrt2))` (written as `half · x · (...)`), or false (nothing
/// written) when the CPU has no AVX-512F. `out` and `inp` have equal lengths.
pub(crate) fn gelu_erf_fwd(out: &mut [f32], inp: &[f32], half: f32, inv_sqrt2: f32) -> bool {
    assert_eq!(out.len(), inp.len(), "gelu_erf_fwd lengths");
    on_avx512!(avx512::gelu_erf_fwd(out, inp, half, inv_sqrt2))
}

/// `dinp = dout (Φ(x) + x φ(x))` with `Φ = half (1 + erf(x · inv_sqrt2))` and
/// `φ = inv_sqrt_2pi · exp(-half · x · x)`, or false when the CPU has no AVX-512F.
pub(crate) fn gelu_erf_bwd(dinp: &mut [f32], inp: &[f32], dout: &[f32], consts: [f32; 3]) -> bool {
    assert!(
        dinp.len() == inp.len() && dout.len() == inp.len(),
        "gelu_erf_bwd lengths"
    );
    on_avx512!(avx512::gelu_erf_bwd(dinp, inp, dout, consts))
}

/// `x = e^(x - shift)` in place, or false (nothing written) when the CPU has no AVX-512F.
pub(crate) fn exp_shift(x: &mut [f32], shift: f32) -> bool {
    on_avx512!(avx512::exp_shift(x, shift))
}

/// The AVX-512 rows, and the 16x16 register transpose that the GEMM's packing and attention's
/// transposed copies share.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use crate::real::{erf_c, exp_c};
    use std::arch::x86_64::*;

    /// Lanes left in the last vector of a row of `len`: a mask of `len - i` (at most 16).
    fn mask(len: usize, i: usize) -> __mmask16 {
        let left = (len - i).min(16);
        ((1u32 << left) - 1) as __mmask16
    }

    /// `real::exp_f32` on 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
        use exp_c::*;
        let set = _mm512_set1_ps;
        // clamp: max then min, with x second so that a NaN passes through as in f32::clamp.
        let x = _mm512_min_ps(set(HI), _mm512_max_ps(set(LO), x));
        let n = _mm512_sub_ps(
            _mm512_add_ps(_mm512_mul_ps(x, set(LOG2E)), set(ROUND)),
            set(ROUND),
        );
        let r = _mm512_fnmadd_ps(n, set(LN2_LO), _mm512_fnmadd_ps(n, set(LN2_HI), x));
        let r2 = _mm512_mul_ps(r, r);
        let mut p = set(POLY[0]);
        for &c in &POLY[1..] {
            p = _mm512_fmadd_ps(p, r, set(c));
        }
        let e = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), set(1.0));
        let bits =
            _mm512_slli_epi32::<23>(_mm512_castps_si512(_mm512_add_ps(n, set(127.0 + ROUND))));
        _mm512_mul_ps(e, _mm512_castsi512_ps(bits))
    }

    /// `real::erf_f32` on 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn erf16(x: __m512) -> __m512 {
        use erf_c::*;
        let set = _mm512_set1_ps;
        let sign = _mm512_set1_epi32(i32::MIN);
        let xi = _mm512_castps_si512(x);
        let z = _mm512_castsi512_ps(_mm512_andnot_si512(sign, xi));
        let t = _mm512_div_ps(
            set(1.0),
            _mm512_add_ps(set(1.0), _mm512_mul_ps(set(0.5), z)),
        );
        let mut p = set(FIT[0]);
        for &c in &FIT[1..] {
            p = _mm512_fmadd_ps(p, t, set(c));
        }
        let big = _mm512_sub_ps(set(1.0), _mm512_mul_ps(t, exp16(_mm512_fnmadd_ps(z, z, p))));
        let z2 = _mm512_mul_ps(z, z);
        let mut s = set(SERIES[0]);
        for &c in &SERIES[1..] {
            s = _mm512_fmadd_ps(s, z2, set(c));
        }
        let small = _mm512_mul_ps(
            set(std::f32::consts::FRAC_2_SQRT_PI),
            _mm512_add_ps(z, _mm512_mul_ps(_mm512_mul_ps(z, z2), s)),
        );
        let is_small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(z, set(SMALL));
        let r = _mm512_mask_blend_ps(is_small, big, small);
        // copysign(r, x): r's magnitude bits, x's sign bit.
        _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_andnot_si512(sign, _mm512_castps_si512(r)),
            _mm512_and_si512(sign, xi),
        ))
    }

    /// 16x16 transpose in registers: `out[q]` lane `r` = `r[r]` lane `q` (unpack pairs of
    /// rows, shuffle groups of four, then two rounds of 128-bit lane shuffles: 64 shuffles).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn transpose16(r: &[__m512; 16]) -> [__m512; 16] {
        // Pairs of rows interleaved within each 128-bit lane.
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // Groups g of 4 rows: u[4g + j] lane L = rows 4g..4g+4 at column 4L + j.
        let mut u = [_mm512_setzero_ps(); 16];
        for g in 0..4 {
            let (lo0, hi0, lo1, hi1) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
            u[4 * g] = _mm512_shuffle_ps::<0x44>(lo0, lo1);
            u[4 * g + 1] = _mm512_shuffle_ps::<0xEE>(lo0, lo1);
            u[4 * g + 2] = _mm512_shuffle_ps::<0x44>(hi0, hi1);
            u[4 * g + 3] = _mm512_shuffle_ps::<0xEE>(hi0, hi1);
        }
        // Gather lane L of the four groups into output column 4L + j.
        let mut out = [_mm512_setzero_ps(); 16];
        for j in 0..4 {
            let v01 = _mm512_shuffle_f32x4::<0x88>(u[j], u[4 + j]);
            let w01 = _mm512_shuffle_f32x4::<0xDD>(u[j], u[4 + j]);
            let v23 = _mm512_shuffle_f32x4::<0x88>(u[8 + j], u[12 + j]);
            let w23 = _mm512_shuffle_f32x4::<0xDD>(u[8 + j], u[12 + j]);
            out[j] = _mm512_shuffle_f32x4::<0x88>(v01, v23);
            out[8 + j] = _mm512_shuffle_f32x4::<0xDD>(v01, v23);
            out[4 + j] = _mm512_shuffle_f32x4::<0x88>(w01, w23);
            out[12 + j] = _mm512_shuffle_f32x4::<0xDD>(w01, w23);
        }
        out
    }

    /// See [`super::exp_shift`].
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_shift(x: &mut [f32], shift: f32) {
        let sh = _mm512_set1_ps(shift);
        let len = x.len();
        for i in (0..len).step_by(16) {
            let m = mask(len, i);
            // SAFETY: the masked lanes are elements i.. < len.
            unsafe {
                let p = x.as_mut_ptr().add(i);
                let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p), sh));
                _mm512_mask_storeu_ps(p, m, e);
            }
        }
    }

    /// See [`super::gelu_erf_fwd`].
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gelu_erf_fwd(out: &mut [f32], inp: &[f32], half: f32, inv_sqrt2: f32) {
        let (h, k) = (_mm512_set1_ps(half), _mm512_set1_ps(inv_sqrt2));
        let one = _mm512_set1_ps(1.0);
        for i in (0..inp.len()).step_by(16) {
            let m = mask(inp.len(), i);
            // SAFETY: the masked lanes are elements i.. < len of both slices.
            unsafe {
                let x = _mm512_maskz_loadu_ps(m, inp.as_ptr().add(i));
                let e = erf16(_mm512_mul_ps(x, k));
                let y = _mm512_mul_ps(_mm512_mul_ps(h, x), _mm512_add_ps(one, e));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), m, y);
            }
        }
    }

    /// See [`super::gelu_erf_bwd`]; `consts` is `[half, inv_sqrt2, inv_sqrt_2pi]`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gelu_erf_bwd(
        dinp: &mut [f32],
        inp: &[f32],
        dout: &[f32],
        consts: [f32; 3],
    ) {
        let [h, k, c] = consts.map(|v| _mm512_set1_ps(v));
        let neg_h = _mm512_set1_ps(-consts[0]);
        let one = _mm512_set1_ps(1.0);
        for i in (0..inp.len()).step_by(16) {
            let m = mask(inp.len(), i);
            // SAFETY: the masked lanes are elements i.. < len of all three slices.
            unsafe {
                let x = _mm512_maskz_loadu_ps(m, inp.as_ptr().add(i));
                let d = _mm512_maskz_loadu_ps(m, dout.as_ptr().add(i));
                let cdf = _mm512_mul_ps(h, _mm512_add_ps(one, erf16(_mm512_mul_ps(x, k))));
                let pdf = _mm512_mul_ps(c, exp16(_mm512_mul_ps(_mm512_mul_ps(neg_h, x), x)));
                let y = _mm512_mul_ps(d, _mm512_add_ps(cdf, _mm512_mul_ps(x, pdf)));
                _mm512_mask_storeu_ps(dinp.as_mut_ptr().add(i), m, y);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::real::{erf_f32, exp_f32};

    /// Inputs across both erf branches, the exp clamp and signed zeros, plus a ragged tail.
    fn inputs() -> Vec<f32> {
        let mut v: Vec<f32> = (0..4001).map(|i| (i as f32 - 2000.0) * 0.0037).collect();
        v.extend([
            0.0,
            -0.0,
            0.5,
            -0.5,
            0.499_999_97,
            9.0,
            -9.0,
            30.0,
            -30.0,
            1e-30,
        ]);
        v
    }

    #[test]
    fn the_explicit_rows_give_the_portable_bits() {
        let x = inputs();
        let d: Vec<f32> = x.iter().map(|v| 1.0 - 0.25 * v).collect();
        let (half, k, c) = (
            0.5f32,
            std::f64::consts::FRAC_1_SQRT_2 as f32,
            0.398_942_3_f32,
        );
        let mut out = vec![f32::NAN; x.len()];
        if !gelu_erf_fwd(&mut out, &x, half, k) {
            return; // no AVX-512F here: the portable path is the only one.
        }
        for (i, (&o, &v)) in out.iter().zip(&x).enumerate() {
            let want = half * v * (1.0 + erf_f32(v * k));
            assert_eq!(o.to_bits(), want.to_bits(), "fwd at {i}: x = {v}");
        }
        assert!(gelu_erf_bwd(&mut out, &x, &d, [half, k, c]));
        for (i, ((&o, &v), &dv)) in out.iter().zip(&x).zip(&d).enumerate() {
            let cdf = half * (1.0 + erf_f32(v * k));
            let pdf = c * exp_f32(-half * v * v);
            let want = dv * (cdf + v * pdf);
            assert_eq!(o.to_bits(), want.to_bits(), "bwd at {i}: x = {v}");
        }
    }

    #[test]
    fn the_shifted_exp_gives_the_portable_bits() {
        let x = inputs();
        let mut y = x.clone();
        if !exp_shift(&mut y, 1.25) {
            return;
        }
        for (i, (&got, &v)) in y.iter().zip(&x).enumerate() {
            let want = exp_f32(v - 1.25);
            assert_eq!(got.to_bits(), want.to_bits(), "at {i}: x = {v}");
        }
    }

    #[test]
    fn only_f32_slices_take_the_fast_path() {
        assert!(as_f32(&[1.0f32][..]).is_some());
        assert!(as_f32(&[1.0f64][..]).is_none());
        assert!(as_f32_mut(&mut [1.0f64][..]).is_none());
    }
}
