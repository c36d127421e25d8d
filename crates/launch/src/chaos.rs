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
//! - `partition@STEP[:NODE[:SECONDS]]`: right after STEP, node NODE (its agent and every worker
//!   on it) is cut off the network for SECONDS, then heals ([`crate::partition`]): silence, not
//!   a reset, so the other nodes notice it only through their timeouts;
//! - `corrupt-newest`: before a restart the agent flips a byte of the newest committed
//!   checkpoint, so recovery must fall back to the one before;
//! - `soak:N` (alone): N faults of random kinds (kill, hang, slow, and partition on a job of
//!   several nodes) drawn from the chaos seed, over one run ([`crate::soak`]).
//!
//! STEP may be `random`, and RANK or NODE omitted: they are then drawn from the chaos seed.
//! Every fault but `slow@` fails its generation. The plan is cut into episodes, each ending
//! with a failing fault: episode 0 strikes in generation 0, episode 1 in generation 1 (the
//! restart the first failure caused), and so on, so faults happen in every generation and a
//! chaotic run finishes when `--max-restarts` covers them (the agent refuses a plan with more
//! failing faults than restarts + 1: the later ones could never fire). A `slow@` fault rides
//! with the failing fault after it (or, after the last one, with the final generation): it
//! slows its rank until its generation ends, which costs time, never a restart. A `random` step
//! of a later generation is drawn after the last step the agent saw before the generation
//! started, so it falls after the step the generation resumes from; a fixed STEP at or before
//! that never fires. Node 0 resolves each generation's faults and hands them to that
//! generation's workers only (a partition's only to the workers of its node).

use crate::error::{LaunchError, Result};
use std::fmt;
use std::path::Path;
use std::time::Duration;

/// What a worker (or, for a partition, a node) does to itself.
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
    /// The node is cut off the network for this many seconds (`None` in a plan: the default,
    /// [`Chaos::resolve_in`]; a resolved fault always has it).
    Partition(Option<u32>),
}

/// The largest `slow@` factor (a bigger one is a stall: use `stall@`).
pub const MAX_SLOW_FACTOR: f64 = 100.0;
/// The longest partition, in seconds (a longer one is a lost node: kill its agent instead).
pub const MAX_PARTITION_SECS: u32 = 3600;

impl FaultKind {
    /// The slowdown factor of a [`FaultKind::Slow`] (1 for the others).
    pub fn factor(self) -> f64 {
        match self {
            FaultKind::Slow(h) => f64::from(h) / 100.0,
            _ => 1.0,
        }
    }

    /// Whether the fault fails its generation (every kind but `slow@`).
    pub fn fails(self) -> bool {
        !matches!(self, FaultKind::Slow(_))
    }

    /// The plan's name of the kind.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Hang => "hang",
            FaultKind::Stall => "stall",
            FaultKind::Slow(_) => "slow",
            FaultKind::Partition(_) => "partition",
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

/// One fault as written; see [`Chaos::resolve_in`] for the concrete one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultSpec {
    /// What happens.
    pub kind: FaultKind,
    /// After which step.
    pub step: StepSpec,
    /// To which rank, or for a partition which node (`None`: drawn from the seed).
    pub rank: Option<usize>,
}

/// A concrete fault: `kind` strikes `rank` (for a partition: node `rank`) right after it
/// completes `step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// What happens.
    pub kind: FaultKind,
    /// After which step.
    pub step: u64,
    /// Which rank; for [`FaultKind::Partition`], which node.
    pub rank: usize,
}

/// A parsed `--chaos` plan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chaos {
    /// The faults, in order: cut into episodes after each failing fault, episode g striking in
    /// generation g (see the module docs).
    pub faults: Vec<FaultSpec>,
    /// Corrupt the newest committed checkpoint before restarting.
    pub corrupt_newest: bool,
    /// `soak:N`: N random faults, to be drawn by [`Chaos::soak_faults`] (`faults` is then empty
    /// until the agent draws them).
    pub soak: Option<u32>,
    /// Random steps fall in a window after the last step seen, sized so that every failing
    /// fault still has steps to strike in ([`crate::soak`]; set for a drawn soak).
    pub windowed: bool,
}

