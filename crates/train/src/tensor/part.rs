//! [`TpPart`]: what tensor parallelism adds to a [`crate::Trainer`] rank (000 §2.15): its
//! tensor-parallel group, where its flat buffer sits in the whole model ([`TpLayout`]), the
//! ranges it counts in the global gradient norm, and the mapping of its shards to the whole
//! tensors a checkpoint stores.
//!
//! - Buffer. The rank's parameters, gradients and AdamW moments are the split model's flat
//!   buffer ([`model::layout::Layout::split`]); the data-parallel buckets and ZeRO's segments
//!   cut it as they cut a whole model's, every rank of a data-parallel group holding the same
//!   tensor-parallel shard.
//! - Norm. Each element of the whole model counted once over the group: rank 0 counts its
//!   whole buffer, the others only their column- and row-parallel slices
//!   ([`TpLayout::norm_ranges`]); the partial sums are added exactly, in rank order, so every
//!   rank gets the same bits.
//! - Checkpoint pieces. A shard of a split tensor is a few boxes of the whole tensor
//!   ([`TpPart::place`]): rows `r·n/t ..` of each run of a column-parallel weight (QKV's q, k
//!   and v runs, SwiGLU's gate and up halves), columns `r·c/t ..` of a row-parallel one; a
//!   replicated tensor is written by rank 0 only. So each rank writes only what it owns, and
//!   any layout reads the pieces back.
use std::ops::Range;

use ckpt::Slice;
use comm::ReduceOp;
use comm::group::ProcessGroup;
use model::Threads;
use model::config::ModelConfig;
use model::layout::{ParamEntry, Split};
use model::optim::grad_sum_sq;

use super::layout::TpLayout;
use super::shard::TpShard;
use crate::error::Result;
use crate::zero::state::flat_boxes;

/// One rank's tensor-parallel part: its group, its layout in the whole model, the ranges it
/// counts in the global norm.
pub struct TpPart {
    /// The tensor-parallel group (its size is the degree).
    pub group: ProcessGroup,
    /// Where this rank's flat buffer sits in the whole model.
    pub layout: TpLayout,
    /// The local ranges whose gradients this rank counts in the global norm.
    pub counted: Vec<Range<usize>>,
    /// Whether the residual stream is split by rows over the group too (Megatron's sequence
    /// parallelism: the norms, residuals and block outputs on `N/tp` rows per rank).
    pub sequence: bool,
}

impl TpPart {
    /// Rank `group.rank()` of a `group.size()`-way split of `cfg` at batch `b`, length `t`,
    /// with the residual stream split by rows too when `sequence`. Refuses what
    /// [`TpLayout::new`] refuses.
    pub fn new(
        cfg: &ModelConfig,
        group: ProcessGroup,
        (b, t): (usize, usize),
        sequence: bool,
    ) -> Result<Self> {
        let layout = TpLayout::new(cfg, group.size(), group.rank(), b, t)?;
        let counted = layout.norm_ranges();
        Ok(Self {
            group,
            layout,
            counted,
            sequence,
        })
    }

