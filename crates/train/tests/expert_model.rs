//! Expert parallelism inside a trained model (issue 8, 000 "专家并行（混合专家模型）", F49-F50):
//! a 2-layer MoE decoder (C = 32, 4 heads, E = 4 experts, top-1 and top-2, capacity factor
//! low enough to drop tokens) trained with AdamW and clipping. EP = 2 and EP = 4 on shares of
//! the global batch against EP = 1 on the whole batch; repeated runs bit-identical; the loss
//! falls on the Markov corpus; a group size not dividing E refused.
use comm::group::GroupConfig;
use comm::local::run_threads;
use model::optim::AdamWConfig;
use train::DataSpec;
use train::expert::{
    MoeConfig, MoeModelConfig, MoeModelLayout, MoeStepStats, MoeTrainConfig, MoeTrainer,
};

/// Global batch: 4 rows of 16 tokens (64 tokens routed per layer and step).
const GLOBAL_ROWS: usize = 4;
/// The clip, below the early gradient norms so clipping acts.
const CLIP: f64 = 0.5;

fn model_cfg(top_k: usize, capacity_factor: f64) -> MoeModelConfig {
    MoeModelConfig {
        vocab: 64,
        seq_len: 16,
        layers: 2,
        heads: 4,
        moe: MoeConfig {
            experts: 4,
            top_k,
            channels: 32,
            hidden: 64,
            capacity_factor,
            aux_weight: 0.01,
        },
        norm_eps: 1e-5,
    }
}

fn train_cfg(model: MoeModelConfig, batch: usize) -> MoeTrainConfig {
    MoeTrainConfig {
        model,
        batch,
        seq_len: 16,
        lr: 3e-3,
        adamw: AdamWConfig::default(),
        grad_clip: Some(CLIP),
        seed: 7,
        threads: 1,
        data: DataSpec::Markov { branching: 4 },
    }
}

/// Per-step stats and the gathered (ep = 1 layout) final parameters of `steps` steps on
/// `ep` ranks, the global batch split evenly.
fn run(ep: usize, model: MoeModelConfig, steps: usize) -> (Vec<MoeStepStats>, Vec<f32>) {
    let cfg = train_cfg(model, GLOBAL_ROWS / ep);
    let out = run_threads(ep, GroupConfig::default(), move |g| {
        let mut t = MoeTrainer::new(cfg.clone(), g).expect("trainer");
        let stats: Vec<_> = (0..steps).map(|_| t.step().expect("step")).collect();
        Ok((stats, t.params().to_vec()))
    })
    .expect("threads");
    let mut ranks: Vec<_> = out.into_iter().map(|r| r.expect("rank")).collect();
    for (r, (s, _)) in ranks.iter().enumerate().skip(1) {
        let l0: Vec<f64> = ranks[0].0.iter().map(|s| s.loss).collect();
        let lr: Vec<f64> = s.iter().map(|s| s.loss).collect();
        assert_eq!(l0, lr, "rank {r} reports other losses than rank 0");
    }
    let shards: Vec<Vec<f32>> = ranks.iter().map(|(_, p)| p.clone()).collect();
    // The dense part and the routers are replicas: bit-identical on every rank.
    let l0 = MoeModelLayout::new(model, ep, 0).unwrap();
    for (r, s) in shards.iter().enumerate() {
        let l = MoeModelLayout::new(model, ep, r).unwrap();
        assert!(
            s[..l.dense] == shards[0][..l0.dense],
            "rank {r}: dense part differs"
        );
        for (b, b0) in l.blocks.iter().zip(&l0.blocks) {
            let router = &s[l.router(b)];
            assert!(
                router == &shards[0][l0.router(b0)],
                "rank {r}: router differs"
            );
        }
    }
    let whole = MoeModelLayout::gather(model, &shards).expect("gather");
    (ranks.swap_remove(0).0, whole)
}

/// max_i |a_i − b_i| / max_i |b_i|, and max_i |a_i − b_i|.
fn rel_diff(a: &[f32], b: &[f32]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    let abs = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max);
    let scale = b.iter().map(|&y| f64::from(y.abs())).fold(0.0, f64::max);
    (abs / scale, abs)
}

