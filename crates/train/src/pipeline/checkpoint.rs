//! Checkpoints of a pipeline-parallel run (alone, DP x PP, or with ZeRO-1 inside a stage) in
//! the [`crate::Trainer`]'s format (issue 8: a checkpoint moves between layouts), so one
//! process, a data-parallel group (with or without ZeRO), a tensor-parallel group and a
//! pipeline resume from each other's saves.
//!
//! - Format. Exactly [`crate::checkpoint`]'s: one float32 tensor per entry of the whole
//!   model's layout under `model.`, `optim.exp_avg.` and `optim.exp_avg_sq.`, in global
//!   shapes; state `step`, `optimizer_step`, `batches_drawn` (micro-batches drawn, `m` per
//!   step), `rows_drawn` (the global row cursor), `loader`, `seed`, `world` (the replicas, the
//!   data-parallel ranks drawing rows) and `model_config`; the same [`config_hash`] (the
//!   training config has no pipeline field, and the hash ignores `grad_accum`, which is `m`
//!   here: a pipeline with `m` micro-batches and a data-parallel `Trainer` without
//!   accumulation hash alike). Layout `{"dp": d, "tp": t, "pp": p, "split": "stage-flat",
//!   "zero": 0 | 1}` records the saving layout; readers do not need it.
//! - Save ([`PipelineStage::save_checkpoint`], a collective over all `p x d (x t)` ranks). The
//!   stages' chunk ranges partition the flat buffer and each holds whole layout entries, so
//!   stage `s` writes the tensors of its entries; a tied last stage's copy of `wte` is left to
//!   stage 0, which owns it. Within a stage, replica `j` of `d` writes part `j` of every chunk
//!   range (`j L / d .. (j + 1) L / d`, the cut ZeRO-1 shards by) of the parameters and both
//!   moments, as the row-major boxes that cover it exactly
//!   ([`crate::zero::state::flat_boxes`], as a ZeRO rank writes its flat parts). Under ZeRO-1
//!   that part is exactly the moments the replica holds, so sharded moments are written
//!   without any gather; unsharded replicas split the writing the same way. Every rank is one
//!   writer, with global writer index `replica + d x stage` (the rank order of a dp x pp
//!   [`comm::mesh::DeviceMesh`] whose stages are in order); writer 0 (stage 0 of replica 0)
//!   collects the piece lists ([`ckpt::handoff`]) and commits, as the tensor-parallel and
//!   data-parallel saves do. A failure on any rank fails all, with nothing committed. Stages
//!   with tensor-parallel blocks (`t > 1`) assemble their entries whole over the TP group and
//!   split the writing over their `d t` ranks, writer index `tp + t (replica + d stage)`
//!   (`pipeline::tensor_checkpoint`).
//! - Load ([`PipelineStage::restore`], a collective). Each stage reads the whole tensors of the
//!   entries in its ranges (the reader assembles them from whatever pieces a DP, ZeRO, TP or PP
//!   save wrote), keeps its ranges of the parameters and its (possibly ZeRO-1 sharded) part of
//!   the moments, and restores the step, AdamW's step count and the global row cursor, so the
//!   next global batch is the one the saving run would draw next. A checkpoint of another
//!   model or training config is refused naming what differs; the stage changes only once
//!   every rank has read everything. Tensor-parallel stages shard each block they read with
//!   their plan.
use std::ops::Range;
use std::path::Path;

use ckpt::{Checkpoint, CheckpointMeta, RankWriter, f32_bytes};
use comm::ReduceOp;
use model::optim::AdamW;
use serde_json::json;

use super::build::{intersect, minus, replica_share};
use super::engine::PipelineStage;
use crate::checkpoint::{
    Checkpointer, RunState, SaveSummary, check_state_tensors, config_hash, piece_refs,
    read_state_range, save_collectively, saved_run, state_metas,
};
use crate::error::{Result, TrainError};
use crate::source::Source;
use crate::zero::replica::replica_part;
use crate::zero::state::{StatePiece, flat_boxes};

