//! Whole-model checks: finite differences on the f64 reference path for a
//! GPT-2-style and a Llama-style tiny model, recomputation equivalence,
//! determinism, the gradient-ready hook, and bad-input errors.
use model::config::ModelConfig;
use model::gradcheck::{assert_tensors_match, numeric_grad};
use model::init::init_params;
use model::model::Model;
use model::{ModelError, Threads};

fn tiny_gpt2() -> ModelConfig {
    ModelConfig::gpt2(2, 2, 8, 5, 11)
}

fn tiny_llama() -> ModelConfig {
    let mut c = ModelConfig::llama(2, 4, 2, 8, 12, 5, 11);
    c.tied_embeddings = false;
    c
}

fn batch(cfg: &ModelConfig, b: usize) -> (Vec<u32>, Vec<u32>) {
    let n = b * cfg.seq_len;
    let toks: Vec<u32> = (0..n).map(|i| ((i * 7 + 3) % cfg.vocab) as u32).collect();
    let tgts: Vec<u32> = (0..n).map(|i| ((i * 5 + 1) % cfg.vocab) as u32).collect();
    (toks, tgts)
}

/// Parameters with larger-than-init values so every path carries signal.
fn params_for(cfg: &ModelConfig, m: &Model<f64>) -> Vec<f64> {
    let mut p = vec![0.0; m.n_params()];
    init_params(cfg, m.layout(), 7, &mut p);
    let noise = model::gradcheck::rand_vec(11, p.len(), 0.1);
    p.iter().zip(noise).map(|(x, n)| x * 5.0 + n).collect()
}

fn check_model(cfg: ModelConfig) {
    let th = Threads::new(2).unwrap();
    let b = 2;
    let mut m = Model::<f64>::new(&cfg, b, cfg.seq_len, false).unwrap();
    let p = params_for(&cfg, &m);
    let (toks, tgts) = batch(&cfg, b);
    m.forward(&th, &p, &toks, Some(&tgts)).unwrap();
    let mut g = vec![0.0; p.len()];
    m.backward(&th, &p, &mut g).unwrap();
    let num = numeric_grad(&p, 1e-5, |q| {
        m.forward(&th, q, &toks, Some(&tgts)).unwrap().unwrap()
    });
    assert_tensors_match(m.layout(), &g, &num, 1e-5);
}

#[test]
fn gpt2_whole_model_gradients_match_finite_differences() {
    check_model(tiny_gpt2());
}

#[test]
fn llama_whole_model_gradients_match_finite_differences() {
    check_model(tiny_llama());
}

#[test]
fn gelu_tanh_untied_model_gradients_match() {
    let mut c = tiny_gpt2();
    c.activation = model::config::Activation::GeluTanh;
    c.tied_embeddings = false;
    check_model(c);
}

fn run_f32(cfg: &ModelConfig, threads: usize, recompute: bool) -> (f64, Vec<f32>, Vec<f32>) {
    let th = Threads::new(threads).unwrap();
    let mut m = Model::<f32>::new(cfg, 2, cfg.seq_len, recompute).unwrap();
    let mut p = vec![0f32; m.n_params()];
    init_params(cfg, m.layout(), 3, &mut p);
    let (toks, tgts) = batch(cfg, 2);
    let loss = m.forward(&th, &p, &toks, Some(&tgts)).unwrap().unwrap();
    let mut g = vec![0f32; p.len()];
    m.backward(&th, &p, &mut g).unwrap();
    (loss, g, p)
}

