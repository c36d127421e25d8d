//! The pipeline-parallel training engine: one stage of `p`, executing its [`Schedule`] list
//! literally (file 000 Algorithm 1; "流水线并行", lines 2343-2411).
//!
//! - Partition: the `L` blocks are cut into `K = p * v` chunks of equal block counts (chunk
//!   `k` holds blocks `k L / K .. (k + 1) L / K`, so every chunk has at least one block; `K > L`
//!   is refused); the embeddings go with chunk 0 and the final norm and head with chunk `K - 1`.
//!   Stage `s` holds chunks `c p + s` for `c` in `0..v` (Algorithm 1 step 1).
//! - State: the parameters and gradients are whole-model flat buffers ([`Window`]s: anonymous
//!   mappings), so the model's unit kernels index them as in one process, but a stage holds
//!   only its own chunks' ranges resident: after initialising the whole model from the seed it
//!   hands every other page back to the kernel, and nothing writes those ranges again (the
//!   gradients are zeroed, reduced and scaled on the owned ranges only). AdamW moments exist
//!   only for those ranges (one optimizer per chunk). With tied embeddings the last stage also
//!   holds a copy of `wte`, which its head reads: the first and last stages all-reduce `wte`'s
//!   gradient (Megatron's embedding group; middle stages lend a transient zero buffer) and both
//!   apply the identical update. [`PipelineStage::state_memory`] measures what stays resident.
//! - Activations: one [`Model`](model::model::Model) per micro-batch in flight on the stage
//!   (the schedule's [`Schedule::max_in_flight`]), reused as micro-batches retire; each is
//!   sized for the whole model (only its chunks' regions are written).
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
//!   the first stage reads the tokens, the last the targets. The update is in `pipeline::update`.
//! - Tensor parallelism (PP x TP x DP, 000 "混合并行"; "Megatron 风格的张量并行"): on a mesh
//!   with `tp > 1` ([`PipelineStage::on_mesh`]) every block of a stage runs on this TP rank's
//!   shard, the embeddings and head replicated over the stage's TP group, the residual
//!   exchanged whole with the same-TP-index rank of the neighbouring stages; each slot's units
//!   run in `pipeline::tensor_stage`, so this executor is the same for every layout.
//! - Data parallelism (DP x PP, 000 §2.20; "3D 训练循环"): with a data-parallel group
//!   ([`PipelineStage::with_data_parallel`], [`PipelineStage::on_mesh`]) each replica of the
//!   pipeline draws its own `cfg.batch` rows of every global batch, and the gradients are summed
//!   over the replicas before the norm; the step is a data-parallel `Trainer`'s.
use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use comm::ReduceOp;
use comm::group::ProcessGroup;
use model::Threads;
use model::layout::{Layout, Unit};
use model::optim::check_finite;

use super::build::{Chunk, config_err};
use super::tensor_stage::{Run, Slot, TensorPart, unit_range};
use super::update::Update;
use super::{Action, Schedule};
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::source::Source;
use crate::trainer::StateMemory;
use crate::zero::{Stage, Window};

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