    /// The degree.
    pub fn tp(&self) -> usize {
        self.group.size()
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The squared norm of the whole model's gradient, from this rank's `grads` (its flat
    /// buffer): its counted ranges, summed exactly over the group. A collective.
    pub fn sum_sq(&self, th: &Threads, grads: &[f32]) -> Result<f64> {
        self.sum_sq_without(th, grads, &[])
    }

    /// [`TpPart::sum_sq`] of the counted ranges less `holes` (the experts' ranges, which the
    /// expert part sums over its own group).
    pub fn sum_sq_without(
        &self,
        th: &Threads,
        grads: &[f32],
        holes: &[Range<usize>],
    ) -> Result<f64> {
        let mine = crate::expert::cut_out(&self.counted, holes)
            .into_iter()
            .fold(0.0, |a, r| a + grad_sum_sq(th, &grads[r]));
        sum_in_rank_order(&self.group, mine)
    }

    /// `local`, a buffer in this rank's flat layout (the parameters, or a moment), assembled
    /// into the whole model's layout order with an all-gather: block shards from their ranks,
    /// replicated tensors from rank 0. A collective; exact copies.
    pub fn gather_whole(&self, cfg: &ModelConfig, local: &[f32]) -> Result<Vec<f32>> {
        let layout = &self.layout;
        let (tp, len) = (self.tp(), layout.total);
        super::shard::check_len("local state", local.len(), len)?;
        let mut all = vec![0f32; tp * len];
        self.group.all_gather(local, &mut all)?;
        let mut whole = vec![0f32; layout.whole.total];
        let s = &layout.shard;
        let d = &s.dims;
        for (r, part) in all.chunks_exact(len).enumerate() {
            let mut other = layout.clone();
            other.shard = TpShard::new(cfg, &s.whole, tp, r, d.b, d.t)?;
            other.unshard_params(part, &mut whole)?;
        }
        Ok(whole)
    }

    /// Where the elements `range` (relative to the entry) of this rank's shard of `e` (an
    /// entry of the split layout, in its local shape) lie in the whole tensor: row-major boxes
    /// of the whole shape, each with the sub-range of `range` it holds, in order. Empty for a
    /// replicated tensor on ranks other than 0 (rank 0 writes it).
    pub fn place(&self, e: &ParamEntry, range: Range<usize>) -> Vec<(Slice, Range<usize>)> {
        let (tp, rank) = (self.tp() as u64, self.rank() as u64);
        let local = flat_boxes(&e.shape, range);
        match &e.split {
            Split::Replicated if rank == 0 => local,
            Split::Replicated => Vec::new(),
            Split::Cols => local
                .into_iter()
                .map(|(mut s, r)| {
                    let cols = e.shape[1] as u64;
                    s.0[1].offset += rank * cols;
                    (s, r)
                })
                .collect(),
            Split::Rows(runs) => {
                let mut out = Vec::new();
                for (s, r) in local {
                    // Local rows [a, a + n) cut at the runs' local boundaries.
                    let (mut a, end) = (s.0[0].offset, s.0[0].offset + s.0[0].len);
                    let mut flat = r.start;
                    let (mut local_start, mut whole_start) = (0u64, 0u64);
                    for &run in runs {
                        let (run, part) = (run as u64, run as u64 / tp);
                        let local_end = local_start + part;
                        if a < local_end && a < end {
                            let b = end.min(local_end);
                            let mut piece = s.clone();
                            piece.0[0].offset = whole_start + rank * part + (a - local_start);
                            piece.0[0].len = b - a;
                            let n = piece.volume().unwrap_or(0) as usize;
                            out.push((piece, flat..flat + n));
                            flat += n;
                            a = b;
                        }
                        local_start = local_end;
                        whole_start += run;
                    }
                }
                out
            }
        }
    }
}

/// `mine`, one rank's value, summed over `group` exactly and in rank order: each rank fills
/// its slot of a zeroed vector, the all-reduce adds zeros to every other slot (exact whatever
/// the algorithm), then every rank sums the slots in the same order, so all get the same bits.
pub fn sum_in_rank_order(group: &ProcessGroup, mine: f64) -> Result<f64> {
    let mut slots = vec![0f64; group.size()];
    slots[group.rank()] = mine;
    group.all_reduce(&mut slots, ReduceOp::Sum)?;
    Ok(slots.iter().sum())
}

#[cfg(test)]
mod tests {
    use model::config::ModelConfig;

    use super::super::layout::TpLayout;

    /// The split model's local layout is the tensor-parallel layout's: one table
    /// ([`model::layout::Layout::split`]) describes the buffer both address.
    #[test]
    fn the_split_layout_is_the_shard_layout() {
        let mut llama = ModelConfig::gpt2(2, 8, 64, 16, 32);
        llama.kv_heads = 4;
        llama.activation = model::config::Activation::SwiGlu;
        llama.norm = model::config::Norm::RmsNorm;
        llama.bias = false;
        for cfg in [ModelConfig::gpt2(2, 4, 64, 16, 32), llama] {
            for tp in [1, 2, 4] {
                let m = TpLayout::new(&cfg, tp, tp - 1, 1, 8).unwrap();
                let split = model::layout::Layout::split(&cfg, tp).unwrap();
                assert_eq!(m.shard.local, split.block, "tp {tp}");
                assert_eq!(m.total, split.total, "tp {tp}");
                assert_eq!(m.blocks, split.blocks, "tp {tp}");
            }
        }
    }
}
