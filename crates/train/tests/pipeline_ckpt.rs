//! Checkpoints move between pipeline stages and the data-parallel [`Trainer`] (issue 8: "a
//! checkpoint saved under DP4 loads under PP2 x DP2 (and back), and training continues with
//! the same loss as if the layout had not changed"). Each test trains 3 steps under one
//! layout, saves, resumes under another for 3 more, and compares the per-step losses and the
//! final parameters with a straight 6-step run within float summation-order tolerance.
//!
//! The layouts run the same update on the same rows. DP4 takes global batches of 4 x 2 rows,
//! rank r its rows 2r..2r+2, one micro-batch per step; PP2 x DP2 runs `grad_accum = 2`
//! micro-batches of 2 x 2 rows per step (each replica its 2 rows of each), so one step draws the
//! same 8 rows of the stream and the gradient is the mean of the same four 2-row means (the
//! engine scales the sum by 1/(m d) = 1/4 as DP4 scales by 1/4); only the summation order
//! differs. `grad_accum` is not in the config hash, so both resume each other's checkpoints.
//! PP2 alone with `grad_accum = 2` is one process with `grad_accum = 2`. The model ties its
//! embeddings, so stage 0 writes `wte` and the last stage restores its copy of it.
#[path = "support/common.rs"]
mod common;
use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, Verify};
use comm::group::{GroupConfig, ProcessGroup};
use comm::local::run_threads;
use comm::mesh::{DeviceMesh, MeshShape};
use common::max_rel_diff;
use model::config::ModelConfig;
use train::pipeline::{PipelineStage, ScheduleKind};
use train::zero::Stage;
use train::{CheckpointConfig, Checkpointer, TrainConfig, TrainError, Trainer};

const STEPS: u64 = 6;
const HALF: u64 = 3;
const TOL: f64 = 1e-4;

/// A 2-layer GPT-2 (4 heads, C = 64, F = 256, V = 64, tied) on the Markov corpus, 2 rows of
/// 16 tokens per rank and micro-batch, warmup then cosine over the 6 steps, clipping; one
/// micro-batch per step (the data-parallel layout).
fn cfg() -> TrainConfig {
    common::gpt2_cosine(STEPS, 0.5)
}

/// [`cfg`] with two micro-batches per step (the pipeline layouts).
fn pipe_cfg() -> TrainConfig {
    let mut c = cfg();
    c.grad_accum = 2;
    c
}

fn assert_losses(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}");
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / w.abs())
        .fold(0.0, f64::max);
    println!("{what}: losses within {worst:.2e} relative");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (g - w).abs() / w.abs();
        assert!(d < TOL, "{what}: step {} loss {g} vs {w} ({d})", i + 1);
    }
}

fn assert_params(what: &str, got: &[f32], want: &[f32]) {
    let d = max_rel_diff(got, want);
    println!("{what}: parameters within {d:.2e} of the largest");
    assert!(d < TOL, "{what} params: {d}");
}

/// A synchronous checkpointer under `dir` that saves only when asked.
fn checkpointer(dir: &Path) -> Checkpointer {
    let ck = CheckpointConfig {
        dir: dir.to_path_buf(),
        every: 0,
        asynchronous: false,
        auto_mtbf: None,
    };
    Checkpointer::new(ck, "pipe-ckpt").unwrap()
}

/// Four data-parallel ranks of [`cfg`], resuming from `resume` first when given, train `steps`
/// steps and save into `save` when given (each rank its rows, rank 0 commits); rank 0's
/// losses and parameters.
fn dp4(resume: Option<PathBuf>, steps: u64, save: Option<PathBuf>) -> (Vec<f64>, Vec<f32>) {
    let mut out = run_threads(
        4,
        GroupConfig::for_training().unwrap(),
        move |g: ProcessGroup| {
            let (rank, size) = (g.rank() as u32, g.size() as u32);
            let mut t = Trainer::data_parallel(cfg(), g, 16 << 10).unwrap();
            if let Some(dir) = &resume {
                assert_eq!(Checkpointer::resume(dir, &mut t).unwrap().unwrap().0, HALF);
            }
            let losses: Vec<f64> = (0..steps).map(|_| t.step().unwrap().loss).collect();
            if let Some(dir) = &save {
                let mut ck = checkpointer(dir).with_shard(rank, size).unwrap();
                ck.save(&mut t).unwrap();
            }
            Ok((losses, t.params().to_vec()))
        },
    )
    .unwrap();
    out.swap_remove(0).unwrap()
}

