//! GELU and SwiGLU.
use super::*;

#[test]
fn gelu_gradcheck() {
    let len = 37;
    for &nt in &THREADS {
        let th = pool(nt);
        for kind in [GeluKind::Erf, GeluKind::Tanh] {
            let inp = rand_vec(21, len, 3.0);
            let w = rand_vec(22, len, 1.0);
            let fwd = |x: &[f64]| {
                let mut out = vec![0.0; len];
                gelu_fwd(&th, &mut out, x, kind);
                out
            };
            // Forward against the closed forms.
            for (&x, &y) in inp.iter().zip(&fwd(&inp)) {
                let want = match kind {
                    GeluKind::Erf => 0.5 * x * (1.0 + model::real::erf_f64(x / 2f64.sqrt())),
                    GeluKind::Tanh => {
                        0.5 * x
                            * (1.0
                                + ((2.0 / std::f64::consts::PI).sqrt()
                                    * (x + 0.044715 * x * x * x))
                                    .tanh())
                    }
                };
                assert!(
                    (y - want).abs() < 1e-14,
                    "{kind:?} gelu({x}) = {y}, want {want}"
                );
            }
            let mut dinp = vec![1e3; len]; // overwritten
            gelu_bwd(&th, &mut dinp, &inp, &w, kind);
            let num = numeric_grad(&inp, EPS, |x| dot(&fwd(x), &w));
            check(&format!("gelu {kind:?} dinp"), &dinp, &num);
        }
    }
}

#[test]
fn swiglu_gradcheck() {
    let (n, f) = (5, 7);
    for &nt in &THREADS {
        let th = pool(nt);
        let inp = rand_vec(31, n * 2 * f, 3.0);
        let w = rand_vec(32, n * f, 1.0);
        let fwd = |x: &[f64]| {
            let mut out = vec![0.0; n * f];
            swiglu_fwd(&th, &mut out, x, n, f);
            out
        };
        let out = fwd(&inp);
        for i in 0..n {
            for j in 0..f {
                let (g, u) = (inp[i * 2 * f + j], inp[i * 2 * f + f + j]);
                let want = g / (1.0 + (-g).exp()) * u;
                assert!((out[i * f + j] - want).abs() < 1e-14);
            }
        }
        let mut dinp = vec![1e3; n * 2 * f]; // overwritten
        swiglu_bwd(&th, &mut dinp, &w, &inp, n, f);
        check(
            "swiglu dinp",
            &dinp,
            &numeric_grad(&inp, EPS, |x| dot(&fwd(x), &w)),
        );
    }
}

#[test]
fn swiglu_saturates_without_nan() {
    let th = pool(1);
    let inp = [-1e4, 1e4, 2.0, 3.0];
    let (mut out, mut d) = (vec![0.0f32; 2], vec![0.0f32; 4]);
    let inp32 = to_f32(&inp);
    swiglu_fwd(&th, &mut out, &inp32, 1, 2);
    swiglu_bwd(&th, &mut d, &[1.0, 1.0], &inp32, 1, 2);
    assert!(out.iter().chain(&d).all(|v| v.is_finite()), "{out:?} {d:?}");
    assert_eq!(out[0], 0.0);
    assert!((out[1] - 3e4).abs() < 1.0);
    let (mut out, mut d) = (vec![0.0f64; 2], vec![0.0f64; 4]);
    swiglu_fwd(&th, &mut out, &inp, 1, 2);
    swiglu_bwd(&th, &mut d, &[1.0, 1.0], &inp, 1, 2);
    assert!(out.iter().chain(&d).all(|v| v.is_finite()), "{out:?} {d:?}");
}
