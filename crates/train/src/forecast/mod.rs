//! The planner's forecast of this run's step, set beside what the run measured (issue 7,
//! "plan beside actual").
//!
//! The forecast is built bottom-up from numbers taken apart from the run:
//! - [`probe`]: each unit's forward and backward (embeddings, one block, head) and the
//!   per-parameter update, timed on a two-block model of the same shape on this machine;
//! - the group's calibrated alpha-beta model ([`comm::model`], 004 eqs. 28.10-28.12) for every
//!   collective the engine issues, at the sizes its bucket or shard plan gives them;
//! - [`timeline`]: the engine's step replayed op by op on one compute and one communication
//!   stream, so overlap (000 F2) comes out of the order of the ops rather than a factor.
//!
//! Rank skew is modelled as noise: every collective waits for the last rank to issue it, on
//! average `e_N · σ` after the mean, σ being the probe's spread of the compute since the previous
//! collective ([`timeline`]). Not modelled: systematic differences between ranks, cores shared
//! beyond what the probe saw (every rank probes at once), and the data loader, which is assumed
//! hidden by prefetching (eq. 4.2: `max(T_compute, T_io)`).

pub mod probe;
pub mod report;
pub mod timeline;

pub use probe::UnitTimes;
pub use report::{Measured, Row, beside, render};
pub use timeline::{Issued, Timeline};

use crate::trainer::Trainer;
use crate::zero::Stage;
use comm::OpKind;
use model::layout::Unit;

/// Predicted seconds of one optimizer step (all micro-batches) of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Forecast {
    /// Forward, backward, update and staging copies on the compute stream.
    pub compute: f64,
    /// Seconds the collectives keep the communication stream busy.
    pub comm: f64,
    /// The part of the communication the compute stream waits for.
    pub exposed: f64,
    /// Batch wait (0: hidden by prefetching, eq. 4.2).
    pub data: f64,
    /// The whole step: compute + exposed + data.
    pub step: f64,
    /// Training paused per checkpoint: the snapshot copy of this rank's state.
    pub ckpt_pause: f64,
    /// The sums behind the numbers, one line each.
    pub explain: Vec<String>,
}

/// One collective the engine issues per step: its kind and buffer bytes (the whole
/// gathered/scattered buffer for all-gather and reduce-scatter, as [`comm::model::predict`]).
#[derive(Debug, Clone, Copy)]
struct Op {
    kind: OpKind,
    bytes: usize,
}

/// The seconds one block's sums over its tensor-parallel group block the compute stream, in
/// its forward and in its backward (0 without tensor parallelism), from the group's alpha-beta
/// model: two all-reduces of the (N, C) residual each way (000 F46), or under sequence
/// parallelism an all-gather and a reduce-scatter for each, the backward gathering each norm's
/// rows once more (000 L3239); with recompute the backward repeats the forward's.
fn tensor_sums(trainer: &Trainer) -> (f64, f64) {
    let Some(t) = trainer.tensor_part() else {
        return (0.0, 0.0);
    };
    let d = trainer.model().dims();
    block_sums(&t.group, t.sequence, d.n * d.c, trainer.config().recompute)
}

/// The seconds one block's tensor-parallel sums over `group` take in its forward and in its
/// backward, for a residual stream of `nc` elements (see [`tensor_sums`]).
pub(crate) fn block_sums(
    group: &comm::group::ProcessGroup,
    sequence: bool,
    nc: usize,
    recompute: bool,
) -> (f64, f64) {
    let bytes = 4 * nc;
    let cost = |kind| group.explain(kind, bytes).predicted_s.unwrap_or(0.0);
    let (fwd, bwd) = if sequence {
        let pair = cost(OpKind::AllGather) + cost(OpKind::ReduceScatter);
        (2.0 * pair, 2.0 * (pair + cost(OpKind::AllGather)))
    } else {
        let sum = cost(OpKind::AllReduce);
        (2.0 * sum, 2.0 * sum)
    };
    match recompute {
        true => (fwd, bwd + fwd),
        false => (fwd, bwd),
    }
}

