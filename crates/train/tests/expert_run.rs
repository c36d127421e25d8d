//! Expert parallelism in the one trainer ([`Trainer::expert_parallel`]): the model's blocks
//! carry experts split over the data-parallel ranks. EP = 2 matches one process on the same
//! global batch (top-1 and top-2, with and without drops); its asynchronous checkpoints
//! resume it bit-identically and one process continues them; each expert is written by its
//! owner only.
#[path = "support/common.rs"]
mod common;

use comm::group::GroupConfig;
use comm::local::run_threads;
use common::{max_rel_diff, rel};
use model::config::{ModelConfig, MoeSpec};
use train::{CheckpointConfig, Checkpointer, DataSpec, TrainConfig, Trainer};

const GLOBAL_ROWS: usize = 4;

/// A 2-layer GPT-2 (C = 32, 4 heads) with 4 experts of F = 64 per block.
fn cfg(batch: usize, steps: u64, top_k: usize, capacity_factor: f64) -> TrainConfig {
    let mut m = ModelConfig::gpt2(2, 4, 32, 16, 64);
    m.ffn = 64;
    m.moe = Some(MoeSpec {
        experts: 4,
        top_k,
        capacity_factor,
        aux_weight: 0.01,
    });
    let mut c = TrainConfig::new(m, steps);
    c.batch = batch;
    c.seq_len = 16;
    c.lr = 3e-3;
    c.threads = 1;
    c.seed = 7;
    c.grad_clip = Some(0.5);
    c.data = DataSpec::Markov { branching: 4 };
    c
}

/// Per-step losses, the last step's routing (dropped, routed) and the whole parameters.
type Out = (Vec<f64>, (usize, usize), Vec<f32>);

fn routing(t: &Trainer) -> (usize, usize) {
    let s = t.model().moe_stats();
    (
        s.iter().map(|s| s.dropped_assignments).sum(),
        s.iter().map(|s| s.routed.iter().sum::<usize>()).sum(),
    )
}

fn one_process(c: TrainConfig) -> Out {
    let mut t = Trainer::new(c.clone()).unwrap();
    let losses = (0..c.steps).map(|_| t.step().unwrap().loss).collect();
    (losses, routing(&t), t.params().to_vec())
}

/// `world` data-parallel ranks with the experts split over EP groups of `ep` (groups as a
/// training job's: each op's algorithm chosen by the layout, so every run sums alike).
fn ep_run(world: usize, ep: usize, c: TrainConfig) -> Out {
    let out = run_threads(world, GroupConfig::for_training().unwrap(), move |g| {
        let mut t = Trainer::expert_parallel(c.clone(), g, ep, 16 << 10).unwrap();
        let losses: Vec<f64> = (0..c.steps).map(|_| t.step().unwrap().loss).collect();
        let r = routing(&t);
        Ok((losses, r, t.whole_params().unwrap()))
    })
    .unwrap();
    let outs: Vec<Out> = out.into_iter().map(|r| r.unwrap()).collect();
    for o in &outs[1..] {
        assert_eq!(o.0, outs[0].0, "ranks report the same losses");
        assert_eq!(o.2, outs[0].2, "ranks assemble the same model");
    }
    outs.into_iter().next().unwrap()
}

#[test]
fn ep2_matches_one_process_with_top1_top2_and_drops() {
    for (k, cf) in [(1, 1.0), (2, 1.0), (2, 4.0)] {
        let (one, one_r, one_p) = one_process(cfg(GLOBAL_ROWS, 3, k, cf));
        let (two, two_r, two_p) = ep_run(2, 2, cfg(GLOBAL_ROWS / 2, 3, k, cf));
        for (s, (a, b)) in two.iter().zip(&one).enumerate() {
            assert!(rel(*a, *b) < 1e-5, "top-{k} cf {cf} step {s}: {a} vs {b}");
        }
        // Capacity is global over the group, in global token order: the same drops.
        assert_eq!(two_r, one_r, "top-{k} cf {cf}: (dropped, routed)");
        let d = max_rel_diff(&two_p, &one_p);
        assert!(d < 1e-5, "top-{k} cf {cf}: parameters differ by {d:.2e}");
        println!("top-{k} cf {cf}: routing {two_r:?}, parameters within {d:.1e}");
    }
}

#[test]
fn dp4_with_two_ep2_groups_matches_one_process_without_drops() {
    // Two EP groups of two ranks, each routing its own half of the global batch: without
    // drops or an aux loss (both per routing group) the objective is one process's.
    let same = |batch| {
        let mut c = cfg(batch, 3, 2, 4.0);
        if let Some(m) = c.model.moe.as_mut() {
            m.aux_weight = 0.0;
        }
        c
    };
    let (one, _, one_p) = one_process(same(GLOBAL_ROWS));
    let (four, _, four_p) = ep_run(4, 2, same(GLOBAL_ROWS / 4));
    for (s, (a, b)) in four.iter().zip(&one).enumerate() {
        assert!(rel(*a, *b) < 1e-5, "step {s}: {a} vs {b}");
    }
    let d = max_rel_diff(&four_p, &one_p);
    assert!(d < 1e-5, "DP4 x EP2: parameters differ by {d:.2e}");
}

