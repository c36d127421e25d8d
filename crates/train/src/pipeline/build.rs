//! Building a pipeline stage ([`super::engine`]): the partition of the blocks into chunks,
//! the checks of the layout (each error naming its field), the optimizer ranges and, with
//! data parallelism (000 §2.20 hybrid parallelism; "3D 训练循环"), the replica's data share and
//! the agreement of the replicas.
use std::ops::Range;

use comm::group::ProcessGroup;
use comm::mesh::DeviceMesh;
use model::Threads;
use model::init::init_params;
use model::layout::{Layout, Unit};
use model::model::Model;
use model::optim::Bf16Store;

use super::engine::PipelineStage;
use super::tensor_stage::{Slot, TensorPart, check_tensor_parallel, unit_range};
use super::update::Update;
use super::{Action, Schedule, ScheduleKind};
use crate::config::TrainConfig;
use crate::ddp::GradBuckets;
use crate::error::{Result, TrainError};
use crate::source::{Share, Source};
use crate::zero::{Stage, Window};

/// One local chunk: model chunk `index`, its units in forward order and its parameter range.
#[derive(Clone, Debug)]
pub(super) struct Chunk {
    pub(super) units: Vec<Unit>,
    pub(super) range: Range<usize>,
}

/// The model chunks' units for `layers` blocks cut into `k` chunks of equal block counts.
pub(super) fn chunk_units(layers: usize, k: usize, index: usize) -> Vec<Unit> {
    let (a, b) = (index * layers / k, (index + 1) * layers / k);
    let mut units = Vec::with_capacity(b - a + 2);
    if index == 0 {
        units.push(Unit::Embed);
    }
    units.extend((a..b).map(Unit::Block));
    if index + 1 == k {
        units.push(Unit::Head);
    }
    units
}

/// Peak number of micro-batches with a forward begun (local chunk 0) and the backward not yet
/// finished (local chunk 0) in `list`: the [`Model`]s a stage needs (at least 1). Counts
/// micro-batches, not (micro-batch, chunk) pairs as [`Schedule::max_in_flight`] does, since one
/// model holds all of a micro-batch's chunks on the stage.
fn microbatches_in_flight(list: &[Action]) -> usize {
    let (mut now, mut peak) = (0usize, 1usize);
    for a in list {
        match *a {
            Action::Forward { chunk: 0, .. } => {
                now += 1;
                peak = peak.max(now);
            }
            Action::Backward { chunk: 0, .. } => now = now.saturating_sub(1),
            _ => {}
        }
    }
    peak
}

pub(super) fn config_err(field: &'static str, value: impl ToString, reason: String) -> TrainError {
    TrainError::Config {
        field,
        value: value.to_string(),
        reason,
    }
}

pub(super) use crate::zero::replica::{intersect, minus};

/// The rows replica `dp.rank()` of `dp.size()` takes of every global micro-batch (the rows a
/// data-parallel [`crate::Trainer`] rank of that index takes), or whole batches without `dp`.
pub(super) fn replica_share(cfg: &TrainConfig, dp: Option<&ProcessGroup>) -> Share {
    match dp {
        Some(d) => Share {
            batch: cfg.batch,
            world: d.size(),
            rank: d.rank(),
        },
        None => Share::whole(cfg.batch),
    }
}

/// Hands back to the kernel every page of `buf` that lies outside `owned` (the gaps between the
/// owned ranges, sorted here): they read as zeros and cost no memory until written again. A page
/// shared by an owned range and a gap stays (only the gap's elements on it are zeroed).
fn release_unowned(buf: &mut Window, owned: &[Range<usize>]) {
    let mut owned = owned.to_vec();
    owned.sort_by_key(|r| r.start);
    let mut at = 0;
    for r in owned.iter().chain(std::iter::once(&(buf.len()..buf.len()))) {
        if r.start > at {
            buf.release(at..r.start);
        }
        at = at.max(r.end);
    }
}

