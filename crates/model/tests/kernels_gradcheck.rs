//! Finite-difference gradient checks (f64 reference path) for the norm,
//! activation, RoPE, embedding, loss and residual kernels, plus thread
//! determinism and f32-vs-f64 agreement.
//!
//! Every gradient check uses the loss `L = Σ out ⊙ w` for random `w` (so
//! `dout = w`) and compares the analytic backward with central
//! differences for every input. Accumulating backwards start from random
//! gradient buffers (the check subtracts them), overwriting ones from junk.
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

// ---------------------------------------------------------------- norm

fn ln_fwd(
    th: &Threads,
    inp: &[f64],
    w: &[f64],
    b: Option<&[f64]>,
    n: usize,
    c: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    layernorm_fwd(th, &mut out, &mut mean, &mut rstd, inp, w, b, n, c, 1e-5);
    (out, mean, rstd)
}

#[test]
fn layernorm_gradcheck() {
    let (n, c) = (6, 10);
    for &nt in &THREADS {
        let th = pool(nt);
        for with_bias in [true, false] {
            let inp = rand_vec(1, n * c, 2.0);
            let weight: Vec<f64> = rand_vec(2, c, 1.0).iter().map(|v| v + 1.0).collect();
            let bias = rand_vec(3, c, 1.0);
            let bias_opt = with_bias.then_some(&bias[..]);
            let w = rand_vec(4, n * c, 1.0);
            let (out, mean, rstd) = ln_fwd(&th, &inp, &weight, bias_opt, n, c);
            // Mean and rstd against a direct computation.
            for (i, row) in inp.chunks(c).enumerate() {
                let m = row.iter().sum::<f64>() / c as f64;
                let var = row.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / c as f64;
                assert!((mean[i] - m).abs() < 1e-14);
                assert!((rstd[i] - 1.0 / (var + 1e-5).sqrt()).abs() < 1e-12);
            }
            let _ = out;
            let (b0, bw0, bb0) = (
                rand_vec(5, n * c, 1.0),
                rand_vec(6, c, 1.0),
                rand_vec(7, c, 1.0),
            );
            let (mut dinp, mut dw, mut db) = (b0.clone(), bw0.clone(), bb0.clone());
            layernorm_bwd(
                &th,
                &mut dinp,
                &mut dw,
                Some(&mut db),
                &w,
                &inp,
                &weight,
                &mean,
                &rstd,
                n,
                c,
            );
            let loss = |i: &[f64], wt: &[f64], b: &[f64]| {
                dot(&ln_fwd(&th, i, wt, with_bias.then_some(b), n, c).0, &w)
            };
            check(
                "layernorm dinp",
                &added(&dinp, &b0),
                &numeric_grad(&inp, EPS, |x| loss(x, &weight, &bias)),
            );
            check(
                "layernorm dweight",
                &added(&dw, &bw0),
                &numeric_grad(&weight, EPS, |x| loss(&inp, x, &bias)),
            );
            // dbias = Σ dout whether or not the forward had a bias.
            let want_db: Vec<f64> = (0..c).map(|j| (0..n).map(|i| w[i * c + j]).sum()).collect();
            check("layernorm dbias", &added(&db, &bb0), &want_db);
            if with_bias {
                check(
                    "layernorm dbias (numeric)",
                    &added(&db, &bb0),
                    &numeric_grad(&bias, EPS, |x| loss(&inp, &weight, x)),
                );
            }
            // Without dbias the other gradients are the same.
            let (mut dinp2, mut dw2) = (b0.clone(), bw0.clone());
            layernorm_bwd(
                &th, &mut dinp2, &mut dw2, None, &w, &inp, &weight, &mean, &rstd, n, c,
            );
            assert_eq!(dinp2, dinp);
            assert_eq!(dw2, dw);
        }
    }
}

fn rms_fwd(th: &Threads, inp: &[f64], w: &[f64], n: usize, c: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_fwd(th, &mut out, &mut rstd, inp, w, n, c, 1e-6);
    (out, rstd)
}

