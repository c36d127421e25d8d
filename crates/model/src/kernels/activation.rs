//! Activations: GELU (GPT-2's MLP) and SwiGLU (Llama's MLP), forward and
//! backward. Elementwise (or row-wise for SwiGLU), so every result is
//! bit-identical for any thread count.
//!
//! Backwards overwrite (`=`) the input gradient: the activation's input is
//! the output of a matmul, whose gradient buffer has no other contributor.
//!
//! Cost: a handful of flops and one transcendental (`erf_k`, `tanh_k` or
//! `exp_k`, all vectorisable for f32) per element. The exact GELU's rows are compute-bound and
//! run 16 lanes wide on AVX-512 (`kernels::vmath`, the same bits as the portable rows).
//!
//! SwiGLU buffers may be longer than their shapes (only the prefix is
//! used); shorter ones panic with an index error.
use crate::kernels::residual::par_rows;
use crate::kernels::vmath;
use crate::real::Real;
use crate::threads::Threads;

/// Which GELU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GeluKind {
    /// Exact: `0.5 x (1 + erf(x / √2))` (PyTorch `F.gelu`, the default).
    #[default]
    Erf,
    /// Tanh approximation (GPT-2's "gelu_new", PyTorch
    /// `approximate="tanh"`): `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
    Tanh,
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4; // sqrt(2/pi)
const GELU_COEF: f64 = 0.044_715;
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7; // 1/sqrt(2 pi)

/// GELU forward, elementwise: `out = gelu(inp)` (see [`GeluKind`]).
///
/// out, inp: any equal length (typically (N, F)).
///
/// # Panics
/// If the lengths differ.
pub fn gelu_fwd<T: Real>(th: &Threads, out: &mut [T], inp: &[T], kind: GeluKind) {
    assert_eq!(out.len(), inp.len(), "gelu_fwd lengths");
    let half = T::of(0.5);
    match kind {
        GeluKind::Erf => {
            let inv_sqrt2 = T::of(std::f64::consts::FRAC_1_SQRT_2);
            par_rows(th, out, 1, |first, block| {
                let src = &inp[first..first + block.len()];
                gelu_erf_row(block, src, half, inv_sqrt2);
            });
        }
        GeluKind::Tanh => {
            let (k0, k1) = (T::of(SQRT_2_OVER_PI), T::of(SQRT_2_OVER_PI * GELU_COEF));
            par_rows(th, out, 1, |first, block| {
                let src = &inp[first..first + block.len()];
                gelu_tanh_row(block, src, half, k0, k1);
            });
        }
    }
}

/// GELU backward, elementwise, overwriting: `dinp = dout * gelu'(inp)`.
///
/// Erf: `gelu'(x) = Φ(x) + x φ(x)` with `Φ(x) = (1 + erf(x/√2))/2` and
/// `φ(x) = e^{-x²/2}/√(2π)`.
/// Tanh: with `u = √(2/π)(x + 0.044715 x³)`,
/// `gelu'(x) = (1 + tanh u)/2 + x/2 (1 - tanh² u) √(2/π)(1 + 3·0.044715 x²)`.
///
/// dinp, inp, dout: any equal length.
///
/// # Panics
/// If the lengths differ.
pub fn gelu_bwd<T: Real>(th: &Threads, dinp: &mut [T], inp: &[T], dout: &[T], kind: GeluKind) {
    assert!(
        inp.len() == dinp.len() && dout.len() == dinp.len(),
        "gelu_bwd lengths: dinp {}, inp {}, dout {}",
        dinp.len(),
        inp.len(),
        dout.len()
    );
    let half = T::of(0.5);
    match kind {
        GeluKind::Erf => {
            let inv_sqrt2 = T::of(std::f64::consts::FRAC_1_SQRT_2);
            let inv_sqrt_2pi = T::of(INV_SQRT_2PI);
            par_rows(th, dinp, 1, |first, block| {
                let end = first + block.len();
                gelu_erf_bwd_row(
                    block,
                    &inp[first..end],
                    &dout[first..end],
                    half,
                    inv_sqrt2,
                    inv_sqrt_2pi,
                );
            });
        }
        GeluKind::Tanh => {
            let (k0, k1) = (T::of(SQRT_2_OVER_PI), T::of(SQRT_2_OVER_PI * GELU_COEF));
            let k3 = T::of(3.0 * SQRT_2_OVER_PI * GELU_COEF);
            par_rows(th, dinp, 1, |first, block| {
                let end = first + block.len();
                for ((o, &x), &d) in block
                    .iter_mut()
                    .zip(&inp[first..end])
                    .zip(&dout[first..end])
                {
                    let x2 = x * x;
                    let t = (x * (k0 + k1 * x2)).tanh_k();
                    let du = k0 + k3 * x2;
                    *o = d * (half * (T::one() + t) + half * x * (T::one() - t * t) * du);
                }
            });
        }
    }
}

// Row bodies live in their own functions so the compiler sees that the
// output slice does not alias the inputs and vectorises without checks.

/// `out = x/2 (1 + erf(x/√2))` over one block.
#[inline(never)]
fn gelu_erf_row<T: Real>(out: &mut [T], inp: &[T], half: T, inv_sqrt2: T) {
    if let (Some(o), Some(i), Some(h), Some(k)) = (
        vmath::as_f32_mut(out),
        vmath::as_f32(inp),
        half.to_f32(),
        inv_sqrt2.to_f32(),
    ) && vmath::gelu_erf_fwd(o, i, h, k)
    {
        return;
    }
    for (o, &x) in out.iter_mut().zip(inp) {
        *o = half * x * (T::one() + (x * inv_sqrt2).erf_k());
    }
}

