//! Stragglers named (issue 29): per-rank arrival skew measured at the step's collectives.
//!
//! Every rank leaves a step's exchange of arrival times at about the same moment (the
//! exchange is a collective), so the time until it next arrives there, less what it waited
//! for gradients inside the step (`comm_seconds`: a rank that arrives early at the gradient
//! all-reduce waits there for the slow one), is its own work for the step: data, forward,
//! backward and whatever slowed it (a hot core, a throttled GPU, a `slow@` chaos fault). The
//! ranks all-gather these arrival times once per step (one value each, after the step, so it
//! adds one small collective and no barrier inside the step's work), and each rank judges the
//! same numbers the same way: a rank whose arrival time is at least [`SLOW_RATIO`] times the
//! median of the other ranks' for [`WINDOW`] consecutive steps is a straggler, its slowdown the
//! median of those ratios. Single-process runs exchange nothing.
//!
//! Under a pipeline the stages wait for each other point to point inside the step, which
//! `comm_seconds` does not count, so a slow stage shows up less sharply there.

use std::collections::VecDeque;
use std::time::Instant;

use comm::group::ProcessGroup;

use crate::error::{Context, Result};
use crate::metrics_log::MetricsLog;
use crate::trainer::StepStats;

/// Steps in a row a rank must be slow before it is named.
pub const WINDOW: usize = 3;
/// How many times the other ranks' median arrival time a straggler takes.
pub const SLOW_RATIO: f64 = 1.75;

/// A rank named slow.
#[derive(Clone, Debug, PartialEq)]
pub struct Straggler {
    /// The slow rank.
    pub rank: usize,
    /// How many times longer than the median of the other ranks it took to arrive (the
    /// median over the window).
    pub slowdown: f64,
    /// The step at which it was named.
    pub step: u64,
    /// Its arrival time at that step, seconds.
    pub arrival_s: f64,
    /// The median of the other ranks' arrival times at that step, seconds.
    pub others_s: f64,
}

impl Straggler {
    /// The log line naming it.
    pub fn line(&self) -> String {
        format!(
            "# straggler: rank {} is {:.2}x slower than the other ranks (arrival at the step's \
             collectives {:.1} ms against their median {:.1} ms, {WINDOW} steps in a row to \
             step {})",
            self.rank,
            self.slowdown,
            self.arrival_s * 1e3,
            self.others_s * 1e3,
            self.step
        )
    }
}

/// One rank's view of every rank's arrival times (see the module docs).
#[derive(Default)]
pub struct StragglerWatch {
    /// When this rank left the previous exchange.
    left: Option<Instant>,
    /// Every rank's arrival times of the last [`WINDOW`] steps.
    recent: VecDeque<Vec<f64>>,
    /// Ranks already named (each once per run).
    named: Vec<usize>,
}

impl StragglerWatch {
    /// A watch with nothing seen yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// After step `s`: exchanges this rank's arrival time over `group` (every rank calls it
    /// after every step) and returns a newly named straggler, if any.
    pub fn step(
        &mut self,
        group: Option<&ProcessGroup>,
        s: &StepStats,
    ) -> Result<Option<Straggler>> {
        let Some(g) = group.filter(|g| g.size() > 1) else {
            return Ok(None);
        };
        let now = Instant::now();
        let since = match self.left {
            Some(t) => (now - t).as_secs_f64(),
            None => s.seconds + s.data_seconds,
        };
        let mine = [(since - s.comm_seconds).max(0.0)];
        let mut all = vec![0f64; g.size()];
        g.all_gather(&mine, &mut all)
            .ctx(|| format!("exchanging arrival times after step {}", s.step))?;
        self.left = Some(Instant::now());
        Ok(self.observe(s.step, all))
    }

    /// Judges one step's arrival times `all` (one per rank).
    pub fn observe(&mut self, step: u64, all: Vec<f64>) -> Option<Straggler> {
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(all);
        if self.recent.len() < WINDOW {
            return None;
        }
        let mut ratios = Vec::with_capacity(WINDOW);
        let mut slow = None;
        for a in &self.recent {
            let (r, ratio) = slowest(a)?;
            if slow.is_some_and(|s| s != r) || ratio < SLOW_RATIO {
                return None;
            }
            slow = Some(r);
            ratios.push(ratio);
        }
        let rank = slow?;
        if self.named.contains(&rank) {
            return None;
        }
        self.named.push(rank);
        let last = self.recent.back()?;
        ratios.sort_by(f64::total_cmp);
        Some(Straggler {
            rank,
            slowdown: ratios[ratios.len() / 2],
            step,
            arrival_s: last[rank],
            others_s: median_without(last, rank),
        })
    }
}

/// Records a named straggler in the world group's flight recorder (every rank: a
/// post-mortem of any rank shows it) and in the metrics file, if this rank writes one.
pub fn record(
    st: &Straggler,
    group: Option<&ProcessGroup>,
    metrics: Option<&mut MetricsLog>,
) -> Result<()> {
    if let Some(g) = group {
        g.flight().event("straggler", st.line());
    }
    if let Some(m) = metrics {
        m.straggler(st)?;
    }
    Ok(())
}

/// The rank with the largest ratio of its arrival time to the median of the others', with it.
fn slowest(a: &[f64]) -> Option<(usize, f64)> {
    (0..a.len())
        .map(|r| (r, a[r] / median_without(a, r).max(1e-9)))
        .max_by(|x, y| x.1.total_cmp(&y.1))
}

/// The median of `a` without entry `skip` (the mean of the middle two when even).
fn median_without(a: &[f64], skip: usize) -> f64 {
    let mut v: Vec<f64> = (a.iter().enumerate())
        .filter(|&(i, _)| i != skip)
        .map(|(_, &x)| x)
        .collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_slow_three_steps_in_a_row_is_named_once_with_its_slowdown() {
        let mut w = StragglerWatch::new();
        assert_eq!(w.observe(1, vec![0.10, 0.11, 0.10]), None);
        assert_eq!(w.observe(2, vec![0.10, 0.30, 0.10]), None);
        assert_eq!(w.observe(3, vec![0.10, 0.31, 0.10]), None);
        // One step of noise on another rank breaks the run.
        assert_eq!(w.observe(4, vec![0.30, 0.10, 0.10]), None);
        assert_eq!(w.observe(5, vec![0.10, 0.29, 0.10]), None);
        assert_eq!(w.observe(6, vec![0.10, 0.30, 0.11]), None);
        let s = w.observe(7, vec![0.10, 0.33, 0.10]).unwrap();
        assert_eq!((s.rank, s.step), (1, 7));
        assert!((s.slowdown - 2.9).abs() < 0.11, "{s:?}");
        assert!(s.line().contains("rank 1 is 3.0") || s.line().contains("rank 1 is 2.9"));
        assert_eq!(w.observe(8, vec![0.10, 0.33, 0.10]), None, "named once");
    }

    #[test]
    fn two_ranks_compare_with_each_other_and_even_ranks_are_fine() {
        let mut w = StragglerWatch::new();
        for step in 1..=5 {
            assert_eq!(w.observe(step, vec![0.1, 0.12]), None);
        }
        let mut w = StragglerWatch::new();
        let named: Vec<_> = (1..=4)
            .filter_map(|step| w.observe(step, vec![0.3, 0.1]))
            .collect();
        assert_eq!(named.len(), 1);
        assert_eq!(named[0].rank, 0);
        assert!((named[0].slowdown - 3.0).abs() < 1e-9);
        assert_eq!(median_without(&[5.0], 0), 0.0);
    }
}
