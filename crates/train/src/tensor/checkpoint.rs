//! Checkpoints of a tensor-parallel run, with or without data-parallel replicas (DP x TP), in
//! the [`crate::Trainer`]'s format (issue 8: a checkpoint moves between layouts), so one
//! process, a data-parallel group (with or without ZeRO), a tensor-parallel group and a
//! `dp x tp` grid resume from each other's saves.
//!
//! - Format. Exactly [`crate::checkpoint`]'s: one float32 tensor per entry of the whole
//!   model's layout under `model.`, `optim.exp_avg.` and `optim.exp_avg_sq.`, in global
//!   shapes; state `step`, `optimizer_step`, `batches_drawn`, `rows_drawn` (the global row
//!   cursor over all replicas), `loader`, `seed`, `world` (the replicas `d`: a replica draws
//!   one data-parallel rank's rows) and `model_config`; the same [`config_hash`] (the training
//!   config has no tensor-parallel field, so a TP run and a one-process run of one config hash
//!   alike).
//! - Save ([`TpTrainer::save_checkpoint`], a collective over the `dp x tp` world). AdamW's
//!   moments share the parameters' flat layout ([`super::TpLayout`]), so parameters and both
//!   moments are assembled whole on every rank of a replica with the same all-gather and
//!   unshard as [`TpTrainer::gather_params`]; then the `d·t` ranks split the writing as `d·t`
//!   data-parallel ranks do (split `dim0`: writer `w = dp_rank·t + tp_rank`, the rank's place
//!   in [`comm::mesh`] order, writes [`ckpt::rank_rows`]`(w, d·t)` of every whole tensor;
//!   writer 0 commits through [`ckpt::handoff`]), so the checkpoint is exactly what `d·t` DP
//!   ranks save. Not yet: each rank writing only the shard it owns without the gather (row
//!   shards are contiguous row blocks, column shards and the fused QKV's per-head blocks are
//!   not).
//! - Load ([`TpTrainer::restore`]). Each rank reads the whole tensors (the reader reassembles
//!   them from whatever pieces a DP, ZeRO or TP save wrote), keeps its part with
//!   [`super::TpLayout::shard_params`] (moments alike), and restores the step, AdamW's step
//!   count and the global row cursor, from which each replica draws its share of the global
//!   batches the saving run would draw next (the same rows whenever the global batch
//!   `batch x replicas x grad_accum` is the same: e.g. DP4 with `b` rows per rank and DP2 x TP2
//!   with `b` rows and `grad_accum` 2).
use std::path::Path;

use ckpt::{Checkpoint, CheckpointMeta, RankWriter};
use serde_json::json;

use super::data_parallel::failures;
use super::trainer::TpTrainer;
use crate::checkpoint::{
    Checkpointer, RunState, SaveSummary, check_state_tensors, config_hash, piece_refs,
    read_whole_state, save_collectively, saved_run, state_metas, whole_state_rows,
};
use crate::error::{Result, TrainError};

impl TpTrainer {
    /// Everything of a checkpoint of the current step but the tensors, as
    /// [`crate::Trainer::checkpoint_meta`] writes it (layout `dp` and `tp` record the saving
    /// degrees; [`TpTrainer::save_checkpoint`] sets `world_size` to the `dp x tp` writers).
    pub fn checkpoint_meta(&mut self, run_id: &str) -> CheckpointMeta {
        let tensors = state_metas(&self.layout().whole);
        let loader = self.loader_state().map(|s| s.to_json());
        let state = RunState {
            step: self.steps_done(),
            optimizer_step: self.optimizer().step_count(),
            batches_drawn: self.batches_drawn(),
            rows_drawn: self.rows_drawn(),
            loader,
            world: self.replicas(),
            config: self.config(),
        }
        .to_json();
        CheckpointMeta {
            run_id: run_id.to_string(),
            world_size: 1,
            layout: json!({"dp": self.replicas(), "tp": self.tp(), "pp": 1, "split": "dim0"}),
            config_hash: config_hash(self.config()),
            tensors,
            state,
        }
    }

