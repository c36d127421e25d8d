//! Where a tensor-parallel rank keeps the whole model (000 §2.15): one flat buffer in the
//! whole model's [`Layout`] order with every block replaced by this rank's shard ([`TpShard`],
//! the same length on every rank):
//!
//! ```text
//! [wte (V, C) | wpe (T, C)] [block 0 shard] … [block L-1 shard] [lnf_w (C) | lnf_b (C) | lm_head (V, C)]
//!  replicated (whole)        sharded, S = shard.local.size each   replicated (whole)
//! ```
//!
//! Parameters, gradients and AdamW moments all use it, so the optimizer is one element-wise
//! pass over `total` elements. The decay ranges and the norm ranges (each element of the
//! whole model counted once over the group) are mapped here.
use std::ops::Range;

use model::config::ModelConfig;
use model::layout::Layout;

use super::shard::{TpShard, check_len};
use crate::error::Result;

/// Where rank `shard.rank` of a `shard.tp`-way group keeps the whole model in its flat buffer
/// (length `total`): the whole [`Layout`]'s order, each block (whole length
/// `whole.block.size`) replaced by its shard (length `shard.local.size`). The embedding
/// ranges are the whole layout's; the head's are shifted down by `L·(whole − shard)` block
/// elements.
#[derive(Clone, Debug)]
pub struct TpLayout {
    /// The whole model's layout (length `whole.total`).
    pub whole: Layout,
    /// This rank's shard of one block (the same plan for every block).
    pub shard: TpShard,
    /// The embeddings `wte` (V, C) and `wpe` (T, C): `0..E`, as in the whole layout.
    pub embed: Range<usize>,
    /// Block `l`'s shard, `shard.local.size` elements each.
    pub blocks: Vec<Range<usize>>,
    /// The final norm and the untied head: the last `whole.total − whole.blocks[L−1].end`
    /// elements.
    pub head: Range<usize>,
    /// Elements of the rank's flat buffer.
    pub total: usize,
}

use crate::zero::replica::intersect;

/// Appends `r` to `out`, merging it with the last range when adjacent.
fn push_merged(out: &mut Vec<Range<usize>>, r: Range<usize>) {
    match out.last_mut() {
        Some(last) if last.end == r.start => last.end = r.end,
        _ => out.push(r),
    }
}

impl TpLayout {
    /// The layout of rank `rank` of `tp` for `cfg` at batch `b`, length `t`. Refuses what
    /// [`TpShard::new`] refuses (`tp` not dividing heads, kv_heads or ffn, named).
    pub fn new(cfg: &ModelConfig, tp: usize, rank: usize, b: usize, t: usize) -> Result<Self> {
        cfg.validate()?;
        let whole = Layout::new(cfg);
        let shard = TpShard::new(cfg, &whole.block, tp, rank, b, t)?;
        let first = whole.unit_range(model::layout::Unit::Embed).end;
        let s = shard.local.size;
        let blocks = (0..cfg.layers)
            .map(|l| first + l * s..first + (l + 1) * s)
            .collect();
        let head_len = whole.total - whole.blocks.last().map_or(first, |b| b.end);
        let head_start = first + cfg.layers * s;
        Ok(Self {
            embed: 0..first,
            blocks,
            head: head_start..head_start + head_len,
            total: head_start + head_len,
            shard,
            whole,
        })
    }

    /// `r` (a range of the whole head) in this rank's buffer.
    fn head_local(&self, r: &Range<usize>) -> Range<usize> {
        let shift = self.whole.total - self.total;
        r.start - shift..r.end - shift
    }

    /// This rank's flat buffer (length `total`) out of the whole model's `whole` (length
    /// `whole.total`).
    pub fn shard_params(&self, whole: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("whole model", whole.len(), self.whole.total)?;
        check_len("tp rank state", out.len(), self.total)?;
        out[self.embed.clone()].copy_from_slice(&whole[self.embed.clone()]);
        for (l, r) in self.blocks.iter().enumerate() {
            self.shard
                .shard(&whole[self.whole.blocks[l].clone()], &mut out[r.clone()])?;
        }
        let wh = self.whole.total - self.head.len()..self.whole.total;
        out[self.head.clone()].copy_from_slice(&whole[wh]);
        Ok(())
    }

    /// Writes rank `self.shard.rank`'s buffer `local` into `whole`: its block shards, and, on
    /// rank 0 only, the replicated tensors (embeddings, head, the blocks' norms and
    /// row-parallel biases). Calling it with every rank's buffer assembles the whole model.
    pub fn unshard_params(&self, local: &[f32], whole: &mut [f32]) -> Result<()> {
        check_len("tp rank state", local.len(), self.total)?;
        check_len("whole model", whole.len(), self.whole.total)?;
        for (l, r) in self.blocks.iter().enumerate() {
            self.shard
                .unshard(&local[r.clone()], &mut whole[self.whole.blocks[l].clone()])?;
        }
        if self.shard.rank == 0 {
            whole[self.embed.clone()].copy_from_slice(&local[self.embed.clone()]);
            let wh = self.whole.total - self.head.len()..self.whole.total;
            whole[wh].copy_from_slice(&local[self.head.clone()]);
        }
        Ok(())
    }

