//! ZeRO-1/2/3: data parallelism with the training state sharded over the ranks (file 000,
//! "内存高效数据并行：ZeRO 与 FSDP").
//!
//! Every rank still computes the gradient of its own rows of each global batch over the whole
//! model; what is split is the state kept between steps. Rank `r` owns part `r` of every
//! segment of the flat buffer ([`ShardPlan`]) and keeps AdamW's moments for those elements only.
//! - **Stage 1**: parameters and gradients stay whole. After the backward each segment is
//!   reduce-scattered (not all-reduced: a rank only needs its part), the owned parameters are
//!   updated in place ([`model::optim::AdamW::step_parts`]) and each segment is all-gathered.
//! - **Stage 2**: as stage 1, but a segment's gradients are reduce-scattered as soon as the
//!   backward finishes them (overlapping the rest of it, like the data-parallel buckets) and
//!   the whole-model gradient pages are then handed back ([`Window`]): only the reduced part is
//!   kept. With gradient accumulation every micro-batch is reduced (there is no whole gradient
//!   to accumulate into).
//! - **Stage 3**: parameters are sharded too. Each unit (embeddings, block, head) is
//!   all-gathered just before its forward, the next one prefetched meanwhile, and freed after;
//!   again before its backward (the head, run last in the forward, is kept for the backward).
//!   The optimizer updates the shard; nothing whole is kept between steps.
//!
//! The update is the same as plain data parallel's: AdamW is elementwise, so updating parts
//! changes nothing; only the order in which the ranks' gradients are summed can differ (and
//! the global norm's, summed per part and then over ranks).
//!
//! Resident state per parameter (f32 parameters and gradients, AdamW's two f32 moments: 16
//! bytes in all; the seeds' 2 + 2 + 12 with bf16 compute copies and an f32 master):
//! stage 0 (DDP) 4 + 4 + 8, stage 1 4 + 4 + 8/N, stage 2 4 + (4 + 8)/N, stage 3 16/N bytes
//! ([`expected_bytes`]; 000 eqs. for ZeRO's 2+2+K, 2+2+K/N, 2+(2+K)/N, (2+2+K)/N).
//!
//! Communication per step for P parameters (ring, 004 eq. 28.11): stages 1 and 2 send a
//! reduce-scatter and an all-gather, (N-1)/N x 4P bytes each, as much as one all-reduce;
//! stage 3 adds a second all-gather (the backward's), 1.5x data parallel's traffic.

pub mod plan;
pub mod replica;
pub mod spares;
pub mod state;
pub mod window;

use std::ops::Range;
use std::sync::Arc;

use crate::ft::FaultTolerance;
use std::time::{Duration, Instant};

use comm::dtype::ReduceOp;
use comm::group::{OpOptions, ProcessGroup, Work};
use model::Threads;
use model::layout::{Layout, Unit};
use model::model::Model;
use model::optim::{AdamW, StatePart, check_finite, clip_coef, grad_sum_sq, scale_grads};

use crate::ddp::plan_buckets;
use crate::error::{Result, TrainError};
use crate::tensor::{BlockComm, TpPart, sum_in_rank_order};
pub use plan::ShardPlan;
pub use spares::Spares;
pub use window::Window;

/// A collective's (input, output) buffers, handed back by its [`Work`].
type Buffers = (Vec<f32>, Vec<f32>);

/// How much of the training state is sharded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Optimizer state.
    One,
    /// Optimizer state and gradients.
    Two,
    /// Optimizer state, gradients and parameters.
    Three,
}

impl Stage {
    /// The stage numbered `n` (1-3); 0 means no sharding (`None`).
    pub fn from_number(n: u8) -> Result<Option<Stage>> {
        match n {
            0 => Ok(None),
            1 => Ok(Some(Stage::One)),
            2 => Ok(Some(Stage::Two)),
            3 => Ok(Some(Stage::Three)),
            _ => Err(TrainError::Config {
                field: "zero stage",
                value: n.to_string(),
                reason: "must be 0 (plain data parallel), 1, 2 or 3".into(),
            }),
        }
    }

    /// The stage's number.
    pub fn number(self) -> u8 {
        match self {
            Stage::One => 1,
            Stage::Two => 2,
            Stage::Three => 3,
        }
    }
}

