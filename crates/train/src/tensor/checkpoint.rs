//! Checkpoints of a tensor-parallel run in the [`crate::Trainer`]'s format (issue 8: a
//! checkpoint moves between layouts), so one process, a data-parallel group (with or without
//! ZeRO) and a tensor-parallel group resume from each other's saves.
//!
//! - Format. Exactly [`crate::checkpoint`]'s: one float32 tensor per entry of the whole
//!   model's layout under `model.`, `optim.exp_avg.` and `optim.exp_avg_sq.`, in global
//!   shapes; state `step`, `optimizer_step`, `batches_drawn`, `rows_drawn` (the global row
//!   cursor), `loader`, `seed`, `world` (1: the group draws one process's rows) and
//!   `model_config`; the same [`config_hash`] (the training config has no tensor-parallel
//!   field, so a TP run and a one-process run of one config hash alike).
//! - Save ([`TpTrainer::save_checkpoint`], a collective). AdamW's moments share the
//!   parameters' flat layout ([`super::TpLayout`]), so parameters and both moments are
//!   assembled whole on every rank with the same all-gather and unshard as
//!   [`TpTrainer::gather_params`]; then the `tp` ranks split the writing as `tp`
//!   data-parallel ranks do (split `dim0`: rank `r` writes [`ckpt::rank_rows`] of every whole
//!   tensor, rank 0 commits), so the checkpoint is exactly what `tp` DP ranks save. Not yet: each rank
//!   writing only the shard it owns without the gather (row shards are contiguous row blocks,
//!   column shards and the fused QKV's per-head blocks are not).
//! - Load ([`TpTrainer::restore`]). Each rank reads the whole tensors (the reader reassembles
//!   them from whatever pieces a DP or ZeRO save wrote), keeps its part with
//!   [`super::TpLayout::shard_params`] (moments alike), and restores the step, AdamW's step
//!   count and the data cursor, so the next batch is the one the saving run would draw next.
use std::path::Path;

use ckpt::{Checkpoint, CheckpointMeta, RankWriter, Verify};
use comm::ReduceOp;
use serde_json::json;

use super::trainer::TpTrainer;
use crate::checkpoint::{
    SAVE_TIMEOUT, config_hash, piece_refs, read_whole_state, rows_pieces, saved_run, state_metas,
    state_views,
};
use crate::error::{Result, TrainError};

impl TpTrainer {
    /// Everything of a checkpoint of the current step but the tensors, as
    /// [`crate::Trainer::checkpoint_meta`] writes it (layout `tp` records the saving degree;
    /// [`TpTrainer::save_checkpoint`] sets `world_size` to the `tp` writers).
    pub fn checkpoint_meta(&mut self, run_id: &str) -> CheckpointMeta {
        let tensors = state_metas(&self.layout().whole);
        let loader = self.loader_state().map(|s| s.to_json());
        let state = json!({
            "step": self.steps_done(),
            "optimizer_step": self.optimizer().step_count(),
            "batches_drawn": self.batches_drawn(),
            "rows_drawn": self.rows_drawn(),
            "loader": loader,
            "seed": self.config().seed,
            "world": 1,
            "model_config": model::interop::config_to_metadata(&self.config().model),
        });
        CheckpointMeta {
            run_id: run_id.to_string(),
            world_size: 1,
            layout: json!({"dp": 1, "tp": self.tp(), "pp": 1, "split": "dim0"}),
            config_hash: config_hash(self.config()),
            tensors,
            state,
        }
    }

    /// The whole parameters and AdamW moments, each in the whole model's layout order. A
    /// collective (every rank must call it); every rank gets them.
    pub fn gather_state(&self) -> Result<[Vec<f32>; 3]> {
        let (m, v) = self.optimizer().moments();
        Ok([
            self.gather_whole(self.params_shard())?,
            self.gather_whole(m)?,
            self.gather_whole(v)?,
        ])
    }

