//! A whole decoder on one tensor-parallel rank (000 §2.15, F46–F47): the model crate's one
//! [`Model`], split ([`Model::split`]): the embeddings and the head replicated, every block
//! stored as this rank's shard and run by the one block with the group as its
//! [`BlockComm`], the residual stream whole.
//!
//! ```text
//! tokens ── embed (whole, replicated) ── x0 ── block 0 shard ── x1 ── … ── xL ── norm ── lm_head ── CE
//!                                            (4 all-reduces of (N, C) per block, F46)
//! ```
//!
//! - Flat state. A rank's parameters (and gradients, and AdamW moments) are one flat buffer:
//!   the whole model's [`Layout`](model::layout::Layout) order with every block replaced by
//!   this rank's shard ([`model::layout::Layout::split`], the same length on every rank),
//!   `[wte | wpe] [block 0 shard] … [block L-1 shard] [lnf_w | lnf_b | lm_head]`. See
//!   [`TpLayout`] for its mapping to and from the whole model.
//! - Replication. The embeddings, the final norm and the LM head are whole on every rank and
//!   computed from identical whole tensors (the residual stream after each block's all-reduce
//!   is the same on every rank), so their gradients are identical on every rank with no
//!   communication. This is the simplest split, not Megatron's vocabulary-parallel embedding
//!   and cross-entropy (each rank V/t rows of `wte`): that is a later step. It costs every rank
//!   the whole `V·C` (twice untied) instead of `V·C/t`.
//! - Recompute. With it, each block keeps only its output and is run forward again, its two
//!   sums included, during the backward (as Megatron's full recomputation does).
use model::block::BlockComm;
use model::config::ModelConfig;
use model::model::Model;
use model::threads::Threads;

use super::layout::TpLayout;
use super::shard::check_len;
use crate::error::{Result, TrainError};

/// One rank's decoder at batch `b`, length `t` (N = B·T rows): the split [`Model`] with its
/// activation arena, and where its buffer sits in the whole model ([`TpLayout`]).
pub struct TpModel {
    layout: TpLayout,
    model: Model<f32>,
}

impl TpModel {
    /// Rank `rank` of a `tp`-way group for `cfg` at batch `b`, length `t` (at most
    /// `cfg.seq_len`), every block recomputed in the backward when `recompute`. Refuses what
    /// [`TpLayout::new`] and [`Model::split`] refuse.
    pub fn new(
        cfg: &ModelConfig,
        tp: usize,
        rank: usize,
        b: usize,
        t: usize,
        recompute: bool,
    ) -> Result<Self> {
        if b == 0 || t == 0 || t > cfg.seq_len {
            return Err(TrainError::Config {
                field: "seq_len",
                value: format!("batch {b}, length {t}"),
                reason: format!("needs batch >= 1 and length in 1..={}", cfg.seq_len),
            });
        }
        let layout = TpLayout::new(cfg, tp, rank, b, t)?;
        let model = Model::split(cfg, b, t, vec![recompute; cfg.layers], tp)?;
        Ok(Self { layout, model })
    }

    /// The rank's layout.
    pub fn layout(&self) -> &TpLayout {
        &self.layout
    }

    /// Bytes of activations this rank holds (the arena and the backward scratch).
    pub fn activation_bytes(&self) -> usize {
        self.model.activation_bytes()
    }

    /// Forward of `tokens` (B·T ids) with this rank's buffer `p` (length `layout.total`);
    /// returns the mean cross-entropy against `targets` (B·T ids), the same on every rank.
    /// Calls `comm` twice per block, on (N, C) buffers. Every rank of the group must call it
    /// with the same tokens.
    pub fn forward<C: BlockComm<f32>>(
        &mut self,
        th: &Threads,
        p: &[f32],
        tokens: &[u32],
        targets: &[u32],
        comm: &mut C,
    ) -> Result<f64> {
        check_len("tp rank params", p.len(), self.layout.total)?;
        let loss = self
            .model
            .forward_with(th, p, tokens, Some(targets), comm)?;
        loss.ok_or(TrainError::Config {
            field: "tp model",
            value: "forward".into(),
            reason: "a forward with targets gives a loss".into(),
        })
    }

    /// Backward of the last [`forward`](Self::forward) (same `p`): gradients of the mean loss
    /// accumulate (`+=`) into `g` (length `layout.total`), the replicated tensors' whole and
    /// the same on every rank, the blocks' for this rank's shards. Calls `comm` twice per
    /// block (four with recompute), on (N, C) buffers.
    pub fn backward<C: BlockComm<f32>>(
        &mut self,
        th: &Threads,
        p: &[f32],
        g: &mut [f32],
        comm: &mut C,
    ) -> Result<()> {
        check_len("tp rank params", p.len(), self.layout.total)?;
        check_len("tp rank grads", g.len(), self.layout.total)?;
        Ok(self
            .model
            .backward_hooked_with(th, p, g, &mut |_, _| {}, comm)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::block::Alone;

    #[test]
    fn refuses_bad_input() {
        let cfg = ModelConfig::gpt2(1, 4, 64, 16, 32);
        assert!(TpLayout::new(&cfg, 3, 0, 1, 8).is_err());
        assert!(TpModel::new(&cfg, 2, 0, 1, 17, false).is_err());
        let mut m = TpModel::new(&cfg, 1, 0, 1, 8, false).unwrap();
        let th = Threads::single();
        let p = vec![0f32; m.layout().total];
        let mut g = p.clone();
        assert!(m.backward(&th, &p, &mut g, &mut Alone).is_err());
        let bad = [32u32; 8];
        let ok = [0u32; 8];
        assert!(m.forward(&th, &p, &bad, &ok, &mut Alone).is_err());
        assert!(m.forward(&th, &p[1..], &ok, &ok, &mut Alone).is_err());
        assert!(m.forward(&th, &p, &ok, &ok, &mut Alone).is_ok());
    }

    /// The split model's local layout is the tensor-parallel layout's: one table
    /// ([`model::layout::Layout::split`]) describes the buffer both address.
    #[test]
    fn the_split_layout_is_the_shard_layout() {
        let mut llama = ModelConfig::gpt2(2, 8, 64, 16, 32);
        llama.kv_heads = 4;
        llama.activation = model::config::Activation::SwiGlu;
        llama.norm = model::config::Norm::RmsNorm;
        llama.bias = false;
        for cfg in [ModelConfig::gpt2(2, 4, 64, 16, 32), llama] {
            for tp in [1, 2, 4] {
                let m = TpModel::new(&cfg, tp, tp - 1, 1, 8, false).unwrap();
                let split = model::layout::Layout::split(&cfg, tp).unwrap();
                assert_eq!(m.layout().shard.local, split.block, "tp {tp}");
                assert_eq!(m.layout().total, split.total, "tp {tp}");
                assert_eq!(m.layout().blocks, split.blocks, "tp {tp}");
            }
        }
    }
}
