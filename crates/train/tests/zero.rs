//! ZeRO-1/2/3: N ranks sharding optimizer state, gradients and parameters end where plain data
//! parallel and one process on the concatenated batch end (up to float summation order),
//! bit-identically between repeated runs, and each rank holds the state the seeds' formulas say.
#[path = "support/common.rs"]
mod common;

use comm::group::GroupConfig;
use comm::local::run_threads;
use common::{max_rel_diff, run, tiny, with_checkpoints};
use model::config::ModelConfig;
use train::zero::{Stage, expected_bytes};
use train::{DataSpec, TrainConfig, Trainer};

#[test]
fn every_stage_matches_data_parallel_and_one_process() {
    for world in [2usize, 3] {
        let mut single = Trainer::new(tiny(2 * world, 4)).unwrap();
        let single_losses: Vec<f64> = (0..4).map(|_| single.step().unwrap().loss).collect();
        let ddp = run(world, tiny(2, 4), 0, 16 << 10);
        for stage in 1..=3u8 {
            let ranks = run(world, tiny(2, 4), stage, 16 << 10);
            for (rank, (params, losses, _, _)) in ranks.iter().enumerate() {
                assert_eq!(params, &ranks[0].0, "ZeRO-{stage} rank {rank} differs");
                for (a, b) in losses.iter().zip(&single_losses) {
                    assert!((a - b).abs() < 1e-5, "ZeRO-{stage} x{world}: {a} vs {b}");
                }
            }
            // Same bound as plain data parallel against one process (tests/ddp.rs).
            let d = max_rel_diff(&ranks[0].0, single.params());
            assert!(d < 1e-4, "ZeRO-{stage} x{world} vs one process: {d}");
            let d = max_rel_diff(&ranks[0].0, &ddp[0].0);
            assert!(d < 1e-4, "ZeRO-{stage} x{world} vs data parallel: {d}");
        }
    }
}

#[test]
fn zero_runs_are_bit_identical() {
    for stage in 1..=3u8 {
        let a = run(2, tiny(2, 3), stage, 16 << 10);
        let b = run(2, tiny(2, 3), stage, 16 << 10);
        assert_eq!(a[0].0, b[0].0, "ZeRO-{stage}");
        assert_eq!(a[1].1, b[1].1, "ZeRO-{stage} losses");
    }
}

#[test]
fn two_ranks_sum_like_data_parallel() {
    // With two ranks every element's sum is one addition, which is commutative: ZeRO's
    // reduce-scatter gives exactly data parallel's all-reduce, so without clipping (whose norm
    // is summed per part) the parameters are bit-identical.
    let mut cfg = tiny(2, 3);
    cfg.grad_clip = None;
    let ddp = run(2, cfg.clone(), 0, 16 << 10);
    for stage in 1..=3u8 {
        let z = run(2, cfg.clone(), stage, 16 << 10);
        assert_eq!(z[0].0, ddp[0].0, "ZeRO-{stage}");
    }
}

#[test]
fn gradient_accumulation_under_every_stage() {
    let mut big = Trainer::new(tiny(4, 3)).unwrap();
    for _ in 0..3 {
        big.step().unwrap();
    }
    for stage in 1..=3u8 {
        let mut c = tiny(1, 3);
        c.grad_accum = 2;
        let z = run(2, c, stage, 16 << 10);
        let d = max_rel_diff(&z[0].0, big.params());
        assert!(d < 1e-4, "ZeRO-{stage} accumulating: {d}");
    }
}

#[test]
fn resident_state_matches_the_formulas() {
    // A model of ~3.4M parameters (13 MB of f32), so page rounding at unit edges is noise.
    let mut cfg = TrainConfig::new(ModelConfig::gpt2(4, 4, 256, 32, 2048), 2);
    cfg.batch = 1;
    cfg.threads = 1;
    cfg.data = DataSpec::Markov { branching: 4 };
    for world in [2usize, 3] {
        for stage in 0..=3u8 {
            let ranks = run(world, cfg.clone(), stage, 1 << 20);
            for (rank, (_, _, mem, n)) in ranks.iter().enumerate() {
                let (p, g, o) = expected_bytes(Stage::from_number(stage).unwrap(), world);
                let n = *n as f64;
                eprintln!(
                    "stage {stage} x{world} rank {rank}: params {} grads {} optim {} comm {} bytes; {n} parameters; formula {p:.2}+{g:.2}+{o:.2} B/param",
                    mem.params, mem.grads, mem.optimizer, mem.comm_buffers
                );
                for (what, got, want) in [
                    ("parameters", mem.params, p * n),
                    ("gradients", mem.grads, g * n),
                    ("optimizer", mem.optimizer, o * n),
                ] {
                    let err = (got as f64 - want).abs() / want;
                    assert!(
                        err < 0.05,
                        "stage {stage} x{world} rank {rank}: {what} {got} bytes, formula {want:.0} ({:.1} %)",
                        100.0 * err
                    );
                }
            }
        }
    }
}

