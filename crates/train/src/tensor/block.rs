//! [`TpBlock`]: one transformer block's shard on a tensor-parallel rank with its activations,
//! run by the model crate's one block ([`model::block::Block`]) with the group as its
//! [`BlockComm`]: equal to the whole block up to float summation order.
//!
//! ```text
//! forward (rank r, shard of tp):              backward (reversed):
//!   ln1  = norm(x)               replicated     dact_r = dout · Wfcp_r ; dWfcp_r += doutᵀ·act_r, dbfcp += Σ dout
//!   qkv_r = ln1 · Wqkv_rᵀ (+b_r)  f: identity   dfch_r = act'(fch_r) ⊙ dact_r
//!   atty_r = attention(qkv_r)    H/tp heads     dln2   = Σ_ranks dfch_r · Wfc_r        f: all-reduce #3
//!   res2 = Σ_ranks atty_r·Wproj_rᵀ g: all-reduce #1, then + bproj + x
//!   ln2  = norm(res2)            replicated     dres2  = dout + norm'(dln2)
//!   fch_r = ln2 · Wfc_rᵀ (+b_r)   f: identity   datty_r = dres2 · Wproj_r ; dWproj_r, dbproj += Σ dres2
//!   act_r = act(fch_r)                          dqkv_r = attention'(datty_r); rope'
//!   out  = Σ_ranks act_r·Wfcp_rᵀ  g: all-reduce #2, then + bfcp + res2
//!                                               dln1   = Σ_ranks dqkv_r · Wqkv_r       f: all-reduce #4
//!                                               dx     = dres2 + norm'(dln1)
//! ```
//!
//! Replicated parameters. The norms and the row-parallel biases (`proj_b`,
//! `fcp_b`) are whole on every rank. Their gradients are computed by every
//! rank from the same whole tensors (x, res2, dout, dres2 and the
//! all-reduced dln are identical on all ranks), so every rank holds the
//! same, complete gradient and no extra communication is needed; an
//! optimizer applied on each rank keeps the copies identical. The biases
//! are added once, after the all-reduce, not once per rank.
use super::shard::{TpShard, check_len};
use crate::error::{Result, TrainError};
use model::Real;
use model::block::{Block, BlockActs, BlockComm, BlockScratch};
use model::config::ModelConfig;
use model::kernels::rope::RopeTable;
use model::layout::BlockLayout;
use model::threads::Threads;

/// One block's share on rank `shard.rank` of a `shard.tp`-way group, with
/// the activations its backward needs (sized for the shard: (N, C) for
/// the replicated norms and residuals, (N, (H+2K)D/tp), (N, HD/tp),
/// (N, Fin/tp) for the split ones).
pub struct TpBlock<T> {
    /// Which part of the block this rank holds, its layout and dimensions.
    pub shard: TpShard,
    /// The model's block over the shard's layout.
    block: Block,
    acts: Vec<T>,
    /// Backward scratch ([`BlockScratch`] of the shard's dimensions).
    scratch: Vec<T>,
    forwarded: bool,
}

impl<T: Real> TpBlock<T> {
    /// Rank `rank`'s block of a `tp`-way group for `cfg` (whose whole block
    /// layout is `whole`) at batch `b`, length `t`. Refuses what
    /// [`TpShard::new`] refuses.
    pub fn new(
        cfg: &ModelConfig,
        whole: &BlockLayout,
        tp: usize,
        rank: usize,
        b: usize,
        t: usize,
    ) -> Result<Self> {
        let shard = TpShard::new(cfg, whole, tp, rank, b, t)?;
        let d = &shard.dims;
        Ok(Self {
            block: Block::new(cfg, shard.local.clone()),
            acts: vec![T::zero(); d.block_acts_len()],
            scratch: vec![T::zero(); d.block_scratch_len()],
            forwarded: false,
            shard,
        })
    }

    fn check_inputs(&self, p: &[T], x: &[T], y: &[T], rope: Option<&RopeTable<T>>) -> Result<()> {
        let d = &self.shard.dims;
        check_len("tp block params", p.len(), self.shard.local.size)?;
        check_len("tp block input (N, C)", x.len(), d.n * d.c)?;
        check_len("tp block output (N, C)", y.len(), d.n * d.c)?;
        if let Some(r) = rope {
            check_len("rope table head dim", r.head_dim(), d.d)?;
            if r.max_t() < d.t {
                return Err(TrainError::Model(model::ModelError::Shape {
                    what: "rope table positions",
                    expected: d.t,
                    got: r.max_t(),
                }));
            }
        }
        Ok(())
    }

    /// Forward: `out` (N, C, whole) from `x` (N, C, whole, the same on every
    /// rank), with this rank's shard `p` (length `shard.local.size`).
    /// Calls `comm` twice (the g operators after proj and after fcp), each
    /// on an (N, C) buffer. Saves activations for [`backward`](Self::backward).
    pub fn forward<C: BlockComm<T>>(
        &mut self,
        th: &Threads,
        p: &[T],
        rope: Option<&RopeTable<T>>,
        x: &[T],
        out: &mut [T],
        comm: &mut C,
    ) -> Result<()> {
        self.check_inputs(p, x, out, rope)?;
        self.forwarded = false;
        let d = &self.shard.dims;
        let mut a = BlockActs::carve(&mut self.acts, d);
        let mut s = BlockScratch::carve(&mut self.scratch, d);
        self.block
            .forward(th, d, p, rope, &mut a, &mut s, x, out, comm)?;
        self.forwarded = true;
        Ok(())
    }

    /// Backward of the last [`forward`](Self::forward) (same `p`, `rope`
    /// and `x`). On entry `dx` (N, C, whole) holds the gradient of the
    /// output; on exit that of the input, whole and the same on every rank.
    /// Parameter gradients of the shard accumulate into `g` (length
    /// `shard.local.size`). Calls `comm` twice (the f operators before fc
    /// and before QKV), each on an (N, C) buffer.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<C: BlockComm<T>>(
        &mut self,
        th: &Threads,
        p: &[T],
        g: &mut [T],
        rope: Option<&RopeTable<T>>,
        x: &[T],
        dx: &mut [T],
        comm: &mut C,
    ) -> Result<()> {
        self.check_inputs(p, x, dx, rope)?;
        check_len("tp block grads", g.len(), self.shard.local.size)?;
        if !self.forwarded {
            return Err(TrainError::Config {
                field: "tp block",
                value: "backward".into(),
                reason: "backward needs a completed forward first".into(),
            });
        }
        let d = &self.shard.dims;
        let a = BlockActs::carve(&mut self.acts, d);
        let mut s = BlockScratch::carve(&mut self.scratch, d);
        self.block
            .backward(th, d, p, g, rope, &a, &mut s, x, dx, comm)?;
        Ok(())
    }
}
