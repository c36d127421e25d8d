//! The single-process trainer: forward, backward, clip, AdamW, schedule.
use crate::config::TrainConfig;
use crate::error::Result;
use crate::source::Source;
use model::Threads;
use model::init::init_params;
use model::model::Model;
use model::optim::{AdamW, Bf16Store, check_finite, clip_grad_norm, grad_norm};
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

/// A single-process training run.
pub struct Trainer {
    cfg: TrainConfig,
    th: Threads,
    model: Model<f32>,
    params: Vec<f32>,
    grads: Vec<f32>,
    opt: AdamW,
    bf16: Option<Bf16Store>,
    decay: Vec<Range<usize>>,
    source: Source,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    step: u64,
    /// Batches drawn from `source` (training and evaluation alike): the data cursor of the
    /// built-in corpora.
    drawn: u64,
    /// Data-parallel gradient buckets, when this is one rank of several.
    sync: Option<GradBuckets>,
}

impl Trainer {
    /// Validate `cfg`, initialise the parameters from its seed and build the
    /// data source.
    pub fn new(cfg: TrainConfig) -> Result<Self> {
        Self::build(cfg, None)
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
        Self::build(cfg, Some((group, bucket_bytes)))
    }

    fn build(cfg: TrainConfig, dp: Option<(ProcessGroup, usize)>) -> Result<Self> {
        cfg.validate()?;
        let th = Threads::new(cfg.threads)?;
        let model = Model::<f32>::new(&cfg.model, cfg.batch, cfg.seq_len, cfg.recompute)?;
        let mut params = vec![0f32; model.n_params()];
        init_params(&cfg.model, model.layout(), cfg.seed, &mut params);
        let bf16 = match cfg.bf16 {
            true => {
                let store = Bf16Store::new(params.clone());
                store.decode_params(&mut params)?;
                Some(store)
            }
            false => None,
        };
        let decay = model.layout().decay_ranges(cfg.decay_all);
        let opt = AdamW::new(cfg.adamw, params.len())?;
        let sync = dp.map(|(group, bytes)| GradBuckets::new(group, model.layout(), bytes));
        let source = Source::new(
            &cfg.data,
            cfg.model.vocab,
            cfg.seq_len,
            share(&cfg, sync.as_ref()),
            cfg.seed,
            None,
        )?;
        let n = cfg.micro_tokens();
        Ok(Self {
            grads: vec![0f32; params.len()],
            params,
            opt,
            bf16,
            decay,
            source,
            inputs: vec![0; n],
            targets: vec![0; n],
            step: 0,
            drawn: 0,
            sync,
            th,
            model,
            cfg,
        })
    }

    /// The config.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// The model (layout, dims, logits).
    pub fn model(&self) -> &Model<f32> {
        &self.model
    }

    /// The current parameters (f32; the bf16 values widened under `bf16`).
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// The compute threads.
    pub fn threads(&self) -> &Threads {
        &self.th
    }

    /// The data-parallel process group, when this is one rank of several.
    pub fn group(&self) -> Option<&ProcessGroup> {
        self.sync.as_ref().map(GradBuckets::group)
    }

    /// Data-parallel ranks (1 for one process).
    pub fn world(&self) -> usize {
        self.sync.as_ref().map_or(1, |s| s.group().size())
    }

    /// This process's data-parallel rank (0 for one process).
    pub fn rank(&self) -> usize {
        self.sync.as_ref().map_or(0, |s| s.group().rank())
    }

    /// Steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// The f32 parameters the optimizer updates: the master weights under bf16, else
    /// [`Trainer::params`].
    pub fn master_params(&self) -> &[f32] {
        match &self.bf16 {
            Some(store) => store.master(),
            None => &self.params,
        }
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }

    /// Batches drawn from the data source so far.
    pub fn batches_drawn(&self) -> u64 {
        self.drawn
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
        self.opt = AdamW::from_state(self.cfg.adamw, m, v, optimizer_step)?;
        match &mut self.bf16 {
            Some(store) => {
                *store = Bf16Store::new(master);
                store.decode_params(&mut self.params)?;
            }
            None => self.params = master,
        }
        self.step = step;
        Ok(())
    }

    /// Rebuilds the data source at a checkpoint's position: from the loader's saved state for
    /// token datasets, else by replaying `drawn` batches of the deterministic stream.
    pub(crate) fn reset_source(
        &mut self,
        loader: Option<&data::LoaderState>,
        drawn: u64,
    ) -> Result<()> {
        let c = &self.cfg;
        let share = share(c, self.sync.as_ref());
        self.source = Source::new(&c.data, c.model.vocab, c.seq_len, share, c.seed, loader)?;
        if loader.is_none() {
            for _ in 0..drawn {
                self.source
                    .next_batch(&mut self.inputs, &mut self.targets)?;
            }
        }
        self.drawn = drawn;
        Ok(())
    }

    /// The best achievable loss of the data, when known.
    pub fn entropy_floor(&self) -> Option<f64> {
        self.source.entropy_floor()
    }

    /// Model FLOPs per trained token (6N + 12LTC).
    pub fn flops_per_token(&self) -> f64 {
        let mut c = self.cfg.model.clone();
        c.seq_len = self.cfg.seq_len;
        c.flops_per_token(self.model.n_params())
    }

