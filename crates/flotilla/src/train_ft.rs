//! `train --ft`: the checks before any worker starts, and a worker's replica group and its side
//! of the per-step quorum (`train::ft`).
use anyhow::{Context, Result, bail};
use comm::group::{GroupConfig, ProcessGroup};
use train::run::RunConfig;

use crate::spawn::Worker;

/// Under --ft, the ranks per replica group (checked against the layout and the node before any
/// worker starts); None without --ft.
pub(crate) fn ft_replica_size(
    ft: bool,
    cfg: &RunConfig,
    nproc: usize,
    world: usize,
) -> Result<Option<usize>> {
    if !ft {
        return Ok(None);
    }
    if let Some(why) = train::run::ft::refusal(cfg) {
        bail!("{why}");
    }
    let size = cfg
        .layout
        .hybrid_groups(world)?
        .map_or(1, |(shard, _)| shard);
    if world / size < 2 {
        bail!(
            "--ft: {world} worker(s) in replica groups of {size} make one replica; fault tolerance needs at least two"
        );
    }
    if !nproc.is_multiple_of(size) {
        bail!(
            "--ft: a replica group of {size} workers must sit on one node: --dp-shard {size} must divide --nproc {nproc}"
        );
    }
    Ok(Some(size))
}

/// A worker's replica group and its side of the per-step quorum (`--ft`): a restarted replica
/// rejoins `join_after` steps after its loss; a retry waits for the loss to be declared within
/// twice the heartbeat timeout and 10 s.
pub(crate) fn ft_worker(
    (join_after, heartbeat_timeout_s): (u64, f64),
    cfg: &RunConfig,
    w: &Worker,
) -> Result<(ProcessGroup, std::sync::Arc<train::ft::FaultTolerance>)> {
    let size = cfg
        .layout
        .hybrid_groups(w.world)?
        .map_or(1, |(shard, _)| shard);
    let ftc = train::ft::FtConfig {
        replica_size: size,
        replicas: w.world / size,
        join_after,
        join_timeout: std::time::Duration::from_secs(60),
        retry_timeout: std::time::Duration::from_secs_f64(2.0 * heartbeat_timeout_s + 10.0),
    };
    let ft = train::ft::FaultTolerance::join(&w.rdv, w.rank, ftc)
        .with_context(|| format!("joining the quorum as rank {}", w.rank))?;
    let name = format!("replica{}i{}", ft.replica(), ft.incarnation());
    let group = ProcessGroup::new(
        &w.rdv,
        &name,
        w.rank % size,
        size,
        GroupConfig::for_training()?,
    )
    .with_context(|| format!("joining replica group {} as rank {}", ft.replica(), w.rank))?;
    Ok((group, std::sync::Arc::new(ft)))
}
