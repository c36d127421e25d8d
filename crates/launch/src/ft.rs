//! The agent's side of per-step fault tolerance (`--ft`, `train::ft`): a failed worker takes
//! only its replica group down. The agent declares that replica down in the store (the
//! survivors' next quorum leaves it out), stops the replica's other local workers, and starts
//! them again; the restarted ranks rejoin at a later step with a live replica's state. No
//! generation ends and no other worker stops (004 §28.8; TorchFT's per-replica restarts).
//!
//! A replica group lives on one node (`--dp-shard` divides `--nproc`), so the node that hosts
//! it restarts it. Chaos under `--ft`: every fault of the plan goes to every worker at once
//! (each strikes its own rank at its step; a restarted worker's faults at earlier steps never
//! fire), since no generation follows a fault.
use crate::chaos::{Chaos, Draw, Fault, FaultKind};
use crate::error::{LaunchError, Result};
use crate::process::LocalWorker;
use crate::watchdog::Failure;
use comm::store::StoreClient;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The replica group of global rank `rank` with `size` ranks per group.
pub fn replica_of(rank: usize, size: usize) -> usize {
    rank / size.max(1)
}

/// Every fault of `chaos` resolved against `draw` (random steps and ranks drawn from its
/// seed), as one plan: under `--ft` each worker gets all of them. Partitions and soaks are
/// refused here: they are built for restart-from-checkpoint so far.
pub fn resolve_all(chaos: &Chaos, draw: &Draw<'_>) -> Result<Vec<Fault>> {
    if chaos.soak.is_some()
        || chaos
            .faults
            .iter()
            .any(|f| matches!(f.kind, FaultKind::Partition(_)))
    {
        return Err(LaunchError::invalid(
            "--chaos",
            "partition@ or soak:N",
            "not built under --ft yet (they drill restart-from-checkpoint)",
        ));
    }
    let mut all = Vec::new();
    let mut g = 0;
    while !chaos.episode(g).is_empty() {
        all.extend(chaos.resolve_in(g, 0, draw)?);
        g += 1;
    }
    Ok(all)
}

/// A replica restart made by [`replace`]: which, why, when it was declared down.
pub struct Replaced {
    /// The replica group.
    pub replica: usize,
    /// Its new incarnation.
    pub incarnation: u64,
    /// The failure that took it down.
    pub why: String,
    /// When the agent saw it.
    pub detected: Instant,
}

/// Replaces the replicas of the failed ranks: each is declared down in the store, its local
/// workers still running are killed and reaped, and `spawn(local)` starts each of its local
/// ranks again (`nproc` workers per node, `replica_size` ranks per replica).
pub fn replace(
    store: &StoreClient,
    workers: &mut [LocalWorker],
    failures: &[Failure],
    (nproc, replica_size): (usize, usize),
    spawn: impl Fn(usize) -> Result<LocalWorker>,
) -> Result<Vec<Replaced>> {
    let detected = Instant::now();
    let mut lost: BTreeMap<usize, String> = BTreeMap::new();
    for f in failures {
        lost.entry(replica_of(f.rank, replica_size))
            .or_insert_with(|| f.to_string());
    }
    let mut out = Vec::new();
    for (replica, why) in lost {
        let incarnation = train::ft::declare_down(store, replica, &why)
            .map_err(|e| LaunchError::Aborted(format!("declaring replica {replica} down: {e}")))?;
        for w in workers.iter_mut() {
            if replica_of(w.rank, replica_size) == replica {
                crate::process::stop_all(std::slice::from_mut(w), Duration::ZERO)?;
            }
        }
        for w in workers.iter_mut() {
            if replica_of(w.rank, replica_size) == replica {
                *w = spawn(w.rank % nproc)?;
            }
        }
        out.push(Replaced {
            replica,
            incarnation,
            why,
            detected,
        });
    }
    Ok(out)
}
