//! Pipeline parallelism (file 000 Algorithm 1): PP = 2 and 4 under GPipe, 1F1B and interleaved
//! 1F1B end where one process with `grad_accum = m` ends on the same batches (up to float
//! summation order), repeated runs are bit-identical, and bad layouts are refused by name.
//! DP x PP (000 §2.20 hybrid parallelism): two data-parallel replicas of a 2-stage pipeline on
//! a 4-rank device mesh end where a data-parallel `Trainer` on 2 ranks ends, and where one
//! process on the same global batch ends.
#[path = "support/common.rs"]
mod common;

use comm::group::GroupConfig;
use comm::local::run_threads;
use comm::mesh::{DeviceMesh, MeshShape};
use common::{max_rel_diff, tiny};
use train::ddp::DEFAULT_BUCKET_BYTES;
use train::pipeline::{PipelineStage, ScheduleKind};
use train::zero::Stage;
use train::{TrainConfig, TrainError, Trainer};

/// A 4-block tiny GPT, `m` micro-batches of 2 rows per step, `steps` steps.
fn four_blocks(m: usize, steps: u64, tied: bool) -> TrainConfig {
    let mut c = tiny(2, steps);
    c.model.layers = 4;
    c.model.tied_embeddings = tied;
    c.grad_accum = m;
    c
}

/// Per stage: the gathered whole-model parameters, per-step losses and bubble fractions.
type StageOut = (Vec<f32>, Vec<f64>, Vec<f64>);

fn pipe(cfg: TrainConfig, p: usize, kind: ScheduleKind) -> Vec<StageOut> {
    run_threads(p, GroupConfig::for_training().unwrap(), move |g| {
        let steps = cfg.steps;
        let mut st = PipelineStage::new(cfg.clone(), g, p, kind).unwrap();
        let (mut losses, mut bubbles) = (Vec::new(), Vec::new());
        for _ in 0..steps {
            let s = st.step().unwrap();
            losses.push(s.loss);
            bubbles.push(s.bubble());
        }
        Ok((st.gather_params().unwrap(), losses, bubbles))
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

fn single(cfg: TrainConfig) -> (Vec<f32>, Vec<f64>) {
    let mut t = Trainer::new(cfg.clone()).unwrap();
    let losses = (0..cfg.steps).map(|_| t.step().unwrap().loss).collect();
    (t.params().to_vec(), losses)
}

fn check(cfg: TrainConfig, p: usize, kind: ScheduleKind) {
    let (ref_params, ref_losses) = single(cfg.clone());
    let out = pipe(cfg, p, kind);
    for (s, (params, losses, _)) in out.iter().enumerate() {
        assert_eq!(
            params, &out[0].0,
            "{kind:?} p={p}: stage {s} gathered other parameters"
        );
        assert_eq!(
            losses, &out[0].1,
            "{kind:?} p={p}: stage {s} reports other losses"
        );
    }
    for (a, b) in out[0].1.iter().zip(&ref_losses) {
        assert!(
            ((a - b) / b).abs() < 1e-5,
            "{kind:?} p={p}: loss {a} vs one process {b}"
        );
    }
    let d = max_rel_diff(&out[0].0, &ref_params);
    assert!(
        d < 1e-5,
        "{kind:?} p={p}: parameters differ from one process by {d}"
    );
}

#[test]
fn pp2_gpipe_and_1f1b_match_one_process() {
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        check(four_blocks(4, 3, false), 2, kind);
    }
}

#[test]
fn pp2_tied_embeddings_match_one_process() {
    check(four_blocks(4, 3, true), 2, ScheduleKind::OneFOneB);
}

#[test]
fn pp2_interleaved_matches_one_process() {
    let kind = ScheduleKind::Interleaved { virtual_stages: 2 };
    check(four_blocks(4, 3, false), 2, kind);
    check(four_blocks(4, 2, true), 2, kind);
}

#[test]
fn pp4_every_schedule_matches_one_process() {
    check(four_blocks(4, 2, false), 4, ScheduleKind::OneFOneB);
    check(four_blocks(4, 2, true), 4, ScheduleKind::GPipe);
    // Interleaved with 4 stages needs 8 chunks, hence 8 blocks.
    let mut c = four_blocks(4, 2, false);
    c.model.layers = 8;
    check(c, 4, ScheduleKind::Interleaved { virtual_stages: 2 });
}

#[test]
fn untied_runs_are_bit_identical_to_one_process() {
    // Every unit's gradient is computed by the same kernels and accumulated over the
    // micro-batches in the same order as in one process, the global norm sums the same blocks
    // in the same order, and AdamW is elementwise: only a tied wte (its two halves summed
    // across stages) changes the summation order.
    for (p, kind, layers, recompute, clip) in [
        (2, ScheduleKind::GPipe, 4, false, None),
        (2, ScheduleKind::OneFOneB, 4, true, Some(0.1)),
        (4, ScheduleKind::OneFOneB, 4, false, Some(0.1)),
        (4, ScheduleKind::GPipe, 4, false, Some(1.0)),
        (
            2,
            ScheduleKind::Interleaved { virtual_stages: 2 },
            4,
            false,
            Some(0.1),
        ),
    ] {
        let mut c = four_blocks(4, 2, false);
        c.model.layers = layers;
        c.grad_clip = clip;
        c.recompute = recompute;
        let (ref_params, ref_losses) = single(c.clone());
        let out = pipe(c, p, kind);
        assert_eq!(out[0].1, ref_losses, "{kind:?} p={p}: losses");
        assert!(
            out[0].0 == ref_params,
            "{kind:?} p={p}: parameters not bit-identical"
        );
    }
}

#[test]
fn repeated_runs_are_bit_identical() {
    let kind = ScheduleKind::Interleaved { virtual_stages: 2 };
    let a = pipe(four_blocks(4, 2, true), 2, kind);
    let b = pipe(four_blocks(4, 2, true), 2, kind);
    assert_eq!(a[0].0, b[0].0);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a[1].1), bits(&b[1].1));
}