#[test]
fn a_bad_stage_is_refused() {
    assert!(Stage::from_number(4).is_err());
}

#[test]
fn zero_checkpoints_resume_bit_identically_and_across_stages() {
    let mut cfg = tiny(2, 5);
    cfg.grad_clip = None;
    let straight = run(2, cfg.clone(), 2, 16 << 10);
    for (save_stage, load_stage) in [(2u8, 2u8), (3, 1), (0, 3)] {
        let dir = tempfile::tempdir().unwrap();
        let mut first = cfg.clone();
        first.steps = 3;
        with_checkpoints(first, save_stage, dir.path().to_path_buf());
        let c = ckpt::Checkpoint::open(dir.path(), 3, ckpt::Verify::AllPieces).unwrap();
        assert_eq!(c.manifest().world_size, 2);
        let resumed = with_checkpoints(cfg.clone(), load_stage, dir.path().to_path_buf());
        // Two ranks: every stage sums exactly like data parallel (see above), so a run saved at
        // one stage and resumed at another still ends bit-identically.
        assert_eq!(
            resumed, straight[0].0,
            "ZeRO-{save_stage} -> ZeRO-{load_stage}"
        );
        assert_eq!(ckpt::list_committed(dir.path()).unwrap(), vec![2, 3, 4, 5]);
    }
}

/// `world` ranks (1: one process) of `cfg` resume from `dir` and train to `cfg.steps`, saving
/// at the end; returns rank 0's parameters and the rows drawn.
fn elastic_leg(world: usize, cfg: TrainConfig, dir: std::path::PathBuf) -> (Vec<f32>, u64) {
    let leg = move |t: &mut Trainer, rank: u32, size: u32| {
        train::Checkpointer::resume(&dir, t).unwrap();
        let ck = train::CheckpointConfig {
            dir: dir.clone(),
            every: 0,
            asynchronous: false,
            auto_mtbf: None,
        };
        let mut ck = train::Checkpointer::new(ck, "elastic")
            .unwrap()
            .with_shard(rank, size)
            .unwrap();
        while t.steps_done() < t.config().steps {
            ck.step(t).unwrap();
        }
        ck.finish(t).unwrap();
        (t.params().to_vec(), t.rows_drawn())
    };
    if world == 1 {
        let mut t = Trainer::new(cfg).unwrap();
        return leg(&mut t, 0, 1);
    }
    let out = run_threads(world, GroupConfig::for_training().unwrap(), move |g| {
        let (rank, size) = (g.rank() as u32, g.size() as u32);
        let mut t = Trainer::zero(cfg.clone(), g, Stage::Two, 16 << 10).unwrap();
        // Every rank only reads the directory; rank 0 alone commits, after the others wrote.
        let r = leg(&mut t, rank, size);
        t.group().unwrap().barrier().unwrap();
        Ok(r)
    })
    .unwrap();
    out.into_iter().next().unwrap().unwrap()
}

#[test]
fn an_elastic_resume_continues_the_row_stream_on_fewer_ranks() {
    // 3 ranks x 2 rows for 2 steps, then 2 ranks x 2 rows for 2 more: the same global batches
    // (6 rows, then 4) as one process accumulating 3, then 2, micro-batches of 2 rows.
    let (elastic, single) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut cfg = tiny(2, 2);
    let (_, rows) = elastic_leg(3, cfg.clone(), elastic.path().to_path_buf());
    assert_eq!(rows, 12);
    let mut accumulating = cfg.clone();
    accumulating.grad_accum = 3;
    elastic_leg(1, accumulating.clone(), single.path().to_path_buf());
    cfg.steps = 4;
    let (resumed, rows) = elastic_leg(2, cfg.clone(), elastic.path().to_path_buf());
    assert_eq!(rows, 20);
    cfg.grad_accum = 2;
    let (reference, rows) = elastic_leg(1, cfg, single.path().to_path_buf());
    assert_eq!(rows, 20);
    let d = max_rel_diff(&resumed, &reference);
    assert!(d < 1e-4, "elastic 3 -> 2 ranks vs one process: {d}");
    let c = ckpt::Checkpoint::open(elastic.path(), 4, ckpt::Verify::AllPieces).unwrap();
    assert_eq!(c.manifest().world_size, 2);
}
