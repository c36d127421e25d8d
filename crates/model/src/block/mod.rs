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
use crate::kernels::matmul::{matmul_bwd_weight, matmul_fwd};
use crate::kernels::norm::{layernorm_bwd, layernorm_fwd, rmsnorm_bwd, rmsnorm_fwd};
use crate::kernels::rope::RopeTable;
use crate::layout::BlockLayout;
use crate::moe::{ExpertComm, Experts};
use crate::profile::timed;
use crate::real::Real;
use crate::threads::Threads;
use std::ops::Range;

mod experts;
mod halves;

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

    /// Whether the residual stream is split by rows over the group (Megatron's sequence
    /// parallelism, 000 L3239): each rank keeps `rows = N/tp` consecutive rows of it, `f`
    /// all-gathers the norm's rows before a column-parallel linear and `g` reduce-scatters a
    /// row-parallel linear's partial output into the rows, in place of the sums.
    fn sequence(&self) -> bool {
        false
    }

    /// This rank's index in the group and the group's size: which rows of the residual stream
    /// it keeps under sequence parallelism.
    fn part(&self) -> (usize, usize) {
        (0, 1)
    }

    /// Gathers every rank's `rows` (rows/parts of `whole`) into `whole`, in rank order:
    /// `f`'s forward and `g`'s backward under sequence parallelism.
    ///
    /// # Errors
    /// [`crate::ModelError::Comm`] when the group's collective fails.
    fn gather(&mut self, rows: &[T], whole: &mut [T]) -> Result<()>
    where
        T: Copy,
    {
        whole.copy_from_slice(rows);
        Ok(())
    }

    /// Sums `whole` over the group and keeps this rank's rows in `rows`: `g`'s forward and
    /// `f`'s backward under sequence parallelism.
    ///
    /// # Errors
    /// [`crate::ModelError::Comm`] when the group's collective fails.
    fn scatter(&mut self, whole: &mut [T], rows: &mut [T]) -> Result<()>
    where
        T: Copy,
    {
        rows.copy_from_slice(whole);
        Ok(())
    }

    /// The expert-parallel group a mixture-of-experts feed-forward exchanges its rows over
    /// (Megatron's expert dispatch and combine): None for a block alone on its rank (every
    /// exchange a copy).
    fn experts(&mut self) -> Option<&mut dyn ExpertComm<T>> {
        None
    }
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
    /// Rows of the residual stream this rank keeps: N, or N/tp under sequence parallelism
    /// (the norms, residuals and block outputs; the linears and attention see all N).
    pub rows: usize,
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
    /// The dimensions of `cfg` at batch `b` and length `t`. With experts in place of the MLP
    /// `f` and `fin` are 0: the experts keep their own activations
    /// ([`crate::moe::Experts`]).
    pub fn new(cfg: &ModelConfig, b: usize, t: usize) -> Self {
        let dense = cfg.moe.is_none();
        Self {
            b,
            t,
            n: b * t,
            rows: b * t,
            c: cfg.d_model,
            h: cfg.heads,
            k: cfg.kv_heads,
            d: cfg.head_dim(),
            qkv: cfg.qkv_dim(),
            f: if dense { cfg.ffn } else { 0 },
            fin: if dense { cfg.ffn_in_dim() } else { 0 },
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

    /// The dimensions under sequence parallelism over `tp` ranks: each keeps `rows = N/tp`
    /// rows of the residual stream. `tp` must divide N (checked by [`crate::model::Model`]).
    pub fn sequence(&self, tp: usize) -> Self {
        Self {
            rows: self.n / tp,
            ..self.clone()
        }
    }

    /// Whether the residual stream is split by rows (sequence parallelism).
    pub fn sequence_split(&self) -> bool {
        self.rows < self.n
    }

    /// Elements of one block's saved activations (everything but its output): the norms'
    /// outputs and statistics and the residual on `rows` rows, the rest on all N.
    pub fn block_acts_len(&self) -> usize {
        let (n, c, r) = (self.n, self.c, self.rows);
        3 * r * c
            + 4 * r
            + n * self.qkv
            + n * self.h * self.d
            + self.b * self.h * self.t
            + n * self.fin
            + n * self.f
    }

    /// Elements of the backward scratch of one block (under sequence parallelism also the
    /// gather buffer (N, C), the scattered rows (rows, C) and the norms' partial gradients).
    pub fn block_scratch_len(&self) -> usize {
        let n = self.n;
        let wide = self.wide_len();
        n * self.f + n * self.fin + n * self.c + n * self.h * self.d + n * self.qkv + wide
    }

    /// The sequence-parallel part of the scratch: (N, C) + (rows, C) + 2C, or nothing.
    fn wide_len(&self) -> usize {
        match self.sequence_split() {
            true => self.n * self.c + self.rows * self.c + 2 * self.c,
            false => 0,
        }
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
    /// ln1 output (rows, C).
    pub ln1: &'a mut [T],
    /// ln1 row means (rows) (LayerNorm only).
    pub ln1_mean: &'a mut [T],
    /// ln1 reciprocal std (rows).
    pub ln1_rstd: &'a mut [T],
    /// q, k (rotated) and v (N, (H+2K)D).
    pub qkv: &'a mut [T],
    /// attention output before the projection (N, HD).
    pub atty: &'a mut [T],
    /// attention log-sum-exp per query (B, H, T).
    pub lse: &'a mut [T],
    /// residual after attention (rows, C).
    pub res2: &'a mut [T],
    /// ln2 output (rows, C).
    pub ln2: &'a mut [T],
    /// ln2 row means (rows).
    pub ln2_mean: &'a mut [T],
    /// ln2 reciprocal std (rows).
    pub ln2_rstd: &'a mut [T],
    /// first MLP linear output, pre-activation (N, Fin).
    pub fch: &'a mut [T],
    /// activation output (N, F).
    pub act: &'a mut [T],
    /// The block's experts, which keep their own activations, when its feed-forward is a
    /// mixture of experts (set by the caller after [`BlockActs::carve`]).
    pub experts: Option<&'a mut Experts<T>>,
}

impl<'a, T> BlockActs<'a, T> {
    /// Carve the fields out of `buf` (length [`Dims::block_acts_len`]).
    pub fn carve(buf: &'a mut [T], d: &Dims) -> Self {
        let (n, c, r) = (d.n, d.c, d.rows);
        let mut k = Carve::new(buf);
        Self {
            ln1: k.take(r * c),
            ln1_mean: k.take(r),
            ln1_rstd: k.take(r),
            qkv: k.take(n * d.qkv),
            atty: k.take(n * d.h * d.d),
            lse: k.take(d.b * d.h * d.t),
            res2: k.take(r * c),
            ln2: k.take(r * c),
            ln2_mean: k.take(r),
            ln2_rstd: k.take(r),
            fch: k.take(n * d.fin),
            act: k.take(n * d.f),
            experts: None,
        }
    }
}

/// Gradient scratch for one block's backward.
pub struct BlockScratch<'a, T> {
    dact: &'a mut [T],
    dfch: &'a mut [T],
    /// A column-parallel linear's input gradient (N, C).
    pub(crate) dln: &'a mut [T],
    datty: &'a mut [T],
    dqkv: &'a mut [T],
    /// Sequence parallelism only (else empty): the gathered rows (N, C), this rank's rows of
    /// a reduce-scatter (rows, C), and a norm's partial weight and bias gradients (2C).
    pub(crate) wide: &'a mut [T],
    pub(crate) part: &'a mut [T],
    pub(crate) norm: &'a mut [T],
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
            wide: k.take(if d.sequence_split() { n * d.c } else { 0 }),
            part: k.take(if d.sequence_split() { d.rows * d.c } else { 0 }),
            norm: k.take(if d.sequence_split() { 2 * d.c } else { 0 }),
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

    /// The block's norm (LayerNorm or RMSNorm) forward over `d.rows` rows, with its weight
    /// and bias at `w`/`b` inside `p`. Also used for the model's final norm (norms are
    /// replicated over a tensor-parallel group).
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
            Norm::LayerNorm => {
                layernorm_fwd(th, out, mean, rstd, x, w, opt(p, b), d.rows, d.c, eps)
            }
            Norm::RmsNorm => rmsnorm_fwd(th, out, rstd, x, w, d.rows, d.c, eps),
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
            Norm::LayerNorm => layernorm_bwd(th, dx, dw, db, dout, x, w, mean, rstd, d.rows, d.c),
            Norm::RmsNorm => rmsnorm_bwd(th, dx, dw, dout, x, w, rstd, d.rows, d.c),
        }
    }

    /// Forward: `out` from `x` (this rank's `d.rows` rows of the residual stream, (rows, C)),
    /// saving activations in `a` (`s` lends the sequence-parallel gather buffer): the
    /// attention half ([`Block::attention_forward`]) then the feed-forward half
    /// ([`Block::mlp_forward`]). A split block (`comm.splits()`) sums each row-parallel output
    /// over its group with `comm` (twice, on (N, C) buffers), or under sequence parallelism
    /// all-gathers each norm's rows and reduce-scatters each row-parallel output.
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
        s: &mut BlockScratch<'_, T>,
        x: &[T],
        out: &mut [T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        self.attention_forward(th, d, p, rope, a, s, x, comm)?;
        match self.layout.moe {
            Some(_) => self.moe_forward(th, d, p, a, out, comm),
            None => self.mlp_forward(th, d, p, a, s, out, comm),
        }
    }

    /// A row-parallel linear and `g`: `out = Σ_group inp · Wᵀ + b`, `inp` (n, c). Whole, the
    /// bias is added inside the matmul; split, the partial outputs are summed first and the
    /// bias added once; under sequence parallelism the partial (n, oc) lands in `wide` and is
    /// reduce-scattered into `out`, this rank's rows.
    #[allow(clippy::too_many_arguments)]
    fn row_linear<T: Real>(
        &self,
        th: &Threads,
        p: &[T],
        w: &Range<usize>,
        b: &Option<Range<usize>>,
        out: &mut [T],
        inp: &[T],
        (n, c, oc): (usize, usize, usize),
        wide: &mut [T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        if !comm.splits() {
            timed!("matmul.fwd", self.linear(th, p, w, b, out, inp, n, c, oc));
            return Ok(());
        }
        if comm.sequence() {
            timed!(
                "matmul.fwd",
                self.linear(th, p, w, &None, wide, inp, n, c, oc)
            );
            comm.scatter(wide, out)?;
        } else {
            timed!(
                "matmul.fwd",
                self.linear(th, p, w, &None, out, inp, n, c, oc)
            );
            comm.sum(out)?;
        }
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
        match self.layout.moe {
            Some(_) => self.moe_backward(th, d, p, g, a, dx, comm)?,
            None => self.mlp_backward(th, d, p, g, a, s, dx, comm)?,
        }
        self.attention_backward(th, d, p, g, rope, a, s, x, dx, comm)
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

    /// [`Block::norm_grads`] on this rank's rows of the residual stream: under sequence
    /// parallelism the weight and bias gradients of its rows are partial, so they are
    /// computed into `tmp` (2C), summed over the group and then added into `g`; otherwise
    /// straight into `g`.
    ///
    /// # Errors
    /// What `comm` returns.
    #[allow(clippy::too_many_arguments)]
    pub fn rows_norm_grads<T: Real>(
        &self,
        th: &Threads,
        d: &Dims,
        g: &mut [T],
        (w, b): (&Range<usize>, &Option<Range<usize>>),
        dx: &mut [T],
        dnorm: &[T],
        x: &[T],
        p: &[T],
        (mean, rstd): (&[T], &[T]),
        tmp: &mut [T],
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        if !comm.sequence() {
            self.norm_grads(th, d, g, w, b, dx, dnorm, x, p, mean, rstd);
            return Ok(());
        }
        let c = w.len();
        let (tw, tb) = tmp[..2 * c].split_at_mut(c);
        tw.fill(T::zero());
        tb.fill(T::zero());
        let tb = b.as_ref().map(|_| tb);
        self.norm_bwd(th, d, dx, tw, tb, dnorm, x, &p[w.clone()], mean, rstd);
        comm.sum(&mut tmp[..2 * c])?;
        for (gi, &ti) in g[w.clone()].iter_mut().zip(&tmp[..c]) {
            *gi += ti;
        }
        if let Some(b) = b {
            for (gi, &ti) in g[b.clone()].iter_mut().zip(&tmp[c..2 * c]) {
                *gi += ti;
            }
        }
        Ok(())
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