#[test]
fn rmsnorm_gradcheck() {
    let (n, c) = (6, 10);
    for &nt in &THREADS {
        let th = pool(nt);
        let inp = rand_vec(11, n * c, 2.0);
        let weight: Vec<f64> = rand_vec(12, c, 1.0).iter().map(|v| v + 1.0).collect();
        let w = rand_vec(13, n * c, 1.0);
        let (out, rstd) = rms_fwd(&th, &inp, &weight, n, c);
        for (i, row) in inp.chunks(c).enumerate() {
            let ms = row.iter().map(|x| x * x).sum::<f64>() / c as f64;
            let r = 1.0 / (ms + 1e-6).sqrt();
            assert!((rstd[i] - r).abs() < 1e-12);
            for j in 0..c {
                assert!((out[i * c + j] - row[j] * r * weight[j]).abs() < 1e-12);
            }
        }
        let (b0, bw0) = (rand_vec(14, n * c, 1.0), rand_vec(15, c, 1.0));
        let (mut dinp, mut dw) = (b0.clone(), bw0.clone());
        rmsnorm_bwd(&th, &mut dinp, &mut dw, &w, &inp, &weight, &rstd, n, c);
        let loss = |i: &[f64], wt: &[f64]| dot(&rms_fwd(&th, i, wt, n, c).0, &w);
        check(
            "rmsnorm dinp",
            &added(&dinp, &b0),
            &numeric_grad(&inp, EPS, |x| loss(x, &weight)),
        );
        check(
            "rmsnorm dweight",
            &added(&dw, &bw0),
            &numeric_grad(&weight, EPS, |x| loss(&inp, x)),
        );
    }
}

// ---------------------------------------------------------- activation

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

// ---------------------------------------------------------------- rope

#[test]
fn rope_gradcheck() {
    let (b, t, h, k, d) = (2, 3, 2, 1, 6);
    let row = (h + 2 * k) * d;
    let n = b * t;
    let table = RopeTable::<f64>::new(5, d, 100.0);
    for &nt in &THREADS {
        let th = pool(nt);
        let qkv = rand_vec(41, n * row, 1.0);
        let w = rand_vec(42, n * row, 1.0);
        let fwd = |x: &[f64]| {
            let mut y = x.to_vec();
            rope_fwd(&th, &mut y, &table, b, t, h, k, d);
            y
        };
        let y = fwd(&qkv);
        // Reference: HF rotate_half on every q/k head, v untouched.
        for r in 0..n {
            let pos = (r % t) as f64;
            for head in 0..h + 2 * k {
                for i in 0..d {
                    let idx = r * row + head * d + i;
                    let want = if head < h + k {
                        let j = i % (d / 2);
                        let ang = pos * 100f64.powf(-2.0 * j as f64 / d as f64);
                        let rot = if i < d / 2 {
                            -qkv[idx + d / 2]
                        } else {
                            qkv[idx - d / 2]
                        };
                        qkv[idx] * ang.cos() + rot * ang.sin()
                    } else {
                        qkv[idx]
                    };
                    assert!(
                        (y[idx] - want).abs() < 1e-14,
                        "rope row {r} head {head} i {i}"
                    );
                }
            }
        }
        // Position 0 is the identity.
        assert_eq!(&y[..row], &qkv[..row]);
        let mut dq = w.clone();
        rope_bwd(&th, &mut dq, &table, b, t, h, k, d);
        check(
            "rope dqkv",
            &dq,
            &numeric_grad(&qkv, EPS, |x| dot(&fwd(x), &w)),
        );
        // The backward inverts the forward (a rotation).
        let mut back = y.clone();
        rope_bwd(&th, &mut back, &table, b, t, h, k, d);
        for (a, c) in back.iter().zip(&qkv) {
            assert!((a - c).abs() < 1e-14);
        }
    }
}

// ----------------------------------------------------------- embedding

