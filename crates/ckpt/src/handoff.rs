//! Handing every rank's piece list to the coordinator through the staging directory, for jobs
//! whose ranks save in parallel from separate processes.
//!
//! Each rank, once its file is durable, publishes its piece list as
//! `step-<N>.tmp/pieces-rank-<r>.json` (tmp file, fsync, rename: a list is there whole or not at
//! all). The coordinator collects all `world` lists, waiting with a deadline, removes them and
//! calls [`crate::commit`]. Nothing here uses the training job's collectives, so the handoff can
//! run on background threads while the training threads communicate. The staging directory
//! must be visible to every rank (one machine, or a shared filesystem).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{CkptError, Result, io_err};
use crate::fsio::{read_capped, write_atomic};
use crate::manifest::{MAX_MANIFEST_BYTES, Piece};
use crate::names::tmp_dir_name;

/// How often the coordinator looks for lists that have not arrived yet.
pub const POLL: Duration = Duration::from_millis(20);

fn list_path(root: &Path, step: u64, rank: u32) -> PathBuf {
    root.join(tmp_dir_name(step))
        .join(format!("pieces-rank-{rank:05}.json"))
}

/// Publishes `rank`'s piece list for `step` (after its [`crate::RankWriter::finish`]).
pub fn publish_pieces(root: &Path, step: u64, rank: u32, pieces: &[Piece]) -> Result<()> {
    let bytes = serde_json::to_vec(pieces).map_err(|source| CkptError::Serialize {
        what: "piece list",
        source,
    })?;
    write_atomic(&list_path(root, step, rank), &bytes, false)?;
    Ok(())
}

/// Waits up to `timeout` for the piece lists of ranks `1..world` of `step`, returns them
/// after `own` (rank 0's), in rank order, and removes the list files.
pub fn collect_pieces(
    root: &Path,
    step: u64,
    world: u32,
    own: Vec<Piece>,
    timeout: Duration,
) -> Result<Vec<Piece>> {
    let deadline = Instant::now() + timeout;
    let mut all = own;
    for rank in 1..world {
        let path = list_path(root, step, rank);
        while std::fs::symlink_metadata(&path).is_err() {
            if Instant::now() >= deadline {
                return Err(CkptError::HandoffTimeout {
                    step,
                    rank,
                    path,
                    timeout,
                });
            }
            std::thread::sleep(POLL);
        }
        let bytes = read_capped(&path, MAX_MANIFEST_BYTES)?;
        let pieces: Vec<Piece> =
            serde_json::from_slice(&bytes).map_err(|e| CkptError::Manifest {
                step,
                path: path.clone(),
                reason: format!("unparsable piece list of rank {rank}: {e}"),
            })?;
        all.extend(pieces);
        std::fs::remove_file(&path).map_err(io_err("remove", &path))?;
    }
    Ok(all)
}
