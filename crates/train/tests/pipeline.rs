//! Pipeline parallelism (file 000 Algorithm 1): PP = 2 and 4 under GPipe, 1F1B and interleaved
//! 1F1B end where one process with `grad_accum = m` ends on the same batches (up to float
//! summation order), repeated runs are bit-identical, and bad layouts are refused by name.
#[path = "support/common.rs"]
mod common;

use comm::group::GroupConfig;
use comm::local::run_threads;
use common::{max_rel_diff, tiny};
use train::pipeline::{PipelineStage, ScheduleKind};
use train::{TrainConfig, Trainer};

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
    run_threads(p, GroupConfig::default(), move |g| {
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
        run_threads(world, GroupConfig::default(), move |g| {
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
    // bf16 is not built for pipelines.
    let mut c = four_blocks(4, 1, false);
    c.bf16 = true;
    let e = refused(c, 2, 2, ScheduleKind::GPipe);
    assert!(e.contains("bf16"), "{e}");
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