/// `out = x/2 (1 + tanh(k0 x + k1 x³))` over one block.
#[inline(never)]
fn gelu_tanh_row<T: Real>(out: &mut [T], inp: &[T], half: T, k0: T, k1: T) {
    for (o, &x) in out.iter_mut().zip(inp) {
        let u = x * (k0 + k1 * x * x);
        *o = half * x * (T::one() + u.tanh_k());
    }
}

/// `dinp = dout (Φ(x) + x φ(x))` over one block.
#[inline(never)]
fn gelu_erf_bwd_row<T: Real>(
    dinp: &mut [T],
    inp: &[T],
    dout: &[T],
    half: T,
    inv_sqrt2: T,
    inv_sqrt_2pi: T,
) {
    let consts = [half, inv_sqrt2, inv_sqrt_2pi].map(|c| c.to_f32().unwrap_or(f32::NAN));
    if let (Some(o), Some(i), Some(d)) = (
        vmath::as_f32_mut(dinp),
        vmath::as_f32(inp),
        vmath::as_f32(dout),
    ) && vmath::gelu_erf_bwd(o, i, d, consts)
    {
        return;
    }
    for ((o, &x), &d) in dinp.iter_mut().zip(inp).zip(dout) {
        let cdf = half * (T::one() + (x * inv_sqrt2).erf_k());
        let pdf = inv_sqrt_2pi * (-half * x * x).exp_k();
        *o = d * (cdf + x * pdf);
    }
}

/// SwiGLU forward, row-wise: `out = silu(gate) * up` with
/// `silu(g) = g σ(g)`, `σ(g) = 1 / (1 + e^{-g})`.
///
/// out: (N, F), inp: (N, 2F) where each row is `[gate (F) | up (F)]`
/// (the fused gate/up projection's output).
pub fn swiglu_fwd<T: Real>(th: &Threads, out: &mut [T], inp: &[T], n: usize, f: usize) {
    if n == 0 || f == 0 {
        return;
    }
    let inp = &inp[..n * 2 * f];
    par_rows(th, &mut out[..n * f], f, |first, block| {
        let rows = inp[first * 2 * f..].chunks_exact(2 * f);
        for (y, row) in block.chunks_exact_mut(f).zip(rows) {
            let (gate, up) = row.split_at(f);
            for ((o, &g), &u) in y.iter_mut().zip(gate).zip(up) {
                let sig = T::one() / (T::one() + (-g).exp_k());
                *o = g * sig * u;
            }
        }
    });
}

/// SwiGLU backward, overwriting: with `s = σ(gate)`,
/// `dgate = dout * up * s (1 + gate (1 - s))`, `dup = dout * gate * s`.
///
/// dinp: (N, 2F) rows `[dgate (F) | dup (F)]`, dout: (N, F), inp: (N, 2F).
pub fn swiglu_bwd<T: Real>(
    th: &Threads,
    dinp: &mut [T],
    dout: &[T],
    inp: &[T],
    n: usize,
    f: usize,
) {
    if n == 0 || f == 0 {
        return;
    }
    let (dout, inp) = (&dout[..n * f], &inp[..n * 2 * f]);
    par_rows(th, &mut dinp[..n * 2 * f], 2 * f, |first, block| {
        let rows = inp[first * 2 * f..]
            .chunks_exact(2 * f)
            .zip(dout[first * f..].chunks_exact(f));
        for (dx, (row, dy)) in block.chunks_exact_mut(2 * f).zip(rows) {
            let (gate, up) = row.split_at(f);
            let (dgate, dup) = dx.split_at_mut(f);
            swiglu_bwd_row(dgate, dup, gate, up, dy);
        }
    });
}

/// One row of [`swiglu_bwd`]. A separate function so that the two output
/// halves arrive as distinct `&mut` arguments: LLVM then knows they do not
/// alias and vectorises the loop without runtime checks.
#[inline]
fn swiglu_bwd_row<T: Real>(dgate: &mut [T], dup: &mut [T], gate: &[T], up: &[T], dy: &[T]) {
    for ((((dg, du), &g), &u), &d) in dgate
        .iter_mut()
        .zip(dup.iter_mut())
        .zip(gate)
        .zip(up)
        .zip(dy)
    {
        let sig = T::one() / (T::one() + (-g).exp_k());
        let silu = g * sig;
        *du = d * silu;
        *dg = d * u * (sig + silu * (T::one() - sig));
    }
}

/// A feed-forward's nonlinearity forward, whichever the config names: `act = act(fch)` with
/// act (N, F) and fch (N, F), or (N, 2F) for SwiGLU. The one dispatch the block's MLP and the
/// experts share.
pub fn ffn_act_fwd<T: Real>(
    th: &Threads,
    act: &mut [T],
    fch: &[T],
    activation: crate::config::Activation,
    n: usize,
    f: usize,
) {
    use crate::config::Activation;
    match activation {
        Activation::Gelu => gelu_fwd(th, act, fch, GeluKind::Erf),
        Activation::GeluTanh => gelu_fwd(th, act, fch, GeluKind::Tanh),
        Activation::SwiGlu => swiglu_fwd(th, act, fch, n, f),
    }
}

/// Backward of [`ffn_act_fwd`], overwriting `dfch` from `dact` (N, F).
pub fn ffn_act_bwd<T: Real>(
    th: &Threads,
    dfch: &mut [T],
    dact: &[T],
    fch: &[T],
    activation: crate::config::Activation,
    n: usize,
    f: usize,
) {
    use crate::config::Activation;
    match activation {
        Activation::Gelu => gelu_bwd(th, dfch, fch, dact, GeluKind::Erf),
        Activation::GeluTanh => gelu_bwd(th, dfch, fch, dact, GeluKind::Tanh),
        Activation::SwiGlu => swiglu_bwd(th, dfch, dact, fch, n, f),
    }
}