/// Checks (collectively over `dp`) that every replica runs the same stage of the same pipeline
/// on the same micro-batches, sharded alike (ZeRO, tensor parallelism), so that their gradient
/// reductions pair up; an error naming `data_parallel` on every member otherwise (they all see
/// the same gathered values).
fn agree_across_replicas(
    dp: &ProcessGroup,
    cfg: &TrainConfig,
    (stage, stages): (usize, usize),
    kind: ScheduleKind,
    zero: bool,
    tp: usize,
) -> Result<()> {
    let kind_id = match kind {
        ScheduleKind::GPipe => 0,
        ScheduleKind::OneFOneB => 1,
        ScheduleKind::Interleaved { virtual_stages } => 1 + virtual_stages,
    };
    let mine = [
        stage,
        stages,
        kind_id,
        cfg.grad_accum,
        cfg.batch,
        cfg.model.layers,
        usize::from(zero),
        tp,
    ]
    .map(|x| i64::try_from(x).unwrap_or(i64::MAX));
    let mut all = vec![0i64; mine.len() * dp.size()];
    dp.all_gather(&mine, &mut all)?;
    match all.chunks(mine.len()).position(|c| c != mine) {
        None => Ok(()),
        Some(r) => Err(config_err(
            "data_parallel",
            dp.size(),
            format!(
                "replica {r} runs (stage, stages, schedule, microbatches, batch, layers, zero, \
                 tp) = {:?}, replica {} runs {mine:?}: every replica must run the same stage of \
                 the same pipeline",
                &all[r * mine.len()..(r + 1) * mine.len()],
                dp.rank()
            ),
        )),
    }
}

impl PipelineStage {
    /// Stage `group.rank()` of a `stages`-stage pipeline running `kind` over
    /// `m = cfg.grad_accum` micro-batches of `cfg.batch` sequences per step. Every stage
    /// initialises the whole model from `cfg.seed` (so the chunks start as one process's), then
    /// hands back the pages of every range it does not own (see [`PipelineStage::state_memory`]),
    /// and builds the same data source.
    ///
    /// Errors, each naming the field: `pipeline_stages` when the group has another size or
    /// there are more chunks (`stages * v`) than blocks; `microbatches` when the schedule
    /// refuses `m` (interleaved needs `m % stages == 0`); `bf16` (not built for pipelines);
    /// any [`TrainConfig::validate`] error.
    pub fn new(
        cfg: TrainConfig,
        group: ProcessGroup,
        stages: usize,
        kind: ScheduleKind,
    ) -> Result<Self> {
        Self::build(cfg, group, stages, (None, None), kind, false)
    }

    /// Stage `pp.rank()` of one of `dp.size()` data-parallel replicas of a `pp.size()`-stage
    /// pipeline (DP x PP, 000 §2.20 hybrid parallelism; "3D 训练循环"): replica `dp.rank()`
    /// trains on its `cfg.batch` rows of every micro-batch's global batch of
    /// `cfg.batch x dp.size()` rows (the rows a data-parallel [`crate::Trainer`] rank of that
    /// index takes), runs the schedule within its pipeline, then sums its ranges' gradients
    /// over `dp` and scales them by `(1/m) / d` (`pipeline::update`). The loss reported is the
    /// mean over the replicas. Ends where a data-parallel `Trainer` on `d` ranks with
    /// `grad_accum = m` ends. `pp` must hold one rank per stage; every member of `dp` must run
    /// the same stage with the same schedule, `m`, batch and depth (checked collectively over
    /// `dp`: an error naming `data_parallel` otherwise). Other errors as [`PipelineStage::new`].
    pub fn with_data_parallel(
        cfg: TrainConfig,
        pp: ProcessGroup,
        dp: ProcessGroup,
        kind: ScheduleKind,
    ) -> Result<Self> {
        let stages = pp.size();
        Self::build(cfg, pp, stages, (Some(dp), None), kind, false)
    }