#[test]
fn embedding_gradcheck() {
    let (n, t, c, v, max_t) = (6, 3, 10, 5, 4);
    let tokens = [1u32, 3, 1, 0, 4, 1];
    for &nt in &THREADS {
        let th = pool(nt);
        for with_wpe in [true, false] {
            let wte = rand_vec(51, v * c, 1.0);
            let wpe = rand_vec(52, max_t * c, 1.0);
            let w = rand_vec(53, n * c, 1.0);
            let fwd = |e: &[f64], p: &[f64]| {
                let mut out = vec![0.0; n * c];
                embed_fwd(&th, &mut out, &tokens, e, with_wpe.then_some(p), n, t, c);
                out
            };
            let out = fwd(&wte, &wpe);
            for i in 0..n {
                for j in 0..c {
                    let p = if with_wpe { wpe[(i % t) * c + j] } else { 0.0 };
                    assert_eq!(out[i * c + j], wte[tokens[i] as usize * c + j] + p);
                }
            }
            let (b0, bp0) = (rand_vec(54, v * c, 1.0), rand_vec(55, max_t * c, 1.0));
            let (mut dwte, mut dwpe) = (b0.clone(), bp0.clone());
            embed_bwd(
                &th,
                &mut dwte,
                with_wpe.then_some(&mut dwpe[..]),
                &w,
                &tokens,
                n,
                t,
                c,
            );
            check(
                "embed dwte",
                &added(&dwte, &b0),
                &numeric_grad(&wte, EPS, |x| dot(&fwd(x, &wpe), &w)),
            );
            if with_wpe {
                check(
                    "embed dwpe",
                    &added(&dwpe, &bp0),
                    &numeric_grad(&wpe, EPS, |x| dot(&fwd(&wte, x), &w)),
                );
            } else {
                assert_eq!(dwpe, bp0);
            }
        }
    }
}

// ---------------------------------------------------------------- loss

fn ce_fwd(
    th: &Threads,
    logits: &[f64],
    targets: &[u32],
    n: usize,
    v: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (mut losses, mut lse) = (vec![0.0; n], vec![0.0; n]);
    cross_entropy_fwd(th, &mut losses, &mut lse, logits, targets, n, v);
    (losses, lse)
}

#[test]
fn cross_entropy_gradcheck() {
    let (n, v) = (5, 11);
    let targets = [3u32, 0, 10, 3, 7];
    let scale = 0.37;
    for &nt in &THREADS {
        let th = pool(nt);
        let logits = rand_vec(61, n * v, 3.0);
        let (losses, lse) = ce_fwd(&th, &logits, &targets, n, v);
        for i in 0..n {
            let row = &logits[i * v..(i + 1) * v];
            let want_lse = row.iter().map(|x| x.exp()).sum::<f64>().ln();
            assert!((lse[i] - want_lse).abs() < 1e-14);
            assert!((losses[i] - (want_lse - row[targets[i] as usize])).abs() < 1e-14);
        }
        let mut dl = logits.clone();
        cross_entropy_bwd(&th, &mut dl, &lse, &targets, n, v, scale);
        let num = numeric_grad(&logits, EPS, |x| {
            ce_fwd(&th, x, &targets, n, v).0.iter().sum::<f64>() * scale
        });
        check("cross-entropy dlogits", &dl, &num);
        // Each row of the gradient sums to zero.
        for row in dl.chunks(v) {
            assert!(row.iter().sum::<f64>().abs() < 1e-15);
        }
    }
}

#[test]
fn cross_entropy_uniform_is_ln_v() {
    let th = pool(3);
    for v in [1usize, 2, 17, 1000] {
        let n = 4;
        let targets: Vec<u32> = (0..n as u32).map(|i| i % v as u32).collect();
        let logits = vec![0.25f32; n * v];
        let (mut losses, mut lse) = (vec![0.0f32; n], vec![0.0f32; n]);
        cross_entropy_fwd(&th, &mut losses, &mut lse, &logits, &targets, n, v);
        let want = (v as f64).ln();
        assert!(
            (mean_loss(&losses) - want).abs() < 1e-6,
            "V={v}: {} vs ln V {want}",
            mean_loss(&losses)
        );
        let (l64, _) = ce_fwd(&th, &vec![-2.5; n * v], &targets, n, v);
        assert!((mean_loss(&l64) - want).abs() < 1e-13);
    }
}

#[test]
fn cross_entropy_is_stable_for_large_logits() {
    let th = pool(1);
    let (n, v) = (2, 4);
    let logits = [
        1000.0f32, 999.0, -1000.0, 998.0, -3000.0, -3001.0, -3000.5, -2999.0,
    ];
    let targets = [1u32, 3];
    let (mut losses, mut lse) = (vec![0.0f32; n], vec![0.0f32; n]);
    cross_entropy_fwd(&th, &mut losses, &mut lse, &logits, &targets, n, v);
    let l64: Vec<f64> = logits.iter().map(|&x| x as f64).collect();
    let (want, _) = ce_fwd(&th, &l64, &targets, n, v);
    assert_close32("large-logit losses", &losses, &want, 1e-6);
    let mut dl = logits.to_vec();
    cross_entropy_bwd(&th, &mut dl, &lse, &targets, n, v, 1.0);
    assert!(dl.iter().all(|x| x.is_finite()));
    assert!(mean_loss::<f32>(&[]) == 0.0);
    assert_eq!(mean_loss(&[1.0f64, 2.0, 6.0]), 3.0);
}

