//! Loader metrics: per-step data stall (000 eq. 4.2) and batch latency percentiles, which also
//! size the automatic prefetch depth (000 eq. 4.3).

use std::collections::VecDeque;
use std::time::Duration;

/// Batch latencies kept for the percentiles.
const LATENCY_WINDOW: usize = 512;

/// What the loader measured so far, as seen by the consumer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoaderMetrics {
    /// Batches delivered.
    pub batches: u64,
    /// Tokens delivered (rows x (seq_len + 1)).
    pub tokens: u64,
    /// Time the last `next` call waited for its batch.
    pub last_stall: Duration,
    /// Time between the previous batch's delivery and the last one's: one step, T_step.
    pub last_step: Duration,
    /// Sum of all waits.
    pub total_stall: Duration,
    /// Sum of all step times (from the first delivery on).
    pub total_step: Duration,
    /// Current prefetch depth K (batches ready or being built, at most).
    pub depth: usize,
    /// Most batches ever ready or in flight at once (never above the depth at that time).
    pub max_outstanding: usize,
    /// Batches built by the consumer's own thread: a `next` call that finds its batch not
    /// ready builds the next unclaimed one instead of sleeping. Many means the workers are
    /// the bottleneck (more `workers` would help, if cores are free).
    pub consumer_built: u64,
    /// Median time to build one batch (read, verify on first use, assemble).
    pub p50_latency: Duration,
    /// 99th-percentile time to build one batch.
    pub p99_latency: Duration,
}

impl LoaderMetrics {
    /// Data stall % of the last step: (T_step - T_compute) / T_step x 100 (000 eq. 4.2), where
    /// T_step - T_compute is the time the step waited for data.
    pub fn last_stall_pct(&self) -> f64 {
        pct(self.last_stall, self.last_step)
    }

    /// Data stall % over the whole run so far (eq. 4.2 on the sums).
    pub fn stall_pct(&self) -> f64 {
        pct(self.total_stall, self.total_step)
    }
}

fn pct(part: Duration, whole: Duration) -> f64 {
    if whole.is_zero() {
        0.0
    } else {
        100.0 * part.as_secs_f64() / whole.as_secs_f64()
    }
}

/// A sliding window of batch build latencies.
#[derive(Debug, Default)]
pub(crate) struct LatencyWindow {
    recent: VecDeque<Duration>,
}

impl LatencyWindow {
    pub(crate) fn push(&mut self, d: Duration) {
        if self.recent.len() == LATENCY_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(d);
    }

    /// Several quantiles (nearest rank) from one sort of the window; zeros when empty.
    pub(crate) fn quantiles<const N: usize>(&self, qs: [f64; N]) -> [Duration; N] {
        if self.recent.is_empty() {
            return [Duration::ZERO; N];
        }
        let mut v: Vec<Duration> = self.recent.iter().copied().collect();
        v.sort_unstable();
        qs.map(|q| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1])
    }
}

/// Prefetch depth from eq. 4.3, Q = ceil(P99 batch latency / T_compute), plus one batch of
/// margin, at least one per worker (so every worker can be busy), clamped to `[2, max]`.
pub fn auto_depth(p99: Duration, compute: Duration, workers: usize, max: usize) -> usize {
    let q = if compute.is_zero() {
        max
    } else {
        (p99.as_secs_f64() / compute.as_secs_f64()).ceil() as usize + 1
    };
    q.max(workers).clamp(2, max.max(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_follows_eq_4_3() {
        let ms = Duration::from_millis;
        // P99 of 250 ms against 100 ms of compute: ceil(2.5) = 3, plus one.
        assert_eq!(auto_depth(ms(250), ms(100), 1, 64), 4);
        assert_eq!(auto_depth(ms(10), ms(100), 1, 64), 2);
        assert_eq!(auto_depth(ms(10), ms(100), 6, 64), 6);
        assert_eq!(auto_depth(ms(10_000), ms(1), 1, 16), 16);
        assert_eq!(auto_depth(ms(1), Duration::ZERO, 1, 16), 16);
    }

    #[test]
    fn quantiles_use_nearest_rank() {
        let mut w = LatencyWindow::default();
        for i in 1..=100 {
            w.push(Duration::from_millis(i));
        }
        let ms = Duration::from_millis;
        assert_eq!(w.quantiles([0.5, 0.99]), [ms(50), ms(99)]);
        assert_eq!(LatencyWindow::default().quantiles([0.99]), [Duration::ZERO]);
    }

    #[test]
    fn stall_pct_is_eq_4_2() {
        let m = LoaderMetrics {
            last_stall: Duration::from_millis(5),
            last_step: Duration::from_millis(100),
            ..Default::default()
        };
        assert!((m.last_stall_pct() - 5.0).abs() < 1e-9);
    }
}
