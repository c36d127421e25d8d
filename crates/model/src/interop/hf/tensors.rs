//! The Hugging Face tensor plan: each HF tensor's name and shape, and how
//! it is cut from (export) or pasted into (import) Flotilla's flat layout.
use super::HfArch;
use crate::config::ModelConfig;
use crate::layout::Layout;
use std::collections::HashMap;

/// How one Hugging Face tensor is cut from one Flotilla tensor.
#[derive(Clone, Debug, PartialEq)]
enum Piece {
    /// The whole tensor, same shape.
    Whole,
    /// The whole 2-D tensor, transposed (GPT-2's Conv1D).
    Transposed,
    /// Rows `start..end` of the first dimension.
    Rows(usize, usize),
}

/// One Hugging Face tensor: its name and shape, and where it lives in ours.
#[derive(Clone, Debug)]
pub(super) struct HfTensor {
    pub(super) hf: String,
    pub(super) entry: usize,
    piece: Piece,
    pub(super) shape: Vec<usize>,
}

/// Every Hugging Face tensor of `cfg`'s model, with `prefix` before GPT-2's
/// `transformer.`-less names (`"transformer."` when exporting).
pub(super) fn plan(
    cfg: &ModelConfig,
    layout: &Layout,
    arch: HfArch,
    gpt2_prefix: &str,
) -> Vec<HfTensor> {
    let index: HashMap<&str, usize> = layout
        .entries
        .iter()
        .enumerate()
        .map(|(i, e)| (e.name.as_str(), i))
        .collect();
    let mut out = Vec::new();
    let mut add = |hf: String, ours: &str, piece: Piece| {
        let Some(&entry) = index.get(ours) else {
            return;
        };
        let s = &layout.entries[entry].shape;
        let shape = match piece {
            Piece::Whole => s.clone(),
            Piece::Transposed => vec![s[1], s[0]],
            Piece::Rows(a, b) => std::iter::once(b - a)
                .chain(s[1..].iter().copied())
                .collect(),
        };
        out.push(HfTensor {
            hf,
            entry,
            piece,
            shape,
        });
    };
    match arch {
        HfArch::Gpt2 => {
            let p = gpt2_prefix;
            add(format!("{p}wte.weight"), "wte", Piece::Whole);
            add(format!("{p}wpe.weight"), "wpe", Piece::Whole);
            for l in 0..cfg.layers {
                let h = format!("{p}h.{l}.");
                let o = format!("h.{l}.");
                for (hf, ours, transposed) in [
                    ("ln_1.weight", "ln1.weight", false),
                    ("ln_1.bias", "ln1.bias", false),
                    ("attn.c_attn.weight", "attn.qkv.weight", true),
                    ("attn.c_attn.bias", "attn.qkv.bias", false),
                    ("attn.c_proj.weight", "attn.proj.weight", true),
                    ("attn.c_proj.bias", "attn.proj.bias", false),
                    ("ln_2.weight", "ln2.weight", false),
                    ("ln_2.bias", "ln2.bias", false),
                    ("mlp.c_fc.weight", "mlp.fc.weight", true),
                    ("mlp.c_fc.bias", "mlp.fc.bias", false),
                    ("mlp.c_proj.weight", "mlp.proj.weight", true),
                    ("mlp.c_proj.bias", "mlp.proj.bias", false),
                ] {
                    let piece = if transposed {
                        Piece::Transposed
                    } else {
                        Piece::Whole
                    };
                    add(format!("{h}{hf}"), &format!("{o}{ours}"), piece);
                }
            }
            add(format!("{p}ln_f.weight"), "ln_f.weight", Piece::Whole);
            add(format!("{p}ln_f.bias"), "ln_f.bias", Piece::Whole);
        }
        HfArch::Llama => {
            let d = cfg.head_dim();
            let (q, kv) = (cfg.heads * d, cfg.kv_heads * d);
            add("model.embed_tokens.weight".into(), "wte", Piece::Whole);
            for l in 0..cfg.layers {
                let h = format!("model.layers.{l}.");
                let o = format!("h.{l}.");
                add(
                    format!("{h}input_layernorm.weight"),
                    &format!("{o}ln1.weight"),
                    Piece::Whole,
                );
                for suffix in ["weight", "bias"] {
                    let qkv = format!("{o}attn.qkv.{suffix}");
                    add(
                        format!("{h}self_attn.q_proj.{suffix}"),
                        &qkv,
                        Piece::Rows(0, q),
                    );
                    add(
                        format!("{h}self_attn.k_proj.{suffix}"),
                        &qkv,
                        Piece::Rows(q, q + kv),
                    );
                    add(
                        format!("{h}self_attn.v_proj.{suffix}"),
                        &qkv,
                        Piece::Rows(q + kv, q + 2 * kv),
                    );
                    add(
                        format!("{h}self_attn.o_proj.{suffix}"),
                        &format!("{o}attn.proj.{suffix}"),
                        Piece::Whole,
                    );
                }
                add(
                    format!("{h}post_attention_layernorm.weight"),
                    &format!("{o}ln2.weight"),
                    Piece::Whole,
                );
                for suffix in ["weight", "bias"] {
                    let fc = format!("{o}mlp.fc.{suffix}");
                    add(
                        format!("{h}mlp.gate_proj.{suffix}"),
                        &fc,
                        Piece::Rows(0, cfg.ffn),
                    );
                    add(
                        format!("{h}mlp.up_proj.{suffix}"),
                        &fc,
                        Piece::Rows(cfg.ffn, 2 * cfg.ffn),
                    );
                    add(
                        format!("{h}mlp.down_proj.{suffix}"),
                        &format!("{o}mlp.proj.{suffix}"),
                        Piece::Whole,
                    );
                }
            }
            add("model.norm.weight".into(), "ln_f.weight", Piece::Whole);
        }
    }
    add("lm_head.weight".into(), "lm_head.weight", Piece::Whole);
    out
}

/// Cut `t` out of our tensor `src` (of shape `shape`).
pub(super) fn cut(t: &HfTensor, src: &[f32], shape: &[usize]) -> Vec<f32> {
    let row: usize = shape[1..].iter().product();
    match t.piece {
        Piece::Whole => src.to_vec(),
        Piece::Rows(a, b) => src[a * row..b * row].to_vec(),
        Piece::Transposed => {
            let (r, c) = (shape[0], shape[1]);
            let mut out = vec![0.0; src.len()];
            for i in 0..r {
                for j in 0..c {
                    out[j * r + i] = src[i * c + j];
                }
            }
            out
        }
    }
}

/// Put `t`'s data `v` back into our tensor `dst` (of shape `shape`).
pub(super) fn paste(t: &HfTensor, v: &[f32], dst: &mut [f32], shape: &[usize]) {
    let row: usize = shape[1..].iter().product();
    match t.piece {
        Piece::Whole => dst.copy_from_slice(v),
        Piece::Rows(a, b) => dst[a * row..b * row].copy_from_slice(v),
        Piece::Transposed => {
            let (r, c) = (shape[0], shape[1]);
            for i in 0..r {
                for j in 0..c {
                    dst[i * c + j] = v[j * r + i];
                }
            }
        }
    }
}
