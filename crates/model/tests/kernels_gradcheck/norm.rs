//! LayerNorm and RMSNorm.
use super::*;

/// LayerNorm forward in f64: (out, mean, rstd).
pub(crate) fn ln_fwd(
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

/// RMSNorm forward in f64: (out, rstd).
pub(crate) fn rms_fwd(
    th: &Threads,
    inp: &[f64],
    w: &[f64],
    n: usize,
    c: usize,
) -> (Vec<f64>, Vec<f64>) {
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