    /// The whole parameters and AdamW moments, each in the whole model's layout order. A
    /// collective (every rank must call it); every rank gets them.
    pub fn gather_state(&self) -> Result<[Vec<f32>; 3]> {
        let (m, v) = self.local_moments()?;
        Ok([
            self.gather_whole(self.params_shard())?,
            self.gather_whole(&m)?,
            self.gather_whole(&v)?,
        ])
    }

    /// Saves the current step under `dir` (created if missing) in the [`crate::Trainer`]'s
    /// format: a collective that every rank of the `dp x tp` world must call. The whole state
    /// is gathered on every rank ([`TpTrainer::gather_state`]); writer
    /// `w = replica·tp + rank` of `replicas·tp` writes its [`ckpt::rank_rows`] of every whole
    /// tensor (as that many data-parallel ranks would), writer 0 collects the piece lists
    /// ([`ckpt::handoff`]) and commits. Every rank returns the same outcome: a failed write on
    /// any rank is an error on all and nothing is committed. Returns the step saved.
    pub fn save_checkpoint(&mut self, dir: &Path, run_id: &str) -> Result<u64> {
        let step = self.steps_done();
        let state = self.gather_state()?;
        let (rank, writers) = self.writer();
        let mut meta = self.checkpoint_meta(run_id);
        meta.world_size = writers;
        let write = |meta: &CheckpointMeta| {
            let pieces = whole_state_rows(&self.layout().whole, &state, rank, writers);
            let refs = piece_refs(&meta.tensors, &pieces);
            Ok(RankWriter::write_all(dir, step, rank, &refs)?)
        };
        save_collectively(dir, step, (rank, writers), meta, write, |ok, what| {
            self.agree(step, ok, what)
        })
    }

    /// This rank's writer index `replica·tp + rank` and the `replicas·tp` writers (its rank and
    /// size in the mesh's world).
    pub fn writer(&self) -> (u32, u32) {
        let (tp, replicas) = (self.tp() as u32, self.replicas() as u32);
        (
            self.replica() as u32 * tp + self.rank() as u32,
            replicas * tp,
        )
    }

    /// Saves the current step through `ck` (asynchronously when it saves so: the whole state
    /// gathered in the foreground, a collective, then copied into its host buffer and written
    /// in the background), `ck` saving as [`TpTrainer::writer`].
    pub fn save_into(&mut self, ck: &mut Checkpointer, run_id: &str) -> Result<SaveSummary> {
        let step = self.steps_done();
        let state = self.gather_state()?;
        let (rank, writers) = self.writer();
        let mut meta = self.checkpoint_meta(run_id);
        meta.world_size = writers;
        let pieces = whole_state_rows(&self.layout().whole, &state, rank, writers);
        let refs = piece_refs(&meta.tensors, &pieces);
        ck.save_pieces(step, meta.clone(), &refs)
    }

    /// Sums every rank's failure flag over the `dp x tp` world: an error on every rank when
    /// any rank's `ok` is false (that rank's own error is returned by its caller).
    fn agree(&self, step: u64, ok: bool, what: &str) -> Result<()> {
        let failed = failures(self.group(), self.dp_group(), ok)?;
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

    /// Loads `ckpt`, saved by any layout in the [`crate::Trainer`]'s format (one process,
    /// data-parallel, ZeRO, tensor-parallel or DP x TP), into this rank: the whole tensors are
    /// read and this rank's part kept, and the data cursor set so that this replica draws its
    /// share of the global batches the saving run would have drawn next. Refused, naming what
    /// differs, when a tensor is missing or has another shape (another model) or the training
    /// config differs (as [`crate::Trainer::restore`]). This rank is only changed once
    /// everything has been read.
    pub fn restore(&mut self, ckpt: &Checkpoint) -> Result<()> {
        check_state_tensors(ckpt, &self.layout().whole)?;
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
    /// `dir` holds no committed step. Every rank of the `dp x tp` world calls it and reads the
    /// same step.
    pub fn resume(&mut self, dir: &Path) -> Result<Option<u64>> {
        let Some(ckpt) = crate::checkpoint::newest_committed(dir)? else {
            return Ok(None);
        };
        self.restore(&ckpt)?;
        Ok(Some(ckpt.step()))
    }
}
