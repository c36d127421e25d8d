//! `kernels::sgemm` against a naive f64 reference: shapes across the
//! micro-tile and cache-block edges, transposed and general strides,
//! alpha/beta handling (beta 0 must ignore NaN in C) and determinism.
use model::kernels::sgemm::{sgemm, sgemm_init};
use model::real::GemmInit;

/// Deterministic values in [-1, 1).
fn fill(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Layout of an operand: row-major, transposed (column-major) or a
/// general stride pair with padding.
#[derive(Clone, Copy, Debug)]
enum Lay {
    Row,
    Col,
    Padded,
}

/// (buffer length, row stride, column stride) of an r x c matrix.
fn strides(lay: Lay, r: usize, c: usize) -> (usize, isize, isize) {
    match lay {
        Lay::Row => (r * c, c as isize, 1),
        Lay::Col => (r * c, 1, r as isize),
        Lay::Padded => ((r.max(1)) * (2 * c + 3), (2 * c + 3) as isize, 2),
    }
}

#[allow(clippy::too_many_arguments)]
fn check(m: usize, k: usize, n: usize, la: Lay, lb: Lay, csc_col: bool, alpha: f32, beta: f32) {
    let (alen, rsa, csa) = strides(la, m, k);
    let (blen, rsb, csb) = strides(lb, k, n);
    let a = fill(alen, (m * 31 + k) as u64);
    let b = fill(blen, (k * 17 + n) as u64);
    let c0 = fill(m * n, (m + n) as u64);
    let (rsc, csc) = if csc_col {
        (1, m as isize)
    } else {
        (n as isize, 1)
    };
    let mut c = if beta == 0.0 {
        vec![f32::NAN; m * n]
    } else {
        c0.clone()
    };
    // SAFETY: all views are in bounds of their buffers; C is distinct.
    unsafe {
        sgemm(
            m,
            k,
            n,
            alpha,
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            beta,
            c.as_mut_ptr(),
            rsc,
            csc,
        )
    };
    for i in 0..m {
        for j in 0..n {
            let mut dot = 0.0f64;
            let mut mag = 0.0f64;
            for p in 0..k {
                let x = a[(i as isize * rsa + p as isize * csa) as usize] as f64;
                let y = b[(p as isize * rsb + j as isize * csb) as usize] as f64;
                dot += x * y;
                mag += (x * y).abs();
            }
            let ci = (i as isize * rsc + j as isize * csc) as usize;
            let want = alpha as f64 * dot
                + if beta == 0.0 {
                    0.0
                } else {
                    beta as f64 * c0[ci] as f64
                };
            let scale = alpha.abs() as f64 * mag + beta.abs() as f64 * c0[ci].abs() as f64 + 1e-30;
            let got = c[ci] as f64;
            assert!(
                (got - want).abs() <= 1e-5 * scale.max(1.0),
                "{m}x{k}x{n} {la:?} {lb:?} csc_col={csc_col} alpha={alpha} beta={beta}: C[{i},{j}] = {got}, want {want}"
            );
        }
    }
}

#[test]
fn matches_reference_on_edge_shapes() {
    let shapes = [
        (1, 1, 1),
        (13, 7, 33),
        (100, 300, 17),
        (5, 1, 40),
        (12, 4, 32),
        (14, 3, 64),
        (15, 9, 31),
        (29, 65, 47),
        (33, 513, 35),
        (2, 1100, 3),
        (70, 9, 100),
    ];
    for &(m, k, n) in &shapes {
        for (la, lb) in [
            (Lay::Row, Lay::Row),
            (Lay::Col, Lay::Row),
            (Lay::Row, Lay::Col),
            (Lay::Col, Lay::Col),
        ] {
            check(m, k, n, la, lb, false, 1.0, 0.0);
        }
        check(m, k, n, Lay::Padded, Lay::Padded, false, 0.5, 1.0);
        check(m, k, n, Lay::Row, Lay::Row, true, -1.5, 0.25);
        check(m, k, n, Lay::Row, Lay::Col, false, 2.0, 1.0);
    }
}

/// `sgemm_init` with a bias against filling C with the bias and `sgemm` with beta 1: the same bits,
/// row-major and column-major C, across tile edges and several k-slices.
fn check_bias(m: usize, k: usize, n: usize, la: Lay, lb: Lay, csc_col: bool, alpha: f32) {
    let (alen, rsa, csa) = strides(la, m, k);
    let (blen, rsb, csb) = strides(lb, k, n);
    let a = fill(alen, (m * 7 + k) as u64);
    let b = fill(blen, (k * 3 + n) as u64);
    let bias = fill(n, n as u64 + 99);
    let (rsc, csc) = if csc_col {
        (1, m as isize)
    } else {
        (n as isize, 1)
    };
    let mut want = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            want[(i as isize * rsc + j as isize * csc) as usize] = bias[j];
        }
    }
    let mut got = vec![f32::NAN; m * n];
    // SAFETY: all views are in bounds of their buffers; C is distinct.
    unsafe {
        let (ap, bp) = (a.as_ptr(), b.as_ptr());
        sgemm(
            m,
            k,
            n,
            alpha,
            ap,
            rsa,
            csa,
            bp,
            rsb,
            csb,
            1.0,
            want.as_mut_ptr(),
            rsc,
            csc,
        );
        let (bi, cp) = (bias.as_ptr(), got.as_mut_ptr());
        sgemm_init(
            m,
            k,
            n,
            alpha,
            ap,
            rsa,
            csa,
            bp,
            rsb,
            csb,
            GemmInit::Bias(bi),
            cp,
            rsc,
            csc,
        );
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&got),
        bits(&want),
        "{m}x{k}x{n} {la:?} {lb:?} csc_col={csc_col} alpha={alpha}"
    );
}

