//! DP x TP: `d` data-parallel replicas of one `t`-way tensor-parallel group (000 "混合并行",
//! §2.20; the tensor-parallel part is "Megatron 风格的张量并行", F46–F47), the update a
//! data-parallel [`crate::Trainer`] on `d` ranks makes, up to float summation order.
//!
//! ```text
//! world rank = tp + t·dp (comm::mesh order, pp = 1), here d = 2, t = 2:
//!            tp 0  tp 1
//!   dp 0:    r0    r1     one TP group: rows [0, b) of every global micro-batch of 2b rows
//!   dp 1:    r2    r3     the other:    rows [b, 2b)
//!            └dp┘  └dp┘   each tp rank's data-parallel group: the same shard in every replica
//! ```
//!
//! - Data. Every rank of replica `j` draws the `cfg.batch` rows data-parallel rank `j` of `d`
//!   draws ([`crate::source::Share`]); the global row cursor advances by `d · batch` per
//!   micro-batch.
//! - Gradients. After the backward of the step's `m` micro-batches, each rank sums its flat
//!   gradients (`layout.total` elements, laid out alike on every member of its dp group: the
//!   same tp rank of every replica) over the dp group in one all-reduce pinned to
//!   [`super::TP_ALL_REDUCE`], then scales them by `(1/m)/d` in one multiplication as
//!   [`crate::ddp::GradBuckets::finish`] does. The pinned ring gives every member the same
//!   bytes, and every tp rank's dp group sums the same replicated-tensor values at the same
//!   offsets, so replicated tensors stay bit-identical across the tp group and replicas stay
//!   bit-identical to each other.
//! - Norm and clipping. After that sum (every replica holds the mean gradient), over the tp
//!   group only, each element of the whole model counted once, as without replicas.
//! - Loss. The replicas' mean, summed exactly in replica order (`sum_in_rank_order`), and
//!   checked for finiteness only then, so a non-finite loss on one replica fails every rank
//!   together rather than leaving the others waiting in the gradient sum.
//! - Agreement. Before anything else the replicas exchange their setup (tp degree and rank,
//!   dp degree and rank, `grad_accum`, the training config's hash) over both groups: ranks
//!   that would pair unlike buffers in the dp all-reduce fail together with an error naming
//!   `data_parallel` and the equation `dp x tp = world`, instead of hanging or summing
//!   nonsense.
//! - Cost. Per step one all-reduce of `4 · layout.total` bytes per rank over dp (a ring moves
//!   `2(d−1)/d` of it), beside the tp group's four all-reduces of (N, C) per block and
//!   micro-batch (F46).
use std::time::Instant;

use comm::ReduceOp;
use comm::group::{ProcessGroup, group_id};
use comm::mesh::DeviceMesh;
use model::Threads;
use model::optim::scale_grads;

use super::trainer::{PINNED, TpTrainer, refuse, sum_in_rank_order};
use crate::checkpoint::config_hash;
use crate::config::TrainConfig;
use crate::error::Result;

/// What a rank tells its peers before training, one value per name (see [`setup`]).
const SETUP: [&str; 6] = ["tp", "tp rank", "dp", "dp rank", "grad_accum", "config"];
/// The index in [`SETUP`] of the tp rank, the one field that differs inside a tp group.
const TP_RANK: usize = 1;
/// The index in [`SETUP`] of the dp rank, the one field that differs inside a dp group.
const DP_RANK: usize = 3;

