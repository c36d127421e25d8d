//! A small mixture-of-experts decoder on one rank of an EP group (000 "专家并行（混合专家模型）",
//! F49 capacity, F50 all-to-all volume): GPT-2's pre-norm blocks with the MLP replaced by an
//! [`EpMoeLayer`], trained end to end by [`MoeTrainer`] ([`train`]).
//!
//! Legend: B = rows on this rank, T = sequence length, N = B·T, C = channels, H = heads,
//! D = C / H, V = vocabulary, L = layers, E = experts, El = E / ep.
//!
//! ```text
//! tokens ─ wte + wpe ─ x0 ─┬─ LN1 ─ qkv ─ attention ─ proj ─(+)─ res ─┬─ LN2 ─ MoE ─(+)─ x1 … xL
//!                          └──────────────────────────────────────┘  └───────────────┘
//! xL ─ LNf ─ lm_head ─ cross-entropy (+ aux_weight · Σ_l aux_l, inside each MoE backward)
//! ```
//!
//! - Flat state ([`layout`]): `[dense | moe 0 | … | moe L-1]`, the dense tensors replicated,
//!   each layer's router replicated and its experts sharded; [`MoeModelLayout::gather`] and
//!   [`MoeModelLayout::shard`] convert to and from the ep = 1 buffer.
//! - Kernels. The attention half is composed from the model crate's public kernels
//!   (LayerNorm, matmul, causal attention, residual add, embedding, cross-entropy), as
//!   [`crate::tensor::model`] composes its parts; the block's own entry point runs its MLP too.
//! - Gradient scale. The backward differentiates the *group's* objective, the mean
//!   cross-entropy over the N_global = ep·N tokens of the EP group plus the aux losses: the
//!   cross-entropy rows are scaled by 1 / N_global. So each expert's gradient (every rank's
//!   tokens through the all-to-all) and each router's (summed inside the layer) are already
//!   the ep = 1 gradient, and the dense gradients become it when summed over the group
//!   (= the average of the ranks' own-rows mean gradients, the shares being equal).
pub mod checkpoint;
pub mod layout;
pub mod train;

pub use layout::{BlockRanges, Lin, MoeModelConfig, MoeModelLayout};
pub use train::{MoeStepStats, MoeTrainConfig, MoeTrainer};

use crate::error::Result;
use crate::expert::{EpMoeLayer, MoeStats, bad, check_len};
use comm::group::ProcessGroup;
use model::Threads;
use model::kernels::attention::{attention_bwd, attention_fwd};
use model::kernels::embedding::{embed_bwd, embed_fwd};
use model::kernels::loss::{cross_entropy_bwd, cross_entropy_fwd};
use model::kernels::matmul::{matmul_bwd_input, matmul_bwd_weight, matmul_fwd};
use model::kernels::norm::{layernorm_bwd, layernorm_fwd};
use model::kernels::residual::add_acc;

// ----------------------------------------------------------------------------
// thin wrappers over the kernels, addressing tensors by their place in the buffer

/// `out = inp · Wᵀ + b` with the linear `l` of `p`. out: (n, oc), inp: (n, c).
fn lin_fwd(th: &Threads, p: &[f32], l: Lin, out: &mut [f32], inp: &[f32], n: usize) {
    matmul_fwd(th, out, inp, &p[l.w()], Some(&p[l.b()]), n, l.c, l.oc);
}

/// Backward of [`lin_fwd`]: `dinp = dout · W` (overwritten), `dW += doutᵀ · inp`,
/// `db += Σ dout` into `g`.
#[allow(clippy::too_many_arguments)]
fn lin_bwd(
    th: &Threads,
    p: &[f32],
    g: &mut [f32],
    l: Lin,
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    n: usize,
) {
    matmul_bwd_input(th, dinp, 0.0, dout, &p[l.w()], n, l.c, l.oc);
    let (gw, gb) = g[l.all()].split_at_mut(l.oc * l.c);
    matmul_bwd_weight(th, gw, Some(gb), dout, inp, n, l.c, l.oc);
}

/// One LayerNorm's output and saved statistics.
#[derive(Debug, Default)]
struct NormActs {
    /// (N, C).
    out: Vec<f32>,
    /// (N) each.
    mean: Vec<f32>,
    rstd: Vec<f32>,
}

impl NormActs {
    fn new(n: usize, c: usize) -> Self {
        Self {
            out: vec![0.0; n * c],
            mean: vec![0.0; n],
            rstd: vec![0.0; n],
        }
    }

    fn forward(&mut self, th: &Threads, p: &[f32], l: Lin, x: &[f32], eps: f32) {
        let (n, c) = (self.mean.len(), l.oc);
        let (w, b) = (&p[l.w()], &p[l.b()]);
        layernorm_fwd(
            th,
            &mut self.out,
            &mut self.mean,
            &mut self.rstd,
            x,
            w,
            Some(b),
            n,
            c,
            eps,
        );
    }

