//! Tensor parallelism inside pipeline stages (file 000 "混合并行", "3D 训练循环"; the blocks
//! "Megatron 风格的张量并行"; issue 8 "Must show"): PP2 x TP2 on 4 ranks and DP2 x PP2 x TP2 on
//! 8 ranks of one device mesh, under 1F1B and GPipe with clipping on every step, end after 3
//! steps with one process's losses and parameters on the same global batch (`grad_accum = m`,
//! `dp x batch` rows) within float summation-order tolerance; repeated runs are
//! bit-identical; a TP degree not dividing the heads and recompute are refused by name; their
//! checkpoints, in the `Trainer`'s format, resume in one process and back, and in the same
//! layout bit-identically.
#[path = "support/common.rs"]
mod common;

use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, Verify};
use comm::group::GroupConfig;
use comm::local::run_threads;
use comm::mesh::{DeviceMesh, MeshShape};
use common::{assert_steps_close, max_rel_diff, rel};
use train::pipeline::{PipelineStage, ScheduleKind};
use train::{CheckpointConfig, Checkpointer, TrainConfig, TrainError, Trainer};

const STEPS: u64 = 3;

/// Clipping threshold below the gradient norm of every step (checked), so every step clips.
const CLIP: f64 = 0.05;

/// Tolerance relative to the largest parameter (and to the loss and norm): the TP blocks and
/// the replicas' mean sum in another order than one process. Measured: at most 4.1e-7 on the
/// parameters, 7e-9 on the losses and 3e-8 on the norms.
const TOL: f64 = 2e-6;

/// A 4-block GPT-2 (4 heads, C = 64, F = 256, V = 64, tied embeddings) on the Markov corpus,
/// `m` micro-batches of 2 rows of 16 tokens per replica, warmup-cosine, clipping at [`CLIP`].
fn gpt2(m: usize) -> TrainConfig {
    let mut c = common::gpt2_cosine(STEPS, CLIP);
    c.model.layers = 4;
    c.grad_accum = m;
    c
}

/// What one rank reports: its mesh coordinate (dp, pp, tp), the gathered whole-model
/// parameters and the per-step (loss, gradient norm).
struct RankOut {
    coord: (usize, usize, usize),
    params: Vec<f32>,
    stats: Vec<(f64, f64)>,
    /// AdamW elements per moment and resident parameter bytes of the rank's stage.
    state: (usize, usize),
}

