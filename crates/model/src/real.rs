//! The float type the kernels are generic over.
//!
//! `f32` is the fast path: its transcendental functions are branch-free
//! polynomials that the compiler vectorises (relative error below 3e-7,
//! checked against `f64` in the tests). `f64` is the reference path used by
//! the finite-difference gradient checks; it calls the standard library.
use num_traits::{Float, FromPrimitive, ToPrimitive};
use std::fmt::Debug;
use std::iter::Sum;
use std::ops::{AddAssign, DivAssign, MulAssign, SubAssign};

/// A float the kernels compute in.
pub trait Real:
    Float
    + FromPrimitive
    + ToPrimitive
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
    + Sum
    + Default
    + Debug
    + Send
    + Sync
    + 'static
{
    /// "f32" or "f64".
    const NAME: &'static str;
    /// `x` converted from f64 (rounded to nearest).
    fn of(x: f64) -> Self;
    /// `e^x`, vectorisable.
    fn exp_k(self) -> Self;
    /// The error function, vectorisable.
    fn erf_k(self) -> Self;
    /// Hyperbolic tangent, vectorisable.
    fn tanh_k(self) -> Self;
    /// Single-threaded GEMM: `C = alpha * A(m x k) * B(k x n) + beta * C` (or `+ bias`, see
    /// [`GemmInit`]), every matrix given by a pointer and (row stride, column stride).
    ///
    /// # Safety
    /// The pointers and strides must describe valid, non-overlapping
    /// regions (C may not alias A or B); a bias points to `n` values.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        init: GemmInit<Self>,
        c: *mut Self,
        rsc: isize,
        csc: isize,
    );
}

/// What a GEMM adds its product to: `beta * C`, or a bias row (`n` values, one per column of
/// C) broadcast over C's rows, the linear layer's forward. With a bias, each element gets the
/// bits of filling C with the bias and using `beta = 1` (`1 * bias` is exact).
#[derive(Clone, Copy, Debug)]
pub enum GemmInit<T> {
    /// `C = alpha * A * B + beta * C` (`beta == 0` never reads C).
    Beta(T),
    /// `C = alpha * A * B + bias[j]`; C is only written.
    Bias(*const T),
}

impl<T: Real> GemmInit<T> {
    /// For kernels without a bias epilogue: writes the bias into every row of C (m x n) and
    /// returns the `beta` that then gives the same result (1 after a bias).
    ///
    /// # Safety
    /// C must be valid for writes at that shape and strides, a bias for `n` reads.
    pub(crate) unsafe fn into_beta(
        self,
        m: usize,
        n: usize,
        c: *mut T,
        rsc: isize,
        csc: isize,
    ) -> T {
        match self {
            GemmInit::Beta(beta) => beta,
            GemmInit::Bias(bias) => {
                // SAFETY: forwarded contract.
                unsafe { fill_rows(m, n, bias, c, rsc, csc) };
                T::one()
            }
        }
    }
}

/// Every row of C (m x n, strides `rsc`, `csc`) set to the bias row (n values).
///
/// # Safety
/// C must be valid for writes at those shape and strides, `bias` for `n` reads.
unsafe fn fill_rows<T: Copy>(
    m: usize,
    n: usize,
    bias: *const T,
    c: *mut T,
    rsc: isize,
    csc: isize,
) {
    for i in 0..m {
        for j in 0..n {
            // SAFETY: (i, j) is inside C and j inside the bias.
            unsafe { *c.offset(i as isize * rsc + j as isize * csc) = *bias.add(j) };
        }
    }
}

impl Real for f64 {
    const NAME: &'static str = "f64";
    #[inline(always)]
    fn of(x: f64) -> Self {
        x
    }
    #[inline(always)]
    fn exp_k(self) -> Self {
        self.exp()
    }
    #[inline(always)]
    fn erf_k(self) -> Self {
        erf_f64(self)
    }
    #[inline(always)]
    fn tanh_k(self) -> Self {
        self.tanh()
    }
    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        init: GemmInit<Self>,
        c: *mut Self,
        rsc: isize,
        csc: isize,
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            let beta = init.into_beta(m, n, c, rsc, csc);
            matrixmultiply::dgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc)
        }
    }
}

