//! Decoder-only transformer configurations (GPT-2 and Llama families).
use crate::error::{ModelError, Result};

/// Which normalisation a block uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    /// LayerNorm with weight and (if `bias`) bias: GPT-2.
    LayerNorm,
    /// RMSNorm with weight only: Llama.
    RmsNorm,
}

/// The feed-forward nonlinearity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// Exact GELU (erf), PyTorch's `F.gelu` default.
    Gelu,
    /// GELU's tanh approximation (GPT-2's "gelu_new").
    GeluTanh,
    /// SwiGLU: `silu(x W_gate) * (x W_up)`, Llama.
    SwiGlu,
}

/// How positions enter the model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Positions {
    /// A learned (seq_len, d_model) table added to the token embedding.
    Learned,
    /// Rotary embeddings on queries and keys with base `theta`.
    Rope {
        /// The rotary base (10000 in Llama 2).
        theta: f64,
    },
}

/// A mixture-of-experts feed-forward in every block (000 专家并行): E experts, each the block's
/// MLP (`ffn` wide, the block's activation and biases), of which a router sends each token to
/// `top_k`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeSpec {
    /// E, experts per block.
    pub experts: usize,
    /// k, experts per token: 1 or 2.
    pub top_k: usize,
    /// Capacity factor: per-expert capacity ⌈factor · N · k / E⌉ over the routing group (F49).
    pub capacity_factor: f64,
    /// Weight of the load-balancing loss in the objective.
    pub aux_weight: f64,
}

/// A decoder configuration; [`ModelConfig::validate`] names any bad field.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Number of transformer blocks (L).
    pub layers: usize,
    /// Model width (C).
    pub d_model: usize,
    /// Query heads (H).
    pub heads: usize,
    /// Key/value heads (K); H must be a multiple of K (grouped-query attention).
    pub kv_heads: usize,
    /// Feed-forward hidden width (F).
    pub ffn: usize,
    /// Vocabulary size (V).
    pub vocab: usize,
    /// Maximum sequence length (T).
    pub seq_len: usize,
    /// Normalisation.
    pub norm: Norm,
    /// Feed-forward nonlinearity.
    pub activation: Activation,
    /// Position scheme.
    pub positions: Positions,
    /// Whether the LM head reuses the token embedding.
    pub tied_embeddings: bool,
    /// Whether linears and norms carry biases.
    pub bias: bool,
    /// Epsilon inside the norms.
    pub norm_eps: f64,
    /// Dropout probability; only 0 is supported (training is deterministic).
    pub dropout: f64,
    /// A mixture-of-experts feed-forward in place of every block's MLP (None: dense).
    pub moe: Option<MoeSpec>,
}

impl ModelConfig {
    /// A GPT-2-style config: LayerNorm, exact GELU, learned positions, tied
    /// embeddings, biases, F = 4C (the layout of `../shared/peers/ddp_gpt_bench.py`).
    pub fn gpt2(layers: usize, heads: usize, d_model: usize, seq_len: usize, vocab: usize) -> Self {
        Self {
            layers,
            d_model,
            heads,
            kv_heads: heads,
            ffn: 4 * d_model,
            vocab,
            seq_len,
            norm: Norm::LayerNorm,
            activation: Activation::Gelu,
            positions: Positions::Learned,
            tied_embeddings: true,
            bias: true,
            norm_eps: 1e-5,
            dropout: 0.0,
            moe: None,
        }
    }

    /// A Llama-style config: RMSNorm, SwiGLU, rotary positions, no biases,
    /// untied head.
    #[allow(clippy::too_many_arguments)]
    pub fn llama(
        layers: usize,
        heads: usize,
        kv_heads: usize,
        d_model: usize,
        ffn: usize,
        seq_len: usize,
        vocab: usize,
    ) -> Self {
        Self {
            layers,
            d_model,
            heads,
            kv_heads,
            ffn,
            vocab,
            seq_len,
            norm: Norm::RmsNorm,
            activation: Activation::SwiGlu,
            positions: Positions::Rope { theta: 10_000.0 },
            tied_embeddings: false,
            bias: false,
            norm_eps: 1e-5,
            dropout: 0.0,
            moe: None,
        }
    }

    /// Named presets: `tiny` and `small` match the peer benchmark's configs;
    /// `gpt2` is GPT-2 small (124M); `llama-tiny` is a small Llama layout.
    pub fn preset(name: &str) -> Result<Self> {
        Ok(match name {
            "tiny" => Self::gpt2(4, 4, 256, 256, 8192),
            "small" => Self::gpt2(6, 6, 384, 256, 8192),
            "gpt2" => {
                let mut c = Self::gpt2(12, 12, 768, 1024, 50257);
                c.activation = Activation::GeluTanh;
                c
            }
            "llama-tiny" => Self::llama(4, 8, 2, 256, 688, 256, 8192),
            other => {
                return Err(ModelError::Config {
                    field: "preset",
                    value: other.to_string(),
                    reason: format!("unknown preset; known: {}", Self::PRESETS.join(", ")),
                });
            }
        })
    }

