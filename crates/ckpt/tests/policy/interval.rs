//! The Young/Daly checkpoint interval: the seed test vectors, input validation, and the
//! `IntervalPlanner` that replaces its priors with measurements.
use std::time::{Duration, Instant};

use ckpt::policy::{
    Formula, IntervalPlanner, PauseAverage, cluster_mtbf, daly_interval, expected_loss_fraction,
    interval_steps, young_interval,
};

fn close(actual: f64, expected: f64, tol: f64) {
    assert!(
        (actual - expected).abs() <= tol,
        "{actual} is not within {tol} of {expected}"
    );
}

// ---------------------------------------------------------------------------------------------
// Interval: seed test vectors
// ---------------------------------------------------------------------------------------------

/// 004 eq. 28.25 (004_fff1170a72f11f87.txt line 361): C = 60 s, M = 24 h gives τ* ≈ 3220 s
/// ≈ 53.7 min; at τ* the pause and lost-work terms are each ≈ 1.86% (line 363).
#[test]
fn young_matches_eq_28_25() {
    let tau = young_interval(60.0, 86_400.0).unwrap();
    close(tau, 3219.94, 0.005);
    assert_eq!(tau.round(), 3220.0);
    close(tau / 60.0, 53.7, 0.05);
    let w = expected_loss_fraction(tau, 60.0, 86_400.0, 0.0).unwrap();
    close(60.0 / tau, 0.0186, 0.00005);
    close(tau / (2.0 * 86_400.0), 0.0186, 0.00005);
    close(w, 2.0 * 0.018634, 0.000005);
    // R_f / M adds on top.
    let w_r = expected_loss_fraction(tau, 60.0, 86_400.0, 864.0).unwrap();
    close(w_r - w, 0.01, 1e-12);
    // Exercise 28.11 (notes/004_001.md TV-K3): M / 4 halves τ*.
    close(young_interval(60.0, 21_600.0).unwrap(), tau / 2.0, 1e-9);
}

/// Daly's correction for the same inputs: 3180.06 s (notes/004_001.md line 575).
#[test]
fn daly_matches_notes() {
    close(daly_interval(60.0, 86_400.0).unwrap(), 3180.06, 0.005);
    // Fallback for C >= 2M: τ = M.
    assert_eq!(daly_interval(200.0, 100.0).unwrap(), 100.0);
    assert_eq!(daly_interval(200.0, 99.0).unwrap(), 99.0);
    // Just below the boundary it is still positive and below M.
    let t = daly_interval(199.9, 100.0).unwrap();
    assert!(t > 0.0 && t < 100.0, "{t}");
}

/// 000 E56 / pitfall P10 (000_7a796c6865dceb08.txt line 2863; notes/000_part2.md lines
/// 681-689, 956): 1,024 GPUs at 50,000 h MTBF each give 48.8 h; a 5 min write gives
/// τ_opt ≈ 171.2 min and a 5.8% tax; every 15 min costs 33.6%.
#[test]
fn young_daly_e56_p10() {
    let m = cluster_mtbf(50_000.0 * 3600.0, 1024).unwrap();
    close(m / 3600.0, 48.83, 0.005);
    let c = 5.0 * 60.0;
    let tau = young_interval(c, m).unwrap();
    close(tau / 60.0, 171.16, 0.01);
    let w_opt = expected_loss_fraction(tau, c, m, 0.0).unwrap();
    close(w_opt, 0.0584, 0.0001);
    let w_15 = expected_loss_fraction(15.0 * 60.0, c, m, 0.0).unwrap();
    close(w_15, 0.3359, 0.0001);
    // The daily loss quoted with them ($13,638 at an implied $2 per GPU-hour).
    close((w_15 - w_opt) * 1024.0 * 24.0 * 2.0, 13_638.0, 1.0);
}

#[test]
fn interval_inputs_are_validated_by_name() {
    for (result, name) in [
        (young_interval(0.0, 1.0), "c_secs"),
        (young_interval(1.0, -1.0), "mtbf_secs"),
        (young_interval(f64::NAN, 1.0), "c_secs"),
        (daly_interval(1.0, f64::INFINITY), "mtbf_secs"),
        (expected_loss_fraction(0.0, 1.0, 1.0, 0.0), "tau_secs"),
        (expected_loss_fraction(1.0, 1.0, 1.0, -1.0), "restart_secs"),
        (cluster_mtbf(-5.0, 3), "per_device_mtbf_secs"),
        (cluster_mtbf(5.0, 0), "devices"),
    ] {
        let err = result.unwrap_err();
        assert_eq!(err.what, name);
        assert!(err.to_string().starts_with(name), "{err}");
    }
    assert_eq!(interval_steps(0.0, 1.0).unwrap_err().what, "interval_secs");
    assert_eq!(interval_steps(10.0, 0.0).unwrap_err().what, "step_secs");
    assert!(expected_loss_fraction(1.0, 1.0, 1.0, 0.0).is_ok());
}