/// Resident bytes per parameter of (parameters, gradients, optimizer state) at `stage` (`None`:
/// plain data parallel) over `world` ranks, with f32 parameters and gradients and AdamW's two
/// f32 moments (see the module doc): the planner's formula
/// ([`::plan::memory::state_bytes_per_param`], 000 §ZeRO), one state at a time, so the runtime
/// reports against the same model the planner predicts with.
pub fn expected_bytes(stage: Option<Stage>, world: usize) -> (f64, f64, f64) {
    use ::plan::layout::ZeroStage;
    let z = match stage {
        None => ZeroStage::None,
        Some(Stage::One) => ZeroStage::Optimizer,
        Some(Stage::Two) => ZeroStage::Gradients,
        Some(Stage::Three) => ZeroStage::Parameters,
    };
    let per = |w, g, k| ::plan::memory::state_bytes_per_param(z, w, g, k, world as u64);
    (per(4.0, 0.0, 0.0), per(0.0, 4.0, 0.0), per(0.0, 0.0, 8.0))
}

/// One rank's ZeRO engine (see the module doc).
pub struct Zero {
    group: ProcessGroup,
    stage: Stage,
    plan: ShardPlan,
    /// Whether the head reads the embedding's parameters (tied weights).
    tied: bool,
    /// Stage 3: this rank's parameter parts.
    shard: Vec<f32>,
    /// Stages 2 and 3: this rank's reduced gradient parts (stage 1 keeps them in place in the
    /// whole gradient buffer).
    grad_shard: Vec<f32>,
    /// Weight-decay ranges in shard coordinates.
    decay: Vec<Range<usize>>,
    /// Reduce-scatters launched this micro-batch: segment and handle.
    inflight: Vec<(usize, Work<Buffers>)>,
    /// Transfer buffers back from finished collectives, for the next ones.
    spares: Spares,
    /// Lowest gradient index final in the current backward.
    ready_from: usize,
    /// An error raised inside the backward hook.
    failed: Option<TrainError>,
    /// Time blocked on communication this step.
    exposed: Duration,
    /// The options of its summing collectives (the group's choice unless pinned).
    options: OpOptions,
    /// Hybrid sharding (HSDP): the same shard of the other replica groups, over which each
    /// reduced part is summed once more (the state is sharded inside `group` and replicated
    /// across these).
    replicas: Option<Replicas>,
    /// Under bf16: the f32 master weights of this rank's parts (local coordinates, as the
    /// moments); the parameters (whole or the stage-3 shard) hold their bf16 values widened.
    master: Option<Vec<f32>>,
}

/// `x` rounded to bf16 and widened back: the value a bf16 tensor holds.
pub(crate) fn bf16_value(x: f32) -> f32 {
    model::optim::bf16::to_bf16(x).to_f32()
}

impl Zero {
    /// Mixed precision (`--bf16`): this rank keeps the f32 master weights of its parts only
    /// (sharded like the moments: 000's ZeRO with 2 + 2 + 12/N bytes per parameter), the
    /// parameters every rank computes with (`params`, whole; the shard under stage 3) become
    /// their bf16 values, and each update rounds the reduced gradients to bf16, steps the
    /// master and gathers the re-rounded parameters (as the data-parallel trainer's bf16 step).
    pub fn with_bf16(mut self, params: &mut [f32]) -> Self {
        let mut master = vec![0f32; self.plan.len()];
        for s in 0..self.plan.segments().len() {
            let src = match self.stage {
                Stage::Three => &self.shard[self.plan.local(s)],
                _ => &params[self.plan.owned(s)],
            };
            master[self.plan.local(s)].copy_from_slice(src);
        }
        match self.stage {
            Stage::Three => self.shard.iter_mut().for_each(|x| *x = bf16_value(*x)),
            _ => params.iter_mut().for_each(|x| *x = bf16_value(*x)),
        }
        self.master = Some(master);
        self
    }

    /// The f32 master weights of this rank's parts under bf16, to overwrite.
    pub(crate) fn master_mut(&mut self) -> Option<&mut [f32]> {
        self.master.as_deref_mut()
    }