/// Everything a restore replaces, read and checked before anything is changed.
struct Loaded {
    /// Per update range, in the stage's order: its parameters.
    params: Vec<Vec<f32>>,
    /// Per update range: AdamW over its shard, with the saved moments and step count.
    opts: Vec<AdamW>,
    step: u64,
    source: Source,
    rows: u64,
}

impl PipelineStage {
    /// This rank's writer index and the number of writers in a checkpoint:
    /// `(tp_rank + t x (replica + d x stage), t x p x d)` with `t` the stage's TP degree
    /// (1 without tensor parallelism).
    pub fn writer(&self) -> (u32, u32) {
        let (d, t) = (self.replicas(), self.tensor_parallel());
        let index = self.tensor_rank() + t * (self.replica() + d * self.stage());
        (index as u32, (t * d * self.schedule.stages()) as u32)
    }

    /// Everything of a checkpoint of the current step but the tensors, as
    /// [`crate::Trainer::checkpoint_meta`] writes it (see the module doc for the state and the
    /// layout); `world_size` is the number of writers ([`PipelineStage::writer`]).
    pub fn checkpoint_meta(&mut self, run_id: &str) -> CheckpointMeta {
        let loader = self.source.loader_state().map(|s| s.to_json());
        let optimizer_step = self.updates.first().map_or(0, |u| u.opt.step_count());
        let state = RunState {
            step: self.step,
            optimizer_step,
            batches_drawn: self.drawn,
            rows_drawn: self.rows_drawn(),
            loader,
            world: self.replicas(),
            config: &self.cfg,
        }
        .to_json();
        let layout = json!({
            "dp": self.replicas(),
            "tp": self.tensor_parallel(),
            "pp": self.schedule.stages(),
            "split": "stage-flat",
            "zero": u8::from(self.zero),
        });
        CheckpointMeta {
            run_id: run_id.to_string(),
            world_size: self.writer().1,
            layout,
            config_hash: config_hash(&self.cfg),
            tensors: state_metas(&self.layout),
            state,
        }
    }

    /// The pieces this rank writes (see the module doc): replica `j`'s part of every chunk
    /// range, for the parameters and both moments, each naming its tensor by index into
    /// [`state_metas`]. With tensor-parallel stages, `views` are the stage's entries
    /// assembled whole (`pipeline::tensor_checkpoint`) and TP rank `r` of replica `j` writes
    /// part `j t + r` of `d t` of every chunk range.
    fn checkpoint_pieces<'a>(&'a self, views: Option<&'a [Vec<f32>; 3]>) -> Vec<StatePiece<'a>> {
        let (d, j) = (self.replicas(), self.replica());
        let mut out = Vec::new();
        let Some([p, m, v]) = views else {
            // The first `chunks` updates are the chunk ranges (`build`); a tied last stage's
            // extra `wte` update is stage 0's to write.
            for u in &self.updates[..self.chunks.len()] {
                let part = replica_part(&u.part.range, d, j);
                let (m, v) = u.opt.moments();
                // Where element `x` of the flat buffer lies in each source: the parameters are
                // whole-model, the moments cover `u.part.shard` (which holds `part`, sharded or not).
                let sources = [
                    (u.master(&self.params), u.part.range.start),
                    (m, u.part.shard.start),
                    (v, u.part.shard.start),
                ];
                match &self.experts {
                    None => self.range_pieces(&part, sources, &mut out),
                    // The replicas split the dense parts; each expert is written by its owner.
                    Some(e) => {
                        for piece in minus(&part, &e.all) {
                            self.range_pieces(&piece, sources, &mut out);
                        }
                        for own in e.owned.iter().filter_map(|o| intersect(o, &u.part.range)) {
                            self.range_pieces(&own, sources, &mut out);
                        }
                    }
                }
            }
            return out;
        };
        let (t, r) = (self.tensor_parallel(), self.tensor_rank());
        for c in &self.chunks {
            let part = replica_part(&c.range, d * t, j * t + r);
            self.range_pieces(&part, [(p, 0), (m, 0), (v, 0)], &mut out);
        }
        out
    }

