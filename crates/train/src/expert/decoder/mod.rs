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
//! - Kernels. Each block's attention half is the model crate's one block
//!   ([`model::block::Block::attention_forward`] and its backward, over this buffer's ranges:
//!   the same kernel sequence every dense layout runs), its norms the block's norms; the MoE
//!   layer replaces the block's MLP half (Megatron's layer spec with an MoE MLP).
//! - Gradient scale. The backward differentiates the *group's* objective, the mean
//!   cross-entropy over the N_global = ep·N tokens of the EP group plus the aux losses: the
//!   cross-entropy rows are scaled by 1 / N_global. So each expert's gradient (every rank's
//!   tokens through the all-to-all) and each router's (summed inside the layer) are already
//!   the ep = 1 gradient, and the dense gradients become it when summed over the group
//!   (= the average of the ranks' own-rows mean gradients, the shares being equal).
pub mod checkpoint;
mod forecast;
pub mod layout;
pub mod train;

pub use layout::{BlockRanges, Lin, MoeModelConfig, MoeModelLayout};
pub use train::{MoeStepStats, MoeTrainConfig, MoeTrainer};

use crate::error::Result;
use crate::expert::{EpMoeLayer, MoeStats, bad, check_len};
use comm::group::ProcessGroup;
use model::Threads;
use model::block::{Alone, Block, BlockActs, BlockScratch, Dims};
use model::config::ModelConfig;
use model::kernels::embedding::{embed_bwd, embed_fwd};
use model::kernels::loss::{cross_entropy_bwd, cross_entropy_fwd};
use model::kernels::matmul::{matmul_bwd_input, matmul_bwd_weight, matmul_fwd};
use model::kernels::residual::add_acc;
use model::layout::BlockLayout;

/// One block's saved state: its input (N, C) and the one block's activations (its
/// [`Dims::block_acts_len`] arena, the MLP's parts empty).
#[derive(Debug)]
struct LayerActs {
    x: Vec<f32>,
    arena: Vec<f32>,
}

/// The one block over the attention half of layer `r` of this buffer (absolute ranges: the
/// block reads `p` and writes `g` whole); its MLP ranges are empty (the MoE layer is the
/// feed-forward).
fn attention_block(cfg: &ModelConfig, r: &BlockRanges, total: usize) -> Block {
    let layout = BlockLayout {
        ln1_w: r.ln1.w(),
        ln1_b: Some(r.ln1.b()),
        qkv_w: r.qkv.w(),
        qkv_b: Some(r.qkv.b()),
        proj_w: r.proj.w(),
        proj_b: Some(r.proj.b()),
        ln2_w: r.ln2.w(),
        ln2_b: Some(r.ln2.b()),
        fc_w: 0..0,
        fc_b: None,
        fcp_w: 0..0,
        fcp_b: None,
        size: total,
    };
    Block::new(cfg, layout)
}

