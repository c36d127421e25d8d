//! Hugging Face checkpoints: `GPT2LMHeadModel` and `LlamaForCausalLM`.
//!
//! A Hugging Face model directory holds `config.json` and `model.safetensors`
//! (or shards listed in `model.safetensors.index.json`, read on import).
//! Which architecture a Flotilla config maps to follows its norm: LayerNorm
//! configs are GPT-2, RMSNorm configs are Llama; a config the chosen class
//! cannot represent is refused with a [`ModelError::Config`] naming the field.
//!
//! Tensor mapping (ours on the left, `l` a layer):
//!
//! ```text
//! GPT-2 (Conv1D weights are stored (in, out): transposed vs ours)
//!   wte, wpe                 transformer.wte.weight, transformer.wpe.weight
//!   h.l.ln1.{weight,bias}    transformer.h.l.ln_1.{weight,bias}
//!   h.l.attn.qkv.weight      transformer.h.l.attn.c_attn.weight     (transposed)
//!   h.l.attn.qkv.bias        transformer.h.l.attn.c_attn.bias
//!   h.l.attn.proj.*          transformer.h.l.attn.c_proj.*          (weight transposed)
//!   h.l.ln2.*                transformer.h.l.ln_2.*
//!   h.l.mlp.fc.*             transformer.h.l.mlp.c_fc.*             (weight transposed)
//!   h.l.mlp.proj.*           transformer.h.l.mlp.c_proj.*           (weight transposed)
//!   ln_f.*                   transformer.ln_f.*
//!   lm_head.weight           lm_head.weight (untied only)
//! Llama (nn.Linear, (out, in) like ours)
//!   wte                      model.embed_tokens.weight
//!   h.l.ln1.weight           model.layers.l.input_layernorm.weight
//!   h.l.attn.qkv.* rows      model.layers.l.self_attn.{q,k,v}_proj.*  (rows [q | k | v])
//!   h.l.attn.proj.*          model.layers.l.self_attn.o_proj.*
//!   h.l.ln2.weight           model.layers.l.post_attention_layernorm.weight
//!   h.l.mlp.fc.* rows        model.layers.l.mlp.{gate,up}_proj.*      (rows [gate | up])
//!   h.l.mlp.proj.*           model.layers.l.mlp.down_proj.*
//!   ln_f.weight              model.norm.weight
//!   lm_head.weight           lm_head.weight (untied only)
//! ```
//!
//! Both use the same attention head order as Flotilla and Llama's RoPE is
//! the "rotate_half" convention Flotilla implements, so no row permutation
//! is needed.
use super::safetensors_io::{TensorFile, TensorWriter, io_err, show};
use crate::config::{Activation, ModelConfig, Norm, Positions};
use crate::error::{ModelError, Result};
use crate::layout::Layout;
use serde_json::{Map, Value, json};
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// Name of the weights file [`export_hf`] writes.
pub const HF_WEIGHTS: &str = "model.safetensors";
/// Name of the shard index [`import_hf`] reads when [`HF_WEIGHTS`] is absent.
pub const HF_INDEX: &str = "model.safetensors.index.json";
/// Name of the config file.
pub const HF_CONFIG: &str = "config.json";

/// GPT-2's `<|endoftext|>` id, `GPT2Config`'s default bos/eos token.
const GPT2_EOT: usize = 50256;

/// The Hugging Face model class a config maps to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfArch {
    /// `GPT2LMHeadModel` (`model_type` "gpt2").
    Gpt2,
    /// `LlamaForCausalLM` (`model_type` "llama").
    Llama,
}

impl HfArch {
    /// The `transformers` class name.
    pub fn class_name(self) -> &'static str {
        match self {
            HfArch::Gpt2 => "GPT2LMHeadModel",
            HfArch::Llama => "LlamaForCausalLM",
        }
    }

    /// The `model_type` in `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            HfArch::Gpt2 => "gpt2",
            HfArch::Llama => "llama",
        }
    }
}

