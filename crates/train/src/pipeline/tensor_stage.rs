//! Tensor parallelism inside pipeline stages: PP x TP (x DP) on one device mesh (file 000
//! "混合并行", §2.20 Fig 5.18; "3D 训练循环"; the blocks Megatron-style, "Megatron 风格的张量并行").
//!
//! ```text
//!            stage 0 (embeddings, blocks 0..k)        stage 1 (blocks k..L, head)
//! tp rank 0: embed ── blocks (shard 0) ── x ──send──▶ blocks (shard 0) ── norm ── head ── CE
//! tp rank 1: embed ── blocks (shard 1) ── x ──send──▶ blocks (shard 1) ── norm ── head ── CE
//!                 └─ 4 all-reduces per block ─┘ (TP group)   gradients flow back the same way
//! ```
//!
//! - Messages. Each TP rank of stage `s` exchanges the whole residual (N, C) with the
//!   same-TP-index rank of stage `s ± 1`: that is exactly the mesh's pipeline group of the
//!   rank ([`comm::mesh::DeviceMesh::pp`]: the ranks with its dp and tp coordinates, in stage
//!   order), so the schedule executor of [`super::engine`] runs unchanged on it.
//! - Units. Every slot is the one [`Model`], split over the stage's TP group and reading its
//!   shards at the whole model's addresses ([`Model::split_in_place`]): the embeddings (first
//!   stage) and the final norm and head (last stage) whole and replicated over the group,
//!   every block the one block on this rank's shard summing over the group (recomputed in
//!   the backward with `recompute`). The residual after every block is whole and the same on
//!   every TP rank, so the replicated units get identical inputs and identical gradients with
//!   no communication.
//! - Flat buffers. The stage's parameter and gradient buffers keep the whole model's
//!   [`Layout`] addresses (so the embedding and head kernels index them as in one process),
//!   with block `l`'s shard (`S = shard.local.size` elements, laid out as the narrower block of
//!   [`crate::tensor::TpShard`]) at the start of the block's range, `blocks[l].start ..
//!   blocks[l].start + S`; the rest of the block's range is never written and its pages are
//!   handed back with every other range the stage does not own.
//! - Step. As the pipeline's (`pipeline::update`): the tied-embedding sum over the pipeline
//!   group, the sum over the replicas (pinned to the ring, as every summing all-reduce of
//!   this layout, so repeated runs are bit-identical), the `1/(m d)` scaling, then the global
//!   norm counting each element of the whole model once across the mesh: TP rank 0 of each
//!   stage counts all it owns, the other TP ranks only their column- and row-parallel slices
//!   ([`TpLayout::norm_ranges`]), summed exactly over the stages and then over the TP ranks
//!   (the same value on every rank); clipping and AdamW on the rank's own ranges.
//! - Checkpoints (`pipeline::tensor_checkpoint`): the [`crate::Trainer`]'s format, the stage's
//!   entries assembled whole over the TP group ([`PipelineStage::stage_view`]) and every block
//!   read back sharded.
use std::ops::Range;

use comm::ReduceOp;
use comm::group::{OpOptions, ProcessGroup};
use model::Threads;
use model::config::ModelConfig;
use model::layout::{Layout, Unit};
use model::model::Model;
use model::optim::grad_sum_sq;

use super::build::{Chunk, intersect};
use super::engine::PipelineStage;
use crate::config::TrainConfig;
use crate::error::Result;
use crate::expert::{BlockGroups, ExpertGroup};
use crate::tensor::{BlockComm, PINNED, TpGroup};
use crate::tensor::{TpLayout, check_tp};
use crate::zero::Window;

/// A stage's tensor-parallel part: its TP group, this rank's plan, the ranges it owns and
/// those it counts in the global norm.
pub(super) struct TensorPart {
    /// The stage's TP group (the same stage and replica, every TP index).
    pub(super) group: ProcessGroup,
    /// This rank's shard plan, in compact coordinates (see [`packed`]).
    pub(super) plan: TpLayout,
    /// The ranges of the stage's flat buffers this rank owns: its units' [`unit_range`]s
    /// (adjacent ones merged), the embeddings and head whole, each block's shard.
    pub(super) owned: Vec<Range<usize>>,
    /// The parts of `owned` whose gradients this rank counts in the norm.
    pub(super) counted: Vec<Range<usize>>,
    /// Whether the residual stream is split by rows over the group (sequence parallelism).
    pub(super) sequence: bool,
}

/// Checks that `tp` ranks can split every block of `model` ([`check_tp`]: whole heads per
/// rank, the field named).
pub(super) fn check_tensor_parallel(model: &ModelConfig, tp: usize) -> Result<()> {
    check_tp(model, tp)
}

