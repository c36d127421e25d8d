//! One transformer block, forward and backward on its own.
//!
//! A block reads its parameters from a slice of the flat buffer (laid out by
//! [`BlockLayout`]), keeps what its backward needs in [`BlockActs`], and
//! writes its parameter gradients into a slice of the gradient buffer, so
//! pipeline stages, tensor splits and overlapped gradient buckets can be
//! built on it.
//!
//! ```text
//! forward (pre-norm):                       backward (same list, reversed):
//!   ln1  = norm(x)                            dact  = dout · Wfcp ; dWfcp += doutᵀ·act
//!   qkv  = ln1 · Wqkvᵀ (+b), rope(q, k)       dfch  = act'(fch) ⊙ dact
//!   atty = causal_attention(qkv)              dln2  = dfch · Wfc  ; dWfc += dfchᵀ·ln2
//!   res2 = x + atty · Wprojᵀ (+b)             dres2 = dout + norm'(dln2)
//!   ln2  = norm(res2)                         datty = dres2 · Wproj ; dWproj += dres2ᵀ·atty
//!   fch  = ln2 · Wfcᵀ (+b); act = act(fch)    dqkv  = attention'(datty); rope'(dqkv)
//!   out  = res2 + act · Wfcpᵀ (+b)            dln1  = dqkv · Wqkv ; dWqkv += dqkvᵀ·ln1
//!                                             dx    = dres2 + norm'(dln1)
//! ```
use crate::config::{Activation, ModelConfig, Norm};
use crate::error::Result;
use crate::kernels::activation::{GeluKind, gelu_bwd, gelu_fwd, swiglu_bwd, swiglu_fwd};
use crate::kernels::attention::{attention_bwd, attention_fwd};
use crate::kernels::matmul::{matmul_bwd_input, matmul_bwd_weight, matmul_fwd};
use crate::kernels::norm::{layernorm_bwd, layernorm_fwd, rmsnorm_bwd, rmsnorm_fwd};
use crate::kernels::residual::add_acc;
use crate::kernels::rope::{RopeTable, rope_bwd, rope_fwd};
use crate::layout::BlockLayout;
use crate::profile::{scope, timed};
use crate::real::Real;
use crate::threads::Threads;
use std::ops::Range;

/// Where a block meets the other ranks holding parts of it: Megatron's communication points
/// `f` and `g` (000 §2.15, F46). A column-parallel linear (QKV, fc) starts with `f` (forward:
/// identity; backward: sum of the input gradient), a row-parallel one (proj, fcp) ends with `g`
/// (forward: sum of the partial outputs; backward: identity). A whole block ([`Alone`]) has
/// nothing to communicate; a tensor-parallel shard sums over its group.
pub trait BlockComm<T> {
    /// Whether the block's linears are split over a group, so the row-parallel outputs are
    /// partial sums: their biases are then added once, after [`BlockComm::sum`], instead of
    /// inside the matmul.
    fn splits(&self) -> bool;

    /// Sums an (N, C) buffer over the group in place: `g`'s forward after proj and fcp, `f`'s
    /// backward after the QKV and fc input gradients.
    ///
    /// # Errors
    /// [`crate::ModelError::Comm`] when the group's collective fails.
    fn sum(&mut self, buf: &mut [T]) -> Result<()>;
}

/// The [`BlockComm`] of a whole block on one process: no group, nothing to sum.
#[derive(Clone, Copy, Debug, Default)]
pub struct Alone;

impl<T> BlockComm<T> for Alone {
    fn splits(&self) -> bool {
        false
    }

    fn sum(&mut self, _buf: &mut [T]) -> Result<()> {
        Ok(())
    }
}

/// `out[i, j] += b[j]` for an (N, C) `out`: a row-parallel bias, added once after the sum.
fn add_bias<T: Real>(out: &mut [T], b: Option<&[T]>) {
    if let Some(b) = b {
        for row in out.chunks_exact_mut(b.len()) {
            for (o, &x) in row.iter_mut().zip(b) {
                *o += x;
            }
        }
    }
}