#[test]
fn bias_epilogue_matches_fill_then_accumulate() {
    for &(m, k, n) in &[
        (1, 1, 1),
        (13, 7, 33),
        (29, 65, 47),
        (33, 1100, 35),
        (70, 0, 9),
    ] {
        check_bias(m, k, n, Lay::Row, Lay::Col, false, 1.0);
        check_bias(m, k, n, Lay::Col, Lay::Row, false, 1.0);
        check_bias(m, k, n, Lay::Padded, Lay::Padded, true, 0.5);
    }
    // Several n blocks (the bias offset per block and per tile) and several k-slices.
    check_bias(40, 530, 1100, Lay::Row, Lay::Col, false, 1.0);
}

#[test]
fn cache_block_boundaries() {
    // Crosses the m, n and k block caps (several blocks each way), with
    // both operands row-major and both transposed.
    check(4300, 600, 40, Lay::Row, Lay::Row, false, 1.0, 1.0);
    check(300, 600, 1100, Lay::Row, Lay::Row, false, 1.0, 1.0);
    check(4300, 530, 40, Lay::Col, Lay::Col, false, 1.0, 0.0);
    check(90, 530, 1100, Lay::Row, Lay::Col, false, 1.0, 0.0);
    check(300, 2049, 70, Lay::Col, Lay::Row, false, 1.0, 0.0);
}

#[test]
fn degenerate_sizes() {
    // m or n zero: nothing touched.
    let mut c = [7.0f32; 4];
    // SAFETY: no element is accessed for an empty output.
    unsafe {
        sgemm(
            0,
            3,
            4,
            1.0,
            [0.0f32; 0].as_ptr(),
            3,
            1,
            [0.0f32; 12].as_ptr(),
            4,
            1,
            0.0,
            c.as_mut_ptr(),
            4,
            1,
        )
    };
    assert_eq!(c, [7.0; 4]);
    // k zero: C = beta * C, and beta 0 clears NaN.
    let mut c = [2.0f32, 4.0, 6.0, 8.0];
    // SAFETY: A and B are never read when k == 0; C is 2 x 2.
    unsafe {
        sgemm(
            2,
            0,
            2,
            1.0,
            [0.0f32; 0].as_ptr(),
            0,
            1,
            [0.0f32; 0].as_ptr(),
            2,
            1,
            0.5,
            c.as_mut_ptr(),
            2,
            1,
        )
    };
    assert_eq!(c, [1.0, 2.0, 3.0, 4.0]);
    let mut c = [f32::NAN; 4];
    // SAFETY: as above.
    unsafe {
        sgemm(
            2,
            0,
            2,
            1.0,
            [0.0f32; 0].as_ptr(),
            0,
            1,
            [0.0f32; 0].as_ptr(),
            2,
            1,
            0.0,
            c.as_mut_ptr(),
            2,
            1,
        )
    };
    assert_eq!(c, [0.0; 4]);
    check(3, 1, 1, Lay::Row, Lay::Row, false, 1.0, 0.0);
    check(1, 1, 50, Lay::Col, Lay::Col, false, 1.0, 1.0);
}

#[test]
fn deterministic_bits() {
    let (m, k, n) = (77, 700, 90);
    let a = fill(m * k, 1);
    let b = fill(k * n, 2);
    let run = || {
        let mut c = vec![f32::NAN; m * n];
        // SAFETY: row-major views in bounds.
        unsafe {
            sgemm(
                m,
                k,
                n,
                1.0,
                a.as_ptr(),
                k as isize,
                1,
                b.as_ptr(),
                n as isize,
                1,
                0.0,
                c.as_mut_ptr(),
                n as isize,
                1,
            )
        };
        c.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    };
    assert_eq!(run(), run());
}
