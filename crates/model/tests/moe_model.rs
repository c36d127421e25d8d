//! The one model with a mixture-of-experts feed-forward in every block (ep = 1): finite
//! differences of the whole objective (mean cross-entropy plus the weighted aux losses) on the
//! f64 path, for GPT-2-style (GELU, biases, top-2) and Llama-style (SwiGLU, no biases, top-1)
//! experts; recomputation bit-identical; the layout names every expert; bad settings refused.
use model::Threads;
use model::config::{ModelConfig, MoeSpec};
use model::gradcheck::{assert_tensors_match, numeric_grad};
use model::init::init_params;
use model::layout::Layout;
use model::model::Model;

fn moe(experts: usize, top_k: usize, aux: f64) -> MoeSpec {
    MoeSpec {
        experts,
        top_k,
        // Large enough that nothing is dropped (a drop is a step in the objective).
        capacity_factor: 4.0,
        aux_weight: aux,
    }
}

fn gpt2_moe() -> ModelConfig {
    let mut c = ModelConfig::gpt2(2, 2, 8, 5, 11);
    c.ffn = 12;
    c.moe = Some(moe(4, 2, 0.05));
    c
}

fn llama_moe() -> ModelConfig {
    let mut c = ModelConfig::llama(2, 4, 2, 8, 6, 5, 11);
    c.moe = Some(moe(3, 1, 0.1));
    c
}

fn batch(cfg: &ModelConfig, b: usize) -> (Vec<u32>, Vec<u32>) {
    let n = b * cfg.seq_len;
    let toks: Vec<u32> = (0..n).map(|i| ((i * 7 + 3) % cfg.vocab) as u32).collect();
    let tgts: Vec<u32> = (0..n).map(|i| ((i * 5 + 1) % cfg.vocab) as u32).collect();
    (toks, tgts)
}

/// The objective the backward differentiates: the mean cross-entropy plus each block's
/// weighted aux loss.
fn objective(m: &mut Model<f64>, th: &Threads, p: &[f64], toks: &[u32], tgts: &[u32]) -> f64 {
    let ce = m.forward(th, p, toks, Some(tgts)).unwrap().unwrap();
    let w = m.config().moe.unwrap().aux_weight;
    ce + w * m.moe_stats().iter().map(|s| s.aux_loss).sum::<f64>()
}

fn check(cfg: ModelConfig) {
    let th = Threads::new(2).unwrap();
    let b = 2;
    let mut m = Model::<f64>::new(&cfg, b, cfg.seq_len, false).unwrap();
    let mut p = vec![0.0; m.n_params()];
    init_params(&cfg, m.layout(), 7, &mut p);
    let noise = model::gradcheck::rand_vec(11, p.len(), 0.1);
    let p: Vec<f64> = p.iter().zip(noise).map(|(x, n)| x * 5.0 + n).collect();
    let (toks, tgts) = batch(&cfg, b);
    objective(&mut m, &th, &p, &toks, &tgts);
    assert_eq!(m.moe_stats().len(), cfg.layers);
    assert!(m.moe_stats().iter().all(|s| s.dropped_assignments == 0));
    let mut g = vec![0.0; p.len()];
    m.backward(&th, &p, &mut g).unwrap();
    let num = numeric_grad(&p, 1e-5, |q| objective(&mut m, &th, q, &toks, &tgts));
    assert_tensors_match(m.layout(), &g, &num, 1e-5);
}

#[test]
fn gpt2_experts_gradients_match_finite_differences() {
    check(gpt2_moe());
}

#[test]
fn llama_experts_gradients_match_finite_differences() {
    check(llama_moe());
}

#[test]
fn recomputed_experts_give_identical_gradients() {
    let cfg = gpt2_moe();
    let th = Threads::new(2).unwrap();
    let (toks, tgts) = batch(&cfg, 2);
    let run = |recompute: bool| {
        let mut m = Model::<f32>::new(&cfg, 2, cfg.seq_len, recompute).unwrap();
        let mut p = vec![0f32; m.n_params()];
        init_params(&cfg, m.layout(), 3, &mut p);
        let loss = m.forward(&th, &p, &toks, Some(&tgts)).unwrap().unwrap();
        let mut g = vec![0f32; p.len()];
        m.backward(&th, &p, &mut g).unwrap();
        (
            loss.to_bits(),
            g.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        )
    };
    assert_eq!(run(false), run(true));
}

#[test]
fn the_layout_names_every_expert_and_each_ranks_share() {
    let cfg = gpt2_moe();
    let whole = Layout::new(&cfg);
    let names: Vec<&str> = whole.entries.iter().map(|e| e.name.as_str()).collect();
    assert!(names.contains(&"h.1.moe.router.weight"));
    assert!(names.contains(&"h.0.moe.experts.3.proj.bias"));
    assert!(!names.iter().any(|n| n.contains("mlp.")));
    assert_eq!(whole.experts(), Some(4));
    // Rank 1 of 2 owns experts 2 and 3 of every block: one run per block.
    let owned = whole.owned_expert_ranges(2, 1);
    assert_eq!(owned.len(), cfg.layers);
    for e in whole.entries.iter().filter(|e| e.expert.is_some()) {
        let inside = owned.iter().any(|r| r.contains(&e.offset));
        assert_eq!(inside, e.expert.unwrap() >= 2, "{}", e.name);
    }
    let all: usize = whole.expert_ranges().iter().map(|r| r.len()).sum();
    let half: usize = owned.iter().map(|r| r.len()).sum();
    assert_eq!(all, 2 * half);
    let err = Model::<f32>::parts(&cfg, (1, 5), vec![false; 2], (1, false), (3, 0), false);
    assert!(err.err().unwrap().to_string().contains("experts % ep"));
}

#[test]
fn bad_expert_settings_are_refused_by_name() {
    let mut c = gpt2_moe();
    c.moe = Some(MoeSpec {
        top_k: 3,
        ..moe(4, 2, 0.0)
    });
    assert!(c.validate().unwrap_err().to_string().contains("top_k"));
    c.moe = Some(MoeSpec {
        capacity_factor: 0.0,
        ..moe(4, 2, 0.0)
    });
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .contains("capacity_factor")
    );
    let sp = Model::<f32>::split(&gpt2_moe(), 2, 5, vec![false; 2], (2, true));
    assert!(sp.err().unwrap().to_string().contains("sequence parallel"));
}