    /// Saves the current step under `dir` (created if missing) in the [`crate::Trainer`]'s
    /// format: a collective that every rank of the group must call. The whole state is
    /// gathered on every rank ([`TpTrainer::gather_state`]); rank `r` of `tp` writes its
    /// [`ckpt::rank_rows`] of every whole tensor (as `tp` data-parallel ranks would), rank 0
    /// collects the piece lists ([`ckpt::handoff`]) and commits. Every rank returns the same
    /// outcome: a failed write on any rank is an error on all and nothing is committed.
    /// Returns the step saved.
    pub fn save_checkpoint(&mut self, dir: &Path, run_id: &str) -> Result<u64> {
        let step = self.steps_done();
        let [params, m, v] = self.gather_state()?;
        let (rank, tp) = (self.rank() as u32, self.tp() as u32);
        let mut meta = self.checkpoint_meta(run_id);
        meta.world_size = tp;
        let written = (|| -> Result<Vec<ckpt::Piece>> {
            std::fs::create_dir_all(dir).map_err(|e| TrainError::Config {
                field: "checkpoint dir",
                value: dir.display().to_string(),
                reason: e.to_string(),
            })?;
            let views = state_views(&self.layout().whole, &params, &m, &v);
            let pieces = rows_pieces(&views, rank, tp);
            let refs = piece_refs(&meta.tensors, &pieces);
            Ok(RankWriter::write_all(dir, step, rank, &refs)?)
        })();
        // Every rank's file is durable (or some rank failed) before any piece list is handed
        // over, so rank 0 never waits for a rank that gave up.
        self.agree(step, written.is_ok(), "write its piece of")?;
        let written = written?;
        let committed = if rank == 0 {
            ckpt::handoff::collect_pieces(dir, step, tp, written, SAVE_TIMEOUT)
                .and_then(|all| ckpt::commit(dir, step, all, meta).map(drop))
        } else {
            ckpt::handoff::publish_pieces(dir, step, rank, &written)
        };
        // Also the barrier that keeps every rank from going on before the step is committed.
        self.agree(step, committed.is_ok(), "commit")?;
        committed?;
        Ok(step)
    }

    /// Sums every rank's failure flag over the group: an error on every rank when any rank's
    /// `ok` is false (that rank's own error is returned by its caller).
    fn agree(&self, step: u64, ok: bool, what: &str) -> Result<()> {
        let mut failed = [if ok { 0f32 } else { 1.0 }];
        self.group().all_reduce(&mut failed, ReduceOp::Sum)?;
        if ok && failed[0] != 0.0 {
            return Err(TrainError::Resume {
                step,
                reason: format!(
                    "{} tensor-parallel rank(s) failed to {what} the checkpoint",
                    failed[0]
                ),
            });
        }
        Ok(())
    }

    /// Loads `ckpt`, saved by any layout in the [`crate::Trainer`]'s format (one process,
    /// data-parallel, ZeRO or tensor-parallel), into this rank: the whole tensors are read and
    /// this rank's part kept. Refused, naming what differs, when a tensor is missing or has
    /// another shape (another model) or the training config differs (as
    /// [`crate::Trainer::restore`]). This rank is only changed once everything has been read.
    pub fn restore(&mut self, ckpt: &Checkpoint) -> Result<()> {
        let resume = |reason: String| TrainError::Resume {
            step: ckpt.step(),
            reason,
        };
        let want = state_metas(&self.layout().whole);
        let have = &ckpt.manifest().tensors;
        for t in &want {
            match have.iter().find(|h| h.name == t.name) {
                None => {
                    return Err(resume(format!(
                        "the checkpoint has no tensor {:?}: saved from another model",
                        t.name
                    )));
                }
                Some(h) if h.shape != t.shape || h.dtype != t.dtype => {
                    return Err(resume(format!(
                        "tensor {:?} is {:?} {:?} in the checkpoint, {:?} {:?} in this model: \
                         saved from another model",
                        t.name, h.dtype, h.shape, t.dtype, t.shape
                    )));
                }
                Some(_) => {}
            }
        }
        if have.len() != want.len() {
            return Err(resume(format!(
                "the checkpoint holds {} tensors, this model's state {}: saved from another model",
                have.len(),
                want.len()
            )));
        }
        let run = saved_run(ckpt, self.config())?;
        let layout = self.layout();
        let whole = read_whole_state(ckpt, &layout.whole)?;
        let mut local = whole.iter().map(|w| {
            let mut mine = vec![0f32; layout.total];
            layout.shard_params(w, &mut mine).map(|()| mine)
        });
        let mut next = || local.next().unwrap_or_else(|| Ok(Vec::new()));
        let (params, m, v) = (next()?, next()?, next()?);
        self.load_state(params, m, v, run.optimizer_step, run.step)?;
        self.reset_source(run.loader.as_ref(), run.rows)
    }

    /// Restores this rank from the newest committed step under `dir` (verifying the manifest;
    /// each tensor's bytes are verified as read). Returns the step resumed from, or `None` when
    /// `dir` holds no committed step. Every rank of the group calls it and reads the same step.
    pub fn resume(&mut self, dir: &Path) -> Result<Option<u64>> {
        if !dir.exists() {
            return Ok(None);
        }
        let Some(&step) = ckpt::list_committed(dir)?.last() else {
            return Ok(None);
        };
        let ckpt = Checkpoint::open(dir, step, Verify::ManifestOnly)?;
        self.restore(&ckpt)?;
        Ok(Some(step))
    }
}
