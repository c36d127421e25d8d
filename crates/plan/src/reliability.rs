//! Reliability: cluster MTBF, Young and Daly checkpoint intervals, the loss per unit of useful
//! time (000 §2.23, F4–F5; 004 eqs. 28.23–28.25).

/// Cluster MTBF from independent devices: M = MTBF_device / N (000 F4b; 004 line 365
/// "failure rate pλ, MTBF 1/(pλ)"). 000 E56: 50,000 h / 1,024 = 48.83 h.
pub fn cluster_mtbf(device_mtbf: f64, n: u64) -> f64 {
    device_mtbf / n.max(1) as f64
}

/// Probability that at least one of `n` units fails within an hour when each survives it with
/// probability `p`: 1 − pⁿ; the MTBF in hours is its inverse (000 F5, E1: 0.999, 100 → 9.52%,
/// 10.5 h).
pub fn hourly_failure_probability(p_survive: f64, n: u64) -> f64 {
    1.0 - p_survive.powf(n as f64)
}

/// Young's interval τ* = √(2CM) (000 F4; 004 eq. 28.24). 004 eq. 28.25: C = 60 s, M = 24 h →
/// 3,219.94 s.
pub fn young_interval(c: f64, m: f64) -> f64 {
    (2.0 * c * m).sqrt()
}

/// Daly's higher-order interval (Daly 2006, eq. 37): for C < 2M,
/// √(2CM)·[1 + ⅓√(C/2M) + ⅑(C/2M)] − C; otherwise M (004 notes §4.3: 3,180.06 s for C = 60,
/// M = 86,400).
pub fn daly_interval(c: f64, m: f64) -> f64 {
    if c >= 2.0 * m {
        return m;
    }
    let x = c / (2.0 * m);
    (2.0 * c * m).sqrt() * (1.0 + x.sqrt() / 3.0 + x / 9.0) - c
}

/// Loss per unit of useful time w(τ) ≈ C/τ + τ/(2M) + R_f/M (004 eq. 28.23; 000 F4c).
/// 000 E56: C = 5 min, M = 48.83 h → 5.84% at τ*, 33.59% at τ = 15 min.
pub fn checkpoint_overhead(tau: f64, c: f64, m: f64, restart: f64) -> f64 {
    c / tau + tau / (2.0 * m) + restart / m
}

/// Goodput: the useful fraction of wall time, 1/(1 + w).
pub fn goodput(overhead: f64) -> f64 {
    1.0 / (1.0 + overhead)
}

/// Daily cost of running at overhead `w` instead of `w_opt` on `n` devices (000 E56: $13,638).
pub fn daily_overhead_cost(w: f64, w_opt: f64, n: u64, price_per_device_hour: f64) -> f64 {
    (w - w_opt) * n as f64 * 24.0 * price_per_device_hour
}

/// Expected stragglers per step: N·p (000 F63, E10: 1,000 × 1% = 10).
pub fn expected_stragglers(n: u64, p: f64) -> f64 {
    n as f64 * p
}

/// Probability that at least one of `n` links is degraded: 1 − (1 − p)ⁿ (000 part 1 F7, N11).
pub fn any_degraded(n: u64, p: f64) -> f64 {
    1.0 - (1.0 - p).powf(n as f64)
}
