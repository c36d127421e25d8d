//! Checkpoints move between the tensor-parallel trainer and the plain and data-parallel
//! [`Trainer`] (issue 8: a checkpoint saved under one layout loads under another and training
//! continues with the same loss). Each test trains 3 steps under one layout, saves, resumes
//! under another for 3 more, and compares the per-step losses and final parameters with a
//! straight 6-step run of one process within float summation-order tolerance: one process ->
//! TP2, ZeRO-2 on 2 ranks -> TP2, TP2 -> one process and 2 data-parallel ranks, TP4 -> TP2. A
//! checkpoint of another model is refused by name.
#[path = "support/common.rs"]
mod common;
use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, Verify};
use comm::group::{GroupConfig, ProcessGroup};
use comm::local::run_threads;
use model::config::ModelConfig;
use train::tensor::TpTrainer;
use train::zero::Stage;
use train::{CheckpointConfig, Checkpointer, TrainConfig, TrainError, Trainer};

const STEPS: u64 = 6;
const HALF: u64 = 3;
const TOL: f64 = 1e-4;

/// A 2-layer GPT-2 (4 heads, C = 64, F = 256, V = 64) on the Markov corpus, 2 micro-batches
/// of 2 rows of 16 tokens per step, warmup then cosine over the 6 steps, clipping.
fn cfg() -> TrainConfig {
    let mut c = common::gpt2_cosine(STEPS, 0.5);
    c.grad_accum = 2;
    c
}

/// The largest difference between `a` and `b`, relative to `b`'s largest magnitude.
fn max_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs()));
    a.iter()
        .zip(b)
        .fold(0f64, |m, (&x, &y)| m.max(f64::from(x - y).abs()))
        / scale
}

fn assert_losses(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (g - w).abs() / w.abs();
        assert!(d < TOL, "{what}: step {} loss {g} vs {w} ({d})", i + 1);
    }
}

/// One process trains `cfg` straight: per-step losses and final parameters.
fn straight(cfg: &TrainConfig) -> (Vec<f64>, Vec<f32>) {
    let mut t = Trainer::new(cfg.clone()).unwrap();
    let losses = (0..cfg.steps).map(|_| t.step().unwrap().loss).collect();
    (losses, t.params().to_vec())
}

/// A synchronous checkpointer under `dir` that saves only when asked.
fn checkpointer(dir: &Path) -> Checkpointer {
    let ck = CheckpointConfig {
        dir: dir.to_path_buf(),
        every: 0,
        asynchronous: false,
        auto_mtbf: None,
    };
    Checkpointer::new(ck, "tp-ckpt").unwrap()
}

/// `tp` ranks (threads) of `cfg`, each resuming from `resume` first when given, train `steps`
/// steps and save into `save` when given; rank 0's losses and the gathered whole parameters.
fn tp_leg(
    tp: usize,
    cfg: &TrainConfig,
    resume: Option<PathBuf>,
    steps: u64,
    save: Option<PathBuf>,
) -> (Vec<f64>, Vec<f32>) {
    let cfg = cfg.clone();
    let mut out = run_threads(tp, GroupConfig::default(), move |g| {
        let mut t = TpTrainer::new(cfg.clone(), g).unwrap();
        if let Some(dir) = &resume {
            assert_eq!(t.resume(dir).unwrap(), Some(HALF));
            assert_eq!(t.steps_done(), HALF);
        }
        let losses: Vec<f64> = (0..steps).map(|_| t.step().unwrap().loss).collect();
        if let Some(dir) = &save {
            assert_eq!(t.save_checkpoint(dir, "tp-ckpt").unwrap(), t.steps_done());
        }
        Ok((losses, t.gather_params().unwrap()))
    })
    .unwrap();
    out.swap_remove(0).unwrap()
}

/// Two data-parallel ranks of `cfg` with one micro-batch each (the same global batch of
/// `2 x batch` rows as one process accumulating two) resume from `dir` and train 3 steps.
fn dp_leg(cfg: &TrainConfig, dir: PathBuf) -> (Vec<f64>, Vec<f32>) {
    let mut cfg = cfg.clone();
    cfg.grad_accum = 1;
    let mut out = run_threads(2, GroupConfig::default(), move |g: ProcessGroup| {
        let mut t = Trainer::data_parallel(cfg.clone(), g, 16 << 10).unwrap();
        assert_eq!(Checkpointer::resume(&dir, &mut t).unwrap().unwrap().0, HALF);
        let losses: Vec<f64> = (0..HALF).map(|_| t.step().unwrap().loss).collect();
        Ok((losses, t.params().to_vec()))
    })
    .unwrap();
    out.swap_remove(0).unwrap()
}

#[test]
fn one_process_checkpoint_resumes_under_tp2() {
    let c = cfg();
    let (want_losses, want) = straight(&c);
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(c.clone()).unwrap();
    let mut ck = checkpointer(dir.path());
    let mut losses: Vec<f64> = (0..HALF).map(|_| t.step().unwrap().loss).collect();
    ck.save(&mut t).unwrap();
    drop(t);
    let (more, params) = tp_leg(2, &c, Some(dir.path().to_path_buf()), HALF, None);
    losses.extend(more);
    assert_losses("1 process -> TP2", &losses, &want_losses);
    let d = max_rel_diff(&params, &want);
    assert!(d < TOL, "1 process -> TP2 params: {d}");
}

