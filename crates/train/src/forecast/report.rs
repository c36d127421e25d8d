//! The forecast beside the measurement: one row per component of the step, flagged when the
//! two differ by more than [`FLAG_OFF`].

use super::Forecast;

/// A component is flagged when plan and measurement differ by more than this fraction of the
/// measurement (issue 7: 20 %)...
pub const FLAG_OFF: f64 = 0.20;

/// ...and it is at least this fraction of the measured step (smaller ones are noise).
pub const FLAG_FLOOR: f64 = 0.01;

/// What the run measured, summed over its timed steps.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Measured {
    /// Timed steps.
    pub steps: u64,
    /// Their wall seconds.
    pub step_s: f64,
    /// Seconds blocked on communication.
    pub comm_s: f64,
    /// Seconds waiting for batches.
    pub data_s: f64,
    /// Checkpoints taken.
    pub ckpts: u64,
    /// Seconds training paused for them.
    pub ckpt_pause_s: f64,
}

/// One component: planned and measured seconds (per step; per checkpoint for the pause).
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// "compute", "exposed comm", "data stall", "step", "ckpt pause".
    pub name: &'static str,
    /// The forecast.
    pub plan: f64,
    /// The measurement.
    pub measured: f64,
    /// (plan − measured) / measured.
    pub off: f64,
    /// Beyond [`FLAG_OFF`] on a component of at least [`FLAG_FLOOR`] of the step.
    pub flagged: bool,
}

/// The rows of `f` beside `m` (none when nothing was timed).
pub fn beside(f: &Forecast, m: &Measured) -> Vec<Row> {
    if m.steps == 0 || m.step_s <= 0.0 {
        return Vec::new();
    }
    let n = m.steps as f64;
    let step = m.step_s / n;
    let row = |name, plan: f64, measured: f64| {
        let off = if measured > 0.0 {
            (plan - measured) / measured
        } else if plan > 0.0 {
            f64::INFINITY
        } else {
            0.0
        };
        let big = plan.max(measured) >= FLAG_FLOOR * step;
        Row {
            name,
            plan,
            measured,
            off,
            flagged: big && off.abs() > FLAG_OFF,
        }
    };
    let mut rows = vec![
        row(
            "compute",
            f.compute,
            (m.step_s - m.comm_s - m.data_s).max(0.0) / n,
        ),
        row("exposed comm", f.exposed, m.comm_s / n),
        row("data stall", f.data, m.data_s / n),
        row("step", f.step, step),
    ];
    if m.ckpts > 0 {
        rows.push(row(
            "ckpt pause",
            f.ckpt_pause,
            m.ckpt_pause_s / m.ckpts as f64,
        ));
    }
    rows
}

/// The rows as a table, one `#`-prefixed line each.
pub fn render(rows: &[Row]) -> String {
    let mut out = String::from("#   component        plan   measured    off\n");
    for r in rows {
        let off = if r.off.is_finite() {
            format!("{:+.1}%", 100.0 * r.off)
        } else {
            "n/a".into()
        };
        let mark = if r.flagged {
            "  <- more than 20% off"
        } else {
            ""
        };
        out.push_str(&format!(
            "#   {:<12} {:>8.2} ms {:>8.2} ms {:>7}{mark}\n",
            r.name,
            r.plan * 1e3,
            r.measured * 1e3,
            off
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(compute: f64, exposed: f64) -> Forecast {
        Forecast {
            compute,
            comm: exposed,
            exposed,
            data: 0.0,
            step: compute + exposed,
            ckpt_pause: 0.001,
            explain: Vec::new(),
        }
    }

    #[test]
    fn components_are_compared_per_step_and_large_misses_flagged() {
        let m = Measured {
            steps: 4,
            step_s: 4.0,
            comm_s: 0.4,
            data_s: 0.004,
            ckpts: 2,
            ckpt_pause_s: 0.02,
        };
        let rows = beside(&plan(0.9, 0.05), &m);
        let get = |n: &str| rows.iter().find(|r| r.name == n).unwrap().clone();
        let c = get("compute");
        assert!((c.measured - 0.899).abs() < 1e-12 && !c.flagged, "{c:?}");
        // Comm: 0.05 planned vs 0.1 measured is 50% off on 10% of the step: flagged.
        let x = get("exposed comm");
        assert!((x.off + 0.5).abs() < 1e-12 && x.flagged, "{x:?}");
        // Data: 0 vs 1 ms is 100% off but under 1% of the step: not flagged.
        let d = get("data stall");
        assert!(d.off == -1.0 && !d.flagged, "{d:?}");
        let s = get("step");
        assert!((s.off - (0.95 - 1.0) / 1.0).abs() < 1e-12 && !s.flagged);
        assert_eq!(get("ckpt pause").measured, 0.01);
        let text = render(&rows);
        assert_eq!(text.lines().count(), 6, "{text}");
        assert!(text.contains("exposed comm") && text.contains("<- more than 20% off"));
        assert!(beside(&plan(1.0, 0.0), &Measured::default()).is_empty());
    }
}