    /// [`PipelineStage::with_data_parallel`] with ZeRO `stage` over `dp` inside each pipeline
    /// stage (000 §2.20: ZeRO composes with PP along the DP axis). Stage 1 is built: each
    /// replica keeps AdamW moments for `1/d` of every range it updates (a contiguous shard),
    /// steps only that shard after the all-reduce and norm, and the shards are all-gathered
    /// back; AdamW is elementwise, so the parameters are bit-identical to the unsharded run.
    /// Errors naming `zero_stage` for stages 2 and 3 (not built with pipelines yet), else as
    /// `with_data_parallel`.
    pub fn with_zero(
        cfg: TrainConfig,
        pp: ProcessGroup,
        dp: ProcessGroup,
        kind: ScheduleKind,
        stage: Stage,
    ) -> Result<Self> {
        if stage != Stage::One {
            return Err(config_err(
                "zero_stage",
                stage.number(),
                "pipelines shard only the optimizer state (ZeRO-1) so far".into(),
            ));
        }
        let stages = pp.size();
        Self::build(cfg, pp, stages, (Some(dp), None), kind, true)
    }

    /// [`PipelineStage::with_data_parallel`] over a device mesh's pipeline and data-parallel
    /// groups, with the blocks of every stage split over the mesh's TP group when `tp > 1`
    /// (PP x TP x DP, 000 "混合并行", "3D 训练循环"; `pipeline::tensor_stage`): each TP rank of
    /// stage `s` exchanges the whole residual with the same-TP-index rank of `s ± 1` (its
    /// pipeline group), the embeddings and head are replicated over the first and last stage's
    /// TP groups, every block runs Megatron-style on the rank's shard
    /// ([`crate::tensor::TpBlock`]), and the global norm counts every element once across the
    /// mesh. Ends where one process with `grad_accum = m` on the global batch of
    /// `cfg.batch x dp` rows ends, up to float summation order; repeated runs are
    /// bit-identical. Errors naming `expert_parallel` when the mesh has `ep > 1`; with
    /// `tp > 1`, `tp` when it does not divide the heads, kv_heads or ffn; else as
    /// `with_data_parallel`.
    pub fn on_mesh(cfg: TrainConfig, mesh: &DeviceMesh, kind: ScheduleKind) -> Result<Self> {
        Self::on_mesh_with(cfg, mesh, kind, false)
    }

    /// [`PipelineStage::on_mesh`] with Megatron sequence parallelism inside the TP stages when
    /// `sequence`: each TP rank keeps `N/tp` rows of the residual stream, so a stage sends the
    /// next one only its rows (the same-TP-index ranks pair up), `(N/tp, C)` per message.
    pub fn on_mesh_with(
        cfg: TrainConfig,
        mesh: &DeviceMesh,
        kind: ScheduleKind,
        sequence: bool,
    ) -> Result<Self> {
        Self::on_mesh_zero(cfg, mesh, kind, sequence, None)
    }

    /// [`PipelineStage::on_mesh_with`] with ZeRO `zero` over each stage's data-parallel
    /// replicas (as [`PipelineStage::with_zero`]: stage 1 is built), TP stages included: each
    /// replica of a TP rank keeps AdamW moments for `1/d` of that rank's ranges.
    pub fn on_mesh_zero(
        cfg: TrainConfig,
        mesh: &DeviceMesh,
        kind: ScheduleKind,
        sequence: bool,
        zero: Option<Stage>,
    ) -> Result<Self> {
        if let Some(stage) = zero.filter(|s| *s != Stage::One) {
            return Err(config_err(
                "zero_stage",
                stage.number(),
                "pipelines shard only the optimizer state (ZeRO-1) so far".into(),
            ));
        }
        let shape = mesh.shape();
        if shape.ep > 1 {
            return Err(config_err(
                "expert_parallel",
                shape.ep,
                format!("mesh {shape}: pipelines do not hold expert-parallel layers yet"),
            ));
        }
        let (pp, dp, tp) = (mesh.pp().clone(), mesh.dp().clone(), mesh.tp().clone());
        let stages = pp.size();
        let tp = (tp, sequence);
        Self::build(cfg, pp, stages, (Some(dp), Some(tp)), kind, zero.is_some())
    }