/// The range of the stage's flat buffers that holds `unit` of this rank: the whole model's
/// for the embeddings and the head, the block's first `S` elements for its shard.
pub(super) fn unit_range(layout: &Layout, plan: &TpLayout, unit: Unit) -> Range<usize> {
    match unit {
        Unit::Block(l) => {
            let start = layout.blocks[l].start;
            start..start + plan.shard.local.size
        }
        other => layout.unit_range(other),
    }
}

/// `r`, a range of the compact TP buffer ([`TpLayout`]: embeddings, the block shards end to
/// end, the head), as ranges of the stage's flat buffers (see the module doc).
fn packed(layout: &Layout, plan: &TpLayout, r: &Range<usize>) -> Vec<Range<usize>> {
    let mut segments = vec![(plan.embed.clone(), 0)];
    for (l, b) in plan.blocks.iter().enumerate() {
        segments.push((b.clone(), layout.blocks[l].start));
    }
    segments.push((plan.head.clone(), layout.unit_range(Unit::Head).start));
    segments
        .into_iter()
        .filter_map(|(seg, at)| {
            intersect(r, &seg).map(|x| at + x.start - seg.start..at + x.end - seg.start)
        })
        .collect()
}

/// The ranges of `packed(rs)` that lie inside `owned`.
fn packed_within(
    layout: &Layout,
    plan: &TpLayout,
    rs: &[Range<usize>],
    owned: &[Range<usize>],
) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    for r in rs {
        for p in packed(layout, plan, r) {
            out.extend(owned.iter().filter_map(|o| intersect(&p, o)));
        }
    }
    out
}

/// The ranges a stage holding `chunks` owns on the TP rank of `plan`: every unit's
/// [`unit_range`] (adjacent ones merged), the embeddings and head whole, each block's shard.
fn owned_ranges(layout: &Layout, plan: &TpLayout, chunks: &[Chunk]) -> Vec<Range<usize>> {
    let mut owned: Vec<Range<usize>> = Vec::new();
    for u in chunks.iter().flat_map(|c| c.units.iter()) {
        let r = unit_range(layout, plan, *u);
        match owned.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => owned.push(r),
        }
    }
    owned
}

impl TensorPart {
    /// Rank `group.rank()` of the `group.size()`-way TP group of a stage holding `chunks`.
    pub(super) fn new(
        cfg: &TrainConfig,
        (group, sequence): (ProcessGroup, bool),
        layout: &Layout,
        chunks: &[Chunk],
    ) -> Result<Self> {
        let (tp, rank) = (group.size(), group.rank());
        let plan = TpLayout::new(&cfg.model, tp, rank, cfg.batch, cfg.seq_len)?;
        let owned = owned_ranges(layout, &plan, chunks);
        let counted = packed_within(layout, &plan, &plan.norm_ranges(), &owned);
        Ok(Self {
            group,
            plan,
            owned,
            counted,
            sequence,
        })
    }

    /// The decayed ranges of the stage's flat buffers (the whole model's decayed elements,
    /// wherever the shard keeps them; [`TpLayout::decay_ranges`]).
    pub(super) fn decay(&self, layout: &Layout, all: bool) -> Result<Vec<Range<usize>>> {
        let compact = self.plan.decay_ranges(all)?;
        Ok(compact
            .iter()
            .flat_map(|r| packed(layout, &self.plan, r))
            .collect())
    }

    /// Replaces, in `params` (the whole model as initialised from the seed), every block of
    /// `chunks` by this rank's shard at the block's start.
    pub(super) fn shard_blocks(
        &self,
        layout: &Layout,
        chunks: &[Chunk],
        params: &mut Window,
    ) -> Result<()> {
        for u in chunks.iter().flat_map(|c| c.units.iter()) {
            if let Unit::Block(l) = *u {
                let whole = params[layout.blocks[l].clone()].to_vec();
                let at = unit_range(layout, &self.plan, *u);
                self.plan.shard.shard(&whole, &mut params[at])?;
            }
        }
        Ok(())
    }
}

/// `mine` summed over `group` exactly and in rank order, the same bits on every rank: each
/// rank fills its slot of a zeroed vector, the all-reduce adds only zeros to each slot.
fn sum_exactly(group: &ProcessGroup, mine: f64) -> Result<f64> {
    let mut slots = vec![0f64; group.size()];
    slots[group.rank()] = mine;
    group.all_reduce(&mut slots, ReduceOp::Sum)?;
    Ok(slots.iter().sum())
}