/// `dp` replicas of a 2-stage 1F1B pipeline of [`pipe_cfg`] on a `dp x 2` mesh (ZeRO-1 over
/// the replicas when `zero`), resuming from `resume` first when given, train `steps` steps and
/// save into `save` when given; world rank 0's losses and the gathered whole parameters.
fn pp2(
    dp: usize,
    zero: bool,
    resume: Option<PathBuf>,
    steps: u64,
    save: Option<PathBuf>,
) -> (Vec<f64>, Vec<f32>) {
    let mut out = run_threads(2 * dp, GroupConfig::for_training().unwrap(), move |g| {
        let mesh = DeviceMesh::new(&g, MeshShape::new(dp, 2, 1), false)?;
        let (c, kind) = (pipe_cfg(), ScheduleKind::OneFOneB);
        let mut st = match zero {
            true => {
                let (pp, dpg) = (mesh.pp().clone(), mesh.dp().clone());
                PipelineStage::with_zero(c, pp, dpg, kind, Stage::One)
            }
            false => PipelineStage::on_mesh(c, &mesh, kind),
        }
        .unwrap();
        if let Some(dir) = &resume {
            assert_eq!(st.resume(dir).unwrap(), Some(HALF));
            assert_eq!(st.steps_done(), HALF);
        }
        let losses: Vec<f64> = (0..steps).map(|_| st.step().unwrap().loss).collect();
        if let Some(dir) = &save {
            assert_eq!(
                st.save_checkpoint(dir, "pipe-ckpt").unwrap(),
                st.steps_done()
            );
        }
        Ok((losses, st.gather_params().unwrap()))
    })
    .unwrap();
    out.swap_remove(0).unwrap()
}

fn name(zero: bool) -> &'static str {
    if zero {
        "PP2 x DP2 ZeRO-1"
    } else {
        "PP2 x DP2"
    }
}

#[test]
fn a_dp4_checkpoint_resumes_under_pp2_x_dp2() {
    let (want_losses, want) = dp4(None, STEPS, None);
    for zero in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (mut losses, _) = dp4(None, HALF, Some(dir.path().to_path_buf()));
        let (more, params) = pp2(2, zero, Some(dir.path().to_path_buf()), HALF, None);
        losses.extend(more);
        let what = format!("DP4 -> {}", name(zero));
        assert_losses(&what, &losses, &want_losses);
        assert_params(&what, &params, &want);
    }
}

#[test]
fn a_pp2_x_dp2_checkpoint_resumes_under_dp4() {
    let (want_losses, want) = dp4(None, STEPS, None);
    for zero in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (mut losses, _) = pp2(2, zero, None, HALF, Some(dir.path().to_path_buf()));
        assert_losses(
            &format!("{} first half", name(zero)),
            &losses,
            &want_losses[..HALF as usize],
        );

        // The Trainer's format, written by all four ranks (each stage its entries, each
        // replica half of every range), committed once; every piece verifies.
        let saved = Checkpoint::open(dir.path(), HALF, Verify::AllPieces).unwrap();
        let m = saved.manifest();
        assert_eq!(m.world_size, 4);
        assert_eq!(
            (m.layout["pp"].as_u64(), m.layout["dp"].as_u64()),
            (Some(2), Some(2))
        );
        assert_eq!(m.layout["zero"].as_u64(), Some(u64::from(zero)));
        let files: std::collections::BTreeSet<&str> =
            m.pieces.iter().map(|p| p.file.as_str()).collect();
        assert_eq!(files.len(), 4, "{files:?}");
        assert_eq!(saved.state()["rows_drawn"], HALF * 4 * 2);
        assert_eq!(saved.state()["optimizer_step"], HALF);

        let (more, params) = dp4(Some(dir.path().to_path_buf()), HALF, None);
        losses.extend(more);
        let what = format!("{} -> DP4", name(zero));
        assert_losses(&what, &losses, &want_losses);
        assert_params(&what, &params, &want);
    }
}

