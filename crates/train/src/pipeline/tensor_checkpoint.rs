//! Checkpoints of pipeline stages whose blocks are tensor-parallel (PP x TP x DP, file 000
//! "混合并行", "3D 训练循环"; `pipeline::tensor_stage`), in the [`crate::Trainer`]'s format
//! (`pipeline::checkpoint`), so such a run resumes from any layout's save and any layout
//! resumes from its.
//!
//! - Save. The ranks of a stage's TP group assemble the stage's entries whole (parameters and
//!   both AdamW moments, [`PipelineStage::stage_view`]: each element from one TP rank, so
//!   exactly), then each writes its part of every chunk range: TP rank `r` of replica `j`
//!   writes part `j t + r` of `d t` (as row-major boxes, like every pipeline writer), so the
//!   `d t` ranks of a stage split its entries. Writer index `r + t (j + d s)`, the mesh's rank
//!   order (`rank = tp + T (dp + D slab)`).
//!   Under ZeRO-1 the replicas first sum their zero-padded moment shards, so the TP group
//!   assembles whole moments. (Both assemblies gather: this writer does not yet write only
//!   what a rank owns, as the data-parallel and DP x TP writers do.)
//! - Restore. Each rank reads the whole tensors of its units (and a tied last stage's `wte`),
//!   keeps the embeddings and the head whole and shards every block with its plan
//!   ([`crate::tensor::TpShard::shard`]); AdamW is elementwise, so a moment's shard is the
//!   shard of the moment, as for the parameters.
use comm::ReduceOp;
use model::optim::AdamW;

use super::engine::PipelineStage;
use super::tensor_stage::{TensorPart, unit_range};
use crate::checkpoint::read_state_range;
use crate::error::Result;

impl PipelineStage {
    /// The parameters and both moments of this stage in the whole model's coordinates,
    /// current on its chunk ranges and zeros elsewhere (a collective over the TP group).
    pub(super) fn tensor_views(&self, t: &TensorPart) -> Result<[Vec<f32>; 3]> {
        let total = self.layout.total;
        let (mut m, mut v) = (vec![0f32; total], vec![0f32; total]);
        for u in &self.updates {
            let (um, uv) = u.opt.moments();
            m[u.part.shard.clone()].copy_from_slice(um);
            v[u.part.shard.clone()].copy_from_slice(uv);
        }
        // Under ZeRO-1 each replica holds its shard of the moments: the replicas' zero-padded
        // shards summed are the whole moments, exactly (each element from one replica).
        if let Some(dp) = self.dp.as_ref().filter(|d| self.zero && d.size() > 1) {
            let opts = self.sum_options();
            for u in &self.updates {
                for buf in [&mut m, &mut v] {
                    dp.all_reduce_with(&mut buf[u.part.range.clone()], ReduceOp::Sum, &opts)?;
                }
            }
        }
        // The f32 weights the optimizer updates (bf16: the master weights).
        let mut master = self.params.to_vec();
        for u in &self.updates {
            master[u.part.range.clone()].copy_from_slice(u.master(&self.params));
        }
        Ok([
            self.stage_view(t, &master)?,
            self.stage_view(t, &m)?,
            self.stage_view(t, &v)?,
        ])
    }

    /// Per update range, in the stage's order: its parameters and AdamW with the saved
    /// moments and `optimizer_step`, read from `ckpt`'s whole tensors and sharded for this TP
    /// rank.
    pub(super) fn read_tensor(
        &self,
        t: &TensorPart,
        ckpt: &ckpt::Checkpoint,
        optimizer_step: u64,
    ) -> Result<(Vec<Vec<f32>>, Vec<AdamW>)> {
        let total = self.layout.total;
        // Parameters, m, v in the stage's flat coordinates, filled on the ranges it updates.
        let mut state = [vec![0f32; total], vec![0f32; total], vec![0f32; total]];
        let last = self.stage() + 1 == self.schedule.stages();
        let tied = self.tied.clone().filter(|_| last);
        let units = self.chunks.iter().flat_map(|c| c.units.iter().copied());
        let wholes = units
            .map(|u| (self.layout.unit_range(u), Some(u)))
            .chain(tied.map(|wte| (wte, None)));
        for (whole, unit) in wholes {
            let read = read_state_range(ckpt, &self.layout, whole.clone())?;
            for (buf, src) in state.iter_mut().zip(&read) {
                match unit {
                    Some(u @ model::layout::Unit::Block(_)) => {
                        let at = unit_range(&self.layout, &t.plan, u);
                        t.plan.shard.shard(src, &mut buf[at])?;
                    }
                    _ => buf[whole.clone()].copy_from_slice(src),
                }
            }
        }
        let [p, m, v] = state;
        let mut params = Vec::with_capacity(self.updates.len());
        let mut opts = Vec::with_capacity(self.updates.len());
        for u in &self.updates {
            params.push(p[u.part.range.clone()].to_vec());
            let (um, uv) = (
                m[u.part.shard.clone()].to_vec(),
                v[u.part.shard.clone()].to_vec(),
            );
            opts.push(AdamW::from_state(self.cfg.adamw, um, uv, optimizer_step)?);
        }
        Ok((params, opts))
    }
}