/// What a plan is resolved against, one generation at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draw<'a> {
    /// Seed of the random choices.
    pub seed: u64,
    /// Steps of the run.
    pub steps: u64,
    /// Workers per node.
    pub nproc: usize,
    /// The nodes of the generation (node 0 first); world = nproc x their number.
    pub members: &'a [usize],
    /// A partition's duration when the plan gives none.
    pub partition_default: Duration,
}

pub(crate) fn bad(value: &str, why: impl Into<String>) -> LaunchError {
    LaunchError::invalid("--chaos", value, why)
}

impl Chaos {
    /// Parses a plan such as `kill@random,corrupt-newest`, `hang@4:1`, `partition@3:2:8` or
    /// `soak:20`.
    pub fn parse(text: &str) -> Result<Chaos> {
        let mut plan = Chaos::default();
        for item in text.split(',').map(str::trim) {
            if item == "corrupt-newest" {
                plan.corrupt_newest = true;
                continue;
            }
            if let Some(n) = item.strip_prefix("soak:") {
                plan.soak = Some(crate::soak::parse_count(item, n)?);
                continue;
            }
            plan.faults.push(parse_fault(item)?);
        }
        if plan.soak.is_some() && (plan.corrupt_newest || !plan.faults.is_empty()) {
            return Err(bad(
                text,
                "soak:N draws its own faults: give it alone, without other faults or corrupt-newest",
            ));
        }
        Ok(plan)
    }

    /// The faults that fail their generation (every kind but `slow@`): a job needs as many
    /// restarts.
    pub fn failing(&self) -> usize {
        self.faults.iter().filter(|f| f.kind.fails()).count()
    }

    /// The faults of generation `g`: the g-th episode (the failing fault that ends it and the
    /// `slow@` faults before it), or after the last failing fault the `slow@` faults left.
    pub fn episode(&self, g: u64) -> &[FaultSpec] {
        let mut start = 0;
        let mut episode = 0u64;
        for (i, f) in self.faults.iter().enumerate() {
            if f.kind.fails() {
                if episode == g {
                    return &self.faults[start..=i];
                }
                episode += 1;
                start = i + 1;
            }
        }
        if episode == g {
            &self.faults[start..]
        } else {
            &[]
        }
    }

    /// The concrete faults of generation `g` (its episode, [`Chaos::episode`]), the agent having
    /// seen steps up to `after` before the generation started: random choices are drawn from
    /// the seed and `g` (a step in after+1..steps, so steps remain after it, or for a
    /// [windowed](Chaos::windowed) plan a step in the window of [`crate::soak::window`]); a
    /// random fault with no step left to draw is left out. A partition strikes a node other
    /// than node 0 (which hosts the store), for the plan's seconds or `partition_default`.
    pub fn resolve_in(&self, g: u64, after: u64, d: &Draw<'_>) -> Result<Vec<Fault>> {
        let mut rng = SplitMix(d.seed ^ g.wrapping_mul(0xa076_1d64_78bd_642f));
        let episode = self.episode(g);
        let world = d.nproc * d.members.len();
        // The failing fault first: in a windowed plan the slow faults fall before it.
        let mut order: Vec<&FaultSpec> = episode.iter().filter(|f| f.kind.fails()).collect();
        order.extend(episode.iter().filter(|f| !f.kind.fails()));
        let mut failing_step = None;
        let mut out = Vec::with_capacity(order.len());
        for f in order {
            let step = match f.step {
                StepSpec::At(s) if s >= d.steps => {
                    return Err(bad(
                        &format!("{s}"),
                        format!(
                            "the fault step must be below --steps {}, or it never fires",
                            d.steps
                        ),
                    ));
                }
                StepSpec::At(s) => s,
                StepSpec::Random if d.steps < 2 => {
                    return Err(bad("random", "a random fault step needs --steps >= 2"));
                }
                StepSpec::Random if self.windowed => {
                    let left = self
                        .failing()
                        .saturating_sub(usize::try_from(g).unwrap_or(0));
                    match crate::soak::window(after, d.steps, left, failing_step, f.kind) {
                        Some((lo, hi)) => lo + rng.next() % (hi - lo + 1),
                        None => continue,
                    }
                }
                StepSpec::Random if after + 1 >= d.steps => continue,
                StepSpec::Random => after + 1 + rng.next() % (d.steps - after - 1),
            };
            let rank = match f.kind {
                FaultKind::Partition(_) => partition_node(f.rank, d.members, &mut rng)?,
                _ => match f.rank {
                    Some(r) if r >= world => {
                        return Err(bad(
                            &r.to_string(),
                            format!("no rank {r} in a world of {world}"),
                        ));
                    }
                    Some(r) => r,
                    None => (rng.next() % world.max(1) as u64) as usize,
                },
            };
            let kind = match f.kind {
                FaultKind::Partition(None) => FaultKind::Partition(Some(
                    u32::try_from(d.partition_default.as_secs().max(1)).unwrap_or(u32::MAX),
                )),
                k => k,
            };
            if kind.fails() {
                failing_step = Some(step);
            }
            out.push(Fault { kind, step, rank });
        }
        Ok(out)
    }
}

