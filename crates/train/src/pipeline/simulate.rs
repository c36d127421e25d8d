//! Event-driven timeline of a schedule, and its measured bubble (file 000 F41, lines 2353-2371).
//!
//! Model: each stage runs its forwards and backwards in list order, one at a time. A compute
//! starts when its stage is free and its input is ready: a forward needs the previous model
//! chunk's forward of the same micro-batch, a backward its own forward and the next chunk's
//! backward. An input made on another stage is ready `p2p_latency` after its producer ends.
//! Messages are taken as posted asynchronously in list order (non-blocking send and receive,
//! waited on by the compute that needs them), so they add no waiting of their own; the
//! optimizer step takes no time. A forward of one micro-batch through all of stage `s`'s layers
//! takes `fwd_time[s]`, so each of its `v` chunks takes `fwd_time[s] / v` (same for backward):
//! schedules with different `v` are compared on the same model.
//!
//! Bubble fraction: the idle share of the stage-time rectangle,
//! `sum_s (makespan - busy_s) / (p * makespan)`, with the makespan from the first forward's
//! start (time 0) to the last backward's end. With balanced stages and no latency this is
//! exactly (p-1)/(m+p-1) for GPipe and for 1F1B (000 F41: each stage idles p-1 forward and p-1
//! backward slots around its m of each), and (p-1)/(v m + p-1) for interleaved 1F1B
//! (Narayanan et al. 2021: the fill and drain shrink to (p-1)/v slots).
use super::schedule::invalid;
use super::schedule::{Action, Schedule};
use super::{Result, ScheduleError};

/// One compute action on the timeline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// The [`Action::Forward`] or [`Action::Backward`].
    pub action: Action,
    /// Start time, in the units of the costs given to [`Schedule::simulate`].
    pub start: f64,
    /// End time.
    pub end: f64,
}

/// A simulated run of one global batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// Per stage, its computes in order with their times.
    pub stages: Vec<Vec<Span>>,
    /// Time from the first start to the last end.
    pub makespan: f64,
}

impl Timeline {
    /// Time stage `stage` spends computing (0 past the last stage).
    pub fn busy(&self, stage: usize) -> f64 {
        self.stages
            .get(stage)
            .map_or(0.0, |spans| spans.iter().map(|sp| sp.end - sp.start).sum())
    }

    /// Time stage `stage` is idle within the makespan.
    pub fn idle(&self, stage: usize) -> f64 {
        self.makespan - self.busy(stage)
    }

    /// Idle share of all stages over the makespan: `sum_s idle_s / (p * makespan)` (module doc);
    /// 0 for an empty timeline.
    pub fn bubble_fraction(&self) -> f64 {
        let p = self.stages.len();
        if p == 0 || self.makespan <= 0.0 {
            return 0.0;
        }
        let idle: f64 = (0..p).map(|s| self.idle(s)).sum();
        idle / (p as f64 * self.makespan)
    }
}

impl Schedule {
    /// Simulates the schedule (module doc): `fwd_time[s]` / `bwd_time[s]` is the time of one
    /// micro-batch's forward / backward through all of stage `s`'s layers, `p2p_latency` the
    /// delay of a message between stages. Costs must be finite and non-negative, one per stage.
    pub fn simulate(
        &self,
        fwd_time: &[f64],
        bwd_time: &[f64],
        p2p_latency: f64,
    ) -> Result<Timeline> {
        let p = self.stages();
        for (field, costs) in [("fwd_time", fwd_time), ("bwd_time", bwd_time)] {
            if costs.len() != p {
                return Err(ScheduleError::Invalid {
                    field,
                    value: format!("{} entries", costs.len()),
                    reason: format!("need one cost per stage (p = {p})"),
                });
            }
            if let Some(c) = costs.iter().find(|c| !c.is_finite() || **c < 0.0) {
                return Err(invalid(field, c, "costs must be finite and >= 0"));
            }
        }
        if !p2p_latency.is_finite() || p2p_latency < 0.0 {
            return Err(invalid(
                "p2p_latency",
                p2p_latency,
                "latency must be finite and >= 0",
            ));
        }
        let stages = dataflow(
            p,
            self.virtual_stages(),
            self.per_stage(),
            fwd_time,
            bwd_time,
            p2p_latency,
        )?;
        let makespan = stages
            .iter()
            .flat_map(|spans| spans.iter().map(|sp| sp.end))
            .fold(0.0, f64::max);
        Ok(Timeline { stages, makespan })
    }
}

