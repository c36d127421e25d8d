//! DP x TP (issue 8; 000 "混合并行", "Megatron 风格的张量并行" F46-F47): data-parallel
//! replicas of a tensor-parallel group on a device mesh (`Trainer::on_mesh`).
//!
//! - Equivalence. DP2 x TP2 on 4 ranks (GPT-2), DP4 x TP2 (GPT-2) and DP2 x TP4 (Llama GQA,
//!   grad_accum 2) on 8 ranks train 3 steps with clipping on every step; each replica draws
//!   `batch` rows of every global micro-batch of `dp x batch` rows. Per-step loss, gradient
//!   norm and final parameters match one process `Trainer` on the concatenated global batch
//!   (`batch x dp` rows) and the loss and parameters a data-parallel `Trainer` on `dp` ranks,
//!   within the 1e-4 relative tolerance of `tensor_train.rs`; every rank reports the same
//!   stats and gathers the same model, replicated tensors bit-identical on all ranks.
//! - Determinism. Two runs of DP4 x TP2 are bit-identical (stats and every rank's flat
//!   parameters), the second with another all-reduce algorithm forced on the groups: the
//!   gradient sums are pinned to the ring.
//! - Refusals. A mesh whose `dp x pp x tp` is not the world, hand-made groups that are not a
//!   `dp x tp` grid (a dp group joining different tp ranks; replicas of different tp degrees),
//!   replicas with different configs, and a mesh with pipeline stages are refused on every
//!   rank, naming `data_parallel` / the axis and the equation.
//!
//! Checkpoints between DP4 and DP2 x TP2 (both ways) are in `tensor_ckpt.rs`.
#[path = "support/common.rs"]
mod common;
use std::ops::Range;

use comm::OpKind;
use comm::algo::Algo;
use comm::group::GroupConfig;
use comm::local::run_threads;
use comm::mesh::{DeviceMesh, MeshShape};
use common::{assert_steps_close, max_rel_diff, rel};
use model::config::ModelConfig;
use train::{TrainConfig, TrainError, Trainer};

const STEPS: u64 = 3;
const TOL: f64 = 1e-4;
/// Clipping threshold below the initial gradient norm (checked), so every step clips.
const CLIP: f64 = 0.05;
/// Data-parallel Trainer buckets: several per block.
const BUCKET: usize = 16 << 10;

/// Groups that skip the α-β calibration at creation (most of a test's time on 2 cores with 8
/// ranks). Selection is then the same in every run, so [`repeated_runs_are_bit_identical`]
/// runs once calibrated, as a real run does, and once with another all-reduce forced.
fn uncalibrated() -> GroupConfig {
    GroupConfig {
        calibrate: false,
        ..GroupConfig::default()
    }
}

/// A 2-layer GPT-2 (4 heads, C = 64, F = 256, V = 64, tied) on the Markov corpus, batch 2 of
/// 16 per replica, warmup then cosine over the 3 steps, clipping at [`CLIP`].
fn gpt2() -> TrainConfig {
    common::gpt2_cosine(STEPS, CLIP)
}

/// A 2-layer Llama (8 query heads over 4 kv heads, C = 64, SwiGLU F = 128, rotary, untied)
/// with `gpt2`'s schedule and data, two micro-batches of 2 rows per replica and step, weight
/// decay on matrices only.
fn llama() -> TrainConfig {
    let mut c = gpt2();
    c.model = ModelConfig::llama(2, 8, 4, 64, 128, 16, 64);
    c.grad_accum = 2;
    c.decay_all = false;
    c
}

/// What one rank of a DP x TP run returns.
struct RankOut {
    /// (dp, tp) coordinate.
    coord: (usize, usize),
    /// Per-step (loss, gradient norm).
    stats: Vec<(f64, f64)>,
    /// The whole model gathered over the rank's tp group.
    whole: Vec<f32>,
    /// The rank's flat parameters.
    local: Vec<f32>,
    /// The replicated (embedding, head) ranges of `local`.
    replicated: Vec<Range<usize>>,
}

