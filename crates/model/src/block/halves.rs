//! The block's two halves: attention (`res2 = x + proj(attention(qkv(ln1(x))))`) and the
//! feed-forward MLP (`out = res2 + fcp(act(fc(ln2(res2))))`), each with its backward. The
//! whole block ([`Block::forward`], [`Block::backward`]) runs both; a decoder with another
//! feed-forward (mixture of experts) runs the attention half and its own.
use super::{Block, BlockActs, BlockComm, BlockScratch, Dims, linear_weight_grads};
use crate::config::Activation;
use crate::error::Result;
use crate::kernels::activation::{GeluKind, gelu_bwd, gelu_fwd, swiglu_bwd, swiglu_fwd};
use crate::kernels::attention::{attention_bwd, attention_fwd};
use crate::kernels::matmul::matmul_bwd_input;
use crate::kernels::residual::add_acc;
use crate::kernels::rope::{RopeTable, rope_bwd, rope_fwd};
use crate::profile::{scope, timed};
use crate::real::Real;
use crate::threads::Threads;

impl Block {
    /// The attention half: `a.res2 = x + proj(attention(qkv(ln1(x))))` (N, C), saving its
    /// activations in `a`. A decoder whose feed-forward is not this block's MLP (mixture of
    /// experts) runs this half, then its own feed-forward on `norm(a.res2)`.
    ///
    /// # Errors
    /// What `comm` returns.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_forward<T: Real>(
        &self,
        th: &Threads,
        d: &Dims,
        p: &[T],
        rope: Option<&RopeTable<T>>,
        a: &mut BlockActs<'_, T>,
        x: &[T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        let l = &self.layout;
        let (n, c) = (d.n, d.c);
        let hd = d.h * d.d;
        timed!(
            "norm.fwd",
            self.norm_fwd(
                th, d, a.ln1, a.ln1_mean, a.ln1_rstd, x, p, &l.ln1_w, &l.ln1_b
            )
        );
        // f: identity; QKV column-parallel over this block's heads.
        timed!(
            "matmul.fwd",
            self.linear(th, p, &l.qkv_w, &l.qkv_b, a.qkv, a.ln1, n, c, d.qkv)
        );
        if let Some(table) = rope {
            timed!(
                "rope.fwd",
                rope_fwd(th, a.qkv, table, d.b, d.t, d.h, d.k, d.d)
            );
        }
        timed!(
            "attention.fwd",
            attention_fwd(th, a.atty, a.lse, a.qkv, d.b, d.t, d.h, d.k, d.d)
        );
        // res2 = x + atty · Wprojᵀ: the projection (row-parallel, g) lands in res2, then x is
        // added.
        self.row_linear(th, p, &l.proj_w, &l.proj_b, a.res2, a.atty, n, hd, c, comm)?;
        timed!("residual", add_acc(th, a.res2, x));
        Ok(())
    }

