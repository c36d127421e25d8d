//! The single-process trainer: forward, backward, clip, AdamW, schedule. What it holds is read
//! through `view.rs`; the held-out loss is `eval.rs`.
mod eval;
mod ft;
mod view;

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::expert::{BlockGroups, ExpertPart};
use crate::grad::{Accum, GradOut, GradStep, fetch, grad_step};
use crate::source::Source;
use crate::tensor::{BlockComm, TpPart};
use crate::zero::{Stage, Window, Zero};
use model::Threads;
use model::init::init_params;
use model::model::Model;
use model::optim::{AdamW, Bf16Store, check_finite};
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::checkpoint::state_views;
use crate::ddp::GradBuckets;
use crate::source::Share;
use ckpt::TensorMeta;
use comm::group::ProcessGroup;

/// What one optimizer step did.
#[derive(Clone, Copy, Debug)]
pub struct StepStats {
    /// Steps completed, counting this one (1-based).
    pub step: u64,
    /// Mean cross-entropy of the step's batch (nats/token).
    pub loss: f64,
    /// Learning rate used.
    pub lr: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens trained in this step.
    pub tokens: usize,
    /// Wall time of the step, seconds (batch fetch excluded).
    pub seconds: f64,
    /// Time the step waited for its batch, seconds (the data stall, 000 eq. 4.2).
    pub data_seconds: f64,
    /// Time the step waited for gradient communication after its backward, seconds (the
    /// exposed communication; 0 for one process).
    pub comm_seconds: f64,
}

/// Resident bytes of one rank's training state, measured: whole-model buffers count only their
/// pages in memory ([`crate::zero::Window`]), shards and optimizer moments their length.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateMemory {
    /// Parameters (with bf16, its parameters, gradients and master weights too).
    pub params: usize,
    /// Gradients.
    pub grads: usize,
    /// Optimizer state (AdamW's two moments).
    pub optimizer: usize,
    /// Communication buffers kept between steps: the data-parallel bucket buffers, or ZeRO's
    /// reused transfer buffers.
    pub comm_buffers: usize,
}

/// A single-process training run.
pub struct Trainer {
    cfg: TrainConfig,
    th: Threads,
    pub(crate) model: Model<f32>,
    /// The whole model's parameters (f32; under ZeRO-3 only the units gathered at the moment).
    pub(crate) params: Window,
    /// The whole model's gradients (under ZeRO-2/3 only the buckets not yet reduced).
    pub(crate) grads: Window,
    opt: AdamW,
    pub(crate) bf16: Option<Bf16Store>,
    decay: Vec<Range<usize>>,
    source: Source,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    step: u64,
    /// Batches drawn from `source` (training and evaluation alike): the data cursor of the
    /// built-in corpora.
    drawn: u64,
    /// Rows consumed before `drawn` started counting (a resume on another number of ranks
    /// whose cursor is not a whole number of this run's global batches).
    rows_base: u64,
    /// Data-parallel gradient buckets, when this is one rank of several.
    pub(crate) sync: Option<GradBuckets>,
    /// The ZeRO engine, when this is one rank of a sharded data-parallel run.
    zero: Option<Box<Zero>>,
    /// The tensor-parallel part, when the model is split over a TP group ([`crate::tensor`]).
    pub(crate) tensor: Option<TpPart>,
    /// The expert-parallel part, when the experts are split over the data-parallel ranks
    /// ([`crate::expert`]).
    pub(crate) experts: Option<ExpertPart>,
    /// Under per-step fault tolerance: the step's micro-batches, kept for a retry.
    kept: Option<ft::Kept>,
}

impl Trainer {
    /// Validate `cfg`, initialise the parameters from its seed and build the
    /// data source.
    pub fn new(cfg: TrainConfig) -> Result<Self> {
        Self::build(cfg, None, None, None)
    }

