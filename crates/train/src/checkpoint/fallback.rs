//! Resuming every rank of a layout from the newest committed step that loads on all of them
//! (the mesh engines' resume; [`crate::Checkpointer::resume`] is the data-parallel engine's).
//!
//! Each rank reads only what it needs, so a damaged piece may fail on one rank and not on the
//! others. The ranks therefore agree on every attempt: rank 0 lists the committed steps and
//! broadcasts them; for each step, newest first, every rank opens and restores it and the
//! ranks all-reduce their outcomes. If every rank restored it, that step is resumed. If some
//! rank failed its verification (a checkpoint error: missing, truncated or damaged bytes), rank
//! 0 sets the step aside ([`ckpt::quarantine`], so the resumed run can commit that step again)
//! and every rank tries the one before; a restore overwrites the whole state, so a step that
//! failed half-way leaves nothing behind. Any other failure (another training config, a shape
//! that is not this model's) ends the resume on every rank.
use std::path::Path;

use ckpt::{Checkpoint, Verify};
use comm::ReduceOp;
use comm::group::ProcessGroup;

use crate::error::{Result, TrainError};

/// A rank's outcome of one attempt, as the all-reduce sums it.
const LOADED: i64 = 0;
const DAMAGED: i64 = 1;
const REFUSED: i64 = 2;

/// Restores every rank of `world` (None: this process alone) from the newest committed step
/// under `dir` that loads on all of them, calling `restore` on each rank; returns the step and
/// the newer steps set aside (with why), or `None` when `dir` holds no committed step. A
/// collective over `world`.
pub fn resume_collectively(
    dir: &Path,
    world: Option<&ProcessGroup>,
    mut restore: impl FnMut(&Checkpoint) -> Result<()>,
) -> Result<Option<(u64, Vec<String>)>> {
    let Some(world) = world else {
        clear_leftovers(dir)?;
        return resume_alone(dir, restore);
    };
    let lead = world.rank() == 0;
    if lead {
        // Before the broadcast below: no rank saves until every rank has resumed.
        clear_leftovers(dir)?;
    }
    // Rank 0's listing, so every rank walks the same steps.
    let listed = match lead && dir.exists() {
        true => ckpt::list_committed(dir)?,
        false => vec![],
    };
    let mut count = [listed.len() as i64];
    world.broadcast(&mut count, 0)?;
    let mut steps: Vec<i64> = listed.iter().map(|&s| s as i64).collect();
    steps.resize(count[0] as usize, 0);
    world.broadcast(&mut steps, 0)?;
    let mut rejected = Vec::new();
    for &step in steps.iter().rev() {
        let step = step as u64;
        let outcome = Checkpoint::open(dir, step, Verify::ManifestOnly)
            .map_err(TrainError::from)
            .and_then(|c| restore(&c));
        let mine = match &outcome {
            Ok(()) => LOADED,
            Err(e) if e.is_damage() => DAMAGED,
            Err(_) => REFUSED,
        };
        // Per rank, so the message can name the ranks that failed.
        let mut all = vec![0i64; world.size()];
        all[world.rank()] = mine;
        world.all_reduce(&mut all, ReduceOp::Sum)?;
        let failed: Vec<usize> = (0..all.len()).filter(|&r| all[r] != LOADED).collect();
        if failed.is_empty() {
            return Ok(Some((step, rejected)));
        }
        if all.contains(&REFUSED) {
            return Err(match outcome {
                Err(e) if mine == REFUSED => e,
                _ => TrainError::Resume {
                    step,
                    reason: format!("rank(s) {failed:?} refused it (see their errors)"),
                },
            });
        }
        if lead {
            let why = match &outcome {
                Err(e) => e.to_string(),
                Ok(()) => "verification failed".into(),
            };
            rejected.push(set_aside(
                dir,
                step,
                &format!("on rank(s) {failed:?}: {why}"),
            )?);
        }
        world.barrier()?;
    }
    if steps.is_empty() {
        return Ok(None);
    }
    Err(TrainError::Resume {
        step: 0,
        reason: format!(
            "no committed step loads on every rank: {}",
            rejected.join("; ")
        ),
    })
}

/// [`resume_collectively`] for one process (and [`crate::Checkpointer::resume`]): the newest
/// committed step that restores, the newer ones that fail verification set aside.
pub(super) fn resume_alone(
    dir: &Path,
    mut restore: impl FnMut(&Checkpoint) -> Result<()>,
) -> Result<Option<(u64, Vec<String>)>> {
    if !dir.exists() {
        return Ok(None);
    }
    let mut rejected = Vec::new();
    let steps = ckpt::list_committed(dir)?;
    for &step in steps.iter().rev() {
        match Checkpoint::open(dir, step, Verify::ManifestOnly)
            .map_err(TrainError::from)
            .and_then(|c| restore(&c))
        {
            Ok(()) => return Ok(Some((step, rejected))),
            Err(e) if e.is_damage() => rejected.push(set_aside(dir, step, &e.to_string())?),
            Err(other) => return Err(other),
        }
    }
    if steps.is_empty() {
        return Ok(None);
    }
    Err(TrainError::Resume {
        step: 0,
        reason: format!("no committed step loads: {}", rejected.join("; ")),
    })
}

/// Sets `step` aside ([`ckpt::quarantine`], so the resumed run can commit that step again) and
/// says why: `step N: why (moved to ...)`, once (most checkpoint errors name their step already).
fn set_aside(dir: &Path, step: u64, why: &str) -> Result<String> {
    let moved = ckpt::quarantine(dir, step)?;
    let prefix = format!("step {step}:");
    let why = match why.starts_with(&prefix) {
        true => why.to_string(),
        false => format!("{prefix} {why}"),
    };
    Ok(format!("{why} (moved to {})", moved.display()))
}

/// Removes what saves that never committed left under `dir` (staging directories with their
/// rank files and published piece lists, steps without a commit marker), as a run starts and
/// before any of its ranks saves: an interrupted generation's piece list of a step would
/// otherwise be collected in place of the list the new generation's rank is about to publish
/// for the same step. Only the rank that commits calls it, before the ranks' first collective.
pub(crate) fn clear_leftovers(dir: &Path) -> Result<()> {
    if dir.exists() {
        ckpt::gc(dir, ckpt::GcMode::AllUncommitted)?;
    }
    Ok(())
}