#[test]
fn bad_layouts_are_refused_by_name() {
    let refused = |cfg: TrainConfig, world: usize, p: usize, kind: ScheduleKind| -> String {
        run_threads(world, GroupConfig::for_training().unwrap(), move |g| {
            Ok(PipelineStage::new(cfg.clone(), g, p, kind)
                .err()
                .map(|e| e.to_string()))
        })
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .next()
        .flatten()
        .expect("refused")
    };
    // More stages than blocks.
    let e = refused(tiny(2, 1), 4, 4, ScheduleKind::OneFOneB);
    assert!(e.contains("pipeline_stages"), "{e}");
    // Interleaved needs m % p == 0.
    let e = refused(
        four_blocks(3, 1, false),
        2,
        2,
        ScheduleKind::Interleaved { virtual_stages: 2 },
    );
    assert!(e.contains("microbatches"), "{e}");
    // The group is not one rank per stage.
    let e = refused(four_blocks(4, 1, false), 2, 4, ScheduleKind::GPipe);
    assert!(
        e.contains("pipeline_stages") && e.contains("2 ranks"),
        "{e}"
    );
}

#[test]
fn bubble_is_measured() {
    // Wall-clock fractions on a shared machine: only sanity is asserted; `--nocapture` shows
    // them beside 000 F41's (p-1)/(m+p-1).
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let out = pipe(four_blocks(4, 2, false), 4, kind);
        let bubbles: Vec<f64> = out.iter().map(|o| o.2[1]).collect();
        println!("{kind:?} p=4 m=4 bubble per stage {bubbles:.3?} (F41: 0.429)");
        assert!(bubbles.iter().all(|b| (0.0..1.0).contains(b)));
    }
}

/// Per rank of a DP x PP run: (dp, pp) coordinate, gathered parameters and per-step losses.
type HybridOut = ((usize, usize), Vec<f32>, Vec<f64>);