    /// One rank of data-parallel training over `group`: every rank holds the whole model,
    /// trains on its `cfg.batch` rows of each global batch of `cfg.batch x N` rows, and
    /// all-reduces its gradients in buckets of `bucket_bytes` that overlap the backward
    /// ([`crate::ddp`]). Every rank starts from the same seed, so all stay identical.
    pub fn data_parallel(
        cfg: TrainConfig,
        group: ProcessGroup,
        bucket_bytes: usize,
    ) -> Result<Self> {
        Self::build(cfg, Some((group, bucket_bytes)), None, None)
    }

    /// One rank of ZeRO data-parallel training at `stage` ([`crate::zero`]): the same update
    /// as [`Trainer::data_parallel`], with the optimizer state (stage 1), the gradients (2) and
    /// the parameters (3) sharded over `group`. ZeRO-1/2 reduce in buckets of `bucket_bytes`.
    /// With `bf16` the f32 master weights are sharded too ([`Zero::with_bf16`]).
    pub fn zero(
        cfg: TrainConfig,
        group: ProcessGroup,
        stage: Stage,
        bucket_bytes: usize,
    ) -> Result<Self> {
        Self::build(cfg, Some((group, bucket_bytes)), Some(stage), None)
    }

    /// One rank of hybrid-sharded data parallelism (HSDP): ZeRO `stage` over `shard` (one
    /// replica group), the state replicated across the replica groups, `replicas` holding
    /// this rank's counterpart in each ([`Zero::with_replicas`]). The data-parallel ranks are
    /// all `shard x replicas` of them, replica group major: each draws its rows of every
    /// global batch as rank `replica x shard + shard rank` of a plain data-parallel run.
    pub fn hybrid(
        cfg: TrainConfig,
        (shard, replicas): (ProcessGroup, ProcessGroup),
        stage: Stage,
        bucket_bytes: usize,
    ) -> Result<Self> {
        let mut t = Self::zero(cfg, shard, stage, bucket_bytes)?;
        if let Some(z) = t.zero.take() {
            t.zero = Some(Box::new(z.with_replicas(replicas)));
        }
        // The data share of this rank among every replica group's ranks.
        t.reset_source(None, 0)?;
        Ok(t)
    }

