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
//! A plan may hold several worker faults: the first strikes in generation 0, the second in
//! generation 1 (the restart the first one caused), and so on, so faults happen in every
//! generation and a chaotic run finishes when `--max-restarts` covers them (the agent refuses
//! a plan with more failing faults than restarts + 1: the later ones could never fire). A `random` step of a later generation is drawn after the last step the
//! agent saw before the generation started, so it falls after the step the generation resumes
//! from; a fixed STEP at or before that never fires. Node 0 resolves each generation's fault
//! and hands it to that generation's workers only.

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
    /// The worker faults: the one at index g strikes in generation g.
    pub faults: Vec<FaultSpec>,
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
            plan.faults.push(FaultSpec { kind, step, rank });
        }
        Ok(plan)
    }

    /// The faults that fail their generation (every kind but `slow@`): a job needs as many
    /// restarts.
    pub fn failing(&self) -> usize {
        (self.faults.iter())
            .filter(|f| !matches!(f.kind, FaultKind::Slow(_)))
            .count()
    }

    /// The concrete fault of generation 0 for a run of `steps` steps on `world` ranks
    /// ([`Chaos::resolve_in`]).
    pub fn resolve(&self, seed: u64, steps: u64, world: usize) -> Result<Option<Fault>> {
        self.resolve_in(0, 0, seed, steps, world)
    }

    /// The concrete fault of generation `g` (the plan's fault at index g, if any) for a run of
    /// `steps` steps on `world` ranks, the agent having seen steps up to `after` before the
    /// generation started: random choices are drawn from `seed` and `g` (a step in
    /// after+1..steps, so steps remain after it; `None` when no step is left to draw).
    pub fn resolve_in(
        &self,
        g: u64,
        after: u64,
        seed: u64,
        steps: u64,
        world: usize,
    ) -> Result<Option<Fault>> {
        let Some(&f) = usize::try_from(g).ok().and_then(|i| self.faults.get(i)) else {
            return Ok(None);
        };
        let mut rng = SplitMix(seed ^ g.wrapping_mul(0xa076_1d64_78bd_642f));
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
            StepSpec::Random if after + 1 >= steps => return Ok(None),
            StepSpec::Random => after + 1 + rng.next() % (steps - after - 1),
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
        match plan.faults[..] {
            [
                FaultSpec {
                    kind,
                    step: StepSpec::At(step),
                    rank: Some(rank),
                },
            ] => Ok(Fault { kind, step, rank }),
            _ => Err(bad(text, "expected a resolved fault KIND@STEP:RANK")),
        }
    }

    /// Called by a worker after it completes `step`: strikes if this is the fault's rank and
    /// step (the agent hands a fault only to the workers of the generation it belongs to).
    /// `publish` makes sure the agent has seen the completed step first (a heartbeat flush). A
    /// stall never returns before `stall_limit`.
    pub fn strike(
        &self,
        rank: usize,
        step: u64,
        publish: impl FnOnce(),
        stall_limit: Duration,
    ) -> Result<()> {
        if rank != self.rank || step != self.step {
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
    /// A `slow@` fault's delay after rank `rank` computed step `step` in `compute`:
    /// (FACTOR - 1) x `compute` for every step after the fault's step, so the rank's steps
    /// take FACTOR times as long; `None` for other faults, ranks and steps.
    pub fn slow_delay(&self, rank: usize, step: u64, compute: Duration) -> Option<Duration> {
        match self.kind {
            FaultKind::Slow(_) if rank == self.rank && step > self.step => {
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
    fn faults_strike_only_their_rank_and_step() {
        let f = Fault {
            kind: FaultKind::Stall,
            step: 3,
            rank: 1,
        };
        let quick = Duration::from_millis(1);
        assert!(f.strike(0, 3, || {}, quick).is_ok());
        assert!(f.strike(1, 2, || {}, quick).is_ok());
        let mut published = false;
        let e = f.strike(1, 3, || published = true, quick).unwrap_err();
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
        assert_eq!(f.slow_delay(1, 5, c), None);
        assert_eq!(f.slow_delay(1, 6, c), Some(Duration::from_millis(200)));
        assert_eq!(f.slow_delay(0, 6, c), None);
        assert!(f.strike(1, 5, || {}, c).is_ok());
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
    fn later_faults_belong_to_later_generations_and_fall_after_the_last_step_seen() {
        let c = Chaos::parse("kill@random,hang@random:1,slow@2:0:2").unwrap();
        assert_eq!(c.failing(), 2);
        for seed in 0..50 {
            let f0 = c.resolve_in(0, 0, seed, 10, 2).unwrap().unwrap();
            assert_eq!(f0.kind, FaultKind::Kill);
            assert!((1..10).contains(&f0.step));
            let f1 = c.resolve_in(1, 6, seed, 10, 2).unwrap().unwrap();
            assert!((7..10).contains(&f1.step) && f1.rank == 1, "{f1}");
            assert_eq!(c.resolve_in(1, 6, seed, 10, 2).unwrap(), Some(f1));
        }
        assert_eq!(c.resolve_in(1, 9, 0, 10, 2).unwrap(), None, "no step left");
        assert_eq!(
            c.resolve_in(2, 9, 0, 10, 2).unwrap().unwrap().to_string(),
            "slow@2:0:2"
        );
        assert_eq!(c.resolve_in(3, 0, 0, 10, 2).unwrap(), None);
    }

    #[test]
    fn corrupting_an_empty_directory_does_nothing() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(corrupt_newest(d.path()).unwrap(), None);
        assert_eq!(corrupt_newest(&d.path().join("absent")).unwrap(), None);
    }
}