/// One rank's decoder at `b` rows of length `t`: the replicated dense tensors, this rank's
/// experts, and the activations of one batch.
pub struct MoeModel {
    layout: MoeModelLayout,
    moe: Vec<EpMoeLayer<f32>>,
    /// N_global = ep · N, the cross-entropy's denominator.
    n_global: usize,
    /// The one block over each layer's attention half, and the blocks' dimensions (no MLP).
    blocks: Vec<Block>,
    dims: Dims,
    acts: Vec<LayerActs>,
    /// The blocks' backward scratch.
    scratch: Vec<f32>,
    /// Final residual (N, C), its norm (N, C) with means and rstds (N), logits (N, V) (their
    /// gradient after the backward), per-row losses and log-sum-exps (N).
    x_last: Vec<f32>,
    lnf: Vec<f32>,
    lnf_mean: Vec<f32>,
    lnf_rstd: Vec<f32>,
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
        let mut dense = ModelConfig::gpt2(cfg.layers, cfg.heads, c, cfg.seq_len, cfg.vocab);
        dense.norm_eps = cfg.norm_eps;
        let dims = Dims {
            f: 0,
            fin: 0,
            ..Dims::new(&dense, b, t)
        };
        let blocks = layout
            .blocks
            .iter()
            .map(|r| attention_block(&dense, r, layout.total))
            .collect();
        let acts = (0..cfg.layers)
            .map(|_| LayerActs {
                x: vec![0.0; n * c],
                arena: vec![0.0; dims.block_acts_len()],
            })
            .collect();
        Ok(Self {
            moe,
            n_global,
            blocks,
            acts,
            scratch: vec![0.0; dims.block_scratch_len()],
            dims,
            x_last: vec![0.0; n * c],
            lnf: vec![0.0; n * c],
            lnf_mean: vec![0.0; n],
            lnf_rstd: vec![0.0; n],
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
        let (n, c, v, t) = (self.dims.n, self.dims.c, self.dims.v, self.dims.t);
        let d = &self.dims;
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
        let mut s = BlockScratch::carve(&mut self.scratch, d);
        let layers = self.blocks.iter().zip(&l.blocks);
        for (((block, r), a), moe) in layers.zip(&mut self.acts).zip(&mut self.moe) {
            a.x.copy_from_slice(&x);
            let mut acts = BlockActs::carve(&mut a.arena, d);
            // res2 = x + proj(attention(qkv(ln1(x)))), then ln2 = norm(res2) for the experts.
            block.attention_forward(th, d, p, None, &mut acts, &mut s, &a.x, &mut Alone)?;
            let bl = &block.layout;
            let (ln2, mean, rstd) = (acts.ln2, acts.ln2_mean, acts.ln2_rstd);
            block.norm_fwd(th, d, ln2, mean, rstd, acts.res2, p, &bl.ln2_w, &bl.ln2_b);
            let (y, st) = moe.forward(th, &p[r.moe.clone()], ln2)?;
            x.copy_from_slice(acts.res2);
            add_acc(th, &mut x, &y);
            stats.push(st);
        }
        self.x_last = x;
        let lnf = (&l.lnf.w(), &Some(l.lnf.b()));
        self.blocks[0].norm_fwd(
            th,
            d,
            &mut self.lnf,
            &mut self.lnf_mean,
            &mut self.lnf_rstd,
            &self.x_last,
            p,
            lnf.0,
            lnf.1,
        );
        matmul_fwd(
            th,
            &mut self.logits,
            &self.lnf,
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
        let d = &self.dims;
        let (n, c, v, t) = (d.n, d.c, d.v, d.t);
        let scale = 1.0 / self.n_global as f32;
        cross_entropy_bwd(th, &mut self.logits, &self.lse, &self.targets, n, v, scale);
        let mut dln = vec![0f32; n * c];
        matmul_bwd_input(th, &mut dln, 0.0, &self.logits, &p[l.head.clone()], n, c, v);
        matmul_bwd_weight(
            th,
            &mut g[l.head.clone()],
            None,
            &self.logits,
            &self.lnf,
            n,
            c,
            v,
        );
        // dx: the gradient of the residual stream, block output to block input.
        let mut dx = vec![0f32; n * c];
        self.blocks[0].norm_grads(
            th,
            d,
            g,
            &l.lnf.w(),
            &Some(l.lnf.b()),
            &mut dx,
            &dln,
            &self.x_last,
            p,
            &self.lnf_mean,
            &self.lnf_rstd,
        );
        let mut s = BlockScratch::carve(&mut self.scratch, d);
        let layers = self.blocks.iter().zip(&l.blocks).zip(&mut self.acts);
        for (((block, r), a), moe) in layers.zip(&mut self.moe).rev() {
            let acts = BlockActs::carve(&mut a.arena, d);
            let bl = &block.layout;
            // x' = res2 + moe(ln2(res2)): dres2 = dx' + ln2'(moe'(dx')).
            let dy = moe.backward(th, &p[r.moe.clone()], &mut g[r.moe.clone()], &dx)?;
            let (mean, rstd) = (&*acts.ln2_mean, &*acts.ln2_rstd);
            block.norm_grads(
                th, d, g, &bl.ln2_w, &bl.ln2_b, &mut dx, &dy, acts.res2, p, mean, rstd,
            );
            // res2 = x + proj(attention(qkv(ln1(x)))).
            block
                .attention_backward(th, d, p, g, None, &acts, &mut s, &a.x, &mut dx, &mut Alone)?;
        }
        let [wte, wpe] = g
            .get_disjoint_mut([l.wte.clone(), l.wpe.clone()])
            .map_err(|_| bad("layout", "wte, wpe", "overlap"))?;
        embed_bwd(th, wte, Some(wpe), &dx, &self.tokens, n, t, c);
        Ok(())
    }
}