/// The node a partition strikes: the plan's, which must be a member other than node 0, or one
/// drawn from the members other than node 0.
fn partition_node(node: Option<usize>, members: &[usize], rng: &mut SplitMix) -> Result<usize> {
    let others: Vec<usize> = members.iter().copied().filter(|&n| n != 0).collect();
    match node {
        Some(0) => Err(bad(
            "partition@...:0",
            "node 0 hosts the rendezvous store: cut off, it ends the job on every node (the \
             store has no failover to recover from that); partition another node",
        )),
        Some(n) if !members.contains(&n) => Err(bad(
            &format!("partition@...:{n}"),
            format!("node {n} is not in this generation (nodes {members:?})"),
        )),
        Some(n) => Ok(n),
        None if others.is_empty() => Err(bad(
            "partition",
            "a partition cuts off a node other than node 0 (which hosts the store): it needs \
             a job of at least 2 nodes",
        )),
        None => Ok(others[(rng.next() % others.len() as u64) as usize]),
    }
}

/// Parses one fault of a plan (`KIND@STEP...`).
fn parse_fault(item: &str) -> Result<FaultSpec> {
    let expected = "expected kill@STEP[:RANK], hang@STEP[:RANK], stall@STEP[:RANK], \
                    slow@STEP[:RANK]:FACTOR, partition@STEP[:NODE[:SECONDS]], corrupt-newest \
                    or soak:N (STEP may be 'random')";
    let (kind, rest) = item.split_once('@').ok_or_else(|| bad(item, expected))?;
    let (kind, rest) = match kind {
        "kill" => (FaultKind::Kill, rest),
        "hang" => (FaultKind::Hang, rest),
        "stall" => (FaultKind::Stall, rest),
        "slow" => {
            let (rest, factor) = rest
                .rsplit_once(':')
                .ok_or_else(|| bad(item, "expected slow@STEP[:RANK]:FACTOR (e.g. slow@5:1:3)"))?;
            let f: f64 = factor
                .parse()
                .map_err(|_| bad(item, "FACTOR must be a number (how many times slower)"))?;
            if !(f > 1.0 && f <= MAX_SLOW_FACTOR) {
                return Err(bad(
                    item,
                    format!("FACTOR must be above 1 and at most {MAX_SLOW_FACTOR}"),
                ));
            }
            (FaultKind::Slow((f * 100.0).round() as u32), rest)
        }
        "partition" => match rest.splitn(3, ':').collect::<Vec<_>>()[..] {
            [step, node, secs] => {
                let s: u32 = secs
                    .parse()
                    .ok()
                    .filter(|s| (1..=MAX_PARTITION_SECS).contains(s))
                    .ok_or_else(|| {
                        bad(
                            item,
                            format!(
                                "SECONDS must be a whole number from 1 to {MAX_PARTITION_SECS}"
                            ),
                        )
                    })?;
                (
                    FaultKind::Partition(Some(s)),
                    &rest[..step.len() + 1 + node.len()],
                )
            }
            _ => (FaultKind::Partition(None), rest),
        },
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
    let what = match kind {
        FaultKind::Partition(_) => "NODE must be a node number",
        _ => "RANK must be a rank number",
    };
    let rank = rank
        .map(|r| r.parse::<usize>())
        .transpose()
        .map_err(|_| bad(item, what))?;
    Ok(FaultSpec { kind, step, rank })
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}:{}", self.kind.name(), self.step, self.rank)?;
        match self.kind {
            FaultKind::Slow(_) => write!(f, ":{}", self.kind.factor()),
            FaultKind::Partition(Some(s)) => write!(f, ":{s}"),
            _ => Ok(()),
        }
    }
}

