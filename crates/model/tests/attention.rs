//! Causal GQA attention: forward against a naive full-softmax reference,
//! log-sum-exp, finite-difference gradients (f64), f32/f64 agreement,
//! tile-size independence and determinism across thread counts.
use model::Threads;
use model::gradcheck::{compare, dot, numeric_grad, rand_vec};
use model::kernels::attention::{
    Tiles, attention_bwd, attention_bwd_tiled, attention_fwd, attention_fwd_tiled,
};

#[derive(Clone, Copy, Debug)]
struct Shape {
    b: usize,
    t: usize,
    h: usize,
    k: usize,
    d: usize,
}

impl Shape {
    const fn new(b: usize, t: usize, h: usize, k: usize, d: usize) -> Self {
        Self { b, t, h, k, d }
    }
    fn n(&self) -> usize {
        self.b * self.t
    }
    fn w(&self) -> usize {
        (self.h + 2 * self.k) * self.d
    }
    fn qkv_len(&self) -> usize {
        self.n() * self.w()
    }
    fn out_len(&self) -> usize {
        self.n() * self.h * self.d
    }
    fn lse_len(&self) -> usize {
        self.b * self.h * self.t
    }
}

/// Full-softmax reference: (out, lse).
fn naive(qkv: &[f64], s: Shape) -> (Vec<f64>, Vec<f64>) {
    let Shape { b, t, h, k, d } = s;
    let w = s.w();
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0; s.out_len()];
    let mut lse = vec![0.0; s.lse_len()];
    for bi in 0..b {
        for j in 0..h {
            let g = j / (h / k);
            for i in 0..t {
                let q = &qkv[(bi * t + i) * w + j * d..][..d];
                let sc: Vec<f64> = (0..=i)
                    .map(|c| {
                        let kr = &qkv[(bi * t + c) * w + (h + g) * d..][..d];
                        scale * q.iter().zip(kr).map(|(x, y)| x * y).sum::<f64>()
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                lse[(bi * h + j) * t + i] = mx + sum.ln();
                let o = &mut out[(bi * t + i) * h * d + j * d..][..d];
                for (c, p) in e.iter().enumerate() {
                    let v = &qkv[(bi * t + c) * w + (h + k + g) * d..][..d];
                    for (x, y) in o.iter_mut().zip(v) {
                        *x += p / sum * y;
                    }
                }
            }
        }
    }
    (out, lse)
}

fn fwd(th: &Threads, qkv: &[f64], s: Shape, tiles: Tiles) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![f64::NAN; s.out_len()];
    let mut lse = vec![f64::NAN; s.lse_len()];
    attention_fwd_tiled(th, &mut out, &mut lse, qkv, s.b, s.t, s.h, s.k, s.d, tiles);
    (out, lse)
}

