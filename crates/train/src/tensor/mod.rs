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
//! - [`part`]: [`TpPart`], what tensor parallelism adds to a [`crate::Trainer`] rank: the
//!   group, the layout, the norm's counted ranges, the shards' places in the whole tensors.
//! - [`trainer`]: the [`crate::Trainer`] split over a TP group, alone or as one of several
//!   data-parallel replicas with or without ZeRO ([`crate::Trainer::tensor_parallel`],
//!   [`crate::Trainer::on_mesh`]; 000 "混合并行"); the model is the model crate's one
//!   [`::model::model::Model`], split ([`::model::model::Model::split`]).
//! - [`data_parallel`]: the agreement a DP x TP grid makes before training.
//! - [`checkpoint`]: its saves (each rank its own shards) and resumes, in the
//!   [`crate::Trainer`]'s checkpoint format, from and to any layout.
use std::time::Instant;

use comm::dtype::{Element, ReduceOp};
use comm::group::ProcessGroup;

pub mod block;
pub mod checkpoint;
pub mod data_parallel;
pub mod layout;
pub mod part;
pub mod shard;
pub mod trainer;

pub use block::TpBlock;
pub use layout::TpLayout;
pub use part::{TpPart, sum_in_rank_order};
pub use shard::{TpShard, check_tp, gather};
pub use trainer::{PINNED, TP_ALL_REDUCE};

pub use ::model::block::{Alone, BlockComm};

/// A tensor-parallel group as the blocks' [`BlockComm`]: an element-wise sum of an (N, C)
/// buffer over the group, every rank getting the result, with the algorithm pinned to
/// [`TP_ALL_REDUCE`] so that the partials are summed in an order fixed by the ranks alone
/// (repeated runs bit-identical); it also adds up the seconds its sums took.
pub struct TpGroup<'a> {
    /// The tensor-parallel group.
    pub group: &'a ProcessGroup,
    /// Seconds spent in its collectives so far.
    pub seconds: f64,
    /// Whether the residual stream is split by rows over the group (sequence parallelism).
    pub sequence: bool,
}

impl<'a> TpGroup<'a> {
    /// `group` with no time counted yet, the residual stream whole on every rank.
    pub fn new(group: &'a ProcessGroup) -> Self {
        Self {
            group,
            seconds: 0.0,
            sequence: false,
        }
    }

    /// The group of a tensor-parallel part, with its sequence parallelism.
    pub fn of(part: &'a TpPart) -> Self {
        Self {
            sequence: part.sequence,
            ..Self::new(&part.group)
        }
    }

    /// Runs `op` on the group, adding its time; a failure as the block's error.
    fn timed(
        &mut self,
        op: impl FnOnce(&ProcessGroup) -> comm::Result<()>,
    ) -> std::result::Result<(), ::model::ModelError> {
        timed_on(self.group, &mut self.seconds, op)
    }
}

/// Runs a block's collective `op` on `group`, adding its time to `seconds` and reporting a
/// failure as the model crate's communication error: the tensor-parallel and expert groups'
/// one wrapper.
pub(crate) fn timed_on(
    group: &ProcessGroup,
    seconds: &mut f64,
    op: impl FnOnce(&ProcessGroup) -> comm::Result<()>,
) -> std::result::Result<(), ::model::ModelError> {
    let t = Instant::now();
    let r = op(group);
    *seconds += t.elapsed().as_secs_f64();
    r.map_err(|e| ::model::ModelError::Comm(Box::new(e)))
}

impl<T: Element> BlockComm<T> for TpGroup<'_> {
    fn splits(&self) -> bool {
        true
    }

    fn sum(&mut self, buf: &mut [T]) -> std::result::Result<(), ::model::ModelError> {
        self.timed(|g| g.all_reduce_with(buf, ReduceOp::Sum, &PINNED))
    }

    fn sequence(&self) -> bool {
        self.sequence
    }

    fn part(&self) -> (usize, usize) {
        (self.group.rank(), self.group.size())
    }

    fn gather(
        &mut self,
        rows: &[T],
        whole: &mut [T],
    ) -> std::result::Result<(), ::model::ModelError>
    where
        T: Copy,
    {
        self.timed(|g| g.all_gather(rows, whole))
    }

    fn scatter(
        &mut self,
        whole: &mut [T],
        rows: &mut [T],
    ) -> std::result::Result<(), ::model::ModelError>
    where
        T: Copy,
    {
        self.timed(|g| g.reduce_scatter_with(whole, rows, ReduceOp::Sum, &PINNED))
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

    fn sequence(&self) -> bool {
        self.inner.sequence()
    }

    fn part(&self) -> (usize, usize) {
        self.inner.part()
    }

    fn gather(
        &mut self,
        rows: &[T],
        whole: &mut [T],
    ) -> std::result::Result<(), ::model::ModelError>
    where
        T: Copy,
    {
        self.calls += 1;
        self.bytes += std::mem::size_of_val(whole);
        self.inner.gather(rows, whole)
    }

    fn scatter(
        &mut self,
        whole: &mut [T],
        rows: &mut [T],
    ) -> std::result::Result<(), ::model::ModelError>
    where
        T: Copy,
    {
        self.calls += 1;
        self.bytes += std::mem::size_of_val(whole);
        self.inner.scatter(whole, rows)
    }
}
