//! The pipeline-parallel training engine: one stage of `p`, executing its [`Schedule`] list
//! literally (file 000 Algorithm 1; "流水线并行", lines 2343-2411).
//!
//! - Partition: the `L` blocks are cut into `K = p * v` chunks of equal block counts (chunk
//!   `k` holds blocks `k L / K .. (k + 1) L / K`, so every chunk has at least one block; `K > L`
//!   is refused); the embeddings go with chunk 0 and the final norm and head with chunk `K - 1`.
//!   Stage `s` holds chunks `c p + s` for `c` in `0..v` (Algorithm 1 step 1).
//! - State: every stage keeps the whole flat parameter and gradient buffers (so the model's
//!   unit kernels index them as in one process) but writes and updates only its own chunks'
//!   ranges; AdamW moments exist only for those ranges (one optimizer per chunk). With tied
//!   embeddings the last stage also holds a copy of `wte`, which its head reads: the first and
//!   last stages all-reduce `wte`'s gradient (Megatron's embedding group) and both apply the
//!   identical update. The untouched ranges of the full buffers are the cost of this slice.
//! - Activations: one [`Model`] per micro-batch in flight on the stage (the schedule's
//!   [`Schedule::max_in_flight`]), reused as micro-batches retire; each is sized for the whole
//!   model (only its chunks' regions are written).
//! - Messages: the residual stream (N, C) f32 forward and its gradient (N, C) back, with
//!   [`ProcessGroup::send`]/[`ProcessGroup::recv`] in the list's order (blocking, under the
//!   group's op timeout). Each message is `4 B T C` bytes (000 F42 counts `2 B T C` for
//!   BF16 boundaries; this slice sends f32).
//! - Step: gradients of the `m = cfg.grad_accum` micro-batches are summed, scaled by `1/m`,
//!   clipped by the global norm (per-block sums of squares, all-reduced; the same blocks and
//!   order as one process's norm, so the norm is bit-identical) and AdamW is applied
//!   with the schedule's learning rate: the update [`crate::Trainer`] makes with
//!   `grad_accum = m` on the same batches (Algorithm 1 step 8: one optimizer step after all
//!   `m` backwards). Every stage draws the same batches from its own copy of the data source:
//!   the first stage reads the tokens, the last the targets.
use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use comm::ReduceOp;
use comm::group::ProcessGroup;
use model::Threads;
use model::init::init_params;
use model::layout::{Layout, Unit};
use model::model::Model;
use model::optim::clip::NORM_BLOCK;
use model::optim::{AdamW, check_finite, clip_coef, grad_sum_sq, scale_grads};

use super::{Action, Schedule, ScheduleKind};
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::source::{Share, Source};

/// What one pipeline step did, as seen by one stage.
#[derive(Clone, Copy, Debug)]
pub struct PipeStats {
    /// Steps completed, counting this one (1-based).
    pub step: u64,
    /// Mean cross-entropy over the `m` micro-batches (computed by the last stage and
    /// broadcast, so every stage reports the same value).
    pub loss: f64,
    /// Learning rate used.
    pub lr: f32,
    /// Global gradient norm before clipping (all stages' sums of squares).
    pub grad_norm: f64,
    /// Wall time of the step, seconds.
    pub seconds: f64,
    /// Time spent in forwards and backwards, seconds.
    pub compute_seconds: f64,
    /// Time spent blocked in point-to-point sends and receives, seconds: the stage's measured
    /// bubble plus transfer time (000 F41 predicts (p-1)/(m+p-1) of the step for GPipe/1F1B).
    pub wait_seconds: f64,
}

impl PipeStats {
    /// `wait / (wait + compute)`: the fraction of the schedule this stage spent idle.
    pub fn bubble(&self) -> f64 {
        let t = self.wait_seconds + self.compute_seconds;
        if t > 0.0 { self.wait_seconds / t } else { 0.0 }
    }
}