#[test]
fn a_pp2_checkpoint_resumes_in_one_process() {
    let c = pipe_cfg();
    let mut t = Trainer::new(c.clone()).unwrap();
    let want_losses: Vec<f64> = (0..STEPS).map(|_| t.step().unwrap().loss).collect();
    let want = t.params().to_vec();
    let dir = tempfile::tempdir().unwrap();
    let (mut losses, _) = pp2(1, false, None, HALF, Some(dir.path().to_path_buf()));
    let mut t = Trainer::new(c).unwrap();
    assert_eq!(
        Checkpointer::resume(dir.path(), &mut t).unwrap().unwrap().0,
        HALF
    );
    losses.extend((0..HALF).map(|_| t.step().unwrap().loss));
    assert_losses("PP2 -> 1 process", &losses, &want_losses);
    assert_params("PP2 -> 1 process", t.params(), &want);
}

/// Two pipeline stages of `c` restore step 1 of `dir`; stage 0's error.
fn pp2_restore_error(c: TrainConfig, dir: PathBuf) -> TrainError {
    run_threads(2, GroupConfig::for_training().unwrap(), move |g| {
        let mut st = PipelineStage::new(c.clone(), g, 2, ScheduleKind::GPipe).unwrap();
        let ckpt = Checkpoint::open(&dir, 1, Verify::ManifestOnly).unwrap();
        Ok(st.restore(&ckpt).err())
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap().expect("refused on every stage"))
    .next()
    .unwrap()
}

#[test]
fn a_checkpoint_of_another_model_or_config_is_refused() {
    let c = pipe_cfg();
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(c.clone()).unwrap();
    t.step().unwrap();
    checkpointer(dir.path()).save(&mut t).unwrap();

    let mut other = c.clone();
    other.model = ModelConfig::gpt2(2, 4, 32, 16, 64);
    match pp2_restore_error(other, dir.path().to_path_buf()) {
        TrainError::Resume { step: 1, reason } => {
            assert!(reason.contains("another model"), "{reason}");
            assert!(reason.contains("\"model.wte\""), "{reason}");
        }
        e => panic!("expected a resume error, got {e}"),
    }
    let mut other = c;
    other.lr *= 2.0;
    match pp2_restore_error(other, dir.path().to_path_buf()) {
        TrainError::Resume { step: 1, reason } => {
            assert!(reason.contains("training config"), "{reason}");
        }
        e => panic!("expected a resume error, got {e}"),
    }
}

#[test]
fn a_failed_write_on_one_rank_commits_nothing() {
    // Writer 3 (stage 1 of replica 1) finds a directory where its file must go: its write
    // fails, so every rank's save fails and no step is committed.
    let dir = tempfile::tempdir().unwrap();
    let blocked = dir
        .path()
        .join(ckpt::tmp_dir_name(1))
        .join(ckpt::rank_file_name(3));
    std::fs::create_dir_all(&blocked).unwrap();
    let root = dir.path().to_path_buf();
    let out = run_threads(4, GroupConfig::for_training().unwrap(), move |g| {
        let mesh = DeviceMesh::new(&g, MeshShape::new(2, 2, 1), false)?;
        let mut st = PipelineStage::on_mesh(pipe_cfg(), &mesh, ScheduleKind::GPipe).unwrap();
        st.step().unwrap();
        Ok((st.writer(), st.save_checkpoint(&root, "pipe-ckpt").err()))
    })
    .unwrap();
    for r in out {
        let ((writer, writers), err) = r.unwrap();
        assert_eq!(writers, 4);
        let e = err.unwrap_or_else(|| panic!("writer {writer} saved"));
        if writer != 3 {
            assert!(
                e.to_string().contains("1 of the 4 writers"),
                "writer {writer}: {e}"
            );
        }
    }
    assert!(ckpt::list_committed(dir.path()).unwrap().is_empty());
}
