//! Training the MoE decoder ([`MoeModel`]) with expert parallelism, as Megatron and
//! DeepSpeed-MoE do (000 "专家并行（混合专家模型）", F49-F50): the EP ranks are data-parallel
//! replicas of the dense tensors and each holds E / ep experts of every layer.
//!
//! One step on rank r of ep:
//!
//! 1. Data. The `batch` rows data-parallel [`crate::Trainer`] rank r of ep would draw
//!    ([`Share`]): the group trains on a global batch of `ep · batch` rows.
//! 2. Forward and backward of the group's objective, mean cross-entropy over the global batch
//!    plus `aux_weight · Σ_l aux_l` (see [`super`]): routers and experts come out
//!    complete, the dense part as this rank's share.
//! 3. Dense all-reduce. `grads[..dense]` summed over the group in one all-reduce pinned to
//!    [`TP_ALL_REDUCE`] (every rank gets the same bytes, so replicas stay bit-identical); with
//!    the rows scaled by 1 / N_global this is the average of the ranks' own-batch gradients.
//! 4. Global norm, every element once: the dense part and the routers (replicated, identical)
//!    on each rank, plus each expert's sum of squares gathered from its owner and added in
//!    global (layer, expert) order, so the same on every rank for every ep. Clipped as
//!    `torch.nn.utils.clip_grad_norm_`.
//! 5. AdamW (model::optim) over the rank's buffer, element-wise, so the replicated tensors
//!    stay equal and each expert is updated exactly where it lives, at the learning rate of
//!    the trainer's schedule for this step ([`MoeTrainer::with_schedule`]; constant unless
//!    set), decaying the matrices and embeddings, or every tensor
//!    ([`MoeTrainer::with_decay_all`]).
//!
//! EP = p on p shares of a global batch therefore makes the update EP = 1 makes on the whole
//! batch (the capacity rule is already global over the group), within float summation order;
//! every collective has a fixed order, so repeated runs are bit-identical.
use super::{MoeModel, MoeModelConfig, MoeModelLayout};
use crate::config::DataSpec;
use crate::error::Result;
use crate::expert::{MoeStats, bad};
use crate::source::{Share, Source};
use crate::tensor::TP_ALL_REDUCE;
use comm::ReduceOp;
use comm::group::{OpOptions, ProcessGroup};
use model::Threads;
use model::optim::{
    AdamW, AdamWConfig, Schedule, check_finite, check_max_norm, clip_coef, grad_sum_sq, scale_grads,
};

/// The dense all-reduce's options: [`TP_ALL_REDUCE`] pinned (deterministic, same bytes on
/// every rank).
const PINNED: OpOptions = OpOptions {
    algo: Some(TP_ALL_REDUCE),
    timeout: None,
};

/// Everything one EP rank needs to train; every rank of the group passes the same.
#[derive(Clone, Debug)]
pub struct MoeTrainConfig {
    /// The decoder.
    pub model: MoeModelConfig,
    /// Rows per EP rank per step (the global batch is `ep · batch`), >= 1.
    pub batch: usize,
    /// Tokens per row (T), in `1..=model.seq_len`.
    pub seq_len: usize,
    /// Peak learning rate, finite and >= 0: constant unless the trainer is given a schedule
    /// ([`MoeTrainer::with_schedule`]).
    pub lr: f32,
    /// AdamW settings.
    pub adamw: AdamWConfig,
    /// Global gradient-norm clip; `None` disables clipping.
    pub grad_clip: Option<f64>,
    /// Seed of the initialisation and of the data stream.
    pub seed: u64,
    /// Compute threads per rank, >= 1.
    pub threads: usize,
    /// Training data.
    pub data: DataSpec,
}

/// What one step did, the same on every rank of the group.
#[derive(Clone, Debug)]
pub struct MoeStepStats {
    /// Mean cross-entropy over the global batch (the ranks' sums added in rank order).
    pub loss: f64,
    /// Σ over layers of the unweighted aux loss.
    pub aux: f64,
    /// Global gradient norm before clipping.
    pub norm: f64,
    /// Learning rate of the step's update.
    pub lr: f32,
    /// Seconds in the dense gradients' all-reduce (the dispatch and combine all-to-alls run
    /// inside the layers' forward and backward and are not counted here).
    pub allreduce_seconds: f64,
    /// Each layer's routing metrics (byte counts are this rank's).
    pub layers: Vec<MoeStats>,
}

impl MoeStepStats {
    /// Assignments dropped by capacity, over all layers.
    pub fn dropped_assignments(&self) -> usize {
        self.layers.iter().map(|s| s.dropped_assignments).sum()
    }
}

