//! The engine of one rank: what one step of its layout does. The run loop ([`super::run`])
//! owns everything around the step; an engine is built from the [`RunConfig`]'s layout.
//!
//! - [`Engine::Data`]: one process, or data parallel with bucketed all-reduce, or ZeRO-1/2/3
//!   ([`Trainer`]); with experts split over the data-parallel ranks, DP x EP
//!   ([`Trainer::expert_parallel`]).
//! - [`Engine::Tensor`]: DP x TP (with ZeRO-1/2/3) on a device mesh ([`Trainer::on_mesh`]).
//! - [`Engine::Pipeline`]: DP x PP, and DP x PP x TP ([`PipelineStage`]).
use std::path::Path;

use comm::group::ProcessGroup;
use comm::mesh::{DeviceMesh, MeshShape};

use super::config::{RunConfig, refused};
use crate::checkpoint::resume_collectively;
use crate::error::Result;
use crate::pipeline::PipelineStage;
use crate::trainer::{StateMemory, StepStats, Trainer};
use crate::zero::Stage;

/// One rank's engine.
pub enum Engine {
    /// One process, data parallel, or ZeRO.
    Data(Box<Trainer>),
    /// DP x TP.
    Tensor(Box<Trainer>),
    /// DP x PP (x TP).
    Pipeline(Box<PipelineStage>),
}

/// A mesh run's shape and the mesh it runs on (kept for the run's length: the engine's groups
/// were cut from it).
pub struct MeshRun {
    /// dp x pp x tp.
    pub shape: MeshShape,
    /// The mesh (its placement warnings, when forced).
    pub mesh: DeviceMesh,
}

impl Engine {
    /// This rank's engine for `cfg` over `group` (None: one process), and the mesh of a mesh
    /// layout. Refusals (degrees, placement, settings an engine does not build) are
    /// [`crate::TrainError::Refused`].
    pub fn build(
        cfg: &RunConfig,
        group: Option<ProcessGroup>,
    ) -> Result<(Engine, Option<MeshRun>)> {
        let l = &cfg.layout;
        let train = cfg.train.clone();
        let Some(group) = group else {
            return Ok((Engine::Data(Box::new(Trainer::new(train)?)), None));
        };
        if l.ep > 1 && !l.splits_model() {
            let t = Trainer::expert_parallel(train, group, l.ep, l.bucket_bytes)?;
            return Ok((Engine::Data(Box::new(t)), None));
        }
        if !l.splits_model() {
            let hybrid = l.hybrid_groups(group.size())?;
            let t = match (Stage::from_number(l.zero)?, hybrid) {
                (Some(stage), Some(sizes)) => {
                    let groups = hybrid_subgroups(&group, sizes)?;
                    Trainer::hybrid(train, groups, stage, l.bucket_bytes)?
                }
                (Some(stage), None) => Trainer::zero(train, group, stage, l.bucket_bytes)?,
                (None, _) => Trainer::data_parallel(train, group, l.bucket_bytes)?,
            };
            return Ok((Engine::Data(Box::new(t)), None));
        }
        let shape = l.shape(group.size())?;
        let mesh = DeviceMesh::new(&group, shape, l.force_placement).map_err(|e| {
            let e = e.to_string();
            let hint = if e.contains("mesh placement") {
                " (flotilla train --force-placement runs it anyway)"
            } else {
                ""
            };
            refused(format!("{e}{hint}"))
        })?;
        let engine = if shape.pp > 1 {
            // ZeRO-1 inside the stages, over each stage's data-parallel replicas.
            let zero = Stage::from_number(l.zero)?;
            let st = PipelineStage::on_mesh_zero(train, &mesh, l.schedule, l.sp, zero)
                .and_then(|st| match l.ep > 1 {
                    true => st.with_experts(),
                    false => Ok(st),
                })
                .map_err(|e| refused(format!("building the pipeline stage: {e}")))?;
            Engine::Pipeline(Box::new(st))
        } else {
            let stage = Stage::from_number(l.zero)?;
            let t = Trainer::on_mesh(train, &mesh, (stage, l.sp), l.bucket_bytes)
                .and_then(|t| match l.ep > 1 {
                    true => t.with_experts(mesh.dp().clone(), l.ep, l.bucket_bytes),
                    false => Ok(t),
                })
                .map_err(|e| refused(format!("building the tensor-parallel rank: {e}")))?;
            Engine::Tensor(Box::new(t))
        };
        Ok((engine, Some(MeshRun { shape, mesh })))
    }

    /// One optimizer step (a collective over the engine's groups). Tokens are the whole job's;
    /// a pipeline stage's time blocked in sends and receives (bubble and transfers) counts as
    /// its communication.
    pub fn step(&mut self) -> Result<StepStats> {
        match self {
            Engine::Data(t) => t.step(),
            Engine::Tensor(t) => t.step(),
            Engine::Pipeline(p) => {
                let tokens = p.config().tokens_per_step() * p.replicas();
                let s = p.step()?;
                Ok(StepStats {
                    step: s.step,
                    loss: s.loss,
                    lr: s.lr,
                    grad_norm: s.grad_norm,
                    tokens,
                    seconds: s.seconds,
                    data_seconds: 0.0,
                    comm_seconds: s.wait_seconds,
                })
            }
        }
    }