    /// The f32 master weights of this rank's parts under bf16 (local coordinates).
    pub fn master(&self) -> Option<&[f32]> {
        self.master.as_deref()
    }
    /// Hybrid sharding (torchtitan's HSDP, FSDP's `HYBRID_SHARD`): this engine shards over its
    /// group (one replica group) and `replicas` holds the rank with the same shard in every
    /// replica group. Each reduced gradient part is then all-reduced over `replicas`, so the
    /// update is the mean over every rank of both; parameters are gathered inside the replica
    /// group only. The cross-group traffic is one all-reduce of a `1/shard` part per segment.
    pub fn with_replicas(mut self, replicas: ProcessGroup) -> Self {
        self.replicas = (replicas.size() > 1).then_some(Replicas::Group(replicas));
        self
    }

    /// Per-step fault tolerance (`--ft`): hybrid sharding whose replica groups are the
    /// quorum's members of each step ([`crate::ft`]); the update runs only once every member
    /// committed the step's sums.
    pub fn with_quorum(mut self, ft: Arc<FaultTolerance>) -> Self {
        self.replicas = Some(Replicas::Quorum(ft));
        self
    }

    /// The replica groups this rank sums across (hybrid sharding), if any.
    pub fn replicas(&self) -> Option<&Replicas> {
        self.replicas.as_ref()
    }

    /// Every data-parallel rank: the replica group's times the replica groups (all of the
    /// job's, present or not: each keeps its place in the data order).
    pub fn dp_world(&self) -> usize {
        self.plan.world() * self.replicas.as_ref().map_or(1, Replicas::size)
    }

    /// The data-parallel ranks whose gradients this step's mean is over (under `--ft`, the
    /// replicas present).
    fn present_world(&self) -> usize {
        self.plan.world() * self.replicas.as_ref().map_or(1, Replicas::present)
    }

    /// This rank among [`Zero::dp_world`]: replica group major.
    pub fn dp_rank(&self) -> usize {
        let r = self.replicas.as_ref().map_or(0, Replicas::rank);
        r * self.plan.world() + self.group.rank()
    }
    /// The summing collectives with `options` (a pinned algorithm: tensor-parallel ranks'
    /// groups must sum their replicated tensors in the same order).
    pub fn with_options(mut self, options: OpOptions) -> Self {
        self.options = options;
        self
    }

    /// Rank `group.rank()`'s engine at `stage` for a model of `layout` whose (identical on every
    /// rank) initial parameters are `params`; `decay` are the flat weight-decay ranges. ZeRO-1/2
    /// segments are the data-parallel buckets of `bucket_bytes`, ZeRO-3's the model's units.
    /// Under stage 3 the caller releases `params` afterwards ([`Zero::release_params`]).
    pub fn new(
        group: ProcessGroup,
        stage: Stage,
        layout: &Layout,
        bucket_bytes: usize,
        params: &[f32],
        decay: &[Range<usize>],
    ) -> Zero {
        let segments = match stage {
            Stage::Three => plan_buckets(layout, 1),
            _ => plan_buckets(layout, bucket_bytes),
        };
        let plan = ShardPlan::new(segments, group.size(), group.rank());
        let mut shard = Vec::new();
        if stage == Stage::Three {
            shard = vec![0f32; plan.len()];
            for s in 0..plan.segments().len() {
                shard[plan.local(s)].copy_from_slice(&params[plan.owned(s)]);
            }
        }
        let grad_shard = match stage {
            Stage::One => Vec::new(),
            _ => vec![0f32; plan.len()],
        };
        Zero {
            decay: plan.local_ranges(decay),
            tied: layout.head_reads_embed(),
            ready_from: layout.total,
            group,
            stage,
            plan,
            shard,
            grad_shard,
            inflight: Vec::new(),
            spares: Spares::default(),
            failed: None,
            exposed: Duration::ZERO,
            options: OpOptions::default(),
            replicas: None,
            master: None,
        }
    }

    /// The stage.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The shard plan.
    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    /// Optimizer-state length: this rank's shard.
    pub fn shard_len(&self) -> usize {
        self.plan.len()
    }

    /// Bytes of sharded parameters and gradients this engine holds (beyond the whole-model
    /// windows): (parameters, gradients).
    pub fn shard_bytes(&self) -> (usize, usize) {
        let master = self.master.as_ref().map_or(0, Vec::capacity);
        (
            (self.shard.capacity() + master) * 4,
            self.grad_shard.capacity() * 4,
        )
    }

    /// Bytes of the transfer buffers kept between steps for reuse ([`Spares`]).
    pub fn buffer_bytes(&self) -> usize {
        self.spares.bytes()
    }