/// One stage of a pipeline-parallel run over a group of `p` ranks (rank `s` = stage `s`).
pub struct PipelineStage {
    pub(super) cfg: TrainConfig,
    /// The pipeline: group rank `s` runs stage `s`.
    pub(super) group: ProcessGroup,
    /// The data-parallel group of this stage's replicas (same stage, other pipelines).
    pub(super) dp: Option<ProcessGroup>,
    pub(super) schedule: Schedule,
    pub(super) th: Threads,
    pub(super) layout: Layout,
    /// The whole flat parameter buffer; only the update ranges are resident and current (the
    /// rest was handed back after initialisation and reads as zeros).
    pub(super) params: Window,
    /// The whole flat gradient buffer; only the update ranges are ever written.
    pub(super) grads: Window,
    /// Local chunks, `0..v`.
    pub(super) chunks: Vec<Chunk>,
    /// Ranges this stage updates, each with its (possibly ZeRO-1 sharded) optimizer.
    pub(super) updates: Vec<Update>,
    /// Whether the optimizer state is sharded over the data-parallel group (ZeRO-1).
    pub(super) zero: bool,
    /// The ranges this stage owns: its chunks' ranges, whose gradient norm it counts (each
    /// element on exactly one stage); with tensor parallelism its units' ranges on this TP rank
    /// (the norm then counts [`TensorPart`]'s ranges).
    pub(super) norm_ranges: Vec<Range<usize>>,
    /// Where model chunks start in the flat buffer (all stages' chunks, the first excluded).
    pub(super) cuts: Vec<usize>,
    /// `wte`'s range, when tied embeddings span the first and last stages.
    pub(super) tied: Option<Range<usize>>,
    /// One model (and, with tensor parallelism, the local chunks' blocks on this rank's
    /// shards) per micro-batch in flight.
    pub(super) slots: Vec<Slot>,
    /// The stage's tensor-parallel group and shard plan, when its blocks are split
    /// (`pipeline::tensor_stage`; 000 "混合并行").
    pub(super) tensor: Option<TensorPart>,
    /// The experts split over the data-parallel replicas (`pipeline::experts`), when they are.
    pub(super) experts: Option<crate::expert::ExpertPart>,
    /// The data-parallel reduction bucketed by unit and launched as the last micro-batch's
    /// backward finishes each unit, overlapping the rest of the backward (one-chunk schedules
    /// with replicas; [`crate::ddp::GradBuckets::over`]), and the ranges it leaves to the
    /// update (a tied `wte`, summed over the pipeline first).
    pub(super) buckets: Option<(crate::ddp::GradBuckets, Vec<Range<usize>>)>,
    /// This replica's share of the data stream (the same batches on every stage).
    pub(super) source: Source,
    /// Per micro-batch inputs and targets (m, N).
    pub(super) inputs: Vec<Vec<u32>>,
    pub(super) targets: Vec<Vec<u32>>,
    /// Steps completed.
    pub(super) step: u64,
    /// Micro-batches drawn from `source` since it was (re)built (`m` per step).
    pub(super) drawn: u64,
    /// Rows of the global stream consumed before `source` was last rebuilt that are not a
    /// whole number of this run's global micro-batches (a resume from another layout).
    pub(super) rows_base: u64,
}

impl PipelineStage {
    /// The training config.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// The data loader's metrics (stall, batch build latency), when the run reads a token
    /// dataset.
    pub fn data_metrics(&self) -> Option<&data::LoaderMetrics> {
        self.source.loader_metrics()
    }

    /// The schedule this stage runs its part of.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The parameter layout (whole model).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The routing metrics of this stage's blocks from the last forward of its first slot
    /// (empty for a dense model).
    pub fn moe_stats(&self) -> Vec<model::moe::MoeStats> {
        self.slots.first().map_or_else(Vec::new, |s| s.moe_stats())
    }

    /// Data-parallel replicas of the pipeline (1 without a data-parallel group).
    pub fn replicas(&self) -> usize {
        self.dp.as_ref().map_or(1, ProcessGroup::size)
    }

    /// This stage's replica (its rank in the data-parallel group; 0 without one).
    pub fn replica(&self) -> usize {
        self.dp.as_ref().map_or(0, ProcessGroup::rank)
    }

    /// The ZeRO stage over the data-parallel group (`None`: every replica holds the whole
    /// optimizer state of its ranges).
    pub fn zero_stage(&self) -> Option<Stage> {
        self.zero.then_some(Stage::One)
    }