    /// `dx += norm'(dout)`, weight and bias gradients into `g`.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        th: &Threads,
        p: &[f32],
        g: &mut [f32],
        l: Lin,
        dx: &mut [f32],
        dout: &[f32],
        x: &[f32],
    ) {
        let (n, c) = (self.mean.len(), l.oc);
        let (gw, gb) = g[l.all()].split_at_mut(c);
        let w = &p[l.w()];
        layernorm_bwd(
            th,
            dx,
            gw,
            Some(gb),
            dout,
            x,
            w,
            &self.mean,
            &self.rstd,
            n,
            c,
        );
    }
}

/// What one block's backward needs.
#[derive(Debug)]
struct BlockActs {
    /// The block's input (N, C).
    x: Vec<f32>,
    ln1: NormActs,
    /// (N, 3C).
    qkv: Vec<f32>,
    /// Attention output before proj (N, C), its log-sum-exps (B, H, T).
    atty: Vec<f32>,
    lse: Vec<f32>,
    /// x + attention (N, C).
    res: Vec<f32>,
    ln2: NormActs,
}

/// One rank's decoder at `b` rows of length `t`: the replicated dense tensors, this rank's
/// experts, and the activations of one batch.
pub struct MoeModel {
    layout: MoeModelLayout,
    moe: Vec<EpMoeLayer<f32>>,
    /// (b, t, heads).
    bth: (usize, usize, usize),
    /// N_global = ep · N, the cross-entropy's denominator.
    n_global: usize,
    acts: Vec<BlockActs>,
    /// Final residual (N, C), its norm, logits (N, V) (their gradient after the backward),
    /// per-row losses and log-sum-exps (N).
    x_last: Vec<f32>,
    lnf: NormActs,
    logits: Vec<f32>,
    losses: Vec<f32>,
    lse: Vec<f32>,
    tokens: Vec<u32>,
    targets: Vec<u32>,
    forwarded: bool,
}

/// What one forward measured: this rank's summed cross-entropy, and each layer's group-wide
/// routing metrics (aux loss included).
#[derive(Clone, Debug)]
pub struct Forward {
    /// Σ of this rank's per-row losses (f64, row order).
    pub loss_sum: f64,
    /// One per layer.
    pub stats: Vec<MoeStats>,
}

impl MoeModel {
    /// Rank `group.rank()` of the EP `group` for `cfg` at `b` rows of `t` tokens per rank.
    /// Refuses `experts` when `group.size()` does not divide E, `seq_len` when `t` is 0 or
    /// too long, `batch` when `b` is 0.
    pub fn new(cfg: MoeModelConfig, group: ProcessGroup, b: usize, t: usize) -> Result<Self> {
        let layout = MoeModelLayout::new(cfg, group.size(), group.rank())?;
        if t == 0 || t > cfg.seq_len {
            return Err(bad(
                "seq_len",
                t,
                format!("needs 1..={} tokens per row", cfg.seq_len),
            ));
        }
        if b == 0 {
            return Err(bad("batch", b, "must be >= 1"));
        }
        let (n, c) = (b * t, cfg.moe.channels);
        let n_global = n * group.size();
        let moe = (0..cfg.layers)
            .map(|_| EpMoeLayer::new(cfg.moe, group.clone()))
            .collect::<Result<Vec<_>>>()?;
        let acts = (0..cfg.layers)
            .map(|_| BlockActs {
                x: vec![0.0; n * c],
                ln1: NormActs::new(n, c),
                qkv: vec![0.0; n * 3 * c],
                atty: vec![0.0; n * c],
                lse: vec![0.0; b * cfg.heads * t],
                res: vec![0.0; n * c],
                ln2: NormActs::new(n, c),
            })
            .collect();
        Ok(Self {
            moe,
            bth: (b, t, cfg.heads),
            n_global,
            acts,
            x_last: vec![0.0; n * c],
            lnf: NormActs::new(n, c),
            logits: vec![0.0; n * cfg.vocab],
            losses: vec![0.0; n],
            lse: vec![0.0; n],
            tokens: vec![0; n],
            targets: vec![0; n],
            forwarded: false,
            layout,
        })
    }

    /// This rank's layout.
    pub fn layout(&self) -> &MoeModelLayout {
        &self.layout
    }

    /// Tokens the whole EP group trains on per batch.
    pub fn global_tokens(&self) -> usize {
        self.n_global
    }

    fn check_ids(&self, what: &'static str, ids: &[u32]) -> Result<()> {
        let (n, v) = (self.tokens.len(), self.layout.cfg.vocab);
        Ok(model::model::check_token_ids(what, ids, n, v)?)
    }