/// Sizes of one forward/backward pass: config dimensions and the batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Dims {
    /// Sequences per batch (B).
    pub b: usize,
    /// Sequence length (T).
    pub t: usize,
    /// Rows, B*T (N).
    pub n: usize,
    /// Width (C).
    pub c: usize,
    /// Query heads (H).
    pub h: usize,
    /// Key/value heads (K).
    pub k: usize,
    /// Head dim (D).
    pub d: usize,
    /// qkv width, (H+2K)D.
    pub qkv: usize,
    /// Feed-forward width (F).
    pub f: usize,
    /// First feed-forward linear's output width (F, or 2F for SwiGLU).
    pub fin: usize,
    /// Vocabulary (V).
    pub v: usize,
}

impl Dims {
    /// The dimensions of `cfg` at batch `b` and length `t`.
    pub fn new(cfg: &ModelConfig, b: usize, t: usize) -> Self {
        Self {
            b,
            t,
            n: b * t,
            c: cfg.d_model,
            h: cfg.heads,
            k: cfg.kv_heads,
            d: cfg.head_dim(),
            qkv: cfg.qkv_dim(),
            f: cfg.ffn,
            fin: cfg.ffn_in_dim(),
            v: cfg.vocab,
        }
    }

    /// The dimensions of one of `tp` equal shards of the block (000 §2.15: whole heads per
    /// rank): `h` = H/tp, `k` = K/tp, `qkv` = (H+2K)D/tp, `f` = F/tp, `fin` = Fin/tp; the rows,
    /// width, head size and vocabulary stay whole. `tp` must divide H, K and F
    /// ([`ModelConfig::check_split`]).
    pub fn split(&self, tp: usize) -> Self {
        let (h, k, f) = (self.h / tp, self.k / tp, self.f / tp);
        Self {
            h,
            k,
            qkv: (h + 2 * k) * self.d,
            f,
            fin: self.fin / tp,
            ..self.clone()
        }
    }

    /// Elements of one block's saved activations (everything but its output).
    pub fn block_acts_len(&self) -> usize {
        let (n, c) = (self.n, self.c);
        4 * n * c
            + 6 * n
            + n * self.qkv
            + n * self.h * self.d
            + self.b * self.h * self.t
            + n * self.fin
            + n * self.f
    }

    /// Elements of the backward scratch of one block.
    pub fn block_scratch_len(&self) -> usize {
        let n = self.n;
        n * self.f + n * self.fin + n * self.c + n * self.h * self.d + n * self.qkv
    }
}

/// Cuts consecutive sub-slices off a mutable slice.
pub(crate) struct Carve<'a, T>(&'a mut [T]);

impl<'a, T> Carve<'a, T> {
    pub(crate) fn new(s: &'a mut [T]) -> Self {
        Self(s)
    }

    pub(crate) fn take(&mut self, len: usize) -> &'a mut [T] {
        let s = std::mem::take(&mut self.0);
        let (head, tail) = s.split_at_mut(len);
        self.0 = tail;
        head
    }
}

/// What one block's backward needs from its forward.
pub struct BlockActs<'a, T> {
    /// ln1 output (N, C).
    pub ln1: &'a mut [T],
    /// ln1 row means (N) (LayerNorm only).
    pub ln1_mean: &'a mut [T],
    /// ln1 reciprocal std (N).
    pub ln1_rstd: &'a mut [T],
    /// q, k (rotated) and v (N, (H+2K)D).
    pub qkv: &'a mut [T],
    /// attention output before the projection (N, HD).
    pub atty: &'a mut [T],
    /// attention log-sum-exp per query (B, H, T).
    pub lse: &'a mut [T],
    /// residual after attention (N, C).
    pub res2: &'a mut [T],
    /// ln2 output (N, C).
    pub ln2: &'a mut [T],
    /// ln2 row means (N).
    pub ln2_mean: &'a mut [T],
    /// ln2 reciprocal std (N).
    pub ln2_rstd: &'a mut [T],
    /// first MLP linear output, pre-activation (N, Fin).
    pub fch: &'a mut [T],
    /// activation output (N, F).
    pub act: &'a mut [T],
}

