//! [`TpTrainer`]: one rank of tensor-parallel training of a whole model (000 §2.15, F46–F47),
//! the update [`crate::Trainer`] makes on the same global batch up to float summation order.
//!
//! - Data. Every rank of the group draws the same batches (the same [`Source`] and seed as one
//!   process, [`Share::whole`]): tensor parallelism splits the model, not the batch. With a
//!   data-parallel dimension ([`super::data_parallel`]) every rank of replica `j` of `d` draws
//!   the rows data-parallel rank `j` of `d` would draw.
//! - Step. As [`crate::Trainer::step`]: gradients zeroed, forward and backward of each of the
//!   `grad_accum` micro-batches summed (with `d` replicas: summed over them too), scaled by
//!   `1/grad_accum` (`(1/grad_accum)/d`), the global norm taken and clipped to `grad_clip`,
//!   AdamW with the schedule's learning rate and weight decay on the tensors one process
//!   decays ([`TpLayout::decay_ranges`]).
//! - Global norm. Each rank sums the squares of the elements it counts
//!   ([`TpLayout::norm_ranges`]: rank 0 its whole buffer, the others only their sharded
//!   slices, so replicated tensors count once) in f64 with [`grad_sum_sq`]; the `tp` partials
//!   are exchanged exactly (`sum_in_rank_order`) so every rank gets the same norm. Not
//!   bit-identical to one process's norm (other blocks of summation), within float tolerance
//!   of it.
//! - Determinism. The blocks' all-reduces (and the replicas' gradient sum) use a pinned
//!   algorithm ([`TP_ALL_REDUCE`]); the norm's exchange and the gather are exact whatever the
//!   algorithm. So repeated runs are bit-identical.
//! - Replicas stay identical. Replicated tensors get identical gradients on every rank
//!   ([`super::model`]), the same clip coefficient and the same element-wise AdamW, so they
//!   stay bit-identical without communication.
//! - Memory. Per rank: parameters, gradients and AdamW's two moments over `layout.total`
//!   elements (16 B each in f32): `L·S + E + Hd` with `S` the block shard and `E`, `Hd` the
//!   whole embeddings and head (replicated; the planner's vocabulary-parallel formula divides
//!   them by `t`).
use std::ops::Range;
use std::time::Instant;

use comm::ReduceOp;
use comm::algo::Algo;
use comm::group::{OpOptions, ProcessGroup};
use model::Threads;
use model::init::init_params;
use model::optim::{AdamW, check_finite, clip_coef, grad_sum_sq, scale_grads};

use super::TpGroup;
use super::data_parallel::{mean_over_replicas, reduce_over_replicas};
use super::layout::TpLayout;
use super::model::TpModel;
use super::shard::TpShard;
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::grad::fetch;
use crate::source::{Share, Source};
use crate::trainer::{StateMemory, StepStats};
use crate::zero::replica::ReplicaShard;

/// The algorithm of the blocks' all-reduces, pinned. Left to itself the group picks one per
/// op from its α-β model, which calibration measures anew in every run, so two runs could
/// sum the tp partials in different orders; the ring's order is fixed by the ranks alone
/// (and every rank receives the same reduced bytes), so repeated runs are bit-identical.
pub const TP_ALL_REDUCE: Algo = Algo::Ring;

/// The options of every summing all-reduce this engine issues: [`TP_ALL_REDUCE`] pinned.
pub const PINNED: OpOptions = OpOptions {
    algo: Some(TP_ALL_REDUCE),
    timeout: None,
};

/// `mine`, one rank's value, summed over `group` exactly and in rank order: each rank fills
/// its slot of a zeroed vector, the all-reduce adds zeros to every other slot (exact whatever
/// the algorithm), then every rank sums the slots in the same order, so all get the same bits.
pub(super) fn sum_in_rank_order(group: &ProcessGroup, mine: f64) -> Result<f64> {
    let mut slots = vec![0f64; group.size()];
    slots[group.rank()] = mine;
    group.all_reduce(&mut slots, ReduceOp::Sum)?;
    Ok(slots.iter().sum())
}