/// One EP rank's trainer: model, flat parameters and gradients, AdamW state, data.
pub struct MoeTrainer {
    pub(super) cfg: MoeTrainConfig,
    pub(super) group: ProcessGroup,
    pub(super) th: Threads,
    pub(super) model: MoeModel,
    pub(super) params: Vec<f32>,
    pub(super) grads: Vec<f32>,
    pub(super) opt: AdamW,
    pub(super) decay: Vec<std::ops::Range<usize>>,
    pub(super) schedule: Schedule,
    pub(super) decay_all: bool,
    pub(super) source: Source,
    pub(super) inputs: Vec<u32>,
    pub(super) targets: Vec<u32>,
    pub(super) step: u64,
    /// Batches drawn since the source was (re)built, and the global row cursor then.
    pub(super) drawn: u64,
    pub(super) rows_base: u64,
}

impl MoeTrainer {
    /// Rank `group.rank()` of an EP group of `group.size()` ranks, starting from the ep = 1
    /// initialisation of `cfg.seed` cut to this rank. Refuses a group size not dividing E
    /// (naming `experts` and the equation), and the other bad fields by name.
    pub fn new(cfg: MoeTrainConfig, group: ProcessGroup) -> Result<Self> {
        let (ep, rank) = (group.size(), group.rank());
        let layout = MoeModelLayout::new(cfg.model, ep, rank)?;
        if !(cfg.lr.is_finite() && cfg.lr >= 0.0) {
            return Err(bad("lr", cfg.lr, "must be finite and >= 0"));
        }
        if let Some(c) = cfg.grad_clip {
            check_max_norm(c)?;
        }
        let th = Threads::new(cfg.threads)?;
        let model = MoeModel::new(cfg.model, group.clone(), cfg.batch, cfg.seq_len)?;
        let params = layout.shard(&MoeModelLayout::init_whole(cfg.model, cfg.seed)?)?;
        let share = Share {
            batch: cfg.batch,
            world: ep,
            rank,
        };
        let source = Source::new(
            &cfg.data,
            cfg.model.vocab,
            cfg.seq_len,
            share,
            cfg.seed,
            None,
        )?;
        let n = cfg.batch * cfg.seq_len;
        Ok(Self {
            opt: AdamW::new(cfg.adamw, layout.total)?,
            grads: vec![0.0; layout.total],
            decay: layout.decay_ranges(),
            inputs: vec![0; n],
            targets: vec![0; n],
            step: 0,
            drawn: 0,
            rows_base: 0,
            schedule: Schedule::Constant,
            decay_all: false,
            cfg,
            group,
            th,
            model,
            params,
            source,
        })
    }

    /// The trainer with the learning rate of step `s` (0-based) `schedule.lr_at(cfg.lr, s)`,
    /// as the dense trainers take it; refuses an invalid schedule by its field.
    pub fn with_schedule(mut self, schedule: Schedule) -> Result<Self> {
        schedule.validate()?;
        self.schedule = schedule;
        Ok(self)
    }

    /// The trainer with weight decay on every tensor (`all`, torch's default, as
    /// [`crate::TrainConfig::decay_all`]) or on the matrices and embeddings only (the default,
    /// [`MoeModelLayout::decay_ranges`]).
    pub fn with_decay_all(mut self, all: bool) -> Self {
        let total = self.layout().total;
        self.decay_all = all;
        self.decay = if all {
            std::iter::once(0..total).collect()
        } else {
            self.layout().decay_ranges()
        };
        self
    }

    /// This rank's layout.
    pub fn layout(&self) -> &MoeModelLayout {
        self.model.layout()
    }

    /// The training config.
    pub fn config(&self) -> &MoeTrainConfig {
        &self.cfg
    }

    /// The learning-rate schedule and whether every tensor is decayed (the settings a
    /// checkpoint's config hash covers beside the config).
    pub fn schedule(&self) -> (Schedule, bool) {
        (self.schedule, self.decay_all)
    }

