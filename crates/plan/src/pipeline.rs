//! Pipeline schedules: bubble fraction and micro-batches in flight (000 §2.14, F41; Narayanan et
//! al. 2021 for interleaving; Korthikanti et al. 2022 §4.2.3 for in-flight memory).

use serde::{Deserialize, Serialize};

/// A pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// All forwards, then all backwards: all m micro-batches in flight.
    Gpipe,
    /// One-forward-one-backward: at most p micro-batches in flight on the first stage.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Interleaved 1F1B with v virtual stages per device: bubble ÷ v, memory × (1 + (p-1)/(pv)).
    Interleaved,
    /// Zero-bubble (ZB-H2-style, Qi et al. 2024; 000 L2409 "≈0"): no bubble, 1F1B memory.
    ZeroBubble,
}

/// Fraction of the step the pipeline idles: (p-1)/(v·m + p-1); v = 1 gives the seed's
/// (p-1)/(m+p-1) (000 F41, L2353: p = 8, m = 32 → 17.95%); zero-bubble gives 0.
pub fn bubble_fraction(schedule: Schedule, p: u64, m: u64, v: u64) -> f64 {
    if p <= 1 || m == 0 {
        return 0.0;
    }
    let v = match schedule {
        Schedule::Interleaved => v.max(1),
        Schedule::ZeroBubble => return 0.0,
        _ => 1,
    } as f64;
    let (p, m) = (p as f64, m as f64);
    (p - 1.0) / (v * m + p - 1.0)
}

/// The approximation (p-1)/m that 000 L2603 (Config C) uses: 3/32 = 9.4% where the exact
/// fraction is 3/35 = 8.6%. It is the bubble relative to ideal compute time, not to the step.
pub fn bubble_ratio_approx(p: u64, m: u64) -> f64 {
    if m == 0 {
        0.0
    } else {
        (p.saturating_sub(1)) as f64 / m as f64
    }
}

/// Idle time added to `m` micro-batches of `t_mb` seconds each: (p-1)/v · t_mb.
pub fn bubble_time(schedule: Schedule, p: u64, m: u64, v: u64, t_mb: f64) -> f64 {
    let f = bubble_fraction(schedule, p, m, v);
    if f >= 1.0 {
        f64::INFINITY
    } else {
        f / (1.0 - f) * m as f64 * t_mb
    }
}

/// Micro-batches whose activations the first stage holds at peak, in units of "one micro-batch
/// through L/p layers": GPipe m; 1F1B and zero-bubble min(m, p); interleaved
/// min(m, p)·(1 + (p-1)/(p·v)) (Korthikanti et al. 2022 eq. (5) discussion).
pub fn in_flight(schedule: Schedule, p: u64, m: u64, v: u64) -> f64 {
    let base = m.min(p).max(1) as f64;
    match schedule {
        Schedule::Gpipe => m.max(1) as f64,
        Schedule::OneFOneB | Schedule::ZeroBubble => base,
        Schedule::Interleaved => {
            let (pf, vf) = (p as f64, v.max(1) as f64);
            base * (1.0 + (pf - 1.0) / (pf * vf))
        }
    }
}

/// Smallest m keeping the 1F1B bubble at or below `target`: m ≥ (p-1)(1-f)/f
/// (000 E29/E30: p = 8, 10% → 64; 5% → 133).
pub fn min_microbatches_for_bubble(p: u64, target: f64) -> u64 {
    if p <= 1 || target <= 0.0 {
        return if p <= 1 { 1 } else { u64::MAX };
    }
    let m = (p - 1) as f64 * (1.0 - target) / target;
    (m - 1e-9).ceil().max(1.0) as u64
}
