//! Opening a data-parallel run's checkpoint directory: resume on every rank, agreement on the
//! step, and the checkpointer that saves the rest of the run; and a save as the slowest rank
//! saw it.
use std::path::Path;

use comm::group::ProcessGroup;

use crate::checkpoint::{CheckpointConfig, Checkpointer, SaveSummary};
use crate::error::{Context, Result, TrainError};
use crate::trainer::Trainer;

/// What opening the checkpoint directory found, for the run's report.
pub struct Opened {
    /// The checkpointer that saves the rest of the run.
    pub checkpointer: Checkpointer,
    /// The step resumed from and the world size that saved it, if any.
    pub resumed: Option<(u64, u32)>,
    /// Steps set aside because they failed verification, newest first.
    pub rejected: Vec<String>,
    /// Time to map the asynchronous saves' host buffer (None: synchronous saves).
    pub mapped: Option<std::time::Duration>,
}

/// Opens the checkpoint directory: resumes from its newest loadable step, if any, and returns
/// the checkpointer that saves the rest of the run there.
///
/// Data parallel: rank 0 resumes first (setting aside any step that fails verification), then
/// the others, so all read the same directory state; the ranks then check they resumed the same
/// step. Every rank saves its rows of every tensor in parallel; rank 0 commits.
pub fn open(trainer: &mut Trainer, cfg: CheckpointConfig) -> Result<Opened> {
    let shard = Shard {
        rank: trainer.rank() as u32,
        world: trainer.world() as u32,
        clears: trainer.rank() == 0,
    };
    open_as(trainer, cfg, shard)
}

/// Who a rank is among a checkpoint's writers.
#[derive(Clone, Copy, Debug)]
pub struct Shard {
    /// Its place among the writers.
    pub rank: u32,
    /// The writers of each step.
    pub world: u32,
    /// Whether it clears the directory's uncommitted leftovers first (one rank of the job).
    pub clears: bool,
}

/// [`open`] as `shard` of the checkpoint's writers (under `--ft`, one replica group's ranks:
/// the quorum's first replica saves; every replica resumes). The rank placed first resumes
/// before the others of its group.
pub fn open_as(trainer: &mut Trainer, cfg: CheckpointConfig, shard: Shard) -> Result<Opened> {
    let dir = cfg.dir.clone();
    let dir = dir.as_path();
    let lead = shard.rank == 0;
    let resume = |trainer: &mut Trainer| {
        Checkpointer::resume(dir, trainer).ctx(|| format!("resuming from {}", dir.display()))
    };
    if shard.clears {
        // Before the barrier below: no rank saves until every rank has resumed.
        crate::checkpoint::clear_leftovers(dir)?;
    }
    let resumed = if lead { resume(trainer)? } else { None };
    if let Some(g) = trainer.group() {
        g.barrier().ctx(|| "resume barrier".into())?;
    }
    let resumed = if lead { resumed } else { resume(trainer)? };
    agree_on_step(trainer, dir)?;
    let (resumed, rejected) = match resumed {
        Some((step, rejected)) => {
            let saved_by = ckpt::Checkpoint::open(dir, step, ckpt::Verify::ManifestOnly)
                .map(|c| c.manifest().world_size)
                .unwrap_or(0);
            (Some((step, saved_by)), rejected)
        }
        None => (None, vec![]),
    };
    let asynchronous = cfg.asynchronous;
    let run_id = crate::checkpoint::run_id(trainer.config());
    let (rank, world) = (shard.rank, shard.world);
    let mut checkpointer = Checkpointer::new(cfg, &run_id)?.with_shard(rank, world)?;
    let mapped = checkpointer.prepare(trainer)?;
    Ok(Opened {
        checkpointer,
        resumed,
        rejected,
        mapped: asynchronous.then_some(mapped),
    })
}

/// Every rank must have resumed the same step.
fn agree_on_step(trainer: &Trainer, dir: &Path) -> Result<()> {
    let Some(g) = trainer.group() else {
        return Ok(());
    };
    let step = trainer.steps_done() as f64;
    let (mut lo, mut hi) = ([step], [step]);
    g.all_reduce(&mut lo, comm::ReduceOp::Min)?;
    g.all_reduce(&mut hi, comm::ReduceOp::Max)?;
    if lo != hi {
        return Err(TrainError::Resume {
            step: lo[0] as u64,
            reason: format!(
                "ranks resumed from different steps ({} to {}) of {}",
                lo[0],
                hi[0],
                dir.display()
            ),
        });
    }
    Ok(())
}

/// A save as the slowest rank saw it: every rank saves at the same step, so the ranks agree
/// here on the longest pause (a small all-reduce).
pub fn slowest_rank(world: Option<&ProcessGroup>, mut saved: SaveSummary) -> Result<SaveSummary> {
    if let Some(g) = world {
        let mut v = [saved.pause.as_secs_f64(), saved.bytes as f64];
        g.all_reduce(&mut v[..1], comm::ReduceOp::Max)?;
        g.all_reduce(&mut v[1..], comm::ReduceOp::Sum)?;
        saved.pause = std::time::Duration::from_secs_f64(v[0]);
        saved.bytes = v[1] as u64;
    }
    Ok(saved)
}
