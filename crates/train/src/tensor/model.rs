//! A whole decoder on one tensor-parallel rank (000 §2.15, F46–F47): the embeddings and the
//! head replicated, every block sharded with [`TpBlock`], the residual stream whole.
//!
//! ```text
//! tokens ── embed (whole, replicated) ── x0 ── TpBlock 0 ── x1 ── … ── xL ── norm ── lm_head ── CE
//!                                            (4 all-reduces of (N, C) per block, F46)
//! ```
//!
//! - Flat state. A rank's parameters (and gradients, and AdamW moments) are one flat buffer:
//!   the whole model's [`Layout`](model::layout::Layout) order with every block replaced by
//!   this rank's shard ([`TpShard`](super::TpShard), the same length on every rank),
//!   `[wte | wpe] [block 0 shard] … [block L-1 shard] [lnf_w | lnf_b | lm_head]`. See
//!   [`TpLayout`].
//! - Replication. The embeddings, the final norm and the LM head are whole on every rank and
//!   computed from identical whole tensors (the residual stream after each block's all-reduce
//!   is the same on every rank), so their gradients are identical on every rank with no
//!   communication. This is the simplest split, not Megatron's vocabulary-parallel embedding
//!   and cross-entropy (each rank V/t rows of `wte`): that is a later step. It costs every rank
//!   the whole `V·C` (twice untied) instead of `V·C/t`.
//! - Kernels. The embedding and head run the same kernels, on the same shapes, as
//!   [`model::model::Model`], so on identical inputs they give identical outputs; the blocks
//!   differ from one process only in float summation order (split matmuls, all-reduces).
use model::block::{Block, Dims};
use model::config::{ModelConfig, Positions};
use model::kernels::embedding::{embed_bwd, embed_fwd};
use model::kernels::loss::{cross_entropy_bwd, cross_entropy_fwd, mean_loss};
use model::kernels::matmul::{matmul_bwd_input, matmul_bwd_weight, matmul_fwd};
use model::kernels::rope::RopeTable;
use model::threads::Threads;

use super::TpComm;
use super::block::TpBlock;
use super::layout::{LocalRanges, TpLayout};
use super::shard::check_len;
use crate::error::{Result, TrainError};

/// One rank's decoder at batch `b`, length `t` (N = B·T rows): the replicated embeddings and
/// head, the sharded blocks, and the activations of one micro-batch (f32).
pub struct TpModel {
    layout: TpLayout,
    ranges: LocalRanges,
    dims: Dims,
    /// The model crate's block over the whole layout, for its final-norm kernels.
    norm: Block,
    blocks: Vec<TpBlock<f32>>,
    rope: Option<RopeTable<f32>>,
    /// The residual stream entering block `l` (`xs[l]`) and leaving the last (`xs[L]`),
    /// (N, C) each.
    xs: Vec<Vec<f32>>,
    /// Final norm output (N, C), its mean and rstd (N).
    lnf: Vec<f32>,
    lnf_mean: Vec<f32>,
    lnf_rstd: Vec<f32>,
    /// Logits (N, V); after the backward, their gradient.
    logits: Vec<f32>,
    /// Per-row losses and log-sum-exps (N).
    losses: Vec<f32>,
    lse: Vec<f32>,
    /// Backward scratch: d lnf and d residual (N, C).
    dlnf: Vec<f32>,
    dresid: Vec<f32>,
    tokens: Vec<u32>,
    targets: Vec<u32>,
    forwarded: bool,
}

