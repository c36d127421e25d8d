//! Golden tests: Flotilla's f32 decoder against a PyTorch reference.
//!
//! `tests/fixtures/golden_{gpt2,llama}.safetensors` are written by
//! `scripts/golden/make_fixtures.py` (no Python is needed here): a tiny
//! GPT-2-style and a tiny Llama-style config (in the metadata), float32
//! parameters under Flotilla's names, a batch of tokens and targets, and
//! PyTorch's logits, mean cross-entropy loss and every parameter gradient
//! (`grad.<name>`), evaluated in float64 from the float32 inputs and
//! rounded to float32.
//!
//! Agreement is measured per tensor as the maximum absolute difference
//! relative to the reference's largest magnitude:
//!
//! `max_i |ours_i - torch_i| <= 1e-5 * max_i |torch_i|`
//!
//! for the logits, the loss and each parameter gradient, with the forward
//! and backward run on `Threads::new(2)`, with and without recomputation. A
//! failure names the worst tensor and lists every tensor over the bound.
use model::config::ModelConfig;
use model::interop::{TensorFile, load_flotilla_with_config};
use model::layout::Layout;
use model::model::Model;
use model::{ModelError, Threads};
use std::path::PathBuf;

/// The relative bound of the agreement measure (see the crate doc).
const TOL: f64 = 1e-5;

/// One fixture, loaded.
struct Fixture {
    name: String,
    cfg: ModelConfig,
    layout: Layout,
    params: Vec<f32>,
    batch: usize,
    seq: usize,
    tokens: Vec<u32>,
    targets: Vec<u32>,
    logits: Vec<f32>,
    loss: f32,
    grads: Vec<f32>,
}

fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("golden_{name}.safetensors"))
}

fn load(name: &str) -> Result<Fixture, ModelError> {
    let path = fixture_path(name);
    let (cfg, params) = load_flotilla_with_config(&path)?;
    let f = TensorFile::open(&path)?;
    let layout = Layout::new(&cfg);
    let grads = f.read_flat(&layout, "grad.")?;
    let (ts, tokens) = f.read_ids("tokens")?;
    let (gs, targets) = f.read_ids("targets")?;
    assert_eq!(ts.len(), 2, "{name}: tokens must be (B, T), got {ts:?}");
    assert_eq!(ts, gs, "{name}: tokens and targets shapes differ");
    let (batch, seq) = (ts[0], ts[1]);
    let logits = f.read_f32_shaped("logits", &[batch * seq, cfg.vocab])?;
    let (ls, loss) = f.read_f32("loss")?;
    assert_eq!(
        ls.iter().product::<usize>(),
        1,
        "{name}: loss must hold one value, shape {ls:?}"
    );
    Ok(Fixture {
        name: name.into(),
        cfg,
        layout,
        params,
        batch,
        seq,
        tokens,
        targets,
        logits,
        loss: loss[0],
        grads,
    })
}

/// `max|ours - torch| / max|torch|` (0 when both are all zero), and `max|torch|`.
fn rel_err(ours: &[f32], torch: &[f32]) -> (f64, f64) {
    assert_eq!(ours.len(), torch.len());
    let diff = ours
        .iter()
        .zip(torch)
        .map(|(&a, &b)| (a as f64 - b as f64).abs())
        .fold(0.0, f64::max);
    let scale = torch.iter().map(|&b| (b as f64).abs()).fold(0.0, f64::max);
    let rel = if scale > 0.0 {
        diff / scale
    } else if diff == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    (rel, scale)
}

/// Run the fixture through Flotilla and return `(tensor, relative error, max|torch|)`
/// for the logits, the loss and every parameter gradient.
fn compare(fx: &Fixture, recompute: bool) -> Vec<(String, f64, f64)> {
    let th = Threads::new(2).expect("2 threads");
    let mut m = Model::<f32>::new(&fx.cfg, fx.batch, fx.seq, recompute).expect("model");
    let loss = m
        .forward(&th, &fx.params, &fx.tokens, Some(&fx.targets))
        .expect("forward")
        .expect("loss");
    let logits = m.logits().to_vec();
    let mut grads = vec![0.0f32; fx.layout.total];
    m.backward(&th, &fx.params, &mut grads).expect("backward");
    let mut rows = Vec::new();
    let (r, s) = rel_err(&logits, &fx.logits);
    rows.push(("logits".to_string(), r, s));
    let torch_loss = fx.loss as f64;
    rows.push((
        "loss".to_string(),
        (loss - torch_loss).abs() / torch_loss.abs(),
        torch_loss.abs(),
    ));
    for e in &fx.layout.entries {
        let (r, s) = rel_err(&grads[e.range()], &fx.grads[e.range()]);
        rows.push((format!("grad.{}", e.name), r, s));
    }
    rows
}

fn check(name: &str) {
    let fx = load(name).unwrap_or_else(|e| panic!("loading fixture {name}: {e}"));
    for recompute in [false, true] {
        let rows = compare(&fx, recompute);
        let label = format!("{} (recompute {recompute})", fx.name);
        for (t, r, s) in &rows {
            println!("{label}: {t:<28} rel {r:.2e}  (max|torch| {s:.3e})");
        }
        let worst = rows
            .iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .expect("rows");
        println!(
            "{label}: worst {} rel {:.2e} over {} tensors",
            worst.0,
            worst.1,
            rows.len()
        );
        let over: Vec<String> = rows
            .iter()
            .filter(|(_, r, _)| r.is_nan() || *r > TOL)
            .map(|(t, r, _)| format!("{t} {r:.2e}"))
            .collect();
        assert!(
            over.is_empty(),
            "{label}: worst tensor {} at {:.3e} relative (bound {TOL:e}); over the bound: {}",
            worst.0,
            worst.1,
            over.join(", ")
        );
    }
}

#[test]
fn gpt2_matches_pytorch() {
    check("gpt2");
}

#[test]
fn llama_matches_pytorch() {
    check("llama");
}

#[test]
fn fixtures_describe_the_intended_configs() {
    let g = load("gpt2").unwrap();
    assert_eq!(g.cfg, ModelConfig::gpt2(2, 4, 32, 16, 64));
    let l = load("llama").unwrap();
    assert_eq!(l.cfg, ModelConfig::llama(2, 4, 2, 32, 48, 16, 64));
    for fx in [&g, &l] {
        assert_eq!((fx.batch, fx.seq), (2, 16), "{}", fx.name);
        let size = std::fs::metadata(fixture_path(&fx.name)).unwrap().len();
        assert!(size < 400_000, "{}: fixture is {size} bytes", fx.name);
    }
}