fn refuse(arch: HfArch, field: &'static str, value: String, reason: &str) -> ModelError {
    ModelError::Config {
        field,
        value,
        reason: format!("{} cannot represent this: {reason}", arch.class_name()),
    }
}

/// The Hugging Face class `cfg` maps to (LayerNorm: GPT-2, RMSNorm: Llama),
/// or a [`ModelError::Config`] naming the field that class cannot represent.
pub fn hf_arch(cfg: &ModelConfig) -> Result<HfArch> {
    cfg.validate()?;
    match cfg.norm {
        Norm::LayerNorm => {
            let a = HfArch::Gpt2;
            if let Positions::Rope { theta } = cfg.positions {
                return Err(refuse(
                    a,
                    "positions",
                    format!("rope (theta {theta})"),
                    "GPT-2 has learned positions only",
                ));
            }
            if cfg.activation == Activation::SwiGlu {
                return Err(refuse(
                    a,
                    "activation",
                    "SwiGlu".into(),
                    "GPT-2's MLP is gelu or gelu_new",
                ));
            }
            if cfg.kv_heads != cfg.heads {
                return Err(refuse(
                    a,
                    "kv_heads",
                    cfg.kv_heads.to_string(),
                    &format!(
                        "GPT-2 has no grouped-query attention (kv_heads must equal heads = {})",
                        cfg.heads
                    ),
                ));
            }
            if !cfg.bias {
                return Err(refuse(
                    a,
                    "bias",
                    "false".into(),
                    "GPT-2's linears and LayerNorms always have biases",
                ));
            }
            Ok(a)
        }
        Norm::RmsNorm => {
            let a = HfArch::Llama;
            if cfg.positions == Positions::Learned {
                return Err(refuse(
                    a,
                    "positions",
                    "learned".into(),
                    "Llama has rotary positions only",
                ));
            }
            if cfg.activation != Activation::SwiGlu {
                return Err(refuse(
                    a,
                    "activation",
                    format!("{:?}", cfg.activation),
                    "Llama's MLP is SwiGLU (silu)",
                ));
            }
            Ok(a)
        }
    }
}

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
struct HfTensor {
    hf: String,
    entry: usize,
    piece: Piece,
    shape: Vec<usize>,
}