/// One micro-batch in flight on a stage: the model's activation arena (every unit of the
/// stage's chunks) and, when its blocks are split, the TP group they sum over. The model is the
/// one [`Model`] for every layout: whole, or split over the TP group with its shards read at
/// the whole model's addresses ([`Model::split_in_place`]).
pub(super) struct Slot {
    pub(super) model: Model<f32>,
    /// The TP group and whether it splits the rows too (sequence parallelism).
    group: Option<(ProcessGroup, bool)>,
    /// The EP group the blocks' experts exchange rows over, when they are split.
    pub(super) experts: Option<ProcessGroup>,
}

/// What a slot's units read: the worker threads and the stage's parameters.
pub(super) struct Run<'a> {
    pub(super) th: &'a Threads,
    pub(super) params: &'a [f32],
}

impl Slot {
    /// A slot over `model`, its blocks summing over `tensor`'s group when given.
    pub(super) fn new(model: Model<f32>, tensor: Option<&TensorPart>) -> Self {
        Self {
            model,
            group: tensor.map(|t| (t.group.clone(), t.sequence)),
            experts: None,
        }
    }

    /// Runs `f` with this slot's model and its blocks' communication.
    fn with_comm<R>(
        &mut self,
        f: impl FnOnce(&mut Model<f32>, &mut dyn BlockComm<f32>) -> Result<R>,
    ) -> Result<R> {
        let mut groups = BlockGroups {
            tp: self.group.as_ref().map(|(g, sequence)| TpGroup {
                sequence: *sequence,
                ..TpGroup::new(g)
            }),
            experts: self.experts.as_ref().map(ExpertGroup::new),
        };
        f(&mut self.model, &mut groups)
    }

    /// Forward of a local chunk (`units`, in order) of one micro-batch: from `tokens` when it
    /// starts at the embeddings, else from `input`, the residual received; with `targets` when
    /// it ends at the head (then [`Slot::loss`] holds the loss).
    pub(super) fn forward(
        &mut self,
        run: &Run,
        units: &[Unit],
        input: Option<&[f32]>,
        tokens: &[u32],
        targets: Option<&[u32]>,
    ) -> Result<()> {
        let (th, p) = (run.th, run.params);
        self.with_comm(|model, comm| {
            match input {
                None => model.begin_at(units[0], None, Some(tokens), targets)?,
                Some(x) => model.begin_at(units[0], Some(x), None, targets)?,
            }
            for &u in units {
                model.forward_unit_with(th, p, u, comm)?;
            }
            Ok(())
        })
    }

    /// Each block's routing metrics from this slot's last forward (empty: dense).
    pub(super) fn moe_stats(&self) -> Vec<model::moe::MoeStats> {
        self.model.moe_stats()
    }

    /// The loss of the last forward that reached the head.
    pub(super) fn loss(&self) -> Option<f64> {
        self.model.loss()
    }

    /// What a local chunk ending at `last` (not the head) sends on after its forward.
    pub(super) fn output(&self, last: Unit) -> Result<&[f32]> {
        Ok(self.model.unit_output(last)?)
    }

    /// Backward of a local chunk (`units`) from `dout`, the gradient received for its output
    /// (none when it ends at the head); gradients accumulate into `grads`.
    /// `ready` is told each unit once its backward is done, with the gradients.
    pub(super) fn backward(
        &mut self,
        run: &Run,
        grads: &mut [f32],
        units: &[Unit],
        dout: Option<&[f32]>,
        ready: &mut dyn FnMut(Unit, &[f32]),
    ) -> Result<()> {
        let (th, p) = (run.th, run.params);
        let last = units[units.len() - 1];
        self.with_comm(|model, comm| {
            model.begin_backward_at(last, dout)?;
            for &u in units.iter().rev() {
                model.backward_unit_with(th, p, grads, u, comm)?;
                ready(u, grads);
            }
            Ok(())
        })
    }

    /// What a local chunk sends back after its backward: the gradient of its input.
    pub(super) fn input_grad(&self) -> &[f32] {
        self.model.input_grad()
    }
}

impl PipelineStage {
    /// The tensor-parallel degree inside this stage (1 without tensor parallelism).
    pub fn tensor_parallel(&self) -> usize {
        self.tensor.as_ref().map_or(1, |t| t.group.size())
    }

    /// This rank's index in its stage's TP group (0 without tensor parallelism).
    pub fn tensor_rank(&self) -> usize {
        self.tensor.as_ref().map_or(0, |t| t.group.rank())
    }

    /// The options of the stage's summing all-reduces over the replicas: pinned to the ring
    /// ([`PINNED`]) with tensor-parallel stages, so repeated runs are bit-identical;
    /// otherwise the group's choice (two replicas' sums commute exactly whatever it picks).
    pub(super) fn sum_options(&self) -> OpOptions {
        match self.tensor {
            Some(_) => PINNED,
            None => OpOptions::default(),
        }
    }

