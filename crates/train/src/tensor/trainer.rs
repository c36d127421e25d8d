//! Tensor parallelism in the one [`Trainer`] (000 §2.15, F46–F47; with data parallelism,
//! 000 "混合并行" §2.20): the model is split over a TP group ([`TpPart`]) as one more step
//! applied to the same model, and everything else is the data-parallel trainer's.
//!
//! - Model. [`model::model::Model::split`]: every block stored as this rank's shard and run by
//!   the one block with the group as its [`super::BlockComm`] (four all-reduces of (N, C) per
//!   block, F46); the embeddings, norms and head whole. `recompute` recomputes blocks, their
//!   sums included.
//! - Data. Every rank of a TP group draws the same rows: the rows of its data-parallel rank
//!   (tensor parallelism splits the model, not the batch).
//! - Gradients. The replicas' sum is the data-parallel trainer's: buckets all-reduced as the
//!   backward completes them ([`crate::ddp`]), or ZeRO-1/2/3 over the replicas
//!   ([`crate::zero`]: FSDP2 x TP), with every summing collective pinned to
//!   [`TP_ALL_REDUCE`], so each TP rank's data-parallel group sums its replicated tensors in
//!   the same order and they stay bit-identical across the TP group.
//! - Norm. Each element of the whole model counted once over the TP group
//!   ([`TpPart::sum_sq`]), after the replicas' sum (or over ZeRO's parts, then the replicas).
//! - Determinism. The blocks' sums and the replicas' sums use a pinned algorithm; the norm's
//!   exchange and the gathers are exact whatever the algorithm. So repeated runs are
//!   bit-identical.
//! - Memory. Per rank: the split buffer's `L·S + E + Hd` elements (`S` the block shard, `E`
//!   and `Hd` the whole embeddings and head: replicated, where the planner's
//!   vocabulary-parallel formula divides them by `t`), divided over the replicas as ZeRO's
//!   stage says.
use comm::algo::Algo;
use comm::group::{OpOptions, ProcessGroup};
use comm::mesh::DeviceMesh;

use super::TpPart;
use super::data_parallel::agree_across_replicas;
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::trainer::Trainer;
use crate::zero::Stage;

/// The algorithm of every summing collective of a tensor-parallel run, pinned. Left to itself
/// a group picks one per op from its α-β model, which calibration measures anew in every run,
/// so two runs (or two TP ranks' data-parallel groups) could sum in different orders; the
/// ring's order is fixed by the ranks alone (and every rank receives the same reduced bytes),
/// so repeated runs are bit-identical and replicated tensors stay identical.
pub const TP_ALL_REDUCE: Algo = Algo::Ring;

/// The options of every summing collective of a tensor-parallel run: [`TP_ALL_REDUCE`] pinned.
pub const PINNED: OpOptions = OpOptions {
    algo: Some(TP_ALL_REDUCE),
    timeout: None,
};

/// A configuration error naming `field`.
pub(super) fn refuse(field: &'static str, value: &str, reason: &str) -> TrainError {
    TrainError::Config {
        field,
        value: value.into(),
        reason: reason.into(),
    }
}

impl Trainer {
    /// Rank `tp.rank()` of a `tp.size()`-way tensor-parallel run of `cfg` (no replicas). Every
    /// rank initialises the whole model from `cfg.seed` (whole and transiently) and keeps its
    /// part. Errors naming `tp` when the group size does not divide heads, kv_heads or ffn;
    /// any [`TrainConfig::validate`] error.
    pub fn tensor_parallel(cfg: TrainConfig, tp: ProcessGroup) -> Result<Self> {
        Self::build(cfg, None, None, Some((tp, false)))
    }

    /// Rank `tp.rank()` of a tensor-parallel group that is replica `dp.rank()` of `dp.size()`
    /// data-parallel replicas (DP x TP): the replica trains on the rows data-parallel rank
    /// `dp.rank()` takes; the gradients are reduced over `dp` in buckets of `bucket_bytes`
    /// overlapping the backward, or sharded over it by ZeRO `stage`. `dp` must join this tp
    /// rank of every replica and `tp` one replica's ranks (a `dp x tp` grid, as
    /// [`DeviceMesh`] builds); every rank must pass the same config. Checked collectively over
    /// both groups before anything else: an error naming `data_parallel` and the equation on
    /// every rank otherwise. With `sequence` (Megatron's sequence parallelism, 000 L3239) the
    /// residual stream is split by rows over `tp` too.
    pub fn tensor_data_parallel(
        cfg: TrainConfig,
        (tp, sequence): (ProcessGroup, bool),
        dp: ProcessGroup,
        stage: Option<Stage>,
        bucket_bytes: usize,
    ) -> Result<Self> {
        agree_across_replicas(&cfg, &tp, &dp)?;
        let dp = (dp.size() > 1).then_some((dp, bucket_bytes));
        let stage = stage.filter(|_| dp.is_some());
        Self::build(cfg, dp, stage, Some((tp, sequence)))
    }

    /// [`Trainer::tensor_data_parallel`] over a device mesh's tensor- and data-parallel
    /// groups. Errors naming `pipeline_parallel` or `expert_parallel` when the mesh has
    /// `pp > 1` or `ep > 1` (the pipeline's own engine runs those); the same on every rank
    /// (they share the shape), so none waits for another.
    pub fn on_mesh(
        cfg: TrainConfig,
        mesh: &DeviceMesh,
        (stage, sequence): (Option<Stage>, bool),
        bucket_bytes: usize,
    ) -> Result<Self> {
        let shape = mesh.shape();
        for (field, n) in [
            ("pipeline_parallel", shape.pp),
            ("expert_parallel", shape.ep),
        ] {
            if n > 1 {
                return Err(refuse(
                    field,
                    &n.to_string(),
                    &format!(
                        "mesh {shape}: this trainer runs dp x tp (dp {} x tp {} = world, pp 1, \
                         ep 1); pipelines run on their stages' engine",
                        shape.dp, shape.tp
                    ),
                ));
            }
        }
        let (tp, dp) = (mesh.tp().clone(), mesh.dp().clone());
        Self::tensor_data_parallel(cfg, (tp, sequence), dp, stage, bucket_bytes)
    }

    /// The tensor-parallel degree (1 without tensor parallelism).
    pub fn tp(&self) -> usize {
        self.tensor.as_ref().map_or(1, TpPart::tp)
    }

    /// This rank's index in its tensor-parallel group (0 without tensor parallelism).
    pub fn tp_rank(&self) -> usize {
        self.tensor.as_ref().map_or(0, TpPart::rank)
    }

    /// The tensor-parallel part, when the model is split.
    pub fn tensor_part(&self) -> Option<&TpPart> {
        self.tensor.as_ref()
    }

    /// The whole model's parameters in its [`model::layout::Layout`] order, assembled from
    /// every rank's part: ZeRO-3's shards gathered over the replicas, then the tensor-parallel
    /// shards over the TP group. A collective (every rank must call it); exact copies.
    pub fn whole_params(&mut self) -> Result<Vec<f32>> {
        self.gather_params()?;
        let mut whole = match &self.tensor {
            Some(t) => t.gather_whole(&self.config().model, self.params())?,
            None => self.params().to_vec(),
        };
        // Every expert from its owner (the others hold zeros there).
        if let Some(p) = &self.experts {
            let experts = model::layout::Layout::new(&self.config().model).expert_ranges();
            p.complete(&mut whole, &experts)?;
        }
        Ok(whole)
    }
}