/// Every Hugging Face tensor of `cfg`'s model, with `prefix` before GPT-2's
/// `transformer.`-less names (`"transformer."` when exporting).
fn plan(cfg: &ModelConfig, layout: &Layout, arch: HfArch, gpt2_prefix: &str) -> Vec<HfTensor> {
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
fn cut(t: &HfTensor, src: &[f32], shape: &[usize]) -> Vec<f32> {
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
fn paste(t: &HfTensor, v: &[f32], dst: &mut [f32], shape: &[usize]) {
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

/// The `config.json` `transformers` needs to build `cfg`'s model (see
/// [`hf_arch`] for what is refused). GPT-2: `activation_function` "gelu"
/// (exact) or "gelu_new" (tanh), `n_inner`, `layer_norm_epsilon`, dropouts
/// 0. Llama: `hidden_act` "silu", `num_key_value_heads`, `rope_theta` (also
/// as `rope_parameters`), `rms_norm_eps`, `attention_bias` = `mlp_bias` =
/// `cfg.bias`. Both: `tie_word_embeddings`, `torch_dtype` float32.
/// Returned as pretty-printed JSON text ending in a newline.
pub fn hf_config_json(cfg: &ModelConfig) -> Result<String> {
    let value = hf_config_value(cfg)?;
    let mut text = serde_json::to_string_pretty(&value).map_err(|e| ModelError::Config {
        field: "config",
        value: format!("{cfg:?}"),
        reason: format!("cannot serialise config.json: {e}"),
    })?;
    text.push('\n');
    Ok(text)
}

fn hf_config_value(cfg: &ModelConfig) -> Result<Value> {
    let arch = hf_arch(cfg)?;
    Ok(match arch {
        HfArch::Gpt2 => json!({
            "architectures": [arch.class_name()],
            "model_type": arch.model_type(),
            "vocab_size": cfg.vocab,
            "n_positions": cfg.seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.layers,
            "n_head": cfg.heads,
            "n_inner": cfg.ffn,
            "activation_function": if cfg.activation == Activation::Gelu { "gelu" } else { "gelu_new" },
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "summary_first_dropout": 0.0,
            "layer_norm_epsilon": cfg.norm_eps,
            "initializer_range": 0.02,
            "scale_attn_weights": true,
            "scale_attn_by_inverse_layer_idx": false,
            "reorder_and_upcast_attn": false,
            "tie_word_embeddings": cfg.tied_embeddings,
            // GPT-2's BPE <|endoftext|> when the vocabulary can hold it; Flotilla knows no tokenizer otherwise.
            "bos_token_id": (cfg.vocab > GPT2_EOT).then_some(GPT2_EOT),
            "eos_token_id": (cfg.vocab > GPT2_EOT).then_some(GPT2_EOT),
            "use_cache": true,
            "torch_dtype": "float32",
        }),
        HfArch::Llama => {
            let Positions::Rope { theta } = cfg.positions else {
                return Err(refuse(
                    arch,
                    "positions",
                    "learned".into(),
                    "Llama has rotary positions only",
                ));
            };
            json!({
                "architectures": [arch.class_name()],
                "model_type": arch.model_type(),
                "vocab_size": cfg.vocab,
                "hidden_size": cfg.d_model,
                "intermediate_size": cfg.ffn,
                "num_hidden_layers": cfg.layers,
                "num_attention_heads": cfg.heads,
                "num_key_value_heads": cfg.kv_heads,
                "head_dim": cfg.head_dim(),
                "hidden_act": "silu",
                "max_position_embeddings": cfg.seq_len,
                "rms_norm_eps": cfg.norm_eps,
                "rope_theta": theta,
                "rope_scaling": null,
                "rope_parameters": { "rope_type": "default", "rope_theta": theta },
                "attention_bias": cfg.bias,
                "mlp_bias": cfg.bias,
                "attention_dropout": 0.0,
                "pretraining_tp": 1,
                "initializer_range": 0.02,
                "tie_word_embeddings": cfg.tied_embeddings,
                "use_cache": true,
                "torch_dtype": "float32",
            })
        }
    })
}

/// Write `cfg`'s model with parameters `params` (Flotilla's flat layout) to
/// the Hugging Face directory `dir` (created if needed): `model.safetensors`
/// (f32, HF names and layouts, `format = pt` metadata) and `config.json`.
/// `transformers`' `from_pretrained(dir)` loads it.
pub fn export_hf(dir: impl AsRef<Path>, cfg: &ModelConfig, params: &[f32]) -> Result<()> {
    let dir = dir.as_ref();
    let arch = hf_arch(cfg)?;
    let layout = Layout::new(cfg);
    if params.len() != layout.total {
        return Err(ModelError::Shape {
            what: "params",
            expected: layout.total,
            got: params.len(),
        });
    }
    let text = hf_config_json(cfg)?;
    std::fs::create_dir_all(dir)
        .map_err(|e| io_err(show(dir), format!("cannot create directory: {e}")))?;
    let mut w = TensorWriter::new(dir.join(HF_WEIGHTS));
    w.set_metadata("format", "pt");
    for t in plan(cfg, &layout, arch, "transformer.") {
        let e = &layout.entries[t.entry];
        w.add_f32(&t.hf, &t.shape, &cut(&t, &params[e.range()], &e.shape))?;
    }
    w.write()?;
    let path = dir.join(HF_CONFIG);
    std::fs::write(&path, text).map_err(|e| io_err(show(&path), format!("cannot write: {e}")))
}

/// Typed access to a `config.json` object, naming the file and key in errors.
struct Json<'a> {
    path: &'a str,
    obj: &'a Map<String, Value>,
}

impl Json<'_> {
    fn bad(&self, key: &str, v: &Value, what: &str) -> ModelError {
        io_err(self.path, format!("`{key}` = {v}: {what}"))
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .ok_or_else(|| self.bad(key, v, "expected a non-negative integer"))
            })
            .transpose()
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| io_err(self.path, format!("`{key}` is missing")))
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.bad(key, v, "expected a number")),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.bad(key, v, "expected true or false")),
        }
    }

    fn str_or<'b>(&'b self, key: &str, default: &'b str) -> Result<&'b str> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| self.bad(key, v, "expected a string")),
        }
    }

    fn require_bool(&self, key: &str, default: bool, want: bool, why: &str) -> Result<()> {
        let v = self.bool_or(key, default)?;
        if v != want {
            Err(io_err(
                self.path,
                format!("`{key}` = {v} is not supported: {why}"),
            ))
        } else {
            Ok(())
        }
    }
}