/// One rank of a tensor-parallel run over `group` (its size is the degree `tp`), optionally
/// one of `dp` data-parallel replicas of that group ([`TpTrainer::with_data_parallel`]).
pub struct TpTrainer {
    cfg: TrainConfig,
    group: ProcessGroup,
    /// The data-parallel group (this rank's counterparts in the other replicas), when `dp > 1`.
    dp: Option<ProcessGroup>,
    th: Threads,
    model: TpModel,
    /// This rank's flat parameters (length `layout.total`, see [`TpLayout`]).
    params: Vec<f32>,
    /// Their gradients (same length).
    grads: Vec<f32>,
    /// AdamW over this rank's flat buffers, or under ZeRO-1 over its replica's part of them
    /// (`zero1`).
    opt: AdamW,
    /// The ranges `opt` decays (relative to the part under ZeRO-1).
    decay: Vec<Range<usize>>,
    /// ZeRO-1 over the data-parallel replicas: the part of the flat buffers whose moments this
    /// replica keeps and steps ([`crate::zero::replica`]).
    zero1: Option<ReplicaShard>,
    norm_ranges: Vec<Range<usize>>,
    source: Source,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    step: u64,
    /// Micro-batches drawn since the source was (re)built.
    drawn: u64,
    /// Rows of the stream consumed before the source was last rebuilt that do not make a whole
    /// global micro-batch (a resume from a run with another global batch).
    rows_base: u64,
}

/// Refuses a buffer of `got` elements where `want` are needed.
fn check_len_eq(what: &'static str, got: usize, want: usize) -> Result<()> {
    if got == want {
        return Ok(());
    }
    Err(refuse(
        what,
        &got.to_string(),
        &format!("this rank's flat layout holds {want} elements"),
    ))
}

/// The config error of `field` = `value`, for `reason`.
pub(super) fn refuse(field: &'static str, value: &str, reason: &str) -> TrainError {
    TrainError::Config {
        field,
        value: value.into(),
        reason: reason.into(),
    }
}

impl TpTrainer {
    /// Rank `group.rank()` of a `group.size()`-way tensor-parallel run of `cfg`. Every rank
    /// initialises the whole model from `cfg.seed` (as [`crate::Trainer::new`] does, whole
    /// and transiently) and keeps its part.
    ///
    /// Errors, each naming the field: `tp` when the group size does not divide heads, kv_heads
    /// or ffn ([`super::check_tp`]); `bf16` (not built for tensor parallelism); any
    /// [`TrainConfig::validate`] error. With `recompute`, every block keeps only its output
    /// and is run forward again (its two sums included) in the backward.
    pub fn new(cfg: TrainConfig, group: ProcessGroup) -> Result<Self> {
        Self::build(cfg, group, None)
    }

    /// [`TpTrainer::new`] as one of `dp.size()` data-parallel replicas when `dp` is given (the
    /// checks across replicas are the caller's: [`TpTrainer::with_data_parallel`]).
    pub(super) fn build(
        cfg: TrainConfig,
        group: ProcessGroup,
        dp: Option<ProcessGroup>,
    ) -> Result<Self> {
        cfg.validate()?;
        if cfg.bf16 {
            return Err(refuse(
                "bf16",
                "true",
                "tensor-parallel ranks keep f32 state; bf16 with TP is not built yet",
            ));
        }
        let (tp, rank) = (group.size(), group.rank());
        let th = Threads::new(cfg.threads)?;
        let model = TpModel::new(&cfg.model, tp, rank, cfg.batch, cfg.seq_len, cfg.recompute)?;
        let layout = model.layout();
        let mut whole = vec![0f32; layout.whole.total];
        init_params(&cfg.model, &layout.whole, cfg.seed, &mut whole);
        let mut params = vec![0f32; layout.total];
        layout.shard_params(&whole, &mut params)?;
        drop(whole);
        let decay = layout.decay_ranges(cfg.decay_all)?;
        let norm_ranges = layout.norm_ranges();
        let opt = AdamW::new(cfg.adamw, params.len())?;
        let dp = dp.filter(|d| d.size() > 1);
        let source = Source::for_config(&cfg, replica_share(cfg.batch, dp.as_ref()))?;
        let n = cfg.micro_tokens();
        Ok(Self {
            dp,
            grads: vec![0f32; params.len()],
            params,
            opt,
            decay,
            norm_ranges,
            source,
            inputs: vec![0; n],
            targets: vec![0; n],
            step: 0,
            drawn: 0,
            rows_base: 0,
            zero1: None,
            model,
            th,
            group,
            cfg,
        })
    }

