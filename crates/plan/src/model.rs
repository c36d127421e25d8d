//! Model shapes: presets from the published papers and model cards, parameter counts and FLOPs
//! per token.

use crate::error::{PlanError, Result, at_least_one};
use serde::{Deserialize, Serialize};

/// A decoder-only transformer's shape. `experts = 1` is a dense model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    /// Preset name or "custom".
    #[serde(default = "custom")]
    pub name: String,
    /// Transformer blocks L.
    pub layers: u64,
    /// Model width h (d_model).
    pub hidden: u64,
    /// Attention (query) heads a.
    pub heads: u64,
    /// Key/value heads (grouped-query attention); equal to `heads` for multi-head attention.
    pub kv_heads: u64,
    /// MLP inner width (per expert).
    pub ffn: u64,
    /// Vocabulary size V.
    pub vocab: u64,
    /// Training sequence length s.
    pub seq: u64,
    /// Experts per MoE layer (1 = dense).
    #[serde(default = "one")]
    pub experts: u64,
    /// Experts each token is routed to (1 for dense).
    #[serde(default = "one")]
    pub top_k: u64,
    /// Gated MLP (SwiGLU, three matrices) instead of a two-matrix GELU MLP.
    #[serde(default)]
    pub gated: bool,
    /// Input embedding and output head share weights.
    #[serde(default)]
    pub tied_embeddings: bool,
    /// Width of one attention head when it is not h/a (Qwen 3, GPT-OSS); absent: h/a.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<u64>,
    /// A layer norm on the embedding output (BLOOM's `--embed-layernorm`); it keeps its input
    /// for the backward outside the recomputed blocks. Default false.
    #[serde(default)]
    pub embedding_norm: bool,
}

fn custom() -> String {
    "custom".into()
}
fn one() -> u64 {
    1
}

/// Model preset names accepted by [`model_preset`].
pub const MODEL_PRESETS: &[&str] = &[
    "gpt3-175b",
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "mixtral-8x7b",
    "mt-nlg-530b",
    "gpt-1t",
];

/// A model preset. Sources:
/// - GPT-3 175B: Brown et al. 2020, Table 2.1 (96 layers, d 12,288, 96 heads, seq 2,048), GPT-2
///   vocabulary 50,257, tied embeddings; 000 L2327 uses the same shape.
/// - Llama 2 7B/13B/70B: Touvron et al. 2023 and the Hugging Face configs (vocab 32,000, seq
///   4,096; 70B uses 8 KV heads).
/// - Llama 3 8B/70B/405B: Llama 3 herd paper (Dubey et al. 2024) Table 3 (vocab 128,256, 8 KV
///   heads, seq 8,192).
/// - Mixtral 8x7B: Jiang et al. 2024 (8 experts, top-2, Mistral-7B body).
/// - MT-NLG 530B: Smith et al. 2022 (105 layers, d 20,480, 128 heads).
/// - 1T: Narayanan et al. 2021 (SC21) Table 1, the 1,008B row (128 layers, d 25,600, 160 heads).
pub fn model_preset(name: &str) -> Result<ModelShape> {
    #[allow(clippy::too_many_arguments)]
    fn m(
        n: &str,
        layers: u64,
        hidden: u64,
        heads: u64,
        kv: u64,
        ffn: u64,
        vocab: u64,
        seq: u64,
        gated: bool,
    ) -> ModelShape {
        ModelShape {
            name: n.into(),
            layers,
            hidden,
            heads,
            kv_heads: kv,
            ffn,
            vocab,
            seq,
            experts: 1,
            top_k: 1,
            gated,
            tied_embeddings: !gated,
            head_dim: None,
            embedding_norm: false,
        }
    }
    let key = name.to_ascii_lowercase();
    Ok(match key.as_str() {
        "gpt3-175b" | "gpt3" => m(&key, 96, 12288, 96, 96, 49152, 50257, 2048, false),
        "llama2-7b" => m(&key, 32, 4096, 32, 32, 11008, 32000, 4096, true),
        "llama2-13b" => m(&key, 40, 5120, 40, 40, 13824, 32000, 4096, true),
        "llama2-70b" => m(&key, 80, 8192, 64, 8, 28672, 32000, 4096, true),
        "llama3-8b" => m(&key, 32, 4096, 32, 8, 14336, 128256, 8192, true),
        "llama3-70b" => m(&key, 80, 8192, 64, 8, 28672, 128256, 8192, true),
        "llama3-405b" => m(&key, 126, 16384, 128, 8, 53248, 128256, 8192, true),
        "mixtral-8x7b" => ModelShape {
            experts: 8,
            top_k: 2,
            ..m(&key, 32, 4096, 32, 8, 14336, 32000, 4096, true)
        },
        "mt-nlg-530b" => m(&key, 105, 20480, 128, 128, 81920, 50257, 2048, false),
        "gpt-1t" | "1t" => m(&key, 128, 25600, 160, 160, 102400, 51200, 2048, false),
        _ => {
            return Err(PlanError::UnknownPreset {
                field: "model.preset",
                name: name.into(),
                known: MODEL_PRESETS.join(", "),
            });
        }
    })
}

