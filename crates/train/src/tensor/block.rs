//! [`TpBlock`]: one transformer block's forward and backward on a
//! tensor-parallel shard, equal to the model crate's
//! [`Block`](model::block::Block) up to float summation order.
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
use super::TpComm;
use super::shard::{TpShard, check_len};
use crate::error::{Result, TrainError};
use model::Real;
use model::block::{Block, BlockActs, linear_weight_grads};
use model::config::{Activation, ModelConfig};
use model::kernels::activation::{GeluKind, gelu_bwd, gelu_fwd, swiglu_bwd, swiglu_fwd};
use model::kernels::attention::{attention_bwd, attention_fwd};
use model::kernels::matmul::{matmul_bwd_input, matmul_fwd};
use model::kernels::residual::add_acc;
use model::kernels::rope::{RopeTable, rope_bwd, rope_fwd};
use model::layout::BlockLayout;
use model::threads::Threads;
use std::ops::Range;

/// One block's share on rank `shard.rank` of a `shard.tp`-way group, with
/// the activations its backward needs (sized for the shard: (N, C) for
/// the replicated norms and residuals, (N, (H+2K)D/tp), (N, HD/tp),
/// (N, Fin/tp) for the split ones).
pub struct TpBlock<T> {
    /// Which part of the block this rank holds, its layout and dimensions.
    pub shard: TpShard,
    /// The model's block over the shard's layout: its norms (replicated) are run as is.
    block: Block,
    activation: Activation,
    acts: Vec<T>,
    /// Backward scratch: dact (N, F/tp), dfch (N, Fin/tp), dln (N, C),
    /// datty (N, HD/tp), dqkv (N, (H+2K)D/tp).
    dact: Vec<T>,
    dfch: Vec<T>,
    dln: Vec<T>,
    datty: Vec<T>,
    dqkv: Vec<T>,
    forwarded: bool,
}

fn opt<'a, T>(s: &'a [T], r: &Option<Range<usize>>) -> Option<&'a [T]> {
    r.as_ref().map(|r| &s[r.clone()])
}

