//! How often to checkpoint: Young's and Daly's intervals from the foreground pause `C` and the
//! job's mean time between failures `M`, the expected loss fraction, and an [`IntervalPlanner`]
//! that measures `C` and `M` as the job runs.
//!
//! Sources (seeds under `shared/seeds/`):
//! - 004 §28.9, eq. 28.23 (`004_fff1170a72f11f87.txt` line 351): loss per unit of useful time
//!   `w(τ) ≈ C/τ + τ/(2M) + R_f/M`, assuming Poisson failures and `C, R_f, τ ≪ M`;
//! - 004 eq. 28.24 (line 355): `τ* = √(2CM)` (Young's first-order interval);
//! - 004 eq. 28.25 (line 361): `C = 60 s, M = 86400 s` gives `τ* ≈ 3220 s`;
//! - 004 line 365 and 000 line 2863: `p` independent devices fail `p` times as often, so
//!   `M_sys = M_device / p` (invalid under shared power, network or software faults);
//! - Daly (2006), higher-order correction, outside the seed text (notes/004_001.md G6):
//!   `τ ≈ √(2CM)[1 + ⅓√(C/2M) + ⅑(C/2M)] − C` for `C < 2M`, else `τ = M`.
//!
//! With an asynchronous save, `C` is the *foreground* pause only (004 line 363): the time the
//! training loop is stopped, not the background upload.

use std::time::Instant;

use super::{PolicyError, non_negative, positive};

/// Young's interval `τ* = √(2CM)` (004 eq. 28.24): the minimum of eq. 28.23's loss. `c_secs`
/// is the foreground pause per checkpoint, `mtbf_secs` the job's mean time between failures;
/// both must be finite and positive.
pub fn young_interval(c_secs: f64, mtbf_secs: f64) -> Result<f64, PolicyError> {
    let c = positive("c_secs", c_secs)?;
    let m = positive("mtbf_secs", mtbf_secs)?;
    Ok((2.0 * c * m).sqrt())
}

/// Daly's higher-order interval (Daly 2006; not in the seed text, see notes/004_001.md G6):
/// `√(2CM)[1 + ⅓√(C/2M) + ⅑(C/2M)] − C` when `C < 2M`, and `M` otherwise (a save that takes
/// longer than two MTBFs cannot be amortised; checkpoint once per expected failure). It is
/// slightly shorter than [`young_interval`] for `C ≪ M`: 3180.06 s against 3219.94 s for
/// `C = 60 s, M = 86400 s`.
pub fn daly_interval(c_secs: f64, mtbf_secs: f64) -> Result<f64, PolicyError> {
    let c = positive("c_secs", c_secs)?;
    let m = positive("mtbf_secs", mtbf_secs)?;
    if c >= 2.0 * m {
        return Ok(m);
    }
    let r = c / (2.0 * m);
    Ok((2.0 * c * m).sqrt() * (1.0 + r.sqrt() / 3.0 + r / 9.0) - c)
}

/// Expected fraction of time lost, 004 eq. 28.23: `w(τ) ≈ C/τ + τ/(2M) + R_f/M`, checkpointing
/// every `tau_secs` of useful work with pause `c_secs`, failures every `mtbf_secs` on average,
/// and `restart_secs` (`R_f`, may be 0) to recover from each. The first term is the pauses, the
/// second the work lost since the last checkpoint (half an interval on average), the third the
/// restarts. At `τ*` the first two are equal (004 line 361: ≈1.86% each for the eq. 28.25
/// inputs). A first-order model: it ignores failures during saves and restarts.
pub fn expected_loss_fraction(
    tau_secs: f64,
    c_secs: f64,
    mtbf_secs: f64,
    restart_secs: f64,
) -> Result<f64, PolicyError> {
    let tau = positive("tau_secs", tau_secs)?;
    let c = positive("c_secs", c_secs)?;
    let m = positive("mtbf_secs", mtbf_secs)?;
    let r = non_negative("restart_secs", restart_secs)?;
    Ok(c / tau + tau / (2.0 * m) + r / m)
}

/// The job's MTBF when any one of `devices` independent devices, each failing every
/// `per_device_mtbf_secs` on average, stops it: `M_sys = M_device / N` (004 line 365: failure
/// rate `pλ`, MTBF `1/(pλ)`; 000 line 2863: 50,000 h / 1,024 GPUs = 48.8 h). Correlated faults
/// (shared power, network, software) make the real MTBF shorter.
pub fn cluster_mtbf(per_device_mtbf_secs: f64, devices: u64) -> Result<f64, PolicyError> {
    let m = positive("per_device_mtbf_secs", per_device_mtbf_secs)?;
    if devices == 0 {
        return Err(PolicyError {
            what: "devices",
            value: "0".into(),
            reason: "must be at least 1",
        });
    }
    Ok(m / devices as f64)
}

/// An interval in seconds as a whole number of training steps of `step_secs` each: the nearest
/// whole number, at least 1 (saturating at `u64::MAX`).
pub fn interval_steps(interval_secs: f64, step_secs: f64) -> Result<u64, PolicyError> {
    let tau = positive("interval_secs", interval_secs)?;
    let step = positive("step_secs", step_secs)?;
    // `as` saturates: an infinite or huge ratio becomes u64::MAX.
    Ok(((tau / step).round() as u64).max(1))
}

/// Which interval formula an [`IntervalPlanner`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Formula {
    /// [`young_interval`], 004 eq. 28.24.
    #[default]
    Young,
    /// [`daly_interval`], Daly's higher-order correction.
    Daly,
}

/// How an [`IntervalPlanner`] averages the measured pauses.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum PauseAverage {
    /// The running mean of every pause measured.
    #[default]
    Mean,
    /// An exponentially weighted moving average with this weight of the newest pause, in
    /// `(0, 1]` (the first measurement is taken as is).
    Ewma(f64),
}

