//! Checkpoints move between the tensor-parallel trainer (alone or as DP x TP replicas on a
//! mesh) and the plain and data-parallel [`Trainer`] (issue 8: a checkpoint saved under one
//! layout loads under another and training continues with the same loss). Each test trains 3
//! steps under one layout, saves, resumes under another for 3 more, and compares the per-step
//! losses and gradient norms and the final parameters with a straight 6-step run within float
//! summation-order tolerance (1e-4 relative).
//!
//! - Against one process (global batch 4 rows: 2 micro-batches of 2, or 2 ranks of 2): one
//!   process -> TP2, ZeRO-2 on 2 ranks -> TP2, TP2 -> one process and 2 data-parallel ranks,
//!   TP4 -> TP2.
//! - Against a straight data-parallel `Trainer` on 4 ranks (DP4, `b = 2` rows per rank: a
//!   global batch of 4b = 8 rows): DP4 -> DP2 x TP2 and DP2 x TP2 -> DP4, where each DP2 x TP2
//!   replica takes `b` rows with `grad_accum = 2` (2 replicas x 2 micro-batches x 2 rows = 8,
//!   the same rows per step). Not `2b` rows per replica: the training config's hash covers
//!   the batch (not `grad_accum`), so that run would be refused as another config.
//! - A checkpoint of another model is refused by name.
#[path = "support/common.rs"]
mod common;
use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, Verify};
use comm::group::{GroupConfig, ProcessGroup};
use comm::local::run_threads;
use comm::mesh::{DeviceMesh, MeshShape};
use common::max_rel_diff;
use model::config::ModelConfig;
use train::{CheckpointConfig, Checkpointer, TrainConfig, TrainError, Trainer};

const STEPS: u64 = 6;
const HALF: u64 = 3;
const TOL: f64 = 1e-4;

/// Per-step (loss, gradient norm) and the final whole parameters of one leg of a test.
type Leg = (Vec<(f64, f64)>, Vec<f32>);

/// A 2-layer GPT-2 (4 heads, C = 64, F = 256, V = 64) on the Markov corpus, 2 micro-batches
/// of 2 rows of 16 tokens per step, warmup then cosine over the 6 steps, clipping.
fn cfg() -> TrainConfig {
    let mut c = common::gpt2_cosine(STEPS, 0.5);
    c.grad_accum = 2;
    c
}

/// `cfg()` with one micro-batch per step (data-parallel ranks of 2 rows each).
fn one_micro() -> TrainConfig {
    let mut c = cfg();
    c.grad_accum = 1;
    c
}

/// `got` against `want`, step by step (loss and norm, relative) and the parameters.
fn assert_continues(what: &str, got: &Leg, want: &Leg) {
    assert_eq!(got.0.len(), want.0.len(), "{what}");
    for (i, (&(l, n), &(wl, wn))) in got.0.iter().zip(&want.0).enumerate() {
        let (dl, dn) = ((l - wl).abs() / wl.abs(), (n - wn).abs() / wn.abs());
        println!(
            "{what} step {}: loss {l:.7} vs {wl:.7} ({dl:.2e}), norm ({dn:.2e})",
            i + 1
        );
        assert!(dl < TOL, "{what}: step {} loss {l} vs {wl} ({dl})", i + 1);
        assert!(dn < TOL, "{what}: step {} norm {n} vs {wn} ({dn})", i + 1);
    }
    let d = max_rel_diff(&got.1, &want.1);
    println!("{what}: final params, max rel diff {d:.2e}");
    assert!(d < TOL, "{what} params: {d}");
}

/// `steps` steps of `t`: per-step (loss, norm).
fn train(t: &mut Trainer, steps: u64) -> Vec<(f64, f64)> {
    (0..steps)
        .map(|_| t.step().map(|s| (s.loss, s.grad_norm)).unwrap())
        .collect()
}