    /// One optimizer step on the next batch. A non-finite loss or gradient
    /// norm is an error naming the step; the parameters are left as they
    /// were before the step.
    pub fn step(&mut self) -> Result<StepStats> {
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
            None => self
                .opt
                .step(&self.th, &mut self.params, &self.grads, lr, &self.decay)?,
        }
        self.step = step;
        Ok(StepStats {
            step,
            loss: out.loss,
            lr,
            grad_norm: out.norm,
            tokens: self.cfg.tokens_per_step() * self.world(),
            seconds: t0.elapsed().as_secs_f64() - data_seconds,
            data_seconds,
            comm_seconds: out.comm_seconds,
        })
    }

    /// The data loader's metrics, when training on datasets.
    pub fn data_metrics(&self) -> Option<&data::LoaderMetrics> {
        self.source.loader_metrics()
    }

    /// Mean loss over `batches` fresh batches without updating anything.
    pub fn eval_loss(&mut self, batches: usize) -> Result<f64> {
        let mut sum = 0.0;
        for _ in 0..batches {
            self.source
                .next_batch(&mut self.inputs, &mut self.targets)?;
            self.drawn += 1;
            sum += self
                .model
                .forward(&self.th, &self.params, &self.inputs, Some(&self.targets))?
                .unwrap_or(f64::NAN);
        }
        Ok(sum / batches.max(1) as f64)
    }
}

/// This process's share of each global batch.
fn share(cfg: &TrainConfig, sync: Option<&GradBuckets>) -> Share {
    match sync {
        Some(s) => Share {
            batch: cfg.batch,
            world: s.group().size(),
            rank: s.group().rank(),
        },
        None => Share::whole(cfg.batch),
    }
}

/// The [`GradStep`] of a trainer's fields. A macro, not a method: a method would borrow the
/// whole trainer, while the staging thread of `step_with_staging` holds other fields.
macro_rules! grad_step {
    ($t:ident) => {
        GradStep {
            model: &mut $t.model,
            th: &$t.th,
            params: &$t.params,
            inputs: &$t.inputs,
            targets: &$t.targets,
            grads: &mut $t.grads,
            sync: $t.sync.as_mut(),
        }
    };
}
use grad_step;

/// What one step's gradient computation reads and writes.
struct GradStep<'a> {
    model: &'a mut Model<f32>,
    th: &'a Threads,
    params: &'a [f32],
    inputs: &'a [u32],
    targets: &'a [u32],
    grads: &'a mut [f32],
    sync: Option<&'a mut GradBuckets>,
}

/// What it produced.
struct GradOut {
    /// Mean loss over the global batch.
    loss: f64,
    /// Global gradient norm before clipping.
    norm: f64,
    /// Exposed gradient communication, seconds.
    comm_seconds: f64,
}

/// Fills the input and target buffers with the next micro-batch; returns the seconds it took.
fn fetch(source: &mut Source, inputs: &mut [u32], targets: &mut [u32]) -> Result<f64> {
    let start = Instant::now();
    source.next_batch(inputs, targets)?;
    Ok(start.elapsed().as_secs_f64())
}

/// Gradient accumulation over the micro-batches of one optimizer step.
struct Accum {
    count: usize,
    done: usize,
    loss_sum: f64,
    data_seconds: f64,
}

impl Accum {
    fn new(count: usize) -> Accum {
        Accum {
            count: count.max(1),
            done: 0,
            loss_sum: 0.0,
            data_seconds: 0.0,
        }
    }

    /// Runs the next micro-batch through `g` (whose batch took `fetched` seconds to fetch);
    /// after the last, returns the step's gradient result.
    fn micro(
        &mut self,
        g: GradStep<'_>,
        fetched: f64,
        clip: Option<f64>,
        step: u64,
    ) -> Result<Option<GradOut>> {
        self.data_seconds += fetched;
        let (first, last) = (self.done == 0, self.done + 1 == self.count);
        let loss = g.run(first, last, self.count, clip, step, &mut self.loss_sum)?;
        self.done += 1;
        Ok(loss)
    }
}

impl GradStep<'_> {
    /// Forward and backward of one micro-batch, the gradients summed into `grads` (zeroed by
    /// the `first`); reads `params` only. The `last` of `count` micro-batches also all-reduces
    /// the gradient buckets as the backward completes them (data parallel), scales the sum to
    /// the mean over micro-batches and ranks, and takes (and clips to `clip`) the norm; it
    /// returns the result, with the loss averaged over the micro-batches (summed in
    /// `loss_sum`) and ranks. A non-finite loss or norm is an error naming `step`.
    fn run(
        self,
        first: bool,
        last: bool,
        count: usize,
        clip: Option<f64>,
        step: u64,
        loss_sum: &mut f64,
    ) -> Result<Option<GradOut>> {
        let GradStep {
            model,
            th,
            params,
            inputs,
            targets,
            grads,
            sync,
        } = self;
        if first {
            grads.fill(0.0);
        }
        let loss = model
            .forward(th, params, inputs, Some(targets))?
            .unwrap_or(f64::NAN);
        check_finite("loss", step, loss)?;
        *loss_sum += loss;
        let mut comm_seconds = 0.0;
        let mut loss = *loss_sum / count as f64;
        let scale = 1.0 / count as f32;
        // Data parallel: only the last micro-batch's backward communicates.
        let synced = match sync {
            Some(s) if last => {
                model.backward_hooked(th, params, grads, &mut |range, g| s.ready(range, g))?;
                comm_seconds = s.finish(grads, scale)?.as_secs_f64();
                loss = s.mean(loss)?;
                true
            }
            _ => {
                model.backward(th, params, grads)?;
                false
            }
        };
        if !last {
            return Ok(None);
        }
        if !synced && count > 1 {
            grads.iter_mut().for_each(|g| *g *= scale);
        }
        let _p = model::profile::scope("grad_norm");
        let norm = match clip {
            Some(max) => clip_grad_norm(th, grads, max),
            None => grad_norm(th, grads),
        };
        check_finite("gradient norm", step, norm)?;
        Ok(Some(GradOut {
            loss,
            norm,
            comm_seconds,
        }))
    }
}