impl<'a, T> BlockActs<'a, T> {
    /// Carve the fields out of `buf` (length [`Dims::block_acts_len`]).
    pub fn carve(buf: &'a mut [T], d: &Dims) -> Self {
        let (n, c) = (d.n, d.c);
        let mut k = Carve::new(buf);
        Self {
            ln1: k.take(n * c),
            ln1_mean: k.take(n),
            ln1_rstd: k.take(n),
            qkv: k.take(n * d.qkv),
            atty: k.take(n * d.h * d.d),
            lse: k.take(d.b * d.h * d.t),
            res2: k.take(n * c),
            ln2: k.take(n * c),
            ln2_mean: k.take(n),
            ln2_rstd: k.take(n),
            fch: k.take(n * d.fin),
            act: k.take(n * d.f),
        }
    }
}

/// Gradient scratch for one block's backward.
pub struct BlockScratch<'a, T> {
    dact: &'a mut [T],
    dfch: &'a mut [T],
    dln: &'a mut [T],
    datty: &'a mut [T],
    dqkv: &'a mut [T],
}

impl<'a, T> BlockScratch<'a, T> {
    /// Carve the scratch out of `buf` (length [`Dims::block_scratch_len`]).
    pub fn carve(buf: &'a mut [T], d: &Dims) -> Self {
        let n = d.n;
        let mut k = Carve::new(buf);
        Self {
            dact: k.take(n * d.f),
            dfch: k.take(n * d.fin),
            dln: k.take(n * d.c),
            datty: k.take(n * d.h * d.d),
            dqkv: k.take(n * d.qkv),
        }
    }
}

/// One block's configuration-derived behaviour.
#[derive(Clone, Debug)]
pub struct Block {
    /// The relative parameter offsets.
    pub layout: BlockLayout,
    norm: Norm,
    activation: Activation,
    eps: f64,
}

fn opt<'a, T>(s: &'a [T], r: &Option<Range<usize>>) -> Option<&'a [T]> {
    r.as_ref().map(|r| &s[r.clone()])
}

/// A linear layer's weight gradients for its weight and bias at `w`/`b` inside
/// `g`: `dW += doutᵀ · inp` (oc, c), `db += Σ_rows dout` (oc), with `dout` (n, oc) and
/// `inp` (n, c). Shared with the tensor-parallel block.
#[allow(clippy::too_many_arguments)]
pub fn linear_weight_grads<T: Real>(
    th: &Threads,
    g: &mut [T],
    w: &Range<usize>,
    b: &Option<Range<usize>>,
    dout: &[T],
    inp: &[T],
    n: usize,
    c: usize,
    oc: usize,
) {
    match b {
        Some(b) => {
            let [gw, gb] = grads_mut(g, [w.clone(), b.clone()]);
            matmul_bwd_weight(th, gw, Some(gb), dout, inp, n, c, oc);
        }
        None => matmul_bwd_weight(th, &mut g[w.clone()], None, dout, inp, n, c, oc),
    }
}

/// Disjoint mutable views of several ranges of one gradient slice.
fn grads_mut<T, const M: usize>(g: &mut [T], rs: [Range<usize>; M]) -> [&mut [T]; M] {
    g.get_disjoint_mut(rs)
        .expect("block layout ranges are disjoint")
}

impl Block {
    /// The block of `cfg`.
    pub fn new(cfg: &ModelConfig, layout: BlockLayout) -> Self {
        Self {
            layout,
            norm: cfg.norm,
            activation: cfg.activation,
            eps: cfg.norm_eps,
        }
    }

