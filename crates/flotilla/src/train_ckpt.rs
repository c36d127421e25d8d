//! `flotilla train`'s checkpoint glue: opening the run's checkpoint directory (resume on every
//! rank, agreement on the step, the checkpointer) and reporting saves as the slowest rank saw
//! them.
use anyhow::{Context, Result, bail};
use train::Trainer;

/// The line printed for a finished save.
pub fn saved_line(s: &train::SaveSummary) -> String {
    let planned = match s.planned {
        Some((tau, loss)) => format!(
            "; next in {tau:.1} s (Young/Daly, expected loss {:.2} %)",
            100.0 * loss
        ),
        None => String::new(),
    };
    format!(
        "# checkpoint step {}: {:.1} MB, training paused {:.1} ms (slowest rank){planned}",
        s.step,
        s.bytes as f64 / 1e6,
        s.pause.as_secs_f64() * 1e3
    )
}

/// Opens the checkpoint directory: resumes from its newest loadable step, if any, and returns
/// the checkpointer that saves the rest of the run there.
///
/// Data parallel: rank 0 resumes first (setting aside any step that fails verification), then
/// the others, so all read the same directory state; the ranks then check they resumed the same
/// step. Every rank saves its rows of every tensor in parallel; rank 0 commits.
pub fn open_checkpoints(
    trainer: &mut Trainer,
    cfg: train::CheckpointConfig,
) -> Result<train::Checkpointer> {
    let dir = cfg.dir.clone();
    let dir = dir.as_path();
    let lead = trainer.rank() == 0;
    let resume = |trainer: &mut Trainer| {
        train::Checkpointer::resume(dir, trainer)
            .with_context(|| format!("resuming from {}", dir.display()))
    };
    let resumed = if lead { resume(trainer)? } else { None };
    if let Some(g) = trainer.group() {
        g.barrier().context("resume barrier")?;
    }
    let resumed = if lead { resumed } else { resume(trainer)? };
    if let Some(g) = trainer.group() {
        let step = trainer.steps_done() as f64;
        let (mut lo, mut hi) = ([step], [step]);
        g.all_reduce(&mut lo, comm::ReduceOp::Min)?;
        g.all_reduce(&mut hi, comm::ReduceOp::Max)?;
        if lo != hi {
            bail!(
                "ranks resumed from different steps ({} to {}) of {}",
                lo[0],
                hi[0],
                dir.display()
            );
        }
    }
    match resumed {
        Some((step, rejected)) => {
            for r in &rejected {
                out!(lead, "# checkpoint rejected (lost): {r}");
            }
            let saved_by = ckpt::Checkpoint::open(dir, step, ckpt::Verify::ManifestOnly)
                .map(|c| c.manifest().world_size)
                .unwrap_or(0);
            let world = trainer.world() as u32;
            let elastic = match saved_by {
                w if w != world && w > 0 => {
                    format!(" (saved by {w} ranks, continuing on {world}: elastic)")
                }
                _ => String::new(),
            };
            out!(
                lead,
                "# resumed from {} step {step}{elastic}",
                dir.display()
            );
        }
        None => out!(
            lead,
            "# no checkpoint in {}: starting at step 0",
            dir.display()
        ),
    }
    let asynchronous = cfg.asynchronous;
    let run_id = format!("train-seed{}", trainer.config().seed);
    let (rank, world) = (trainer.rank() as u32, trainer.world() as u32);
    let mut ck = train::Checkpointer::new(cfg, &run_id)?.with_shard(rank, world)?;
    let mapped = ck.prepare(trainer)?;
    if asynchronous && lead {
        println!(
            "# checkpoint host buffer mapped in {:.1} ms (asynchronous saves copy into it)",
            mapped.as_secs_f64() * 1e3
        );
    }
    Ok(ck)
}

/// A save as the slowest rank saw it: every rank saves at the same step, so the ranks agree
/// here on the longest pause (a small all-reduce).
pub fn slowest_rank(
    trainer: &Trainer,
    mut saved: train::SaveSummary,
) -> Result<train::SaveSummary> {
    if let Some(g) = trainer.group() {
        let mut v = [saved.pause.as_secs_f64(), saved.bytes as f64];
        g.all_reduce(&mut v[..1], comm::ReduceOp::Max)?;
        g.all_reduce(&mut v[1..], comm::ReduceOp::Sum)?;
        saved.pause = std::time::Duration::from_secs_f64(v[0]);
        saved.bytes = v[1] as u64;
    }
    Ok(saved)
}
