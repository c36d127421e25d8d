//! Times f32 GEMM through `model::kernels::matmul::gemm` (our threaded
//! wrapper over `Real::gemm`, i.e. `kernels::sgemm`) and plain
//! `matrixmultiply::sgemm` under the same row/column split, printing
//! GFLOP/s (median and best of `reps` timed calls after a warm-up).
//!
//! ```text
//! CARGO_TARGET_DIR=/work/target-sgemm cargo run --release -p flotilla-model --example gemm_bench -- [threads] [big|train|all|N,N..] [reps]
//! ```
//! Shapes: `big` is 1024^3 and 2048^3 (A, B row-major), `N,N..` those squares; `train` the linear
//! layers at 2048 tokens: forward `inp · Wᵀ` (B transposed), backward input
//! `dout · W`, backward weight `doutᵀ · inp` (A transposed). Compare with
//! torch at the same moment (`/root/.cache/flotilla-peers/venv/bin/python`):
//!
//! ```text
//! import sys, time, statistics, torch
//! torch.set_num_threads(int(sys.argv[1]))
//! for s in [1024, 2048]:
//!     a, b = torch.randn(s, s), torch.randn(s, s); ts = []
//!     for r in range(17):
//!         t0 = time.perf_counter(); torch.mm(a, b); ts.append(time.perf_counter() - t0)
//!     print(s, 2 * s**3 / statistics.median(ts[2:]) / 1e9)
//! ```
use model::Threads;
use model::kernels::matmul::{MatRef, gemm};
use model::threads::{SharedMut, part_range};
use std::time::Instant;

#[derive(Clone, Copy)]
enum Kind {
    /// A (m x k) and B (k x n) row-major.
    Nn,
    /// B given as (n x k) row-major, used transposed (linear forward).
    Nt,
    /// A given as (k x m) row-major, used transposed (weight gradient).
    Tn,
}

fn median_best(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[v.len() - 1])
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let set = args.get(2).map(String::as_str).unwrap_or("big");
    let reps: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(15);
    let th = Threads::new(threads).expect("threads");
    let mut shapes: Vec<(&str, Kind, usize, usize, usize)> = Vec::new();
    if set == "big" || set == "all" {
        shapes.push(("1024^3", Kind::Nn, 1024, 1024, 1024));
        shapes.push(("2048^3", Kind::Nn, 2048, 2048, 2048));
    }
    // A list of sizes ("2040,2048") runs those square products (A, B row-major).
    for s in set.split(',').filter_map(|s| s.parse::<usize>().ok()) {
        shapes.push(("square", Kind::Nn, s, s, s));
    }
    if set == "train" || set == "all" {
        for (d, h) in [(256, 1024), (384, 1536)] {
            for n in [3 * d, d, h] {
                shapes.push(("fwd", Kind::Nt, 2048, d, n));
            }
            shapes.push(("fwd", Kind::Nt, 2048, h, d));
            shapes.push(("fwd", Kind::Nt, 2048, d, 8192));
            shapes.push(("bwd_in", Kind::Nn, 2048, 3 * d, d));
            shapes.push(("bwd_in", Kind::Nn, 2048, d, h));
            shapes.push(("bwd_in", Kind::Nn, 2048, 8192, d));
            shapes.push(("bwd_w", Kind::Tn, 3 * d, 2048, d));
            shapes.push(("bwd_w", Kind::Tn, h, 2048, d));
            shapes.push(("bwd_w", Kind::Tn, 8192, 2048, d));
        }
    }
    println!("threads={threads} reps={reps}");
    for (name, kind, m, k, n) in shapes {
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.1)
            .collect();
        let mut c = vec![0.0f32; m * n];
        let (av, bv, strides) = match kind {
            Kind::Nn => (
                MatRef::new(&a, m, k),
                MatRef::new(&b, k, n),
                [k as isize, 1, n as isize, 1],
            ),
            Kind::Nt => (
                MatRef::new(&a, m, k),
                MatRef::new(&b, n, k).t(),
                [k as isize, 1, 1, k as isize],
            ),
            Kind::Tn => (
                MatRef::new(&a, k, m).t(),
                MatRef::new(&b, k, n),
                [1, m as isize, n as isize, 1],
            ),
        };
        let flops = 2.0 * (m * k * n) as f64;
        let mut ours = Vec::new();
        let mut mm = Vec::new();
        // Interleave ours and matrixmultiply so both see the same noise.
        for r in 0..reps + 2 {
            let t = Instant::now();
            gemm(&th, 1.0, av, bv, 0.0, &mut c);
            let t1 = t.elapsed().as_secs_f64();
            let t = Instant::now();
            mm_gemm(&th, a.as_ptr(), b.as_ptr(), (m, k, n, strides), &mut c);
            let t2 = t.elapsed().as_secs_f64();
            if r >= 2 {
                ours.push(flops / t1 / 1e9);
                mm.push(flops / t2 / 1e9);
            }
        }
        let ((om, ob), (mm_m, mm_b)) = (median_best(ours), median_best(mm));
        println!(
            "{name:7} m={m:5} k={k:5} n={n:5}  ours {om:6.1} (best {ob:6.1})  matrixmultiply {mm_m:6.1} (best {mm_b:6.1})  ratio {:.2}",
            om / mm_m
        );
    }
}

/// matrixmultiply under the same split as `matmul::gemm` (longer of m, n).
fn mm_gemm(
    th: &Threads,
    a: *const f32,
    b: *const f32,
    dims: (usize, usize, usize, [isize; 4]),
    c: &mut [f32],
) {
    let (m, k, n, [rsa, csa, rsb, csb]) = dims;
    let along_rows = m >= n;
    let len = if along_rows { m } else { n };
    let parts = th.n().min(len.div_ceil(32)).max(1);
    let cs = SharedMut::new(c);
    let (ap, bp) = (a as usize, b as usize);
    th.run(parts, |i| {
        let r = part_range(len, parts, i);
        let (ap, bp) = (ap as *const f32, bp as *const f32);
        // SAFETY: blocks of C are disjoint and all views are in bounds.
        unsafe {
            let (rows, cols, a0, b0, c0) = if along_rows {
                (
                    r.len(),
                    n,
                    ap.offset(r.start as isize * rsa),
                    bp,
                    cs.ptr().add(r.start * n),
                )
            } else {
                (
                    m,
                    r.len(),
                    ap,
                    bp.offset(r.start as isize * csb),
                    cs.ptr().add(r.start),
                )
            };
            matrixmultiply::sgemm(
                rows, k, cols, 1.0, a0, rsa, csa, b0, rsb, csb, 0.0, c0, n as isize, 1,
            );
        }
    });
}
