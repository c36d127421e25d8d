//! Shared pieces of the engine tests: a tiny config, runs of N ranks at any ZeRO stage, runs
//! with checkpoints, and the parameter comparison.
#![allow(dead_code)]

use comm::group::{GroupConfig, ProcessGroup};
use comm::local::run_threads;
use model::config::ModelConfig;
use train::zero::Stage;
use train::{DataSpec, StateMemory, TrainConfig, Trainer};

/// A 2-layer GPT on the Markov corpus, `batch` rows of 32 tokens per rank, `steps` steps.
pub fn tiny(batch: usize, steps: u64) -> TrainConfig {
    let mut c = TrainConfig::new(ModelConfig::gpt2(2, 4, 64, 32, 64), steps);
    c.batch = batch;
    c.lr = 3e-3;
    c.threads = 1;
    c.seed = 5;
    c.grad_clip = Some(1.0);
    c.data = DataSpec::Markov { branching: 4 };
    c
}

/// A 2-layer GPT-2 (4 heads, C = 64, F = 256, V = 64) on the Markov corpus, batch 2 of 16
/// tokens, one warmup step then a cosine decay over `steps`, clipping at `clip`: heads divide
/// by 4, for the tensor-parallel tests.
pub fn gpt2_cosine(steps: u64, clip: f64) -> TrainConfig {
    let mut c = TrainConfig::new(ModelConfig::gpt2(2, 4, 64, 16, 64), steps);
    c.schedule = model::optim::schedule::Schedule::Cosine {
        warmup: 1,
        total: steps,
        min_lr_ratio: 0.1,
    };
    c.batch = 2;
    c.lr = 3e-3;
    c.threads = 1;
    c.seed = 5;
    c.grad_clip = Some(clip);
    c.data = DataSpec::Markov { branching: 4 };
    c
}

/// One rank's trainer at ZeRO `stage` (0: plain data parallel) with buckets of `bucket` bytes.
pub fn trainer(cfg: TrainConfig, g: ProcessGroup, stage: u8, bucket: usize) -> Trainer {
    match Stage::from_number(stage).unwrap() {
        Some(s) => Trainer::zero(cfg, g, s, bucket).unwrap(),
        None => Trainer::data_parallel(cfg, g, bucket).unwrap(),
    }
}

/// What a run returns per rank: final parameters, per-step losses, the state's resident bytes
/// after the last step and the model's parameter count.
pub type RankOut = (Vec<f32>, Vec<f64>, StateMemory, usize);

/// `world` ranks train `cfg` for `steps` steps at ZeRO `stage` (0: plain data parallel) with
/// buckets of `bucket` bytes.
pub fn run(world: usize, cfg: TrainConfig, stage: u8, bucket: usize) -> Vec<RankOut> {
    run_threads(world, GroupConfig::for_training().unwrap(), move |g| {
        let steps = cfg.steps;
        let mut t = trainer(cfg.clone(), g, stage, bucket);
        let losses = (0..steps).map(|_| t.step().unwrap().loss).collect();
        let memory = t.state_memory();
        t.gather_params().unwrap();
        Ok((t.params().to_vec(), losses, memory, t.model().n_params()))
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// The largest difference between `a` and `b`, relative to `b`'s largest magnitude (absolute
/// when `b` is all zeros).
pub fn max_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs()));
    let diff = a
        .iter()
        .zip(b)
        .fold(0f64, |m, (&x, &y)| m.max(f64::from(x - y).abs()));
    if scale == 0.0 { diff } else { diff / scale }
}

/// Two ranks train `cfg` to `steps` at ZeRO `stage` (0: plain data parallel), checkpointing
/// every 2 steps into `dir` (asynchronous writes) after resuming from it; returns rank 0's
/// whole parameters.
pub fn with_checkpoints(cfg: TrainConfig, stage: u8, dir: std::path::PathBuf) -> Vec<f32> {
    let out = run_threads(2, GroupConfig::for_training().unwrap(), move |g| {
        let (rank, size) = (g.rank() as u32, g.size() as u32);
        let mut t = trainer(cfg.clone(), g, stage, 16 << 10);
        if rank == 0 {
            train::Checkpointer::resume(&dir, &mut t).unwrap();
        }
        t.group().unwrap().barrier().unwrap();
        if rank != 0 {
            train::Checkpointer::resume(&dir, &mut t).unwrap();
        }
        let ck = train::CheckpointConfig {
            dir: dir.clone(),
            every: 2,
            asynchronous: true,
            auto_mtbf: None,
        };
        let mut ck = train::Checkpointer::new(ck, "zero")
            .unwrap()
            .with_shard(rank, size)
            .unwrap();
        while t.steps_done() < cfg.steps {
            ck.step(&mut t).unwrap();
        }
        ck.finish(&mut t).unwrap();
        t.group().unwrap().barrier().unwrap();
        t.gather_params().unwrap();
        Ok(t.params().to_vec())
    })
    .unwrap();
    out.into_iter().next().unwrap().unwrap()
}

/// `|a - b| / |b|`.
pub fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

/// Asserts each step's (loss, gradient norm) of `got` within `tol` (relative) of `want`'s,
/// printing both; `what` names the run in messages.
pub fn assert_steps_close(what: &str, got: &[(f64, f64)], want: &[(f64, f64)], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: steps");
    for (s, (&(l, n), &(wl, wn))) in got.iter().zip(want).enumerate() {
        println!(
            "{what} step {}: loss {l:.7} vs {wl:.7} (rel {:.2e}), norm {n:.6} vs {wn:.6} (rel \
             {:.2e})",
            s + 1,
            rel(l, wl),
            rel(n, wn)
        );
        assert!(rel(l, wl) < tol, "{what} step {}: loss {l} vs {wl}", s + 1);
        assert!(rel(n, wn) < tol, "{what} step {}: norm {n} vs {wn}", s + 1);
    }
}
