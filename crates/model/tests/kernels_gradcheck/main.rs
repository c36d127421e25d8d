//! Finite-difference gradient checks (f64 reference path) for the norm,
//! activation, RoPE, embedding, loss and residual kernels, plus thread
//! determinism and f32-vs-f64 agreement.
//!
//! Every gradient check uses the loss `L = Σ out ⊙ w` for random `w` (so
//! `dout = w`) and compares the analytic backward with central
//! differences for every input. Accumulating backwards start from random
//! gradient buffers (the check subtracts them), overwriting ones from junk.
mod activation;
mod loss_residual;
mod norm;
mod rope_embedding;
mod threads;

use model::Threads;
use model::gradcheck::{compare, dot, numeric_grad, rand_vec};
use model::kernels::activation::{GeluKind, gelu_bwd, gelu_fwd, swiglu_bwd, swiglu_fwd};
use model::kernels::embedding::{embed_bwd, embed_fwd};
use model::kernels::loss::{cross_entropy_bwd, cross_entropy_fwd, mean_loss};
use model::kernels::norm::{layernorm_bwd, layernorm_fwd, rmsnorm_bwd, rmsnorm_fwd};
use model::kernels::residual::{add_acc, add_fwd};
use model::kernels::rope::{RopeTable, rope_bwd, rope_fwd};

const EPS: f64 = 1e-5;
const TOL: f64 = 1e-6;
/// Central differences of an O(1..10) loss in f64 carry ~1e-10 absolute
/// round-off (1e-16 * |L| / 2ε), so gradient elements below this floor are
/// held to `TOL * FLOOR` = 1e-9 absolute instead of 1e-6 relative.
const FLOOR: f64 = 1e-3;
const THREADS: [usize; 2] = [1, 3];

fn pool(n: usize) -> Threads {
    Threads::new(n).unwrap()
}

fn check(what: &str, analytic: &[f64], numeric: &[f64]) {
    let e = compare(analytic, numeric, FLOOR);
    eprintln!(
        "{what}: max_rel {:.2e}, max_abs {:.2e}",
        e.max_rel, e.max_abs
    );
    e.assert_below(TOL, what);
}

/// `after - before`, elementwise (the part an accumulating backward added).
fn added(after: &[f64], before: &[f64]) -> Vec<f64> {
    after.iter().zip(before).map(|(a, b)| a - b).collect()
}

fn to_f32(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

/// f32 copy of `x` and `x` rounded to f32 values (so both paths see the
/// same inputs).
fn both(x: &[f64]) -> (Vec<f32>, Vec<f64>) {
    let f = to_f32(x);
    let d = f.iter().map(|&v| v as f64).collect();
    (f, d)
}

/// `|a - b| <= tol * max(|b|, 1)` for every element.
fn assert_close32(what: &str, a: &[f32], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let err = (x as f64 - y).abs() / y.abs().max(1.0);
        assert!(
            err <= tol,
            "{what}[{i}]: f32 {x} vs f64 {y} (rel {err:e} > {tol:e})"
        );
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}