    /// Stage 3: hands back every gathered parameter page (the shard keeps the values).
    pub fn release_params(&self, params: &mut Window) {
        if self.stage == Stage::Three {
            params.release(0..params.len());
        }
    }

    /// One micro-batch: forward and backward over `inputs`/`targets`, the gradients reduced to
    /// this rank's parts when this micro-batch communicates (stages 2 and 3 always, stage 1 on
    /// the `last` of `count`), scaled to the mean over micro-batches and ranks. Returns the
    /// micro-batch's (local) loss.
    #[allow(clippy::too_many_arguments)]
    pub fn micro(
        &mut self,
        model: &mut Model<f32>,
        th: &Threads,
        params: &mut Window,
        grads: &mut Window,
        (inputs, targets): (&[u32], &[u32]),
        (first, last, count): (bool, bool, usize),
        comm: &mut dyn BlockComm<f32>,
    ) -> Result<f64> {
        if first {
            match self.stage {
                Stage::One => grads.fill(0.0),
                _ => self.grad_shard.fill(0.0),
            }
        }
        let loss = self
            .forward(model, th, params, (inputs, Some(targets)), true, comm)?
            .unwrap_or(f64::NAN);
        let communicate = self.stage != Stage::One || last;
        match (self.stage, communicate) {
            (Stage::Three, _) => self.backward_gathered(model, th, params, grads, comm)?,
            (_, true) => {
                let ready = &mut |r, g: &mut [f32]| self.ready(r, g);
                model.backward_hooked_with(th, params, grads, ready, comm)?;
            }
            (_, false) => model.backward_hooked_with(th, params, grads, &mut |_, _| {}, comm)?,
        }
        if communicate {
            self.finish(grads, 1.0 / count as f32)?;
        }
        Ok(loss)
    }

    /// Forward over `inputs` (with `targets`, the loss), a split model's blocks summing over
    /// their group with `comm`. Stage 3 gathers each unit just before its forward (prefetching
    /// the next) and frees it after, except, when `keep` (a backward follows), the head and a
    /// tied embedding.
    pub fn forward(
        &mut self,
        model: &mut Model<f32>,
        th: &Threads,
        params: &mut Window,
        (inputs, targets): (&[u32], Option<&[u32]>),
        keep: bool,
        comm: &mut dyn BlockComm<f32>,
    ) -> Result<Option<f64>> {
        if self.stage != Stage::Three {
            return Ok(model.forward_with(th, params, inputs, targets, comm)?);
        }
        model.begin(inputs, targets)?;
        let units = model.layout().units();
        let mut pending = Some(self.gather(model.layout(), units[0])?);
        for (i, &unit) in units.iter().enumerate() {
            if let Some(work) = pending.take() {
                self.place(model.layout(), params, unit, work)?;
            }
            if let Some(&next) = units.get(i + 1) {
                pending = Some(self.gather(model.layout(), next)?);
            }
            model.forward_unit_with(th, params, unit, comm)?;
            let kept = match unit {
                Unit::Embed => self.tied,
                Unit::Block(_) => false,
                Unit::Head => keep,
            };
            if !kept {
                params.release(model.layout().unit_range(unit));
            }
        }
        if self.tied && !keep {
            params.release(model.layout().unit_range(Unit::Embed));
        }
        Ok(model.loss())
    }

    /// Stage 3's backward: each block gathered before its backward (the next prefetched),
    /// reduce-scattered and freed after it, parameters and gradients alike.
    fn backward_gathered(
        &mut self,
        model: &mut Model<f32>,
        th: &Threads,
        params: &mut Window,
        grads: &mut Window,
        comm: &mut dyn BlockComm<f32>,
    ) -> Result<()> {
        let units: Vec<Unit> = model.layout().units().into_iter().rev().collect();
        let mut pending: Option<Work<Buffers>> = None;
        for (i, &unit) in units.iter().enumerate() {
            if let Some(work) = pending.take() {
                self.place(model.layout(), params, unit, work)?;
            }
            // Prefetch the next block; the embeddings' backward reads no parameters.
            if let Some(&next @ Unit::Block(_)) = units.get(i + 1) {
                pending = Some(self.gather(model.layout(), next)?);
            }
            let range = model.layout().unit_range(unit);
            grads.populate(range.clone());
            model.backward_unit_with(th, params, grads, unit, comm)?;
            self.ready(range.clone(), grads);
            match unit {
                Unit::Head if self.tied => {
                    params.release(range);
                    params.release(model.layout().unit_range(Unit::Embed));
                }
                Unit::Embed => {}
                _ => params.release(range),
            }
        }
        Ok(())
    }