/// `world` ranks train `c` with experts split over EP groups of `ep`, checkpointing every 2
/// steps into `dir` (asynchronous) after resuming from it; returns the whole parameters.
fn ep_with_checkpoints(
    (world, ep): (usize, usize),
    c: TrainConfig,
    dir: std::path::PathBuf,
) -> Vec<f32> {
    let out = run_threads(world, GroupConfig::for_training().unwrap(), move |g| {
        let (rank, size) = (g.rank() as u32, g.size() as u32);
        let mut t = Trainer::expert_parallel(c.clone(), g, ep, 16 << 10).unwrap();
        Checkpointer::resume(&dir, &mut t).unwrap();
        let ck = CheckpointConfig {
            dir: dir.clone(),
            every: 2,
            asynchronous: true,
            auto_mtbf: None,
        };
        let mut ck = Checkpointer::new(ck, "moe")
            .unwrap()
            .with_shard(rank, size)
            .unwrap();
        while t.steps_done() < c.steps {
            ck.step(&mut t).unwrap();
        }
        ck.finish(&mut t).unwrap();
        t.group().unwrap().barrier().unwrap();
        Ok(t.whole_params().unwrap())
    })
    .unwrap();
    out.into_iter().next().unwrap().unwrap()
}

#[test]
fn ep2_checkpoints_resume_bit_identically_and_one_process_continues_them() {
    // No drops (capacity factor 4) and no aux loss, so one process accumulating two
    // micro-batches of the global batch has the group's objective (capacity and the aux loss
    // are per routing batch).
    let ep2 = |steps| {
        let mut c = cfg(GLOBAL_ROWS / 2, steps, 2, 4.0);
        if let Some(m) = c.model.moe.as_mut() {
            m.aux_weight = 0.0;
        }
        c
    };
    let straight = ep_run(2, 2, ep2(5)).2;
    let dir = tempfile::tempdir().unwrap();
    ep_with_checkpoints((2, 2), ep2(3), dir.path().to_path_buf());
    let c = ckpt::Checkpoint::open(dir.path(), 3, ckpt::Verify::AllPieces).unwrap();
    assert_eq!(c.manifest().world_size, 2);
    let resumed = ep_with_checkpoints((2, 2), ep2(5), dir.path().to_path_buf());
    assert_eq!(resumed, straight, "EP2 3 + save + resume + 2 vs 5 straight");
    // One process (the same rows per micro-batch, two micro-batches a step) resumes the EP2
    // checkpoint of step 3.
    let dir3 = tempfile::tempdir().unwrap();
    ep_with_checkpoints((2, 2), ep2(3), dir3.path().to_path_buf());
    let mut c1 = ep2(5);
    c1.grad_accum = 2;
    let mut one = Trainer::new(c1).unwrap();
    let (step, _) = Checkpointer::resume(dir3.path(), &mut one)
        .unwrap()
        .unwrap();
    assert_eq!(step, 3);
    while one.steps_done() < 5 {
        one.step().unwrap();
    }
    let d = max_rel_diff(one.params(), &straight);
    assert!(d < 1e-5, "one process after EP2's step 3: {d:.2e}");
}

#[test]
fn dp4_x_ep2_checkpoints_resume_bit_identically_and_one_process_continues_them() {
    // Four ranks in two EP groups: each expert written once (by the first of its replicas).
    let dp4 = |steps| {
        let mut c = cfg(1, steps, 2, 4.0);
        if let Some(m) = c.model.moe.as_mut() {
            m.aux_weight = 0.0;
        }
        c
    };
    let straight = ep_run(4, 2, dp4(5)).2;
    let dir = tempfile::tempdir().unwrap();
    ep_with_checkpoints((4, 2), dp4(3), dir.path().to_path_buf());
    let mut one = dp4(5);
    one.grad_accum = 4;
    let mut one = Trainer::new(one).unwrap();
    let (step, _) = Checkpointer::resume(dir.path(), &mut one).unwrap().unwrap();
    assert_eq!(step, 3);
    let resumed = ep_with_checkpoints((4, 2), dp4(5), dir.path().to_path_buf());
    assert_eq!(
        resumed, straight,
        "DP4 x EP2 3 + save + resume + 2 vs 5 straight"
    );
    while one.steps_done() < 5 {
        one.step().unwrap();
    }
    let d = max_rel_diff(one.params(), &straight);
    assert!(d < 1e-5, "one process after DP4 x EP2's step 3: {d:.2e}");
}
