//! The MoE decoder's flat parameter layout on one EP rank, its ep = 1 form (gather,
//! shard) and its initialisation (000 "专家并行（混合专家模型）", F49-F50).
//!
//! One rank's buffer is `[dense | moe 0 | … | moe L-1]`: the dense part (`wte (V, C)`,
//! `wpe (T, C)`, per layer `ln1 w|b (C)`, `qkv w (3C, C)|b (3C)`, `proj w (C, C)|b (C)`,
//! `ln2 w|b (C)`, then `lnf w|b (C)` and `lm_head (V, C)`) is the same on every rank and
//! replicated; each `moe l` is that layer's [`MoeLayout`] for this rank (the replicated
//! router, then this rank's El experts). Keeping the dense part first makes its gradient
//! all-reduce one contiguous buffer.
use crate::error::Result;
use crate::expert::{MoeConfig, MoeLayout, bad, check_len};
use model::rng::Rng;
use std::ops::Range;

/// Shape of the decoder; the MoE settings carry C (`moe.channels`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeModelConfig {
    /// V, the vocabulary, >= 1.
    pub vocab: usize,
    /// Longest sequence (rows of `wpe`), >= 1.
    pub seq_len: usize,
    /// L, blocks, >= 1.
    pub layers: usize,
    /// H, attention heads, dividing C.
    pub heads: usize,
    /// Every block's MoE feed-forward (C = `channels`, the model width).
    pub moe: MoeConfig,
    /// LayerNorm epsilon, finite and > 0.
    pub norm_eps: f64,
}

impl MoeModelConfig {
    /// Check every field, naming the first bad one.
    pub fn validate(&self) -> Result<()> {
        self.moe.validate()?;
        for (field, v) in [
            ("vocab", self.vocab),
            ("seq_len", self.seq_len),
            ("layers", self.layers),
            ("heads", self.heads),
        ] {
            if v == 0 {
                return Err(bad(field, v, "must be >= 1"));
            }
        }
        if !self.moe.channels.is_multiple_of(self.heads) {
            return Err(bad(
                "heads",
                self.heads,
                format!("must divide channels ({})", self.moe.channels),
            ));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(bad("norm_eps", self.norm_eps, "must be finite and > 0"));
        }
        Ok(())
    }
}

/// A linear's weight (oc, c) at `at`, its bias (oc) right after it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Lin {
    /// First element of the weight.
    pub at: usize,
    /// Output features.
    pub oc: usize,
    /// Input features.
    pub c: usize,
}

impl Lin {
    /// The weight's elements.
    pub fn w(&self) -> Range<usize> {
        self.at..self.at + self.oc * self.c
    }
    /// The bias's elements.
    pub fn b(&self) -> Range<usize> {
        self.w().end..self.w().end + self.oc
    }
    /// Weight and bias.
    pub fn all(&self) -> Range<usize> {
        self.at..self.b().end
    }
}

/// One block's dense tensors (absolute offsets): two LayerNorms (weight (C) then bias (C),
/// a [`Lin`] with `c` = 1) and the attention's two linears.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockRanges {
    /// Attention norm.
    pub ln1: Lin,
    /// Fused q|k|v (3C, C) + (3C).
    pub qkv: Lin,
    /// Attention output (C, C) + (C).
    pub proj: Lin,
    /// MoE norm.
    pub ln2: Lin,
    /// This rank's MoE buffer (router, El experts).
    pub moe: Range<usize>,
}

/// Where everything lies in one rank's flat buffer (see the module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeModelLayout {
    /// The model.
    pub cfg: MoeModelConfig,
    /// This rank's MoE layout (the same for every layer).
    pub moe: MoeLayout,
    /// Token embedding (V, C).
    pub wte: Range<usize>,
    /// Position embedding (seq_len, C).
    pub wpe: Range<usize>,
    /// The blocks.
    pub blocks: Vec<BlockRanges>,
    /// Final norm.
    pub lnf: Lin,
    /// LM head (V, C), no bias.
    pub head: Range<usize>,
    /// The replicated, data-parallel part: `0..dense`.
    pub dense: usize,
    /// Elements on this rank.
    pub total: usize,
}

