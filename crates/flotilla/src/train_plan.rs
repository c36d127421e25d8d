//! The planner beside the run (issue 7): after the last step every rank probes the model's
//! units at once (so the cores are shared as in training), the ranks' mean is taken, and rank
//! 0 prints the forecast of one step beside what the run measured.

use anyhow::{Context, Result};
use train::Trainer;
use train::forecast::{self, Measured, UnitTimes, beside, render};

/// Probe repetitions (the median and the spread are kept).
const PROBE_REPS: usize = 5;

/// The bar for the whole step.
const STEP_WITHIN: f64 = 0.15;

/// Probes and forecasts collectively; returns rank 0's report (every rank must call it).
pub fn report(trainer: &Trainer, measured: &Measured) -> Result<String> {
    if let Some(g) = trainer.group() {
        g.barrier().context("barrier before the forecast probe")?;
    }
    let mut probe = forecast::probe::measure(trainer.config(), trainer.threads(), PROBE_REPS)
        .context("probing the model's units for the forecast")?;
    if let Some(g) = trainer.group() {
        // The ranks' mean: their noise is what the forecast's straggler term is made of.
        let mut v = probe.to_vec();
        g.all_reduce(&mut v, comm::ReduceOp::Sum)
            .context("gathering the forecast probe")?;
        v.iter_mut().for_each(|x| *x /= g.size() as f64);
        probe = UnitTimes::from_slice(&v).context("probe values")?;
    }
    let f = forecast::forecast(trainer, &probe);
    let rows = beside(&f, measured);
    let mut out = format!(
        "# plan beside measured, per step over {} timed steps (units probed on this machine, all ranks at once):\n",
        measured.steps
    );
    for line in &f.explain {
        out.push_str(&format!("#   = {line}\n"));
    }
    out.push_str(&render(&rows));
    if let Some(step) = rows.iter().find(|r| r.name == "step") {
        out.push_str(&format!(
            "# step forecast {:+.1}% off the measurement: {}",
            100.0 * step.off,
            if step.off.abs() <= STEP_WITHIN {
                "within 15%"
            } else {
                "NOT within 15%"
            }
        ));
    }
    Ok(out)
}