    /// The local ranges that receive weight decay: the whole layout's
    /// [`Layout::decay_ranges`]`(all)` mapped element by element to this rank's buffer (a
    /// shard keeps an element's tensor, so it keeps its decay).
    pub fn decay_ranges(&self, all: bool) -> Result<Vec<Range<usize>>> {
        let decay = self.whole.decay_ranges(all);
        let mut out = Vec::new();
        for d in &decay {
            if let Some(x) = intersect(d, &self.embed) {
                push_merged(&mut out, x);
            }
        }
        for (l, local) in self.blocks.iter().enumerate() {
            let wb = &self.whole.blocks[l];
            let mut mask = vec![false; wb.len()];
            for d in &decay {
                if let Some(x) = intersect(d, wb) {
                    mask[x.start - wb.start..x.end - wb.start].fill(true);
                }
            }
            let mine = self.shard.shard_vec(&mask)?;
            let mut i = 0;
            while i < mine.len() {
                let start = i;
                while i < mine.len() && mine[i] == mine[start] {
                    i += 1;
                }
                if mine[start] {
                    push_merged(&mut out, local.start + start..local.start + i);
                }
            }
        }
        let wh = self.whole.total - self.head.len()..self.whole.total;
        for d in &decay {
            if let Some(x) = intersect(d, &wh) {
                push_merged(&mut out, self.head_local(&x));
            }
        }
        Ok(out)
    }

    /// The local ranges whose gradients this rank counts in the global norm, so that every
    /// element of the whole model is counted exactly once: rank 0 its whole buffer (the
    /// replicated tensors and its shards), the other ranks only their column- and
    /// row-parallel slices (qkv, proj, fc, fcp weights and the qkv and fc biases).
    pub fn norm_ranges(&self) -> Vec<Range<usize>> {
        if self.shard.rank == 0 {
            return vec![Range {
                start: 0,
                end: self.total,
            }];
        }
        let b = &self.shard.local;
        let mut parts: Vec<Range<usize>> = [&b.qkv_w, &b.proj_w, &b.fc_w, &b.fcp_w]
            .into_iter()
            .cloned()
            .chain([&b.qkv_b, &b.fc_b].into_iter().flatten().cloned())
            .collect();
        parts.sort_by_key(|r| r.start);
        let mut out = Vec::new();
        for blk in &self.blocks {
            for p in &parts {
                push_merged(&mut out, blk.start + p.start..blk.start + p.end);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn configs() -> Vec<ModelConfig> {
        vec![
            ModelConfig::gpt2(2, 4, 64, 16, 32),
            ModelConfig::llama(2, 4, 2, 64, 96, 16, 32),
        ]
    }

    #[test]
    fn tp1_layout_is_the_whole_layout() {
        for cfg in configs() {
            let l = TpLayout::new(&cfg, 1, 0, 2, 8).unwrap();
            assert_eq!(l.total, l.whole.total);
            for all in [false, true] {
                assert_eq!(l.decay_ranges(all).unwrap(), l.whole.decay_ranges(all));
            }
            let n = l.norm_ranges();
            assert_eq!((n.len(), n[0].clone()), (1, 0..l.total));
        }
    }

    #[test]
    fn shards_cover_the_model_and_count_each_element_once() {
        for cfg in configs() {
            for tp in [2, 4] {
                if super::super::check_tp(&cfg, tp).is_err() {
                    continue;
                }
                let ls: Vec<TpLayout> = (0..tp)
                    .map(|r| TpLayout::new(&cfg, tp, r, 2, 8).unwrap())
                    .collect();
                let whole: Vec<f32> = (0..ls[0].whole.total).map(|i| i as f32).collect();
                let mut back = vec![-1f32; whole.len()];
                let mut counted = 0;
                for l in &ls {
                    let mut mine = vec![0f32; l.total];
                    l.shard_params(&whole, &mut mine).unwrap();
                    l.unshard_params(&mine, &mut back).unwrap();
                    counted += l.norm_ranges().iter().map(|r| r.len()).sum::<usize>();
                    // A local element decays exactly when its whole element does.
                    let wd = l.whole.decay_ranges(false);
                    let ld = l.decay_ranges(false).unwrap();
                    for (i, &x) in mine.iter().enumerate() {
                        let w = x as usize;
                        let want = wd.iter().any(|r| r.contains(&w));
                        assert_eq!(ld.iter().any(|r| r.contains(&i)), want, "tp {tp} at {i}");
                    }
                }
                assert_eq!(back, whole, "tp {tp}");
                assert_eq!(counted, ls[0].whole.total, "tp {tp}");
            }
        }
    }
}