    /// The block's norm (LayerNorm or RMSNorm) forward, with its weight and
    /// bias at `w`/`b` inside `p`. Also used for the model's final norm and by
    /// the tensor-parallel block (norms are replicated there).
    pub fn norm_fwd<T: Real>(
        &self,
        th: &Threads,
        d: &Dims,
        out: &mut [T],
        mean: &mut [T],
        rstd: &mut [T],
        x: &[T],
        p: &[T],
        w: &Range<usize>,
        b: &Option<Range<usize>>,
    ) {
        let (w, eps) = (&p[w.clone()], T::of(self.eps));
        match self.norm {
            Norm::LayerNorm => layernorm_fwd(th, out, mean, rstd, x, w, opt(p, b), d.n, d.c, eps),
            Norm::RmsNorm => rmsnorm_fwd(th, out, rstd, x, w, d.n, d.c, eps),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn norm_bwd<T: Real>(
        &self,
        th: &Threads,
        d: &Dims,
        dx: &mut [T],
        dw: &mut [T],
        db: Option<&mut [T]>,
        dout: &[T],
        x: &[T],
        w: &[T],
        mean: &[T],
        rstd: &[T],
    ) {
        match self.norm {
            Norm::LayerNorm => layernorm_bwd(th, dx, dw, db, dout, x, w, mean, rstd, d.n, d.c),
            Norm::RmsNorm => rmsnorm_bwd(th, dx, dw, dout, x, w, rstd, d.n, d.c),
        }
    }

    /// Forward: `out` (N, C) from `x` (N, C), saving activations in `a`. A split block
    /// (`comm.splits()`) sums each row-parallel output over its group with `comm` (twice, on
    /// (N, C) buffers).
    ///
    /// # Errors
    /// What `comm` returns.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<T: Real>(
        &self,
        th: &Threads,
        d: &Dims,
        p: &[T],
        rope: Option<&RopeTable<T>>,
        a: &mut BlockActs<'_, T>,
        x: &[T],
        out: &mut [T],
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

    /// A row-parallel linear and `g`: `out = Σ_group inp · Wᵀ + b`. Whole, the bias is added
    /// inside the matmul; split, the partial outputs are summed first and the bias added once.
    #[allow(clippy::too_many_arguments)]
    fn row_linear<T: Real>(
        &self,
        th: &Threads,
        p: &[T],
        w: &Range<usize>,
        b: &Option<Range<usize>>,
        out: &mut [T],
        inp: &[T],
        n: usize,
        c: usize,
        oc: usize,
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        if !comm.splits() {
            timed!("matmul.fwd", self.linear(th, p, w, b, out, inp, n, c, oc));
            return Ok(());
        }
        timed!(
            "matmul.fwd",
            self.linear(th, p, w, &None, out, inp, n, c, oc)
        );
        comm.sum(out)?;
        add_bias(out, opt(p, b));
        Ok(())
    }

    /// Backward. On entry `dx` holds the gradient of the block's output; on
    /// exit the gradient of its input. Parameter gradients accumulate into
    /// `g` (the block's slice of the gradient buffer). A split block sums the input gradients
    /// of its column-parallel linears over its group with `comm` (twice, on (N, C) buffers);
    /// its replicated tensors' gradients come out whole and equal on every rank.
    ///
    /// # Errors
    /// What `comm` returns.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<T: Real>(
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

    /// A linear forward with its weight and bias at `w`/`b` inside `p`:
    /// `out = inp · Wᵀ + b`.
    fn linear<T: Real>(
        &self,
        th: &Threads,
        p: &[T],
        w: &Range<usize>,
        b: &Option<Range<usize>>,
        out: &mut [T],
        inp: &[T],
        n: usize,
        c: usize,
        oc: usize,
    ) {
        matmul_fwd(th, out, inp, &p[w.clone()], opt(p, b), n, c, oc);
    }

    #[allow(clippy::too_many_arguments)]
    /// The norm's backward: `dx += norm'(dnorm)`, weight/bias gradients
    /// accumulate into `g` at `w`/`b`. Also used for the model's final norm.
    pub fn norm_grads<T: Real>(
        &self,
        th: &Threads,
        d: &Dims,
        g: &mut [T],
        w: &Range<usize>,
        b: &Option<Range<usize>>,
        dx: &mut [T],
        dnorm: &[T],
        x: &[T],
        p: &[T],
        mean: &[T],
        rstd: &[T],
    ) {
        let weight = &p[w.clone()];
        match b {
            Some(b) => {
                let [gw, gb] = grads_mut(g, [w.clone(), b.clone()]);
                self.norm_bwd(th, d, dx, gw, Some(gb), dnorm, x, weight, mean, rstd);
            }
            None => self.norm_bwd(
                th,
                d,
                dx,
                &mut g[w.clone()],
                None,
                dnorm,
                x,
                weight,
                mean,
                rstd,
            ),
        }
    }
}