/// One process trains `cfg` straight.
fn straight(cfg: &TrainConfig) -> Leg {
    let mut t = Trainer::new(cfg.clone()).unwrap();
    (train(&mut t, cfg.steps), t.params().to_vec())
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

/// `dp x tp` ranks (threads) of `cfg` on a mesh, each resuming from `resume` first when given
/// (at step `HALF`), train `steps` steps and save into `save` when given; rank 0's stats and
/// the gathered whole parameters (every rank gathers the same).
fn mesh_leg(
    (dp, tp): (usize, usize),
    cfg: &TrainConfig,
    resume: Option<PathBuf>,
    steps: u64,
    save: Option<PathBuf>,
) -> Leg {
    let cfg = cfg.clone();
    let out = run_threads(dp * tp, GroupConfig::for_training().unwrap(), move |g| {
        let mesh = DeviceMesh::new(&g, MeshShape::new(dp, 1, tp), false)?;
        let mut t = Trainer::on_mesh(cfg.clone(), &mesh, (None, false), 1 << 20).unwrap();
        if let Some(dir) = &resume {
            let resumed = train::checkpoint::resume_collectively(dir, Some(&g), |c| t.restore(c));
            assert_eq!(resumed.unwrap().map(|r| r.0), Some(HALF));
            assert_eq!(t.steps_done(), HALF);
        }
        let stats: Vec<(f64, f64)> = (0..steps)
            .map(|_| t.step().map(|s| (s.loss, s.grad_norm)).unwrap())
            .collect();
        if let Some(dir) = &save {
            assert_eq!(t.save_checkpoint(dir, "tp-ckpt").unwrap(), t.steps_done());
        }
        Ok((stats, t.whole_params().unwrap()))
    })
    .unwrap();
    let mut out: Vec<Leg> = out.into_iter().map(|r| r.unwrap()).collect();
    for (r, o) in out.iter().enumerate() {
        assert!(
            *o == out[0],
            "dp{dp} x tp{tp}: rank {r} differs from rank 0"
        );
    }
    out.swap_remove(0)
}

/// `world` data-parallel `Trainer` ranks of `cfg` at ZeRO `stage` (0: plain data parallel),
/// each resuming from `resume` first when given (at step `HALF`), train `steps` steps and save
/// into `save` when given (each rank its rows, or under ZeRO the flat pieces it owns); rank
/// 0's stats and parameters.
fn dp_leg(
    (world, stage): (usize, u8),
    cfg: &TrainConfig,
    resume: Option<PathBuf>,
    steps: u64,
    save: Option<PathBuf>,
) -> Leg {
    let cfg = cfg.clone();
    let mut out = run_threads(
        world,
        GroupConfig::for_training().unwrap(),
        move |g: ProcessGroup| {
            let (rank, size) = (g.rank() as u32, g.size() as u32);
            let mut t = common::trainer(cfg.clone(), g, stage, 16 << 10);
            if let Some(dir) = &resume {
                assert_eq!(Checkpointer::resume(dir, &mut t).unwrap().unwrap().0, HALF);
            }
            let stats = train(&mut t, steps);
            if let Some(dir) = &save {
                let mut ck = checkpointer(dir).with_shard(rank, size).unwrap();
                ck.save(&mut t).unwrap();
                // Rank 0 commits once the others' pieces arrived; nobody reads before then.
                t.group().unwrap().barrier().unwrap();
            }
            t.gather_params().unwrap();
            Ok((stats, t.params().to_vec()))
        },
    )
    .unwrap();
    out.swap_remove(0).unwrap()
}

/// The first leg's stats followed by the second's, with the second's parameters.
fn joined(first: Leg, second: Leg) -> Leg {
    let mut stats = first.0;
    stats.extend(second.0);
    (stats, second.1)
}

#[test]
fn one_process_checkpoint_resumes_under_tp2() {
    let c = cfg();
    let want = straight(&c);
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(c.clone()).unwrap();
    let mut ck = checkpointer(dir.path());
    let first = (train(&mut t, HALF), Vec::new());
    ck.save(&mut t).unwrap();
    drop(t);
    let second = mesh_leg((1, 2), &c, Some(dir.path().to_path_buf()), HALF, None);
    assert_continues("1 process -> TP2", &joined(first, second), &want);
}

#[test]
fn tp2_checkpoint_resumes_in_one_process_and_data_parallel() {
    let c = cfg();
    let want = straight(&c);
    let dir = tempfile::tempdir().unwrap();
    let first = mesh_leg((1, 2), &c, None, HALF, Some(dir.path().to_path_buf()));

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
    let one = (train(&mut t, HALF), t.params().to_vec());
    assert_continues("TP2 -> 1 process", &joined(first.clone(), one), &want);

    // Two data-parallel ranks, one micro-batch of the global batch each.
    let dir = Some(dir.path().to_path_buf());
    let dp = dp_leg((2, 0), &one_micro(), dir, HALF, None);
    assert_continues("TP2 -> DP2", &joined(first, dp), &want);
}

#[test]
fn a_zero2_data_parallel_checkpoint_resumes_under_tp2() {
    // DP2 (ZeRO-2, flat sharded pieces, one micro-batch each) -> TP2: the same global
    // batches of 4 rows.
    let c = cfg();
    let want = straight(&c);
    let dir = tempfile::tempdir().unwrap();
    let first = dp_leg(
        (2, 2),
        &one_micro(),
        None,
        HALF,
        Some(dir.path().to_path_buf()),
    );
    let second = mesh_leg((1, 2), &c, Some(dir.path().to_path_buf()), HALF, None);
    assert_continues("ZeRO-2 DP2 -> TP2", &joined(first, second), &want);
}

#[test]
fn a_tp4_checkpoint_resumes_under_tp2() {
    // TP4 -> TP2: another degree, so every block's shards (and the moments') are cut anew.
    let c = cfg();
    let want = straight(&c);
    let dir = tempfile::tempdir().unwrap();
    let first = mesh_leg((1, 4), &c, None, HALF, Some(dir.path().to_path_buf()));
    let second = mesh_leg((1, 2), &c, Some(dir.path().to_path_buf()), HALF, None);
    assert_continues("TP4 -> TP2", &joined(first, second), &want);
}

#[test]
fn a_dp4_checkpoint_resumes_under_dp2_tp2() {
    // DP4 (2 rows per rank) -> DP2 x TP2 (2 rows per replica, grad_accum 2): 8 rows a step.
    let want = dp_leg((4, 0), &one_micro(), None, STEPS, None);
    let dir = tempfile::tempdir().unwrap();
    let save = Some(dir.path().to_path_buf());
    let first = dp_leg((4, 0), &one_micro(), None, HALF, save);
    let second = mesh_leg((2, 2), &cfg(), Some(dir.path().to_path_buf()), HALF, None);
    assert_continues("DP4 -> DP2 x TP2", &joined(first, second), &want);
}

#[test]
fn a_dp2_tp2_checkpoint_resumes_under_dp4() {
    let want = dp_leg((4, 0), &one_micro(), None, STEPS, None);
    let dir = tempfile::tempdir().unwrap();
    let first = mesh_leg((2, 2), &cfg(), None, HALF, Some(dir.path().to_path_buf()));
    // The Trainer's format as 4 data-parallel ranks write it: one file per rank of the world,
    // the saving degrees, the global row cursor (3 steps of 8 rows), every piece verified.
    let saved = Checkpoint::open(dir.path(), HALF, Verify::AllPieces).unwrap();
    let m = saved.manifest();
    assert_eq!(m.world_size, 4);
    let files: std::collections::BTreeSet<&str> =
        m.pieces.iter().map(|p| p.file.as_str()).collect();
    assert_eq!(files.len(), 4, "{files:?}");
    assert_eq!((&m.layout["dp"], &m.layout["tp"]), (&2.into(), &2.into()));
    assert_eq!(saved.state()["rows_drawn"], HALF * 8);
    let dir = Some(dir.path().to_path_buf());
    let second = dp_leg((4, 0), &one_micro(), dir, HALF, None);
    assert_continues("DP2 x TP2 -> DP4", &joined(first, second), &want);
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
    let err = run_threads(2, GroupConfig::for_training().unwrap(), move |g| {
        let mut t = Trainer::tensor_parallel(other.clone(), g).unwrap();
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