// ------------------------------------------------------------ residual

#[test]
fn residual_gradcheck() {
    let len = 23;
    for &nt in &THREADS {
        let th = pool(nt);
        let (a, b, w) = (
            rand_vec(71, len, 1.0),
            rand_vec(72, len, 1.0),
            rand_vec(73, len, 1.0),
        );
        let fwd = |a: &[f64], b: &[f64]| {
            let mut out = vec![0.0; len];
            add_fwd(&th, &mut out, a, b);
            out
        };
        // d/da and d/db of dot(a + b, w) are w (what the backward passes on).
        check(
            "add_fwd da",
            &w,
            &numeric_grad(&a, EPS, |x| dot(&fwd(x, &b), &w)),
        );
        check(
            "add_fwd db",
            &w,
            &numeric_grad(&b, EPS, |x| dot(&fwd(&a, x), &w)),
        );
        let acc_fn = |acc: &[f64], x: &[f64]| {
            let mut y = acc.to_vec();
            add_acc(&th, &mut y, x);
            y
        };
        check(
            "add_acc dacc",
            &w,
            &numeric_grad(&a, EPS, |x| dot(&acc_fn(x, &b), &w)),
        );
        check(
            "add_acc dx",
            &w,
            &numeric_grad(&b, EPS, |x| dot(&acc_fn(&a, x), &w)),
        );
        let y = acc_fn(&a, &b);
        assert!(y.iter().zip(fwd(&a, &b)).all(|(p, q)| *p == q));
    }
}

// ------------------------------------------- threads and f32 agreement

/// Large enough (64 x 1024) that 3 threads really split the work.
const BIG_N: usize = 64;
const BIG_C: usize = 1024;