/// Decides when the next checkpoint is due from measured pauses and an observed or configured
/// MTBF.
///
/// `C` is the average of the foreground pauses recorded with [`record_pause`], or the
/// configured prior until one is. `M` is the total run time recorded with [`record_run_time`]
/// divided by the failures recorded with [`record_failure`], or the configured prior until a
/// failure has been seen (and while no run time is recorded).
///
/// [`record_pause`]: IntervalPlanner::record_pause
/// [`record_run_time`]: IntervalPlanner::record_run_time
/// [`record_failure`]: IntervalPlanner::record_failure
#[derive(Debug, Clone, PartialEq)]
pub struct IntervalPlanner {
    pause_prior: f64,
    mtbf_prior: f64,
    restart_secs: f64,
    average: PauseAverage,
    formula: Formula,
    pauses: u64,
    pause_avg: f64,
    run_secs: f64,
    failures: u64,
}

impl IntervalPlanner {
    /// A planner using `pause_prior_secs` for `C` until a pause is measured and
    /// `mtbf_prior_secs` for `M` until a failure is seen (for a cluster, see
    /// [`cluster_mtbf`]). Running mean of pauses, Young's formula, no restart cost.
    pub fn new(pause_prior_secs: f64, mtbf_prior_secs: f64) -> Result<Self, PolicyError> {
        Ok(IntervalPlanner {
            pause_prior: positive("pause_prior_secs", pause_prior_secs)?,
            mtbf_prior: positive("mtbf_prior_secs", mtbf_prior_secs)?,
            restart_secs: 0.0,
            average: PauseAverage::Mean,
            formula: Formula::Young,
            pauses: 0,
            pause_avg: 0.0,
            run_secs: 0.0,
            failures: 0,
        })
    }

    /// Sets how pauses are averaged (an EWMA weight must be in `(0, 1]`).
    pub fn with_average(mut self, average: PauseAverage) -> Result<Self, PolicyError> {
        if let PauseAverage::Ewma(alpha) = average
            && !(alpha.is_finite() && alpha > 0.0 && alpha <= 1.0)
        {
            return Err(PolicyError {
                what: "ewma_alpha",
                value: alpha.to_string(),
                reason: "must be greater than 0 and at most 1",
            });
        }
        self.average = average;
        Ok(self)
    }

    /// Sets the interval formula.
    pub fn with_formula(mut self, formula: Formula) -> Self {
        self.formula = formula;
        self
    }

    /// Sets the restart cost `R_f` used by [`IntervalPlanner::expected_loss_fraction`].
    pub fn with_restart(mut self, restart_secs: f64) -> Result<Self, PolicyError> {
        self.restart_secs = non_negative("restart_secs", restart_secs)?;
        Ok(self)
    }

    /// Records one measured foreground pause (finite, > 0).
    pub fn record_pause(&mut self, secs: f64) -> Result<(), PolicyError> {
        let c = positive("pause_secs", secs)?;
        self.pauses += 1;
        self.pause_avg = match self.average {
            _ if self.pauses == 1 => c,
            PauseAverage::Mean => self.pause_avg + (c - self.pause_avg) / self.pauses as f64,
            PauseAverage::Ewma(alpha) => alpha * c + (1.0 - alpha) * self.pause_avg,
        };
        Ok(())
    }

    /// Adds `secs` (finite, >= 0) of run time to the total the observed MTBF divides.
    pub fn record_run_time(&mut self, secs: f64) -> Result<(), PolicyError> {
        self.run_secs += non_negative("run_secs", secs)?;
        Ok(())
    }

    /// Records one failure of the job.
    pub fn record_failure(&mut self) {
        self.failures = self.failures.saturating_add(1);
    }

    /// The pause `C` in use: the average of measured pauses, or the prior.
    pub fn pause(&self) -> f64 {
        if self.pauses == 0 {
            self.pause_prior
        } else {
            self.pause_avg
        }
    }

    /// The MTBF `M` in use: run time / failures once both are non-zero, else the prior.
    pub fn mtbf(&self) -> f64 {
        if self.failures == 0 || self.run_secs <= 0.0 {
            self.mtbf_prior
        } else {
            self.run_secs / self.failures as f64
        }
    }

    /// The checkpoint interval in seconds for the current `C` and `M`.
    pub fn interval(&self) -> f64 {
        let (c, m) = (self.pause(), self.mtbf());
        // Both are finite and positive by construction, so the formulas cannot refuse them.
        let tau = match self.formula {
            Formula::Young => young_interval(c, m),
            Formula::Daly => daly_interval(c, m),
        };
        tau.unwrap_or(m)
    }

    /// The expected loss fraction (004 eq. 28.23) at [`IntervalPlanner::interval`] (NaN only
    /// if that interval overflowed to infinity, for absurdly large `C·M`).
    pub fn expected_loss_fraction(&self) -> f64 {
        let (c, m) = (self.pause(), self.mtbf());
        expected_loss_fraction(self.interval(), c, m, self.restart_secs).unwrap_or(f64::NAN)
    }

    /// Whether a checkpoint is due at `now` when the last one was taken at `last` (a `now`
    /// before `last` counts as no time elapsed).
    pub fn is_due(&self, last: Instant, now: Instant) -> bool {
        now.saturating_duration_since(last).as_secs_f64() >= self.interval()
    }

    /// [`IntervalPlanner::interval`] in training steps of `step_secs` (see [`interval_steps`]).
    pub fn interval_steps(&self, step_secs: f64) -> Result<u64, PolicyError> {
        interval_steps(self.interval(), step_secs)
    }
}
