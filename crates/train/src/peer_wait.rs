//! Exposed communication with the slower ranks' compute taken out.
//!
//! A rank that finishes its backward first waits at the gradient all-reduce until the others
//! have sent their part: the wait it measures (a step's `comm_seconds`) is the communication
//! left after its backward *plus* the time until the slowest rank joined (file 000,
//! "屏障语义与失效模式": the slowest member sets the pace of a collective). Only the last
//! rank to arrive measures the first part alone. So per step the communication that the
//! schedule leaves exposed is the smallest wait over the ranks, and the rest of each rank's
//! wait is time spent waiting for slower ranks: load imbalance, or a core that was busy
//! elsewhere for a moment. The two call for different fixes (overlap and bucket sizes for the
//! first; balance, or a quieter machine, for the second), so the summary reports both.
//!
//! The split needs every rank's waits: [`gather_split`] all-gathers them once, at the end of
//! a run (one small collective, nothing per step).

use comm::group::ProcessGroup;

use crate::error::{Result, TrainError};

/// One rank's communication waits over a run, split (seconds, summed over the steps).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WaitSplit {
    /// Communication exposed after the slowest rank's compute: per step, the smallest wait
    /// over the ranks.
    pub exposed_s: f64,
    /// Time this rank waited for slower ranks: its own waits less `exposed_s`.
    pub peer_wait_s: f64,
}

/// Splits `own` (this rank's wait per step) given `all`, every rank's waits for the same
/// steps, rank-major (`all[r * own.len() + j]` is rank `r`'s wait at step `j`; `own` is one of
/// the rows).
///
/// # Errors
/// [`TrainError::Config`] when `all` is not a whole number of rows of `own.len()`, or a wait
/// is negative or not finite.
pub fn split_waits(own: &[f64], all: &[f64]) -> Result<WaitSplit> {
    let steps = own.len();
    let bad = |reason: String| TrainError::Config {
        field: "per-step communication waits",
        value: format!("{} of one rank, {} of all ranks", steps, all.len()),
        reason,
    };
    if steps == 0 {
        return Ok(WaitSplit::default());
    }
    if all.is_empty() || !all.len().is_multiple_of(steps) {
        return Err(bad(format!(
            "all ranks' waits must be whole rows of {steps} steps"
        )));
    }
    if let Some(w) = all.iter().chain(own).find(|w| !w.is_finite() || **w < 0.0) {
        return Err(bad(format!("a wait of {w} s is not a finite duration")));
    }
    let mut split = WaitSplit::default();
    for (j, &mine) in own.iter().enumerate() {
        let least = all
            .iter()
            .skip(j)
            .step_by(steps)
            .fold(mine, |m, &w| m.min(w));
        split.exposed_s += least;
        split.peer_wait_s += mine - least;
    }
    Ok(split)
}

/// All-gathers every rank's per-step waits over `group` and splits this rank's `own`
/// ([`split_waits`]). Every rank must call it with the same number of steps.
///
/// # Errors
/// A failed collective, or the errors of [`split_waits`].
pub fn gather_split(group: &ProcessGroup, own: &[f64]) -> Result<WaitSplit> {
    let mut all = vec![0f64; own.len() * group.size()];
    group.all_gather(own, &mut all)?;
    split_waits(own, &all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_rank_to_arrive_sets_the_exposed_part() {
        // Rank 0 waits 0.30 s at step 1 because rank 1's compute ran 0.29 s long there.
        let r0 = [0.010, 0.300, 0.008];
        let r1 = [0.012, 0.010, 0.009];
        let all: Vec<f64> = r0.iter().chain(&r1).copied().collect();
        let s0 = split_waits(&r0, &all).unwrap();
        let s1 = split_waits(&r1, &all).unwrap();
        for s in [s0, s1] {
            assert!(
                (s.exposed_s - (0.010 + 0.010 + 0.008)).abs() < 1e-12,
                "{s:?}"
            );
        }
        assert!((s0.peer_wait_s - 0.290).abs() < 1e-12, "{s0:?}");
        assert!((s1.peer_wait_s - (0.002 + 0.001)).abs() < 1e-12, "{s1:?}");
        // Own waits are always exposed + waiting for others.
        assert!((s0.exposed_s + s0.peer_wait_s - r0.iter().sum::<f64>()).abs() < 1e-12);
    }

    #[test]
    fn one_rank_or_no_steps_has_nothing_to_split_off() {
        let own = [0.1, 0.2];
        let s = split_waits(&own, &own).unwrap();
        assert_eq!(s.peer_wait_s, 0.0);
        assert!((s.exposed_s - 0.3).abs() < 1e-12);
        assert_eq!(split_waits(&[], &[]).unwrap(), WaitSplit::default());
    }

    #[test]
    fn ragged_or_impossible_waits_are_refused_by_name() {
        let e = split_waits(&[0.1, 0.2], &[0.1, 0.2, 0.3]).unwrap_err();
        assert!(e.to_string().contains("whole rows of 2 steps"), "{e}");
        let e = split_waits(&[0.1], &[0.1, f64::NAN]).unwrap_err();
        assert!(e.to_string().contains("not a finite duration"), "{e}");
        let e = split_waits(&[-0.1], &[-0.1]).unwrap_err();
        assert!(
            e.to_string().contains("per-step communication waits"),
            "{e}"
        );
    }
}
