//! What a trainer holds, read: its config, model, parameters, groups and ranks, the ranges
//! its gradients travel in, its counters and the memory its state takes.
use std::ops::Range;

use comm::group::ProcessGroup;
use model::Threads;
use model::model::Model;
use model::optim::AdamW;

use super::{StateMemory, Trainer};
use crate::config::TrainConfig;
use crate::ddp::GradBuckets;
use crate::zero::{Stage, Zero};

impl Trainer {
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
        self.sync
            .as_ref()
            .map(GradBuckets::group)
            .or(self.zero.as_ref().map(|z| z.group()))
    }

    /// Data-parallel ranks (1 for one process; under hybrid sharding every replica group's).
    pub fn world(&self) -> usize {
        match self.zero.as_ref().filter(|z| z.replicas().is_some()) {
            Some(z) => z.dp_world(),
            None => self.group().map_or(1, |g| g.size()),
        }
    }

    /// This process's data-parallel rank (0 for one process; replica group major under
    /// hybrid sharding).
    pub fn rank(&self) -> usize {
        match self.zero.as_ref().filter(|z| z.replicas().is_some()) {
            Some(z) => z.dp_rank(),
            None => self.group().map_or(0, |g| g.rank()),
        }
    }

    /// The ZeRO engine, when the state is sharded.
    pub(crate) fn zero_engine(&self) -> Option<&Zero> {
        self.zero.as_deref()
    }

    /// The ZeRO stage, when the state is sharded.
    pub fn zero_stage(&self) -> Option<Stage> {
        self.zero.as_ref().map(|z| z.stage())
    }

    /// The ranges the gradients are communicated in, each with the bytes of its collective's
    /// buffer: the data-parallel buckets, or the ZeRO segments padded to equal parts (empty for
    /// one process).
    pub fn comm_segments(&self) -> Vec<(Range<usize>, usize)> {
        match (&self.sync, &self.zero) {
            (Some(s), _) => s
                .buckets()
                .iter()
                .map(|b| (b.clone(), 4 * b.len()))
                .collect(),
            (_, Some(z)) => {
                let p = z.plan();
                (0..p.segments().len())
                    .map(|i| (p.segments()[i].clone(), 4 * p.part_len(i) * p.world()))
                    .collect()
            }
            _ => Vec::new(),
        }
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

    /// Rows of the data stream consumed so far by all ranks together (the global row cursor).
    pub fn rows_drawn(&self) -> u64 {
        self.rows_base + self.drawn * self.global_rows()
    }

    /// The best achievable loss of the data, when known.
    pub fn entropy_floor(&self) -> Option<f64> {
        self.source.entropy_floor()
    }

    /// Model FLOPs per trained token (6N + 12LTC).
    pub fn flops_per_token(&self) -> f64 {
        let mut c = self.cfg.model.clone();
        c.seq_len = self.cfg.seq_len;
        let whole = match &self.tensor {
            Some(t) => t.layout.whole.total,
            None => self.model.n_params(),
        };
        c.flops_per_token(whole)
    }

    /// Resident bytes of the training state on this rank, measured (see [`StateMemory`]).
    pub fn state_memory(&self) -> StateMemory {
        let (shard_params, shard_grads) = self.zero.as_ref().map_or((0, 0), |z| z.shard_bytes());
        let bf16 = self
            .bf16
            .as_ref()
            .map_or(0, |b| b.param_bytes() + b.grad_bytes() + b.master_bytes());
        let (m, v) = self.opt.moments();
        StateMemory {
            params: self.params.resident_bytes() + shard_params + bf16,
            grads: self.grads.resident_bytes() + shard_grads,
            // The other ranks' experts' moments are never touched.
            optimizer: (m.len() + v.len()
                - 2 * self
                    .experts
                    .as_ref()
                    .map_or(0, |p| p.others_len(&(0..m.len()))))
                * 4,
            comm_buffers: self.sync.as_ref().map_or(0, |s| s.buffer_bytes())
                + self.zero.as_ref().map_or(0, |z| z.buffer_bytes()),
        }
    }

    /// The data loader's metrics, when training on datasets.
    pub fn data_metrics(&self) -> Option<&data::LoaderMetrics> {
        self.source.loader_metrics()
    }
}