    /// The trainer of every layout without pipeline stages: one process, data parallel over
    /// `dp` (buckets of `bucket_bytes` overlapping the backward), ZeRO `stage` over it, and the
    /// model split over the tensor-parallel group `tp` when given ([`crate::tensor`]), with
    /// sequence parallelism when its flag is set.
    pub(crate) fn build(
        cfg: TrainConfig,
        dp: Option<(ProcessGroup, usize)>,
        stage: Option<Stage>,
        tp: Option<(ProcessGroup, bool)>,
    ) -> Result<Self> {
        cfg.validate()?;
        let th = Threads::new(cfg.threads)?;
        let rows = (cfg.batch, cfg.seq_len);
        let tensor = match tp {
            Some((g, sequence)) => Some(TpPart::new(&cfg.model, g, rows, sequence)?),
            None => None,
        };
        let recompute = vec![cfg.recompute; cfg.model.layers];
        let split = tensor.as_ref().map_or((1, false), |t| (t.tp(), t.sequence));
        let model = Model::<f32>::split(&cfg.model, cfg.batch, cfg.seq_len, recompute, split)?;
        check_state_fits(
            model.n_params(),
            stage,
            dp.as_ref().map_or(1, |(g, _)| g.size()),
        )?;
        let mut params = Window::new(model.n_params())?;
        match &tensor {
            None => init_params(&cfg.model, model.layout(), cfg.seed, &mut params),
            Some(t) => {
                // Every rank initialises the whole model from the seed and keeps its part.
                let mut whole = vec![0f32; t.layout.whole.total];
                init_params(&cfg.model, &t.layout.whole, cfg.seed, &mut whole);
                t.layout.shard_params(&whole, &mut params)?;
            }
        }
        // Under ZeRO the master weights are sharded with the moments (`Zero::with_bf16`).
        let bf16 = match cfg.bf16 && stage.is_none() {
            true => {
                let store = Bf16Store::new(params.to_vec());
                store.decode_params(&mut params)?;
                Some(store)
            }
            false => None,
        };
        let decay = model.layout().decay_ranges(cfg.decay_all);
        let (mut sync, mut zero) = (None, None);
        match (dp, stage) {
            (Some((group, bytes)), Some(stage)) => {
                let mut z = Zero::new(group, stage, model.layout(), bytes, &params, &decay);
                if tensor.is_some() {
                    z = z.with_options(crate::tensor::PINNED);
                }
                if cfg.bf16 {
                    z = z.with_bf16(&mut params);
                }
                z.release_params(&mut params);
                zero = Some(Box::new(z));
            }
            (Some((group, bytes)), None) => {
                let mut b = GradBuckets::new(group, model.layout(), bytes);
                if tensor.is_some() {
                    b = b.with_options(crate::tensor::PINNED);
                }
                sync = Some(b)
            }
            (None, _) => {}
        }
        let opt_len = zero.as_ref().map_or(params.len(), |z| z.shard_len());
        let opt = AdamW::new(cfg.adamw, opt_len)?;
        let group = sync
            .as_ref()
            .map(GradBuckets::group)
            .or(zero.as_ref().map(|z| z.group()));
        let source = Source::for_config(&cfg, share(&cfg, group))?;
        let n = cfg.micro_tokens();
        Ok(Self {
            grads: Window::new(params.len())?,
            params,
            opt,
            bf16,
            decay,
            source,
            inputs: vec![0; n],
            targets: vec![0; n],
            step: 0,
            drawn: 0,
            rows_base: 0,
            sync,
            zero,
            tensor,
            experts: None,
            kept: None,
            th,
            model,
            cfg,
        })
    }

    /// One optimizer step on the next batch. A non-finite loss or gradient
    /// norm is an error naming the step; the parameters are left as they
    /// were before the step.
    pub fn step(&mut self) -> Result<StepStats> {
        if self.zero.is_some() {
            return self.zero_step();
        }
        let step = self.step + 1;
        let t0 = Instant::now();
        let mut acc = Accum::new(self.cfg.grad_accum);
        let out = loop {
            let fetched = fetch(&mut self.source, &mut self.inputs, &mut self.targets)?;
            self.drawn += 1;
            if let Some(out) = acc.micro(grad_step!(self), fetched, self.cfg.grad_clip, step)? {
                break out;
            }
        };
        self.update(step, out, acc.data_seconds, t0)
    }

    /// One optimizer step, like [`Trainer::step`], while `stage` runs on a second thread over
    /// the state as it stands at the start of the step, as checkpoint tensors (see
    /// [`crate::checkpoint`]: parameters, or master weights under bf16, and AdamW's moments).
    /// The forward and backward only read that state, so they overlap the staging; the
    /// optimizer, which writes it, first waits for `stage` to return. Returns the step's stats,
    /// what `stage` returned and how long the step waited for it (the checkpoint's foreground
    /// pause).
    pub fn step_with_staging<R: Send>(
        &mut self,
        stage: impl FnOnce(&[(TensorMeta, &[u8])]) -> R + Send,
    ) -> Result<(StepStats, R, Duration)> {
        if let Some(t) = &self.tensor {
            return Err(TrainError::Config {
                field: "checkpoint staging",
                value: format!("tp {}", t.tp()),
                reason: "a tensor-parallel rank saves its own shards: Trainer::save_into".into(),
            });
        }
        if let Some(stage) = self.zero_stage() {
            return Err(TrainError::Config {
                field: "checkpoint staging",
                value: format!("ZeRO-{}", stage.number()),
                reason: "a ZeRO rank's step rewrites the shards it would stage: save with \
                         Checkpointer::save between steps"
                    .into(),
            });
        }
        let step = self.step + 1;
        let t0 = Instant::now();
        let master: &[f32] = match &self.bf16 {
            Some(store) => store.master(),
            None => &self.params,
        };
        let (m, v) = self.opt.moments();
        let views = state_views(self.model.layout(), master, m, v);
        let mut acc = Accum::new(self.cfg.grad_accum);
        let (grads, staged, waited) = std::thread::scope(|s| {
            let staging = s.spawn(move || stage(&views));
            let grads = (|| -> Result<GradOut> {
                loop {
                    let fetched = fetch(&mut self.source, &mut self.inputs, &mut self.targets)?;
                    self.drawn += 1;
                    if let Some(out) =
                        acc.micro(grad_step!(self), fetched, self.cfg.grad_clip, step)?
                    {
                        return Ok(out);
                    }
                }
            })();
            let wait = Instant::now();
            let staged = staging.join();
            (grads, staged, wait.elapsed())
        });
        let staged = staged.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        let stats = self.update(step, grads?, acc.data_seconds, t0)?;
        Ok((stats, staged, waited))
    }