    /// Starts the all-gather of `unit`'s parameters from every rank's shard.
    fn gather(&mut self, layout: &Layout, unit: Unit) -> Result<Work<Buffers>> {
        let s = self.segment(layout, unit)?;
        let part = self.plan.part(s);
        let input = self.spares.filled(part.len(), &self.shard[part]);
        let output = self.spares.take(input.len() * self.plan.world());
        Ok(self
            .group
            .all_gather_async(input, output, OpOptions::default())?)
    }

    /// Waits for `unit`'s gather and writes the parameters into `params`.
    fn place(
        &mut self,
        layout: &Layout,
        params: &mut Window,
        unit: Unit,
        work: Work<Buffers>,
    ) -> Result<()> {
        let range = layout.unit_range(unit);
        params.populate(range.clone());
        let t = Instant::now();
        let (input, out) = work.wait()?;
        self.exposed += t.elapsed();
        let n = range.len();
        params[range].copy_from_slice(&out[..n]);
        self.spares.put_pair((input, out));
        Ok(())
    }

    /// The segment of `unit` (stage 3's segments are the units).
    fn segment(&self, layout: &Layout, unit: Unit) -> Result<usize> {
        self.plan
            .segment_of(&layout.unit_range(unit))
            .ok_or_else(|| TrainError::Config {
                field: "zero unit",
                value: format!("{unit:?}"),
                reason: "not a segment of the shard plan".into(),
            })
    }

    /// Backward hook: `range` of `grads` is final. Launches the reduce-scatter of every segment
    /// now complete; stages 2 and 3 then hand the segment's gradient pages back.
    pub fn ready(&mut self, range: Range<usize>, grads: &mut [f32]) {
        self.ready_from = self.ready_from.min(range.start);
        while self.failed.is_none() {
            let s = self.inflight.len();
            let Some(seg) = self.plan.segments().get(s).cloned() else {
                break;
            };
            if seg.start < self.ready_from {
                break;
            }
            let part = self.plan.part_len(s);
            let input = self
                .spares
                .filled(part * self.plan.world(), &grads[seg.clone()]);
            let output = self.spares.take(part);
            match self
                .group
                .reduce_scatter_async(input, output, ReduceOp::Sum, self.options)
            {
                Ok(work) => self.inflight.push((s, work)),
                Err(e) => self.failed = Some(e.into()),
            }
            if self.stage != Stage::One {
                window::release(&mut grads[seg]);
            }
        }
    }