impl TpTrainer {
    /// Rank `tp.rank()` of a `tp.size()`-way tensor-parallel group that is replica `dp.rank()`
    /// of `dp.size()` data-parallel replicas (DP x TP, 000 "混合并行"; see the module doc):
    /// the replica trains on its `cfg.batch` rows of every global micro-batch of
    /// `cfg.batch x dp.size()` rows (the rows a data-parallel [`crate::Trainer`] rank of that
    /// index takes), the gradients are summed over `dp` and scaled by `(1/grad_accum)/d` before
    /// the norm, clipping and AdamW, and the loss reported is the replicas' mean. Ends where a
    /// data-parallel `Trainer` on `d` ranks ends, within float summation order.
    ///
    /// `dp` must join this tp rank of every replica and `tp` one replica's ranks (a
    /// `dp x tp` grid, as [`DeviceMesh`] builds); every rank must pass the same config. Checked
    /// collectively over both groups before anything else: an error naming `data_parallel`
    /// and the equation on every rank otherwise. Other errors as [`TpTrainer::new`].
    pub fn with_data_parallel(
        cfg: TrainConfig,
        tp: ProcessGroup,
        dp: ProcessGroup,
    ) -> Result<Self> {
        agree_across_replicas(&cfg, &tp, &dp)?;
        Self::build(cfg, tp, Some(dp))
    }

    /// [`TpTrainer::with_data_parallel`] over a device mesh's tensor- and data-parallel
    /// groups. Errors naming `pipeline_parallel` or `expert_parallel` when the mesh has
    /// `pp > 1` or `ep > 1` (not composed with tensor parallelism yet); the same on every rank
    /// (they share the shape), so none waits for another.
    pub fn on_mesh(cfg: TrainConfig, mesh: &DeviceMesh) -> Result<Self> {
        let shape = mesh.shape();
        for (field, n) in [
            ("pipeline_parallel", shape.pp),
            ("expert_parallel", shape.ep),
        ] {
            if n > 1 {
                return Err(refuse(
                    field,
                    &n.to_string(),
                    &format!(
                        "mesh {shape}: tensor parallelism composes only with data parallelism \
                         so far (dp {} x tp {} = world, pp 1, ep 1)",
                        shape.dp, shape.tp
                    ),
                ));
            }
        }
        Self::with_data_parallel(cfg, mesh.tp().clone(), mesh.dp().clone())
    }
}

impl TpTrainer {
    /// [`TpTrainer::on_mesh`] with ZeRO `stage` over the data-parallel replicas (FSDP-style
    /// sharding inside DP x TP, 000 §2.20). Stage 1 is built ([`crate::zero::replica`]): each
    /// replica keeps AdamW's moments for `1/d` of its flat buffers, steps that part after the
    /// replicas' sum and the clipping, and the parts are all-gathered back; the parameters are
    /// bit-identical to the unsharded run. Errors naming `zero_stage` for stages 2 and 3 (not
    /// built with tensor parallelism yet), else as `on_mesh`.
    pub fn with_zero(
        cfg: TrainConfig,
        mesh: &DeviceMesh,
        stage: crate::zero::Stage,
    ) -> Result<Self> {
        if stage != crate::zero::Stage::One {
            return Err(refuse(
                "zero_stage",
                &stage.number().to_string(),
                "tensor-parallel ranks shard only the optimizer state (ZeRO-1) so far",
            ));
        }
        let mut t = Self::on_mesh(cfg, mesh)?;
        t.shard_optimizer()?;
        Ok(t)
    }
}

/// This rank's setup as [`SETUP`] names it.
fn setup(cfg: &TrainConfig, tp: &ProcessGroup, dp: &ProcessGroup) -> [i64; 6] {
    let config = group_id(&config_hash(cfg));
    let small = |x: usize| i64::try_from(x).unwrap_or(i64::MAX);
    [
        small(tp.size()),
        small(tp.rank()),
        small(dp.size()),
        small(dp.rank()),
        small(cfg.grad_accum),
        i64::from_le_bytes(config.to_le_bytes()),
    ]
}

/// `v`, the value of [`SETUP`] field `field`, as an error message shows it.
fn show(field: usize, v: i64) -> String {
    match SETUP[field] {
        "config" => format!(
            "training config {:016x}",
            u64::from_le_bytes(v.to_le_bytes())
        ),
        name => format!("{name} {v}"),
    }
}