    /// The optimizer half of step `step`: applies the gradients and returns the step's stats.
    fn update(
        &mut self,
        step: u64,
        out: GradOut,
        data_seconds: f64,
        t0: Instant,
    ) -> Result<StepStats> {
        let _p = model::profile::scope("optimizer");
        let lr = self.cfg.schedule.lr_at(self.cfg.lr, self.step);
        match &mut self.bf16 {
            Some(store) => {
                store.store_grads(&self.grads)?;
                store.step(&self.th, &mut self.opt, lr, &self.decay)?;
                store.decode_params(&mut self.params)?;
            }
            None => match &self.experts {
                Some(p) => {
                    let state = (&mut self.params[..], &self.grads[..]);
                    p.step_owned(&self.th, &mut self.opt, state, 0, (lr, &self.decay))?
                }
                None => self
                    .opt
                    .step(&self.th, &mut self.params, &self.grads, lr, &self.decay)?,
            },
        }
        self.step = step;
        Ok(self.stats(step, lr, out, data_seconds, t0))
    }

    /// The stats of step `step`, begun at `t0`, whose gradients gave `out`.
    fn stats(&self, step: u64, lr: f32, out: GradOut, data_seconds: f64, t0: Instant) -> StepStats {
        StepStats {
            step,
            loss: out.loss,
            lr,
            grad_norm: out.norm,
            tokens: self.cfg.tokens_per_step() * self.world(),
            seconds: t0.elapsed().as_secs_f64() - data_seconds,
            data_seconds,
            comm_seconds: out.comm_seconds,
        }
    }

    /// [`Trainer::step`] of a ZeRO rank: micro-batches through the engine, then its update.
    fn zero_step(&mut self) -> Result<StepStats> {
        let step = self.step + 1;
        let t0 = Instant::now();
        let count = self.cfg.grad_accum.max(1);
        let (mut loss_sum, mut data_seconds) = (0.0, 0.0);
        let rows = self.rows_at_step_start();
        let mut groups = BlockGroups::new(self.tensor.as_ref(), self.experts.as_ref());
        let comm: &mut dyn BlockComm<f32> = &mut groups;
        for i in 0..count {
            let draw = ft::Draw {
                kept: &mut self.kept,
                source: &mut self.source,
                inputs: &mut self.inputs,
                targets: &mut self.targets,
                drawn: &mut self.drawn,
            };
            data_seconds += ft::next_micro(draw, i, rows)?;
            let z = self.zero.as_mut().expect("a ZeRO trainer");
            let loss = z.micro(
                &mut self.model,
                &self.th,
                &mut self.params,
                &mut self.grads,
                (&self.inputs, &self.targets),
                (i == 0, i + 1 == count, count),
                comm,
            )?;
            check_finite("loss", step, loss)?;
            loss_sum += loss;
        }
        let z = self.zero.as_mut().expect("a ZeRO trainer");
        let loss = z.mean(loss_sum / count as f64)?;
        let lr = self.cfg.schedule.lr_at(self.cfg.lr, self.step);
        let tp_seconds = groups.seconds();
        let (norm, comm) = z.update(
            &self.th,
            &mut self.params,
            &mut self.grads,
            &mut self.opt,
            (lr, self.cfg.grad_clip),
            step,
            self.tensor.as_ref(),
        )?;
        self.step = step;
        self.step_committed();
        let out = GradOut {
            loss,
            norm,
            comm_seconds: comm.as_secs_f64() + tp_seconds,
        };
        Ok(self.stats(step, lr, out, data_seconds, t0))
    }