/// The seconds one block's expert exchanges over `part`'s EP group take in its forward and in
/// its backward (0, 0 without one), for `n` token rows of `c` channels with `moe`'s top-k:
/// the dispatch and combine all-to-alls of `N·k·C` f32 each way per direction (000 F50; the
/// probe ran every expert on one rank, so this is what splitting them adds), forward also the
/// routing counts' all-gather and the two small sums; the backward repeats the two
/// all-to-alls, and with recompute the forward's exchanges too.
pub(crate) fn expert_exchanges(
    part: Option<&crate::expert::ExpertPart>,
    moe: Option<model::moe::MoeConfig>,
    n: usize,
    recompute: bool,
) -> (f64, f64) {
    let (Some(p), Some(m)) = (part, moe) else {
        return (0.0, 0.0);
    };
    let g = &p.group;
    let cost = |kind, bytes| g.explain(kind, bytes).predicted_s.unwrap_or(0.0);
    let a2a = cost(OpKind::AllToAll, 4 * n * m.top_k * m.channels);
    let small = cost(OpKind::AllGather, 8 * (m.experts + 2) * g.size())
        + cost(OpKind::AllReduce, 4 * m.experts)
        + cost(OpKind::AllReduce, 8);
    let (fwd, bwd) = (2.0 * a2a + small, 2.0 * a2a);
    match recompute {
        true => (fwd, bwd + fwd),
        false => (fwd, bwd),
    }
}