/// `cfg` on a `shape` mesh of threads, `kind` in every pipeline.
fn mesh_run(cfg: &TrainConfig, shape: MeshShape, kind: ScheduleKind) -> Vec<RankOut> {
    let cfg = cfg.clone();
    let world = shape.world().unwrap();
    run_threads(world, GroupConfig::for_training().unwrap(), move |g| {
        let mesh = DeviceMesh::new(&g, shape, false)?;
        let mut st = PipelineStage::on_mesh(cfg.clone(), &mesh, kind).unwrap();
        let c = mesh.coord();
        assert_eq!((st.tensor_parallel(), st.tensor_rank()), (shape.tp, c.tp));
        let stats = (0..cfg.steps)
            .map(|_| {
                let s = st.step().unwrap();
                (s.loss, s.grad_norm)
            })
            .collect();
        Ok(RankOut {
            coord: (c.dp, c.pp, c.tp),
            params: st.gather_params().unwrap(),
            stats,
            state: (st.optimizer_len(), st.state_memory().params),
        })
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// One process on the global batch (`dp x batch` rows, `grad_accum = m`): per-step (loss,
/// norm) and the final parameters.
fn single(cfg: &TrainConfig, dp: usize) -> (Vec<(f64, f64)>, Vec<f32>) {
    let mut whole = cfg.clone();
    whole.batch *= dp;
    let mut t = Trainer::new(whole).unwrap();
    let stats = (0..cfg.steps)
        .map(|_| {
            let s = t.step().unwrap();
            (s.loss, s.grad_norm)
        })
        .collect();
    (stats, t.params().to_vec())
}

/// `cfg` on `shape` against one process; returns the parameters' largest difference
/// relative to the largest parameter.
fn matches_one_process(cfg: &TrainConfig, shape: MeshShape, kind: ScheduleKind) -> f64 {
    let name = format!("{kind:?} dp{} x pp{} x tp{}", shape.dp, shape.pp, shape.tp);
    let (want, want_params) = single(cfg, shape.dp);
    for (s, &(_, n)) in want.iter().enumerate() {
        assert!(
            n > CLIP,
            "{name}: step {} norm {n} must exceed {CLIP}",
            s + 1
        );
    }
    let out = mesh_run(cfg, shape, kind);
    let r0 = &out[0];
    for o in &out[1..] {
        assert!(
            o.params == r0.params,
            "{name}: rank {:?} gathered other parameters",
            o.coord
        );
        assert_eq!(
            o.stats, r0.stats,
            "{name}: rank {:?} reports other stats",
            o.coord
        );
    }
    assert_steps_close(&name, &r0.stats, &want, TOL);
    let d = max_rel_diff(&r0.params, &want_params);
    println!("{name}: parameters after {STEPS} steps, max diff / max |param| = {d:.2e}");
    assert!(
        d < TOL,
        "{name}: parameters differ from one process by {d:e}"
    );
    d
}

#[test]
fn pp2_tp2_matches_one_process() {
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
        matches_one_process(&gpt2(4), MeshShape::new(1, 2, 2), kind);
    }
}

#[test]
fn tp2_stages_hold_about_half_of_each_pp2_stage() {
    // Each stage keeps its blocks' shards and the whole embeddings or head: about half of a
    // PP2 stage's state (the replicated embedding and head, V x C each, are not split).
    let cfg = gpt2(2);
    let whole = mesh_run(&cfg, MeshShape::new(1, 2, 1), ScheduleKind::OneFOneB);
    let split = mesh_run(&cfg, MeshShape::new(1, 2, 2), ScheduleKind::OneFOneB);
    for o in &split {
        let (_, stage, _) = o.coord;
        let (tp1, tp2) = (whole[stage].state, o.state);
        let ratio = tp2.0 as f64 / tp1.0 as f64;
        println!(
            "stage {stage}: AdamW elements {} vs {} without TP ({ratio:.3}), resident \
             parameters {} B vs {} B",
            tp2.0, tp1.0, tp2.1, tp1.1
        );
        assert!((0.5..0.56).contains(&ratio), "rank {:?}: {ratio}", o.coord);
        assert!(
            tp2.1 < tp1.1 * 6 / 10,
            "rank {:?}: resident {tp2:?}",
            o.coord
        );
    }
}

#[test]
fn pp2_tp2_untied_matches_one_process() {
    let mut cfg = gpt2(4);
    cfg.model.tied_embeddings = false;
    matches_one_process(&cfg, MeshShape::new(1, 2, 2), ScheduleKind::OneFOneB);
}

#[test]
fn dp2_pp2_tp2_on_8_ranks_matches_one_process() {
    matches_one_process(&gpt2(2), MeshShape::new(2, 2, 2), ScheduleKind::OneFOneB);
}

#[test]
fn repeated_runs_are_bit_identical() {
    let cfg = gpt2(2);
    let shape = MeshShape::new(2, 2, 2);
    let a = mesh_run(&cfg, shape, ScheduleKind::OneFOneB);
    let b = mesh_run(&cfg, shape, ScheduleKind::OneFOneB);
    let bits = |v: &[(f64, f64)]| {
        v.iter()
            .map(|(l, n)| (l.to_bits(), n.to_bits()))
            .collect::<Vec<_>>()
    };
    for (x, y) in a.iter().zip(&b) {
        assert!(x.params == y.params, "rank {:?}: parameters", x.coord);
        assert_eq!(bits(&x.stats), bits(&y.stats), "rank {:?}: stats", x.coord);
    }
}

/// Every rank's error building a `shape` stage of `cfg`.
fn refusals(cfg: TrainConfig, shape: MeshShape) -> Vec<String> {
    let world = shape.world().unwrap();
    run_threads(world, GroupConfig::for_training().unwrap(), move |g| {
        let mesh = DeviceMesh::new(&g, shape, false)?;
        let r = PipelineStage::on_mesh(cfg.clone(), &mesh, ScheduleKind::OneFOneB);
        Ok(r.err().map(|e: TrainError| e.to_string()))
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap().expect("refused"))
    .collect()
}

#[test]
fn bad_layouts_are_refused_by_name_on_every_rank() {
    // 4 heads over 3 TP ranks.
    for e in refusals(gpt2(2), MeshShape::new(1, 2, 3)) {
        assert!(
            e.contains("tp = 3") && e.contains("heads (4) % tp (3)"),
            "{e}"
        );
    }
}

/// Recompute inside tensor-parallel stages: the stage's split model keeps only each block's
/// output and runs it forward again (its sums too) in the backward, so the run is the plain
/// one, bit for bit.
#[test]
fn pp2_tp2_with_recompute_is_the_plain_run() {
    let kind = ScheduleKind::OneFOneB;
    let plain = mesh_run(&gpt2(2), MeshShape::new(1, 2, 2), kind);
    let mut c = gpt2(2);
    c.recompute = true;
    let again = mesh_run(&c, MeshShape::new(1, 2, 2), kind);
    for (x, y) in plain.iter().zip(&again) {
        assert!(x.params == y.params, "rank {:?}: parameters", x.coord);
        assert_eq!(x.stats, y.stats, "rank {:?}: stats", x.coord);
    }
}

// === Checkpoints: 3 steps, save, 3 more under another layout, against the straight run ===

const HALF: u64 = 3;

/// [`gpt2`] with `m` micro-batches over 6 steps (the cosine over all 6).
fn six_steps(m: usize) -> TrainConfig {
    let mut c = common::gpt2_cosine(2 * HALF, CLIP);
    c.model.layers = 4;
    c.grad_accum = m;
    c
}

/// `cfg` on a `shape` mesh: resumes from `resume` when given, trains `steps` steps, saves into
/// `save` when given; rank 0's losses and the gathered parameters.
fn mesh_ckpt(
    cfg: &TrainConfig,
    shape: MeshShape,
    resume: Option<PathBuf>,
    steps: u64,
    save: Option<PathBuf>,
) -> (Vec<f64>, Vec<f32>) {
    let cfg = cfg.clone();
    let world = shape.world().unwrap();
    let mut out = run_threads(world, GroupConfig::for_training().unwrap(), move |g| {
        let mesh = DeviceMesh::new(&g, shape, false)?;
        let mut st = PipelineStage::on_mesh(cfg.clone(), &mesh, ScheduleKind::OneFOneB).unwrap();
        if let Some(dir) = &resume {
            assert_eq!(st.resume(dir).unwrap(), Some(HALF));
        }
        let losses: Vec<f64> = (0..steps).map(|_| st.step().unwrap().loss).collect();
        if let Some(dir) = &save {
            let step = st.save_checkpoint(dir, "pp-tp").unwrap();
            assert_eq!(step, st.steps_done());
        }
        Ok((losses, st.gather_params().unwrap()))
    })
    .unwrap();
    out.swap_remove(0).unwrap()
}

fn checkpointer(dir: &Path) -> Checkpointer {
    let ck = CheckpointConfig {
        dir: dir.to_path_buf(),
        every: 0,
        asynchronous: false,
        auto_mtbf: None,
    };
    Checkpointer::new(ck, "pp-tp").unwrap()
}

fn close(what: &str, losses: &[f64], params: &[f32], want: &(Vec<f64>, Vec<f32>)) {
    let worst = losses
        .iter()
        .zip(&want.0)
        .map(|(a, b)| rel(*a, *b))
        .fold(0.0, f64::max);
    let d = max_rel_diff(params, &want.1);
    println!("{what}: losses within {worst:.2e}, parameters within {d:.2e} of the largest");
    assert_eq!(losses.len(), want.0.len(), "{what}");
    assert!(worst < TOL, "{what}: losses {worst:e}");
    assert!(d < TOL, "{what}: parameters {d:e}");
}

#[test]
fn a_pp2_tp2_checkpoint_resumes_in_one_process_and_back() {
    let c = six_steps(2);
    let mut t = Trainer::new(c.clone()).unwrap();
    let straight: Vec<f64> = (0..2 * HALF).map(|_| t.step().unwrap().loss).collect();
    let want = (straight, t.params().to_vec());
    let pp2_tp2 = MeshShape::new(1, 2, 2);

    // PP2 x TP2 -> one process: the Trainer's format, four writers, every piece verifying.
    let dir = tempfile::tempdir().unwrap();
    let (mut losses, _) = mesh_ckpt(&c, pp2_tp2, None, HALF, Some(dir.path().into()));
    let saved = Checkpoint::open(dir.path(), HALF, Verify::AllPieces).unwrap();
    let m = saved.manifest();
    assert_eq!(m.world_size, 4);
    assert_eq!(
        (m.layout["pp"].as_u64(), m.layout["tp"].as_u64()),
        (Some(2), Some(2))
    );
    let mut t = Trainer::new(c.clone()).unwrap();
    assert_eq!(
        Checkpointer::resume(dir.path(), &mut t).unwrap().unwrap().0,
        HALF
    );
    losses.extend((0..HALF).map(|_| t.step().unwrap().loss));
    close("PP2 x TP2 -> one process", &losses, t.params(), &want);

    // One process -> PP2 x TP2.
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(c.clone()).unwrap();
    let mut losses: Vec<f64> = (0..HALF).map(|_| t.step().unwrap().loss).collect();
    checkpointer(dir.path()).save(&mut t).unwrap();
    let (more, params) = mesh_ckpt(&c, pp2_tp2, Some(dir.path().into()), HALF, None);
    losses.extend(more);
    close("one process -> PP2 x TP2", &losses, &params, &want);
}

#[test]
fn a_dp2_pp2_tp2_checkpoint_continues_bit_identically() {
    // Saved and restored in the same layout, the state read back is the state written, so
    // the resumed run repeats the straight run's bits.
    let c = six_steps(2);
    let shape = MeshShape::new(2, 2, 2);
    let (want_losses, want) = mesh_ckpt(&c, shape, None, 2 * HALF, None);
    let dir = tempfile::tempdir().unwrap();
    let (mut losses, _) = mesh_ckpt(&c, shape, None, HALF, Some(dir.path().into()));
    let saved = Checkpoint::open(dir.path(), HALF, Verify::AllPieces).unwrap();
    assert_eq!(saved.manifest().world_size, 8);
    let (more, params) = mesh_ckpt(&c, shape, Some(dir.path().into()), HALF, None);
    losses.extend(more);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&losses), bits(&want_losses));
    assert!(
        params == want,
        "parameters: {:e}",
        max_rel_diff(&params, &want)
    );
}