/// The timeline of the compute actions in `lists` (other actions are skipped): repeatedly runs
/// every stage's next compute whose inputs have ended, until all have run. Fails with
/// [`ScheduleError::Deadlock`] when the compute order has a dependency cycle. Stage costs are
/// per micro-batch through the whole stage; a chunk costs `1/v` of that.
pub(super) fn dataflow(
    p: usize,
    v: usize,
    lists: &[Vec<Action>],
    fwd_time: &[f64],
    bwd_time: &[f64],
    latency: f64,
) -> Result<Vec<Vec<Span>>> {
    let m = lists
        .iter()
        .flatten()
        .filter_map(|a| match a {
            Action::Forward { mb, .. } | Action::Backward { mb, .. } => Some(mb + 1),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let chunks = p * v;
    // End times by (model chunk, micro-batch): index k * m + mb.
    let mut fwd_end: Vec<Option<f64>> = vec![None; chunks * m];
    let mut bwd_end: Vec<Option<f64>> = vec![None; chunks * m];
    // (action, mb, chunk, is_forward) of each compute, in list order.
    let computes: Vec<Vec<(Action, usize, usize, bool)>> = lists
        .iter()
        .map(|l| {
            l.iter()
                .filter_map(|&a| match a {
                    Action::Forward { mb, chunk } => Some((a, mb, chunk, true)),
                    Action::Backward { mb, chunk } => Some((a, mb, chunk, false)),
                    _ => None,
                })
                .collect()
        })
        .collect();
    let mut pos = vec![0usize; p];
    let mut clock = vec![0.0f64; p];
    let mut out: Vec<Vec<Span>> = computes
        .iter()
        .map(|c| Vec::with_capacity(c.len()))
        .collect();
    // An input's ready time, seen from stage `s`; None while its producer has not run.
    let ready = |end: Option<f64>, producer_stage: usize, s: usize| {
        end.map(|t| if producer_stage == s { t } else { t + latency })
    };
    loop {
        let mut progress = false;
        for s in 0..p {
            while let Some(&(a, mb, chunk, is_fwd)) = computes[s].get(pos[s]) {
                if mb >= m || chunk >= v {
                    return Err(ScheduleError::Incomplete {
                        stage: s,
                        reason: format!("{a} out of range"),
                    });
                }
                let k = chunk * p + s;
                let input = if is_fwd {
                    if k == 0 {
                        Some(0.0)
                    } else {
                        ready(fwd_end[(k - 1) * m + mb], (k - 1) % p, s)
                    }
                } else {
                    let own = fwd_end[k * m + mb];
                    let grad = if k + 1 == chunks {
                        Some(0.0)
                    } else {
                        ready(bwd_end[(k + 1) * m + mb], (k + 1) % p, s)
                    };
                    own.zip(grad).map(|(x, y)| x.max(y))
                };
                let Some(t) = input else { break };
                let cost = if is_fwd { fwd_time[s] } else { bwd_time[s] } / v as f64;
                let start = clock[s].max(t);
                let end = start + cost;
                clock[s] = end;
                if is_fwd {
                    fwd_end[k * m + mb] = Some(end);
                } else {
                    bwd_end[k * m + mb] = Some(end);
                }
                out[s].push(Span {
                    action: a,
                    start,
                    end,
                });
                pos[s] += 1;
                progress = true;
            }
        }
        if (0..p).all(|s| pos[s] == computes[s].len()) {
            return Ok(out);
        }
        if !progress {
            let detail = (0..p)
                .filter_map(|s| {
                    computes[s]
                        .get(pos[s])
                        .map(|(a, ..)| format!("stage {s} waits at {a}"))
                })
                .collect::<Vec<_>>()
                .join("; ");
            return Err(ScheduleError::Deadlock { detail });
        }
    }
}