    /// Appends the row-major boxes of every entry's part inside `part` (flat coordinates) for
    /// the parameters and both moments, `sources[i]` holding flat element `x` at `x - base`.
    fn range_pieces<'a>(
        &self,
        part: &Range<usize>,
        sources: [(&'a [f32], usize); 3],
        out: &mut Vec<StatePiece<'a>>,
    ) {
        let entries = &self.layout.entries;
        for (which, (src, base)) in sources.into_iter().enumerate() {
            for (i, e) in entries.iter().enumerate() {
                let Some(x) = intersect(&e.range(), part) else {
                    continue;
                };
                for (slice, sub) in flat_boxes(&e.shape, x.start - e.offset..x.end - e.offset) {
                    let at = e.offset + sub.start - base;
                    let bytes = f32_bytes(&src[at..at + sub.len()]);
                    out.push((which * entries.len() + i, slice, bytes));
                }
            }
        }
    }

    /// Saves the current step under `dir` (created if missing) in the [`crate::Trainer`]'s
    /// format: a collective that every rank of every replica must call. Each rank writes its
    /// pieces (module doc) in parallel; once every file is durable (or some rank failed, so
    /// writer 0 never waits for a writer that gave up) the others publish their piece lists and
    /// writer 0 collects them and commits. Every rank returns the same outcome: a failed write
    /// on any rank is an error on all and nothing is committed. Returns the step saved.
    pub fn save_checkpoint(&mut self, dir: &Path, run_id: &str) -> Result<u64> {
        let step = self.step;
        // Tensor-parallel stages assemble their entries whole first (a collective over the TP
        // group, so every rank makes it before any rank can fail on its own).
        let views = match &self.tensor {
            Some(t) => Some(self.tensor_views(t)?),
            None => None,
        };
        let writer = self.writer();
        let meta = self.checkpoint_meta(run_id);
        let write = |meta: &CheckpointMeta| {
            let pieces = self.checkpoint_pieces(views.as_ref());
            let refs = piece_refs(&meta.tensors, &pieces);
            Ok(RankWriter::write_all(dir, step, writer.0, &refs)?)
        };
        save_collectively(dir, step, writer, meta, write, |ok, what| {
            self.agree_saved(step, ok, what)
        })
    }

    /// Saves the current step through `ck` (asynchronously when it saves so: tensor-parallel
    /// stages assemble their entries in the foreground, a collective, then this rank's pieces
    /// are copied into the host buffer and written in the background), `ck` saving as
    /// [`PipelineStage::writer`].
    pub fn save_into(&mut self, ck: &mut Checkpointer, run_id: &str) -> Result<SaveSummary> {
        let step = self.step;
        let views = match &self.tensor {
            Some(t) => Some(self.tensor_views(t)?),
            None => None,
        };
        let meta = self.checkpoint_meta(run_id);
        let pieces = self.checkpoint_pieces(views.as_ref());
        let refs = piece_refs(&meta.tensors, &pieces);
        ck.save_pieces(step, meta.clone(), &refs)
    }

    /// An error on every rank whose `ok` is true when any rank's is false (that rank returns
    /// its own error).
    fn agree_saved(&self, step: u64, ok: bool, what: &str) -> Result<()> {
        let failed = self.failures(ok)?;
        if ok && failed > 0 {
            return Err(TrainError::Config {
                field: "checkpoint save",
                value: format!("step {step}"),
                reason: format!(
                    "{failed} of the {} writers failed to {what} it",
                    self.writer().1
                ),
            });
        }
        Ok(())
    }

    /// The number of ranks, over the whole dp x pp world, whose `ok` is false (a collective:
    /// summed over the pipeline, then over the replicas of this stage, which covers every rank
    /// once).
    fn failures(&self, ok: bool) -> Result<u32> {
        let mut failed = [f32::from(u8::from(!ok))];
        self.group.all_reduce(&mut failed, ReduceOp::Sum)?;
        if let Some(dp) = self.dp.as_ref().filter(|d| d.size() > 1) {
            dp.all_reduce(&mut failed, ReduceOp::Sum)?;
        }
        if let Some(t) = &self.tensor {
            t.group.all_reduce(&mut failed, ReduceOp::Sum)?;
        }
        Ok(failed[0] as u32)
    }

    /// Loads `ckpt`, saved by any layout in the [`crate::Trainer`]'s format (one process,
    /// data-parallel, ZeRO, tensor- or pipeline-parallel), into this stage: a collective that
    /// every rank must call. Refused, naming what differs, when a tensor is missing or has
    /// another shape (another model) or the training config differs (as
    /// [`crate::Trainer::restore`]); when any rank cannot load it, every rank fails. The stage
    /// is only changed once every rank has read everything.
    pub fn restore(&mut self, ckpt: &Checkpoint) -> Result<()> {
        let loaded = self.read(ckpt);
        let failed = self.failures(loaded.is_ok())?;
        let loaded = loaded?;
        if failed > 0 {
            return Err(TrainError::Resume {
                step: ckpt.step(),
                reason: format!(
                    "{failed} of the {} pipeline ranks could not load it",
                    self.writer().1
                ),
            });
        }
        for ((u, params), opt) in self.updates.iter_mut().zip(loaded.params).zip(loaded.opts) {
            u.set_master(params, &mut self.params)?;
            u.opt = opt;
        }
        self.step = loaded.step;
        self.source = loaded.source;
        let per = self.global_rows();
        self.drawn = loaded.rows / per;
        self.rows_base = loaded.rows % per;
        Ok(())
    }

    /// Reads and checks what [`PipelineStage::restore`] replaces.
    fn read(&self, ckpt: &Checkpoint) -> Result<Loaded> {
        check_state_tensors(ckpt, &self.layout)?;
        let run = saved_run(ckpt, &self.cfg)?;
        let (params, opts) = match &self.tensor {
            Some(t) => self.read_tensor(t, ckpt, run.optimizer_step)?,
            None => self.read_ranges(ckpt, run.optimizer_step)?,
        };
        // The data source at the saved global row cursor (token datasets: the loader's state).
        let c = &self.cfg;
        let share = replica_share(c, self.dp.as_ref());
        let loader = run.loader.as_ref();
        let mut source = Source::new(&c.data, c.model.vocab, c.seq_len, share, c.seed, loader)?;
        if loader.is_none() {
            source.skip_rows(run.rows, c.seq_len)?;
        }
        Ok(Loaded {
            params,
            opts,
            step: run.step,
            source,
            rows: run.rows,
        })
    }

    /// Per update range, in the stage's order: its parameters and AdamW over its (possibly
    /// ZeRO-1 sharded) part with the saved moments and `optimizer_step`.
    fn read_ranges(
        &self,
        ckpt: &Checkpoint,
        optimizer_step: u64,
    ) -> Result<(Vec<Vec<f32>>, Vec<AdamW>)> {
        let (mut params, mut opts) = (Vec::new(), Vec::new());
        for u in &self.updates {
            let [mut p, mut m, mut v] = read_state_range(ckpt, &self.layout, u.part.range.clone())?;
            // The others' experts stay at zero here (their owners hold them).
            if let Some(e) = &self.experts {
                for b in [&mut p, &mut m, &mut v] {
                    e.zero_within(b, u.part.range.start);
                }
            }
            let mine: Range<usize> =
                u.part.shard.start - u.part.range.start..u.part.shard.end - u.part.range.start;
            let (m, v) = (m[mine.clone()].to_vec(), v[mine].to_vec());
            opts.push(AdamW::from_state(self.cfg.adamw, m, v, optimizer_step)?);
            params.push(p);
        }
        Ok((params, opts))
    }

    /// Restores this stage from the newest committed step under `dir` (verifying the manifest;
    /// each tensor's bytes are verified as read). Returns the step resumed from, or `None` when
    /// `dir` holds no committed step. A collective: every rank calls it and reads the same step.
    pub fn resume(&mut self, dir: &Path) -> Result<Option<u64>> {
        let Some(ckpt) = crate::checkpoint::newest_committed(dir)? else {
            return Ok(None);
        };
        self.restore(&ckpt)?;
        Ok(Some(ckpt.step()))
    }
}