    /// The config.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// The data loader's metrics (stall, batch build latency), when the run reads a token
    /// dataset.
    pub fn data_metrics(&self) -> Option<&data::LoaderMetrics> {
        self.source.loader_metrics()
    }

    /// The tensor-parallel degree (the group's size).
    pub fn tp(&self) -> usize {
        self.group.size()
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Data-parallel replicas of the tensor-parallel group (1 without data parallelism).
    pub fn replicas(&self) -> usize {
        self.dp.as_ref().map_or(1, ProcessGroup::size)
    }

    /// This rank's replica, `0..replicas()` (its data-parallel rank).
    pub fn replica(&self) -> usize {
        self.dp.as_ref().map_or(0, ProcessGroup::rank)
    }

    /// Where this rank keeps what in its flat buffers.
    pub fn layout(&self) -> &TpLayout {
        self.model.layout()
    }

    /// Steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// This rank's flat parameters (length `layout().total`): the replicated embeddings and
    /// head and its block shards.
    pub fn params_shard(&self) -> &[f32] {
        &self.params
    }

    /// This rank's gradients of the last step, after scaling and clipping (length
    /// `layout().total`).
    pub fn grads_shard(&self) -> &[f32] {
        &self.grads
    }

    /// The optimizer over this rank's flat state.
    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }

    /// The whole model's parameters in its [`model::layout::Layout`] order (length
    /// `layout().whole.total`), assembled from every rank's buffer with an all-gather: block
    /// shards from their ranks, replicated tensors from rank 0. A collective (every rank must
    /// call it); exact copies.
    pub fn gather_params(&self) -> Result<Vec<f32>> {
        self.gather_whole(&self.params)
    }

    /// `local`, a buffer in this rank's flat layout (parameters, or one of AdamW's moments,
    /// which share it), assembled into the whole model's [`model::layout::Layout`] order as
    /// [`TpTrainer::gather_params`] does. A collective.
    pub(crate) fn gather_whole(&self, local: &[f32]) -> Result<Vec<f32>> {
        let layout = self.model.layout();
        let (tp, len) = (self.tp(), layout.total);
        check_len_eq("local state", local.len(), len)?;
        let mut all = vec![0f32; tp * len];
        self.group.all_gather(local, &mut all)?;
        let mut whole = vec![0f32; layout.whole.total];
        let s = &layout.shard;
        let d = &s.dims;
        for (r, part) in all.chunks_exact(len).enumerate() {
            let mut other = layout.clone();
            other.shard = TpShard::new(&self.cfg.model, &s.whole, tp, r, d.b, d.t)?;
            other.unshard_params(part, &mut whole)?;
        }
        Ok(whole)
    }

    /// Micro-batches drawn from the data source since it was last (re)built.
    pub fn batches_drawn(&self) -> u64 {
        self.drawn
    }

    /// Rows of the data stream consumed so far by all replicas together (the global row
    /// cursor: every rank of a replica draws the same rows, so without data parallelism this
    /// is what one process would have drawn).
    pub fn rows_drawn(&self) -> u64 {
        self.rows_base + self.drawn * self.global_rows()
    }

