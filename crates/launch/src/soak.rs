//! `--chaos soak:N`: N faults of random kinds over one run, every one to be recovered (issue
//! 29's soak; the long one is a benchmark, `scripts/soak.sh`).
//!
//! The agent of node 0 draws the N kinds from the chaos seed before the job starts
//! ([`expand`]): kill, hang and slow, plus partition when the job has several nodes (a partition
//! cuts off a node other than node 0). The drawn plan then runs like any other (see
//! [`crate::chaos`]): it is cut into episodes at each failing fault, episode g strikes in
//! generation g, so the job needs `--max-restarts` of at least the failing faults less one,
//! and a slow fault rides with the failing fault after it: its rank is slow from a step before
//! that fault's until the fault ends the generation (a restart, which brings every rank back at
//! full speed). A slow fault drawn after the last failing fault slows the final generation to
//! the end.
//!
//! Steps: a plan's `random` step is drawn after the last step seen, up to the end of the run,
//! which would spend a long run's steps in a handful of generations. A soak's steps are
//! windowed instead ([`window`]): each failing fault falls in the next `(steps left) / (failing
//! faults left)` steps, at least 2 after the last step seen (room for a slow fault before it),
//! and never so late that the faults after it run out of steps; a run of `--steps` S holds
//! a soak of F failing faults when S >= 2F + 1 (refused otherwise).
//!
//! Soaks run only in rigid jobs: an elastic job shrinks at each lost node and never grows back
//! yet, so a long soak would end at MIN nodes with faults it could not place.

use crate::chaos::{Chaos, FaultKind, FaultSpec, SplitMix, StepSpec, bad};
use crate::error::Result;

/// The most faults of one soak.
pub const MAX_SOAK: u32 = 100_000;

/// Parses the N of `soak:N` (`item` is the whole plan item, for the message).
pub(crate) fn parse_count(item: &str, n: &str) -> Result<u32> {
    n.parse::<u32>()
        .ok()
        .filter(|n| (1..=MAX_SOAK).contains(n))
        .ok_or_else(|| {
            bad(
                item,
                format!("N must be a number of faults from 1 to {MAX_SOAK}"),
            )
        })
}

/// `plan` with its `soak:N` drawn from `seed` as N faults for a rigid job of `nnodes` nodes and
/// `steps` steps (see the module docs); a plan without a soak is returned as it is.
///
/// # Errors
/// An elastic job (`elastic`), or too few steps for the failing faults drawn.
pub fn expand(plan: &Chaos, seed: u64, nnodes: usize, elastic: bool, steps: u64) -> Result<Chaos> {
    let Some(n) = plan.soak else {
        return Ok(plan.clone());
    };
    let item = format!("soak:{n}");
    if elastic {
        return Err(bad(
            &item,
            "a soak needs a rigid job (--nnodes N): an elastic job shrinks at each lost node \
             and is never grown back, so a soak's later faults would find no node to strike",
        ));
    }
    let mut rng = SplitMix(seed ^ 0x5041_4b53_0000_0000);
    let kinds: &[FaultKind] = if nnodes > 1 {
        &[
            FaultKind::Kill,
            FaultKind::Hang,
            FaultKind::Slow(200),
            FaultKind::Partition(None),
        ]
    } else {
        &[FaultKind::Kill, FaultKind::Hang, FaultKind::Slow(200)]
    };
    let faults = (0..n)
        .map(|_| {
            let kind = match kinds[(rng.next() % kinds.len() as u64) as usize] {
                // A slowdown of 1.5x, 2x or 3x.
                FaultKind::Slow(_) => FaultKind::Slow([150, 200, 300][(rng.next() % 3) as usize]),
                k => k,
            };
            FaultSpec {
                kind,
                step: StepSpec::Random,
                rank: None,
            }
        })
        .collect();
    let drawn = Chaos {
        faults,
        corrupt_newest: false,
        soak: Some(n),
        windowed: true,
    };
    let failing = drawn.failing() as u64;
    if steps < 2 * failing + 1 {
        return Err(bad(
            &item,
            format!(
                "seed {seed} draws {failing} failing faults, each at least 2 steps after the \
                 last: they need --steps of at least {} (this run has {steps})",
                2 * failing + 1
            ),
        ));
    }
    Ok(drawn)
}