#[test]
fn tp2_checkpoint_resumes_in_one_process_and_data_parallel() {
    let c = cfg();
    let (want_losses, want) = straight(&c);
    let dir = tempfile::tempdir().unwrap();
    let (mut losses, _) = tp_leg(2, &c, None, HALF, Some(dir.path().to_path_buf()));
    assert_losses("TP2 first half", &losses, &want_losses[..HALF as usize]);

    // The saved step is the Trainer's format (a DP2 save: each rank wrote its row blocks of
    // the whole tensors), and every piece verifies.
    let saved = Checkpoint::open(dir.path(), HALF, Verify::AllPieces).unwrap();
    assert_eq!(saved.manifest().world_size, 2);
    let files: std::collections::BTreeSet<&str> = saved
        .manifest()
        .pieces
        .iter()
        .map(|p| p.file.as_str())
        .collect();
    assert_eq!(files.len(), 2, "{files:?}");
    assert_eq!(saved.manifest().layout["tp"], 2);
    assert_eq!(saved.state()["rows_drawn"], HALF * 2 * 2);

    // One process.
    let mut t = Trainer::new(c.clone()).unwrap();
    assert_eq!(
        Checkpointer::resume(dir.path(), &mut t).unwrap().unwrap().0,
        HALF
    );
    let more: Vec<f64> = (0..HALF).map(|_| t.step().unwrap().loss).collect();
    let mut one = losses.clone();
    one.extend(more);
    assert_losses("TP2 -> 1 process", &one, &want_losses);
    let d = max_rel_diff(t.params(), &want);
    assert!(d < TOL, "TP2 -> 1 process params: {d}");

    // Two data-parallel ranks, one micro-batch of the global batch each.
    let (more, params) = dp_leg(&c, dir.path().to_path_buf());
    losses.extend(more);
    assert_losses("TP2 -> DP2", &losses, &want_losses);
    let d = max_rel_diff(&params, &want);
    assert!(d < TOL, "TP2 -> DP2 params: {d}");
}

/// Two ZeRO-2 ranks of `cfg` with one micro-batch each train 3 steps and save into `dir`
/// (each rank writes the flat pieces it owns); rank 0's losses.
fn zero_leg(cfg: &TrainConfig, dir: PathBuf) -> Vec<f64> {
    let mut cfg = cfg.clone();
    cfg.grad_accum = 1;
    let mut out = run_threads(2, GroupConfig::default(), move |g: ProcessGroup| {
        let (rank, size) = (g.rank() as u32, g.size() as u32);
        let mut t = Trainer::zero(cfg.clone(), g, Stage::Two, 16 << 10).unwrap();
        let mut ck = checkpointer(&dir).with_shard(rank, size).unwrap();
        let losses: Vec<f64> = (0..HALF).map(|_| t.step().unwrap().loss).collect();
        ck.save(&mut t).unwrap();
        // Rank 0 commits once the others' pieces arrived; nobody reads before then.
        t.group().unwrap().barrier().unwrap();
        Ok(losses)
    })
    .unwrap();
    out.swap_remove(0).unwrap()
}

#[test]
fn a_zero2_data_parallel_checkpoint_resumes_under_tp2() {
    // DP2 (ZeRO-2, flat sharded pieces) -> TP2: the same global batches of 4 rows.
    let c = cfg();
    let (want_losses, want) = straight(&c);
    let dir = tempfile::tempdir().unwrap();
    let mut losses = zero_leg(&c, dir.path().to_path_buf());
    let (more, params) = tp_leg(2, &c, Some(dir.path().to_path_buf()), HALF, None);
    losses.extend(more);
    assert_losses("ZeRO-2 DP2 -> TP2", &losses, &want_losses);
    let d = max_rel_diff(&params, &want);
    assert!(d < TOL, "ZeRO-2 DP2 -> TP2 params: {d}");
}

#[test]
fn a_tp4_checkpoint_resumes_under_tp2() {
    // TP4 -> TP2: another degree, so every block's shards (and the moments') are cut anew.
    let c = cfg();
    let (want_losses, want) = straight(&c);
    let dir = tempfile::tempdir().unwrap();
    let (mut losses, _) = tp_leg(4, &c, None, HALF, Some(dir.path().to_path_buf()));
    let (more, params) = tp_leg(2, &c, Some(dir.path().to_path_buf()), HALF, None);
    losses.extend(more);
    assert_losses("TP4 -> TP2", &losses, &want_losses);
    let d = max_rel_diff(&params, &want);
    assert!(d < TOL, "TP4 -> TP2 params: {d}");
}

#[test]
fn a_checkpoint_of_another_model_is_refused() {
    let c = cfg();
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(c.clone()).unwrap();
    t.step().unwrap();
    checkpointer(dir.path()).save(&mut t).unwrap();
    let mut other = c.clone();
    other.model = ModelConfig::gpt2(2, 4, 32, 16, 64);
    let err = run_threads(2, GroupConfig::default(), move |g| {
        let mut t = TpTrainer::new(other.clone(), g).unwrap();
        Ok(t.restore(&Checkpoint::open(dir.path(), 1, Verify::ManifestOnly).unwrap()))
    })
    .unwrap()
    .swap_remove(0)
    .unwrap()
    .unwrap_err();
    match &err {
        TrainError::Resume { step: 1, reason } => {
            assert!(reason.contains("another model"), "{reason}");
            assert!(reason.contains("model."), "{reason}");
        }
        e => panic!("expected a resume error, got {e}"),
    }
}
