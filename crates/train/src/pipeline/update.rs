//! The optimizer half of a pipeline step ([`super::engine`]): the gradient reductions (tied
//! embeddings over the pipeline, then the data-parallel sum over the replicas), the scaling to
//! the mean, the global norm over the stages, clipping and AdamW on this stage's ranges.
//!
//! With `d` data-parallel replicas of the pipeline (000 §2.20 hybrid parallelism; "3D 训练循环",
//! L2623: DP all-reduces gradients once per step), each stage sums its ranges' gradients with
//! the same stage of the other replicas (one-chunk schedules bucket the sum by unit and launch
//! each bucket as the last micro-batch's backward finishes it, so it overlaps the rest of the
//! backward; interleaved ones after the pipeline has drained) and scales the sum by
//! `(1/m) / d` in one multiplication, as [`crate::ddp::GradBuckets::finish`] does for a
//! data-parallel [`crate::Trainer`]; every replica then holds the same gradients, so the norm,
//! the clipping and the update are the same on all of them. Under ZeRO-1
//! ([`PipelineStage::with_zero`]) each replica holds AdamW moments for its `1/d` shard of every
//! range, steps that shard, and the shards are all-gathered into every replica's parameters.
use std::ops::Range;

use comm::ReduceOp;
use model::optim::clip::NORM_BLOCK;
use model::optim::{
    AdamW, AdamWConfig, Bf16Store, check_finite, clip_coef, grad_sum_sq, scale_grads,
};

use super::engine::PipelineStage;
use crate::error::Result;
use crate::zero::replica::{ReplicaShard, intersect, minus};

/// One range a stage updates: reduced and scaled whole, stepped by AdamW on `part.shard` (the
/// whole range, or under ZeRO-1 this replica's contiguous part of it).
pub(super) struct Update {
    /// The range in the flat buffers (`part.range`) and the part this replica's optimizer
    /// steps (`part.shard`).
    pub(super) part: ReplicaShard,
    /// AdamW over `part.shard`.
    pub(super) opt: AdamW,
    /// Decayed ranges, relative to `part.shard.start`.
    pub(super) decay: Vec<Range<usize>>,
    /// Under bf16 (not with ZeRO-1): the range's f32 master weights with their bf16
    /// parameters and gradients ([`Bf16Store`]); the stage's buffer holds the bf16 values
    /// widened, which the units compute with.
    pub(super) bf16: Option<Bf16Store>,
}

impl Update {
    /// The range's f32 weights the optimizer updates (what a checkpoint saves): the bf16
    /// master weights, else `params`' range.
    pub(super) fn master<'a>(&'a self, params: &'a [f32]) -> &'a [f32] {
        match &self.bf16 {
            Some(store) => store.master(),
            None => &params[self.part.range.clone()],
        }
    }

    /// Sets the range's weights to `master` (f32): the bf16 store rebuilt from it and its
    /// bf16 values widened into `params`, or copied as they are.
    pub(super) fn set_master(&mut self, master: Vec<f32>, params: &mut [f32]) -> Result<()> {
        let range = self.part.range.clone();
        match &mut self.bf16 {
            Some(store) => {
                *store = Bf16Store::new(master);
                store.decode_params(&mut params[range])?;
            }
            None => params[range].copy_from_slice(&master),
        }
        Ok(())
    }

    /// `range` cut into `d` contiguous shards ([`crate::zero::replica::replica_part`]), of which replica `j` steps
    /// its own; `decay_all` are the model's decayed ranges.
    pub(super) fn new(
        cfg: AdamWConfig,
        range: Range<usize>,
        decay_all: &[Range<usize>],
        d: usize,
        j: usize,
    ) -> Result<Update> {
        let part = ReplicaShard::new(range, d, j);
        let decay = part.decay_in(decay_all);
        Ok(Update {
            opt: AdamW::new(cfg, part.shard.len())?,
            part,
            decay,
            bf16: None,
        })
    }
}

impl PipelineStage {
    /// The squared global gradient norm, bit-identical to [`grad_sum_sq`] over one process's
    /// whole buffer: the same [`NORM_BLOCK`] blocks are summed in the same order. A block
    /// inside one stage's ranges is summed by that stage; a block a chunk boundary cuts is
    /// assembled by an all-reduce of its pieces (each element from one stage, the rest zeros,
    /// so exactly) and summed by stage 0; the block sums are all-reduced the same way. Over
    /// the pipeline group only: the replicas' gradients are equal after the data-parallel sum.
    fn global_sum_sq(&self) -> Result<f64> {
        // The experts' ranges are summed apart (each replica owns different ones).
        let holes = self.experts.as_ref().map_or(&[][..], |p| &p.all[..]);
        let total = self.grads.len();
        let blocks = total.div_ceil(NORM_BLOCK);
        let block = |b: usize| b * NORM_BLOCK..((b + 1) * NORM_BLOCK).min(total);
        let mut shared: Vec<usize> = self
            .cuts
            .iter()
            .filter(|&&c| !c.is_multiple_of(NORM_BLOCK))
            .map(|&c| c / NORM_BLOCK)
            .collect();
        shared.dedup();
        let mut partial = vec![0f64; blocks];
        if !shared.is_empty() {
            let mut buf = vec![0f32; shared.len() * NORM_BLOCK];
            for (j, &b) in shared.iter().enumerate() {
                let br = block(b);
                for r in &self.norm_ranges {
                    let Some(x) = intersect(r, &br) else { continue };
                    for x in minus(&x, holes) {
                        let at = j * NORM_BLOCK + x.start - br.start;
                        buf[at..at + x.len()].copy_from_slice(&self.grads[x]);
                    }
                }
            }
            self.group.all_reduce(&mut buf, ReduceOp::Sum)?;
            if self.stage() == 0 {
                for (j, &b) in shared.iter().enumerate() {
                    let at = j * NORM_BLOCK;
                    partial[b] = grad_sum_sq(&self.th, &buf[at..at + block(b).len()]);
                }
            }
        }
        for r in &self.norm_ranges {
            let first = r.start / NORM_BLOCK;
            let mine = &mut partial[first..r.end.div_ceil(NORM_BLOCK)];
            for (b, p) in (first..).zip(mine) {
                if shared.binary_search(&b).is_err() {
                    *p = minus(&block(b), holes)
                        .into_iter()
                        .fold(0.0, |a, x| a + grad_sum_sq(&self.th, &self.grads[x]));
                }
            }
        }
        self.group.all_reduce(&mut partial, ReduceOp::Sum)?;
        Ok(partial.iter().sum::<f64>() + self.experts_sum_sq()?)
    }