    /// Rows of one global micro-batch: `batch` per replica.
    fn global_rows(&self) -> u64 {
        (self.cfg.batch * self.replicas()) as u64
    }

    /// The tensor-parallel group.
    pub(crate) fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The data-parallel group, when there are replicas.
    pub(crate) fn dp_group(&self) -> Option<&ProcessGroup> {
        self.dp.as_ref()
    }

    /// The data source's loader state (token datasets only).
    pub(crate) fn loader_state(&mut self) -> Option<data::LoaderState> {
        self.source.loader_state()
    }

    /// Replaces this rank's parameters, AdamW moments (all in its flat layout) and the step
    /// counters, as a checkpoint recorded them.
    pub(crate) fn load_state(
        &mut self,
        params: Vec<f32>,
        m: Vec<f32>,
        v: Vec<f32>,
        optimizer_step: u64,
        step: u64,
    ) -> Result<()> {
        check_len_eq("parameters", params.len(), self.params.len())?;
        let (m, v) = match &self.zero1 {
            Some(z) => (m[z.shard.clone()].to_vec(), v[z.shard.clone()].to_vec()),
            None => (m, v),
        };
        self.opt = AdamW::from_state(self.cfg.adamw, m, v, optimizer_step)?;
        self.params = params;
        self.step = step;
        Ok(())
    }

    /// Rebuilds the data source at a checkpoint's position: from the loader's state for token
    /// datasets, else by skipping the `rows` rows already consumed (by any number of ranks);
    /// each replica then draws its share of the global batches that follow.
    pub(crate) fn reset_source(
        &mut self,
        loader: Option<&data::LoaderState>,
        rows: u64,
    ) -> Result<()> {
        let c = &self.cfg;
        let share = replica_share(c.batch, self.dp.as_ref());
        (self.source, self.drawn, self.rows_base) = Source::resumed_at(
            &c.data,
            c.model.vocab,
            c.seq_len,
            share,
            c.seed,
            loader,
            rows,
        )?;
        Ok(())
    }

    /// Resident bytes of this rank's training state: its flat parameters, gradients and
    /// AdamW's two moments (`layout().total` f32 elements each; activations excluded).
    pub fn state_memory(&self) -> StateMemory {
        let (m, v) = self.opt.moments();
        StateMemory {
            params: 4 * self.params.len(),
            grads: 4 * self.grads.len(),
            optimizer: 4 * (m.len() + v.len()),
            comm_buffers: 0,
        }
    }

    /// Shards the optimizer state over the data-parallel replicas (ZeRO-1): from now on this
    /// replica keeps AdamW's moments for its part of the flat buffers only, steps that part,
    /// and all-gathers the parts into the parameters (exact: AdamW is elementwise). Called
    /// before the first step; a no-op without replicas.
    pub(super) fn shard_optimizer(&mut self) -> Result<()> {
        let Some(dp) = self.dp.as_ref() else {
            return Ok(());
        };
        let z = ReplicaShard::new(0..self.params.len(), dp.size(), dp.rank());
        let decay_all = self.model.layout().decay_ranges(self.cfg.decay_all)?;
        self.decay = z.decay_in(&decay_all);
        self.opt = AdamW::new(self.cfg.adamw, z.shard.len())?;
        self.zero1 = Some(z);
        Ok(())
    }

    /// AdamW's two moments over this rank's whole flat buffers (under ZeRO-1 all-gathered
    /// from the replicas' parts: a collective over the data-parallel group).
    pub(crate) fn local_moments(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let (m, v) = self.opt.moments();
        match (&self.zero1, &self.dp) {
            (Some(z), Some(dp)) => Ok((z.gather_part(dp, m)?, z.gather_part(dp, v)?)),
            _ => Ok((m.to_vec(), v.to_vec())),
        }
    }

    /// Whether the optimizer state is sharded over the replicas (ZeRO-1).
    pub fn zero_stage(&self) -> Option<crate::zero::Stage> {
        self.zero1.as_ref().map(|_| crate::zero::Stage::One)
    }