/// `dp x tp` ranks (threads) with groups of `group` on a mesh train `cfg` for `cfg.steps`.
fn mesh_run((dp, tp): (usize, usize), group: GroupConfig, cfg: &TrainConfig) -> Vec<RankOut> {
    let cfg = cfg.clone();
    run_threads(dp * tp, group, move |g| {
        let mesh = DeviceMesh::new(&g, MeshShape::new(dp, 1, tp), false)?;
        let mut t = Trainer::on_mesh(cfg.clone(), &mesh, (None, false), 1 << 20).unwrap();
        let c = mesh.coord();
        assert_eq!(
            (t.rank(), t.world(), t.tp_rank(), t.tp()),
            (c.dp, dp, c.tp, tp)
        );
        let stats = (0..cfg.steps)
            .map(|_| {
                let s = t.step().unwrap();
                (s.loss, s.grad_norm)
            })
            .collect();
        let l = t.tensor_part().unwrap().layout.clone();
        Ok(RankOut {
            coord: (c.dp, c.tp),
            stats,
            replicated: vec![l.embed.clone(), l.head.clone()],
            whole: t.whole_params().unwrap(),
            local: t.params().to_vec(),
        })
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// `world` data-parallel `Trainer` ranks of `cfg` (one process, no group, when `world` is 1)
/// train `cfg.steps`: rank 0's per-step (loss, norm) and final parameters.
fn trainer_run(world: usize, cfg: &TrainConfig) -> (Vec<(f64, f64)>, Vec<f32>) {
    let run = |mut t: Trainer| {
        let stats = (0..t.config().steps)
            .map(|_| t.step().map(|s| (s.loss, s.grad_norm)).unwrap())
            .collect();
        (stats, t.params().to_vec())
    };
    if world == 1 {
        return run(Trainer::new(cfg.clone()).unwrap());
    }
    let cfg = cfg.clone();
    let mut out = run_threads(world, uncalibrated(), move |g| {
        Ok(run(Trainer::data_parallel(cfg.clone(), g, BUCKET).unwrap()))
    })
    .unwrap();
    out.swap_remove(0).unwrap()
}

/// Every rank reports rank 0's stats, gathers its model, and holds bit-identical replicated
/// tensors (replicas and tp ranks alike).
fn assert_ranks_agree(what: &str, ranks: &[RankOut]) {
    let r0 = &ranks[0];
    for o in ranks {
        assert_eq!(o.stats, r0.stats, "{what} rank {:?}: stats", o.coord);
        assert!(o.whole == r0.whole, "{what} rank {:?}: gathered", o.coord);
        for range in &o.replicated {
            assert!(
                o.local[range.clone()] == r0.local[range.clone()],
                "{what} rank {:?}: replicated {range:?} diverged",
                o.coord
            );
        }
    }
}

/// `dp x tp` against one process on the `dp x batch`-row global batch and a data-parallel
/// Trainer on `dp` ranks.
fn matches_one_process_and_data_parallel(name: &str, cfg: TrainConfig, dp: usize, tp: usize) {
    let what = format!("{name} dp{dp} x tp{tp}");
    let mut whole = cfg.clone();
    whole.batch *= dp;
    let (want, one) = trainer_run(1, &whole);
    assert!(
        want[0].1 > CLIP,
        "{what}: initial norm {} must exceed the clip {CLIP} so that clipping is exercised",
        want[0].1
    );
    let ranks = mesh_run((dp, tp), uncalibrated(), &cfg);
    assert_ranks_agree(&what, &ranks);
    let r0 = &ranks[0];
    assert_steps_close(&format!("{what} vs one process"), &r0.stats, &want, TOL);
    let d_one = max_rel_diff(&r0.whole, &one);
    let (dp_stats, dp_params) = trainer_run(dp, &cfg);
    for (s, (&(l, n), &(dl, dn))) in r0.stats.iter().zip(&dp_stats).enumerate() {
        assert!(
            rel(l, dl) < TOL,
            "{what} step {}: loss {l} vs DP {dl}",
            s + 1
        );
        assert!(
            rel(n, dn) < TOL,
            "{what} step {}: norm {n} vs DP {dn}",
            s + 1
        );
    }
    let d_dp = max_rel_diff(&r0.whole, &dp_params);
    let dp_one = max_rel_diff(&dp_params, &one);
    println!(
        "{what}: params after {STEPS} steps, max rel diff vs one process {d_one:.2e}, vs DP{dp} \
         Trainer {d_dp:.2e} (DP{dp} Trainer vs one process {dp_one:.2e})"
    );
    assert!(
        d_one < TOL,
        "{what}: params differ from one process by {d_one:e}"
    );
    assert!(
        d_dp < TOL,
        "{what}: params differ from the DP Trainer by {d_dp:e}"
    );
}

#[test]
fn dp2_tp2_matches_one_process_and_data_parallel_trainer() {
    matches_one_process_and_data_parallel("gpt2", gpt2(), 2, 2);
}

#[test]
fn dp4_tp2_and_dp2_tp4_on_8_ranks_match_one_process_and_data_parallel_trainer() {
    matches_one_process_and_data_parallel("gpt2", gpt2(), 4, 2);
    matches_one_process_and_data_parallel("llama", llama(), 2, 4);
}

#[test]
fn repeated_runs_are_bit_identical() {
    // Four replicas: a ring sums an element's four values in an order set by its place in the
    // buffer, so another algorithm would give other bits (two values commute exactly). The
    // second run forces the binomial tree on every all-reduce the engine leaves to the group
    // (and calibrates nothing): the gradient sums are pinned to the ring, the other
    // all-reduces (loss, norm partials, failure flags) are exact whatever the algorithm, so
    // the bits must not change; an unpinned gradient sum would change them.
    let (dp, tp) = (4, 2);
    let cfg = gpt2();
    let a = mesh_run((dp, tp), GroupConfig::for_training().unwrap(), &cfg);
    let mut tree = uncalibrated();
    tree.algo.insert(OpKind::AllReduce, Algo::Tree);
    let b = mesh_run((dp, tp), tree, &cfg);
    let bits = |s: &[(f64, f64)]| -> Vec<(u64, u64)> {
        s.iter().map(|(l, n)| (l.to_bits(), n.to_bits())).collect()
    };
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(
            bits(&x.stats),
            bits(&y.stats),
            "dp{dp} x tp{tp} {:?}",
            x.coord
        );
        let eq = x
            .local
            .iter()
            .zip(&y.local)
            .all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(
            eq,
            "dp{dp} x tp{tp} {:?}: parameters differ between runs",
            x.coord
        );
    }
}

/// Every rank of `world` builds its tp and dp groups from the world group (`tp_groups` and
/// `dp_groups` list every group's world ranks) and then a DP x TP trainer of `cfg(rank)`;
/// each rank's error text (all must fail).
fn refused_with_groups(
    world: usize,
    tp_groups: Vec<Vec<usize>>,
    dp_groups: Vec<Vec<usize>>,
    cfg: fn(usize) -> TrainConfig,
) -> Vec<String> {
    run_threads(world, uncalibrated(), move |g| {
        let mut mine = Vec::new();
        for (axis, groups) in [("tp", &tp_groups), ("dp", &dp_groups)] {
            for (i, ranks) in groups.iter().enumerate() {
                if let Some(sub) = g.subgroup(&format!("{axis}{i}"), ranks)? {
                    mine.push(sub);
                }
            }
        }
        let dp = mine.pop().expect("a dp group");
        let tp = mine.pop().expect("a tp group");
        Ok(
            Trainer::tensor_data_parallel(cfg(g.rank()), (tp, false), dp, None, 1 << 20)
                .err()
                .map(|e| e.to_string()),
        )
    })
    .unwrap()
    .into_iter()
    .enumerate()
    .map(|(r, e)| {
        e.unwrap()
            .unwrap_or_else(|| panic!("rank {r} was not refused"))
    })
    .collect()
}

#[test]
fn mismatched_degrees_and_setups_are_refused_on_every_rank() {
    let base = |_: usize| gpt2();
    // The mesh checks its equation first.
    let e = run_threads(4, uncalibrated(), |g| {
        let r = DeviceMesh::new(&g, MeshShape::new(2, 1, 3), false)
            .map_err(TrainError::from)
            .and_then(|mesh| Trainer::on_mesh(gpt2(), &mesh, (None, false), 1 << 20));
        Ok(r.err().map(|e| e.to_string()))
    })
    .unwrap();
    for e in e {
        let e = e.unwrap().expect("refused");
        assert!(e.contains("dp 2 x pp 1 x tp 3 = 6 != world 4"), "{e}");
    }
    // A dp group must join one tp rank of every replica: here tp rank 0 with tp rank 1.
    let errs = refused_with_groups(
        4,
        vec![vec![0, 1], vec![2, 3]],
        vec![vec![0, 3], vec![1, 2]],
        base,
    );
    for e in &errs {
        assert!(e.contains("data_parallel = dp 2 x tp 2"), "{e}");
        assert!(
            e.contains("dp x tp = world") && e.contains("dp 2 x tp 2 = 4 ranks"),
            "{e}"
        );
        assert!(e.contains("dp group runs tp rank"), "{e}");
    }
    // Replicas of different tp degrees (a tp-2 group and a tp-1 group on 3 ranks).
    let errs = refused_with_groups(
        3,
        vec![vec![0, 1], vec![2]],
        vec![vec![0, 2], vec![1]],
        base,
    );
    // Rank 0 sees its tp peer in a dp group of 1, rank 1 the reverse, rank 2 a tp-2 peer.
    assert!(
        errs[0].contains("tp group runs dp 1 where member 0 runs dp 2"),
        "{}",
        errs[0]
    );
    assert!(
        errs[1].contains("tp group runs dp 2 where member 1 runs dp 1"),
        "{}",
        errs[1]
    );
    assert!(
        errs[2].contains("dp group runs tp 2 where member 1 runs tp 1"),
        "{}",
        errs[2]
    );
    assert!(errs[2].contains("dp 2 x tp 1 = 2 ranks"), "{}", errs[2]);
    for e in &errs {
        assert!(
            e.contains("data_parallel") && e.contains("dp x tp = world"),
            "{e}"
        );
    }
    // Replicas with another training config (batch 4 against 2).
    let errs = refused_with_groups(
        4,
        vec![vec![0, 1], vec![2, 3]],
        vec![vec![0, 2], vec![1, 3]],
        |r| {
            let mut c = gpt2();
            c.batch = if r < 2 { 2 } else { 4 };
            c
        },
    );
    for e in &errs {
        assert!(
            e.contains("data_parallel") && e.contains("training config"),
            "{e}"
        );
    }
    // Pipeline stages are not composed with tensor parallelism yet.
    let e = run_threads(4, uncalibrated(), |g| {
        let mesh = DeviceMesh::new(&g, MeshShape::new(1, 2, 2), false)?;
        Ok(Trainer::on_mesh(gpt2(), &mesh, (None, false), 1 << 20)
            .err()
            .map(|e| e.to_string()))
    })
    .unwrap();
    for e in e {
        let e = e.unwrap().expect("refused");
        assert!(
            e.contains("pipeline_parallel = 2") && e.contains("dp 1 x pp 2 x tp 2"),
            "{e}"
        );
    }
}
