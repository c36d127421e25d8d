//! A [`ModelConfig`] as safetensors metadata: the `flotilla.*` keys of a
//! Flotilla checkpoint, written, read back and compared.
use super::io_err;
use crate::config::{Activation, ModelConfig, Norm, Positions};
use crate::error::Result;
use std::collections::BTreeMap;

/// Prefix of the metadata keys that hold a [`ModelConfig`].
pub const CONFIG_PREFIX: &str = "flotilla.";

fn norm_name(n: Norm) -> &'static str {
    match n {
        Norm::LayerNorm => "layernorm",
        Norm::RmsNorm => "rmsnorm",
    }
}

fn activation_name(a: Activation) -> &'static str {
    match a {
        Activation::Gelu => "gelu",
        Activation::GeluTanh => "gelu_tanh",
        Activation::SwiGlu => "swiglu",
    }
}

/// The config as metadata: one `flotilla.<field>` key per [`ModelConfig`]
/// field (`positions` is `learned` or `rope`, with `rope_theta` for the
/// latter; `norm` is `layernorm` or `rmsnorm`; `activation` is `gelu`,
/// `gelu_tanh` or `swiglu`; floats in Rust's shortest round-trip form, so
/// reading them back is exact).
pub fn config_to_metadata(cfg: &ModelConfig) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    let mut put = |k: &str, v: String| {
        m.insert(format!("{CONFIG_PREFIX}{k}"), v);
    };
    put("layers", cfg.layers.to_string());
    put("d_model", cfg.d_model.to_string());
    put("heads", cfg.heads.to_string());
    put("kv_heads", cfg.kv_heads.to_string());
    put("ffn", cfg.ffn.to_string());
    put("vocab", cfg.vocab.to_string());
    put("seq_len", cfg.seq_len.to_string());
    put("norm", norm_name(cfg.norm).into());
    put("activation", activation_name(cfg.activation).into());
    match cfg.positions {
        Positions::Learned => put("positions", "learned".into()),
        Positions::Rope { theta } => {
            put("positions", "rope".into());
            put("rope_theta", theta.to_string());
        }
    }
    put("tied_embeddings", cfg.tied_embeddings.to_string());
    put("bias", cfg.bias.to_string());
    put("norm_eps", cfg.norm_eps.to_string());
    put("dropout", cfg.dropout.to_string());
    if let Some(moe) = cfg.moe {
        put("moe_experts", moe.experts.to_string());
        put("moe_top_k", moe.top_k.to_string());
        put("moe_capacity_factor", moe.capacity_factor.to_string());
        put("moe_aux_weight", moe.aux_weight.to_string());
    }
    m
}

/// The config stored by [`config_to_metadata`]; `get` looks a metadata key
/// up, `path` names the file in errors. The result is validated.
pub fn config_from_metadata<'a>(
    path: &str,
    get: impl Fn(&str) -> Option<&'a str>,
) -> Result<ModelConfig> {
    let raw = |k: &str| -> Result<&'a str> {
        get(&format!("{CONFIG_PREFIX}{k}")).ok_or_else(|| {
            io_err(
                path,
                format!("metadata key `{CONFIG_PREFIX}{k}` is missing"),
            )
        })
    };
    let bad = |k: &str, v: &str, what: &str| {
        io_err(
            path,
            format!("metadata key `{CONFIG_PREFIX}{k}` = {v:?}: {what}"),
        )
    };
    let int = |k: &str| -> Result<usize> {
        let v = raw(k)?;
        v.trim()
            .parse()
            .map_err(|_| bad(k, v, "not a non-negative integer"))
    };
    let float = |k: &str| -> Result<f64> {
        let v = raw(k)?;
        v.trim().parse().map_err(|_| bad(k, v, "not a number"))
    };
    let boolean = |k: &str| -> Result<bool> {
        let v = raw(k)?;
        match v.trim() {
            "true" | "True" => Ok(true),
            "false" | "False" => Ok(false),
            _ => Err(bad(k, v, "not true or false")),
        }
    };
    let norm = match raw("norm")? {
        "layernorm" => Norm::LayerNorm,
        "rmsnorm" => Norm::RmsNorm,
        v => return Err(bad("norm", v, "expected layernorm or rmsnorm")),
    };
    let activation = match raw("activation")? {
        "gelu" => Activation::Gelu,
        "gelu_tanh" => Activation::GeluTanh,
        "swiglu" => Activation::SwiGlu,
        v => return Err(bad("activation", v, "expected gelu, gelu_tanh or swiglu")),
    };
    let positions = match raw("positions")? {
        "learned" => Positions::Learned,
        "rope" => Positions::Rope {
            theta: float("rope_theta")?,
        },
        v => return Err(bad("positions", v, "expected learned or rope")),
    };
    let cfg = ModelConfig {
        layers: int("layers")?,
        d_model: int("d_model")?,
        heads: int("heads")?,
        kv_heads: int("kv_heads")?,
        ffn: int("ffn")?,
        vocab: int("vocab")?,
        seq_len: int("seq_len")?,
        norm,
        activation,
        positions,
        tied_embeddings: boolean("tied_embeddings")?,
        bias: boolean("bias")?,
        norm_eps: float("norm_eps")?,
        dropout: float("dropout")?,
        // A mixture of experts only where the file names one (dense files have no moe keys).
        moe: match get(&format!("{CONFIG_PREFIX}moe_experts")) {
            None => None,
            Some(_) => Some(crate::config::MoeSpec {
                experts: int("moe_experts")?,
                top_k: int("moe_top_k")?,
                capacity_factor: float("moe_capacity_factor")?,
                aux_weight: float("moe_aux_weight")?,
            }),
        },
    };
    cfg.validate()
        .map_err(|e| io_err(path, format!("stored config is invalid: {e}")))?;
    Ok(cfg)
}

