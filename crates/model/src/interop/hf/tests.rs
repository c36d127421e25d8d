//! Unit tests of the Hugging Face export and import.
use super::*;
use crate::interop::safetensors_io::TensorWriter;
use serde_json::json;
use std::path::PathBuf;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flotilla-hf-unit-{}-{name}", std::process::id()));
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
fn a_bf16_export_imports_as_the_rounded_weights() {
    for (i, cfg) in configs().into_iter().enumerate() {
        let d = tmp(&format!("bf16-{i}"));
        let p = params(&cfg);
        export_hf_as(&d, &cfg, &p, HfDtype::Bf16).unwrap();
        let f = TensorFile::open(d.join(HF_WEIGHTS)).unwrap();
        assert!(f.names().iter().all(|n| f.dtype(n).unwrap() == "BF16"));
        assert_eq!(
            read_hf_config(&d).unwrap(),
            (hf_arch(&cfg).unwrap(), cfg.clone())
        );
        let text = std::fs::read_to_string(d.join(HF_CONFIG)).unwrap();
        assert!(text.contains("\"torch_dtype\": \"bfloat16\""), "{text}");
        let (c2, p2) = import_hf(&d).unwrap();
        assert_eq!(c2, cfg);
        let mut want = p.clone();
        HfDtype::Bf16.round(&mut want);
        assert!(
            want.iter().zip(&p).any(|(a, b)| a != b),
            "rounding changes some"
        );
        assert!(
            p2.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "config {i}"
        );
        std::fs::remove_dir_all(d).unwrap();
    }
    assert_eq!("bfloat16".parse::<HfDtype>(), Ok(HfDtype::Bf16));
    assert_eq!("F32".parse::<HfDtype>(), Ok(HfDtype::F32));
    assert!(
        "f16"
            .parse::<HfDtype>()
            .unwrap_err()
            .contains("f32 or bf16")
    );
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
    let never = std::env::temp_dir().join(format!("flotilla-hf-unit-{}-never", std::process::id()));
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
