//! Throughput and model-FLOPs utilisation.
//!
//! MFU = tokens/s x flops-per-token / peak, where flops-per-token is
//! `6 N + 12 L T C` ([`model::config::ModelConfig::flops_per_token`]) and
//! the peak is the measured rate of this machine's GEMM kernel on a
//! 2048x2048x2048 product with the same thread count (the denominator the
//! peer benchmark uses for PyTorch).
use model::Threads;
use model::kernels::matmul::{MatRef, gemm};
use std::time::Instant;

/// Median GFLOP/s of an `n x n x n` f32 GEMM on `th` over `reps` runs.
pub fn gemm_gflops(th: &Threads, n: usize, reps: usize) -> f64 {
    let a: Vec<f32> = (0..n * n)
        .map(|i| ((i % 97) as f32 - 48.0) * 0.01)
        .collect();
    let b: Vec<f32> = (0..n * n)
        .map(|i| ((i % 89) as f32 - 44.0) * 0.01)
        .collect();
    let mut c = vec![0f32; n * n];
    let run = |c: &mut [f32]| {
        gemm(
            th,
            1.0,
            MatRef::new(&a, n, n),
            MatRef::new(&b, n, n),
            0.0,
            c,
        )
    };
    run(&mut c);
    let mut times: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            run(&mut c);
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    2.0 * (n as f64).powi(3) / times[times.len() / 2] / 1e9
}

/// Model FLOPs utilisation of `tokens_per_s` against `peak_gflops`.
pub fn mfu(tokens_per_s: f64, flops_per_token: f64, peak_gflops: f64) -> f64 {
    tokens_per_s * flops_per_token / (peak_gflops * 1e9)
}
