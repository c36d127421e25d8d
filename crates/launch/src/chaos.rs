//! Chaos: faults injected on purpose to exercise recovery (001 section 12.8: rehearse the
//! recovery for real, do not wait for the incident).
//!
//! A plan is a comma-separated list of:
//! - `kill@STEP[:RANK]`: that worker SIGKILLs itself right after completing STEP;
//! - `hang@STEP[:RANK]`: it SIGSTOPs itself there (caught by the heartbeat timeout);
//! - `stall@STEP[:RANK]`: it stops progressing while its heartbeat thread lives (caught by
//!   the watchdog);
//! - `slow@STEP[:RANK]:FACTOR`: fail-slow: from the step after STEP on, that worker's steps
//!   take FACTOR times as long (after each it sleeps FACTOR - 1 times that step's compute; the
//!   numbers it computes do not change, only their timing);
//! - `corrupt-newest`: before a restart the agent flips a byte of the newest committed
//!   checkpoint, so recovery must fall back to the one before.
//!
//! STEP may be `random` and RANK may be omitted: both are then drawn from the chaos seed.
//! Faults fire only in generation 0, so a chaotic run always finishes.

use crate::error::{LaunchError, Result};
use std::fmt;
use std::path::Path;
use std::time::Duration;

/// What a worker does to itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// SIGKILL itself.
    Kill,
    /// SIGSTOP itself.
    Hang,
    /// Stop making progress (sleep in the loop).
    Stall,
    /// Fail-slow: every step from the next one on takes this many hundredths times as long.
    Slow(u32),
}

/// The largest `slow@` factor (a bigger one is a stall: use `stall@`).
pub const MAX_SLOW_FACTOR: f64 = 100.0;

impl FaultKind {
    /// The slowdown factor of a [`FaultKind::Slow`] (1 for the others).
    pub fn factor(self) -> f64 {
        match self {
            FaultKind::Slow(h) => f64::from(h) / 100.0,
            _ => 1.0,
        }
    }
}

/// A step given as a number or `random`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepSpec {
    /// This step.
    At(u64),
    /// Drawn from the seed.
    Random,
}

/// One worker fault as written; see [`Chaos::resolve`] for the concrete one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultSpec {
    /// What happens.
    pub kind: FaultKind,
    /// After which step.
    pub step: StepSpec,
    /// To which rank (`None`: drawn from the seed).
    pub rank: Option<usize>,
}

/// A concrete fault: `kind` strikes `rank` right after it completes `step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// What happens.
    pub kind: FaultKind,
    /// After which step.
    pub step: u64,
    /// Which rank.
    pub rank: usize,
}

/// A parsed `--chaos` plan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chaos {
    /// The worker fault, if any.
    pub fault: Option<FaultSpec>,
    /// Corrupt the newest committed checkpoint before restarting.
    pub corrupt_newest: bool,
}

fn bad(value: &str, why: impl Into<String>) -> LaunchError {
    LaunchError::invalid("--chaos", value, why)
}

impl Chaos {
    /// Parses a plan such as `kill@random,corrupt-newest` or `hang@4:1`.
    pub fn parse(text: &str) -> Result<Chaos> {
        let mut plan = Chaos::default();
        for item in text.split(',').map(str::trim) {
            if item == "corrupt-newest" {
                plan.corrupt_newest = true;
                continue;
            }
            let expected = "expected kill@STEP[:RANK], hang@STEP[:RANK], stall@STEP[:RANK], \
                            slow@STEP[:RANK]:FACTOR or corrupt-newest (STEP may be 'random')";
            let (kind, rest) = item.split_once('@').ok_or_else(|| bad(item, expected))?;
            let (kind, rest) = match kind {
                "kill" => (FaultKind::Kill, rest),
                "hang" => (FaultKind::Hang, rest),
                "stall" => (FaultKind::Stall, rest),
                "slow" => {
                    let (rest, factor) = rest.rsplit_once(':').ok_or_else(|| {
                        bad(item, "expected slow@STEP[:RANK]:FACTOR (e.g. slow@5:1:3)")
                    })?;
                    let f: f64 = factor.parse().map_err(|_| {
                        bad(item, "FACTOR must be a number (how many times slower)")
                    })?;
                    if !(f > 1.0 && f <= MAX_SLOW_FACTOR) {
                        return Err(bad(
                            item,
                            format!("FACTOR must be above 1 and at most {MAX_SLOW_FACTOR}"),
                        ));
                    }
                    (FaultKind::Slow((f * 100.0).round() as u32), rest)
                }
                _ => return Err(bad(item, expected)),
            };
            let (step, rank) = match rest.split_once(':') {
                Some((s, r)) => (s, Some(r)),
                None => (rest, None),
            };
            let step = match step {
                "random" => StepSpec::Random,
                s => match s.parse::<u64>() {
                    Ok(n) if n >= 1 => StepSpec::At(n),
                    _ => return Err(bad(item, "STEP must be a step number >= 1 or 'random'")),
                },
            };
            let rank = rank
                .map(|r| r.parse::<usize>())
                .transpose()
                .map_err(|_| bad(item, "RANK must be a rank number"))?;
            if plan.fault.is_some() {
                return Err(bad(text, "at most one worker fault per run"));
            }
            plan.fault = Some(FaultSpec { kind, step, rank });
        }
        Ok(plan)
    }

