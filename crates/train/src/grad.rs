//! The gradient half of a training step: forward and backward of each micro-batch, gradient
//! accumulation, and (data parallel) the bucketed all-reduce hung off the backward, then the
//! global norm and clipping. The trainer ([`crate::trainer`]) runs it and applies the update.
use std::time::Instant;

use model::Threads;
use model::model::Model;
use model::optim::{check_finite, clip_coef, clip_grad_norm, grad_norm, scale_grads};

use crate::ddp::GradBuckets;
use crate::error::Result;
use crate::expert::{BlockGroups, ExpertPart};
use crate::source::Source;
use crate::tensor::{BlockComm, TpPart};

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
            tensor: $t.tensor.as_ref(),
            experts: $t.experts.as_ref(),
        }
    };
}
pub(crate) use grad_step;

/// What one step's gradient computation reads and writes.
pub(crate) struct GradStep<'a> {
    pub(crate) model: &'a mut Model<f32>,
    pub(crate) th: &'a Threads,
    pub(crate) params: &'a [f32],
    pub(crate) inputs: &'a [u32],
    pub(crate) targets: &'a [u32],
    pub(crate) grads: &'a mut [f32],
    pub(crate) sync: Option<&'a mut GradBuckets>,
    /// The tensor-parallel part: the blocks sum over its group, the norm counts each element
    /// of the whole model once over it.
    pub(crate) tensor: Option<&'a TpPart>,
    pub(crate) experts: Option<&'a ExpertPart>,
}

/// What it produced.
pub(crate) struct GradOut {
    /// Mean loss over the global batch.
    pub(crate) loss: f64,
    /// Global gradient norm before clipping.
    pub(crate) norm: f64,
    /// Exposed gradient communication, seconds.
    pub(crate) comm_seconds: f64,
}

/// Fills the input and target buffers with the next micro-batch; returns the seconds it took.
pub(crate) fn fetch(source: &mut Source, inputs: &mut [u32], targets: &mut [u32]) -> Result<f64> {
    let start = Instant::now();
    source.next_batch(inputs, targets)?;
    Ok(start.elapsed().as_secs_f64())
}

/// Gradient accumulation over the micro-batches of one optimizer step.
pub(crate) struct Accum {
    count: usize,
    done: usize,
    loss_sum: f64,
    pub(crate) data_seconds: f64,
}

impl Accum {
    pub(crate) fn new(count: usize) -> Accum {
        Accum {
            count: count.max(1),
            done: 0,
            loss_sum: 0.0,
            data_seconds: 0.0,
        }
    }

    /// Runs the next micro-batch through `g` (whose batch took `fetched` seconds to fetch);
    /// after the last, returns the step's gradient result.
    pub(crate) fn micro(
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
            tensor,
            experts,
        } = self;
        if first {
            grads.fill(0.0);
        }
        let mut groups = BlockGroups::new(tensor, experts);
        let comm: &mut dyn BlockComm<f32> = &mut groups;
        let loss = model
            .forward_with(th, params, inputs, Some(targets), comm)?
            .unwrap_or(f64::NAN);
        check_finite("loss", step, loss)?;
        *loss_sum += loss;
        let mut comm_seconds = 0.0;
        let mut loss = *loss_sum / count as f64;
        let scale = 1.0 / count as f32;
        // Data parallel: only the last micro-batch's backward communicates.
        let synced = match sync {
            Some(s) if last => {
                let ready = &mut |range, g: &mut [f32]| s.ready(range, g);
                model.backward_hooked_with(th, params, grads, ready, comm)?;
                comm_seconds = s.finish(grads, scale)?.as_secs_f64();
                // The experts' ranges are in no bucket: their replicas' mean and the
                // micro-batch scale.
                if let Some(p) = experts {
                    p.finish_grads(th, grads, scale)?;
                }
                loss = s.mean(loss)?;
                true
            }
            _ => {
                model.backward_hooked_with(th, params, grads, &mut |_, _| {}, comm)?;
                false
            }
        };
        // The blocks' sums over the tensor-parallel group and the expert exchanges are exposed
        // too.
        comm_seconds += groups.seconds();
        if !last {
            return Ok(None);
        }
        if !synced && count > 1 {
            grads.iter_mut().for_each(|g| *g *= scale);
        }
        let _p = model::profile::scope("grad_norm");
        let norm = match (tensor, experts, clip) {
            (None, Some(p), clip) => {
                let norm = (p.dense_sum_sq(th, grads) + p.sum_sq(th, grads)?).sqrt();
                if let Some(c) = clip.and_then(|max| clip_coef(norm, max)) {
                    scale_grads(th, grads, c);
                }
                norm
            }
            (Some(t), experts, clip) => {
                let norm = match experts {
                    Some(p) => t.sum_sq_without(th, grads, &p.all)? + p.sum_sq(th, grads)?,
                    None => t.sum_sq(th, grads)?,
                }
                .sqrt();
                if let Some(c) = clip.and_then(|max| clip_coef(norm, max)) {
                    scale_grads(th, grads, c);
                }
                norm
            }
            (None, None, Some(max)) => clip_grad_norm(th, grads, max),
            (None, None, None) => grad_norm(th, grads),
        };
        check_finite("gradient norm", step, norm)?;
        Ok(Some(GradOut {
            loss,
            norm,
            comm_seconds,
        }))
    }
}