    /// Forward of this rank's `tokens` against `targets` (B·T ids each) with its buffer `p`
    /// (collective over the EP group: two all-to-alls and three small exchanges per layer).
    pub fn forward(
        &mut self,
        th: &Threads,
        p: &[f32],
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<Forward> {
        check_len("moe model params", self.layout.total, p.len())?;
        self.check_ids("tokens", tokens)?;
        self.check_ids("targets", targets)?;
        self.forwarded = false;
        self.tokens.copy_from_slice(tokens);
        self.targets.copy_from_slice(targets);
        let l = &self.layout;
        let (b, t, h) = self.bth;
        let (n, c, v) = (b * t, l.cfg.moe.channels, l.cfg.vocab);
        let eps = l.cfg.norm_eps as f32;
        let mut x = vec![0f32; n * c];
        embed_fwd(
            th,
            &mut x,
            &self.tokens,
            &p[l.wte.clone()],
            Some(&p[l.wpe.clone()]),
            n,
            t,
            c,
        );
        let mut stats = Vec::with_capacity(self.moe.len());
        for ((r, a), moe) in l.blocks.iter().zip(&mut self.acts).zip(&mut self.moe) {
            a.x.copy_from_slice(&x);
            a.ln1.forward(th, p, r.ln1, &a.x, eps);
            lin_fwd(th, p, r.qkv, &mut a.qkv, &a.ln1.out, n);
            attention_fwd(th, &mut a.atty, &mut a.lse, &a.qkv, b, t, h, h, c / h);
            // res = x + atty · Wprojᵀ + b: the projection lands in res, then x is added.
            lin_fwd(th, p, r.proj, &mut a.res, &a.atty, n);
            add_acc(th, &mut a.res, &a.x);
            a.ln2.forward(th, p, r.ln2, &a.res, eps);
            let (y, st) = moe.forward(th, &p[r.moe.clone()], &a.ln2.out)?;
            x.copy_from_slice(&a.res);
            add_acc(th, &mut x, &y);
            stats.push(st);
        }
        self.x_last = x;
        self.lnf.forward(th, p, l.lnf, &self.x_last, eps);
        matmul_fwd(
            th,
            &mut self.logits,
            &self.lnf.out,
            &p[l.head.clone()],
            None,
            n,
            c,
            v,
        );
        cross_entropy_fwd(
            th,
            &mut self.losses,
            &mut self.lse,
            &self.logits,
            &self.targets,
            n,
            v,
        );
        self.forwarded = true;
        let loss_sum = self.losses.iter().map(|&x| f64::from(x)).sum();
        Ok(Forward { loss_sum, stats })
    }

    /// Backward of the last forward (collective, same `p`): accumulates into `g` this rank's
    /// part of the gradient of the group's objective (see the module doc): the dense part
    /// from its own rows (sum it over the group), the routers and experts complete.
    pub fn backward(&mut self, th: &Threads, p: &[f32], g: &mut [f32]) -> Result<()> {
        check_len("moe model params", self.layout.total, p.len())?;
        check_len("moe model grads", self.layout.total, g.len())?;
        if !self.forwarded {
            return Err(bad(
                "backward",
                "no forward",
                "needs a completed forward first",
            ));
        }
        self.forwarded = false;
        let l = &self.layout;
        let (b, t, h) = self.bth;
        let (n, c, v) = (b * t, l.cfg.moe.channels, l.cfg.vocab);
        let scale = 1.0 / self.n_global as f32;
        cross_entropy_bwd(th, &mut self.logits, &self.lse, &self.targets, n, v, scale);
        let mut dln = vec![0f32; n * c];
        matmul_bwd_input(th, &mut dln, 0.0, &self.logits, &p[l.head.clone()], n, c, v);
        matmul_bwd_weight(
            th,
            &mut g[l.head.clone()],
            None,
            &self.logits,
            &self.lnf.out,
            n,
            c,
            v,
        );
        // dx: the gradient of the residual stream, block output to block input.
        let mut dx = vec![0f32; n * c];
        self.lnf
            .backward(th, p, g, l.lnf, &mut dx, &dln, &self.x_last);
        let (mut datty, mut dqkv) = (vec![0f32; n * c], vec![0f32; n * 3 * c]);
        for ((r, a), moe) in l.blocks.iter().zip(&self.acts).zip(&mut self.moe).rev() {
            // x' = res + moe(ln2(res)): dres = dx' + ln2'(moe'(dx')).
            let dy = moe.backward(th, &p[r.moe.clone()], &mut g[r.moe.clone()], &dx)?;
            a.ln2.backward(th, p, g, r.ln2, &mut dx, &dy, &a.res);
            // res = x + proj(attention(qkv(ln1(x)))).
            lin_bwd(th, p, g, r.proj, &mut datty, &dx, &a.atty, n);
            attention_bwd(
                th,
                &mut dqkv,
                &datty,
                &a.qkv,
                &a.atty,
                &a.lse,
                b,
                t,
                h,
                h,
                c / h,
            );
            lin_bwd(th, p, g, r.qkv, &mut dln, &dqkv, &a.ln1.out, n);
            a.ln1.backward(th, p, g, r.ln1, &mut dx, &dln, &a.x);
        }
        let [wte, wpe] = g
            .get_disjoint_mut([l.wte.clone(), l.wpe.clone()])
            .map_err(|_| bad("layout", "wte, wpe", "overlap"))?;
        embed_bwd(th, wte, Some(wpe), &dx, &self.tokens, n, t, c);
        Ok(())
    }
}