    /// AdamW moment elements this stage keeps per moment (its ranges' lengths, divided over
    /// the replicas under ZeRO-1).
    pub fn optimizer_len(&self) -> usize {
        let others = |s: &Range<usize>| self.experts.as_ref().map_or(0, |p| p.others_len(s));
        self.updates
            .iter()
            .map(|u| u.part.shard.len() - others(&u.part.shard))
            .sum()
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

    /// The parameter ranges this stage owns in the flat buffer: one per local chunk; with
    /// tensor parallelism, the embeddings and head whole and each block's shard (at the start
    /// of the block's range), adjacent ones merged.
    pub fn owned_ranges(&self) -> Vec<Range<usize>> {
        self.norm_ranges.clone()
    }

    /// This stage's flat parameter buffer (whole-model length; current only on
    /// [`PipelineStage::owned_ranges`], and on `wte` for the last stage when tied; zeros
    /// elsewhere).
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// Micro-batches drawn from the data source since it was last (re)built (`m` per step).
    pub fn batches_drawn(&self) -> u64 {
        self.drawn
    }

    /// Rows of the data stream consumed so far by all replicas together (the global row
    /// cursor, as [`crate::Trainer::rows_drawn`]): `m x cfg.batch x replicas` per step.
    pub fn rows_drawn(&self) -> u64 {
        self.rows_base + self.drawn * self.global_rows()
    }

    /// Rows of one global micro-batch: every replica's `cfg.batch`.
    pub(super) fn global_rows(&self) -> u64 {
        (self.cfg.batch * self.replicas()) as u64
    }

    /// Resident bytes of this stage's training state, measured as [`crate::Trainer`] measures
    /// it: `params` and `grads` count the resident pages of the whole-model buffers (`mincore`:
    /// the owned ranges, plus at most a partial page at each end of a range), `optimizer` the
    /// AdamW moments this stage holds (both moments of its ranges, or of its ZeRO-1 shards).
    /// `comm_buffers` is 0: the activation messages are pooled within a step and freed after it.
    /// Activations (one [`Model`](model::model::Model) arena per micro-batch in flight) are
    /// not state and not counted.
    pub fn state_memory(&self) -> StateMemory {
        // Under bf16 each range's master weights and bf16 parameters and gradients too.
        let bf16: usize = self
            .updates
            .iter()
            .filter_map(|u| u.bf16.as_ref())
            .map(|b| b.param_bytes() + b.grad_bytes() + b.master_bytes())
            .sum();
        StateMemory {
            params: self.params.resident_bytes() + bf16,
            grads: self.grads.resident_bytes(),
            optimizer: 2 * 4 * self.optimizer_len(),
            comm_buffers: 0,
        }
    }

    /// The whole model's current parameters, assembled from every stage's owned ranges (a
    /// collective: every stage must call it; with tensor parallelism every rank of the stage's
    /// TP group too, the shards unsharded). Exact: each element is summed with zeros. The
    /// result is a transient whole-model copy on every stage.
    pub fn gather_params(&self) -> Result<Vec<f32>> {
        if let Some(t) = &self.tensor {
            return self.gather_tensor(t);
        }
        let mut out = vec![0f32; self.params.len()];
        for r in &self.norm_ranges {
            out[r.clone()].copy_from_slice(&self.params[r.clone()]);
        }
        self.group.all_reduce(&mut out, ReduceOp::Sum)?;
        // Each expert from its owner among the replicas (the others hold zeros there).
        if let Some(p) = &self.experts {
            p.complete(&mut out, &p.all)?;
        }
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
        self.drawn += m as u64;
        // The owned ranges only (a middle stage's tied `wte` is not one of them).
        for u in &self.updates {
            self.grads[u.part.range.clone()].fill(0.0);
        }
        // A message is the residual stream (N, C), or under sequence parallelism this TP
        // rank's rows of it.
        let nc = self.cfg.micro_tokens() * self.cfg.model.d_model
            / self
                .tensor
                .as_ref()
                .filter(|t| t.sequence)
                .map_or(1, |t| t.group.size());
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
                    let run = Run {
                        th: &self.th,
                        params: &self.params,
                    };
                    let model = &mut self.slots[slot];
                    let tokens = &self.inputs[mb];
                    model.forward(&run, units, input.as_deref(), tokens, targets)?;
                    if last == Unit::Head {
                        losses[mb] = model.loss().unwrap_or(f64::NAN);
                    } else {
                        let mut out = pool.pop().unwrap_or_else(|| vec![0f32; nc]);
                        out.copy_from_slice(model.output(last)?);
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
                    let run = Run {
                        th: &self.th,
                        params: &self.params,
                    };
                    let model = &mut self.slots[slot];
                    // The last micro-batch's backward finishes each unit's gradients.
                    let last_mb = mb + 1 == m;
                    let (layout, tensor) = (&self.layout, self.tensor.as_ref());
                    let mut ready = |u: Unit, grads: &[f32]| {
                        if let Some((b, _)) = self.buckets.as_mut().filter(|_| last_mb) {
                            let r = match tensor {
                                Some(t) => unit_range(layout, &t.plan, u),
                                None => layout.unit_range(u),
                            };
                            b.ready(r, grads);
                        }
                    };
                    model.backward(&run, &mut self.grads, units, dout.as_deref(), &mut ready)?;
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
            // The mean over the replicas, as `GradBuckets::mean` (every member of this dp
            // group is a last stage).
            if let Some(dp) = self.dp.as_ref().filter(|d| d.size() > 1) {
                dp.all_reduce_with(&mut loss, ReduceOp::Sum, &self.sum_options())?;
                loss[0] /= dp.size() as f64;
            }
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
}
