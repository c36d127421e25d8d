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
mod config;
mod tensors;
#[cfg(test)]
mod tests;

pub use config::{config_from_hf_json, hf_config_json};

use super::safetensors_io::{TensorFile, TensorWriter, io_err, show};
use crate::config::{Activation, ModelConfig, Norm, Positions};
use crate::error::{ModelError, Result};
use crate::layout::Layout;
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use tensors::{cut, paste, plan};

/// Name of the weights file [`export_hf`] writes.
pub const HF_WEIGHTS: &str = "model.safetensors";
/// Name of the shard index [`import_hf`] reads when [`HF_WEIGHTS`] is absent.
pub const HF_INDEX: &str = "model.safetensors.index.json";
/// Name of the config file.
pub const HF_CONFIG: &str = "config.json";
/// Name of a Hugging Face fast tokenizer's file.
pub const HF_TOKENIZER: &str = "tokenizer.json";
/// The files of a saved Hugging Face tokenizer (`save_pretrained`), those present copied by an
/// export so that `AutoTokenizer.from_pretrained` loads the exported directory.
pub const HF_TOKENIZER_FILES: [&str; 7] = [
    HF_TOKENIZER,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

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
    if let Some(m) = cfg.moe {
        return Err(ModelError::Config {
            field: "experts",
            value: m.experts.to_string(),
            reason: "a mixture-of-experts model has no Hugging Face GPT-2 or Llama form (those \
                     classes hold dense MLPs); save it with --save instead"
                .into(),
        });
    }
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

/// The dtype of the weights [`export_hf_as`] writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HfDtype {
    /// Little-endian f32, exact (`torch_dtype` float32).
    #[default]
    F32,
    /// bfloat16, each weight rounded to nearest even (`torch_dtype` bfloat16): half the bytes.
    Bf16,
}

impl HfDtype {
    /// The `torch_dtype` of `config.json`.
    pub fn torch_dtype(self) -> &'static str {
        match self {
            HfDtype::F32 => "float32",
            HfDtype::Bf16 => "bfloat16",
        }
    }

    /// Rounds `values` as storing them in this dtype does (bf16: to nearest even), so that a
    /// computation on them sees the exported weights.
    pub fn round(self, values: &mut [f32]) {
        if self == HfDtype::Bf16 {
            for x in values {
                *x = half::bf16::from_f32(*x).to_f32();
            }
        }
    }
}

impl std::str::FromStr for HfDtype {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float32" | "fp32" => Ok(HfDtype::F32),
            "bf16" | "bfloat16" => Ok(HfDtype::Bf16),
            other => Err(format!("{other:?}: expected f32 or bf16")),
        }
    }
}

/// Write `cfg`'s model with parameters `params` (Flotilla's flat layout) to
/// the Hugging Face directory `dir` (created if needed): `model.safetensors`
/// (f32, HF names and layouts, `format = pt` metadata) and `config.json`.
/// `transformers`' `from_pretrained(dir)` loads it.
pub fn export_hf(dir: impl AsRef<Path>, cfg: &ModelConfig, params: &[f32]) -> Result<()> {
    export_hf_as(dir, cfg, params, HfDtype::F32)
}

/// [`export_hf`] with the weights stored as `dtype` (and `config.json`'s
/// `torch_dtype` saying so).
pub fn export_hf_as(
    dir: impl AsRef<Path>,
    cfg: &ModelConfig,
    params: &[f32],
    dtype: HfDtype,
) -> Result<()> {
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
    let text = config::hf_config_json_as(cfg, dtype)?;
    std::fs::create_dir_all(dir)
        .map_err(|e| io_err(show(dir), format!("cannot create directory: {e}")))?;
    let mut w = TensorWriter::new(dir.join(HF_WEIGHTS));
    w.set_metadata("format", "pt");
    for t in plan(cfg, &layout, arch, "transformer.") {
        let e = &layout.entries[t.entry];
        let v = cut(&t, &params[e.range()], &e.shape);
        match dtype {
            HfDtype::F32 => w.add_f32(&t.hf, &t.shape, &v)?,
            HfDtype::Bf16 => w.add_bf16(&t.hf, &t.shape, &v)?,
        }
    }
    w.write()?;
    let path = dir.join(HF_CONFIG);
    std::fs::write(&path, text).map_err(|e| io_err(show(&path), format!("cannot write: {e}")))
}

/// The weights of a Hugging Face directory: one file or several shards.
struct Source {
    files: Vec<TensorFile>,
    index: HashMap<String, usize>,
}

/// Largest JSON file of a Hugging Face directory read (64 MiB; a config or a weight index).
const MAX_JSON_BYTES: u64 = 64 << 20;

/// The text of a small JSON file: a regular file of at most [`MAX_JSON_BYTES`] in UTF-8.
fn read_json_text(path: &Path) -> std::result::Result<String, fsread::ReadError> {
    fsread::read_text_bounded(path, MAX_JSON_BYTES, fsread::Links::Follow)
}

impl Source {
    fn open(dir: &Path) -> Result<Self> {
        let single = dir.join(HF_WEIGHTS);
        let paths = if single.exists() {
            vec![single]
        } else {
            let ipath = dir.join(HF_INDEX);
            let text = read_json_text(&ipath).map_err(|e| {
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

/// The architecture and model config of the Hugging Face directory `dir`,
/// from its `config.json` alone (a regular file of at most 64 MiB; no weight
/// is read): what [`import_hf`] will load, known before loading it.
pub fn read_hf_config(dir: impl AsRef<Path>) -> Result<(HfArch, ModelConfig)> {
    let cpath = dir.as_ref().join(HF_CONFIG);
    let text =
        read_json_text(&cpath).map_err(|e| io_err(show(&cpath), format!("cannot read: {e}")))?;
    config_from_hf_json(&show(&cpath), &text)
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
    let (arch, cfg) = read_hf_config(dir)?;
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
