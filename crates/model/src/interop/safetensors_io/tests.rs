//! Unit tests of the safetensors reader and writer and Flotilla checkpoints.
use super::*;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flotilla-st-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn reason(e: ModelError) -> String {
    match e {
        ModelError::Io { reason, .. } => reason,
        other => panic!("expected an Io error, got {other:?}"),
    }
}

fn sample(cfg: &ModelConfig) -> (Layout, Vec<f32>) {
    let layout = Layout::new(cfg);
    let params = (0..layout.total).map(|i| (i as f32 * 0.37).sin()).collect();
    (layout, params)
}

#[test]
fn flotilla_round_trip_is_exact() {
    let d = tmp("rt");
    for cfg in [
        ModelConfig::gpt2(2, 4, 32, 16, 64),
        ModelConfig::llama(2, 4, 2, 32, 48, 16, 64),
    ] {
        let (layout, params) = sample(&cfg);
        let p = d.join("m.safetensors");
        save_flotilla(&p, &cfg, &layout, &params).unwrap();
        let back = load_flotilla(&p, &cfg, &layout).unwrap();
        assert!(
            back.iter()
                .zip(&params)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        let (c2, p2) = load_flotilla_with_config(&p).unwrap();
        assert_eq!(c2, cfg);
        assert_eq!(p2, params);
    }
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn bad_files_are_named() {
    let d = tmp("bad");
    let cfg = ModelConfig::gpt2(2, 4, 32, 16, 64);
    let (layout, params) = sample(&cfg);
    let p = d.join("m.safetensors");
    save_flotilla(&p, &cfg, &layout, &params).unwrap();
    // Truncated.
    let bytes = std::fs::read(&p).unwrap();
    let t = d.join("t.safetensors");
    std::fs::write(&t, &bytes[..bytes.len() - 10]).unwrap();
    assert!(reason(load_flotilla(&t, &cfg, &layout).unwrap_err()).contains("truncated"));
    std::fs::write(&t, &bytes[..5]).unwrap();
    assert!(reason(load_flotilla(&t, &cfg, &layout).unwrap_err()).contains("too short"));
    // Missing file.
    assert!(
        reason(load_flotilla(d.join("nope"), &cfg, &layout).unwrap_err()).contains("cannot read")
    );
    // Different config.
    let other = ModelConfig::gpt2(3, 4, 32, 16, 64);
    let r = reason(load_flotilla(&p, &other, &Layout::new(&other)).unwrap_err());
    assert!(r.contains("layers"), "{r}");
    // Wrong shape, missing tensor, wrong dtype.
    let mut w = TensorWriter::new(&t);
    for e in &layout.entries {
        match e.name.as_str() {
            "wpe" => w.add_f32("wpe", &[8, 64], &params[e.range()]).unwrap(),
            "ln_f.bias" => {}
            "h.1.ln2.weight" => w.add_ids(&e.name, &e.shape, &vec![1; e.numel()]).unwrap(),
            _ => w.add_f32(&e.name, &e.shape, &params[e.range()]).unwrap(),
        }
    }
    w.write().unwrap();
    let f = TensorFile::open(&t).unwrap();
    let r = reason(f.read_flat(&layout, "").unwrap_err());
    assert!(
        r.contains("`wpe`") && r.contains("[8, 64]") && r.contains("[16, 32]"),
        "{r}"
    );
    assert!(reason(f.read_f32("ln_f.bias").unwrap_err()).contains("`ln_f.bias` is missing"));
    let r = reason(f.read_f32("h.1.ln2.weight").unwrap_err());
    assert!(r.contains("`h.1.ln2.weight`") && r.contains("I64"), "{r}");
    let r = reason(load_flotilla_with_config(&t).unwrap_err());
    assert!(r.contains("no model config"), "{r}");
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn half_precision_is_widened() {
    let d = tmp("half");
    let p = d.join("h.safetensors");
    let vals = [1.5f32, -0.25, 3.0];
    let f16: Vec<u8> = vals
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
        .collect();
    let bf16: Vec<u8> = vals
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
        .collect();
    let mut w = TensorWriter::new(&p);
    w.push("a", Dtype::F16, &[3], 3, f16).unwrap();
    w.push("b", Dtype::BF16, &[3], 3, bf16).unwrap();
    w.write().unwrap();
    let f = TensorFile::open(&p).unwrap();
    assert_eq!(f.read_f32("a").unwrap().1, vals);
    assert_eq!(f.read_f32_shaped("b", &[3]).unwrap(), vals);
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn reference_round_trip() {
    let d = tmp("ref");
    let tokens = [1u32, 2, 3, 4, 5, 6];
    let logits: Vec<f32> = (0..6 * 5).map(|i| i as f32).collect();
    write_reference(&d, 2, &tokens, &logits).unwrap();
    let (b, t, l, v) = read_reference(&d).unwrap();
    assert_eq!((b, t.as_slice(), &l, v), (2, &tokens[..], &logits, 5));
    assert!(write_reference(&d, 4, &tokens, &logits).is_err());
    std::fs::remove_dir_all(d).unwrap();
}
