//! Thread-count determinism and f32-vs-f64 agreement of the kernels.
use super::loss_residual::ce_fwd;
use super::norm::{ln_fwd, rms_fwd};
use super::*;

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
