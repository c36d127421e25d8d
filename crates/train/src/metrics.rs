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

/// Throughput of a run of timed training steps, as `flotilla bench model` reports it (and
/// prints with `--json`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Throughput {
    /// Timed steps.
    pub steps: usize,
    /// Tokens per second over the mean step.
    pub tokens_per_s: f64,
    /// Mean step time, milliseconds.
    pub step_ms: f64,
    /// Median step time, milliseconds.
    pub median_ms: f64,
    /// Model GFLOP/s at `tokens_per_s` (flops per token from the model).
    pub gflops: f64,
    /// Model FLOPs utilisation against the peak given ([`mfu`]).
    pub mfu: f64,
}

impl Throughput {
    /// The figures of steps that took `seconds` each, of `tokens_per_step` tokens of
    /// `flops_per_token` each, against `peak_gflops`. No steps gives NaN rates.
    pub fn of_steps(
        seconds: &[f64],
        tokens_per_step: usize,
        flops_per_token: f64,
        peak_gflops: f64,
    ) -> Self {
        let step_s = match seconds.len() {
            0 => f64::NAN,
            n => seconds.iter().sum::<f64>() / n as f64,
        };
        let mut sorted = seconds.to_vec();
        sorted.sort_by(f64::total_cmp);
        let median = sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN);
        let tokens_per_s = tokens_per_step as f64 / step_s;
        Throughput {
            steps: seconds.len(),
            tokens_per_s,
            step_ms: step_s * 1e3,
            median_ms: median * 1e3,
            gflops: tokens_per_s * flops_per_token / 1e9,
            mfu: mfu(tokens_per_s, flops_per_token, peak_gflops),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Throughput;

    #[test]
    fn throughput_of_steps() {
        let t = Throughput::of_steps(&[0.3, 0.1, 0.2], 1000, 1e6, 10.0);
        assert_eq!(t.steps, 3);
        assert!((t.step_ms - 200.0).abs() < 1e-9 && (t.median_ms - 200.0).abs() < 1e-9);
        assert!((t.tokens_per_s - 5000.0).abs() < 1e-6);
        assert!((t.gflops - 5.0).abs() < 1e-9 && (t.mfu - 0.5).abs() < 1e-9);
        let none = Throughput::of_steps(&[], 1, 1.0, 1.0);
        assert!(none.median_ms.is_nan() && none.tokens_per_s.is_nan() && none.mfu.is_nan());
    }
}