/// `dp` replicas of a `pp`-stage pipeline on a `dp * pp`-rank mesh built from the world group.
fn hybrid(cfg: TrainConfig, dp: usize, pp: usize, kind: ScheduleKind) -> Vec<HybridOut> {
    run_threads(dp * pp, GroupConfig::for_training().unwrap(), move |g| {
        let steps = cfg.steps;
        let mesh = DeviceMesh::new(&g, MeshShape::new(dp, pp, 1), false)?;
        let mut st = PipelineStage::on_mesh(cfg.clone(), &mesh, kind).unwrap();
        assert_eq!((st.replica(), st.replicas()), (mesh.coord().dp, dp));
        let losses = (0..steps).map(|_| st.step().unwrap().loss).collect();
        let c = mesh.coord();
        Ok(((c.dp, c.pp), st.gather_params().unwrap(), losses))
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// A data-parallel `Trainer` on `n` ranks: rank 0's parameters and losses.
fn data_parallel(cfg: TrainConfig, n: usize) -> (Vec<f32>, Vec<f64>) {
    let mut out = common::run(n, cfg, 0, DEFAULT_BUCKET_BYTES);
    let (params, losses, _, _) = out.swap_remove(0);
    (params, losses)
}

/// `dp` x `pp` against a data-parallel Trainer on `dp` ranks (within 1e-5; bit-identical when
/// `exact`) and one process on the global batch of `dp x batch` rows.
fn check_hybrid(cfg: TrainConfig, dp: usize, pp: usize, kind: ScheduleKind, exact: bool) {
    let tied = cfg.model.tied_embeddings;
    let out = hybrid(cfg.clone(), dp, pp, kind);
    for (c, params, losses) in &out {
        assert_eq!(
            params, &out[0].1,
            "{kind:?} dp{dp} x pp{pp}: rank {c:?} gathered other parameters"
        );
        assert_eq!(
            losses, &out[0].2,
            "{kind:?} dp{dp} x pp{pp}: rank {c:?} reports other losses"
        );
    }
    let (params, losses) = (&out[0].1, &out[0].2);
    let (dp_params, dp_losses) = data_parallel(cfg.clone(), dp);
    if exact {
        assert_eq!(
            losses, &dp_losses,
            "{kind:?} dp{dp} x pp{pp}: losses vs data-parallel Trainer"
        );
        assert!(
            params == &dp_params,
            "{kind:?} dp{dp} x pp{pp}: parameters not bit-identical to the data-parallel Trainer (max rel {})",
            max_rel_diff(params, &dp_params)
        );
    }
    let mut whole = cfg;
    whole.batch *= dp;
    let (one_params, one_losses) = single(whole);
    for (a, b) in losses.iter().zip(&dp_losses) {
        assert!(
            ((a - b) / b).abs() < 1e-5,
            "{kind:?} dp{dp} x pp{pp}: loss {a} vs data-parallel {b}"
        );
    }
    let d = max_rel_diff(params, &dp_params);
    assert!(
        d < 1e-5,
        "{kind:?} dp{dp} x pp{pp}: parameters differ from data-parallel by {d}"
    );
    for (a, b) in losses.iter().zip(&one_losses) {
        assert!(
            ((a - b) / b).abs() < 1e-5,
            "{kind:?} dp{dp} x pp{pp}: loss {a} vs one process {b}"
        );
    }
    // One process sums the global batch's rows in another order than the mean of the
    // replicas' means, and AdamW's first steps magnify last-bit differences of near-zero
    // gradients: with tied embeddings the data-parallel Trainer itself is ~1.5e-5 from one
    // process (its own tests, ddp.rs, allow 1e-4); untied runs stay within 1e-5.
    let d = max_rel_diff(params, &one_params);
    let d_dp = max_rel_diff(&dp_params, &one_params);
    println!("{kind:?} dp{dp} x pp{pp}: vs one process {d:e} (data-parallel Trainer {d_dp:e})");
    let tol = if tied { 1e-4 } else { 1e-5 };
    assert!(
        d < tol,
        "{kind:?} dp{dp} x pp{pp}: parameters differ from one process by {d}"
    );
}

#[test]
fn dp2_pp2_matches_data_parallel_trainer_and_one_process() {
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
        check_hybrid(four_blocks(2, 2, false), 2, 2, kind, true);
    }
    let interleaved = ScheduleKind::Interleaved { virtual_stages: 2 };
    check_hybrid(four_blocks(2, 2, false), 2, 2, interleaved, true);
    // Tied embeddings: wte's two halves are summed across stages, so not bit-identical.
    check_hybrid(four_blocks(2, 2, true), 2, 2, ScheduleKind::OneFOneB, false);
}

#[test]
fn dp4_pp2_and_dp2_pp4_on_8_ranks_match_data_parallel_trainer() {
    // Four replicas: a ring all-reduce's summation order for an element depends on where it
    // sits in the reduced buffer, and this engine reduces per owned range while the Trainer
    // reduces whole buckets, so the four ranks' gradients are added in other orders: within
    // 1e-5, not bit-identical (two replicas add two values, which commutes exactly).
    check_hybrid(
        four_blocks(2, 2, false),
        4,
        2,
        ScheduleKind::OneFOneB,
        false,
    );
    check_hybrid(four_blocks(2, 2, true), 2, 4, ScheduleKind::GPipe, false);
}

#[test]
fn dp2_pp2_repeated_runs_are_bit_identical() {
    let a = hybrid(four_blocks(2, 2, true), 2, 2, ScheduleKind::OneFOneB);
    let b = hybrid(four_blocks(2, 2, true), 2, 2, ScheduleKind::OneFOneB);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.1, y.1);
        assert_eq!(bits(&x.2), bits(&y.2));
    }
}

