//! Hugging Face export of the golden fixtures' models.
//!
//! Each case takes a golden fixture's config and parameters (or a variant of
//! the config, filling tensors the fixture lacks deterministically), computes
//! Flotilla's logits on the fixture's tokens, writes a Hugging Face directory
//! with `export_hf` plus `write_reference`, and checks that `import_hf` gives
//! back the same config and bit-identical parameters.
//!
//! When `FLOTILLA_HF_CHECK_PYTHON` names a Python interpreter that can import
//! `torch`, `transformers` and `safetensors`, it also runs
//! `scripts/hf_check.py` on the directory (transformers' own model on the
//! same tokens, relative logits difference at most 1e-4) and requires it to
//! succeed; otherwise that step is skipped with a note on stderr.
use model::Threads;
use model::config::{Activation, ModelConfig, Positions};
use model::interop::{
    TensorFile, export_hf, import_hf, load_flotilla_with_config, read_reference, write_reference,
};
use model::layout::Layout;
use model::model::Model;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("golden_{name}.safetensors"))
}

/// Parameters for `cfg`: the fixture's tensor where it has one of that name
/// and shape, otherwise `scale * sin(...)` (deterministic).
fn params_for(cfg: &ModelConfig, f: &TensorFile, scale: f32) -> Vec<f32> {
    let layout = Layout::new(cfg);
    let mut p = vec![0.0f32; layout.total];
    for (k, e) in layout.entries.iter().enumerate() {
        let dst = &mut p[e.range()];
        match f.read_f32_shaped(&e.name, &e.shape) {
            Ok(v) => dst.copy_from_slice(&v),
            Err(_) => dst
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = scale * ((i as f32) * 0.713 + k as f32).sin()),
        }
    }
    p
}

/// A Python that can run the check, if `FLOTILLA_HF_CHECK_PYTHON` names one.
fn checker() -> Option<String> {
    let py = std::env::var("FLOTILLA_HF_CHECK_PYTHON")
        .ok()
        .filter(|s| !s.is_empty())?;
    let probe = Command::new(&py)
        .args(["-c", "import torch, transformers, safetensors"])
        .output();
    match probe {
        Ok(o) if o.status.success() => Some(py),
        Ok(o) => {
            eprintln!(
                "FLOTILLA_HF_CHECK_PYTHON={py} cannot import torch/transformers/safetensors; skipping the HF check: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            None
        }
        Err(e) => {
            eprintln!("FLOTILLA_HF_CHECK_PYTHON={py} cannot be run ({e}); skipping the HF check");
            None
        }
    }
}

fn run_check(py: &str, dir: &Path) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/hf_check.py");
    let out = Command::new(py)
        .arg(&script)
        .arg(dir)
        .output()
        .expect("run hf_check.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{}", stdout.trim());
    if !stderr.trim().is_empty() {
        println!("hf_check.py stderr:\n{}", stderr.trim());
    }
    assert!(
        out.status.success(),
        "hf_check.py {} failed ({}):\n{stdout}\n{stderr}",
        dir.display(),
        out.status
    );
}

fn case(label: &str, fixture_name: &str, edit: impl Fn(&mut ModelConfig), fill_scale: f32) {
    let path = fixture(fixture_name);
    let (mut cfg, _) = load_flotilla_with_config(&path).expect("fixture");
    edit(&mut cfg);
    let f = TensorFile::open(&path).expect("fixture");
    let params = params_for(&cfg, &f, fill_scale);
    let (shape, tokens) = f.read_ids("tokens").expect("tokens");
    let (batch, seq) = (shape[0], shape[1]);

    let th = Threads::new(2).expect("threads");
    let mut m = Model::<f32>::new(&cfg, batch, seq, false).expect("model");
    m.forward(&th, &params, &tokens, None).expect("forward");
    let logits = m.logits().to_vec();

    let dir =
        std::env::temp_dir().join(format!("flotilla-hf-export-{}-{label}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    export_hf(&dir, &cfg, &params).expect("export_hf");
    write_reference(&dir, batch, &tokens, &logits).expect("write_reference");

    let (cfg2, params2) = import_hf(&dir).expect("import_hf");
    assert_eq!(cfg2, cfg, "{label}: config round trip");
    assert_eq!(params2.len(), params.len());
    let first_diff = params2
        .iter()
        .zip(&params)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    assert_eq!(
        first_diff, None,
        "{label}: parameters differ after the round trip"
    );
    let (b2, t2, l2, v2) = read_reference(&dir).expect("read_reference");
    assert_eq!((b2, &t2, v2), (batch, &tokens, cfg.vocab));
    assert_eq!(l2, logits);

    match checker() {
        Some(py) => {
            print!("{label}: ");
            run_check(&py, &dir);
        }
        None => eprintln!(
            "{label}: FLOTILLA_HF_CHECK_PYTHON not usable; checked the export round trip only"
        ),
    }
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn gpt2_golden_exports() {
    case("gpt2", "gpt2", |_| {}, 0.0);
}

#[test]
fn gpt2_gelu_new_untied_exports() {
    case(
        "gpt2-gelu-new-untied",
        "gpt2",
        |c| {
            c.activation = Activation::GeluTanh;
            c.tied_embeddings = false;
        },
        0.3,
    );
}

#[test]
fn llama_golden_exports() {
    case("llama", "llama", |_| {}, 0.0);
}

#[test]
fn llama_tied_with_biases_exports() {
    case(
        "llama-tied-bias",
        "llama",
        |c| {
            c.tied_embeddings = true;
            c.bias = true;
            c.positions = Positions::Rope { theta: 500_000.0 };
            c.norm_eps = 1e-6;
        },
        0.05,
    );
}
