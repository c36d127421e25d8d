//! `config.json`: writing the Hugging Face config for a Flotilla config, and
//! parsing one back into a validated [`ModelConfig`].
use super::{HfArch, HfDtype, hf_arch, refuse};
use crate::config::{Activation, ModelConfig, Norm, Positions};
use crate::error::{ModelError, Result};
use crate::interop::safetensors_io::io_err;
use serde_json::{Map, Value, json};

/// GPT-2's `<|endoftext|>` id, `GPT2Config`'s default bos/eos token.
const GPT2_EOT: usize = 50256;

/// The `config.json` `transformers` needs to build `cfg`'s model (see
/// [`hf_arch`] for what is refused). GPT-2: `activation_function` "gelu"
/// (exact) or "gelu_new" (tanh), `n_inner`, `layer_norm_epsilon`, dropouts
/// 0. Llama: `hidden_act` "silu", `num_key_value_heads`, `rope_theta` (also
/// as `rope_parameters`), `rms_norm_eps`, `attention_bias` = `mlp_bias` =
/// `cfg.bias`. Both: `tie_word_embeddings`, `torch_dtype` float32.
/// Returned as pretty-printed JSON text ending in a newline.
pub fn hf_config_json(cfg: &ModelConfig) -> Result<String> {
    hf_config_json_as(cfg, HfDtype::F32)
}

/// [`hf_config_json`] with `torch_dtype` naming `dtype`.
pub(super) fn hf_config_json_as(cfg: &ModelConfig, dtype: HfDtype) -> Result<String> {
    let mut value = hf_config_value(cfg)?;
    if let Some(o) = value.as_object_mut() {
        o.insert("torch_dtype".into(), dtype.torch_dtype().into());
    }
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
                moe: None,
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
                moe: None,
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