    /// The concrete fault for a run of `steps` steps on `world` ranks: random choices are drawn
    /// from `seed` (a step in 1..steps, so steps remain after it).
    pub fn resolve(&self, seed: u64, steps: u64, world: usize) -> Result<Option<Fault>> {
        let Some(f) = self.fault else { return Ok(None) };
        let mut rng = SplitMix(seed);
        let step = match f.step {
            StepSpec::At(s) if s >= steps => {
                return Err(bad(
                    &format!("{s}"),
                    format!("the fault step must be below --steps {steps}, or it never fires"),
                ));
            }
            StepSpec::At(s) => s,
            StepSpec::Random if steps < 2 => {
                return Err(bad("random", "a random fault step needs --steps >= 2"));
            }
            StepSpec::Random => 1 + rng.next() % (steps - 1),
        };
        let rank = match f.rank {
            Some(r) if r >= world => {
                return Err(bad(
                    &r.to_string(),
                    format!("no rank {r} in a world of {world}"),
                ));
            }
            Some(r) => r,
            None => (rng.next() % world.max(1) as u64) as usize,
        };
        Ok(Some(Fault {
            kind: f.kind,
            step,
            rank,
        }))
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            FaultKind::Kill => "kill",
            FaultKind::Hang => "hang",
            FaultKind::Stall => "stall",
            FaultKind::Slow(_) => "slow",
        };
        write!(f, "{kind}@{}:{}", self.step, self.rank)?;
        if let FaultKind::Slow(_) = self.kind {
            write!(f, ":{}", self.kind.factor())?;
        }
        Ok(())
    }
}

impl Fault {
    /// Parses [`Fault`]'s display form (what the agent hands its workers).
    pub fn parse(text: &str) -> Result<Fault> {
        let plan = Chaos::parse(text)?;
        match plan.fault {
            Some(FaultSpec {
                kind,
                step: StepSpec::At(step),
                rank: Some(rank),
            }) => Ok(Fault { kind, step, rank }),
            _ => Err(bad(text, "expected a resolved fault KIND@STEP:RANK")),
        }
    }

    /// Called by a worker after it completes `step`: strikes if this is the fault's rank and
    /// step and the worker belongs to generation 0. `publish` makes sure the agent has seen the
    /// completed step first (a heartbeat flush). A stall never returns before `stall_limit`.
    pub fn strike(
        &self,
        rank: usize,
        step: u64,
        generation: u64,
        publish: impl FnOnce(),
        stall_limit: Duration,
    ) -> Result<()> {
        if generation != 0 || rank != self.rank || step != self.step {
            return Ok(());
        }
        if let FaultKind::Slow(_) = self.kind {
            eprintln!(
                "flotilla: chaos: {self}: rank {rank} is slow from step {} on",
                step + 1
            );
            return Ok(());
        }
        publish();
        eprintln!("flotilla: chaos: {self} strikes rank {rank} after step {step}");
        match self.kind {
            // SAFETY: raising a signal on this process has no memory-safety preconditions.
            FaultKind::Kill => unsafe {
                libc::raise(libc::SIGKILL);
            },
            // SAFETY: as above; the process stops here until SIGCONT or SIGKILL.
            FaultKind::Hang => unsafe {
                libc::raise(libc::SIGSTOP);
            },
            FaultKind::Stall => std::thread::sleep(stall_limit),
            FaultKind::Slow(_) => return Ok(()),
        }
        Err(LaunchError::Aborted(format!(
            "chaos {self} on rank {rank}: the agent did not stop this worker within {stall_limit:?}"
        )))
    }
}

impl Fault {
    /// A `slow@` fault's delay after rank `rank` (of generation `generation`) computed step
    /// `step` in `compute`: (FACTOR - 1) x `compute` for every step after the fault's step, so
    /// the rank's steps take FACTOR times as long; `None` for other faults, ranks, steps and
    /// generations.
    pub fn slow_delay(
        &self,
        rank: usize,
        step: u64,
        generation: u64,
        compute: Duration,
    ) -> Option<Duration> {
        match self.kind {
            FaultKind::Slow(_) if generation == 0 && rank == self.rank && step > self.step => {
                Some(compute.mul_f64(self.kind.factor() - 1.0))
            }
            _ => None,
        }
    }
}

