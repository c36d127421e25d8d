//! The forecast of a step (issue 7, plan beside actual) through the public interface: the probe
//! measures, the engine's step is replayed on the group's calibrated alpha-beta model, and the
//! report sets it beside a measurement.
#[path = "support/common.rs"]
mod common;

use comm::group::GroupConfig;
use comm::local::run_threads;
use common::{tiny, trainer};
use train::forecast::{Measured, UnitTimes, beside, forecast, probe};

/// A probe with round numbers: 1 ms per block forward, 2 ms backward, head 3 and 6 ms; no
/// spread, no staging costs.
fn probe_fixed() -> UnitTimes {
    UnitTimes {
        fwd: [0.0, 1e-3, 3e-3],
        bwd: [0.0, 2e-3, 6e-3],
        ..UnitTimes::default()
    }
}

#[test]
fn the_probe_times_every_unit_of_a_one_block_model() {
    let cfg = tiny(2, 1);
    let th = model::Threads::new(1).unwrap();
    let p = probe::measure(&cfg, &th, 2, 1).unwrap();
    for (i, v) in p.to_vec().iter().enumerate() {
        assert!(v.is_finite() && *v >= 0.0, "value {i} of {p:?}");
    }
    assert!(p.fwd.iter().chain(&p.bwd).all(|&t| t > 0.0), "{p:?}");
    assert_eq!(UnitTimes::from_slice(&p.to_vec()), Some(p));
    assert_eq!(UnitTimes::from_slice(&[0.0; 3]), None);
}

#[test]
fn one_process_forecasts_its_units_and_the_update() {
    let cfg = tiny(2, 1);
    let t = train::Trainer::new(cfg).unwrap();
    let mut p = probe_fixed();
    p.update_per_param = 1e-9;
    let f = forecast(&t, &p);
    // 2 blocks: forward 2 x 1 + 3, backward 2 x 2 + 6, and the update of every parameter.
    let update = t.model().n_params() as f64 * 1e-9;
    assert!((f.compute - (5e-3 + 10e-3 + update)).abs() < 1e-12, "{f:?}");
    assert_eq!((f.comm, f.exposed, f.step), (0.0, 0.0, f.compute));
    assert_eq!(f.explain.len(), 4, "{:?}", f.explain);
}

#[test]
fn zero3_moves_half_again_data_parallels_bytes_and_both_are_compared() {
    // Two ranks, each unit its own bucket: plain data parallel against ZeRO-3, on the
    // uncalibrated alpha-beta model (a calibration on a loaded machine is noise).
    let cfg = GroupConfig {
        calibrate: false,
        ..GroupConfig::default()
    };
    let out = run_threads(2, cfg, |g| {
        let mut dp = trainer(tiny(2, 1), g.clone(), 0, 1);
        let mut z3 = trainer(tiny(2, 1), g, 3, 1);
        dp.step().unwrap();
        z3.step().unwrap();
        Ok((forecast(&dp, &probe_fixed()), forecast(&z3, &probe_fixed())))
    })
    .unwrap();
    for r in out {
        let (dp, z3) = r.unwrap();
        for f in [&dp, &z3] {
            assert!(f.comm > 0.0 && f.exposed <= f.comm, "{f:?}");
            assert!((f.step - (f.compute + f.exposed)).abs() < 1e-12, "{f:?}");
        }
        // ZeRO-3 gathers twice and reduce-scatters once (3 half all-reduces) against the
        // all-reduce's two halves: more time on the wire, never less.
        assert!(z3.comm > dp.comm, "dp {dp:?}\nz3 {z3:?}");
        assert!(
            z3.explain
                .iter()
                .any(|l| l.contains("reduce-scatter + all-gather"))
        );
        // Beside a measurement: the step row is there and within bounds it is not flagged.
        let m = Measured {
            steps: 2,
            step_s: 2.0 * dp.step,
            comm_s: 2.0 * dp.exposed,
            ..Measured::default()
        };
        let rows = beside(&dp, &m);
        let step = rows.iter().find(|r| r.name == "step").unwrap();
        assert!(step.off.abs() < 1e-9 && !step.flagged, "{rows:?}");
    }
}

#[test]
fn noisy_ranks_wait_for_each_other_at_every_collective() {
    // The same two-rank ZeRO-3 step with and without spread in the probe: the spread holds
    // every gather and reduce-scatter back for the last rank, which shows as exposed time.
    let out = run_threads(2, GroupConfig::for_training().unwrap(), |g| {
        let mut z3 = trainer(tiny(2, 1), g, 3, 1);
        z3.step().unwrap();
        let quiet = forecast(&z3, &probe_fixed());
        let mut noisy = probe_fixed();
        noisy.fwd_sd = [0.0, 1e-3, 1e-3];
        noisy.bwd_sd = [0.0, 1e-3, 1e-3];
        Ok((quiet, forecast(&z3, &noisy)))
    })
    .unwrap();
    for r in out {
        let (quiet, noisy) = r.unwrap();
        assert_eq!(noisy.compute, quiet.compute);
        assert!(noisy.step > quiet.step, "{quiet:?}\n{noisy:?}");
        assert!(
            noisy.explain[3].contains("for the last rank"),
            "{:?}",
            noisy.explain
        );
    }
}
