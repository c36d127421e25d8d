//! The MoE trainer under the one run loop's features (issue 27): the learning-rate schedule
//! (a cosine with warmup: the rate of every step is the schedule's), and synchronous
//! checkpoints in which each EP rank writes only what it owns: EP 2 saved at step 3 and
//! resumed to step 6 is bit-identical to the straight 6-step run; the same checkpoint resumed
//! by EP 1 on the same global batch continues within float summation order; another config
//! is refused.
use comm::group::GroupConfig;
use comm::local::run_threads;
use model::optim::{AdamWConfig, Schedule};
use std::path::PathBuf;
use train::DataSpec;
use train::expert::{
    MoeConfig, MoeModelConfig, MoeModelLayout, MoeStepStats, MoeTrainConfig, MoeTrainer,
};

const GLOBAL_ROWS: usize = 4;
const LR: f32 = 3e-3;
const COSINE: Schedule = Schedule::Cosine {
    warmup: 2,
    total: 6,
    min_lr_ratio: 0.1,
};

fn model_cfg() -> MoeModelConfig {
    MoeModelConfig {
        vocab: 64,
        seq_len: 16,
        layers: 2,
        heads: 4,
        moe: MoeConfig {
            experts: 4,
            top_k: 2,
            channels: 32,
            hidden: 64,
            capacity_factor: 1.0,
            aux_weight: 0.01,
        },
        norm_eps: 1e-5,
    }
}

fn train_cfg(ep: usize) -> MoeTrainConfig {
    MoeTrainConfig {
        model: model_cfg(),
        batch: GLOBAL_ROWS / ep,
        seq_len: 16,
        lr: LR,
        adamw: AdamWConfig {
            weight_decay: 0.1,
            ..AdamWConfig::default()
        },
        grad_clip: Some(0.5),
        seed: 11,
        threads: 1,
        data: DataSpec::Markov { branching: 4 },
    }
}

/// What one `ep`-rank run does: resume from `from` if given, train `steps`, save into `to`
/// if given; rank 0's step stats and the gathered parameters.
fn run(
    ep: usize,
    steps: usize,
    from: Option<PathBuf>,
    to: Option<PathBuf>,
) -> (Vec<MoeStepStats>, Vec<f32>) {
    let out = run_threads(ep, GroupConfig::default(), move |g| {
        let mut t = MoeTrainer::new(train_cfg(ep), g)
            .and_then(|t| t.with_schedule(COSINE))
            .expect("trainer")
            .with_decay_all(true);
        if let Some(dir) = &from {
            assert_eq!(t.resume(dir).expect("resume"), Some(3));
            assert_eq!(t.steps_done(), 3);
        }
        let stats: Vec<_> = (0..steps).map(|_| t.step().expect("step")).collect();
        if let Some(dir) = &to {
            assert_eq!(t.save_checkpoint(dir, "moe-test").expect("save"), 3);
        }
        Ok((stats, t.params().to_vec()))
    })
    .expect("threads");
    let ranks: Vec<_> = out.into_iter().map(|r| r.expect("rank")).collect();
    let shards: Vec<Vec<f32>> = ranks.iter().map(|(_, p)| p.clone()).collect();
    let whole = MoeModelLayout::gather(model_cfg(), &shards).expect("gather");
    (ranks[0].0.clone(), whole)
}

#[test]
fn the_learning_rate_follows_a_cosine_schedule() {
    let (stats, _) = run(2, 6, None, None);
    for (i, s) in stats.iter().enumerate() {
        let want = COSINE.lr_at(LR, i as u64);
        println!("step {i}: lr {} (schedule {want}), loss {}", s.lr, s.loss);
        assert_eq!(s.lr, want, "step {i}");
    }
    assert_eq!(stats[0].lr, 0.0, "warmup starts at 0");
    assert_eq!(stats[2].lr, LR, "the peak after warmup");
    assert!(stats[5].lr < stats[3].lr && stats[5].lr > 0.1 * LR);
}

#[test]
fn ep2_save_and_resume_is_bit_identical_and_ep1_continues_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let (straight, straight_params) = run(2, 6, None, None);
    let (first, _) = run(2, 3, None, Some(dir.clone()));
    // Each rank wrote its own file (its experts, its rows of the replicated tensors).
    let step_dir = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .expect("a step directory");
    let files = std::fs::read_dir(&step_dir).unwrap().count();
    assert!(files >= 2, "{files} entries in {}", step_dir.display());
    let (rest, params) = run(2, 3, Some(dir.clone()), None);
    let resumed: Vec<f64> = first.iter().chain(&rest).map(|s| s.loss).collect();
    let want: Vec<f64> = straight.iter().map(|s| s.loss).collect();
    println!("straight {want:?}\nresumed  {resumed:?}");
    assert_eq!(resumed, want, "EP2 3 + save + resume + 3 vs 6 straight");
    assert!(
        params == straight_params,
        "parameters differ after the resume"
    );
    // EP 1 on the same global batch continues the EP 2 checkpoint.
    let (ep1, ep1_params) = run(1, 3, Some(dir), None);
    for (a, b) in ep1.iter().zip(&straight[3..]) {
        let rel = (a.loss - b.loss).abs() / b.loss;
        println!("ep1 resumed loss {} vs {} ({rel:.2e})", a.loss, b.loss);
        assert!(rel < 1e-5);
    }
    let scale = straight_params.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = ep1_params
        .iter()
        .zip(&straight_params)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    println!(
        "ep1 resumed params within {:.2e} of the largest",
        diff / scale
    );
    assert!(diff / scale < 1e-5);
}

#[test]
fn another_config_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    run(2, 3, None, Some(dir.clone()));
    let out = run_threads(1, GroupConfig::default(), move |g| {
        let mut cfg = train_cfg(1);
        cfg.seed = 12;
        let mut t = MoeTrainer::new(cfg, g).expect("trainer");
        Ok(t.resume(&dir).map_err(|e| e.to_string()))
    })
    .expect("threads");
    let e = out.into_iter().next().unwrap().unwrap().unwrap_err();
    assert!(e.contains("config"), "{e}");
}