    /// The stage of `group` with the optional data-parallel and tensor-parallel groups
    /// `(dp, tp)` (a TP group of one rank is no tensor parallelism; its flag: sequence
    /// parallelism).
    fn build(
        cfg: TrainConfig,
        group: ProcessGroup,
        stages: usize,
        (dp, tp): (Option<ProcessGroup>, Option<(ProcessGroup, bool)>),
        kind: ScheduleKind,
        zero: bool,
    ) -> Result<Self> {
        cfg.validate()?;
        let (tp, sequence) = match tp {
            Some((t, s)) if t.size() > 1 => (Some(t), s),
            _ => (None, false),
        };
        if let Some(t) = &tp {
            check_tensor_parallel(&cfg.model, t.size())?;
        }
        if group.size() != stages {
            return Err(config_err(
                "pipeline_stages",
                stages,
                format!(
                    "the pipeline group has {} ranks; it needs one per stage",
                    group.size()
                ),
            ));
        }
        if cfg.bf16 && zero {
            return Err(config_err(
                "bf16",
                "true",
                "ZeRO-1 shards f32 state; bf16 with ZeRO is not built yet".into(),
            ));
        }
        let v = kind.virtual_stages();
        let layers = cfg.model.layers;
        let k = stages.saturating_mul(v.max(1));
        if k > layers {
            return Err(config_err(
                "pipeline_stages",
                stages,
                format!(
                    "{stages} stages x {v} chunks = {k} chunks, but the model has only {layers} \
                     blocks (every chunk needs at least one)"
                ),
            ));
        }
        let m = cfg.grad_accum;
        let schedule = Schedule::new(kind, stages, m)?;
        let s = group.rank();
        if let Some(dp) = dp.as_ref().filter(|d| d.size() > 1) {
            let degree = tp.as_ref().map_or(1, ProcessGroup::size);
            agree_across_replicas(dp, &cfg, (s, stages), kind, zero, degree)?;
        }
        let th = Threads::new(cfg.threads)?;
        let slots_needed = microbatches_in_flight(schedule.actions(s).unwrap_or(&[]));
        let mut models = Vec::with_capacity(slots_needed);
        let degree = tp.as_ref().map_or(1, ProcessGroup::size);
        for _ in 0..slots_needed {
            let recompute = vec![cfg.recompute; cfg.model.layers];
            let (b, t) = (cfg.batch, cfg.seq_len);
            let split = (degree, sequence);
            models.push(Model::<f32>::split_in_place(
                &cfg.model, b, t, recompute, split,
            )?);
        }
        let layout = model::layout::Layout::new(&cfg.model);
        let mut params = Window::new(layout.total)?;
        init_params(&cfg.model, &layout, cfg.seed, &mut params);
        let chunks: Vec<Chunk> = (0..v)
            .map(|c| {
                let units = chunk_units(layers, k, c * stages + s);
                let first = layout.unit_range(units[0]).start;
                let last = layout
                    .unit_range(*units.last().expect("a chunk has a block"))
                    .end;
                Chunk {
                    units,
                    range: first..last,
                }
            })
            .collect();
        let cuts = (1..k)
            .map(|i| layout.unit_range(chunk_units(layers, k, i)[0]).start)
            .collect();
        let tied = (cfg.model.tied_embeddings && stages > 1).then(|| layout.wte.clone());
        // With tensor parallelism a stage owns its units' ranges of this TP rank: the
        // embeddings and head whole, each block's shard at the block's start.
        let (norm_ranges, tensor) = match tp {
            None => (chunks.iter().map(|c| c.range.clone()).collect(), None),
            Some(g) => {
                let part = TensorPart::new(&cfg, (g, sequence), &layout, &chunks)?;
                part.shard_blocks(&layout, &chunks, &mut params)?;
                (part.owned.clone(), Some(part))
            }
        };
        let mut update_ranges: Vec<Range<usize>> = norm_ranges.clone();
        if let Some(wte) = &tied
            && s + 1 == stages
        {
            update_ranges.push(wte.clone());
        }
        let decay_all = match &tensor {
            Some(t) => t.decay(&layout, cfg.decay_all)?,
            None => layout.decay_ranges(cfg.decay_all),
        };
        let (d, j) = match (&dp, zero) {
            (Some(g), true) => (g.size(), g.rank()),
            _ => (1, 0),
        };
        // Only the ranges this stage updates stay resident; nothing writes the others again
        // (gradients are zeroed and reduced on these ranges only, see `update`).
        release_unowned(&mut params, &update_ranges);
        let mut updates = Vec::with_capacity(update_ranges.len());
        for r in update_ranges {
            let mut u = Update::new(cfg.adamw, r, &decay_all, d, j)?;
            if cfg.bf16 {
                // The f32 master weights kept, their bf16 values computed with.
                let store = Bf16Store::new(params[u.part.range.clone()].to_vec());
                store.decode_params(&mut params[u.part.range.clone()])?;
                u.bf16 = Some(store);
            }
            updates.push(u);
        }
        let buckets = unit_buckets(&layout, (&chunks, v), tensor.as_ref(), &tied, &updates, &dp);
        let slots = models
            .into_iter()
            .map(|m| Ok(Slot::new(m, tensor.as_ref())))
            .collect::<Result<Vec<_>>>()?;
        let source = Source::for_config(&cfg, replica_share(&cfg, dp.as_ref()))?;
        let n = cfg.micro_tokens();
        Ok(Self {
            grads: Window::new(layout.total)?,
            params,
            layout,
            chunks,
            updates,
            zero,
            norm_ranges,
            cuts,
            tied,
            slots,
            tensor,
            experts: None,
            buckets,
            source,
            inputs: vec![vec![0; n]; m],
            targets: vec![vec![0; n]; m],
            step: 0,
            drawn: 0,
            rows_base: 0,
            schedule,
            th,
            group,
            dp,
            cfg,
        })
    }
}