fn bwd(th: &Threads, dout: &[f64], qkv: &[f64], s: Shape, tiles: Tiles) -> Vec<f64> {
    let (out, lse) = fwd(th, qkv, s, tiles);
    let mut dqkv = vec![f64::NAN; s.qkv_len()];
    attention_bwd_tiled(
        th, &mut dqkv, dout, qkv, &out, &lse, s.b, s.t, s.h, s.k, s.d, tiles,
    );
    dqkv
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

const SMALL: Tiles = Tiles {
    q: 2,
    k: 3,
    diag: 1,
};

#[test]
fn forward_and_lse_match_naive() {
    let th = Threads::new(2).unwrap();
    let shapes = [
        Shape::new(2, 5, 4, 2, 3),
        Shape::new(1, 70, 2, 1, 3),
        Shape::new(3, 33, 6, 3, 8),
        Shape::new(1, 1, 1, 1, 1),
        Shape::new(2, 130, 4, 4, 16),
    ];
    for (si, s) in shapes.into_iter().enumerate() {
        // Large values make the scores spread, so the running max really moves.
        let qkv = rand_vec(10 + si as u64, s.qkv_len(), 3.0);
        let (want_out, want_lse) = naive(&qkv, s);
        for tiles in [
            Tiles::FWD,
            SMALL,
            Tiles {
                q: 32,
                k: 32,
                diag: 5,
            },
            Tiles {
                q: 16,
                k: 32,
                diag: 16,
            },
            Tiles {
                q: 32,
                k: 16,
                diag: 64,
            },
        ] {
            let (out, lse) = fwd(&th, &qkv, s, tiles);
            let eo = max_abs_diff(&out, &want_out);
            let el = max_abs_diff(&lse, &want_lse);
            assert!(eo < 1e-12, "{s:?} {tiles:?}: out differs by {eo}");
            assert!(el < 1e-12, "{s:?} {tiles:?}: lse differs by {el}");
        }
    }
}

#[test]
fn lse_first_query_is_its_own_score() {
    // Query 0 sees only key 0: lse = scale * q0·k0 exactly.
    let th = Threads::single();
    let s = Shape::new(1, 4, 2, 1, 5);
    let qkv = rand_vec(3, s.qkv_len(), 1.0);
    let (out, lse) = fwd(&th, &qkv, s, Tiles::FWD);
    let (w, d) = (s.w(), s.d);
    for j in 0..s.h {
        let q = &qkv[j * d..][..d];
        let k0 = &qkv[s.h * d..][..d];
        let want = dot(q, k0) / (d as f64).sqrt();
        assert!((lse[j * s.t] - want).abs() < 1e-14);
        // ... and its output is v0.
        let v0 = &qkv[(s.h + s.k) * d..][..d];
        assert!(max_abs_diff(&out[j * d..][..d], v0) < 1e-15);
    }
    assert_eq!(w, (2 + 2) * 5);
}

fn gradcheck(s: Shape, tiles: Tiles, seed: u64) {
    let th = Threads::new(2).unwrap();
    let qkv = rand_vec(seed, s.qkv_len(), 1.5);
    let wts = rand_vec(seed + 1, s.out_len(), 1.0);
    let analytic = bwd(&th, &wts, &qkv, s, tiles);
    let loss = |x: &[f64]| {
        let (out, _) = fwd(&th, x, s, tiles);
        dot(&out, &wts)
    };
    let numeric = numeric_grad(&qkv, 1e-5, loss);
    // Check q, k and v blocks separately so a failure names the part.
    let (hd, kd, w) = (s.h * s.d, s.k * s.d, s.w());
    for (name, lo, hi) in [("dq", 0, hd), ("dk", hd, hd + kd), ("dv", hd + kd, w)] {
        let pick =
            |g: &[f64]| -> Vec<f64> { g.chunks(w).flat_map(|r| r[lo..hi].to_vec()).collect() };
        let e = compare(&pick(&analytic), &pick(&numeric), 1e-3);
        e.assert_below(1e-6, &format!("{name} {s:?} {tiles:?}"));
    }
}

#[test]
fn gradients_small_gqa() {
    let s = Shape::new(2, 5, 4, 2, 3);
    gradcheck(s, Tiles::FWD, 1);
    gradcheck(s, SMALL, 2);
    gradcheck(
        Shape::new(1, 6, 3, 3, 2),
        Tiles {
            q: 4,
            k: 4,
            diag: 1,
        },
        3,
    );
    gradcheck(
        Shape::new(2, 7, 4, 1, 3),
        Tiles {
            q: 3,
            k: 2,
            diag: 2,
        },
        4,
    );
}

#[test]
fn gradients_several_tiles() {
    // T larger than the tiles: several query and key tiles, the online
    // softmax rescales, tiles straddling the diagonal, unequal tile sizes.
    let s = Shape::new(1, 70, 2, 1, 3);
    gradcheck(
        s,
        Tiles {
            q: 32,
            k: 32,
            diag: 8,
        },
        5,
    );
    gradcheck(
        s,
        Tiles {
            q: 16,
            k: 32,
            diag: 5,
        },
        6,
    );
    gradcheck(
        s,
        Tiles {
            q: 32,
            k: 16,
            diag: 32,
        },
        7,
    );
}

#[test]
fn backward_independent_of_tiles() {
    let th = Threads::new(2).unwrap();
    let s = Shape::new(2, 100, 4, 2, 8);
    let qkv = rand_vec(8, s.qkv_len(), 2.0);
    let dout = rand_vec(9, s.out_len(), 1.0);
    let base = bwd(&th, &dout, &qkv, s, Tiles::BWD);
    let scale = base.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    for tiles in [
        SMALL,
        Tiles {
            q: 32,
            k: 32,
            diag: 3,
        },
        Tiles {
            q: 16,
            k: 64,
            diag: 16,
        },
        Tiles {
            q: 64,
            k: 16,
            diag: 7,
        },
        Tiles {
            q: 64,
            k: 256,
            diag: 64,
        },
    ] {
        let g = bwd(&th, &dout, &qkv, s, tiles);
        let e = max_abs_diff(&g, &base);
        assert!(e < 1e-12 * scale.max(1.0), "{tiles:?}: {e}");
    }
}

#[test]
fn gqa_equals_mha_with_repeated_kv() {
    // K kv heads shared by H/K query heads == H kv heads, each a copy; the
    // shared head's gradient is the sum over its copies.
    let th = Threads::new(2).unwrap();
    let g = Shape::new(2, 40, 6, 2, 4);
    let m = Shape::new(2, 40, 6, 6, 4);
    let d = g.d;
    let qkv_g = rand_vec(11, g.qkv_len(), 2.0);
    let mut qkv_m = vec![0.0; m.qkv_len()];
    for (rg, rm) in qkv_g.chunks(g.w()).zip(qkv_m.chunks_mut(m.w())) {
        rm[..g.h * d].copy_from_slice(&rg[..g.h * d]);
        for j in 0..g.h {
            let kv = j / (g.h / g.k);
            rm[(m.h + j) * d..][..d].copy_from_slice(&rg[(g.h + kv) * d..][..d]);
            rm[(m.h + m.k + j) * d..][..d].copy_from_slice(&rg[(g.h + g.k + kv) * d..][..d]);
        }
    }
    let dout = rand_vec(12, g.out_len(), 1.0);
    let (og, lg) = fwd(&th, &qkv_g, g, Tiles::FWD);
    let (om, lm) = fwd(&th, &qkv_m, m, Tiles::FWD);
    assert!(max_abs_diff(&og, &om) < 1e-13);
    assert!(max_abs_diff(&lg, &lm) < 1e-13);
    let dg = bwd(&th, &dout, &qkv_g, g, Tiles::BWD);
    let dm = bwd(&th, &dout, &qkv_m, m, Tiles::BWD);
    for (rg, rm) in dg.chunks(g.w()).zip(dm.chunks(m.w())) {
        assert!(max_abs_diff(&rg[..g.h * d], &rm[..g.h * d]) < 1e-12);
        for kv in 0..g.k {
            for part in 0..2 {
                let (og_, om_) = (g.h + part * g.k, m.h + part * m.k);
                let want: Vec<f64> = (0..d)
                    .map(|c| {
                        (0..g.h / g.k)
                            .map(|r| rm[(om_ + kv * (g.h / g.k) + r) * d + c])
                            .sum()
                    })
                    .collect();
                assert!(max_abs_diff(&rg[(og_ + kv) * d..][..d], &want) < 1e-12);
            }
        }
    }
}

#[test]
fn f32_agrees_with_f64() {
    let th = Threads::new(2).unwrap();
    let s = Shape::new(2, 150, 4, 2, 32);
    let qkv = rand_vec(13, s.qkv_len(), 2.0);
    let dout = rand_vec(14, s.out_len(), 1.0);
    let (o64, l64) = fwd(&th, &qkv, s, Tiles::FWD);
    let mut d64 = vec![0.0; s.qkv_len()];
    attention_bwd(
        &th, &mut d64, &dout, &qkv, &o64, &l64, s.b, s.t, s.h, s.k, s.d,
    );

    let f = |v: &[f64]| -> Vec<f32> { v.iter().map(|&x| x as f32).collect() };
    let (qkv32, dout32) = (f(&qkv), f(&dout));
    let mut o32 = vec![0f32; s.out_len()];
    let mut l32 = vec![0f32; s.lse_len()];
    attention_fwd(&th, &mut o32, &mut l32, &qkv32, s.b, s.t, s.h, s.k, s.d);
    let mut d32 = vec![f32::NAN; s.qkv_len()];
    attention_bwd(
        &th, &mut d32, &dout32, &qkv32, &o32, &l32, s.b, s.t, s.h, s.k, s.d,
    );

    let rel = |a: &[f32], b: &[f64]| {
        let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        a.iter()
            .zip(b)
            .map(|(&x, y)| (x as f64 - y).abs())
            .fold(0.0, f64::max)
            / scale
    };
    assert!(rel(&o32, &o64) < 1e-5, "out {}", rel(&o32, &o64));
    assert!(rel(&l32, &l64) < 1e-5, "lse {}", rel(&l32, &l64));
    assert!(rel(&d32, &d64) < 1e-4, "dqkv {}", rel(&d32, &d64));
}

#[test]
fn deterministic_across_runs_and_thread_counts() {
    let s = Shape::new(3, 90, 4, 2, 16);
    let qkv: Vec<f32> = rand_vec(15, s.qkv_len(), 2.0)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let dout: Vec<f32> = rand_vec(16, s.out_len(), 1.0)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let run = |threads: usize| {
        let th = Threads::new(threads).unwrap();
        let mut out = vec![0f32; s.out_len()];
        let mut lse = vec![0f32; s.lse_len()];
        attention_fwd(&th, &mut out, &mut lse, &qkv, s.b, s.t, s.h, s.k, s.d);
        let mut dqkv = vec![f32::NAN; s.qkv_len()];
        attention_bwd(
            &th, &mut dqkv, &dout, &qkv, &out, &lse, s.b, s.t, s.h, s.k, s.d,
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        (bits(&out), bits(&lse), bits(&dqkv))
    };
    let a = run(2);
    assert!(a == run(2), "two runs with 2 threads differ");
    // Every element is computed by one task in a fixed order, so the
    // thread count does not matter either.
    assert!(a == run(1), "1 vs 2 threads differ");
    assert!(a == run(3), "3 vs 2 threads differ");
}

#[test]
fn backward_overwrites() {
    let th = Threads::new(2).unwrap();
    let s = Shape::new(2, 9, 2, 1, 4);
    let qkv = rand_vec(17, s.qkv_len(), 1.0);
    let dout = rand_vec(18, s.out_len(), 1.0);
    let (out, lse) = fwd(&th, &qkv, s, Tiles::FWD);
    let mut a = vec![123.0; s.qkv_len()];
    let mut b = vec![-7.0; s.qkv_len()];
    attention_bwd(
        &th, &mut a, &dout, &qkv, &out, &lse, s.b, s.t, s.h, s.k, s.d,
    );
    attention_bwd(
        &th, &mut b, &dout, &qkv, &out, &lse, s.b, s.t, s.h, s.k, s.d,
    );
    assert_eq!(a, b);
}
