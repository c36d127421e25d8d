//! The block's two halves: attention (`res2 = x + proj(attention(qkv(ln1(x))))`) and the
//! feed-forward MLP (`out = res2 + fcp(act(fc(ln2(res2))))`), each with its backward. The
//! whole block ([`Block::forward`], [`Block::backward`]) runs both; a decoder with another
//! feed-forward (mixture of experts) runs the attention half and its own.
//!
//! The communication points are [`BlockComm`]'s: `f` before each column-parallel linear
//! ([`enter`]: identity, or under sequence parallelism the all-gather of the norm's rows;
//! backward [`enter_bwd`]: the sum, or the reduce-scatter, of the input gradient) and `g`
//! after each row-parallel one (`Block::row_linear`: the sum, or the reduce-scatter; backward
//! [`enter`] again: identity, or the all-gather of the output gradient's rows).
use super::{Block, BlockActs, BlockComm, BlockScratch, Dims, linear_weight_grads};
use crate::error::Result;
use crate::kernels::activation::{ffn_act_bwd, ffn_act_fwd};
use crate::kernels::attention::{attention_bwd, attention_fwd};
use crate::kernels::matmul::matmul_bwd_input;
use crate::kernels::residual::add_acc;
use crate::kernels::rope::{RopeTable, rope_bwd, rope_fwd};
use crate::profile::{scope, timed};
use crate::real::Real;
use crate::threads::Threads;

/// `f`'s forward (and `g`'s backward): the (N, C) input of a column-parallel linear from
/// `rows`, this rank's rows of it: `rows` itself, or under sequence parallelism every rank's
/// rows all-gathered into `wide`.
fn enter<'w, T: Real>(
    rows: &'w [T],
    wide: &'w mut [T],
    comm: &mut dyn BlockComm<T>,
) -> Result<&'w [T]> {
    if comm.sequence() {
        comm.gather(rows, wide)?;
        Ok(wide)
    } else {
        Ok(rows)
    }
}

/// `f`'s backward: this rank's rows of the sum over the group of `dln` (N, C), the partial
/// input gradient of a column-parallel linear: `dln` summed in place, or under sequence
/// parallelism reduce-scattered into `part`; a whole block's `dln` as it is.
fn enter_bwd<'w, T: Real>(
    dln: &'w mut [T],
    part: &'w mut [T],
    comm: &mut dyn BlockComm<T>,
) -> Result<&'w [T]> {
    if comm.sequence() {
        comm.scatter(dln, part)?;
        Ok(part)
    } else {
        if comm.splits() {
            comm.sum(dln)?;
        }
        Ok(dln)
    }
}

impl Block {
    /// The attention half: `a.res2 = x + proj(attention(qkv(ln1(x))))` (this rank's rows of
    /// the residual stream, `d.rows`), saving its activations in `a`; `s` lends its
    /// gather buffer. A decoder whose feed-forward is not this block's MLP (mixture of
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
        s: &mut BlockScratch<'_, T>,
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
        // f; QKV column-parallel over this block's heads.
        let ln1 = enter(a.ln1, s.wide, comm)?;
        timed!(
            "matmul.fwd",
            self.linear(th, p, &l.qkv_w, &l.qkv_b, a.qkv, ln1, n, c, d.qkv)
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
        self.row_linear(
            th,
            p,
            &l.proj_w,
            &l.proj_b,
            a.res2,
            a.atty,
            (n, hd, c),
            s.wide,
            comm,
        )?;
        timed!("residual", add_acc(th, a.res2, x));
        Ok(())
    }

    /// The feed-forward half's norm, `a.ln2 = norm(a.res2)` (this rank's rows), whichever the
    /// feed-forward (the MLP or the experts).
    pub(super) fn ln2_forward<T: Real>(
        &self,
        th: &Threads,
        d: &Dims,
        p: &[T],
        a: &mut BlockActs<'_, T>,
    ) {
        let l = &self.layout;
        timed!(
            "norm.fwd",
            self.norm_fwd(
                th, d, a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, p, &l.ln2_w, &l.ln2_b
            )
        );
    }

