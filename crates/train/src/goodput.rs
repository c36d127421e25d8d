//! The goodput ledger of a job (issue 29), from its metrics file: where the wall time went, per
//! generation and for the run, beside the planner's goodput for the measured MTBF and
//! checkpoint interval (004 eqs. 28.23-28.25, `plan::reliability`).
//!
//! The lead rank writes one step record per step, stamped with its generation and the time it
//! was written, across restarts (the file is appended to). From those:
//! - **productive**: step time of the steps that were kept (not trained again later);
//! - **lost steps recomputed**: steps a generation trained beyond the step the next one resumed
//!   from, and their time (step, data and checkpoint time);
//! - **restart**: from a generation's last record to the next one's first step starting;
//! - **checkpoint pauses** and **data stalls**: the records' `ckpt_pause_s` and `data_s`;
//! - **straggler waits**: the lead's gradient wait beyond the smallest of its generation (the
//!   exposed communication itself is the smallest wait; the rest is waiting for slower ranks).
//!
//! Under per-step fault tolerance (`--ft`) there is one generation; a replica's loss is a
//! failure (a step trained by fewer replicas than the one before) and costs the survivors at
//! most the attempts of the step it hit (the records' `retried` and `retried_s`, counted as
//! lost steps recomputed; none when the loss was declared before that step's quorum).
//!
//! Goodput is productive time over wall time (first step's start to the last record).

use serde::{Deserialize, Serialize};

use crate::metrics_log::{Record, StepRecord};

/// One generation's (or the run's) share of the wall time, seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Share {
    /// The generation (the run's row: the last generation).
    pub generation: u64,
    /// Steps recorded.
    pub steps: u64,
    /// Wall time from the first step's start to the last record (restart time before it).
    pub wall_s: f64,
    /// Step time of the steps kept.
    pub productive_s: f64,
    /// Steps trained again by a later generation.
    pub lost_steps: u64,
    /// Their time (step, data, checkpoint).
    pub lost_s: f64,
    /// From the previous generation's last record to this one's first step starting.
    pub restart_s: f64,
    /// Checkpoint pauses.
    pub ckpt_pause_s: f64,
    /// Checkpoints taken.
    pub ckpts: u64,
    /// Data stalls.
    pub data_stall_s: f64,
    /// Waits for slower ranks at the gradient all-reduce.
    pub straggler_wait_s: f64,
}

/// The ledger: per generation, the run, and the planner's view.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ledger {
    /// One row per generation, in order.
    pub generations: Vec<Share>,
    /// The run's totals (wall time includes the restarts).
    pub run: Share,
    /// Productive over wall time.
    pub goodput: f64,
    /// Failures (generations that did not finish the job).
    pub failures: u64,
    /// The measured mean time between failures: the time the job was up (wall less restarts)
    /// per failure; `None` without failures.
    pub mtbf_s: Option<f64>,
    /// The planner's goodput 1/(1 + w) for the measured checkpoint pause, interval, MTBF and
    /// restart time (004 eq. 28.23; `None` without failures or checkpoints).
    pub planner_goodput: Option<f64>,
    /// Young's interval for the measured pause and MTBF (004 eq. 28.24), seconds.
    pub young_interval_s: Option<f64>,
}