/// EP 2 and EP 4 against EP 1 over 3 steps: per-step losses, aux losses and norms within
/// 1e-5 relative, final parameters within 1e-5 of the largest parameter.
fn ep_matches_one_process(top_k: usize, capacity_factor: f64) {
    let model = model_cfg(top_k, capacity_factor);
    let (ref_stats, ref_params) = run(1, model, 3);
    let drops: usize = ref_stats.iter().map(|s| s.dropped_assignments()).sum();
    assert!(
        drops > 0,
        "capacity factor {capacity_factor} dropped nothing"
    );
    assert!(
        ref_stats[0].norm > CLIP,
        "clipping never acted: {}",
        ref_stats[0].norm
    );
    for ep in [2, 4] {
        let (stats, params) = run(ep, model, 3);
        for (i, (s, r)) in stats.iter().zip(&ref_stats).enumerate() {
            assert_eq!(
                s.dropped_assignments(),
                r.dropped_assignments(),
                "top-{top_k} ep {ep} step {i}: other tokens dropped"
            );
            for (what, a, b) in [
                ("loss", s.loss, r.loss),
                ("aux", s.aux, r.aux),
                ("norm", s.norm, r.norm),
            ] {
                let rel = (a - b).abs() / b.abs();
                println!("top-{top_k} ep {ep} step {i} {what}: {a} vs {b}, rel {rel:.3e}");
                assert!(
                    rel < 1e-5,
                    "top-{top_k} ep {ep} step {i}: {what} {a} vs {b}"
                );
            }
        }
        let (rel, abs) = rel_diff(&params, &ref_params);
        println!(
            "top-{top_k} ep {ep}: params max |diff| {abs:.3e}, relative {rel:.3e}, {drops} drops over 3 steps (ep 1)"
        );
        assert!(
            rel < 1e-5,
            "top-{top_k} ep {ep}: params differ by {rel:.3e} relative"
        );
    }
}

#[test]
fn ep_2_and_4_match_ep_1_top1_with_drops() {
    ep_matches_one_process(1, 1.0);
}

#[test]
fn ep_2_and_4_match_ep_1_top2_with_drops() {
    ep_matches_one_process(2, 0.75);
}

#[test]
fn repeated_runs_are_bit_identical() {
    let model = model_cfg(2, 0.75);
    let (s1, p1) = run(2, model, 3);
    let (s2, p2) = run(2, model, 3);
    let bits = |s: &[MoeStepStats]| -> Vec<(u64, u64, u64)> {
        s.iter()
            .map(|s| (s.loss.to_bits(), s.aux.to_bits(), s.norm.to_bits()))
            .collect()
    };
    assert_eq!(bits(&s1), bits(&s2));
    let b = |p: &[f32]| p.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(b(&p1) == b(&p2), "parameters differ between runs");
}

#[test]
fn loss_decreases_on_markov() {
    let (stats, _) = run(2, model_cfg(2, 1.25), 20);
    let losses: Vec<f64> = stats.iter().map(|s| s.loss).collect();
    println!("losses: {losses:?}");
    let last = losses[losses.len() - 3..].iter().sum::<f64>() / 3.0;
    assert!(
        last < losses[0] - 0.3,
        "loss did not fall: first {} last-3 mean {last}",
        losses[0]
    );
}

#[test]
fn ep_not_dividing_experts_is_refused() {
    let cfg = train_cfg(model_cfg(1, 1.0), 1);
    let out = run_threads(3, GroupConfig::default(), move |g| {
        Ok(MoeTrainer::new(cfg.clone(), g).err().map(|e| e.to_string()))
    })
    .expect("threads");
    for r in out {
        let msg = r
            .expect("rank")
            .expect("ep 3 with 4 experts must be refused");
        assert!(msg.contains("experts") && msg.contains("ep (3)"), "{msg}");
    }
    let mut bad = model_cfg(1, 1.0);
    bad.heads = 5;
    let e = MoeModelLayout::new(bad, 1, 0).unwrap_err().to_string();
    assert!(e.contains("heads"), "{e}");
}

/// Every rank's tensors tile its buffer exactly, and cutting the ep = 1 initialisation into
/// shards and gathering them back is the identity.
#[test]
fn layout_tiles_and_shards_round_trip() {
    let model = model_cfg(2, 1.0);
    let whole = MoeModelLayout::init_whole(model, 3).unwrap();
    for ep in [1, 2, 4] {
        let mut shards = Vec::new();
        for r in 0..ep {
            let l = MoeModelLayout::new(model, ep, r).unwrap();
            let mut ranges = vec![l.wte.clone(), l.wpe.clone(), l.lnf.all(), l.head.clone()];
            for b in &l.blocks {
                ranges.extend([
                    b.ln1.all(),
                    b.qkv.all(),
                    b.proj.all(),
                    b.ln2.all(),
                    b.moe.clone(),
                ]);
            }
            ranges.sort_by_key(|r| r.start);
            let mut at = 0;
            for r in &ranges {
                assert_eq!(r.start, at, "ep {ep} range {r:?}: gap or overlap");
                at = r.end;
            }
            assert_eq!(at, l.total, "ep {ep}: ranges do not reach the end");
            shards.push(l.shard(&whole).unwrap());
        }
        assert!(
            MoeModelLayout::gather(model, &shards).unwrap() == whole,
            "ep {ep}"
        );
    }
}
