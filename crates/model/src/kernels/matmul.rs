//! Matrix multiply: the linear layer's forward and backward.
//!
//! Single-threaded GEMM is `Real::gemm`: for f32 our packed AVX-512 kernel
//! (`kernels::sgemm`, falling back to `matrixmultiply` without AVX-512F),
//! for f64 `matrixmultiply` (see docs/PERFORMANCE.md for the measured rates).
//! Threading is ours: the output is cut into one
//! contiguous block of rows (or columns) per thread, so every element's
//! sum is computed by one thread in a fixed order (bit-identical results
//! for a given thread count).
//!
//! Cost: 2*M*K*N flops forward; backward 4*M*K*N (input and weight grads).
use crate::real::{GemmInit, Real};
use crate::threads::{SharedMut, Threads, part_range};

/// A read-only matrix view: pointer, rows, cols, row stride, col stride.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a, T> {
    data: &'a [T],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a, T> MatRef<'a, T> {
    /// Row-major `rows x cols` view of `data`.
    pub fn new(data: &'a [T], rows: usize, cols: usize) -> Self {
        assert!(
            data.len() >= rows * cols,
            "MatRef {rows}x{cols} over {} elements",
            data.len()
        );
        Self {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose (no copy).
    pub fn t(self) -> Self {
        Self {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    fn ptr_at(&self, r: usize, c: usize) -> *const T {
        // SAFETY: callers stay within rows x cols, which fits in data.
        unsafe { self.data.as_ptr().add(r * self.rs + c * self.cs) }
    }
}

/// `C(m x n) = alpha * A(m x k) * B(k x n) + beta * C`, C row-major, split
/// over the threads along the longer of m and n.
pub fn gemm<T: Real>(
    th: &Threads,
    alpha: T,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    beta: T,
    c: &mut [T],
) {
    gemm_into(th, alpha, a, b, beta, None, c);
}

/// `C(m x n) = alpha * A(m x k) * B(k x n) + bias` (bias: n, added to every row), split as
/// [`gemm`]; bit-identical to filling C with the bias and calling [`gemm`] with `beta = 1`.
pub fn gemm_bias<T: Real>(
    th: &Threads,
    alpha: T,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    bias: &[T],
    c: &mut [T],
) {
    assert!(
        bias.len() >= b.cols,
        "gemm bias of {} for {} columns",
        bias.len(),
        b.cols
    );
    gemm_into(th, alpha, a, b, T::zero(), Some(bias), c);
}

/// `C = alpha * A * B + beta * C`, or `+ bias` when one is given (`beta` then unused).
fn gemm_into<T: Real>(
    th: &Threads,
    alpha: T,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    beta: T,
    bias: Option<&[T]>,
    c: &mut [T],
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "gemm inner dimensions");
    assert!(
        c.len() >= m * n,
        "gemm output {}x{} over {} elements",
        m,
        n,
        c.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    // Blocks smaller than this are not worth a thread.
    const MIN_BLOCK: usize = 32;
    let along_rows = m >= n;
    let len = if along_rows { m } else { n };
    let parts = th.n().min(len.div_ceil(MIN_BLOCK)).max(1);
    let cs = SharedMut::new(c);
    th.run(parts, |i| {
        let r = part_range(len, parts, i);
        let (rows, cols, ap, bp, cp) = if along_rows {
            // SAFETY: row block r of C lies inside c; blocks are disjoint.
            (r.len(), n, a.ptr_at(r.start, 0), b.ptr_at(0, 0), unsafe {
                cs.ptr().add(r.start * n)
            })
        } else {
            // SAFETY: column block r of C lies inside c; blocks are disjoint.
            (m, r.len(), a.ptr_at(0, 0), b.ptr_at(0, r.start), unsafe {
                cs.ptr().add(r.start)
            })
        };
        // SAFETY: views are in bounds (asserted above) and C does not alias
        // A or B (it is a distinct &mut slice).
        unsafe {
            let (rsa, csa, rsb, csb) = (a.rs as isize, a.cs as isize, b.rs as isize, b.cs as isize);
            // A bias row starts at this part's first column.
            let init = match bias {
                Some(bias) if along_rows => GemmInit::Bias(bias.as_ptr()),
                Some(bias) => GemmInit::Bias(bias[r.start..].as_ptr()),
                None => GemmInit::Beta(beta),
            };
            T::gemm(
                rows, k, cols, alpha, ap, rsa, csa, bp, rsb, csb, init, cp, n as isize, 1,
            )
        }
    });
}

/// Linear forward: `out = inp · weightᵀ + bias`.
///
/// out: (N, OC), inp: (N, C), weight: (OC, C) (PyTorch nn.Linear layout),
/// bias: (OC).
pub fn matmul_fwd<T: Real>(
    th: &Threads,
    out: &mut [T],
    inp: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    let out = &mut out[..n * oc];
    let (inp, weight_t) = (MatRef::new(inp, n, c), MatRef::new(weight, oc, c).t());
    match bias {
        Some(b) => gemm_bias(th, T::one(), inp, weight_t, &b[..oc], out),
        None => gemm(th, T::one(), inp, weight_t, T::zero(), out),
    }
}

/// Linear backward, accumulating (`+=`) into every gradient:
/// `dinp += dout · weight`, `dweight += doutᵀ · inp`, `dbias += Σ_rows dout`.
///
/// dinp: (N, C) or None when the input needs no gradient, dweight: (OC, C),
/// dbias: (OC), dout: (N, OC), inp: (N, C), weight: (OC, C).
#[allow(clippy::too_many_arguments)]
pub fn matmul_bwd<T: Real>(
    th: &Threads,
    dinp: Option<&mut [T]>,
    dweight: &mut [T],
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: &[T],
    weight: &[T],
    n: usize,
    c: usize,
    oc: usize,
) {
    if let Some(dinp) = dinp {
        matmul_bwd_input(th, dinp, T::one(), dout, weight, n, c, oc);
    }
    matmul_bwd_weight(th, dweight, dbias, dout, inp, n, c, oc);
}

/// Input gradient of a linear: `dinp = beta * dinp + dout · weight`
/// (beta 0 overwrites, 1 accumulates).
///
/// dinp: (N, C), dout: (N, OC), weight: (OC, C).
#[allow(clippy::too_many_arguments)]
pub fn matmul_bwd_input<T: Real>(
    th: &Threads,
    dinp: &mut [T],
    beta: T,
    dout: &[T],
    weight: &[T],
    n: usize,
    c: usize,
    oc: usize,
) {
    gemm(
        th,
        T::one(),
        MatRef::new(dout, n, oc),
        MatRef::new(weight, oc, c),
        beta,
        &mut dinp[..n * c],
    );
}

/// Parameter gradients of a linear, accumulating:
/// `dweight += doutᵀ · inp`, `dbias += Σ_rows dout`.
///
/// dweight: (OC, C), dbias: (OC), dout: (N, OC), inp: (N, C).
#[allow(clippy::too_many_arguments)]
pub fn matmul_bwd_weight<T: Real>(
    th: &Threads,
    dweight: &mut [T],
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: &[T],
    n: usize,
    c: usize,
    oc: usize,
) {
    let dout_m = MatRef::new(dout, n, oc);
    gemm(
        th,
        T::one(),
        dout_m.t(),
        MatRef::new(inp, n, c),
        T::one(),
        &mut dweight[..oc * c],
    );
    if let Some(db) = dbias {
        col_sum_acc(th, &mut db[..oc], dout, n, oc);
    }
}

/// `acc[j] += Σ_i m[i, j]` for a row-major (rows x cols) matrix, split over
/// column ranges so each sum has one fixed order.
pub fn col_sum_acc<T: Real>(th: &Threads, acc: &mut [T], m: &[T], rows: usize, cols: usize) {
    let shared = SharedMut::new(&mut acc[..cols]);
    th.ranges(cols, 64, |r| {
        // SAFETY: column ranges of different parts are disjoint.
        let block = unsafe { shared.slice(r.clone()) };
        for i in 0..rows {
            let row = &m[i * cols + r.start..i * cols + r.end];
            for (a, &x) in block.iter_mut().zip(row) {
                *a += x;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    #[test]
    fn gemm_matches_naive_any_split() {
        for th in [1, 2, 3] {
            let th = Threads::new(th).unwrap();
            for &(m, k, n) in &[(1, 1, 1), (5, 7, 3), (70, 9, 33), (3, 40, 100)] {
                let a: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
                let b: Vec<f64> = (0..k * n).map(|i| (i as f64 * 0.11).cos()).collect();
                let mut c = vec![0.0; m * n];
                gemm(
                    &th,
                    1.0,
                    MatRef::new(&a, m, k),
                    MatRef::new(&b, k, n),
                    0.0,
                    &mut c,
                );
                let want = naive(&a, &b, m, k, n);
                for (x, y) in c.iter().zip(&want) {
                    assert!((x - y).abs() < 1e-12);
                }
            }
        }
    }

    #[test]
    fn bias_product_matches_fill_then_accumulate_any_split() {
        // Row splits (m >= n) and column splits (n > m, each part offsets the bias).
        for th in [1, 2, 3] {
            let th = Threads::new(th).unwrap();
            for &(m, k, n) in &[(1, 3, 1), (70, 9, 33), (5, 40, 200), (64, 600, 97)] {
                let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
                let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
                let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 3.0).collect();
                let (am, bm) = (MatRef::new(&a, m, k), MatRef::new(&b, n, k).t());
                let mut want: Vec<f32> = (0..m * n).map(|i| bias[i % n]).collect();
                gemm(&th, 1.0, am, bm, 1.0, &mut want);
                let mut got = vec![f32::NAN; m * n];
                gemm_bias(&th, 1.0, am, bm, &bias, &mut got);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{m}x{k}x{n}");
            }
        }
    }

    #[test]
    fn col_sum_is_exact() {
        let th = Threads::new(2).unwrap();
        let m: Vec<f64> = (0..5 * 37).map(|i| i as f64).collect();
        let mut acc = vec![1.0; 37];
        col_sum_acc(&th, &mut acc, &m, 5, 37);
        let th3 = Threads::new(3).unwrap();
        let m2: Vec<f64> = (0..3 * 300).map(|i| i as f64).collect();
        let mut acc2 = vec![0.0; 300];
        col_sum_acc(&th3, &mut acc2, &m2, 3, 300);
        for (j, a) in acc2.iter().enumerate() {
            assert_eq!(*a, (0..3).map(|i| (i * 300 + j) as f64).sum::<f64>());
        }
        for (j, a) in acc.iter().enumerate() {
            let want: f64 = 1.0 + (0..5).map(|i| (i * 37 + j) as f64).sum::<f64>();
            assert_eq!(*a, want);
        }
    }
}