    /// The feed-forward half: `out = a.res2 + fcp(act(fc(ln2(a.res2))))` (this rank's rows),
    /// saving its activations in `a`; `s` lends its gather buffer.
    ///
    /// # Errors
    /// What `comm` returns.
    #[allow(clippy::too_many_arguments)]
    pub fn mlp_forward<T: Real>(
        &self,
        th: &Threads,
        d: &Dims,
        p: &[T],
        a: &mut BlockActs<'_, T>,
        s: &mut BlockScratch<'_, T>,
        out: &mut [T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        let l = &self.layout;
        let (n, c) = (d.n, d.c);
        self.ln2_forward(th, d, p, a);
        // f; fc column-parallel over this block's F units.
        let ln2 = enter(a.ln2, s.wide, comm)?;
        timed!(
            "matmul.fwd",
            self.linear(th, p, &l.fc_w, &l.fc_b, a.fch, ln2, n, c, d.fin)
        );
        timed!(
            "activation.fwd",
            ffn_act_fwd(th, a.act, a.fch, self.activation, n, d.f)
        );
        self.row_linear(
            th,
            p,
            &l.fcp_w,
            &l.fcp_b,
            out,
            a.act,
            (n, d.f, c),
            s.wide,
            comm,
        )?;
        let _p = scope("residual");
        add_acc(th, out, a.res2);
        Ok(())
    }

    /// Backward of [`Block::mlp_forward`]: on entry `dx` holds the gradient of the block's
    /// output (this rank's rows), on exit that of `a.res2`.
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
        // g's backward; the MLP output projection.
        let dout = enter(dx, s.wide, comm)?;
        timed!(
            "matmul.bwd_input",
            matmul_bwd_input(th, s.dact, T::zero(), dout, &p[l.fcp_w.clone()], n, d.f, c)
        );
        timed!(
            "matmul.bwd_weight",
            linear_weight_grads(th, g, &l.fcp_w, &l.fcp_b, dout, a.act, n, d.f, c)
        );
        timed!(
            "activation.bwd",
            ffn_act_bwd(th, s.dfch, s.dact, a.fch, self.activation, n, d.f)
        );
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
        let dln = enter_bwd(s.dln, s.part, comm)?;
        let ln2 = enter(a.ln2, s.wide, comm)?;
        timed!(
            "matmul.bwd_weight",
            linear_weight_grads(th, g, &l.fc_w, &l.fc_b, s.dfch, ln2, n, c, d.fin)
        );
        timed!(
            "norm.bwd",
            self.rows_norm_grads(
                th,
                d,
                g,
                (&l.ln2_w, &l.ln2_b),
                dx,
                dln,
                a.res2,
                p,
                (a.ln2_mean, a.ln2_rstd),
                s.norm,
                comm
            )
        )?;
        Ok(())
    }

    /// Backward of [`Block::attention_forward`] (same `x`): on entry `dx` holds the gradient
    /// of `a.res2` (this rank's rows), on exit that of `x`.
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
        // dx now holds d res2: g's backward; the attention output projection.
        let dres = enter(dx, s.wide, comm)?;
        timed!(
            "matmul.bwd_input",
            matmul_bwd_input(th, s.datty, T::zero(), dres, &p[l.proj_w.clone()], n, hd, c)
        );
        timed!(
            "matmul.bwd_weight",
            linear_weight_grads(th, g, &l.proj_w, &l.proj_b, dres, a.atty, n, hd, c)
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
        let dln = enter_bwd(s.dln, s.part, comm)?;
        let ln1 = enter(a.ln1, s.wide, comm)?;
        timed!(
            "matmul.bwd_weight",
            linear_weight_grads(th, g, &l.qkv_w, &l.qkv_b, s.dqkv, ln1, n, c, d.qkv)
        );
        timed!(
            "norm.bwd",
            self.rows_norm_grads(
                th,
                d,
                g,
                (&l.ln1_w, &l.ln1_b),
                dx,
                dln,
                x,
                p,
                (a.ln1_mean, a.ln1_rstd),
                s.norm,
                comm
            )
        )?;
        Ok(())
    }
}
