//! Megatron tensor parallelism for a transformer block (000 §2.15, F46–F47).
//!
//! A `tp`-way group splits each block's linears so that every rank holds
//! whole attention heads and a slice of the feed-forward width:
//!
//! ```text
//!            f                     g                    f                    g
//! x ──norm──[id]── QKV (column) ── attention ── proj (row) ──[Σ]── +x ──norm──[id]── fc (column) ── act ── fcp (row) ──[Σ]── +res2
//! dx ←─────[Σ]──────────────────────────────────────────────────────────[Σ]──────────────────────────────────────────────
//! ```
//!
//! - `f` is the identity forward and an all-reduce of the gradient backward
//!   (the column-parallel linear's input gradient is a partial sum over the
//!   rank's output columns).
//! - `g` is an all-reduce forward (the row-parallel linear's output is a
//!   partial sum over the rank's input columns) and the identity backward.
//!
//! So a block costs exactly four all-reduces of an (N, C) activation, two
//! forward and two backward (F46–F47: M_act = B·S·C·sizeof(dtype) each).
//!
//! - [`shard`]: which rows/columns of each tensor a rank keeps, and back.
//! - [`block`]: [`TpBlock`], one block's shard with its activations, run by the model crate's
//!   one block ([`model::block::Block`]) with the group as its [`BlockComm`].
//! - [`layout`]: [`TpLayout`], where a rank keeps the whole model in its flat buffers.
//! - [`model`]: [`TpModel`], a whole decoder on one rank (embeddings and head replicated,
//!   blocks sharded).
//! - [`trainer`]: [`TpTrainer`], one rank of tensor-parallel training (clip, AdamW, schedule).
//! - [`data_parallel`]: DP x TP, data-parallel replicas of the tensor-parallel group
//!   ([`TpTrainer::with_data_parallel`], [`TpTrainer::on_mesh`]; 000 "混合并行").
//! - [`checkpoint`]: its saves and resumes, in the [`crate::Trainer`]'s checkpoint format, from
//!   and to any layout.
use std::time::Instant;

use comm::dtype::{Element, ReduceOp};
use comm::group::ProcessGroup;

pub mod block;
pub mod checkpoint;
pub mod data_parallel;
pub mod layout;
pub mod model;
pub mod shard;
pub mod trainer;

pub use block::TpBlock;
pub use layout::TpLayout;
pub use model::TpModel;
pub use shard::{TpShard, check_tp, gather};
pub use trainer::{PINNED, TP_ALL_REDUCE, TpTrainer};

pub use ::model::block::{Alone, BlockComm};

/// A tensor-parallel group as the blocks' [`BlockComm`]: an element-wise sum of an (N, C)
/// buffer over the group, every rank getting the result, with the algorithm pinned to
/// [`TP_ALL_REDUCE`] so that the partials are summed in an order fixed by the ranks alone
/// (repeated runs bit-identical); it also adds up the seconds its sums took.
pub struct TpGroup<'a> {
    /// The tensor-parallel group.
    pub group: &'a ProcessGroup,
    /// Seconds spent in its sums so far.
    pub seconds: f64,
}

impl<'a> TpGroup<'a> {
    /// `group` with no time counted yet.
    pub fn new(group: &'a ProcessGroup) -> Self {
        Self {
            group,
            seconds: 0.0,
        }
    }
}

impl<T: Element> BlockComm<T> for TpGroup<'_> {
    fn splits(&self) -> bool {
        true
    }

    fn sum(&mut self, buf: &mut [T]) -> std::result::Result<(), ::model::ModelError> {
        let t = Instant::now();
        let r = self.group.all_reduce_with(buf, ReduceOp::Sum, &PINNED);
        self.seconds += t.elapsed().as_secs_f64();
        r.map_err(|e| ::model::ModelError::Comm(Box::new(e)))
    }
}

/// A [`BlockComm`] that counts what passes through it: calls and payload
/// bytes (the buffer size, not the algorithm's wire bytes; a ring moves
/// about 2(tp−1)/tp of that per rank, F46).
#[derive(Debug)]
pub struct Counted<C> {
    /// The collective that does the work.
    pub inner: C,
    /// All-reduce calls so far.
    pub calls: usize,
    /// Payload bytes so far.
    pub bytes: usize,
}

impl<C> Counted<C> {
    /// Wraps `inner` with zero counts.
    pub fn new(inner: C) -> Self {
        Self {
            inner,
            calls: 0,
            bytes: 0,
        }
    }
}

impl<T, C: BlockComm<T>> BlockComm<T> for Counted<C> {
    fn splits(&self) -> bool {
        self.inner.splits()
    }

    fn sum(&mut self, buf: &mut [T]) -> std::result::Result<(), ::model::ModelError> {
        self.calls += 1;
        self.bytes += std::mem::size_of_val(buf);
        self.inner.sum(buf)
    }
}