/// One local chunk: model chunk `index`, its units in forward order and its parameter range.
#[derive(Clone, Debug)]
struct Chunk {
    units: Vec<Unit>,
    range: Range<usize>,
}

/// The model chunks' units for `layers` blocks cut into `k` chunks of equal block counts.
fn chunk_units(layers: usize, k: usize, index: usize) -> Vec<Unit> {
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

/// One stage of a pipeline-parallel run over a group of `p` ranks (rank `s` = stage `s`).
pub struct PipelineStage {
    cfg: TrainConfig,
    group: ProcessGroup,
    schedule: Schedule,
    th: Threads,
    layout: Layout,
    /// The whole flat parameter buffer; only the update ranges are kept current.
    params: Vec<f32>,
    /// The whole flat gradient buffer; only this stage's ranges are written.
    grads: Vec<f32>,
    /// Local chunks, `0..v`.
    chunks: Vec<Chunk>,
    /// Ranges this stage updates, each with its optimizer and decay ranges (relative).
    updates: Vec<(Range<usize>, AdamW, Vec<Range<usize>>)>,
    /// Ranges whose gradient norm this stage counts (each element on exactly one stage).
    norm_ranges: Vec<Range<usize>>,
    /// Where model chunks start in the flat buffer (all stages' chunks, the first excluded).
    cuts: Vec<usize>,
    /// `wte`'s range, when tied embeddings span the first and last stages.
    tied: Option<Range<usize>>,
    /// One model per micro-batch in flight.
    slots: Vec<Model<f32>>,
    source: Source,
    /// Per micro-batch inputs and targets (m, N).
    inputs: Vec<Vec<u32>>,
    targets: Vec<Vec<u32>>,
    step: u64,
}

fn config_err(field: &'static str, value: impl ToString, reason: String) -> TrainError {
    TrainError::Config {
        field,
        value: value.to_string(),
        reason,
    }
}

fn intersect(a: &Range<usize>, b: &Range<usize>) -> Option<Range<usize>> {
    let r = a.start.max(b.start)..a.end.min(b.end);
    (r.start < r.end).then_some(r)
}

impl PipelineStage {
    /// Stage `group.rank()` of a `stages`-stage pipeline running `kind` over
    /// `m = cfg.grad_accum` micro-batches of `cfg.batch` sequences per step. Every stage
    /// initialises the whole model from `cfg.seed` (so the chunks start as one process's) and
    /// builds the same data source.
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
        cfg.validate()?;
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
        if cfg.bf16 {
            return Err(config_err(
                "bf16",
                "true",
                "pipeline stages keep f32 state; bf16 with pipelines is not built yet".into(),
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
        let th = Threads::new(cfg.threads)?;
        let slots_needed = microbatches_in_flight(schedule.actions(s).unwrap_or(&[]));
        let mut slots = Vec::with_capacity(slots_needed);
        for _ in 0..slots_needed {
            slots.push(Model::<f32>::new(
                &cfg.model,
                cfg.batch,
                cfg.seq_len,
                cfg.recompute,
            )?);
        }
        let layout = slots[0].layout().clone();
        let mut params = vec![0f32; layout.total];
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
        let norm_ranges: Vec<Range<usize>> = chunks.iter().map(|c| c.range.clone()).collect();
        let mut update_ranges = norm_ranges.clone();
        if let Some(wte) = &tied
            && s + 1 == stages
        {
            update_ranges.push(wte.clone());
        }
        let decay_all = layout.decay_ranges(cfg.decay_all);
        let mut updates = Vec::with_capacity(update_ranges.len());
        for r in update_ranges {
            let decay = decay_all
                .iter()
                .filter_map(|d| intersect(d, &r))
                .map(|d| d.start - r.start..d.end - r.start)
                .collect();
            updates.push((r.clone(), AdamW::new(cfg.adamw, r.len())?, decay));
        }
        let source = Source::for_config(&cfg, Share::whole(cfg.batch))?;
        let n = cfg.micro_tokens();
        Ok(Self {
            grads: vec![0f32; layout.total],
            params,
            layout,
            chunks,
            updates,
            norm_ranges,
            cuts,
            tied,
            slots,
            source,
            inputs: vec![vec![0; n]; m],
            targets: vec![vec![0; n]; m],
            step: 0,
            schedule,
            th,
            group,
            cfg,
        })
    }

    /// The schedule this stage runs its part of.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The parameter layout (whole model).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// This stage's index (its rank in the pipeline group).
    pub fn stage(&self) -> usize {
        self.group.rank()
    }

    /// Steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// The units of each local chunk `c` (model chunk `c p + s`), in forward order.
    pub fn chunk_units(&self) -> Vec<Vec<Unit>> {
        self.chunks.iter().map(|c| c.units.clone()).collect()
    }

    /// The parameter ranges this stage owns (one per local chunk) in the flat buffer.
    pub fn owned_ranges(&self) -> Vec<Range<usize>> {
        self.norm_ranges.clone()
    }

    /// This stage's flat parameter buffer (whole-model length; current only on
    /// [`PipelineStage::owned_ranges`], and on `wte` for the last stage when tied).
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// The whole model's current parameters, assembled from every stage's owned ranges (a
    /// collective: every stage must call it). Exact: each element is summed with zeros.
    pub fn gather_params(&self) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.params.len()];
        for r in &self.norm_ranges {
            out[r.clone()].copy_from_slice(&self.params[r.clone()]);
        }
        self.group.all_reduce(&mut out, ReduceOp::Sum)?;
        Ok(out)
    }

    fn out_of_order(&self, action: Action, reason: &str) -> TrainError {
        config_err(
            "pipeline_schedule",
            action,
            format!("stage {}: {reason}", self.stage()),
        )
    }

    /// One optimizer step over the next `m` micro-batches: executes this stage's action list,
    /// then the clipped AdamW update of its ranges. Every stage must call it. A non-finite loss
    /// or gradient norm is an error naming the step on every stage, with the parameters left
    /// as they were.
    pub fn step(&mut self) -> Result<PipeStats> {
        let t0 = Instant::now();
        let step = self.step + 1;
        let m = self.schedule.microbatches();
        for mb in 0..m {
            self.source
                .next_batch(&mut self.inputs[mb], &mut self.targets[mb])?;
        }
        for r in self.norm_ranges.iter().chain(self.tied.iter()) {
            self.grads[r.clone()].fill(0.0);
        }
        let nc = self.cfg.micro_tokens() * self.cfg.model.d_model;
        let mut losses = vec![f64::NAN; m];
        let (mut compute, mut wait) = (0.0f64, 0.0f64);
        // Micro-batch -> slot, free slots, received tensors and tensors waiting to be sent.
        let mut slot_of: HashMap<usize, usize> = HashMap::new();
        let mut free: Vec<usize> = (0..self.slots.len()).rev().collect();
        let mut inbox: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
        let mut outbox: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
        let mut pool: Vec<Vec<f32>> = Vec::new();
        let actions = self.schedule.actions(self.stage()).unwrap_or(&[]).to_vec();
        for action in actions {
            match action {
                Action::RecvActivation { mb, chunk, from }
                | Action::RecvGrad { mb, chunk, from } => {
                    let mut buf = pool.pop().unwrap_or_else(|| vec![0f32; nc]);
                    let t = Instant::now();
                    self.group.recv(&mut buf, from)?;
                    wait += t.elapsed().as_secs_f64();
                    let key = (mb, chunk);
                    if inbox.insert(key, buf).is_some() {
                        return Err(
                            self.out_of_order(action, "a second receive for the same chunk")
                        );
                    }
                }
                Action::SendActivation { mb, chunk, to } | Action::SendGrad { mb, chunk, to } => {
                    let Some(buf) = outbox.remove(&(mb, chunk)) else {
                        return Err(self.out_of_order(action, "nothing computed to send"));
                    };
                    let t = Instant::now();
                    self.group.send(&buf, to)?;
                    wait += t.elapsed().as_secs_f64();
                    pool.push(buf);
                }
                Action::Forward { mb, chunk } => {
                    if mb >= m || chunk >= self.chunks.len() {
                        return Err(self.out_of_order(action, "micro-batch or chunk out of range"));
                    }
                    let slot = match slot_of.get(&mb) {
                        Some(&s) => s,
                        None => {
                            let Some(s) = free.pop() else {
                                return Err(self.out_of_order(
                                    action,
                                    "more micro-batches in flight than slots",
                                ));
                            };
                            slot_of.insert(mb, s);
                            s
                        }
                    };
                    let t = Instant::now();
                    let input = inbox.remove(&(mb, chunk));
                    let units = &self.chunks[chunk].units;
                    let (first, last) = (units[0], *units.last().expect("non-empty chunk"));
                    if first != Unit::Embed && input.is_none() {
                        return Err(self.out_of_order(action, "its input was not received"));
                    }
                    let units = &self.chunks[chunk].units;
                    let targets = (last == Unit::Head).then(|| &self.targets[mb][..]);
                    let model = &mut self.slots[slot];
                    match &input {
                        None => model.begin_at(first, None, Some(&self.inputs[mb]), targets)?,
                        Some(x) => model.begin_at(first, Some(x), None, targets)?,
                    }
                    for &u in units {
                        model.forward_unit(&self.th, &self.params, u)?;
                    }
                    if last == Unit::Head {
                        losses[mb] = model.loss().unwrap_or(f64::NAN);
                    } else {
                        let mut out = pool.pop().unwrap_or_else(|| vec![0f32; nc]);
                        out.copy_from_slice(model.unit_output(last)?);
                        outbox.insert((mb, chunk), out);
                    }
                    if let Some(x) = input {
                        pool.push(x);
                    }
                    compute += t.elapsed().as_secs_f64();
                }
                Action::Backward { mb, chunk } => {
                    let Some(&slot) = slot_of.get(&mb) else {
                        return Err(self.out_of_order(action, "no forward of this micro-batch"));
                    };
                    if chunk >= self.chunks.len() {
                        return Err(self.out_of_order(action, "chunk out of range"));
                    }
                    let t = Instant::now();
                    let dout = inbox.remove(&(mb, chunk));
                    let units = &self.chunks[chunk].units;
                    let (first, last) = (units[0], *units.last().expect("non-empty chunk"));
                    if last != Unit::Head && dout.is_none() {
                        return Err(
                            self.out_of_order(action, "its output gradient was not received")
                        );
                    }
                    let units = &self.chunks[chunk].units;
                    let model = &mut self.slots[slot];
                    model.begin_backward_at(last, dout.as_deref())?;
                    for &u in units.iter().rev() {
                        model.backward_unit(&self.th, &self.params, &mut self.grads, u)?;
                    }
                    if first != Unit::Embed {
                        let mut out = pool.pop().unwrap_or_else(|| vec![0f32; nc]);
                        out.copy_from_slice(model.input_grad());
                        outbox.insert((mb, chunk), out);
                    }
                    if let Some(g) = dout {
                        pool.push(g);
                    }
                    if chunk == 0 {
                        slot_of.remove(&mb);
                        free.push(slot);
                    }
                    compute += t.elapsed().as_secs_f64();
                }
                Action::OptimizerStep => {}
            }
        }
        // The loss: summed in micro-batch order on the last stage (as Trainer does), then
        // broadcast so every stage checks the same value.
        let last_stage = self.schedule.stages() - 1;
        let mut loss = [0f64];
        if self.stage() == last_stage {
            loss[0] = losses.iter().fold(0.0, |a, &l| a + l) / m as f64;
        }
        self.group.broadcast(&mut loss, last_stage)?;
        let loss = loss[0];
        check_finite("loss", step, loss)?;
        let (norm, lr) = self.update(step, m)?;
        self.step = step;
        let seconds = t0.elapsed().as_secs_f64();
        Ok(PipeStats {
            step,
            loss,
            lr,
            grad_norm: norm,
            seconds,
            compute_seconds: compute,
            wait_seconds: wait,
        })
    }

    /// The squared global gradient norm, bit-identical to [`grad_sum_sq`] over one process's
    /// whole buffer: the same [`NORM_BLOCK`] blocks are summed in the same order. A block
    /// inside one stage's ranges is summed by that stage; a block a chunk boundary cuts is
    /// assembled by an all-reduce of its pieces (each element from one stage, the rest zeros,
    /// so exactly) and summed by stage 0; the block sums are all-reduced the same way.
    fn global_sum_sq(&self) -> Result<f64> {
        let total = self.grads.len();
        let blocks = total.div_ceil(NORM_BLOCK);
        let block = |b: usize| b * NORM_BLOCK..((b + 1) * NORM_BLOCK).min(total);
        let mut shared: Vec<usize> = self
            .cuts
            .iter()
            .filter(|&&c| !c.is_multiple_of(NORM_BLOCK))
            .map(|&c| c / NORM_BLOCK)
            .collect();
        shared.dedup();
        let mut partial = vec![0f64; blocks];
        if !shared.is_empty() {
            let mut buf = vec![0f32; shared.len() * NORM_BLOCK];
            for (j, &b) in shared.iter().enumerate() {
                let br = block(b);
                for r in &self.norm_ranges {
                    if let Some(x) = intersect(r, &br) {
                        let at = j * NORM_BLOCK + x.start - br.start;
                        buf[at..at + x.len()].copy_from_slice(&self.grads[x]);
                    }
                }
            }
            self.group.all_reduce(&mut buf, ReduceOp::Sum)?;
            if self.stage() == 0 {
                for (j, &b) in shared.iter().enumerate() {
                    let at = j * NORM_BLOCK;
                    partial[b] = grad_sum_sq(&self.th, &buf[at..at + block(b).len()]);
                }
            }
        }
        for r in &self.norm_ranges {
            let first = r.start / NORM_BLOCK;
            let mine = &mut partial[first..r.end.div_ceil(NORM_BLOCK)];
            for (b, p) in (first..).zip(mine) {
                if shared.binary_search(&b).is_err() {
                    *p = grad_sum_sq(&self.th, &self.grads[block(b)]);
                }
            }
        }
        self.group.all_reduce(&mut partial, ReduceOp::Sum)?;
        Ok(partial.iter().sum::<f64>())
    }

    /// Tied-embedding reduction, 1/m scaling, global-norm clipping and AdamW on this stage's
    /// ranges; returns the norm before clipping and the learning rate.
    fn update(&mut self, step: u64, m: usize) -> Result<(f64, f32)> {
        if let Some(wte) = &self.tied {
            // Middle stages contribute zeros, so the sum is the first and last stages' exactly.
            self.group
                .all_reduce(&mut self.grads[wte.clone()], ReduceOp::Sum)?;
        }
        let scale = 1.0 / m as f32;
        if m > 1 {
            for (r, _, _) in &self.updates {
                scale_grads(&self.th, &mut self.grads[r.clone()], scale);
            }
        }
        let norm = self.global_sum_sq()?.sqrt();
        check_finite("gradient norm", step, norm)?;
        if let Some(c) = self.cfg.grad_clip.and_then(|max| clip_coef(norm, max)) {
            for (r, _, _) in &self.updates {
                scale_grads(&self.th, &mut self.grads[r.clone()], c);
            }
        }
        let lr = self.cfg.schedule.lr_at(self.cfg.lr, self.step);
        for (r, opt, decay) in &mut self.updates {
            opt.step(
                &self.th,
                &mut self.params[r.clone()],
                &self.grads[r.clone()],
                lr,
                &decay[..],
            )?;
        }
        Ok((norm, lr))
    }
}