/// The ledger of the step records in `records` written at or after `since_ms` (Unix ms: the
/// job's start, so earlier jobs appending to the same file are left out); `None` without any.
pub fn ledger(records: &[Record], since_ms: u64) -> Option<Ledger> {
    let steps: Vec<&StepRecord> = (records.iter())
        .filter_map(|r| match r {
            Record::Step(s) if s.unix_ms >= since_ms => Some(s),
            _ => None,
        })
        .collect();
    let mut gens: Vec<Vec<&StepRecord>> = Vec::new();
    for s in steps {
        match gens.last_mut() {
            Some(g) if g[0].generation == s.generation => g.push(s),
            _ => gens.push(vec![s]),
        }
    }
    let first = gens.first()?;
    let secs = |s: &StepRecord| s.step_s + s.data_s + s.ckpt_pause_s.unwrap_or(0.0);
    let start_ms = |s: &StepRecord| s.unix_ms as f64 - secs(s) * 1e3;
    let mut rows = Vec::with_capacity(gens.len());
    let mut prev_end: Option<f64> = None;
    for (i, g) in gens.iter().enumerate() {
        // Steps above the next generation's resume point were trained again there.
        let resumed_next = gens.get(i + 1).map(|n| n[0].step.saturating_sub(1));
        let lost = |s: &&&StepRecord| resumed_next.is_some_and(|r| s.step > r);
        let least_wait = g.iter().map(|s| s.comm_s).fold(f64::INFINITY, f64::min);
        let begin = start_ms(g[0]);
        let end = g.last().map_or(begin, |s| s.unix_ms as f64);
        rows.push(Share {
            generation: g[0].generation,
            steps: g.len() as u64,
            wall_s: (end - begin) / 1e3,
            productive_s: total(g.iter().filter(|s| !lost(s)).map(|s| s.step_s)),
            // Under --ft a failure costs the attempts of the step it hit, trained again.
            lost_steps: g.iter().filter(|s| lost(s)).count() as u64
                + g.iter().filter_map(|s| s.retried).sum::<u64>(),
            lost_s: total(g.iter().filter(|s| lost(s)).map(|s| secs(s)))
                + total(g.iter().filter_map(|s| s.retried_s)),
            restart_s: prev_end.map_or(0.0, |p| ((begin - p) / 1e3).max(0.0)),
            ckpt_pause_s: total(g.iter().filter_map(|s| s.ckpt_pause_s)),
            ckpts: g.iter().filter(|s| s.ckpt_pause_s.is_some()).count() as u64,
            data_stall_s: total(g.iter().map(|s| s.data_s)),
            straggler_wait_s: total(g.iter().map(|s| s.comm_s - least_wait)),
        });
        prev_end = Some(end);
    }
    let wall_ms = prev_end.unwrap_or(0.0) - start_ms(first[0]);
    let mut run = Share {
        generation: rows.last().map_or(0, |r| r.generation),
        wall_s: wall_ms / 1e3,
        ..Share::default()
    };
    for r in &rows {
        run.steps += r.steps;
        run.productive_s += r.productive_s;
        run.lost_steps += r.lost_steps;
        run.lost_s += r.lost_s;
        run.restart_s += r.restart_s;
        run.ckpt_pause_s += r.ckpt_pause_s;
        run.ckpts += r.ckpts;
        run.data_stall_s += r.data_stall_s;
        run.straggler_wait_s += r.straggler_wait_s;
    }
    // Restarts of the whole job, and under --ft the steps a lost replica made the others retry.
    // Under --ft a lost replica shows as a step trained by fewer replicas than the one before
    // (the step it hit was retried, or its loss was declared before that step's quorum).
    let ft_failures = (gens.iter().flatten().zip(gens.iter().flatten().skip(1)))
        .filter(|(a, b)| matches!((a.replicas, b.replicas), (Some(x), Some(y)) if y < x))
        .count() as u64;
    let failures = rows.len() as u64 - 1 + ft_failures;
    // The model's M and τ are times the job is up (training, saving): the restarts are its
    // R term, so counting them in M as well would charge each restart twice.
    let up_s = (run.wall_s - run.restart_s).max(1e-9);
    let mtbf_s = (failures > 0).then(|| up_s / failures as f64);
    let (mut planner_goodput, mut young_interval_s) = (None, None);
    if let Some(m) = mtbf_s
        && run.ckpts > 0
    {
        use plan::reliability::{checkpoint_overhead, goodput, young_interval};
        let c = run.ckpt_pause_s / run.ckpts as f64;
        let tau = up_s / run.ckpts as f64;
        let restart = run.restart_s / failures as f64;
        planner_goodput = Some(goodput(checkpoint_overhead(tau, c, m, restart)));
        young_interval_s = Some(young_interval(c, m));
    }
    Some(Ledger {
        goodput: run.productive_s / run.wall_s.max(1e-9),
        generations: rows,
        run,
        failures,
        mtbf_s,
        planner_goodput,
        young_interval_s,
    })
}

/// A sum that is +0 when empty (an empty f64 sum is -0, printed as "-0.00").
fn total(it: impl Iterator<Item = f64>) -> f64 {
    it.fold(0.0, |a, b| a + b)
}