impl ModelShape {
    /// Checks counts are positive and the head arithmetic is whole:
    /// "hidden 4096 is not a multiple of heads 30", "kv_heads 5 does not divide heads 32".
    pub fn validate(&self) -> Result<()> {
        at_least_one("model.layers", self.layers)?;
        at_least_one("model.hidden", self.hidden)?;
        at_least_one("model.heads", self.heads)?;
        at_least_one("model.kv_heads", self.kv_heads)?;
        at_least_one("model.ffn", self.ffn)?;
        at_least_one("model.vocab", self.vocab)?;
        at_least_one("model.seq", self.seq)?;
        at_least_one("model.experts", self.experts)?;
        at_least_one("model.top_k", self.top_k)?;
        if let Some(d) = self.head_dim {
            at_least_one("model.head_dim", d)?;
        } else if !self.hidden.is_multiple_of(self.heads) {
            return Err(PlanError::Inconsistent {
                field: "model.heads",
                equation: format!(
                    "hidden {} is not a multiple of heads {}",
                    self.hidden, self.heads
                ),
            });
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(PlanError::Inconsistent {
                field: "model.kv_heads",
                equation: format!(
                    "kv_heads {} does not divide heads {}",
                    self.kv_heads, self.heads
                ),
            });
        }
        if self.top_k > self.experts {
            return Err(PlanError::Inconsistent {
                field: "model.top_k",
                equation: format!("top_k {} > experts {}", self.top_k, self.experts),
            });
        }
        Ok(())
    }

    /// Head dimension: `head_dim` if given, else h/a.
    pub fn head_dim(&self) -> u64 {
        self.head_dim.unwrap_or(self.hidden / self.heads)
    }

    /// Width of all query heads a·d_head (= h unless `head_dim` is given).
    pub fn q_width(&self) -> u64 {
        self.heads * self.head_dim()
    }

    /// Attention parameters per layer: Q and O are h×(a·d_head) (h×h when d_head = h/a), K and
    /// V are h×(kv·d_head).
    pub fn attn_params_per_layer(&self) -> f64 {
        let h = self.hidden as f64;
        let q = self.q_width() as f64;
        let kv = (self.kv_heads * self.head_dim()) as f64;
        2.0 * h * q + 2.0 * h * kv
    }

    /// MLP parameters of one expert: 3·h·f gated, 2·h·f otherwise.
    pub fn mlp_params_per_expert(&self) -> f64 {
        let mats = if self.gated { 3.0 } else { 2.0 };
        mats * (self.hidden * self.ffn) as f64
    }

    /// Expert (MoE MLP) parameters per layer, router included; 0 for a dense model.
    pub fn expert_params_per_layer(&self) -> f64 {
        if self.experts <= 1 {
            0.0
        } else {
            self.experts as f64 * self.mlp_params_per_expert() + (self.hidden * self.experts) as f64
        }
    }

    /// Dense (non-expert) parameters per layer: attention, a dense MLP if not MoE, two norms.
    pub fn dense_params_per_layer(&self) -> f64 {
        let mlp = if self.experts <= 1 {
            self.mlp_params_per_expert()
        } else {
            0.0
        };
        self.attn_params_per_layer() + mlp + 2.0 * self.hidden as f64
    }

    /// Embedding parameters: V·h, doubled when the output head is untied.
    pub fn embedding_params(&self) -> f64 {
        let e = (self.vocab * self.hidden) as f64;
        if self.tied_embeddings { e } else { 2.0 * e }
    }

    /// Total parameters N (175B preset: 174.6e9; biases ignored).
    pub fn params(&self) -> f64 {
        self.layers as f64 * (self.dense_params_per_layer() + self.expert_params_per_layer())
            + self.embedding_params()
    }

    /// Parameters touched per token: experts count top_k times, not `experts` times.
    pub fn active_params(&self) -> f64 {
        let active_experts = if self.experts <= 1 {
            0.0
        } else {
            self.top_k as f64 * self.mlp_params_per_expert() + (self.hidden * self.experts) as f64
        };
        self.layers as f64 * (self.dense_params_per_layer() + active_experts)
            + self.embedding_params()
    }

    /// Model FLOPs per token, forward + backward: 6·N_active (000 F23) plus the attention-score
    /// term 12·L·h·s (PaLM, Chowdhery et al. 2022, appendix B) that 6N omits.
    pub fn flops_per_token(&self) -> f64 {
        6.0 * self.active_params() + self.attention_flops_per_token()
    }

    /// The attention-score FLOPs per token, forward + backward: 12·L·h·s.
    pub fn attention_flops_per_token(&self) -> f64 {
        12.0 * (self.layers * self.hidden * self.seq) as f64
    }
}

/// FLOPs of one training step: 6·P·tokens (000 F23, L2009).
pub fn flops_per_step(params: f64, tokens_per_step: f64) -> f64 {
    6.0 * params * tokens_per_step
}
