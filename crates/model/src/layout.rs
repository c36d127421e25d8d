//! The flat parameter layout: one f32 buffer, described by a table of
//! (name, shape, offset, layer) entries.
//!
//! Order: token embedding, position table, then each block contiguously
//! (so a pipeline stage or a gradient bucket is a contiguous range), then
//! the final norm and, when untied, the LM head. The gradient buffer uses
//! the same layout. Names are Flotilla's own; `interop` maps them to
//! Hugging Face's.
use crate::config::{ModelConfig, Norm, Positions};
use std::ops::Range;

/// What a parameter is, for weight-decay and init policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// A token or position embedding table.
    Embedding,
    /// A linear layer's weight (out, in).
    Matrix,
    /// A linear layer's weight whose output feeds the residual stream
    /// (attention and MLP output projections: GPT-2 scales their init).
    ResidualMatrix,
    /// A bias vector.
    Bias,
    /// A norm's gain.
    NormWeight,
    /// A norm's bias.
    NormBias,
}

/// How a tensor is divided over a tensor-parallel group (000 §2.15, Megatron's column- and
/// row-parallel linears): the sharding spec every shard layout is derived from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    /// Whole on every rank (embeddings, norms, row-parallel biases, the head).
    Replicated,
    /// Column-parallel: the output rows (dim 0) are cut into consecutive runs of these many
    /// rows each (in the whole tensor), and every run is split into `tp` equal parts, rank `r`
    /// keeping part `r` of each run in order. Strided when there are several runs: QKV's
    /// `[q | k | v]` runs (each rank keeps its heads of each, under GQA too), SwiGLU's fused
    /// `[gate | up]` halves.
    Rows(Vec<usize>),
    /// Row-parallel: the input columns (dim 1) split into `tp` equal consecutive parts.
    Cols,
}

/// One parameter tensor inside the flat buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamEntry {
    /// Flotilla's name, e.g. `h.3.attn.qkv.weight`.
    pub name: String,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// The block it belongs to, if any.
    pub layer: Option<usize>,
    /// What it is.
    pub kind: ParamKind,
    /// How tensor parallelism divides it.
    pub split: Split,
    /// The expert it belongs to (its global index), for an expert's tensor: stored only on the
    /// rank of the expert-parallel group holding that expert.
    pub expert: Option<usize>,
}

impl ParamEntry {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Its range in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// Offsets of one block's tensors, relative to the block's first element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockLayout {
    /// attn norm weight (C).
    pub ln1_w: Range<usize>,
    /// attn norm bias (C), LayerNorm with bias only.
    pub ln1_b: Option<Range<usize>>,
    /// fused qkv weight ((H+2K)D, C).
    pub qkv_w: Range<usize>,
    /// qkv bias ((H+2K)D).
    pub qkv_b: Option<Range<usize>>,
    /// attention output weight (C, HD).
    pub proj_w: Range<usize>,
    /// attention output bias (C).
    pub proj_b: Option<Range<usize>>,
    /// MLP norm weight (C).
    pub ln2_w: Range<usize>,
    /// MLP norm bias (C).
    pub ln2_b: Option<Range<usize>>,
    /// first MLP weight (F or 2F, C).
    pub fc_w: Range<usize>,
    /// first MLP bias.
    pub fc_b: Option<Range<usize>>,
    /// MLP output weight (C, F).
    pub fcp_w: Range<usize>,
    /// MLP output bias (C).
    pub fcp_b: Option<Range<usize>>,
    /// With experts in place of the MLP (its four ranges then empty): the MoE layer's buffer,
    /// the router (E, C) then this rank's experts ([`crate::moe::MoeLayout`]).
    pub moe: Option<Range<usize>>,
    /// Elements in one block.
    pub size: usize,
}

/// A unit of the model whose parameters are one contiguous range of the flat
/// buffer and which runs as one step of the forward and backward: what
/// ZeRO-3 gathers before use and frees after (000 "ZeRO 与 FSDP").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Token (and learned position) embeddings.
    Embed,
    /// Transformer block `l`.
    Block(usize),
    /// Final norm and LM head (plus the loss).
    Head,
}

/// The whole model's layout table.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Every tensor, in buffer order.
    pub entries: Vec<ParamEntry>,
    /// Total elements.
    pub total: usize,
    /// Token embedding (V, C).
    pub wte: Range<usize>,
    /// Position table (T, C), learned positions only.
    pub wpe: Option<Range<usize>>,
    /// Absolute range of each block.
    pub blocks: Vec<Range<usize>>,
    /// Per-block relative offsets (identical for every block).
    pub block: BlockLayout,
    /// Final norm weight (C).
    pub lnf_w: Range<usize>,
    /// Final norm bias (C).
    pub lnf_b: Option<Range<usize>>,
    /// LM head (V, C) when untied.
    pub lm_head: Option<Range<usize>>,
}

