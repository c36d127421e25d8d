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
//! - [`block`]: [`TpBlock`], one block's forward and backward on a shard.
//! - [`layout`]: [`TpLayout`], where a rank keeps the whole model in its flat buffers.
//! - [`model`]: [`TpModel`], a whole decoder on one rank (embeddings and head replicated,
//!   blocks sharded).
//! - [`trainer`]: [`TpTrainer`], one rank of tensor-parallel training (clip, AdamW, schedule).
//! - [`data_parallel`]: DP x TP, data-parallel replicas of the tensor-parallel group
//!   ([`TpTrainer::with_data_parallel`], [`TpTrainer::on_mesh`]; 000 "混合并行").
//! - [`checkpoint`]: its saves and resumes, in the [`crate::Trainer`]'s checkpoint format, from
//!   and to any layout.
use crate::error::Result;
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
pub use trainer::{TP_ALL_REDUCE, TpTrainer};

/// The one collective tensor parallelism needs: an element-wise sum of a
/// buffer over the tensor-parallel group, every rank getting the result.
pub trait TpComm<T> {
    /// Sums `buf` over the group in place.
    fn all_reduce_sum(&mut self, buf: &mut [T]) -> Result<()>;
}

impl<T: Element> TpComm<T> for &ProcessGroup {
    fn all_reduce_sum(&mut self, buf: &mut [T]) -> Result<()> {
        Ok(self.all_reduce(buf, ReduceOp::Sum)?)
    }
}

/// A [`TpComm`] that counts what passes through it: calls and payload
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

impl<T, C: TpComm<T>> TpComm<T> for Counted<C> {
    fn all_reduce_sum(&mut self, buf: &mut [T]) -> Result<()> {
        self.calls += 1;
        self.bytes += std::mem::size_of_val(buf);
        self.inner.all_reduce_sum(buf)
    }
}

/// The group of one: `tp = 1` runs with no communication.
#[derive(Clone, Copy, Debug, Default)]
pub struct Solo;

impl<T> TpComm<T> for Solo {
    fn all_reduce_sum(&mut self, _buf: &mut [T]) -> Result<()> {
        Ok(())
    }
}