/// Flips the last byte of rank 0's file in the newest committed step under `dir`; returns that
/// step (`None` when nothing is committed).
pub fn corrupt_newest(dir: &Path) -> Result<Option<u64>> {
    if !dir.exists() {
        return Ok(None);
    }
    let Some(&step) = ckpt::list_committed(dir)?.last() else {
        return Ok(None);
    };
    let file = dir
        .join(ckpt::names::step_dir_name(step))
        .join(ckpt::rank_file_name(0));
    let mut bytes =
        std::fs::read(&file).map_err(|e| LaunchError::io(format!("read {}", file.display()), e))?;
    let Some(last) = bytes.last_mut() else {
        return Err(LaunchError::invalid(
            "checkpoint file",
            file.display().to_string(),
            "is empty",
        ));
    };
    *last ^= 0x5a;
    std::fs::write(&file, &bytes)
        .map_err(|e| LaunchError::io(format!("write {}", file.display()), e))?;
    Ok(Some(step))
}

/// SplitMix64: a few well-mixed numbers from a seed.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse_and_resolve() {
        let c = Chaos::parse("kill@4:1,corrupt-newest").unwrap();
        assert!(c.corrupt_newest);
        let f = c.resolve(0, 10, 2).unwrap().unwrap();
        assert_eq!(f.to_string(), "kill@4:1");
        assert_eq!(Fault::parse("kill@4:1").unwrap(), f);
        let r = Chaos::parse("hang@random").unwrap();
        for seed in 0..50 {
            let f = r.resolve(seed, 6, 3).unwrap().unwrap();
            assert!((1..6).contains(&f.step) && f.rank < 3, "{f}");
            assert_eq!(r.resolve(seed, 6, 3).unwrap(), Some(f), "deterministic");
        }
        assert_eq!(
            Chaos::parse("corrupt-newest")
                .unwrap()
                .resolve(1, 5, 2)
                .unwrap(),
            None
        );
    }

    #[test]
    fn bad_plans_are_named() {
        for (plan, needle) in [
            ("explode@3", "explode@3"),
            ("kill@0", "STEP"),
            ("kill@x", "STEP"),
            ("kill@3:a", "RANK"),
            ("kill@3,hang@4", "at most one"),
        ] {
            let e = Chaos::parse(plan).unwrap_err().to_string();
            assert!(e.contains("--chaos") && e.contains(needle), "{plan}: {e}");
        }
        let c = Chaos::parse("kill@9:5").unwrap();
        assert!(
            c.resolve(0, 9, 2)
                .unwrap_err()
                .to_string()
                .contains("--steps 9")
        );
        let c = Chaos::parse("kill@3:5").unwrap();
        assert!(
            c.resolve(0, 9, 2)
                .unwrap_err()
                .to_string()
                .contains("no rank 5")
        );
        assert!(Fault::parse("kill@random").is_err());
    }

    #[test]
    fn faults_strike_only_their_rank_step_and_generation_zero() {
        let f = Fault {
            kind: FaultKind::Stall,
            step: 3,
            rank: 1,
        };
        let quick = Duration::from_millis(1);
        assert!(f.strike(0, 3, 0, || {}, quick).is_ok());
        assert!(f.strike(1, 2, 0, || {}, quick).is_ok());
        assert!(f.strike(1, 3, 1, || {}, quick).is_ok());
        let mut published = false;
        let e = f.strike(1, 3, 0, || published = true, quick).unwrap_err();
        assert!(published && e.to_string().contains("stall@3:1"), "{e}");
    }

    #[test]
    fn slow_faults_parse_round_trip_and_only_delay_their_rank_after_their_step() {
        let c = Chaos::parse("slow@5:1:3").unwrap();
        let f = c.resolve(0, 20, 2).unwrap().unwrap();
        assert_eq!(f.to_string(), "slow@5:1:3");
        assert_eq!(Fault::parse("slow@5:1:3").unwrap(), f);
        assert_eq!(Fault::parse("slow@5:1:2.5").unwrap().kind.factor(), 2.5);
        let r = Chaos::parse("slow@random:1.5").unwrap().resolve(3, 9, 4);
        assert_eq!(r.unwrap().unwrap().kind, FaultKind::Slow(150));
        let c = Duration::from_millis(100);
        assert_eq!(f.slow_delay(1, 5, 0, c), None);
        assert_eq!(f.slow_delay(1, 6, 0, c), Some(Duration::from_millis(200)));
        assert_eq!(f.slow_delay(0, 6, 0, c), None);
        assert_eq!(f.slow_delay(1, 6, 1, c), None);
        assert!(f.strike(1, 5, 0, || {}, c).is_ok());
        for (plan, needle) in [
            ("slow@5", "slow@STEP[:RANK]:FACTOR"),
            ("slow@5:1:x", "FACTOR must be a number"),
            ("slow@5:1:1", "above 1"),
            ("slow@5:1:NaN", "above 1"),
            ("slow@5:1:1e9", "at most 100"),
        ] {
            let e = Chaos::parse(plan).unwrap_err().to_string();
            assert!(e.contains(needle), "{plan}: {e}");
        }
    }

    #[test]
    fn corrupting_an_empty_directory_does_nothing() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(corrupt_newest(d.path()).unwrap(), None);
        assert_eq!(corrupt_newest(&d.path().join("absent")).unwrap(), None);
    }
}
