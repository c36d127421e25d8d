//! Expert parallelism inside pipeline stages (PP x EP, 000 "专家并行" with "混合并行"): every
//! stage's blocks carry experts split over the stage's data-parallel replicas (ep = the
//! data-parallel degree), the one model built for the rank's experts ([`Model::parts`]), as in
//! the data-parallel trainer ([`crate::expert`]): the stage's flat buffers keep every expert's
//! place, the rank owns its experts' ranges and keeps the others at zero; the bucketed
//! reduction over the replicas skips the experts' ranges (each expert's gradient already holds
//! every replica's tokens), which are scaled by `1/m` only; the norm adds the owners' squares
//! over the replicas; a checkpoint takes each expert from its owner.
use model::model::Model;

use super::engine::PipelineStage;
use crate::ddp::GradBuckets;
use crate::error::{Result, TrainError};
use crate::expert::{ExpertPart, cut_out};
use crate::tensor::sum_in_rank_order;
use crate::zero::replica::intersect;
use comm::ReduceOp;
use model::optim::grad_sum_sq;

fn refuse(reason: &str) -> TrainError {
    TrainError::Config {
        field: "expert_parallel",
        value: "pipeline".into(),
        reason: reason.into(),
    }
}

impl PipelineStage {
    /// This stage with its blocks' experts split over its data-parallel replicas (see the
    /// module doc). Refuses a dense model, a stage without replicas, tensor-parallel stages,
    /// ZeRO and the interleaved schedules (their reduction is not bucketed), naming why.
    pub fn with_experts(mut self) -> Result<Self> {
        let cfg = self.cfg.clone();
        if cfg.model.moe.is_none() {
            return Err(refuse("the model has no experts (--experts E)"));
        }
        let Some(dp) = self.dp.clone().filter(|d| d.size() > 1) else {
            return Err(refuse(
                "experts split over replicas need data-parallel replicas",
            ));
        };
        if self.tensor.is_some() || self.zero {
            return Err(refuse(
                "experts in tensor-parallel or ZeRO pipeline stages are not built yet",
            ));
        }
        let Some((buckets, late)) = self.buckets.take() else {
            return Err(refuse(
                "experts need the bucketed reduction of one-chunk schedules (1f1b, gpipe)",
            ));
        };
        let (ep, rank) = (dp.size(), dp.rank());
        for slot in &mut self.slots {
            let recompute = vec![cfg.recompute; cfg.model.layers];
            let rows = (cfg.batch, cfg.seq_len);
            slot.model = Model::parts(&cfg.model, rows, recompute, (1, false), (ep, rank), true)?;
            slot.experts = Some(dp.clone());
        }
        let part = ExpertPart::new(&self.layout, dp.clone());
        let others = cut_out(&part.all, &part.owned);
        for r in &others {
            self.params.release(r.clone());
        }
        for u in &mut self.updates {
            if u.bf16.is_some() {
                // The f32 masters of the others' experts zeroed as well.
                let mut master = u.master(&self.params).to_vec();
                part.zero_within(&mut master, u.part.range.start);
                u.set_master(master, &mut self.params)?;
            }
        }
        let dense = part.dense_buckets(buckets.buckets());
        let buckets = GradBuckets::over(dp, dense, self.layout.total);
        self.buckets = Some((buckets, cut_out(&late, &part.all)));
        self.experts = Some(part);
        Ok(self)
    }

    /// Σ over the whole pipeline of the squares of the owners' expert gradients (0 without
    /// experts): this rank's summed over the stages, then over the replicas in rank order (the
    /// same bits on every rank).
    pub(super) fn experts_sum_sq(&self) -> Result<f64> {
        let Some(p) = &self.experts else {
            return Ok(0.0);
        };
        let mine = p
            .owned
            .iter()
            .flat_map(|o| self.norm_ranges.iter().filter_map(|r| intersect(o, r)))
            .fold(0.0, |a, r| a + grad_sum_sq(&self.th, &self.grads[r]));
        let mut stages = [mine];
        self.group.all_reduce(&mut stages, ReduceOp::Sum)?;
        sum_in_rank_order(&p.group, stages[0])
    }
}