struct Builder {
    entries: Vec<ParamEntry>,
    at: usize,
    /// The tensor-parallel degree the shapes are divided by (1: whole).
    tp: usize,
    /// The expert the next tensors belong to.
    expert: Option<usize>,
}

impl Builder {
    fn push(
        &mut self,
        name: String,
        shape: Vec<usize>,
        layer: Option<usize>,
        kind: ParamKind,
    ) -> Range<usize> {
        self.push_split(name, shape, layer, kind, Split::Replicated)
    }

    /// Pushes a tensor of whole shape `shape`, stored as one of `tp` shards under `split`.
    fn push_split(
        &mut self,
        name: String,
        mut shape: Vec<usize>,
        layer: Option<usize>,
        kind: ParamKind,
        split: Split,
    ) -> Range<usize> {
        match split {
            Split::Replicated => {}
            Split::Rows(_) => shape[0] /= self.tp,
            Split::Cols => shape[1] /= self.tp,
        }
        let e = ParamEntry {
            name,
            shape,
            offset: self.at,
            layer,
            kind,
            split,
            expert: self.expert,
        };
        let r = e.range();
        self.at = r.end;
        self.entries.push(e);
        r
    }
}

/// Block `l`'s MoE layer ([`crate::moe::MoeLayout`]): the router (E, C), then every expert
/// `e`, `h.{l}.moe.experts.{e}.fc.weight` (Fin, C), `.fc.bias`, `.proj.weight` (C, F),
/// `.proj.bias`. Returns the layer's range.
fn push_experts(b: &mut Builder, m: crate::moe::MoeConfig, l: usize) -> Range<usize> {
    let (c, f, fin) = (m.channels, m.hidden, m.hidden_in());
    let p = |s: String| format!("h.{l}.moe.{s}");
    let start = b.at;
    b.push(
        p("router.weight".into()),
        vec![m.experts, c],
        Some(l),
        ParamKind::Matrix,
    );
    for e in 0..m.experts {
        b.expert = Some(e);
        let x = |s: &str| p(format!("experts.{e}.{s}"));
        b.push(x("fc.weight"), vec![fin, c], Some(l), ParamKind::Matrix);
        if m.bias {
            b.push(x("fc.bias"), vec![fin], Some(l), ParamKind::Bias);
        }
        b.push(
            x("proj.weight"),
            vec![c, f],
            Some(l),
            ParamKind::ResidualMatrix,
        );
        if m.bias {
            b.push(x("proj.bias"), vec![c], Some(l), ParamKind::Bias);
        }
    }
    b.expert = None;
    start..b.at
}

/// `r` relative to `base` (an empty range, a block's missing MLP, stays `0..0`).
fn rel(r: Range<usize>, base: usize) -> Range<usize> {
    if r.is_empty() {
        return 0..0;
    }
    r.start - base..r.end - base
}