#[test]
fn bad_meshes_are_refused_by_name() {
    let refused = |cfg: TrainConfig, shape: MeshShape| -> String {
        run_threads(4, GroupConfig::for_training().unwrap(), move |g| {
            let r = DeviceMesh::new(&g, shape, false)
                .map_err(TrainError::from)
                .and_then(|mesh| PipelineStage::on_mesh(cfg.clone(), &mesh, ScheduleKind::GPipe));
            Ok(r.err().map(|e| e.to_string()))
        })
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .next()
        .flatten()
        .expect("refused")
    };
    // dp x pp does not cover the world.
    let e = refused(four_blocks(2, 1, false), MeshShape::new(2, 3, 1));
    assert!(e.contains("dp 2 x pp 3") && e.contains("world 4"), "{e}");
    // Expert parallelism inside a pipeline is not built yet (tensor parallelism is:
    // tests/pipeline_tensor.rs).
    let ep = MeshShape {
        ep: 2,
        ..MeshShape::new(2, 2, 1)
    };
    let e = refused(four_blocks(2, 1, false), ep);
    assert!(e.contains("expert_parallel"), "{e}");
    // More stages than blocks, named as for one pipeline.
    let mut c = four_blocks(2, 1, false);
    c.model.layers = 1;
    let e = refused(c, MeshShape::new(2, 2, 1));
    assert!(e.contains("pipeline_stages"), "{e}");
}

#[test]
fn replicas_that_disagree_are_refused_on_every_rank() {
    // Replica 1 would run 4 micro-batches where replica 0 runs 2: their reductions would not
    // pair up, so both refuse before the first step.
    let errs = run_threads(2, GroupConfig::for_training().unwrap(), |g| {
        let mesh = DeviceMesh::new(&g, MeshShape::new(2, 1, 1), false)?;
        let cfg = four_blocks(2 + 2 * g.rank(), 1, false);
        Ok(PipelineStage::on_mesh(cfg, &mesh, ScheduleKind::OneFOneB)
            .err()
            .map(|e| e.to_string()))
    })
    .unwrap();
    for e in errs {
        let e = e.unwrap().expect("refused");
        assert!(e.contains("data_parallel"), "{e}");
    }
}

#[test]
fn dp2_pp2_zero1_is_bit_identical_to_unsharded() {
    // AdamW is elementwise: stepping each replica's half of a range and all-gathering the
    // halves gives the bits the unsharded update gives, with half the moments per rank.
    let cfg = four_blocks(2, 2, true);
    let plain = hybrid(cfg.clone(), 2, 2, ScheduleKind::OneFOneB);
    let sharded = run_threads(4, GroupConfig::for_training().unwrap(), move |g| {
        let mesh = DeviceMesh::new(&g, MeshShape::new(2, 2, 1), false)?;
        let (pp, dp) = (mesh.pp().clone(), mesh.dp().clone());
        let mut st =
            PipelineStage::with_zero(cfg.clone(), pp, dp, ScheduleKind::OneFOneB, Stage::One)
                .unwrap();
        let whole = PipelineStage::on_mesh(cfg.clone(), &mesh, ScheduleKind::OneFOneB).unwrap();
        assert_eq!(st.zero_stage(), Some(Stage::One));
        let (half, full) = (st.optimizer_len(), whole.optimizer_len());
        assert!(half.abs_diff(full / 2) <= 4, "moments {half} of {full}");
        let losses: Vec<f64> = (0..cfg.steps).map(|_| st.step().unwrap().loss).collect();
        let c = mesh.coord();
        Ok(((c.dp, c.pp), st.gather_params().unwrap(), losses))
    })
    .unwrap();
    for (r, p) in sharded.into_iter().zip(&plain) {
        let r = r.unwrap();
        assert_eq!(r.0, p.0);
        assert!(r.1 == p.1, "rank {:?}: ZeRO-1 parameters differ", r.0);
        assert_eq!(r.2, p.2, "rank {:?}: ZeRO-1 losses differ", r.0);
    }
    // ZeRO-2 and 3 are refused by name.
    let e = run_threads(2, GroupConfig::for_training().unwrap(), |g| {
        let mesh = DeviceMesh::new(&g, MeshShape::new(2, 1, 1), false)?;
        let (pp, dp) = (mesh.pp().clone(), mesh.dp().clone());
        Ok(PipelineStage::with_zero(
            four_blocks(2, 1, false),
            pp,
            dp,
            ScheduleKind::GPipe,
            Stage::Two,
        )
        .err()
        .map(|e| e.to_string()))
    })
    .unwrap();
    for e in e {
        let e = e.unwrap().expect("refused");
        assert!(e.contains("zero_stage"), "{e}");
    }
}