/// The steps a windowed random fault of `kind` may strike after (inclusive bounds), the agent
/// having seen steps up to `after`, in a run of `steps` steps with `left` failing faults from
/// this generation's on; `failing` is the step of this generation's failing fault, drawn first.
/// `None`: no step is left.
pub(crate) fn window(
    after: u64,
    steps: u64,
    left: usize,
    failing: Option<u64>,
    kind: FaultKind,
) -> Option<(u64, u64)> {
    let last = steps.checked_sub(1)?;
    if kind.fails() {
        // Every failing fault after this one needs 2 steps of its own.
        let k = u64::try_from(left.max(1)).ok()?;
        let reserve = 2 * (k - 1);
        let span = last.saturating_sub(after);
        let width = (span / k).max(2);
        let lo = after + 2;
        let hi = (after + width).min(last.checked_sub(reserve)?);
        return (lo <= hi).then_some((lo, hi));
    }
    // A slow fault: from a step its generation reaches up to the step before its failing
    // fault, so it slows at least one step.
    let lo = after.max(1);
    let hi = failing.map_or(last, |f| f.saturating_sub(1));
    (lo <= hi).then_some((lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::{Draw, Fault};
    use std::time::Duration;

    fn draw(members: &[usize], steps: u64) -> Draw<'_> {
        Draw {
            seed: 7,
            steps,
            nproc: 1,
            members,
            partition_default: Duration::from_secs(6),
        }
    }

    /// Plays a soak out as the agent would, each generation's failing fault ending it at its
    /// step: every drawn fault strikes, in order, before the run's last step.
    fn play(plan: &Chaos, steps: u64, members: &[usize]) -> Vec<Fault> {
        let (mut after, mut all) = (0, Vec::new());
        for g in 0..=plan.failing() as u64 {
            let faults = plan.resolve_in(g, after, &draw(members, steps)).unwrap();
            assert_eq!(
                faults.len(),
                plan.episode(g).len(),
                "generation {g}: {faults:?}"
            );
            let failing: Vec<&Fault> = faults.iter().filter(|f| f.kind.fails()).collect();
            for f in &faults {
                assert!(
                    f.step >= after.max(1) && f.step < steps,
                    "{f} after {after}"
                );
                if let Some(end) = failing.first() {
                    assert!(
                        f.kind.fails() || f.step < end.step,
                        "{f} before {}",
                        end.step
                    );
                }
            }
            if let Some(end) = failing.first() {
                assert!(end.step >= after + 2, "{end} after {after}");
                after = end.step;
            }
            all.extend(faults);
        }
        all
    }

    #[test]
    fn a_soak_draws_every_kind_and_every_fault_strikes_in_time() {
        for seed in 0..20 {
            let plan = Chaos::parse("soak:40").unwrap();
            let plan = expand(&plan, seed, 3, false, 400).unwrap();
            assert_eq!(plan.faults.len(), 40);
            let all = play(&plan, 400, &[0, 1, 2]);
            assert_eq!(all.len(), 40, "seed {seed}");
            for kind in ["kill", "hang", "slow", "partition"] {
                assert!(
                    all.iter().any(|f| f.kind.name() == kind),
                    "seed {seed}: {kind}"
                );
            }
            assert!(all.iter().all(|f| f.partition().is_none() || f.rank != 0));
            let again = expand(&Chaos::parse("soak:40").unwrap(), seed, 3, false, 400);
            assert_eq!(again.unwrap(), plan, "deterministic");
        }
        // A single node draws no partition; the tightest run still fits every fault.
        let plan = expand(&Chaos::parse("soak:30").unwrap(), 3, 1, false, 1000).unwrap();
        assert!(plan.faults.iter().all(|f| f.kind.name() != "partition"));
        let tight = 2 * plan.failing() as u64 + 1;
        let plan = expand(&Chaos::parse("soak:30").unwrap(), 3, 1, false, tight).unwrap();
        assert_eq!(play(&plan, tight, &[0]).len(), 30);
    }

    #[test]
    fn soaks_are_refused_where_they_cannot_run() {
        let plan = Chaos::parse("soak:10").unwrap();
        let e = expand(&plan, 1, 3, true, 100).unwrap_err().to_string();
        assert!(e.contains("rigid job"), "{e}");
        let e = expand(&plan, 1, 3, false, 5).unwrap_err().to_string();
        assert!(e.contains("--steps of at least"), "{e}");
        for (text, needle) in [
            ("soak:0", "from 1 to"),
            ("soak:x", "from 1 to"),
            ("soak:3,kill@2", "alone"),
            ("soak:3,corrupt-newest", "alone"),
        ] {
            let e = Chaos::parse(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }
}