    /// The EP group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// AdamW's state (its moments share the parameters' flat layout).
    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }

    /// Rows of the data stream consumed by the whole group (the global row cursor).
    pub fn rows_drawn(&self) -> u64 {
        self.rows_base + self.drawn * (self.cfg.batch * self.group.size()) as u64
    }

    /// Batches this rank drew since its source was built or reset.
    pub fn batches_drawn(&self) -> u64 {
        self.drawn
    }

    /// The data source's loader state (token datasets only).
    pub fn loader_state(&mut self) -> Option<data::LoaderState> {
        self.source.loader_state()
    }

    /// Resident bytes of this rank's training state: its flat parameters, gradients and
    /// AdamW's two moments (`layout().total` f32 elements each; activations excluded).
    pub fn state_memory(&self) -> crate::StateMemory {
        let (m, v) = self.opt.moments();
        crate::StateMemory {
            params: 4 * self.params.len(),
            grads: 4 * self.grads.len(),
            optimizer: 4 * (m.len() + v.len()),
            comm_buffers: 0,
        }
    }

    /// Replaces this rank's parameters and AdamW moments (its flat layout) and the step
    /// counters, as a checkpoint recorded them.
    pub(crate) fn load_state(
        &mut self,
        [params, m, v]: [Vec<f32>; 3],
        optimizer_step: u64,
        step: u64,
    ) -> Result<()> {
        crate::expert::check_len("moe trainer parameters", self.params.len(), params.len())?;
        self.opt = AdamW::from_state(self.cfg.adamw, m, v, optimizer_step)?;
        self.params = params;
        self.step = step;
        Ok(())
    }

    /// Rebuilds the data source at a checkpoint's position: from the loader's state for token
    /// datasets, else by skipping the `rows` rows the saving group consumed (any EP degree);
    /// this rank then draws its share of the global batches that follow.
    pub(crate) fn reset_source(
        &mut self,
        loader: Option<&data::LoaderState>,
        rows: u64,
    ) -> Result<()> {
        let c = &self.cfg;
        let share = Share {
            batch: c.batch,
            world: self.group.size(),
            rank: self.group.rank(),
        };
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

    /// This rank's parameters ([`MoeModelLayout::gather`] joins the group's).
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// The data loader's metrics (stall, batch build latency), when the run reads a token
    /// dataset.
    pub fn data_metrics(&self) -> Option<&data::LoaderMetrics> {
        self.source.loader_metrics()
    }

    /// One optimizer step (collective over the group).
    pub fn step(&mut self) -> Result<MoeStepStats> {
        let lr = self.schedule.lr_at(self.cfg.lr, self.step);
        self.step += 1;
        self.source
            .next_batch(&mut self.inputs, &mut self.targets)?;
        self.drawn += 1;
        let th = &self.th;
        self.grads.fill(0.0);
        let fwd = self
            .model
            .forward(th, &self.params, &self.inputs, &self.targets)?;
        let loss = self.in_rank_order(&[fwd.loss_sum])?.iter().sum::<f64>()
            / self.model.global_tokens() as f64;
        // Checked after the exchange, so a non-finite loss fails every rank together.
        check_finite("loss", self.step, loss)?;
        self.model.backward(th, &self.params, &mut self.grads)?;
        let dense = self.layout().dense;
        let t0 = std::time::Instant::now();
        if self.group.size() > 1 {
            self.group
                .all_reduce_with(&mut self.grads[..dense], ReduceOp::Sum, &PINNED)?;
        }
        let allreduce_seconds = t0.elapsed().as_secs_f64();
        let norm = self.global_norm()?;
        check_finite("gradient norm", self.step, norm)?;
        if let Some(c) = self.cfg.grad_clip.and_then(|max| clip_coef(norm, max)) {
            scale_grads(th, &mut self.grads, c);
        }
        self.opt
            .step(th, &mut self.params, &self.grads, lr, &self.decay)?;
        Ok(MoeStepStats {
            loss,
            aux: fwd.stats.iter().map(|s| s.aux_loss).sum(),
            norm,
            lr,
            allreduce_seconds,
            layers: fwd.stats,
        })
    }

    /// Every rank's equal-length `mine`, concatenated in rank order (exact: a gather).
    fn in_rank_order(&self, mine: &[f64]) -> Result<Vec<f64>> {
        let mut all = vec![0f64; mine.len() * self.group.size()];
        self.group.all_gather(mine, &mut all)?;
        Ok(all)
    }

    /// The L2 norm of the whole model's gradient, each element counted once (step 4 of the
    /// module doc).
    fn global_norm(&self) -> Result<f64> {
        let l = self.layout();
        let (th, g) = (&self.th, &self.grads);
        let mut sq = grad_sum_sq(th, &g[..l.dense]);
        for b in &l.blocks {
            sq += grad_sum_sq(th, &g[l.router(b)]);
        }
        let el = l.moe.local_experts();
        let mine: Vec<f64> = l
            .blocks
            .iter()
            .flat_map(|b| (0..el).map(|e| grad_sum_sq(th, &g[l.expert(b, e)])))
            .collect();
        // (ep, L, El) → global order (L, E): expert r·El + e of layer i is at [r][i][e].
        let all = self.in_rank_order(&mine)?;
        let layers = l.blocks.len();
        for i in 0..layers {
            for r in 0..self.group.size() {
                for e in 0..el {
                    sq += all[(r * layers + i) * el + e];
                }
            }
        }
        Ok(sq.sqrt())
    }
}