impl Layout {
    /// The layout of `cfg` (which must have been validated).
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::build(cfg, 1)
    }

    /// The layout of one rank of a `tp`-way tensor-parallel group: the whole layout's table
    /// with every split tensor stored as its shard ([`ParamEntry::split`]), the same shape and
    /// offsets on every rank; `Layout::split(cfg, 1)` is [`Layout::new`]. Refuses `tp` not
    /// dividing heads, kv_heads or ffn ([`ModelConfig::check_split`]).
    pub fn split(cfg: &ModelConfig, tp: usize) -> crate::error::Result<Self> {
        cfg.validate()?;
        cfg.check_split(tp)?;
        Ok(Self::build(cfg, tp))
    }

    fn build(cfg: &ModelConfig, tp: usize) -> Self {
        let (c, v) = (cfg.d_model, cfg.vocab);
        let layer_norm_bias = cfg.bias && cfg.norm == Norm::LayerNorm;
        let mut b = Builder {
            entries: Vec::new(),
            at: 0,
            tp,
            expert: None,
        };
        let hd = cfg.heads * cfg.head_dim();
        let kvd = cfg.kv_heads * cfg.head_dim();
        let qkv_runs = Split::Rows(vec![hd, kvd, kvd]);
        let fc_runs = Split::Rows(if cfg.activation == crate::config::Activation::SwiGlu {
            vec![cfg.ffn, cfg.ffn]
        } else {
            vec![cfg.ffn]
        });
        let wte = b.push("wte".into(), vec![v, c], None, ParamKind::Embedding);
        let wpe = (cfg.positions == Positions::Learned).then(|| {
            b.push(
                "wpe".into(),
                vec![cfg.seq_len, c],
                None,
                ParamKind::Embedding,
            )
        });
        let mut blocks = Vec::new();
        let mut block = None;
        for l in 0..cfg.layers {
            let base = b.at;
            let p = |s: &str| format!("h.{l}.{s}");
            let ln1_w = b.push(p("ln1.weight"), vec![c], Some(l), ParamKind::NormWeight);
            let ln1_b = layer_norm_bias
                .then(|| b.push(p("ln1.bias"), vec![c], Some(l), ParamKind::NormBias));
            let qkv_w = b.push_split(
                p("attn.qkv.weight"),
                vec![cfg.qkv_dim(), c],
                Some(l),
                ParamKind::Matrix,
                qkv_runs.clone(),
            );
            let qkv_b = cfg.bias.then(|| {
                b.push_split(
                    p("attn.qkv.bias"),
                    vec![cfg.qkv_dim()],
                    Some(l),
                    ParamKind::Bias,
                    qkv_runs.clone(),
                )
            });
            let proj_w = b.push_split(
                p("attn.proj.weight"),
                vec![c, hd],
                Some(l),
                ParamKind::ResidualMatrix,
                Split::Cols,
            );
            let proj_b = cfg
                .bias
                .then(|| b.push(p("attn.proj.bias"), vec![c], Some(l), ParamKind::Bias));
            let ln2_w = b.push(p("ln2.weight"), vec![c], Some(l), ParamKind::NormWeight);
            let ln2_b = layer_norm_bias
                .then(|| b.push(p("ln2.bias"), vec![c], Some(l), ParamKind::NormBias));
            let (fc_w, fc_b, fcp_w, fcp_b, moe) = match cfg.moe_layer() {
                Some(m) => (0..0, None, 0..0, None, Some(push_experts(&mut b, m, l))),
                None => {
                    let fc_w = b.push_split(
                        p("mlp.fc.weight"),
                        vec![cfg.ffn_in_dim(), c],
                        Some(l),
                        ParamKind::Matrix,
                        fc_runs.clone(),
                    );
                    let fc_b = cfg.bias.then(|| {
                        b.push_split(
                            p("mlp.fc.bias"),
                            vec![cfg.ffn_in_dim()],
                            Some(l),
                            ParamKind::Bias,
                            fc_runs.clone(),
                        )
                    });
                    let fcp_w = b.push_split(
                        p("mlp.proj.weight"),
                        vec![c, cfg.ffn],
                        Some(l),
                        ParamKind::ResidualMatrix,
                        Split::Cols,
                    );
                    let fcp_b = cfg
                        .bias
                        .then(|| b.push(p("mlp.proj.bias"), vec![c], Some(l), ParamKind::Bias));
                    (fc_w, fc_b, fcp_w, fcp_b, None)
                }
            };
            blocks.push(base..b.at);
            if block.is_none() {
                let r = |x: Range<usize>| rel(x, base);
                block = Some(BlockLayout {
                    ln1_w: r(ln1_w),
                    ln1_b: ln1_b.map(r),
                    qkv_w: r(qkv_w),
                    qkv_b: qkv_b.map(r),
                    proj_w: r(proj_w),
                    proj_b: proj_b.map(r),
                    ln2_w: r(ln2_w),
                    ln2_b: ln2_b.map(r),
                    fc_w: r(fc_w),
                    fc_b: fc_b.map(r),
                    fcp_w: r(fcp_w),
                    fcp_b: fcp_b.map(r),
                    moe: moe.map(r),
                    size: b.at - base,
                });
            }
        }
        let lnf_w = b.push("ln_f.weight".into(), vec![c], None, ParamKind::NormWeight);
        let lnf_b =
            layer_norm_bias.then(|| b.push("ln_f.bias".into(), vec![c], None, ParamKind::NormBias));
        let lm_head = (!cfg.tied_embeddings)
            .then(|| b.push("lm_head.weight".into(), vec![v, c], None, ParamKind::Matrix));
        Layout {
            total: b.at,
            entries: b.entries,
            wte,
            wpe,
            blocks,
            block: block.expect("validated config has at least one layer"),
            lnf_w,
            lnf_b,
            lm_head,
        }
    }

    /// This split layout's tensors at the addresses of `whole` (the layout it splits): each
    /// block's shard at the start of its block's range, every other tensor where `whole` has
    /// it; the rest of each block's range is unused. A buffer in the whole model's coordinates
    /// that holds a rank's shards (a tensor-parallel pipeline stage's) is read through it.
    pub fn placed_in(&self, whole: &Layout) -> Layout {
        let mut entries = self.entries.clone();
        for e in &mut entries {
            e.offset = match e.layer {
                Some(l) => whole.blocks[l].start + (e.offset - self.blocks[l].start),
                None => whole.get(&e.name).map_or(e.offset, |w| w.offset),
            };
        }
        // The embeddings, final norm and head are whole in both: the whole layout's ranges.
        Layout {
            wte: whole.wte.clone(),
            wpe: whole.wpe.clone(),
            blocks: (0..self.blocks.len())
                .map(|l| whole.blocks[l].start..whole.blocks[l].start + self.block.size)
                .collect(),
            block: self.block.clone(),
            lnf_w: whole.lnf_w.clone(),
            lnf_b: whole.lnf_b.clone(),
            lm_head: whole.lm_head.clone(),
            total: whole.total,
            entries,
        }
    }

    /// The experts' tensors: every block's experts (not its router), adjacent ranges merged.
    /// Rank r of an expert-parallel group owns only its experts' parts of them; the rest stay
    /// zero on it.
    pub fn expert_ranges(&self) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::new();
        for e in self.entries.iter().filter(|e| e.expert.is_some()) {
            match out.last_mut() {
                Some(last) if last.end == e.offset => last.end = e.range().end,
                _ => out.push(e.range()),
            }
        }
        out
    }

    /// The ranges of the experts rank `rank` of an `ep`-way group owns (adjacent merged).
    pub fn owned_expert_ranges(&self, ep: usize, rank: usize) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::new();
        let owns = |x: usize| match self.experts() {
            Some(n) => x / (n / ep.max(1)).max(1) == rank,
            None => false,
        };
        for e in self.entries.iter().filter(|e| e.expert.is_some_and(owns)) {
            match out.last_mut() {
                Some(last) if last.end == e.offset => last.end = e.range().end,
                _ => out.push(e.range()),
            }
        }
        out
    }

    /// Experts per block (None: a dense model).
    pub fn experts(&self) -> Option<usize> {
        self.entries
            .iter()
            .filter_map(|e| e.expert)
            .max()
            .map(|e| e + 1)
    }

    /// The entry called `name`.
    pub fn get(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Ranges that receive weight decay: matrices and embeddings
    /// (`all = false`, the GPT-2/nanoGPT convention) or every tensor
    /// (`all = true`, what `torch.optim.AdamW(model.parameters())` does).
    /// Adjacent ranges are merged.
    pub fn decay_ranges(&self, all: bool) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::new();
        for e in &self.entries {
            let decays = all
                || matches!(
                    e.kind,
                    ParamKind::Embedding | ParamKind::Matrix | ParamKind::ResidualMatrix
                );
            if !decays {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.end == e.offset => last.end = e.range().end,
                _ => out.push(e.range()),
            }
        }
        out
    }

    /// The contiguous range of `unit`'s parameters.
    pub fn unit_range(&self, unit: Unit) -> Range<usize> {
        let first = self.blocks.first().map_or(self.total, |b| b.start);
        match unit {
            Unit::Embed => 0..first,
            Unit::Block(l) => self.blocks[l].clone(),
            Unit::Head => self.blocks.last().map_or(first, |b| b.end)..self.total,
        }
    }

    /// Every unit in forward order: the embeddings, the blocks, the head.
    pub fn units(&self) -> Vec<Unit> {
        let mut out = Vec::with_capacity(self.blocks.len() + 2);
        out.push(Unit::Embed);
        out.extend((0..self.blocks.len()).map(Unit::Block));
        out.push(Unit::Head);
        out
    }

    /// Whether the head reads the token embedding (tied weights), so the
    /// [`Unit::Head`] also needs [`Unit::Embed`]'s parameters.
    pub fn head_reads_embed(&self) -> bool {
        self.lm_head.is_none()
    }

    /// The range holding the layers `first..last` (a pipeline stage's blocks).
    pub fn layers_range(&self, layers: Range<usize>) -> Range<usize> {
        if layers.is_empty() {
            return 0..0;
        }
        self.blocks[layers.start].start..self.blocks[layers.end - 1].end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_tiny_has_the_peers_parameter_count() {
        // ddp_gpt_bench.py prints "5.32M unique" for tiny and "13.89M" for small.
        let l = Layout::new(&ModelConfig::preset("tiny").unwrap());
        assert_eq!(l.total, 5_322_240); // 5.32M
        let l = Layout::new(&ModelConfig::preset("small").unwrap());
        assert_eq!((l.total as f64 / 1e6 * 100.0).round() / 100.0, 13.89);
    }

    #[test]
    fn entries_tile_the_buffer() {
        for p in ModelConfig::PRESETS {
            let l = Layout::new(&ModelConfig::preset(p).unwrap());
            let mut at = 0;
            for e in &l.entries {
                assert_eq!(e.offset, at, "{}", e.name);
                at += e.numel();
            }
            assert_eq!(at, l.total);
            for (i, b) in l.blocks.iter().enumerate() {
                assert_eq!(b.len(), l.block.size, "block {i}");
            }
        }
    }
}