    /// The squared global gradient norm when the stages are tensor-parallel: every element of
    /// the whole model counted once over the mesh ([`TensorPart::counted`]), summed exactly
    /// over the pipeline and then over the TP group, so every rank of the replica gets the
    /// same bits (and every replica too: their gradients are identical after the sum).
    pub(super) fn tensor_sum_sq(&self, t: &TensorPart) -> Result<f64> {
        let mine = t.counted.iter().fold(0.0, |a, r| {
            a + grad_sum_sq(&self.th, &self.grads[r.clone()])
        });
        let stages = sum_exactly(&self.group, mine)?;
        sum_exactly(&t.group, stages)
    }

    /// `src`, a buffer in the stage's flat coordinates (the parameters, or a moment laid out
    /// like them), as the whole model's values on the stage's units, zeros elsewhere (a
    /// collective over the TP group; exact): each rank writes its units into a zeroed
    /// whole-model buffer (block shards unsharded in place, replicated tensors by TP rank 0
    /// only), so every element comes from one rank, and the buffers are summed over the group.
    pub(super) fn stage_view(&self, t: &TensorPart, src: &[f32]) -> Result<Vec<f32>> {
        let mut whole = vec![0f32; self.layout.total];
        for u in self.chunks.iter().flat_map(|c| c.units.iter()) {
            let mine = unit_range(&self.layout, &t.plan, *u);
            match *u {
                Unit::Block(l) => {
                    let into = &mut whole[self.layout.blocks[l].clone()];
                    t.plan.shard.unshard(&src[mine], into)?;
                }
                _ if t.group.rank() == 0 => whole[mine.clone()].copy_from_slice(&src[mine]),
                _ => {}
            }
        }
        t.group
            .all_reduce_with(&mut whole, ReduceOp::Sum, &PINNED)?;
        Ok(whole)
    }

    /// The whole model's parameters in its [`Layout`] order, assembled from every stage and
    /// TP rank (a collective over the pipeline and the TP group; exact): the stage's
    /// [`PipelineStage::stage_view`], summed over the pipeline (each element from one stage).
    pub(super) fn gather_tensor(&self, t: &TensorPart) -> Result<Vec<f32>> {
        let mut whole = self.stage_view(t, &self.params)?;
        self.group
            .all_reduce_with(&mut whole, ReduceOp::Sum, &PINNED)?;
        Ok(whole)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_ranges_cover_each_shard_once() {
        let cfg = ModelConfig::gpt2(3, 4, 32, 8, 16);
        let layout = Layout::new(&cfg);
        for tp in [1, 2, 4] {
            let plan = TpLayout::new(&cfg, tp, tp - 1, 1, 8).unwrap();
            let all = packed(&layout, &plan, &(0..plan.total));
            let units: Vec<Range<usize>> = layout
                .units()
                .into_iter()
                .map(|u| unit_range(&layout, &plan, u))
                .collect();
            // The compact buffer maps onto exactly the units' ranges, in order.
            let len: usize = all.iter().map(|r| r.len()).sum();
            assert_eq!(len, plan.total, "tp {tp}");
            assert_eq!(all, units, "tp {tp}");
        }
    }

    /// Over both stages of a 2-stage pipeline and every TP rank, the norm counts exactly as
    /// many elements as the whole model has, and the owned ranges hold every rank's units.
    #[test]
    fn the_norm_counts_each_element_once_across_the_mesh() {
        let cfg = ModelConfig::gpt2(3, 4, 32, 8, 16);
        let layout = Layout::new(&cfg);
        let chunk = |units: Vec<Unit>| {
            let (first, last) = (units[0], units[units.len() - 1]);
            let range = layout.unit_range(first).start..layout.unit_range(last).end;
            Chunk { units, range }
        };
        let stages = [
            vec![chunk(vec![Unit::Embed, Unit::Block(0)])],
            vec![chunk(vec![Unit::Block(1), Unit::Block(2), Unit::Head])],
        ];
        for tp in [1, 2, 4] {
            let mut counted = 0;
            for rank in 0..tp {
                let plan = TpLayout::new(&cfg, tp, rank, 1, 8).unwrap();
                for chunks in &stages {
                    let owned = owned_ranges(&layout, &plan, chunks);
                    let held: usize = owned.iter().map(|r| r.len()).sum();
                    let units = chunks[0].units.iter();
                    let want: usize = units.map(|&u| unit_range(&layout, &plan, u).len()).sum();
                    assert_eq!(held, want, "tp {tp} rank {rank}");
                    let norm = packed_within(&layout, &plan, &plan.norm_ranges(), &owned);
                    counted += norm.iter().map(|r| r.len()).sum::<usize>();
                }
            }
            assert_eq!(counted, layout.total, "tp {tp}");
        }
    }
}