    /// Tied-embedding reduction, the data-parallel sum, the `(1/m) / d` scaling, global-norm
    /// clipping and AdamW on this stage's ranges; returns the norm before clipping and the
    /// learning rate.
    pub(super) fn update(&mut self, step: u64, m: usize) -> Result<(f64, f32)> {
        if let Some(wte) = &self.tied {
            // Middle stages contribute zeros, so the sum is the first and last stages' exactly.
            // They hold no `wte` (its pages were handed back), so they lend a transient buffer
            // rather than write the released range.
            let (s, last) = (self.stage(), self.schedule.stages() - 1);
            if s == 0 || s == last {
                self.group
                    .all_reduce(&mut self.grads[wte.clone()], ReduceOp::Sum)?;
            } else {
                self.group
                    .all_reduce(&mut vec![0f32; wte.len()], ReduceOp::Sum)?;
            }
        }
        // Every replica's stage `s` holds the same ranges, so the calls match across the group.
        let opts = self.sum_options();
        let d = match &self.dp {
            Some(dp) if dp.size() > 1 => {
                let d = dp.size();
                match &mut self.buckets {
                    // Launched during the backward: wait, sums written back unscaled
                    // (d / d = 1 exactly); then what the buckets left.
                    Some((b, late)) => {
                        b.finish(&mut self.grads, d as f32)?;
                        for r in late.iter() {
                            dp.all_reduce_with(&mut self.grads[r.clone()], ReduceOp::Sum, &opts)?;
                        }
                    }
                    None => {
                        for u in &self.updates {
                            dp.all_reduce_with(
                                &mut self.grads[u.part.range.clone()],
                                ReduceOp::Sum,
                                &opts,
                            )?;
                        }
                    }
                }
                d
            }
            _ => 1,
        };
        // As `GradBuckets::finish`: (1/m) / d, applied in one multiplication.
        let scale = 1.0 / m as f32 / d as f32;
        if m > 1 || d > 1 {
            for u in &self.updates {
                let r = u.part.range.clone();
                match &self.experts {
                    // The experts' ranges were not summed over the replicas: 1/m only.
                    Some(p) => {
                        p.scale_apart(&self.th, &mut self.grads, &r, (scale, 1.0 / m as f32))
                    }
                    None => scale_grads(&self.th, &mut self.grads[r], scale),
                }
            }
        }
        let norm = match &self.tensor {
            Some(t) => self.tensor_sum_sq(t)?,
            None => self.global_sum_sq()?,
        }
        .sqrt();
        check_finite("gradient norm", step, norm)?;
        if let Some(c) = self.cfg.grad_clip.and_then(|max| clip_coef(norm, max)) {
            for u in &self.updates {
                scale_grads(&self.th, &mut self.grads[u.part.range.clone()], c);
            }
        }
        let lr = self.cfg.schedule.lr_at(self.cfg.lr, self.step);
        for u in &mut self.updates {
            let shard = u.part.shard.clone();
            match &mut u.bf16 {
                // The gradients rounded to bf16, AdamW on the f32 master, the bf16 parameters
                // widened back into the buffer (as the data-parallel trainer's bf16 step).
                Some(store) => {
                    store.store_grads(&self.grads[shard.clone()])?;
                    store.step(&self.th, &mut u.opt, lr, &u.decay[..])?;
                    store.decode_params(&mut self.params[shard])?;
                }
                None => match &self.experts {
                    // The other replicas' experts are skipped (zero here, moments untouched).
                    Some(p) => {
                        let state = (&mut self.params[shard.clone()], &self.grads[shard.clone()]);
                        p.step_owned(&self.th, &mut u.opt, state, shard.start, (lr, &u.decay))?
                    }
                    None => u.opt.step(
                        &self.th,
                        &mut self.params[shard.clone()],
                        &self.grads[shard],
                        lr,
                        &u.decay[..],
                    )?,
                },
            }
        }
        // ZeRO-1: every replica stepped its shard; all-gather the ranges back (exact copies).
        if let Some(dp) = self.dp.as_ref().filter(|d| self.zero && d.size() > 1) {
            for u in &self.updates {
                u.part.gather(dp, &mut self.params)?;
            }
        }
        Ok((norm, lr))
    }
}