impl TpModel {
    /// Rank `rank` of a `tp`-way group for `cfg` at batch `b`, length `t` (at most
    /// `cfg.seq_len`). Refuses what [`TpLayout::new`] refuses.
    pub fn new(cfg: &ModelConfig, tp: usize, rank: usize, b: usize, t: usize) -> Result<Self> {
        if b == 0 || t == 0 || t > cfg.seq_len {
            return Err(TrainError::Config {
                field: "seq_len",
                value: format!("batch {b}, length {t}"),
                reason: format!("needs batch >= 1 and length in 1..={}", cfg.seq_len),
            });
        }
        let layout = TpLayout::new(cfg, tp, rank, b, t)?;
        let dims = Dims::new(cfg, b, t);
        let blocks = (0..cfg.layers)
            .map(|_| TpBlock::new(cfg, &layout.whole.block, tp, rank, b, t))
            .collect::<Result<Vec<_>>>()?;
        let rope = match cfg.positions {
            Positions::Rope { theta } => Some(RopeTable::new(cfg.seq_len, cfg.head_dim(), theta)),
            Positions::Learned => None,
        };
        let (n, c, v) = (dims.n, dims.c, dims.v);
        Ok(Self {
            ranges: layout.ranges(),
            norm: Block::new(cfg, layout.whole.block.clone()),
            xs: vec![vec![0.0; n * c]; cfg.layers + 1],
            lnf: vec![0.0; n * c],
            lnf_mean: vec![0.0; n],
            lnf_rstd: vec![0.0; n],
            logits: vec![0.0; n * v],
            losses: vec![0.0; n],
            lse: vec![0.0; n],
            dlnf: vec![0.0; n * c],
            dresid: vec![0.0; n * c],
            tokens: vec![0; n],
            targets: vec![0; n],
            forwarded: false,
            blocks,
            rope,
            dims,
            layout,
        })
    }

    /// The rank's layout.
    pub fn layout(&self) -> &TpLayout {
        &self.layout
    }

    /// The whole model's batch dimensions.
    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    fn check_ids(&self, what: &'static str, ids: &[u32]) -> Result<()> {
        Ok(model::model::check_token_ids(
            what,
            ids,
            self.dims.n,
            self.dims.v,
        )?)
    }

    /// Forward of `tokens` (B·T ids) with this rank's buffer `p` (length `layout.total`);
    /// returns the mean cross-entropy against `targets` (B·T ids), the same on every rank.
    /// Calls `comm` twice per block, on (N, C) buffers. Every rank of the group must call it
    /// with the same tokens.
    pub fn forward<C: TpComm<f32>>(
        &mut self,
        th: &Threads,
        p: &[f32],
        tokens: &[u32],
        targets: &[u32],
        comm: &mut C,
    ) -> Result<f64> {
        check_len("tp rank params", p.len(), self.layout.total)?;
        self.check_ids("tokens", tokens)?;
        self.check_ids("targets", targets)?;
        self.forwarded = false;
        self.tokens.copy_from_slice(tokens);
        self.targets.copy_from_slice(targets);
        let d = &self.dims;
        let r = &self.ranges;
        let wpe = r.wpe.as_ref().map(|w| &p[w.clone()]);
        embed_fwd(
            th,
            &mut self.xs[0],
            &self.tokens,
            &p[r.wte.clone()],
            wpe,
            d.n,
            d.t,
            d.c,
        );
        for (l, block) in self.blocks.iter_mut().enumerate() {
            let (done, rest) = self.xs.split_at_mut(l + 1);
            let pl = &p[self.layout.blocks[l].clone()];
            block.forward(th, pl, self.rope.as_ref(), &done[l], &mut rest[0], comm)?;
        }
        let x = &self.xs[self.blocks.len()];
        self.norm.norm_fwd(
            th,
            d,
            &mut self.lnf,
            &mut self.lnf_mean,
            &mut self.lnf_rstd,
            x,
            p,
            &r.lnf_w,
            &r.lnf_b,
        );
        let hw = &p[r.head_w.clone()];
        matmul_fwd(th, &mut self.logits, &self.lnf, hw, None, d.n, d.c, d.v);
        cross_entropy_fwd(
            th,
            &mut self.losses,
            &mut self.lse,
            &self.logits,
            &self.targets,
            d.n,
            d.v,
        );
        self.forwarded = true;
        Ok(mean_loss(&self.losses))
    }