impl MoeModelLayout {
    /// Rank `rank` of an `ep`-way group; refuses what [`MoeModelConfig::validate`] and
    /// [`MoeLayout::new`] refuse (`experts` when ep does not divide E).
    pub fn new(cfg: MoeModelConfig, ep: usize, rank: usize) -> Result<Self> {
        cfg.validate()?;
        let moe = MoeLayout::new(cfg.moe, ep, rank)?;
        let (c, v) = (cfg.moe.channels, cfg.vocab);
        let wte = 0..v * c;
        let wpe = wte.end..wte.end + cfg.seq_len * c;
        let mut at = wpe.end;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            let mut next = |oc: usize, ic: usize| {
                let l = Lin { at, oc, c: ic };
                at = l.b().end;
                l
            };
            blocks.push(BlockRanges {
                ln1: next(c, 1),
                qkv: next(3 * c, c),
                proj: next(c, c),
                ln2: next(c, 1),
                moe: 0..0,
            });
        }
        let lnf = Lin { at, oc: c, c: 1 };
        let head = lnf.b().end..lnf.b().end + v * c;
        let dense = head.end;
        at = dense;
        for b in &mut blocks {
            b.moe = at..at + moe.len();
            at = b.moe.end;
        }
        Ok(Self {
            cfg,
            moe,
            wte,
            wpe,
            blocks,
            lnf,
            head,
            dense,
            total: at,
        })
    }

    /// Block `b`'s router (E, C), absolute.
    pub fn router(&self, b: &BlockRanges) -> Range<usize> {
        b.moe.start..b.moe.start + self.moe.router().end
    }

    /// Block `b`'s local expert `le` (0..El), absolute.
    pub fn expert(&self, b: &BlockRanges, le: usize) -> Range<usize> {
        let r = self.moe.expert(le);
        b.moe.start + r.start..b.moe.start + r.end
    }

    /// The fc and fcp weights of block `b`'s local expert `le`, absolute.
    fn expert_matrices(&self, b: &BlockRanges, le: usize) -> [Range<usize>; 2] {
        let (at, ex) = (self.expert(b, le).start, self.moe.expert_params());
        [ex.fc_w, ex.fcp_w].map(|r| at + r.start..at + r.end)
    }

    /// Ranges AdamW decays: the embeddings, the attention and head matrices, every router
    /// and expert matrix (not biases or norms), as [`model::layout`]'s default policy.
    pub fn decay_ranges(&self) -> Vec<Range<usize>> {
        let mut out = vec![self.wte.clone(), self.wpe.clone(), self.head.clone()];
        for b in &self.blocks {
            out.extend([b.qkv.w(), b.proj.w(), self.router(b)]);
            for le in 0..self.moe.local_experts() {
                out.extend(self.expert_matrices(b, le));
            }
        }
        out
    }

    /// This rank's buffer cut from the ep = 1 buffer `full`.
    pub fn shard(&self, full: &[f32]) -> Result<Vec<f32>> {
        let whole = Self::new(self.cfg, 1, 0)?;
        check_len("full moe model parameters", whole.total, full.len())?;
        let mut out = full[..self.dense].to_vec();
        for b in &whole.blocks {
            out.extend(self.moe.shard(&full[b.moe.clone()])?);
        }
        Ok(out)
    }

    /// The ep = 1 buffer from every rank's buffer (rank order): the dense part and the
    /// routers from rank 0, each layer's experts from their owners.
    pub fn gather(cfg: MoeModelConfig, shards: &[Vec<f32>]) -> Result<Vec<f32>> {
        let ep = shards.len();
        let layouts = (0..ep)
            .map(|r| Self::new(cfg, ep, r))
            .collect::<Result<Vec<_>>>()?;
        for (l, s) in layouts.iter().zip(shards) {
            check_len("moe model shard", l.total, s.len())?;
        }
        let mut out = shards[0][..layouts[0].dense].to_vec();
        for i in 0..cfg.layers {
            let parts: Vec<Vec<f32>> = layouts
                .iter()
                .zip(shards)
                .map(|(l, s)| s[l.blocks[i].moe.clone()].to_vec())
                .collect();
            out.extend(MoeLayout::gather(cfg.moe, &parts)?);
        }
        Ok(out)
    }

    /// The ep = 1 initial buffer of `seed`: normal(0, 0.02) matrices and embeddings, the
    /// residual-feeding ones (attention proj, expert fcp) scaled by 1/√(2L) as GPT-2 does,
    /// norm weights 1, biases 0. Every EP degree shards this one buffer, so all start equal.
    pub fn init_whole(cfg: MoeModelConfig, seed: u64) -> Result<Vec<f32>> {
        let l = Self::new(cfg, 1, 0)?;
        let mut p = vec![0f32; l.total];
        let mut rng = Rng::new(seed);
        let resid = 0.02 / (2.0 * cfg.layers as f64).sqrt();
        let mut normal = |r: Range<usize>, std: f64| {
            for x in &mut p[r] {
                *x = (rng.normal() * std) as f32;
            }
        };
        normal(l.wte.clone(), 0.02);
        normal(l.wpe.clone(), 0.02);
        for b in &l.blocks {
            normal(b.qkv.w(), 0.02);
            normal(b.proj.w(), resid);
            normal(l.router(b), 0.02);
            for e in 0..cfg.moe.experts {
                let [fc, fcp] = l.expert_matrices(b, e);
                normal(fc, 0.02);
                normal(fcp, resid);
            }
        }
        normal(l.head.clone(), 0.02);
        for n in l.blocks.iter().flat_map(|b| [b.ln1, b.ln2]).chain([l.lnf]) {
            p[n.w()].fill(1.0);
        }
        Ok(p)
    }
}