impl Fault {
    /// Parses [`Fault`]'s display form (what the agent hands its workers).
    pub fn parse(text: &str) -> Result<Fault> {
        match parse_fault(text)? {
            FaultSpec {
                kind,
                step: StepSpec::At(step),
                rank: Some(rank),
            } if kind != FaultKind::Partition(None) => Ok(Fault { kind, step, rank }),
            _ => Err(bad(text, "expected a resolved fault KIND@STEP:RANK")),
        }
    }

    /// Parses a generation's faults as the agent hands them to its workers: [`Fault`]'s display
    /// forms joined by commas.
    pub fn parse_list(text: &str) -> Result<Vec<Fault>> {
        text.split(',').map(str::trim).map(Fault::parse).collect()
    }

    /// The display forms of `faults` joined by commas (what [`Fault::parse_list`] reads).
    pub fn list(faults: &[Fault]) -> String {
        let items: Vec<String> = faults.iter().map(Fault::to_string).collect();
        items.join(",")
    }

    /// How long a partition lasts (`None` for other faults).
    pub fn partition(&self) -> Option<Duration> {
        match self.kind {
            FaultKind::Partition(s) => Some(Duration::from_secs(u64::from(s.unwrap_or(1)))),
            _ => None,
        }
    }

    /// Called by a worker after it completes `step`: strikes if this is the fault's rank and
    /// step (the agent hands a fault only to the workers of the generation it belongs to, and a
    /// partition only to the workers of its node, which all strike). `publish` makes sure the
    /// agent has seen the completed step first (a heartbeat flush). A stall never returns
    /// before `stall_limit`; a partition returns at once, this process cut off.
    pub fn strike(
        &self,
        rank: usize,
        step: u64,
        publish: impl FnOnce(),
        stall_limit: Duration,
    ) -> Result<()> {
        let partition = self.partition();
        if let FaultKind::Slow(_) = self.kind {
            // Said once its first slowed step is done: a generation may resume past STEP (from
            // a checkpoint of STEP itself) and never complete STEP, but always completes STEP+1.
            if rank == self.rank && step == self.step + 1 {
                eprintln!("flotilla: chaos: {self}: rank {rank} is slow from step {step} on");
            }
            return Ok(());
        }
        if step != self.step || (partition.is_none() && rank != self.rank) {
            return Ok(());
        }
        publish();
        if let Some(d) = partition {
            eprintln!(
                "flotilla: chaos: {self}: rank {rank} (node {}) is cut off the network for \
                 {} s after step {step}",
                self.rank,
                d.as_secs()
            );
            comm::partition::cut_for(d);
            return Ok(());
        }
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
            FaultKind::Slow(_) | FaultKind::Partition(_) => return Ok(()),
        }
        Err(LaunchError::Aborted(format!(
            "chaos {self} on rank {rank}: the agent did not stop this worker within {stall_limit:?}"
        )))
    }

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
pub(crate) struct SplitMix(pub(crate) u64);

impl SplitMix {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
#[path = "chaos_tests.rs"]
mod tests;