/// Parse a Hugging Face `config.json` (text `text`, from `path`) into the
/// architecture and a validated [`ModelConfig`]. Dropout probabilities are
/// training settings and are not carried over (Flotilla trains without
/// dropout); anything that changes the model's function and that Flotilla
/// cannot express is refused, naming the key.
pub fn config_from_hf_json(path: &str, text: &str) -> Result<(HfArch, ModelConfig)> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| io_err(path, format!("invalid JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| io_err(path, "expected a JSON object"))?;
    let j = Json { path, obj };
    let model_type = j.str_or("model_type", "")?;
    let (arch, cfg) = match model_type {
        "gpt2" => {
            let d_model = j.usize("n_embd")?;
            let activation = match j.str_or("activation_function", "gelu_new")? {
                "gelu" => Activation::Gelu,
                "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluTanh,
                other => {
                    return Err(io_err(
                        path,
                        format!(
                            "`activation_function` = {other:?} is not supported (gelu, gelu_new or gelu_pytorch_tanh)"
                        ),
                    ));
                }
            };
            j.require_bool(
                "scale_attn_weights",
                true,
                true,
                "Flotilla scales attention scores by 1/sqrt(head dim)",
            )?;
            j.require_bool(
                "scale_attn_by_inverse_layer_idx",
                false,
                false,
                "Flotilla does not scale by layer index",
            )?;
            j.require_bool(
                "add_cross_attention",
                false,
                false,
                "Flotilla is decoder-only",
            )?;
            let heads = j.usize("n_head")?;
            let cfg = ModelConfig {
                layers: j.usize("n_layer")?,
                d_model,
                heads,
                kv_heads: heads,
                ffn: j.opt_usize("n_inner")?.unwrap_or(4 * d_model),
                vocab: j.usize("vocab_size")?,
                seq_len: j.usize("n_positions")?,
                norm: Norm::LayerNorm,
                activation,
                positions: Positions::Learned,
                tied_embeddings: j.bool_or("tie_word_embeddings", true)?,
                bias: true,
                norm_eps: j.f64_or("layer_norm_epsilon", 1e-5)?,
                dropout: 0.0,
            };
            (HfArch::Gpt2, cfg)
        }
        "llama" => {
            let act = j.str_or("hidden_act", "silu")?;
            if act != "silu" {
                return Err(io_err(
                    path,
                    format!(
                        "`hidden_act` = {act:?} is not supported (Flotilla's SwiGLU uses silu)"
                    ),
                ));
            }
            let d_model = j.usize("hidden_size")?;
            let heads = j.usize("num_attention_heads")?;
            if let Some(hd) = j
                .opt_usize("head_dim")?
                .filter(|&hd| heads == 0 || hd * heads != d_model)
            {
                return Err(io_err(
                    path,
                    format!(
                        "`head_dim` = {hd} is not supported: Flotilla's head dim is hidden_size / num_attention_heads"
                    ),
                ));
            }
            let mut theta = j.f64_or("rope_theta", 10_000.0)?;
            let mut rope_type = String::from("default");
            for key in ["rope_scaling", "rope_parameters"] {
                let Some(v) = j.get(key) else { continue };
                let o = v
                    .as_object()
                    .ok_or_else(|| j.bad(key, v, "expected an object"))?;
                let sub = Json { path, obj: o };
                if let Some(t) = sub.get("rope_type").or_else(|| sub.get("type")) {
                    rope_type = t
                        .as_str()
                        .ok_or_else(|| j.bad(key, v, "rope_type is not a string"))?
                        .to_string();
                }
                if o.contains_key("rope_theta") {
                    theta = sub.f64_or("rope_theta", theta)?;
                }
                if key == "rope_scaling"
                    && rope_type == "default"
                    && o.keys().any(|k| k == "factor")
                {
                    rope_type = "scaled".into();
                }
            }
            if rope_type != "default" {
                return Err(io_err(
                    path,
                    format!(
                        "rope type {rope_type:?} is not supported (only default RoPE, no scaling)"
                    ),
                ));
            }
            let partial = j.f64_or("partial_rotary_factor", 1.0)?;
            if partial != 1.0 {
                return Err(io_err(
                    path,
                    format!(
                        "`partial_rotary_factor` = {partial} is not supported (Flotilla rotates whole heads)"
                    ),
                ));
            }
            let bias = j.bool_or("attention_bias", false)?;
            let mlp_bias = j.bool_or("mlp_bias", false)?;
            if mlp_bias != bias {
                return Err(io_err(
                    path,
                    format!(
                        "`mlp_bias` = {mlp_bias} differs from `attention_bias` = {bias}: Flotilla has one bias switch"
                    ),
                ));
            }
            let cfg = ModelConfig {
                layers: j.usize("num_hidden_layers")?,
                d_model,
                heads,
                kv_heads: j.opt_usize("num_key_value_heads")?.unwrap_or(heads),
                ffn: j.usize("intermediate_size")?,
                vocab: j.usize("vocab_size")?,
                seq_len: j.opt_usize("max_position_embeddings")?.unwrap_or(2048),
                norm: Norm::RmsNorm,
                activation: Activation::SwiGlu,
                positions: Positions::Rope { theta },
                tied_embeddings: j.bool_or("tie_word_embeddings", false)?,
                bias,
                norm_eps: j.f64_or("rms_norm_eps", 1e-6)?,
                dropout: 0.0,
            };
            (HfArch::Llama, cfg)
        }
        other => {
            return Err(io_err(
                path,
                format!("`model_type` = {other:?} is not supported (gpt2 or llama)"),
            ));
        }
    };
    cfg.validate()
        .map_err(|e| io_err(path, format!("does not give a valid Flotilla config: {e}")))?;
    Ok((arch, cfg))
}

/// The weights of a Hugging Face directory: one file or several shards.
struct Source {
    files: Vec<TensorFile>,
    index: HashMap<String, usize>,
}

impl Source {
    fn open(dir: &Path) -> Result<Self> {
        let single = dir.join(HF_WEIGHTS);
        let paths = if single.exists() {
            vec![single]
        } else {
            let ipath = dir.join(HF_INDEX);
            let text = std::fs::read_to_string(&ipath).map_err(|e| {
                io_err(
                    show(dir),
                    format!("neither {HF_WEIGHTS} nor {HF_INDEX} can be read ({HF_INDEX}: {e})"),
                )
            })?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| io_err(show(&ipath), format!("invalid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| io_err(show(&ipath), "`weight_map` is missing or not an object"))?;
            let mut shards: Vec<&str> = Vec::new();
            for (name, f) in map {
                let f = f.as_str().ok_or_else(|| {
                    io_err(
                        show(&ipath),
                        format!("`weight_map.{name}` is not a file name"),
                    )
                })?;
                if !shards.contains(&f) {
                    shards.push(f);
                }
            }
            shards.sort_unstable();
            shards.iter().map(|f| dir.join(f)).collect()
        };
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for p in paths {
            let f = TensorFile::open(&p)?;
            for name in f.names() {
                if let Some(prev) = index.insert(name.clone(), files.len()) {
                    let prev: &TensorFile = &files[prev];
                    return Err(io_err(
                        f.path(),
                        format!("tensor `{name}` is also in {}", prev.path()),
                    ));
                }
            }
            files.push(f);
        }
        Ok(Self { files, index })
    }

    fn file(&self, name: &str) -> Option<&TensorFile> {
        self.index.get(name).map(|&i| &self.files[i])
    }

    fn names(&self) -> impl Iterator<Item = &String> {
        self.index.keys()
    }

    fn read(&self, name: &str, shape: &[usize], dir: &Path) -> Result<Vec<f32>> {
        match self.file(name) {
            Some(f) => f.read_f32_shaped(name, shape),
            None => Err(io_err(
                show(dir),
                format!("tensor `{name}` is missing from the checkpoint"),
            )),
        }
    }
}

/// Read a Hugging Face `GPT2LMHeadModel` or `LlamaForCausalLM` directory
/// (`config.json` plus `model.safetensors` or an index of shards) into a
/// Flotilla config and flat parameters. Every tensor is checked for shape
/// and dtype (F32, or F16/BF16 widened to f32); a missing tensor, or an
/// unexpected one (other than attention-mask and rotary buffers some
/// checkpoints carry), is an error naming it. GPT-2 names may come with or
/// without the `transformer.` prefix. A tied checkpoint's `lm_head.weight`,
/// if stored, must equal the embedding.
pub fn import_hf(dir: impl AsRef<Path>) -> Result<(ModelConfig, Vec<f32>)> {
    let dir = dir.as_ref();
    let cpath = dir.join(HF_CONFIG);
    let text = std::fs::read_to_string(&cpath)
        .map_err(|e| io_err(show(&cpath), format!("cannot read: {e}")))?;
    let (arch, cfg) = config_from_hf_json(&show(&cpath), &text)?;
    let src = Source::open(dir)?;
    let prefix = if arch == HfArch::Gpt2
        && src.file("transformer.wte.weight").is_none()
        && src.file("wte.weight").is_some()
    {
        ""
    } else {
        "transformer."
    };
    let layout = Layout::new(&cfg);
    let mut params = vec![0.0f32; layout.total];
    let tensors = plan(&cfg, &layout, arch, prefix);
    let mut used: HashSet<&str> = HashSet::new();
    for t in &tensors {
        let e = &layout.entries[t.entry];
        let v = src.read(&t.hf, &t.shape, dir)?;
        paste(t, &v, &mut params[e.range()], &e.shape);
        used.insert(&t.hf);
    }
    let mut extra: Vec<&String> = Vec::new();
    for name in src.names() {
        if used.contains(name.as_str()) {
            continue;
        }
        // Non-parameter buffers older exports carry: GPT-2's causal mask and
        // Llama's rotary frequencies.
        let buffer = (arch == HfArch::Gpt2
            && (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")))
            || (arch == HfArch::Llama && name.ends_with(".rotary_emb.inv_freq"));
        if buffer {
            continue;
        }
        if name == "lm_head.weight" && cfg.tied_embeddings {
            let e = &layout.entries[0];
            let v = src.read(name, &e.shape, dir)?;
            if v.iter()
                .zip(&params[layout.wte.clone()])
                .any(|(a, b)| a.to_bits() != b.to_bits())
            {
                return Err(io_err(
                    src.file(name).map_or(show(dir), |f| f.path().to_string()),
                    "`lm_head.weight` differs from the token embedding although `tie_word_embeddings` is true",
                ));
            }
            continue;
        }
        extra.push(name);
    }
    if !extra.is_empty() {
        extra.sort();
        let shown: Vec<&str> = extra.iter().take(5).map(|s| s.as_str()).collect();
        return Err(io_err(
            show(dir),
            format!(
                "{} unexpected tensor(s) for a {} with this config.json: {}{}",
                extra.len(),
                arch.class_name(),
                shown.join(", "),
                if extra.len() > 5 { ", ..." } else { "" }
            ),
        ));
    }
    Ok((cfg, params))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interop::safetensors_io::TensorWriter;
    use std::path::PathBuf;

    fn tmp(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("flotilla-hf-unit-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn params(cfg: &ModelConfig) -> Vec<f32> {
        (0..Layout::new(cfg).total)
            .map(|i| ((i as f32) * 0.731).sin())
            .collect()
    }

    fn field(e: ModelError) -> &'static str {
        match e {
            ModelError::Config { field, .. } => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    fn reason(e: ModelError) -> String {
        match e {
            ModelError::Io { reason, .. } => reason,
            other => panic!("expected an Io error, got {other:?}"),
        }
    }

    fn configs() -> Vec<ModelConfig> {
        let mut untied = ModelConfig::gpt2(2, 4, 32, 16, 64);
        untied.tied_embeddings = false;
        untied.activation = Activation::GeluTanh;
        untied.ffn = 40;
        let mut llama_bias = ModelConfig::llama(2, 4, 4, 32, 24, 16, 64);
        llama_bias.bias = true;
        llama_bias.tied_embeddings = true;
        llama_bias.positions = Positions::Rope { theta: 500_000.0 };
        llama_bias.norm_eps = 1e-6;
        vec![
            ModelConfig::gpt2(2, 4, 32, 16, 64),
            untied,
            ModelConfig::llama(2, 4, 2, 32, 48, 16, 64),
            llama_bias,
        ]
    }

    #[test]
    fn round_trip_is_exact() {
        for (i, cfg) in configs().into_iter().enumerate() {
            let d = tmp(&format!("rt{i}"));
            let p = params(&cfg);
            export_hf(&d, &cfg, &p).unwrap();
            let (c2, p2) = import_hf(&d).unwrap();
            assert_eq!(c2, cfg);
            assert!(
                p2.iter().zip(&p).all(|(a, b)| a.to_bits() == b.to_bits()),
                "config {i}"
            );
            std::fs::remove_dir_all(d).unwrap();
        }
    }

    #[test]
    fn plans_cover_every_parameter_once() {
        for cfg in configs() {
            let layout = Layout::new(&cfg);
            let arch = hf_arch(&cfg).unwrap();
            let mut hits = vec![0u8; layout.total];
            for t in plan(&cfg, &layout, arch, "transformer.") {
                let e = &layout.entries[t.entry];
                let idx: Vec<f32> = e.range().map(|i| i as f32).collect();
                for v in cut(&t, &idx, &e.shape) {
                    hits[v as usize] += 1;
                }
            }
            assert!(hits.iter().all(|&h| h == 1));
        }
    }

    #[test]
    fn unrepresentable_configs_name_the_field() {
        let mut c = ModelConfig::gpt2(2, 4, 32, 16, 64);
        c.positions = Positions::Rope { theta: 10_000.0 };
        assert_eq!(field(hf_arch(&c).unwrap_err()), "positions");
        let mut c = ModelConfig::gpt2(2, 4, 32, 16, 64);
        c.kv_heads = 2;
        assert_eq!(field(hf_arch(&c).unwrap_err()), "kv_heads");
        let mut c = ModelConfig::gpt2(2, 4, 32, 16, 64);
        c.bias = false;
        // Refused before anything is written.
        let never =
            std::env::temp_dir().join(format!("flotilla-hf-unit-{}-never", std::process::id()));
        assert_eq!(
            field(export_hf(&never, &c, &params(&c)).unwrap_err()),
            "bias"
        );
        assert!(!never.exists());
        let mut c = ModelConfig::gpt2(2, 4, 32, 16, 64);
        c.activation = Activation::SwiGlu;
        assert_eq!(field(hf_arch(&c).unwrap_err()), "activation");
        let mut c = ModelConfig::llama(2, 4, 2, 32, 48, 16, 64);
        c.positions = Positions::Learned;
        assert_eq!(field(hf_arch(&c).unwrap_err()), "positions");
        let mut c = ModelConfig::llama(2, 4, 2, 32, 48, 16, 64);
        c.activation = Activation::Gelu;
        assert_eq!(field(hf_arch(&c).unwrap_err()), "activation");
    }

    #[test]
    fn bad_checkpoints_name_the_tensor() {
        let cfg = ModelConfig::llama(2, 4, 2, 32, 48, 16, 64);
        let d = tmp("bad");
        export_hf(&d, &cfg, &params(&cfg)).unwrap();
        let weights = d.join(HF_WEIGHTS);
        let good = TensorFile::open(&weights).unwrap();
        let rewrite = |skip: &str, reshape: Option<(&str, Vec<usize>)>, extra: Option<&str>| {
            let mut w = TensorWriter::new(&weights);
            w.set_metadata("format", "pt");
            for n in good.names() {
                if n == skip {
                    continue;
                }
                let (mut s, v) = good.read_f32(&n).unwrap();
                if let Some((_, shape)) = reshape.as_ref().filter(|(r, _)| n == *r) {
                    s = shape.clone();
                }
                w.add_f32(&n, &s, &v).unwrap();
            }
            if let Some(x) = extra {
                w.add_f32(x, &[1], &[0.0]).unwrap();
            }
            w.write().unwrap();
        };
        rewrite("model.layers.1.mlp.up_proj.weight", None, None);
        let r = reason(import_hf(&d).unwrap_err());
        assert!(
            r.contains("`model.layers.1.mlp.up_proj.weight` is missing"),
            "{r}"
        );
        rewrite(
            "",
            Some(("model.layers.0.self_attn.k_proj.weight", vec![32, 16])),
            None,
        );
        let r = reason(import_hf(&d).unwrap_err());
        assert!(
            r.contains("`model.layers.0.self_attn.k_proj.weight`") && r.contains("[32, 16]"),
            "{r}"
        );
        rewrite("", None, Some("model.layers.2.input_layernorm.weight"));
        let r = reason(import_hf(&d).unwrap_err());
        assert!(
            r.contains("unexpected") && r.contains("model.layers.2.input_layernorm.weight"),
            "{r}"
        );
        // Truncated weights.
        let bytes = std::fs::read(&weights).unwrap();
        std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
        let r = reason(import_hf(&d).unwrap_err());
        assert!(r.contains("truncated"), "{r}");
        // Config problems.
        let cpath = d.join(HF_CONFIG);
        let base: Value = serde_json::from_str(&std::fs::read_to_string(&cpath).unwrap()).unwrap();
        for (key, value, needle) in [
            ("hidden_act", json!("gelu"), "hidden_act"),
            (
                "rope_parameters",
                json!({"rope_type": "linear", "factor": 2.0}),
                "rope type",
            ),
            ("model_type", json!("mistral"), "model_type"),
            ("hidden_size", json!("32"), "hidden_size"),
            ("num_key_value_heads", json!(3), "kv_heads"),
        ] {
            let mut v = base.clone();
            v[key] = value;
            std::fs::write(&cpath, v.to_string()).unwrap();
            let r = reason(import_hf(&d).unwrap_err());
            assert!(r.contains(needle), "{key}: {r}");
        }
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn gpt2_without_prefix_and_with_buffers_imports() {
        let cfg = ModelConfig::gpt2(1, 2, 8, 4, 10);
        let p = params(&cfg);
        let d = tmp("noprefix");
        export_hf(&d, &cfg, &p).unwrap();
        let weights = d.join(HF_WEIGHTS);
        let good = TensorFile::open(&weights).unwrap();
        let mut w = TensorWriter::new(&weights);
        for n in good.names() {
            let (s, v) = good.read_f32(&n).unwrap();
            w.add_f32(n.trim_start_matches("transformer."), &s, &v)
                .unwrap();
        }
        w.add_f32("h.0.attn.bias", &[1, 1, 4, 4], &[1.0; 16])
            .unwrap();
        w.add_f32("lm_head.weight", &[10, 8], &p[Layout::new(&cfg).wte])
            .unwrap();
        w.write().unwrap();
        let (c2, p2) = import_hf(&d).unwrap();
        assert_eq!((c2, p2), (cfg, p));
        std::fs::remove_dir_all(d).unwrap();
    }
}