    /// The preset names [`ModelConfig::preset`] accepts.
    pub const PRESETS: &'static [&'static str] = &["tiny", "small", "gpt2", "llama-tiny"];

    /// Check every field; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, value: String, reason: &str| {
            Err(ModelError::Config {
                field,
                value,
                reason: reason.to_string(),
            })
        };
        if self.layers == 0 {
            return bad("layers", "0".into(), "need at least one block");
        }
        if self.d_model == 0 {
            return bad("d_model", "0".into(), "must be positive");
        }
        if self.heads == 0 {
            return bad("heads", "0".into(), "must be positive");
        }
        if !self.d_model.is_multiple_of(self.heads) {
            return bad(
                "heads",
                self.heads.to_string(),
                &format!(
                    "must divide d_model ({} % {} = {})",
                    self.d_model,
                    self.heads,
                    self.d_model % self.heads
                ),
            );
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return bad(
                "kv_heads",
                self.kv_heads.to_string(),
                &format!("must be positive and divide heads ({})", self.heads),
            );
        }
        if matches!(self.positions, Positions::Rope { .. }) && !self.head_dim().is_multiple_of(2) {
            return bad(
                "heads",
                self.heads.to_string(),
                "rotary positions need an even head dim (d_model / heads)",
            );
        }
        if let Positions::Rope { theta } = self.positions
            && !(theta.is_finite() && theta > 1.0)
        {
            return bad("rope_theta", theta.to_string(), "must be finite and > 1");
        }
        if self.ffn == 0 {
            return bad("ffn", "0".into(), "must be positive");
        }
        if self.vocab == 0 {
            return bad("vocab", "0".into(), "the vocabulary is empty");
        }
        if self.vocab > u32::MAX as usize {
            return bad("vocab", self.vocab.to_string(), "token ids are u32");
        }
        if self.seq_len == 0 {
            return bad("seq_len", "0".into(), "must be positive");
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return bad(
                "norm_eps",
                self.norm_eps.to_string(),
                "must be finite and positive",
            );
        }
        if self.dropout != 0.0 {
            return bad(
                "dropout",
                self.dropout.to_string(),
                "only 0 is supported (training is deterministic)",
            );
        }
        if let Some(m) = self.moe_layer() {
            m.validate()?;
        }
        Ok(())
    }

    /// The MoE layer every block runs as its feed-forward (None: a dense MLP): the spec's
    /// routing with experts `d_model` wide in and out, `ffn` hidden, the block's activation and
    /// biases.
    pub fn moe_layer(&self) -> Option<crate::moe::MoeConfig> {
        self.moe.map(|m| crate::moe::MoeConfig {
            experts: m.experts,
            top_k: m.top_k,
            channels: self.d_model,
            hidden: self.ffn,
            capacity_factor: m.capacity_factor,
            aux_weight: m.aux_weight,
            activation: self.activation,
            bias: self.bias,
        })
    }

    /// Checks that the blocks split into `tp` equal tensor-parallel shards (000 §2.15: whole
    /// heads per rank): `tp ≥ 1` dividing `heads`, `kv_heads` and `ffn`. The error names the
    /// field and states the equation with its values.
    pub fn check_split(&self, tp: usize) -> Result<()> {
        let refuse = |reason: String| {
            Err(ModelError::Config {
                field: "tp",
                value: tp.to_string(),
                reason,
            })
        };
        if tp == 0 {
            return refuse("must be at least 1".into());
        }
        for (field, v) in [
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("ffn", self.ffn),
        ] {
            if v % tp != 0 {
                return refuse(format!(
                    "{field} ({v}) % tp ({tp}) = {} != 0: tensor parallelism splits {field} evenly",
                    v % tp
                ));
            }
        }
        Ok(())
    }

    /// Head dimension D = C / H.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads
    }

    /// Width of the fused qkv projection, (H + 2K) * D.
    pub fn qkv_dim(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim()
    }

    /// Output width of the first feed-forward linear: F, or 2F for SwiGLU
    /// (gate and up fused, gate first).
    pub fn ffn_in_dim(&self) -> usize {
        if self.activation == Activation::SwiGlu {
            2 * self.ffn
        } else {
            self.ffn
        }
    }

    /// Model FLOPs per trained token: `6 N + 12 L T C` (forward and backward;
    /// N excludes the position table, the tied embedding counts once as the
    /// LM head) — the nanoGPT/PaLM estimate the peer benchmark uses. `n_params` is the whole
    /// model's count; with experts N counts the parameters a token is active in: each block's
    /// router and k of its E experts (`N = n_params − L · (E − k) · P_e`, P_e one expert's).
    pub fn flops_per_token(&self, n_params: usize) -> f64 {
        let wpe = if self.positions == Positions::Learned {
            self.seq_len * self.d_model
        } else {
            0
        };
        let idle = self.moe_layer().map_or(0, |m| {
            self.layers * (m.experts - m.top_k.min(m.experts)) * m.expert_len()
        });
        let active = n_params.saturating_sub(wpe + idle);
        6.0 * active as f64 + 12.0 * (self.layers * self.seq_len * self.d_model) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(c: &ModelConfig) -> &'static str {
        match c.validate() {
            Err(ModelError::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn presets_validate() {
        for p in ModelConfig::PRESETS {
            ModelConfig::preset(p).unwrap().validate().unwrap();
        }
        assert!(ModelConfig::preset("huge").is_err());
    }

    #[test]
    fn bad_fields_are_named() {
        let good = ModelConfig::gpt2(2, 4, 32, 16, 64);
        let mut c = good.clone();
        c.heads = 5;
        assert_eq!(field_of(&c), "heads");
        let mut c = good.clone();
        c.layers = 0;
        assert_eq!(field_of(&c), "layers");
        let mut c = good.clone();
        c.vocab = 0;
        assert_eq!(field_of(&c), "vocab");
        let mut c = good.clone();
        c.seq_len = 0;
        assert_eq!(field_of(&c), "seq_len");
        let mut c = good.clone();
        c.kv_heads = 3;
        assert_eq!(field_of(&c), "kv_heads");
        let mut c = good;
        c.dropout = 0.1;
        assert_eq!(field_of(&c), "dropout");
    }
}
