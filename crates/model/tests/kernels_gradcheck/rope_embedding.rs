//! Rotary position embeddings and the token embedding.
use super::*;

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