/// The first field where `a` and `b` differ, as `(name, a's value, b's value)`.
pub(super) fn config_diff(a: &ModelConfig, b: &ModelConfig) -> Option<(String, String, String)> {
    let (ma, mb) = (config_to_metadata(a), config_to_metadata(b));
    let keys: std::collections::BTreeSet<&String> = ma.keys().chain(mb.keys()).collect();
    for k in keys {
        let (va, vb) = (ma.get(k), mb.get(k));
        if va != vb {
            let s = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(none)".into());
            return Some((
                k.trim_start_matches(CONFIG_PREFIX).to_string(),
                s(va),
                s(vb),
            ));
        }
    }
    None
}

/// Longest sequence a config read from a file may declare (16 Mi tokens): rotary models store
/// no tensor of the sequence length, so nothing in the file bounds it, and a reader sizes its
/// caches by it.
pub const MAX_FILE_SEQ_LEN: usize = 1 << 24;

/// Refuses a config read from a file (`path`, `tensors` tensors and `data_bytes` bytes of
/// data) that the file cannot hold, before its layout is built (which takes time and memory
/// in the number of layers and allocates every parameter): every layer has tensors of its
/// own, and the embedding, each block's QKV and first FFN matrix are stored tensors of at
/// least 4 bytes per element.
pub(crate) fn check_fits(
    path: &str,
    cfg: &ModelConfig,
    tensors: usize,
    data_bytes: u64,
) -> Result<()> {
    let elems = data_bytes / 4;
    let too_big = |what: &str, n: Option<u64>| {
        io_err(
            path,
            format!(
                "the config in the metadata needs {what} of {} elements, the file holds {data_bytes} bytes",
                n.map_or("more than 2^64".into(), |n| n.to_string())
            ),
        )
    };
    if cfg.layers > tensors {
        return Err(io_err(
            path,
            format!(
                "the config in the metadata has {} layers, the file {tensors} tensors",
                cfg.layers
            ),
        ));
    }
    if cfg.seq_len > MAX_FILE_SEQ_LEN {
        return Err(io_err(
            path,
            format!(
                "sequence length {} in the metadata is over {MAX_FILE_SEQ_LEN}",
                cfg.seq_len
            ),
        ));
    }
    // Each is a dimension of a stored tensor; bounded first, so the products below cannot
    // overflow in the config's own arithmetic (QKV width, the SwiGLU doubling).
    for (what, n) in [("a model width", cfg.d_model), ("an FFN width", cfg.ffn)] {
        if n as u64 > elems {
            return Err(too_big(what, Some(n as u64)));
        }
    }
    let c = cfg.d_model as u64;
    for (what, rows) in [
        ("an embedding", cfg.vocab as u64),
        ("a QKV matrix", cfg.qkv_dim() as u64),
        ("an FFN matrix", cfg.ffn_in_dim() as u64),
    ] {
        match rows.checked_mul(c) {
            Some(n) if n <= elems => {}
            n => return Err(too_big(what, n)),
        }
    }
    Ok(())
}