impl Share {
    /// The row in words.
    fn words(&self) -> String {
        format!(
            "{} steps, wall {:.2} s: productive {:.2} s, lost steps recomputed {} ({:.2} s), \
             restart {:.2} s, checkpoint pauses {:.3} s ({}), data stalls {:.3} s, straggler \
             waits {:.3} s",
            self.steps,
            self.wall_s,
            self.productive_s,
            self.lost_steps,
            self.lost_s,
            self.restart_s,
            self.ckpt_pause_s,
            self.ckpts,
            self.data_stall_s,
            self.straggler_wait_s
        )
    }
}

impl Ledger {
    /// The ledger's lines for the log: one per generation, the run, and the planner beside it.
    pub fn lines(&self) -> Vec<String> {
        let mut out: Vec<String> = (self.generations.iter())
            .map(|g| {
                format!(
                    "# goodput ledger, generation {}: {}",
                    g.generation,
                    g.words()
                )
            })
            .collect();
        out.push(format!(
            "# goodput ledger, run: {}; goodput {:.1}%",
            self.run.words(),
            100.0 * self.goodput
        ));
        out.push(match (self.mtbf_s, self.planner_goodput, self.young_interval_s) {
            (Some(m), Some(p), Some(y)) => format!(
                "# goodput beside the planner: measured {:.1}%, planner {:.1}% for MTBF {m:.2} s \
                 ({} failures), checkpoint pause {:.3} s every {:.2} s (Young's interval \
                 {y:.2} s; 004 eqs. 28.23-28.24)",
                100.0 * self.goodput,
                100.0 * p,
                self.failures,
                self.run.ckpt_pause_s / self.run.ckpts.max(1) as f64,
                (self.run.wall_s - self.run.restart_s).max(0.0) / self.run.ckpts.max(1) as f64,
            ),
            _ => format!(
                "# goodput beside the planner: measured {:.1}%; no planner figure without both \
                 a failure (the MTBF) and a checkpoint (its cost)",
                100.0 * self.goodput
            ),
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(generation: u64, step: u64, unix_ms: u64, ckpt: Option<f64>, comm_s: f64) -> Record {
        Record::Step(StepRecord {
            step,
            loss: 1.0,
            lr: 1e-3,
            grad_norm: 1.0,
            tokens: 8,
            tokens_per_s: 80.0,
            mfu: 0.1,
            step_s: 0.1,
            compute_s: 0.1 - comm_s,
            comm_s,
            data_s: 0.0,
            ckpt_pause_s: ckpt,
            val_loss: None,
            retried: None,
            retried_s: None,
            replicas: None,
            rank: 0,
            world: 2,
            generation,
            unix_ms,
        })
    }

    #[test]
    fn lost_steps_restarts_and_the_planner_are_accounted() {
        let old = rec(0, 1, 10, None, 0.0);
        let records = vec![
            old,
            rec(0, 1, 1100, None, 0.01),
            rec(0, 2, 1200, Some(0.05), 0.03),
            rec(0, 3, 1350, None, 0.01),
            // Generation 1 resumes from step 2 (step 3 is trained again) after 1.15 s.
            rec(1, 3, 2600, None, 0.0),
            rec(1, 4, 2700, Some(0.05), 0.0),
        ];
        let l = ledger(&records, 1000).unwrap();
        assert_eq!(l.generations.len(), 2);
        let (g0, g1) = (&l.generations[0], &l.generations[1]);
        assert_eq!((g0.steps, g0.lost_steps, g1.lost_steps), (3, 1, 0));
        assert!((g0.productive_s - 0.2).abs() < 1e-9, "{g0:?}");
        assert!((g0.straggler_wait_s - 0.02).abs() < 1e-9, "{g0:?}");
        assert!((g1.restart_s - 1.15).abs() < 1e-9, "{g1:?}");
        assert!((l.run.wall_s - 1.7).abs() < 1e-9, "{:?}", l.run);
        assert_eq!((l.run.ckpts, l.failures), (2, 1));
        assert!((l.goodput - 0.4 / 1.7).abs() < 1e-9);
        let p = l.planner_goodput.unwrap();
        assert!(p > 0.0 && p < 1.0, "{p}");
        let lines = l.lines();
        assert!(lines[2].contains("run: 5 steps") && lines[2].contains("recomputed 1"));
        assert!(lines[3].contains("planner") && lines[3].contains("1 failures"));
        assert!(ledger(&records[..1], 1000).is_none());
    }
}