    pub(crate) fn source_mut(&mut self) -> &mut Source {
        &mut self.source
    }

    /// Replaces parameters (f32 master weights), optimizer moments and step counters, as a
    /// checkpoint recorded them.
    pub(crate) fn load_state(
        &mut self,
        master: Vec<f32>,
        m: Vec<f32>,
        v: Vec<f32>,
        optimizer_step: u64,
        step: u64,
    ) -> Result<()> {
        if let Some(z) = &mut self.zero {
            let (m, v) = z.load_state(&mut self.params, &master, &m, &v);
            self.opt = AdamW::from_state(self.cfg.adamw, m, v, optimizer_step)?;
            self.step = step;
            return Ok(());
        }
        self.opt = AdamW::from_state(self.cfg.adamw, m, v, optimizer_step)?;
        match &mut self.bf16 {
            Some(store) => {
                *store = Bf16Store::new(master);
                store.decode_params(&mut self.params)?;
            }
            None => self.params.copy_from_slice(&master),
        }
        self.step = step;
        Ok(())
    }

    /// Rows of one global micro-batch.
    fn global_rows(&self) -> u64 {
        (self.cfg.batch * self.world()) as u64
    }

    /// Rebuilds the data source at a checkpoint's position: from the loader's saved state for
    /// token datasets, else by skipping the `rows` rows the run had consumed (on any number of
    /// ranks) in the deterministic stream.
    pub(crate) fn reset_source(
        &mut self,
        loader: Option<&data::LoaderState>,
        rows: u64,
    ) -> Result<()> {
        let c = &self.cfg;
        let share = match self.world() {
            1 => Share::whole(c.batch),
            world => Share {
                batch: c.batch,
                world,
                rank: self.rank(),
            },
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

    /// Under ZeRO-3, all-gathers the whole model into [`Trainer::params`] (every rank must
    /// call it; the pages stay resident until the next step releases them); otherwise the
    /// parameters are already whole and this does nothing.
    pub fn gather_params(&mut self) -> Result<()> {
        match &mut self.zero {
            Some(z) if z.stage() == Stage::Three => z.gather_all(&mut self.params),
            _ => Ok(()),
        }
    }
}

/// This process's share of each global batch.
fn share(cfg: &TrainConfig, group: Option<&ProcessGroup>) -> Share {
    match group {
        Some(g) => Share {
            batch: cfg.batch,
            world: g.size(),
            rank: g.rank(),
        },
        None => Share::whole(cfg.batch),
    }
}

/// Refuses a model whose training state on this rank (weights, gradients and AdamW's moments,
/// as ZeRO `stage` shards them over `world` ranks: [`crate::zero::expected_bytes`]) cannot fit
/// in the memory this machine has available, before any of it is allocated.
fn check_state_fits(n_params: usize, stage: Option<Stage>, world: usize) -> Result<()> {
    let (p, g, o) = crate::zero::expected_bytes(stage, world);
    let need = (p + g + o) * n_params as f64;
    Ok(model::memory::check_fits(
        &format!("the training state of {n_params} parameters (weights, gradients, AdamW moments)"),
        need as u64,
        model::memory::available_bytes(),
        "use fewer layers or a smaller d_model, or shard the state over more ranks (--zero)",
    )?)
}