    /// Backward of the last [`forward`](Self::forward) (same `p`): gradients of the mean loss
    /// accumulate (`+=`) into `g` (length `layout.total`), the replicated tensors' whole and
    /// the same on every rank, the blocks' for this rank's shards. Calls `comm` twice per
    /// block, on (N, C) buffers.
    pub fn backward<C: TpComm<f32>>(
        &mut self,
        th: &Threads,
        p: &[f32],
        g: &mut [f32],
        comm: &mut C,
    ) -> Result<()> {
        check_len("tp rank params", p.len(), self.layout.total)?;
        check_len("tp rank grads", g.len(), self.layout.total)?;
        if !self.forwarded {
            return Err(TrainError::Config {
                field: "tp model",
                value: "backward".into(),
                reason: "backward needs a completed forward first".into(),
            });
        }
        self.forwarded = false;
        let d = self.dims.clone();
        let r = &self.ranges;
        // The head, as Model's: mean cross-entropy, lm_head, final norm.
        let scale = 1.0 / d.n as f32;
        cross_entropy_bwd(
            th,
            &mut self.logits,
            &self.lse,
            &self.targets,
            d.n,
            d.v,
            scale,
        );
        let hw = r.head_w.clone();
        matmul_bwd_input(
            th,
            &mut self.dlnf,
            0.0,
            &self.logits,
            &p[hw.clone()],
            d.n,
            d.c,
            d.v,
        );
        matmul_bwd_weight(th, &mut g[hw], None, &self.logits, &self.lnf, d.n, d.c, d.v);
        self.dresid.fill(0.0);
        let x = &self.xs[self.blocks.len()];
        self.norm.norm_grads(
            th,
            &d,
            g,
            &r.lnf_w,
            &r.lnf_b,
            &mut self.dresid,
            &self.dlnf,
            x,
            p,
            &self.lnf_mean,
            &self.lnf_rstd,
        );
        for (l, block) in self.blocks.iter_mut().enumerate().rev() {
            let range = self.layout.blocks[l].clone();
            block.backward(
                th,
                &p[range.clone()],
                &mut g[range],
                self.rope.as_ref(),
                &self.xs[l],
                &mut self.dresid,
                comm,
            )?;
        }
        let (wte, wpe) = match &r.wpe {
            Some(wpe) => {
                let [a, b] = g
                    .get_disjoint_mut([r.wte.clone(), wpe.clone()])
                    .map_err(|_| TrainError::Config {
                        field: "tp layout",
                        value: format!("{:?} and {wpe:?}", r.wte),
                        reason: "wte and wpe overlap".into(),
                    })?;
                (a, Some(b))
            }
            None => (&mut g[r.wte.clone()], None),
        };
        embed_bwd(th, wte, wpe, &self.dresid, &self.tokens, d.n, d.t, d.c);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_bad_input() {
        let cfg = ModelConfig::gpt2(1, 4, 64, 16, 32);
        assert!(TpLayout::new(&cfg, 3, 0, 1, 8).is_err());
        assert!(TpModel::new(&cfg, 2, 0, 1, 17).is_err());
        let mut m = TpModel::new(&cfg, 1, 0, 1, 8).unwrap();
        let th = Threads::single();
        let p = vec![0f32; m.layout().total];
        let mut g = p.clone();
        let mut solo = super::super::Solo;
        assert!(m.backward(&th, &p, &mut g, &mut solo).is_err());
        let bad = [32u32; 8];
        let ok = [0u32; 8];
        assert!(m.forward(&th, &p, &bad, &ok, &mut solo).is_err());
        assert!(m.forward(&th, &p[1..], &ok, &ok, &mut solo).is_err());
        assert!(m.forward(&th, &p, &ok, &ok, &mut solo).is_ok());
    }
}
