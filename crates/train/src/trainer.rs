//! The single-process trainer: forward, backward, clip, AdamW, schedule.
use crate::config::TrainConfig;
use crate::error::Result;
use crate::source::Source;
use model::Threads;
use model::init::init_params;
use model::model::Model;
use model::optim::{AdamW, Bf16Store, check_finite, clip_grad_norm, grad_norm};
use std::ops::Range;
use std::time::Instant;

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
}

impl Trainer {
    /// Validate `cfg`, initialise the parameters from its seed and build the
    /// data source.
    pub fn new(cfg: TrainConfig) -> Result<Self> {
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
        let source = Source::new(&cfg.data, cfg.model.vocab, cfg.seq_len, cfg.batch, cfg.seed)?;
        let n = cfg.tokens_per_step();
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

    /// Steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
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
        let fetch = Instant::now();
        self.source
            .next_batch(self.cfg.batch, &mut self.inputs, &mut self.targets)?;
        let data_seconds = fetch.elapsed().as_secs_f64();
        let t0 = Instant::now();
        self.grads.fill(0.0);
        let loss = self
            .model
            .forward(&self.th, &self.params, &self.inputs, Some(&self.targets))?
            .unwrap_or(f64::NAN);
        check_finite("loss", step, loss)?;
        self.model
            .backward(&self.th, &self.params, &mut self.grads)?;
        let p = model::profile::scope("grad_norm");
        let norm = match self.cfg.grad_clip {
            Some(max) => clip_grad_norm(&self.th, &mut self.grads, max),
            None => grad_norm(&self.th, &self.grads),
        };
        drop(p);
        check_finite("gradient norm", step, norm)?;
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
            loss,
            lr,
            grad_norm: norm,
            tokens: self.cfg.tokens_per_step(),
            seconds: t0.elapsed().as_secs_f64(),
            data_seconds,
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
                .next_batch(self.cfg.batch, &mut self.inputs, &mut self.targets)?;
            sum += self
                .model
                .forward(&self.th, &self.params, &self.inputs, Some(&self.targets))?
                .unwrap_or(f64::NAN);
        }
        Ok(sum / batches.max(1) as f64)
    }
}
