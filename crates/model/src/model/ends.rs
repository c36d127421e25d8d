//! The model's two ends: the embeddings (forward and backward) and the head (final norm, LM
//! head; the loss is [`Model`]'s). Under sequence parallelism each rank embeds all rows and
//! keeps its own, and the head gathers every rank's rows of the final norm.
use std::ops::Range;

use super::Model;
use crate::block::{BlockComm, BlockScratch, Carve, Dims};
use crate::error::Result;
use crate::kernels::embedding::{embed_bwd, embed_fwd};
use crate::kernels::loss::cross_entropy_bwd;
use crate::kernels::matmul::{matmul_bwd_input, matmul_bwd_weight, matmul_fwd};
use crate::profile::timed;
use crate::real::Real;
use crate::threads::Threads;

/// The elements of this rank's rows of an (N, C) buffer: all of them, or under sequence
/// parallelism the `rows` rows of its index in the group.
fn own_rows<T>(d: &Dims, comm: &dyn BlockComm<T>) -> Range<usize> {
    let (rank, _) = comm.part();
    let len = d.rows * d.c;
    match d.sequence_split() {
        true => rank * len..(rank + 1) * len,
        false => 0..len,
    }
}

impl<T: Real> Model<T> {
    pub(super) fn embed_backward(
        &mut self,
        th: &Threads,
        grads: &mut [T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        let d = &self.dims;
        let (wte, wpe) = match &self.layout.wpe {
            Some(wpe) => {
                let [a, b] = grads
                    .get_disjoint_mut([self.layout.wte.clone(), wpe.clone()])
                    .expect("disjoint");
                (a, Some(b))
            }
            None => (&mut grads[self.layout.wte.clone()], None),
        };
        // Under sequence parallelism every rank's rows of the residual's gradient, gathered.
        let s = BlockScratch::carve(&mut self.scratch, d);
        let dresid: &[T] = if d.sequence_split() {
            comm.gather(&self.dresid, s.wide)?;
            s.wide
        } else {
            &self.dresid
        };
        timed!(
            "embedding.bwd",
            embed_bwd(th, wte, wpe, dresid, &self.tokens, d.n, d.t, d.c)
        );
        Ok(())
    }

    pub(super) fn embed_forward(
        &mut self,
        th: &Threads,
        params: &[T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        let d = &self.dims;
        let wpe = self.layout.wpe.as_ref().map(|r| &params[r.clone()]);
        let wte = &params[self.layout.wte.clone()];
        let emb = &mut self.arena[self.acts.emb.clone()];
        if !d.sequence_split() {
            timed!(
                "embedding.fwd",
                embed_fwd(th, emb, &self.tokens, wte, wpe, d.n, d.t, d.c)
            );
            return Ok(());
        }
        // Every rank embeds all N rows (the embeddings are replicated) and keeps its own.
        let s = BlockScratch::carve(&mut self.scratch, d);
        timed!(
            "embedding.fwd",
            embed_fwd(th, s.wide, &self.tokens, wte, wpe, d.n, d.t, d.c)
        );
        let rows = own_rows(d, comm);
        emb.copy_from_slice(&s.wide[rows]);
        Ok(())
    }

    fn head_weight(&self) -> Range<usize> {
        self.layout
            .lm_head
            .clone()
            .unwrap_or(self.layout.wte.clone())
    }

    pub(super) fn head_forward(
        &mut self,
        th: &Threads,
        params: &[T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        let d = &self.dims;
        let hw = self.head_weight();
        let last = self.acts.outs[self.cfg.layers - 1].clone();
        let [x, lnf, wide, logits] = self
            .arena
            .get_disjoint_mut([
                last,
                self.acts.lnf.clone(),
                self.acts.lnf_wide.clone(),
                self.acts.logits.clone(),
            ])
            .expect("disjoint");
        let mut k = Carve::new(lnf);
        let (out, mean, rstd) = (k.take(d.rows * d.c), k.take(d.rows), k.take(d.rows));
        timed!(
            "norm.fwd",
            self.block.norm_fwd(
                th,
                d,
                out,
                mean,
                rstd,
                x,
                params,
                &self.layout.lnf_w,
                &self.layout.lnf_b
            )
        );
        // Under sequence parallelism the head reads every rank's rows of the norm.
        let input: &[T] = if d.sequence_split() {
            comm.gather(out, wide)?;
            wide
        } else {
            out
        };
        timed!(
            "lm_head.fwd",
            matmul_fwd(th, logits, input, &params[hw], None, d.n, d.c, d.v)
        );
        Ok(())
    }

    pub(super) fn head_backward(
        &mut self,
        th: &Threads,
        params: &[T],
        grads: &mut [T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        let d = self.dims.clone();
        let hw = self.head_weight();
        let last = self.acts.outs[self.cfg.layers - 1].clone();
        let [x, lnf, wide, logits, losses] = self
            .arena
            .get_disjoint_mut([
                last,
                self.acts.lnf.clone(),
                self.acts.lnf_wide.clone(),
                self.acts.logits.clone(),
                self.acts.losses.clone(),
            ])
            .expect("disjoint");
        let lse = &losses[d.n..];
        // Mean over the N rows.
        timed!(
            "cross_entropy.bwd",
            cross_entropy_bwd(
                th,
                logits,
                lse,
                &self.targets,
                d.n,
                d.v,
                T::of(1.0 / d.n as f64)
            )
        );
        let mut k = Carve::new(lnf);
        let (out, mean, rstd) = (k.take(d.rows * d.c), k.take(d.rows), k.take(d.rows));
        let input: &[T] = if d.sequence_split() { wide } else { out };
        // d lnf (N, C) lands in the block scratch's first N*C elements; the norm's partial
        // gradients (sequence parallelism) in its last 2C.
        let (dlnf, rest) = self.scratch.split_at_mut(d.n * d.c);
        let tmp_at = rest.len() - if d.sequence_split() { 2 * d.c } else { 0 };
        let tmp = &mut rest[tmp_at..];
        timed!(
            "lm_head.bwd_input",
            matmul_bwd_input(
                th,
                dlnf,
                T::zero(),
                logits,
                &params[hw.clone()],
                d.n,
                d.c,
                d.v
            )
        );
        timed!(
            "lm_head.bwd_weight",
            matmul_bwd_weight(th, &mut grads[hw], None, logits, input, d.n, d.c, d.v)
        );
        self.dresid.fill(T::zero());
        // Every rank holds the whole d lnf (the head is replicated): its own rows feed the norm.
        let dnorm = &dlnf[own_rows(&d, comm)];
        let lnf_w = (&self.layout.lnf_w, &self.layout.lnf_b);
        timed!(
            "norm.bwd",
            self.block.rows_norm_grads(
                th,
                &d,
                grads,
                lnf_w,
                &mut self.dresid,
                dnorm,
                x,
                params,
                (mean, rstd),
                tmp,
                comm,
            )
        )
    }
}