    /// The feed-forward half: `out = a.res2 + fcp(act(fc(ln2(a.res2))))` (N, C), saving its
    /// activations in `a`.
    ///
    /// # Errors
    /// What `comm` returns.
    pub fn mlp_forward<T: Real>(
        &self,
        th: &Threads,
        d: &Dims,
        p: &[T],
        a: &mut BlockActs<'_, T>,
        out: &mut [T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        let l = &self.layout;
        let n = d.n;
        let c = d.c;
        timed!(
            "norm.fwd",
            self.norm_fwd(
                th, d, a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, p, &l.ln2_w, &l.ln2_b
            )
        );
        // f: identity; fc column-parallel over this block's F units.
        timed!(
            "matmul.fwd",
            self.linear(th, p, &l.fc_w, &l.fc_b, a.fch, a.ln2, n, c, d.fin)
        );
        let _p = scope("activation.fwd");
        match self.activation {
            Activation::Gelu => gelu_fwd(th, a.act, a.fch, GeluKind::Erf),
            Activation::GeluTanh => gelu_fwd(th, a.act, a.fch, GeluKind::Tanh),
            Activation::SwiGlu => swiglu_fwd(th, a.act, a.fch, n, d.f),
        }
        drop(_p);
        self.row_linear(th, p, &l.fcp_w, &l.fcp_b, out, a.act, n, d.f, c, comm)?;
        let _p = scope("residual");
        add_acc(th, out, a.res2);
        Ok(())
    }

    /// Backward of [`Block::mlp_forward`]: on entry `dx` holds the gradient of the block's
    /// output, on exit that of `a.res2`.
    ///
    /// # Errors
    /// What `comm` returns.
    #[allow(clippy::too_many_arguments)]
    pub fn mlp_backward<T: Real>(
        &self,
        th: &Threads,
        d: &Dims,
        p: &[T],
        g: &mut [T],
        a: &BlockActs<'_, T>,
        s: &mut BlockScratch<'_, T>,
        dx: &mut [T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        let l = &self.layout;
        let (n, c) = (d.n, d.c);
        // MLP output projection.
        timed!(
            "matmul.bwd_input",
            matmul_bwd_input(th, s.dact, T::zero(), dx, &p[l.fcp_w.clone()], n, d.f, c)
        );
        timed!(
            "matmul.bwd_weight",
            linear_weight_grads(th, g, &l.fcp_w, &l.fcp_b, dx, a.act, n, d.f, c)
        );
        let _p = scope("activation.bwd");
        match self.activation {
            Activation::Gelu => gelu_bwd(th, s.dfch, a.fch, s.dact, GeluKind::Erf),
            Activation::GeluTanh => gelu_bwd(th, s.dfch, a.fch, s.dact, GeluKind::Tanh),
            Activation::SwiGlu => swiglu_bwd(th, s.dfch, s.dact, a.fch, n, d.f),
        }
        drop(_p);
        timed!(
            "matmul.bwd_input",
            matmul_bwd_input(
                th,
                s.dln,
                T::zero(),
                s.dfch,
                &p[l.fc_w.clone()],
                n,
                c,
                d.fin
            )
        );
        // f's backward: the input gradient is a partial sum over this block's F units.
        if comm.splits() {
            comm.sum(s.dln)?;
        }
        timed!(
            "matmul.bwd_weight",
            linear_weight_grads(th, g, &l.fc_w, &l.fc_b, s.dfch, a.ln2, n, c, d.fin)
        );
        timed!(
            "norm.bwd",
            self.norm_grads(
                th, d, g, &l.ln2_w, &l.ln2_b, dx, s.dln, a.res2, p, a.ln2_mean, a.ln2_rstd
            )
        );
        Ok(())
    }

    /// Backward of [`Block::attention_forward`] (same `x`): on entry `dx` holds the gradient
    /// of `a.res2`, on exit that of `x`.
    ///
    /// # Errors
    /// What `comm` returns.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward<T: Real>(
        &self,
        th: &Threads,
        d: &Dims,
        p: &[T],
        g: &mut [T],
        rope: Option<&RopeTable<T>>,
        a: &BlockActs<'_, T>,
        s: &mut BlockScratch<'_, T>,
        x: &[T],
        dx: &mut [T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        let l = &self.layout;
        let (n, c) = (d.n, d.c);
        let hd = d.h * d.d;
        // dx now holds d res2. Attention output projection.
        timed!(
            "matmul.bwd_input",
            matmul_bwd_input(th, s.datty, T::zero(), dx, &p[l.proj_w.clone()], n, hd, c)
        );
        timed!(
            "matmul.bwd_weight",
            linear_weight_grads(th, g, &l.proj_w, &l.proj_b, dx, a.atty, n, hd, c)
        );
        timed!(
            "attention.bwd",
            attention_bwd(
                th, s.dqkv, s.datty, a.qkv, a.atty, a.lse, d.b, d.t, d.h, d.k, d.d
            )
        );
        if let Some(table) = rope {
            timed!(
                "rope.bwd",
                rope_bwd(th, s.dqkv, table, d.b, d.t, d.h, d.k, d.d)
            );
        }
        timed!(
            "matmul.bwd_input",
            matmul_bwd_input(
                th,
                s.dln,
                T::zero(),
                s.dqkv,
                &p[l.qkv_w.clone()],
                n,
                c,
                d.qkv
            )
        );
        // f's backward: a partial sum over this block's heads.
        if comm.splits() {
            comm.sum(s.dln)?;
        }
        timed!(
            "matmul.bwd_weight",
            linear_weight_grads(th, g, &l.qkv_w, &l.qkv_b, s.dqkv, a.ln1, n, c, d.qkv)
        );
        timed!(
            "norm.bwd",
            self.norm_grads(
                th, d, g, &l.ln1_w, &l.ln1_b, dx, s.dln, x, p, a.ln1_mean, a.ln1_rstd
            )
        );
        Ok(())
    }
}