#[test]
fn recomputation_gives_identical_gradients() {
    for cfg in [tiny_gpt2(), tiny_llama()] {
        let (l1, g1, _) = run_f32(&cfg, 2, false);
        let (l2, g2, _) = run_f32(&cfg, 2, true);
        assert_eq!(l1.to_bits(), l2.to_bits());
        assert!(g1.iter().zip(&g2).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn per_block_recomputation_matches_and_saves_memory() {
    let cfg = tiny_gpt2();
    let (l1, g1, p) = run_f32(&cfg, 2, false);
    let th = Threads::new(2).unwrap();
    let mut m = Model::<f32>::with_recompute(&cfg, 2, cfg.seq_len, vec![true, false]).unwrap();
    let (toks, tgts) = batch(&cfg, 2);
    let l2 = m.forward(&th, &p, &toks, Some(&tgts)).unwrap().unwrap();
    let mut g2 = vec![0f32; p.len()];
    m.backward(&th, &p, &mut g2).unwrap();
    assert_eq!(l1.to_bits(), l2.to_bits());
    assert!(g1.iter().zip(&g2).all(|(a, b)| a.to_bits() == b.to_bits()));
    let full = Model::<f32>::new(&cfg, 8, cfg.seq_len, false)
        .unwrap()
        .activation_bytes();
    let all = Model::<f32>::new(&cfg, 8, cfg.seq_len, true)
        .unwrap()
        .activation_bytes();
    assert!(all < full, "recomputation keeps less: {all} vs {full}");
    assert!(
        Model::<f32>::with_recompute(&cfg, 1, 5, vec![true]).is_err(),
        "one flag per block"
    );
}

#[test]
fn same_inputs_and_threads_give_identical_bits() {
    let cfg = ModelConfig::gpt2(2, 4, 32, 16, 64);
    let (l1, g1, _) = run_f32(&cfg, 2, false);
    let (l2, g2, _) = run_f32(&cfg, 2, false);
    assert_eq!(l1.to_bits(), l2.to_bits());
    assert!(g1.iter().zip(&g2).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn hook_reports_every_gradient_range_once_in_backward_order() {
    let cfg = tiny_gpt2();
    let th = Threads::single();
    let mut m = Model::<f32>::new(&cfg, 1, cfg.seq_len, false).unwrap();
    let mut p = vec![0f32; m.n_params()];
    init_params(&cfg, m.layout(), 1, &mut p);
    let (toks, tgts) = batch(&cfg, 1);
    m.forward(&th, &p, &toks, Some(&tgts)).unwrap();
    let mut g = vec![0f32; p.len()];
    let mut seen = Vec::new();
    m.backward_hooked(&th, &p, &mut g, &mut |r, _| seen.push(r))
        .unwrap();
    let mut covered = vec![0u8; p.len()];
    for r in &seen {
        covered[r.clone()].iter_mut().for_each(|c| *c += 1);
    }
    assert!(
        covered.iter().all(|&c| c == 1),
        "every element reported exactly once"
    );
    assert_eq!(seen.last().unwrap().start, 0, "embeddings come last");
    assert_eq!(seen[0].end, p.len(), "the head comes first");
}

#[test]
fn bad_inputs_are_errors_naming_the_problem() {
    let cfg = tiny_gpt2();
    let th = Threads::single();
    let mut m = Model::<f32>::new(&cfg, 1, cfg.seq_len, false).unwrap();
    let p = vec![0f32; m.n_params()];
    let (mut toks, tgts) = batch(&cfg, 1);
    toks[3] = 99;
    match m.forward(&th, &p, &toks, Some(&tgts)) {
        Err(ModelError::Token {
            what: "tokens",
            id: 99,
            pos: 3,
            ..
        }) => {}
        other => panic!("expected a token error, got {other:?}"),
    }
    assert!(matches!(
        m.forward(&th, &p[1..], &toks, None),
        Err(ModelError::Shape { what: "params", .. })
    ));
    let mut g = vec![0f32; p.len()];
    assert!(
        m.backward(&th, &p, &mut g).is_err(),
        "backward without a forward with targets"
    );
    let mut bad = cfg.clone();
    bad.heads = 3;
    assert!(matches!(
        Model::<f32>::new(&bad, 1, 5, false),
        Err(ModelError::Config { field: "heads", .. })
    ));
    assert!(matches!(
        Model::<f32>::new(&cfg, 1, 6, false),
        Err(ModelError::Config {
            field: "seq_len",
            ..
        })
    ));
    assert!(matches!(
        Model::<f32>::new(&cfg, 0, 5, false),
        Err(ModelError::Config { field: "batch", .. })
    ));
}

#[test]
fn unit_by_unit_passes_equal_the_whole_and_keep_their_order() {
    use model::layout::Unit;
    let cfg = tiny_gpt2();
    let th = Threads::single();
    let mut m = Model::<f32>::new(&cfg, 1, cfg.seq_len, true).unwrap();
    let mut p = vec![0f32; m.n_params()];
    model::init::init_params(&cfg, m.layout(), 3, &mut p);
    let (toks, tgts) = batch(&cfg, 1);
    let whole = m.forward(&th, &p, &toks, Some(&tgts)).unwrap();
    let mut g_whole = vec![0f32; p.len()];
    m.backward(&th, &p, &mut g_whole).unwrap();

    let units = m.layout().units();
    m.begin(&toks, Some(&tgts)).unwrap();
    // Out of order: the first unit is the embedding.
    assert!(m.forward_unit(&th, &p, Unit::Head).is_err());
    for &u in &units {
        m.forward_unit(&th, &p, u).unwrap();
    }
    assert_eq!(m.loss(), whole);
    let mut g = vec![0f32; p.len()];
    assert!(m.backward_unit(&th, &p, &mut g, Unit::Embed).is_err());
    for &u in units.iter().rev() {
        m.backward_unit(&th, &p, &mut g, u).unwrap();
    }
    assert_eq!(g, g_whole);
    // The backward is spent.
    assert!(m.backward_unit(&th, &p, &mut g, Unit::Head).is_err());
    // Units tile the buffer.
    let mut at = 0;
    for &u in &units {
        let r = m.layout().unit_range(u);
        assert_eq!(r.start, at, "{u:?}");
        at = r.end;
    }
    assert_eq!(at, p.len());
}