    /// The data loader's metrics, when the run reads a token dataset (the lead rank's).
    pub fn data_metrics(&mut self) -> Option<data::LoaderMetrics> {
        match self {
            Engine::Data(t) => t.data_metrics().cloned(),
            Engine::Tensor(t) => t.data_metrics().cloned(),
            Engine::Pipeline(p) => p.data_metrics().cloned(),
        }
    }

    /// Steps completed.
    pub fn steps_done(&self) -> u64 {
        match self {
            Engine::Data(t) => t.steps_done(),
            Engine::Tensor(t) => t.steps_done(),
            Engine::Pipeline(p) => p.steps_done(),
        }
    }

    /// The resident bytes of this rank's training state.
    pub fn state_memory(&self) -> StateMemory {
        match self {
            Engine::Data(t) => t.state_memory(),
            Engine::Tensor(t) => t.state_memory(),
            Engine::Pipeline(p) => p.state_memory(),
        }
    }

    /// Model FLOPs per trained token (6N + 12LTC) of the whole model; for MoE, N counts the
    /// parameters a token is active in ([`model::config::ModelConfig::flops_per_token`]).
    pub fn flops_per_token(&self, cfg: &crate::TrainConfig) -> f64 {
        if let Engine::Data(t) = self {
            return t.flops_per_token();
        }
        let mut c = cfg.model.clone();
        c.seq_len = cfg.seq_len;
        c.flops_per_token(model::layout::Layout::new(&cfg.model).total)
    }

    /// Each block's routing metrics from the last forward (empty for a dense model).
    pub fn moe_stats(&self) -> Vec<model::moe::MoeStats> {
        match self {
            Engine::Data(t) | Engine::Tensor(t) => t.model().moe_stats(),
            Engine::Pipeline(p) => p.moe_stats(),
        }
    }

    /// The whole model's parameters, assembled from every rank's part (a collective: every
    /// rank must call it; every rank gets the whole copy).
    pub fn whole_params(&mut self) -> Result<Vec<f32>> {
        match self {
            // ZeRO-3 keeps no whole copy, nor expert parallelism: every rank takes part.
            Engine::Data(t) | Engine::Tensor(t) => t.whole_params(),
            Engine::Pipeline(p) => p.gather_params(),
        }
    }

    /// Resumes a synchronously saving engine (mesh or expert) from the newest committed step
    /// under `dir` that loads on every rank of `world` (None: one process), falling back past
    /// damaged ones ([`crate::checkpoint::resume_collectively`]); the step and the steps set
    /// aside. A collective over `world`.
    pub fn resume_sync(
        &mut self,
        dir: &Path,
        world: Option<&ProcessGroup>,
    ) -> Result<Option<(u64, Vec<String>)>> {
        match self {
            Engine::Data(_) => Err(not_sync()),
            Engine::Tensor(t) => resume_collectively(dir, world, |c| t.restore(c)),
            Engine::Pipeline(p) => resume_collectively(dir, world, |c| p.restore(c)),
        }
    }

    /// Saves a mesh or expert engine's current step through `ck` (asynchronous unless the
    /// checkpointer writes synchronously; the gathering it needs is a collective).
    pub fn save_into(
        &mut self,
        ck: &mut crate::Checkpointer,
        run_id: &str,
    ) -> Result<crate::SaveSummary> {
        match self {
            Engine::Data(_) => Err(not_sync()),
            Engine::Tensor(t) => t.save_into(ck, run_id),
            Engine::Pipeline(p) => p.save_into(ck, run_id),
        }
    }

    /// Saves a mesh or expert engine's current step synchronously (a collective; every rank
    /// writes its pieces, rank 0 commits); returns the step.
    pub fn save_sync(&mut self, dir: &Path, run_id: &str) -> Result<u64> {
        match self {
            Engine::Data(_) => Err(not_sync()),
            Engine::Tensor(t) => t.save_checkpoint(dir, run_id),
            Engine::Pipeline(p) => p.save_checkpoint(dir, run_id),
        }
    }
}

/// The data-parallel engine checkpoints through [`crate::Checkpointer`] (asynchronous saves,
/// the automatic interval, fallback), not through the mesh and expert engines' synchronous path.
fn not_sync() -> crate::TrainError {
    crate::TrainError::Config {
        field: "checkpoint",
        value: "mesh".into(),
        reason: "the data-parallel engine saves and resumes through the Checkpointer".into(),
    }
}

/// This rank's (shard group, replica groups' group) of a hybrid-sharded run over `world`:
/// shard groups of `shard` consecutive ranks (one host's, where hosts hold whole groups), the
/// rank with the same index in each of the `replicate` groups. Collective over `world`.
fn hybrid_subgroups(
    world: &ProcessGroup,
    (shard, replicate): (usize, usize),
) -> Result<(ProcessGroup, ProcessGroup)> {
    let missing = || refused("hybrid sharding: this rank is in no group".into());
    let mut mine = (None, None);
    for r in 0..replicate {
        let ranks: Vec<usize> = (r * shard..(r + 1) * shard).collect();
        if let Some(g) = world.subgroup(&format!("shard{r}"), &ranks)? {
            mine.0 = Some(g);
        }
    }
    for j in 0..shard {
        let ranks: Vec<usize> = (0..replicate).map(|r| r * shard + j).collect();
        if let Some(g) = world.subgroup(&format!("replicate{j}"), &ranks)? {
            mine.1 = Some(g);
        }
    }
    match mine {
        (Some(s), Some(r)) => Ok((s, r)),
        _ => Err(missing()),
    }
}