impl Real for f32 {
    const NAME: &'static str = "f32";
    #[inline(always)]
    fn of(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn exp_k(self) -> Self {
        exp_f32(self)
    }
    #[inline(always)]
    fn erf_k(self) -> Self {
        erf_f32(self)
    }
    #[inline(always)]
    fn tanh_k(self) -> Self {
        tanh_f32(self)
    }
    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        init: GemmInit<Self>,
        c: *mut Self,
        rsc: isize,
        csc: isize,
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            crate::kernels::sgemm::sgemm_init(
                m, k, n, alpha, a, rsa, csa, b, rsb, csb, init, c, rsc, csc,
            )
        }
    }
}

/// Constants of [`exp_f32`], shared with the explicit AVX-512 rows (`kernels::vmath`) so both
/// compute the same bits.
// Published coefficients are kept digit for digit.
#[allow(clippy::excessive_precision)]
pub(crate) mod exp_c {
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    pub const LN2_HI: f32 = 0.693_359_4;
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    /// 1.5 * 2^23: adding it rounds to an integer.
    pub const ROUND: f32 = 12_582_912.0;
    /// The input range kept (below: ~0; above: saturated).
    pub const LO: f32 = -87.3;
    pub const HI: f32 = 88.7;
    /// Cephes expf minimax coefficients for e^r on [-ln2/2, ln2/2], highest degree first.
    pub const POLY: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        5.000_000_1e-1,
    ];
}

/// `e^x` for f32 without branches: range reduction `x = n ln2 + r`,
/// |r| <= ln2/2, a degree-6 polynomial for `e^r`, and `2^n` built from the
/// exponent bits. Inputs below -87.3 give ~0, above 88.7 saturate.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    use exp_c::*;
    let x = x.clamp(LO, HI);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let r2 = r * r;
    let mut p = POLY[0];
    for &c in &POLY[1..] {
        p = p.mul_add(r, c);
    }
    let e = p.mul_add(r2, r) + 1.0;
    // 2^n from the exponent bits: n + 127 sits in the low mantissa bits of
    // `n + 127 + ROUND`; shifting them into the exponent field avoids a
    // float-to-int cast, which would stop the loop from vectorising.
    let bits = (n + (127.0 + ROUND)).to_bits() << 23;
    e * f32::from_bits(bits)
}

/// tanh for f32: `1 - 2 / (e^{2x} + 1)` for |x| >= 0.5 and the odd
/// Taylor series through x^15 below, where the first form cancels
/// (relative error < 3e-7, checked against f64 in the tests).
#[inline(always)]
pub fn tanh_f32(x: f32) -> f32 {
    let e = exp_f32(2.0 * x);
    let big = 1.0 - 2.0 / (e + 1.0);
    let x2 = x * x;
    let mut p = -929_569.0 / 638_512_875.0_f32;
    p = p.mul_add(x2, 21_844.0 / 6_081_075.0);
    p = p.mul_add(x2, -(1_382.0 / 155_925.0));
    p = p.mul_add(x2, 62.0 / 2_835.0);
    p = p.mul_add(x2, -(17.0 / 315.0));
    p = p.mul_add(x2, 2.0 / 15.0);
    p = p.mul_add(x2, -(1.0 / 3.0));
    let small = x + x * x2 * p;
    if x.abs() < 0.5 { small } else { big }
}

/// Constants of [`erf_f32`], shared with the explicit AVX-512 rows (`kernels::vmath`).
#[allow(clippy::excessive_precision)]
pub(crate) mod erf_c {
    /// Numerical Recipes' erfc fit in `t`, highest degree first (Horner form of
    /// -1.26551223 + t(1.00002368 + t(0.37409196 + ...))).
    pub const FIT: [f32; 10] = [
        0.170_872_77,
        -0.822_152_23,
        1.488_515_87,
        -1.135_203_98,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_7,
        -1.265_512_2,
    ];
    /// erf z = 2/sqrt(pi) * sum_n (-1)^n z^(2n+1) / (n! (2n+1)), n = 0..7: the coefficients
    /// of z^2 powers after the first term, highest first.
    pub const SERIES: [f32; 7] = [
        -1.0 / (5_040.0 * 15.0),
        1.0 / (720.0 * 13.0),
        -(1.0 / (120.0 * 11.0)),
        1.0 / (24.0 * 9.0),
        -(1.0 / (6.0 * 7.0)),
        1.0 / (2.0 * 5.0),
        -(1.0 / 3.0),
    ];
    /// Below this |x| the series is used.
    pub const SMALL: f32 = 0.5;
}