    /// The squared global gradient norm over the whole model, every element counted once;
    /// the same value on every rank. Exchanged over the tensor-parallel group only: after the
    /// replicas' sum every replica holds the same gradients.
    fn global_sum_sq(&self) -> Result<f64> {
        let mine = self.norm_ranges.iter().fold(0.0, |a, r| {
            a + grad_sum_sq(&self.th, &self.grads[r.clone()])
        });
        sum_in_rank_order(&self.group, mine)
    }

    /// One optimizer step on the next `grad_accum` micro-batches (the same on every rank of a
    /// replica, each replica its share of the global batch); every rank must call it. A
    /// non-finite loss (the replicas' mean, so every rank refuses together) or gradient norm is
    /// an error naming the step, with the parameters left as they were. The loss is the mean
    /// over the replicas. `comm_seconds` is the time spent
    /// in the blocks' all-reduces and the replicas' gradient sum (all exposed: nothing
    /// overlaps them yet).
    pub fn step(&mut self) -> Result<StepStats> {
        let step = self.step + 1;
        let t0 = Instant::now();
        let count = self.cfg.grad_accum.max(1);
        self.grads.fill(0.0);
        let mut comm = TpGroup::new(&self.group);
        let (mut loss_sum, mut data_seconds) = (0.0f64, 0.0f64);
        for _ in 0..count {
            data_seconds += fetch(&mut self.source, &mut self.inputs, &mut self.targets)?;
            self.drawn += 1;
            let loss = self.model.forward(
                &self.th,
                &self.params,
                &self.inputs,
                &self.targets,
                &mut comm,
            )?;
            loss_sum += loss;
            self.model
                .backward(&self.th, &self.params, &mut self.grads, &mut comm)?;
        }
        let mut comm_seconds = comm.seconds;
        // Before the norm: the norm and the clipping see the replicas' mean gradient.
        comm_seconds += reduce_over_replicas(self.dp.as_ref(), &self.th, &mut self.grads, count)?;
        let loss = mean_over_replicas(self.dp.as_ref(), loss_sum / count as f64)?;
        // Checked on the replicas' mean, not per micro-batch: a non-finite loss on one replica
        // makes the mean non-finite on all, so they refuse the step together instead of one
        // leaving the others waiting in the gradient sum.
        check_finite("loss", step, loss)?;
        let norm = self.global_sum_sq()?.sqrt();
        check_finite("gradient norm", step, norm)?;
        if let Some(c) = self.cfg.grad_clip.and_then(|max| clip_coef(norm, max)) {
            scale_grads(&self.th, &mut self.grads, c);
        }
        let lr = self.cfg.schedule.lr_at(self.cfg.lr, self.step);
        match (&self.zero1, &self.dp) {
            (Some(z), Some(dp)) => {
                let s = z.shard.clone();
                let (params, grads) = (&mut self.params[s.clone()], &self.grads[s]);
                self.opt.step(&self.th, params, grads, lr, &self.decay)?;
                let t = Instant::now();
                z.gather(dp, &mut self.params)?;
                comm_seconds += t.elapsed().as_secs_f64();
            }
            _ => self
                .opt
                .step(&self.th, &mut self.params, &self.grads, lr, &self.decay)?,
        }
        self.step = step;
        Ok(StepStats {
            step,
            loss,
            lr,
            grad_norm: norm,
            tokens: self.cfg.tokens_per_step() * self.replicas(),
            seconds: t0.elapsed().as_secs_f64() - data_seconds,
            data_seconds,
            comm_seconds,
        })
    }
}

/// A replica's share of each global batch: `batch` rows as data-parallel rank `dp.rank()` of
/// `dp.size()` takes them, or whole batches of `batch` rows without replicas.
fn replica_share(batch: usize, dp: Option<&ProcessGroup>) -> Share {
    let (world, rank) = dp.map_or((1, 0), |d| (d.size(), d.rank()));
    Share { batch, world, rank }
}