/// `out[i, j] += b[j]` for an (N, C) `out`: a row-parallel bias, added once
/// after the all-reduce.
fn add_bias<T: Real>(out: &mut [T], b: Option<&[T]>) {
    if let Some(b) = b {
        for row in out.chunks_exact_mut(b.len()) {
            for (o, &x) in row.iter_mut().zip(b) {
                *o += x;
            }
        }
    }
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
        let n = d.n;
        let z = |len: usize| vec![T::zero(); len];
        Ok(Self {
            block: Block::new(cfg, shard.local.clone()),
            activation: cfg.activation,
            acts: z(d.block_acts_len()),
            dact: z(n * d.f),
            dfch: z(n * d.fin),
            dln: z(n * d.c),
            datty: z(n * d.h * d.d),
            dqkv: z(n * d.qkv),
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
    pub fn forward<C: TpComm<T>>(
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
        let d = self.shard.dims.clone();
        let l = self.shard.local.clone();
        let (n, c, hd) = (d.n, d.c, d.h * d.d);
        let mut acts = std::mem::take(&mut self.acts);
        let a = BlockActs::carve(&mut acts, &d);
        self.block.norm_fwd(
            th, &d, a.ln1, a.ln1_mean, a.ln1_rstd, x, p, &l.ln1_w, &l.ln1_b,
        );
        // f: identity forward; QKV column-parallel over this rank's heads.
        matmul_fwd(
            th,
            a.qkv,
            a.ln1,
            &p[l.qkv_w.clone()],
            opt(p, &l.qkv_b),
            n,
            c,
            d.qkv,
        );
        if let Some(table) = rope {
            rope_fwd(th, a.qkv, table, d.b, d.t, d.h, d.k, d.d);
        }
        attention_fwd(th, a.atty, a.lse, a.qkv, d.b, d.t, d.h, d.k, d.d);
        // proj row-parallel: a partial sum over this rank's heads; g sums it.
        matmul_fwd(th, a.res2, a.atty, &p[l.proj_w.clone()], None, n, hd, c);
        let reduced = comm.all_reduce_sum(a.res2);
        if let Err(e) = reduced {
            self.acts = acts;
            return Err(e);
        }
        add_bias(a.res2, opt(p, &l.proj_b));
        add_acc(th, a.res2, x);
        self.block.norm_fwd(
            th, &d, a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, p, &l.ln2_w, &l.ln2_b,
        );
        // f: identity; fc column-parallel over this rank's F/tp units.
        matmul_fwd(
            th,
            a.fch,
            a.ln2,
            &p[l.fc_w.clone()],
            opt(p, &l.fc_b),
            n,
            c,
            d.fin,
        );
        match self.activation {
            Activation::Gelu => gelu_fwd(th, a.act, a.fch, GeluKind::Erf),
            Activation::GeluTanh => gelu_fwd(th, a.act, a.fch, GeluKind::Tanh),
            Activation::SwiGlu => swiglu_fwd(th, a.act, a.fch, n, d.f),
        }
        // fcp row-parallel; g sums the partials.
        matmul_fwd(th, out, a.act, &p[l.fcp_w.clone()], None, n, d.f, c);
        let reduced = comm.all_reduce_sum(out);
        if reduced.is_ok() {
            add_bias(out, opt(p, &l.fcp_b));
            add_acc(th, out, a.res2);
            self.forwarded = true;
        }
        self.acts = acts;
        reduced
    }

    /// Backward of the last [`forward`](Self::forward) (same `p`, `rope`
    /// and `x`). On entry `dx` (N, C, whole) holds the gradient of the
    /// output; on exit that of the input, whole and the same on every rank.
    /// Parameter gradients of the shard accumulate into `g` (length
    /// `shard.local.size`). Calls `comm` twice (the f operators before fc
    /// and before QKV), each on an (N, C) buffer.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<C: TpComm<T>>(
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
        let d = self.shard.dims.clone();
        let l = self.shard.local.clone();
        let (n, c, hd) = (d.n, d.c, d.h * d.d);
        let a = BlockActs::carve(&mut self.acts, &d);
        let (dact, dfch, dln) = (&mut self.dact, &mut self.dfch, &mut self.dln);
        let (datty, dqkv) = (&mut self.datty, &mut self.dqkv);
        // fcp (row-parallel): g's backward is the identity, dout is whole.
        matmul_bwd_input(th, dact, T::zero(), dx, &p[l.fcp_w.clone()], n, d.f, c);
        linear_weight_grads(th, g, &l.fcp_w, &l.fcp_b, dx, a.act, n, d.f, c);
        match self.activation {
            Activation::Gelu => gelu_bwd(th, dfch, a.fch, dact, GeluKind::Erf),
            Activation::GeluTanh => gelu_bwd(th, dfch, a.fch, dact, GeluKind::Tanh),
            Activation::SwiGlu => swiglu_bwd(th, dfch, dact, a.fch, n, d.f),
        }
        // fc (column-parallel): this rank's input gradient is a partial sum
        // over its F/tp units; f's backward sums it.
        matmul_bwd_input(th, dln, T::zero(), dfch, &p[l.fc_w.clone()], n, c, d.fin);
        comm.all_reduce_sum(dln)?;
        linear_weight_grads(th, g, &l.fc_w, &l.fc_b, dfch, a.ln2, n, c, d.fin);
        self.block.norm_grads(
            th, &d, g, &l.ln2_w, &l.ln2_b, dx, dln, a.res2, p, a.ln2_mean, a.ln2_rstd,
        );
        // dx holds d res2. proj (row-parallel).
        matmul_bwd_input(th, datty, T::zero(), dx, &p[l.proj_w.clone()], n, hd, c);
        linear_weight_grads(th, g, &l.proj_w, &l.proj_b, dx, a.atty, n, hd, c);
        attention_bwd(
            th, dqkv, datty, a.qkv, a.atty, a.lse, d.b, d.t, d.h, d.k, d.d,
        );
        if let Some(table) = rope {
            rope_bwd(th, dqkv, table, d.b, d.t, d.h, d.k, d.d);
        }
        // QKV (column-parallel): partial over this rank's heads; f sums it.
        matmul_bwd_input(th, dln, T::zero(), dqkv, &p[l.qkv_w.clone()], n, c, d.qkv);
        comm.all_reduce_sum(dln)?;
        linear_weight_grads(th, g, &l.qkv_w, &l.qkv_b, dqkv, a.ln1, n, c, d.qkv);
        self.block.norm_grads(
            th, &d, g, &l.ln1_w, &l.ln1_b, dx, dln, x, p, a.ln1_mean, a.ln1_rstd,
        );
        Ok(())
    }
}