    /// Waits for every reduce-scatter of the micro-batch and keeps this rank's parts, scaled by
    /// `scale` / N: stage 1 writes them over its owned elements of `grads`, stages 2 and 3 add
    /// them to the gradient shard.
    fn finish(&mut self, grads: &mut [f32], scale: f32) -> Result<()> {
        let t = Instant::now();
        self.ready(0..0, grads);
        let scale = scale / self.present_world() as f32;
        let mut first_err = self.failed.take();
        for (s, work) in std::mem::take(&mut self.inflight) {
            let summed = work
                .wait()
                .map_err(TrainError::from)
                .and_then(|(input, mut out)| {
                    if let Some(r) = &self.replicas {
                        let part = self.plan.part_len(s).min(out.len());
                        r.sum(&mut out[..part], &self.options)?;
                    }
                    Ok((input, out))
                });
            match summed {
                Ok((input, out)) => {
                    let dst = match self.stage {
                        Stage::One => &mut grads[self.plan.owned(s)],
                        _ => &mut self.grad_shard[self.plan.local(s)],
                    };
                    let accumulate = self.stage != Stage::One;
                    for (g, x) in dst.iter_mut().zip(&out) {
                        *g = if accumulate {
                            *g + x * scale
                        } else {
                            x * scale
                        };
                    }
                    self.spares.put_pair((input, out));
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.ready_from = grads.len();
        self.exposed += t.elapsed();
        first_err.map_or(Ok(()), Err)
    }

    /// The mean of `value` over the ranks (every replica group's, under hybrid sharding).
    pub fn mean(&self, value: f64) -> Result<f64> {
        let mut v = [value];
        self.group.all_reduce(&mut v, ReduceOp::Sum)?;
        if let Some(r) = &self.replicas {
            r.sum(&mut v, &OpOptions::default())?;
        }
        Ok(v[0] / self.present_world() as f64)
    }

    /// The optimizer half of step `step`: the global gradient norm (summed over the ranks'
    /// parts; with a tensor-parallel part, over the elements it counts and then exactly over
    /// its group), clipping to `clip`, AdamW on this rank's parts with `lr`, and (stages 1 and
    /// 2) the all-gather of the updated parameters. Returns the norm before clipping and the
    /// step's exposed communication. A non-finite norm is an error naming `step`, with nothing
    /// updated.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &mut self,
        th: &Threads,
        params: &mut Window,
        grads: &mut Window,
        opt: &mut AdamW,
        (lr, clip): (f32, Option<f64>),
        step: u64,
        tensor: Option<&TpPart>,
    ) -> Result<(f64, Duration)> {
        if let Some(Replicas::Quorum(ft)) = &self.replicas {
            // Nothing is updated unless every member of the quorum summed this step.
            ft.commit(step)?;
        }
        let t = Instant::now();
        let segments = self.plan.segments().len();
        let mut sq = [0f64];
        let all = std::slice::from_ref(&(0..usize::MAX));
        let counted = tensor.map_or(all, |t| &t.counted[..]);
        for s in 0..segments {
            let (owned, part) = (self.plan.owned(s), self.grad_part(grads, s));
            for c in counted {
                let (a, b) = (owned.start.max(c.start), owned.end.min(c.end));
                if a < b {
                    sq[0] += grad_sum_sq(th, &part[a - owned.start..b - owned.start]);
                }
            }
        }
        self.group
            .all_reduce_with(&mut sq, ReduceOp::Sum, &self.options)?;
        if let Some(t) = tensor {
            sq[0] = sum_in_rank_order(&t.group, sq[0])?;
        }
        self.exposed += t.elapsed();
        let norm = sq[0].sqrt();
        check_finite("gradient norm", step, norm)?;
        if let Some(c) = clip.and_then(|max| clip_coef(norm, max)) {
            match self.stage {
                Stage::One => {
                    (0..segments).for_each(|s| scale_grads(th, &mut grads[self.plan.owned(s)], c))
                }
                _ => scale_grads(th, &mut self.grad_shard, c),
            }
        }
        if let Some(master) = &mut self.master {
            let _p = model::profile::scope("optimizer");
            // bf16: the gradients rounded, AdamW on the f32 master, the parameters re-rounded.
            for s in 0..segments {
                let part = match self.stage {
                    Stage::One => &mut grads[self.plan.owned(s)],
                    _ => &mut self.grad_shard[self.plan.local(s)],
                };
                part.iter_mut().for_each(|g| *g = bf16_value(*g));
            }
            let grads_of = |s: usize| match self.stage {
                Stage::One => &grads[self.plan.owned(s)],
                _ => &self.grad_shard[self.plan.local(s)],
            };
            let local: Vec<Range<usize>> = (0..segments).map(|s| self.plan.local(s)).collect();
            let mut parts: Vec<StatePart<'_>> = disjoint_mut(master, &local)
                .into_iter()
                .enumerate()
                .map(|(s, p)| StatePart {
                    at: self.plan.local(s).start,
                    params: p,
                    grads: grads_of(s),
                })
                .collect();
            opt.step_parts(th, &mut parts, lr, &self.decay)?;
            for s in 0..segments {
                let src = &master[self.plan.local(s)];
                let dst = match self.stage {
                    Stage::Three => &mut self.shard[self.plan.local(s)],
                    _ => &mut params[self.plan.owned(s)],
                };
                for (d, &m) in dst.iter_mut().zip(src) {
                    *d = bf16_value(m);
                }
            }
        } else {
            let _p = model::profile::scope("optimizer");
            if self.stage == Stage::Three {
                let mut parts = [StatePart {
                    at: 0,
                    params: &mut self.shard,
                    grads: &self.grad_shard,
                }];
                opt.step_parts(th, &mut parts, lr, &self.decay)?;
            } else {
                let owned: Vec<Range<usize>> = (0..segments).map(|s| self.plan.owned(s)).collect();
                let mut parts: Vec<StatePart<'_>> = disjoint_mut(params, &owned)
                    .into_iter()
                    .enumerate()
                    .map(|(s, p)| StatePart {
                        at: self.plan.local(s).start,
                        params: p,
                        grads: self.grad_part(grads, s),
                    })
                    .collect();
                opt.step_parts(th, &mut parts, lr, &self.decay)?;
            }
        }
        if self.stage != Stage::Three {
            self.gather_all(params)?;
        }
        Ok((norm, std::mem::take(&mut self.exposed)))
    }

    /// This rank's reduced gradients of segment `s`.
    fn grad_part<'a>(&'a self, grads: &'a [f32], s: usize) -> &'a [f32] {
        match self.stage {
            Stage::One => &grads[self.plan.owned(s)],
            _ => &self.grad_shard[self.plan.local(s)],
        }
    }

    /// All-gathers every segment's parts into `params` (from the updated owned elements of
    /// `params` for stages 1 and 2, from the shard for stage 3). Every rank must call it.
    pub fn gather_all(&mut self, params: &mut [f32]) -> Result<()> {
        let t = Instant::now();
        let mut works = Vec::with_capacity(self.plan.segments().len());
        for s in 0..self.plan.segments().len() {
            let part = self.plan.part_len(s);
            let src = match self.stage {
                Stage::Three => &self.shard[self.plan.part(s)],
                _ => &params[self.plan.owned(s)],
            };
            let input = self.spares.filled(part, src);
            let output = self.spares.take(part * self.plan.world());
            works.push(
                self.group
                    .all_gather_async(input, output, OpOptions::default())?,
            );
        }
        for (s, work) in works.into_iter().enumerate() {
            let (input, out) = work.wait()?;
            let seg = self.plan.segments()[s].clone();
            let n = seg.len();
            params[seg].copy_from_slice(&out[..n]);
            self.spares.put_pair((input, out));
        }
        self.exposed += t.elapsed();
        Ok(())
    }
}

/// Mutable slices of `buf` at the disjoint `ranges` (any order), returned in that order.
fn disjoint_mut<'a>(buf: &'a mut [f32], ranges: &[Range<usize>]) -> Vec<&'a mut [f32]> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| ranges[i].start);
    let mut out: Vec<Option<&'a mut [f32]>> = (0..ranges.len()).map(|_| None).collect();
    let mut rest = buf;
    let mut base = 0;
    for i in order {
        let r = &ranges[i];
        let (_, tail) = rest.split_at_mut(r.start - base);
        let (mine, tail) = tail.split_at_mut(r.len());
        out[i] = Some(mine);
        rest = tail;
        base = r.end;
    }
    out.into_iter().map(|s| s.unwrap_or_default()).collect()
}