#[test]
fn row_wise_kernels_are_identical_across_thread_counts() {
    let (n, c) = (BIG_N, BIG_C);
    let run = |nt: usize| -> Vec<Vec<u32>> {
        let th = pool(nt);
        let inp = to_f32(&rand_vec(81, n * c, 2.0));
        let wt = to_f32(&rand_vec(82, c, 1.0));
        let bias = to_f32(&rand_vec(83, c, 1.0));
        let dout = to_f32(&rand_vec(84, n * c, 1.0));
        let mut res = Vec::new();
        // layernorm / rmsnorm forward and dinp
        let (mut out, mut mean, mut rstd) = (vec![0.0f32; n * c], vec![0.0f32; n], vec![0.0f32; n]);
        layernorm_fwd(
            &th,
            &mut out,
            &mut mean,
            &mut rstd,
            &inp,
            &wt,
            Some(&bias),
            n,
            c,
            1e-5,
        );
        let (mut dinp, mut dw, mut db) = (vec![0.5f32; n * c], vec![0.0f32; c], vec![0.0f32; c]);
        layernorm_bwd(
            &th,
            &mut dinp,
            &mut dw,
            Some(&mut db),
            &dout,
            &inp,
            &wt,
            &mean,
            &rstd,
            n,
            c,
        );
        res.extend([bits(&out), bits(&mean), bits(&rstd), bits(&dinp)]);
        let mut rstd2 = vec![0.0f32; n];
        rmsnorm_fwd(&th, &mut out, &mut rstd2, &inp, &wt, n, c, 1e-6);
        let mut dinp = vec![0.5f32; n * c];
        rmsnorm_bwd(&th, &mut dinp, &mut dw, &dout, &inp, &wt, &rstd2, n, c);
        res.extend([bits(&out), bits(&rstd2), bits(&dinp)]);
        // gelu
        for kind in [GeluKind::Erf, GeluKind::Tanh] {
            gelu_fwd(&th, &mut out, &inp, kind);
            gelu_bwd(&th, &mut dinp, &inp, &dout, kind);
            res.extend([bits(&out), bits(&dinp)]);
        }
        // swiglu over (N, 2F) with F = C/2
        let f = c / 2;
        let mut y = vec![0.0f32; n * f];
        swiglu_fwd(&th, &mut y, &inp, n, f);
        swiglu_bwd(&th, &mut dinp, &dout[..n * f], &inp, n, f);
        res.extend([bits(&y), bits(&dinp)]);
        // rope: H=8, K=4 heads of D=64 -> row (8+8)*64 = 1024
        let table = RopeTable::<f32>::new(32, 64, 10000.0);
        let mut q = inp.clone();
        rope_fwd(&th, &mut q, &table, 4, 16, 8, 4, 64);
        res.push(bits(&q));
        rope_bwd(&th, &mut q, &table, 4, 16, 8, 4, 64);
        res.push(bits(&q));
        // embedding (V = 50)
        let v = 50;
        let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % v as u32).collect();
        let wte = to_f32(&rand_vec(85, v * c, 1.0));
        let wpe = to_f32(&rand_vec(86, 16 * c, 1.0));
        embed_fwd(&th, &mut out, &tokens, &wte, Some(&wpe), n, 16, c);
        let (mut dwte, mut dwpe) = (vec![0.25f32; v * c], vec![0.25f32; 16 * c]);
        embed_bwd(&th, &mut dwte, Some(&mut dwpe), &dout, &tokens, n, 16, c);
        res.extend([bits(&out), bits(&dwte), bits(&dwpe)]);
        // cross-entropy with V = C
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 37) % c as u32).collect();
        let (mut losses, mut lse) = (vec![0.0f32; n], vec![0.0f32; n]);
        cross_entropy_fwd(&th, &mut losses, &mut lse, &inp, &targets, n, c);
        let mut dl = inp.clone();
        cross_entropy_bwd(&th, &mut dl, &lse, &targets, n, c, 1.0 / n as f32);
        res.extend([bits(&losses), bits(&lse), bits(&dl)]);
        // residual
        add_fwd(&th, &mut out, &inp, &dout);
        let mut acc = inp.clone();
        add_acc(&th, &mut acc, &dout);
        res.extend([bits(&out), bits(&acc)]);
        res
    };
    let one = run(1);
    let three = run(3);
    for (i, (a, b)) in one.iter().zip(&three).enumerate() {
        assert!(a == b, "result #{i} differs between 1 and 3 threads");
    }
}

#[test]
fn norm_param_grads_are_deterministic() {
    let (n, c) = (BIG_N, BIG_C);
    let inp = to_f32(&rand_vec(91, n * c, 2.0));
    let wt = to_f32(&rand_vec(92, c, 1.0));
    let dout = to_f32(&rand_vec(93, n * c, 1.0));
    let run = |nt: usize| -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let th = pool(nt);
        let (mut out, mut mean, mut rstd) = (vec![0.0f32; n * c], vec![0.0f32; n], vec![0.0f32; n]);
        layernorm_fwd(
            &th, &mut out, &mut mean, &mut rstd, &inp, &wt, None, n, c, 1e-5,
        );
        let (mut dinp, mut dw, mut db) = (vec![0.0f32; n * c], vec![0.0f32; c], vec![0.0f32; c]);
        layernorm_bwd(
            &th,
            &mut dinp,
            &mut dw,
            Some(&mut db),
            &dout,
            &inp,
            &wt,
            &mean,
            &rstd,
            n,
            c,
        );
        rmsnorm_fwd(&th, &mut out, &mut rstd, &inp, &wt, n, c, 1e-6);
        let mut dw2 = vec![0.0f32; c];
        rmsnorm_bwd(&th, &mut dinp, &mut dw2, &dout, &inp, &wt, &rstd, n, c);
        (dw, db, dw2)
    };
    for nt in THREADS {
        let (a, b) = (run(nt), run(nt));
        assert!(
            bits(&a.0) == bits(&b.0) && bits(&a.1) == bits(&b.1) && bits(&a.2) == bits(&b.2),
            "{nt} threads"
        );
    }
    // Across thread counts only the summation order differs.
    let (a, b) = (run(1), run(3));
    for (x, y) in [(&a.0, &b.0), (&a.1, &b.1), (&a.2, &b.2)] {
        for (p, q) in x.iter().zip(y) {
            assert!((p - q).abs() <= 1e-5 * p.abs().max(1.0), "{p} vs {q}");
        }
    }
}