#[test]
fn interval_in_steps() {
    assert_eq!(interval_steps(3219.94, 1.5).unwrap(), 2147);
    assert_eq!(interval_steps(1.0, 10.0).unwrap(), 1, "at least one step");
    assert_eq!(interval_steps(1e300, 1e-300).unwrap(), u64::MAX);
}

// ---------------------------------------------------------------------------------------------
// IntervalPlanner
// ---------------------------------------------------------------------------------------------

#[test]
fn planner_uses_priors_then_measurements() {
    let mut p = IntervalPlanner::new(60.0, 86_400.0).unwrap();
    close(p.interval(), 3219.94, 0.005);
    let t0 = Instant::now();
    assert!(!p.is_due(t0, t0 + Duration::from_secs(3000)));
    assert!(p.is_due(t0, t0 + Duration::from_secs(3221)));
    assert!(
        !p.is_due(t0 + Duration::from_secs(10), t0),
        "clock before last: not due"
    );
    assert_eq!(p.interval_steps(2.0).unwrap(), 1610);

    // Measured pauses replace the prior: mean of 20 and 40 is 30.
    p.record_pause(20.0).unwrap();
    p.record_pause(40.0).unwrap();
    assert_eq!(p.pause(), 30.0);
    close(p.interval(), (2.0f64 * 30.0 * 86_400.0).sqrt(), 1e-9);

    // Run time without failures keeps the prior MTBF; then 2 failures in 43,200 s give 21,600.
    p.record_run_time(43_200.0).unwrap();
    assert_eq!(p.mtbf(), 86_400.0);
    p.record_failure();
    p.record_failure();
    assert_eq!(p.mtbf(), 21_600.0);
    close(p.interval(), (2.0f64 * 30.0 * 21_600.0).sqrt(), 1e-9);
    assert!(p.is_due(t0, t0 + Duration::from_secs(1139)));
    assert!(!p.is_due(t0, t0 + Duration::from_secs(1137)));
    close(
        p.expected_loss_fraction(),
        expected_loss_fraction(p.interval(), 30.0, 21_600.0, 0.0).unwrap(),
        1e-12,
    );
}

#[test]
fn planner_ewma_daly_and_restart() {
    let mut p = IntervalPlanner::new(1.0, 86_400.0)
        .unwrap()
        .with_average(PauseAverage::Ewma(0.5))
        .unwrap()
        .with_formula(Formula::Daly)
        .with_restart(864.0)
        .unwrap();
    p.record_pause(100.0).unwrap();
    assert_eq!(p.pause(), 100.0, "first measurement taken as is");
    p.record_pause(20.0).unwrap();
    assert_eq!(p.pause(), 60.0);
    close(p.interval(), 3180.06, 0.005);
    let w = p.expected_loss_fraction();
    close(
        w,
        60.0 / p.interval() + p.interval() / 172_800.0 + 0.01,
        1e-12,
    );
}

#[test]
fn planner_refuses_bad_input() {
    assert_eq!(
        IntervalPlanner::new(0.0, 1.0).unwrap_err().what,
        "pause_prior_secs"
    );
    assert_eq!(
        IntervalPlanner::new(1.0, f64::NAN).unwrap_err().what,
        "mtbf_prior_secs"
    );
    let p = IntervalPlanner::new(1.0, 1.0).unwrap();
    for alpha in [0.0, 1.5, f64::NAN, -0.1] {
        let err = p
            .clone()
            .with_average(PauseAverage::Ewma(alpha))
            .unwrap_err();
        assert_eq!(err.what, "ewma_alpha");
    }
    assert!(p.clone().with_average(PauseAverage::Ewma(1.0)).is_ok());
    assert_eq!(
        p.clone().with_restart(-1.0).unwrap_err().what,
        "restart_secs"
    );
    let mut q = p.clone();
    assert_eq!(q.record_pause(-3.0).unwrap_err().what, "pause_secs");
    assert_eq!(
        q.record_run_time(f64::INFINITY).unwrap_err().what,
        "run_secs"
    );
    assert_eq!(q, p, "refused input changes nothing");
    assert_eq!(p.interval_steps(0.0).unwrap_err().what, "step_secs");
}
