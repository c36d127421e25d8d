//! Checkpoints of a tensor-parallel [`Trainer`] (DP x TP, with or without ZeRO), in the
//! one-process trainer's format (issue 8: a checkpoint moves between layouts), so one process,
//! a data-parallel group (with or without ZeRO), a tensor-parallel group and a `dp x tp` grid
//! resume from each other's saves.
//!
//! - Format. Exactly [`crate::checkpoint`]'s: one float32 tensor per entry of the whole
//!   model's layout under `model.`, `optim.exp_avg.` and `optim.exp_avg_sq.`, in global
//!   shapes; the same run state and [`crate::checkpoint::config_hash`] (the training config
//!   has no tensor-parallel field, so a TP run and a one-process run of one config hash alike).
//! - Save ([`Trainer::save_into`], [`Trainer::save_checkpoint`]). Each rank writes only what it
//!   owns, as DCP does: its shards as boxes of the whole tensors ([`super::TpPart::place`]:
//!   row blocks of each run of a column-parallel weight, column blocks of a row-parallel one;
//!   replicated tensors from TP rank 0), under ZeRO only its owned parts of them, without
//!   ZeRO a share of them split over the replicas ([`Trainer::checkpoint_pieces`]). Nothing is
//!   gathered. Writer `w` is the rank's place in the mesh's world (`dp_rank·t + tp_rank`);
//!   writer 0 collects the piece lists ([`ckpt::handoff`]) and commits.
//! - Load ([`Trainer::restore`]). Each rank reads the whole tensors (the reader reassembles
//!   them from whatever pieces a DP, ZeRO or TP save wrote), keeps its shards (moments alike),
//!   and restores the step, AdamW's step count and the global row cursor.
use std::path::Path;

use ckpt::{CheckpointMeta, RankWriter};

use super::data_parallel::failures;
use crate::checkpoint::{Checkpointer, SaveSummary, piece_refs, save_collectively};
use crate::error::{Result, TrainError};
use crate::trainer::Trainer;

impl Trainer {
    /// This rank's writer index `replica·tp + tp_rank` and the `replicas·tp` writers (its rank
    /// and size in the mesh's world).
    pub fn writer(&self) -> (u32, u32) {
        let (tp, replicas) = (self.tp() as u32, self.world() as u32);
        (
            self.rank() as u32 * tp + self.tp_rank() as u32,
            replicas * tp,
        )
    }

    /// Everything of a mesh save but the bytes: the meta (`world_size` the writers) and this
    /// rank's pieces as indices into its tensors.
    fn mesh_save_meta(&mut self, run_id: &str) -> CheckpointMeta {
        let mut meta = self.checkpoint_meta(run_id);
        meta.world_size = self.writer().1;
        meta
    }

    /// Saves the current step through `ck` (asynchronously when it saves so: this rank's
    /// pieces copied into its host buffer in the foreground, written in the background), `ck`
    /// saving as [`Trainer::writer`]. Every rank writes only what it owns.
    pub fn save_into(&mut self, ck: &mut Checkpointer, run_id: &str) -> Result<SaveSummary> {
        let step = self.steps_done();
        let meta = self.mesh_save_meta(run_id);
        let pieces = self.checkpoint_pieces(self.rank() as u32, self.world() as u32);
        let refs = piece_refs(&meta.tensors, &pieces);
        ck.save_pieces(step, meta.clone(), &refs)
    }

    /// Saves the current step under `dir` (created if missing): a collective that every rank
    /// of the `dp x tp` world must call. Every rank writes its pieces, writer 0 collects the
    /// piece lists ([`ckpt::handoff`]) and commits. Every rank returns the same outcome: a
    /// failed write on any rank is an error on all and nothing is committed. Returns the step.
    pub fn save_checkpoint(&mut self, dir: &Path, run_id: &str) -> Result<u64> {
        let step = self.steps_done();
        let writer = self.writer();
        let meta = self.mesh_save_meta(run_id);
        let write = |meta: &CheckpointMeta| {
            let pieces = self.checkpoint_pieces(self.rank() as u32, self.world() as u32);
            let refs = piece_refs(&meta.tensors, &pieces);
            Ok(RankWriter::write_all(dir, step, writer.0, &refs)?)
        };
        save_collectively(dir, step, writer, meta, write, |ok, what| {
            self.agree(step, ok, what)
        })
    }

    /// Sums every rank's failure flag over the `dp x tp` world: an error on every rank when
    /// any rank's `ok` is false (that rank's own error is returned by its caller).
    fn agree(&self, step: u64, ok: bool, what: &str) -> Result<()> {
        let failed = match (self.tensor_part(), self.group()) {
            (Some(t), dp) => failures(&t.group, dp, ok)?,
            (None, Some(dp)) => failures(dp, None, ok)?,
            (None, None) => i64::from(!ok),
        };
        if ok && failed != 0 {
            return Err(TrainError::Resume {
                step,
                reason: format!(
                    "{failed} rank(s) of the dp x tp world failed to {what} the checkpoint"
                ),
            });
        }
        Ok(())
    }
}
