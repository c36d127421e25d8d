//! The block's feed-forward half when it is a mixture of experts (Megatron's layer spec with
//! an MoE MLP): `out = res2 + experts(ln2(res2))`, the experts exchanging rows over the
//! block's expert group ([`BlockComm::experts`]: the dispatch and combine all-to-alls). The
//! experts are whole on every tensor-parallel rank (each runs them on the same (N, C) rows, so
//! their output needs no sum); under sequence parallelism they are not built
//! ([`crate::model::Model`] refuses it).
use super::{Block, BlockActs, BlockComm, Dims};
use crate::error::{ModelError, Result};
use crate::kernels::residual::add_acc;
use crate::moe::{Experts, Local};
use crate::profile::timed;
use crate::real::Real;
use crate::threads::Threads;

fn no_experts() -> ModelError {
    ModelError::Config {
        field: "experts",
        value: "none".into(),
        reason: "a block with a mixture-of-experts feed-forward needs its experts in its \
                 activations (BlockActs::experts)"
            .into(),
    }
}

impl Block {
    /// The experts' half: `out = a.res2 + experts(ln2(a.res2))`, the experts keeping their
    /// own activations.
    ///
    /// # Errors
    /// What the experts and `comm` return.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_forward<T: Real>(
        &self,
        th: &Threads,
        d: &Dims,
        p: &[T],
        a: &mut BlockActs<'_, T>,
        out: &mut [T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        let l = &self.layout;
        let range = l.moe.clone().ok_or_else(no_experts)?;
        self.ln2_forward(th, d, p, a);
        let experts: &mut Experts<T> = a.experts.as_deref_mut().ok_or_else(no_experts)?;
        let (y, _) = timed!(
            "experts.fwd",
            match comm.experts() {
                Some(group) => experts.forward(group, th, &p[range], a.ln2),
                None => experts.forward(&mut Local, th, &p[range], a.ln2),
            }
        )?;
        out.copy_from_slice(&y);
        timed!("residual", add_acc(th, out, a.res2));
        Ok(())
    }

    /// Backward of [`Block::moe_forward`]: on entry `dx` holds the gradient of the block's
    /// output, on exit that of `a.res2`.
    ///
    /// # Errors
    /// What the experts and `comm` return.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_backward<T: Real>(
        &self,
        th: &Threads,
        d: &Dims,
        p: &[T],
        g: &mut [T],
        a: &BlockActs<'_, T>,
        dx: &mut [T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        let l = &self.layout;
        let range = l.moe.clone().ok_or_else(no_experts)?;
        let experts: &Experts<T> = a.experts.as_deref().ok_or_else(no_experts)?;
        let (pm, gm) = (&p[range.clone()], &mut g[range]);
        let dy = timed!(
            "experts.bwd",
            match comm.experts() {
                Some(group) => experts.backward(group, th, pm, gm, dx),
                None => experts.backward(&mut Local, th, pm, gm, dx),
            }
        )?;
        timed!(
            "norm.bwd",
            self.norm_grads(
                th, d, g, &l.ln2_w, &l.ln2_b, dx, &dy, a.res2, p, a.ln2_mean, a.ln2_rstd
            )
        );
        Ok(())
    }
}