#[test]
fn f32_forward_matches_f64() {
    let th = pool(3);
    let (n, c) = (7, 333);
    let (inp32, inp) = both(&rand_vec(101, n * c, 3.0));
    let (wt32, wt) = both(&rand_vec(102, c, 1.5));
    let (b32, b) = both(&rand_vec(103, c, 1.0));
    const TOL32: f64 = 1e-6;

    let (out64, mean64, rstd64) = ln_fwd(&th, &inp, &wt, Some(&b), n, c);
    let (mut out, mut mean, mut rstd) = (vec![0.0f32; n * c], vec![0.0f32; n], vec![0.0f32; n]);
    layernorm_fwd(
        &th,
        &mut out,
        &mut mean,
        &mut rstd,
        &inp32,
        &wt32,
        Some(&b32),
        n,
        c,
        1e-5,
    );
    assert_close32("layernorm out", &out, &out64, TOL32);
    assert_close32("layernorm mean", &mean, &mean64, TOL32);
    assert_close32("layernorm rstd", &rstd, &rstd64, TOL32);

    let (out64, rstd64) = rms_fwd(&th, &inp, &wt, n, c);
    rmsnorm_fwd(&th, &mut out, &mut rstd, &inp32, &wt32, n, c, 1e-6);
    assert_close32("rmsnorm out", &out, &out64, TOL32);
    assert_close32("rmsnorm rstd", &rstd, &rstd64, TOL32);

    for kind in [GeluKind::Erf, GeluKind::Tanh] {
        let mut o64 = vec![0.0; n * c];
        gelu_fwd(&th, &mut o64, &inp, kind);
        gelu_fwd(&th, &mut out, &inp32, kind);
        assert_close32("gelu", &out, &o64, TOL32);
        let (d32, d) = both(&rand_vec(104, n * c, 1.0));
        let mut g64 = vec![0.0; n * c];
        gelu_bwd(&th, &mut g64, &inp, &d, kind);
        let mut g32 = vec![0.0f32; n * c];
        gelu_bwd(&th, &mut g32, &inp32, &d32, kind);
        assert_close32("gelu bwd", &g32, &g64, TOL32);
    }

    // SwiGLU over rows of 2F = 222 (the first 10 * 222 inputs).
    let f = 111;
    let rows = n * c / (2 * f);
    let mut s64 = vec![0.0; rows * f];
    let mut s32 = vec![0.0f32; rows * f];
    swiglu_fwd(&th, &mut s64, &inp, rows, f);
    swiglu_fwd(&th, &mut s32, &inp32, rows, f);
    assert_close32("swiglu", &s32, &s64, TOL32);

    // RoPE with B = 3, T = 7, H = K = 1, D = 76.
    let (t, d) = (7, 76);
    let rows_q = 3;
    let (q32, q) = both(&rand_vec(105, rows_q * t * 3 * d, 1.0));
    let (mut y32, mut y) = (q32.clone(), q.clone());
    rope_fwd(
        &th,
        &mut y32,
        &RopeTable::<f32>::new(t, d, 10000.0),
        rows_q,
        t,
        1,
        1,
        d,
    );
    rope_fwd(
        &th,
        &mut y,
        &RopeTable::<f64>::new(t, d, 10000.0),
        rows_q,
        t,
        1,
        1,
        d,
    );
    assert_close32("rope", &y32, &y, TOL32);

    let v = c;
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 101) % v as u32).collect();
    let (l64, lse64) = ce_fwd(&th, &inp, &targets, n, v);
    let (mut l32, mut lse32) = (vec![0.0f32; n], vec![0.0f32; n]);
    cross_entropy_fwd(&th, &mut l32, &mut lse32, &inp32, &targets, n, v);
    assert_close32("cross-entropy loss", &l32, &l64, TOL32);
    assert_close32("cross-entropy lse", &lse32, &lse64, TOL32);
    let mut d64 = inp.clone();
    cross_entropy_bwd(&th, &mut d64, &lse64, &targets, n, v, 1.0);
    let mut d32 = inp32.clone();
    cross_entropy_bwd(&th, &mut d32, &lse32, &targets, n, v, 1.0);
    assert_close32("cross-entropy dlogits", &d32, &d64, TOL32);
}