/// erf for f32: for |x| >= 0.5, `1 - t e^{-x^2 + P(t)}` with
/// `t = 1/(1+|x|/2)` (Numerical Recipes' erfc fit, relative error 1.2e-7);
/// below, the Maclaurin series through x^15, where `1 - erfc` would cancel.
#[inline(always)]
pub fn erf_f32(x: f32) -> f32 {
    use erf_c::*;
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let mut p = FIT[0];
    for &c in &FIT[1..] {
        p = p.mul_add(t, c);
    }
    let big = 1.0 - t * exp_f32((-z).mul_add(z, p));
    let z2 = z * z;
    let mut s = SERIES[0];
    for &c in &SERIES[1..] {
        s = s.mul_add(z2, c);
    }
    let small = std::f32::consts::FRAC_2_SQRT_PI * (z + z * z2 * s);
    let r = if z < SMALL { small } else { big };
    r.copysign(x)
}

/// erf for f64 to ~1e-15 (series for small |x|, continued fraction erfc
/// for large |x|), used by the reference path.
pub fn erf_f64(x: f64) -> f64 {
    let z = x.abs();
    let r = if z < 2.5 {
        // Maclaurin series: erf z = 2/sqrt(pi) * sum (-1)^n z^(2n+1) / (n! (2n+1))
        let mut term = z;
        let mut sum = z;
        let z2 = z * z;
        // At |x| < 2.5 the terms fall below 1e-17 of the sum within 60.
        for n in 1..=80 {
            let n = n as f64;
            term *= -z2 / n;
            let add = term / (2.0 * n + 1.0);
            sum += add;
            if add.abs() <= 1e-17 * sum.abs() {
                break;
            }
        }
        sum * std::f64::consts::FRAC_2_SQRT_PI
    } else {
        // Lentz continued fraction for erfc.
        let mut f = z;
        let mut c = z;
        let mut d = 0.0;
        let mut k = 0.5;
        for _ in 0..200 {
            d = z + k * d;
            d = 1.0 / d;
            c = z + k / c;
            let delta = c * d;
            f *= delta;
            k += 0.5;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        1.0 - (-z * z).exp() / (f * std::f64::consts::PI.sqrt())
    };
    r.copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worst_rel(f32f: fn(f32) -> f32, f64f: fn(f64) -> f64, lo: f64, hi: f64) -> f64 {
        let mut worst: f64 = 0.0;
        for i in 0..=200_000 {
            let x = lo + (hi - lo) * i as f64 / 200_000.0;
            let xf = x as f32;
            let want = f64f(xf as f64);
            let got = f32f(xf) as f64;
            let scale = want.abs().max(1e-30);
            worst = worst.max((got - want).abs() / scale);
        }
        worst
    }

    #[test]
    fn exp_is_accurate() {
        assert!(worst_rel(exp_f32, f64::exp, -80.0, 80.0) < 3e-7);
        assert!(exp_f32(-1000.0) < 1e-37);
        assert!(exp_f32(0.0) == 1.0);
    }

    #[test]
    fn tanh_is_accurate() {
        let w = worst_rel(tanh_f32, f64::tanh, -12.0, 12.0);
        assert!(w < 3e-7, "tanh worst relative error {w:e}");
    }

    #[test]
    fn erf_is_accurate() {
        // erf f64 reference against known values.
        assert!((erf_f64(0.5) - 0.520_499_877_813_046_5).abs() < 1e-15);
        assert!((erf_f64(1.0) - 0.842_700_792_949_714_9).abs() < 1e-15);
        assert!((erf_f64(3.0) - 0.999_977_909_503_001_4).abs() < 1e-15);
        assert_eq!(erf_f64(0.0), 0.0);
        assert_eq!(erf_f32(0.0), 0.0);
        let w = worst_rel(erf_f32, erf_f64, -6.0, 6.0);
        assert!(w < 3e-7, "erf worst relative error {w:e}");
    }
}