/// The data-parallel reduction of a one-chunk stage with replicas, bucketed by unit in the
/// backward's order (the head first), and the ranges left to the update: a tied `wte`,
/// summed over the pipeline before the replicas. None for interleaved schedules (their chunks
/// finish out of address order) and without replicas.
fn unit_buckets(
    layout: &Layout,
    (chunks, v): (&[Chunk], usize),
    tensor: Option<&TensorPart>,
    tied: &Option<Range<usize>>,
    updates: &[Update],
    dp: &Option<ProcessGroup>,
) -> Option<(GradBuckets, Vec<Range<usize>>)> {
    let g = dp.as_ref().filter(|g| g.size() > 1)?;
    let chunk = chunks.first().filter(|_| v <= 1)?;
    let tied: Vec<Range<usize>> = tied.iter().cloned().collect();
    let mut ranges = Vec::new();
    for &u in chunk.units.iter().rev() {
        let r = match tensor {
            Some(t) => unit_range(layout, &t.plan, u),
            None => layout.unit_range(u),
        };
        ranges.extend(minus(&r, &tied).into_iter().rev());
    }
    let late = updates
        .iter()
        .flat_map(|u| minus(&u.part.range, &ranges))
        .collect();
    let options = match tensor {
        Some(_) => crate::tensor::PINNED,
        None => comm::group::OpOptions::default(),
    };
    let buckets = GradBuckets::over(g.clone(), ranges, layout.total).with_options(options);
    Some((buckets, late))
}