/// Gathers every member's setup over `group` (a collective) and describes the first member
/// that differs from `mine` in a field other than `own` (the one expected to differ there).
fn disagreement(group: &ProcessGroup, mine: &[i64; 6], own: usize) -> Result<Option<String>> {
    let mut all = vec![0i64; mine.len() * group.size()];
    group.all_gather(mine, &mut all)?;
    for (member, theirs) in all.chunks(mine.len()).enumerate() {
        let differs = (0..mine.len()).find(|&f| f != own && theirs[f] != mine[f]);
        if let Some(f) = differs {
            return Ok(Some(format!(
                "member {member} of this rank's {} group runs {} where member {} runs {}",
                if own == TP_RANK { "tp" } else { "dp" },
                show(f, theirs[f]),
                group.rank(),
                show(f, mine[f]),
            )));
        }
    }
    Ok(None)
}

/// Checks (collectively over `tp` and `dp`) that the ranks form a `dp x tp` grid of one
/// config: inside a tp group the same replica (dp rank) and degrees, inside a dp group the
/// same tp rank and degrees; every rank fails when any rank of the world it can see does.
fn agree_across_replicas(cfg: &TrainConfig, tp: &ProcessGroup, dp: &ProcessGroup) -> Result<()> {
    let mine = setup(cfg, tp, dp);
    // Both gathers run before any verdict, so every peer's collectives pair up.
    let over_tp = disagreement(tp, &mine, TP_RANK)?;
    let over_dp = disagreement(dp, &mine, DP_RANK)?;
    let mine_ok = over_tp.is_none() && over_dp.is_none();
    let failed = failures(tp, Some(dp), mine_ok)?;
    let why = match over_tp.or(over_dp) {
        Some(why) => why,
        None if failed > 0 => format!("{failed} rank(s) of the world found a mismatch"),
        None => return Ok(()),
    };
    let (d, t) = (dp.size(), tp.size());
    Err(refuse(
        "data_parallel",
        &format!("dp {d} x tp {t}"),
        &format!(
            "{why}: every replica must be a tp-{t} group of the same training config and \
             grad_accum, each dp group one tp rank of every replica (dp x tp = world: this \
             rank's groups make dp {d} x tp {t} = {} ranks)",
            d * t
        ),
    ))
}

/// How many ranks of the `dp x tp` world passed `ok = false`: the flags summed over `tp`,
/// then those sums over `dp`, so on a `dp x tp` grid every rank gets the world's count. A
/// collective over both groups (exact: small integers).
pub(super) fn failures(tp: &ProcessGroup, dp: Option<&ProcessGroup>, ok: bool) -> Result<i64> {
    let mut n = [i64::from(!ok)];
    tp.all_reduce(&mut n, ReduceOp::Sum)?;
    if let Some(dp) = dp {
        dp.all_reduce(&mut n, ReduceOp::Sum)?;
    }
    Ok(n[0])
}

/// `grads`, one rank's flat gradients summed over `count` micro-batches, summed over the
/// replicas `dp` (one all-reduce pinned to [`super::TP_ALL_REDUCE`]) and scaled to the mean
/// over micro-batches and replicas by `(1/count)/d` in one multiplication, as
/// [`crate::ddp::GradBuckets::finish`] does (without replicas: `1/count`). Returns the seconds
/// spent in the all-reduce.
pub(super) fn reduce_over_replicas(
    dp: Option<&ProcessGroup>,
    th: &Threads,
    grads: &mut [f32],
    count: usize,
) -> Result<f64> {
    let t = Instant::now();
    let d = match dp {
        Some(g) => {
            g.all_reduce_with(grads, ReduceOp::Sum, &PINNED)?;
            g.size()
        }
        None => 1,
    };
    let seconds = t.elapsed().as_secs_f64();
    if count > 1 || d > 1 {
        scale_grads(th, grads, 1.0 / count as f32 / d as f32);
    }
    Ok(seconds)
}

/// The mean of `loss` over the replicas `dp` (summed exactly, in replica order), or `loss`
/// without replicas.
pub(super) fn mean_over_replicas(dp: Option<&ProcessGroup>, loss: f64) -> Result<f64> {
    match dp {
        Some(g) => Ok(sum_in_rank_order(g, loss)? / g.size() as f64),
        None => Ok(loss),
    }
}