/// Forecasts one step of `trainer`'s run from `probe` (see the module doc).
pub fn forecast(trainer: &Trainer, probe: &UnitTimes) -> Forecast {
    let cfg = trainer.config();
    let layout = trainer.model().layout();
    let units = layout.units();
    // The ranks the state is sharded (or the gradients all-reduced) over: one replica group
    // under hybrid sharding, whose parts are then summed across the groups.
    let world = trainer.group().map_or(1, |g| g.size());
    let replicas = trainer.zero_engine().and_then(|z| z.replicas());
    let stage = trainer.zero_stage();
    let segments = trainer.comm_segments();
    let cost = |op: Op| match trainer.group() {
        Some(g) if world > 1 => g.explain(op.kind, op.bytes).predicted_s.unwrap_or(0.0),
        _ => 0.0,
    };
    let copy = |bytes: usize| bytes as f64 * probe.copy_per_byte;
    let fresh = |bytes: usize| bytes as f64 * (probe.copy_per_byte + probe.fault_per_byte);
    // Stages 2 and 3 hand gradient pages back after reducing them (and stage 3 parameter
    // pages after each unit): the next write faults them in again.
    let released_grads = matches!(stage, Some(Stage::Two | Stage::Three));
    let gathered = stage == Some(Stage::Three);
    // The comm thread writes each gathered or reduced result into a buffer just allocated.
    let gather_op = |u: Unit| {
        let op = gather(layout, &segments, u);
        cost(op) + fresh(op.bytes) - copy(op.bytes)
    };
    let count = cfg.grad_accum.max(1);
    let (tp_fwd, tp_bwd) = tensor_sums(trainer);
    let d = trainer.model().dims();
    let moe = cfg.model.moe_layer();
    let (ep_fwd, ep_bwd) = expert_exchanges(trainer.experts.as_ref(), moe, d.n, cfg.recompute);
    let (tp_fwd, tp_bwd) = (tp_fwd + ep_fwd, tp_bwd + ep_bwd);
    // Ranks on the busiest host times threads each, against its cores.
    let saturated = trainer.group().is_some_and(|g| {
        let topo = g.topology();
        let per_host = topo.size.div_ceil(topo.hosts.max(1));
        per_host * cfg.threads >= topo.cores.max(1)
    });
    let mut t = if saturated {
        Timeline::saturated(world)
    } else {
        Timeline::new(world)
    };
    let mut staging = 0.0;
    let mut stage_in = |t: &mut Timeline, seconds: f64| {
        staging += seconds;
        t.compute(seconds);
    };
    for micro in 0..count {
        let communicate = world > 1
            && match stage {
                None | Some(Stage::One) => micro + 1 == count,
                Some(_) => true,
            };
        // Forward; stage 3 gathers each unit first (the next one prefetched meanwhile) into
        // pages handed back after the previous step.
        let mut pending = gathered.then(|| t.issue(gather_op(units[0])));
        for (i, &u) in units.iter().enumerate() {
            if let Some(done) = pending.take() {
                t.wait(done);
                stage_in(&mut t, fresh(gather(layout, &segments, u).bytes));
            }
            if gathered && let Some(&next) = units.get(i + 1) {
                pending = Some(t.issue(gather_op(next)));
            }
            t.compute_noisy(probe.forward(u), probe.forward_var(u));
            if matches!(u, Unit::Block(_)) && tp_fwd > 0.0 {
                t.blocking(tp_fwd);
            }
        }
        // Backward, launching each bucket or segment once the units it spans are done.
        let mut launched = Vec::new();
        for (i, &u) in units.iter().enumerate().rev() {
            if let Some(done) = pending.take() {
                t.wait(done);
                stage_in(&mut t, fresh(gather(layout, &segments, u).bytes));
            }
            if gathered && i > 0 && matches!(units[i - 1], Unit::Block(_)) {
                pending = Some(t.issue(gather_op(units[i - 1])));
            }
            t.compute_noisy(probe.backward(u), probe.backward_var(u));
            if matches!(u, Unit::Block(_)) && tp_bwd > 0.0 {
                t.blocking(tp_bwd);
            }
            if released_grads {
                let bytes = 4 * layout.unit_range(u).len();
                stage_in(&mut t, fresh(bytes) - copy(bytes));
            }
            if !communicate {
                continue;
            }
            let from = layout.unit_range(u).start;
            while let Some(&(ref range, bytes)) = segments.get(launched.len()) {
                if range.start < from {
                    break;
                }
                // Data parallel copies into a bucket buffer kept between steps; ZeRO into a
                // new one, and its result lands in another.
                let op = match stage {
                    None => {
                        stage_in(&mut t, copy(bytes));
                        cost(Op {
                            kind: OpKind::AllReduce,
                            bytes,
                        })
                    }
                    Some(_) => {
                        stage_in(&mut t, fresh(bytes));
                        let rs = Op {
                            kind: OpKind::ReduceScatter,
                            bytes,
                        };
                        let across = replicas.and_then(|r| r.group()).map_or(0.0, |g| {
                            g.explain(OpKind::AllReduce, bytes / world)
                                .predicted_s
                                .unwrap_or(0.0)
                        });
                        cost(rs) + across + fresh(bytes / world) - copy(bytes / world)
                    }
                };
                launched.push((t.issue(op), bytes));
            }
        }
        for (op, bytes) in launched {
            t.wait(op);
            let back = if stage.is_some() {
                bytes / world
            } else {
                bytes
            };
            stage_in(&mut t, copy(back));
        }
    }
    // The ranks agree on the loss, and under ZeRO on the gradient norm: one scalar each.
    if world > 1 {
        let scalars = if stage.is_some() { 2 } else { 1 };
        for _ in 0..scalars {
            t.blocking(cost(Op {
                kind: OpKind::AllReduce,
                bytes: 8,
            }));
        }
    }
    let params = layout.total;
    let local = match stage {
        Some(_) => params.div_ceil(world),
        None => params,
    };
    t.compute(local as f64 * probe.update_per_param);
    if matches!(stage, Some(Stage::One | Stage::Two)) {
        let mut done = Vec::with_capacity(segments.len());
        for &(_, bytes) in &segments {
            stage_in(&mut t, fresh(bytes / world));
            let op = Op {
                kind: OpKind::AllGather,
                bytes,
            };
            done.push((t.issue(cost(op) + fresh(bytes) - copy(bytes)), bytes));
        }
        for (op, bytes) in done {
            t.wait(op);
            stage_in(&mut t, copy(bytes));
        }
    }
    let blocks = cfg.model.layers;
    // One pass over the units: embeddings, `blocks` blocks, head (backward: the other way).
    let pass = |name: &str, t: &[f64; 3], reverse: bool| {
        let total = (t[0] + blocks as f64 * t[1] + t[2]) * count as f64;
        let (first, last) = if reverse {
            (("head", t[2]), ("embed", t[0]))
        } else {
            (("embed", t[0]), ("head", t[2]))
        };
        format!(
            "{name} {count} x ({} {} + {blocks} x block {} + {} {}) = {}",
            first.0,
            ms(first.1),
            ms(t[1]),
            last.0,
            ms(last.1),
            ms(total)
        )
    };
    let explain = vec![
        pass("forward", &probe.fwd, false),
        pass("backward", &probe.bwd, true),
        format!(
            "update {local} params x {:.2} ns = {}; staging copies and page faults {} \
             (copy {:.1} GB/s, fresh pages {:.1} GB/s)",
            probe.update_per_param * 1e9,
            ms(local as f64 * probe.update_per_param),
            ms(staging),
            1e-9 / probe.copy_per_byte.max(1e-15),
            1e-9 / (probe.copy_per_byte + probe.fault_per_byte).max(1e-15)
        ),
        format!(
            "collectives {} busy ({}, {} segments, {world} ranks; alpha-beta from the group's \
             calibration{}), {} exposed after overlap (000 F2), {} of it waiting for \
             the last rank (e_N x sigma of the compute between blocking waits)",
            ms(t.comm_s()),
            if stage.is_some() {
                "reduce-scatter + all-gather"
            } else {
                "all-reduce"
            },
            segments.len(),
            if saturated {
                "; no core to spare, so their CPU work counts as compute"
            } else {
                ""
            },
            ms(t.exposed_s()),
            ms(t.skew_s())
        ),
    ];
    let mut explain = explain;
    if ep_fwd > 0.0 {
        explain.push(format!(
            "expert exchanges over ep {} (000 F50: dispatch and combine all-to-alls, counts): \
             {count} x {blocks} blocks x ({} forward + {} backward) = {}, blocking the compute",
            trainer.experts.as_ref().map_or(1, |p| p.ep()),
            ms(ep_fwd),
            ms(ep_bwd),
            ms((ep_fwd + ep_bwd) * (count * blocks) as f64)
        ));
    }
    if let Some(tp) = trainer.tensor_part() {
        explain.push(format!(
            "tensor-parallel sums over tp {} ({}): {count} x {blocks} blocks x ({} forward + \
             {} backward) = {}, blocking the compute",
            tp.tp(),
            if tp.sequence {
                "all-gather + reduce-scatter pairs, sequence parallel"
            } else {
                "all-reduces of (N, C)"
            },
            ms(tp_fwd),
            ms(tp_bwd),
            ms((tp_fwd + tp_bwd) * (count * blocks) as f64)
        ));
    }
    Forecast {
        compute: t.compute_s(),
        comm: t.comm_s(),
        exposed: t.exposed_s(),
        data: 0.0,
        step: t.now(),
        // A checkpoint snapshots this rank's parameters and both moments.
        ckpt_pause: copy(12 * local),
        explain,
    }
}

/// The all-gather of `unit`'s segment (stage 3: one segment per unit, in unit order).
fn gather(
    layout: &model::layout::Layout,
    segments: &[(std::ops::Range<usize>, usize)],
    unit: Unit,
) -> Op {
    let start = layout.unit_range(unit).start;
    let bytes = segments
        .iter()
        .find(|(r, _)| r.start == start)
        .map_or(0, |&(_, b)| b);
    Op {
        kind: OpKind::AllGather,
        bytes,
    }
}

pub(crate) fn ms(s: f64) -> String {
    format!("{:.1} ms", s * 1e3)
}