/// What a hybrid-sharded rank sums its reduced parts across.
#[derive(Clone)]
pub enum Replicas {
    /// The same shard of every replica group (HSDP).
    Group(ProcessGroup),
    /// The replica groups of each step's quorum (`--ft`).
    Quorum(Arc<FaultTolerance>),
}

impl Replicas {
    /// Replica groups in the job.
    pub fn size(&self) -> usize {
        match self {
            Replicas::Group(g) => g.size(),
            Replicas::Quorum(ft) => ft.replicas(),
        }
    }

    /// This rank's replica group.
    pub fn rank(&self) -> usize {
        match self {
            Replicas::Group(g) => g.rank(),
            Replicas::Quorum(ft) => ft.replica(),
        }
    }

    /// Replica groups summed over this step.
    pub fn present(&self) -> usize {
        match self {
            Replicas::Group(g) => g.size(),
            Replicas::Quorum(ft) => ft.participants(),
        }
    }

    /// The process group across the replica groups (under `--ft`, the current quorum's).
    pub fn group(&self) -> Option<ProcessGroup> {
        match self {
            Replicas::Group(g) => Some(g.clone()),
            Replicas::Quorum(ft) => ft.group(),
        }
    }

    /// Sums `buf` across the replica groups.
    fn sum<T: comm::Element>(&self, buf: &mut [T], options: &OpOptions) -> Result<()> {
        match self {
            Replicas::Group(g) => Ok(g.all_reduce_with(buf, ReduceOp::Sum, options)?),
            Replicas::Quorum(ft) => ft.sum(buf),
        }
    }
}
