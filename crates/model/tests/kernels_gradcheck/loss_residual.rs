//! The fused softmax cross-entropy and the residual add.
use super::*;

/// Cross-entropy forward in f64: (per-row losses, log-sum-exp).
pub(crate) fn ce_fwd(
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
