//! Pipeline parallelism as an explicit schedule: per stage, the literal list of actions a runtime
//! executes (file 000, "流水线并行", lines 2343-2411; notes/000_part2.md §2.14).
//!
//! The model's layers are cut into `p * v` consecutive chunks; stage `s` holds the `v` chunks
//! `c * p + s` for `c` in `0..v` (Megatron's interleaving; `v = 1` for GPipe and 1F1B, where
//! stage `s` simply holds the `s`-th slice of the layers, 000 Algorithm 1 step 1). A global
//! batch is split into `m` micro-batches; activations flow to the next chunk, gradients flow
//! back, and every stage takes one optimizer step after all `m` backwards (Algorithm 1 step 8).
//!
//! - [`schedule`]: [`Action`], [`ScheduleKind`] and [`Schedule`], which generates GPipe, 1F1B
//!   (Algorithm 1: warm-up, one-forward-one-backward, drain) and interleaved 1F1B, and
//!   [`Schedule::check`], which replays the lists with blocking point-to-point semantics.
//! - [`engine`]: [`PipelineStage`], one stage of a pipeline-parallel training run executing its
//!   list with point-to-point sends of activations and gradients, alone or as one of several
//!   data-parallel replicas (DP x PP, optionally ZeRO-1); its construction and layout checks
//!   are in `build`, its optimizer half (reductions, norm, AdamW) in `update`, its
//!   checkpoints in the [`crate::Trainer`]'s format (save, restore from any layout) in
//!   `checkpoint`. With a device mesh whose `tp > 1` every stage's blocks are split
//!   Megatron-style over its TP group (PP x TP x DP, 000 "混合并行", "3D 训练循环"):
//!   `tensor_stage` (the stage's shard plan, norm and gather; its slots are the one split
//!   model) and `tensor_checkpoint` (their saves and restores).
//! - [`simulate`]: an event-driven timeline of a schedule for given per-stage compute times,
//!   with the measured bubble fraction (000 F41: (p-1)/(m+p-1) for GPipe and 1F1B).
//!
//! Dimension legend: `p` stages, `m` micro-batches, `v` virtual stages (chunks per stage),
//! `K = p * v` model chunks.
mod build;
mod check;
mod checkpoint;
pub mod engine;
mod experts;
mod forecast;
mod generate;
pub mod schedule;
pub mod simulate;
mod tensor_checkpoint;
mod tensor_stage;
#[cfg(test)]
mod tests;
mod update;

use thiserror::Error;

use crate::error::TrainError;

pub use engine::{PipeStats, PipelineStage};
pub use schedule::{Action, Schedule, ScheduleKind};
pub use simulate::{Span, Timeline};

/// Why a schedule could not be built, checked or simulated.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ScheduleError {
    // === Inputs ===
    /// A parameter is out of range; the reason states the rule with the values.
    #[error("invalid pipeline input: {field} = {value}: {reason}")]
    Invalid {
        /// The parameter's name (`pipeline_stages`, `microbatches`, `virtual_stages`, ...).
        field: &'static str,
        /// Its value as given.
        value: String,
        /// The rule it breaks, with the values.
        reason: String,
    },

    // === Schedule contents ===
    /// One action of one stage breaks a rule (a dependency, a duplicate, a wrong peer ...).
    #[error("stage {stage}, action {index} ({action}): {reason}")]
    Action {
        /// The stage whose list holds the action.
        stage: usize,
        /// The action's position in that list.
        index: usize,
        /// The action itself.
        action: Action,
        /// What is wrong.
        reason: String,
    },
    /// A stage's list ends with work missing (a micro-batch never forwarded, a send never made,
    /// no optimizer step ...).
    #[error("stage {stage}: {reason}")]
    Incomplete {
        /// The stage.
        stage: usize,
        /// What is missing.
        reason: String,
    },
    /// The sends from one stage to a neighbour and that neighbour's receives from it disagree
    /// (point-to-point messages are matched in call order, as `ProcessGroup::send`/`recv` are).
    #[error(
        "stage {from} -> stage {to}: message {position} is sent as {sent}, received as {received}"
    )]
    Mismatch {
        /// The sending stage.
        from: usize,
        /// The receiving stage.
        to: usize,
        /// Position of the first disagreeing message on that link (0-based).
        position: usize,
        /// What the sender sends there (`none` when it sends fewer).
        sent: String,
        /// What the receiver expects there (`none` when it receives fewer).
        received: String,
    },
    /// Executed with blocking sends and receives, every unfinished stage waits on another.
    #[error("deadlock: {detail}")]
    Deadlock {
        /// Each blocked stage with the action it is stuck on.
        detail: String,
    },
}

/// Pipeline errors surface to the trainer as a config error (a schedule is part of the run's
/// configuration); the full message is kept in `reason`.
impl From<ScheduleError> for TrainError {
    fn from(e: ScheduleError) -> Self {
        match e {
            ScheduleError::Invalid {
                field,
                value,
                reason,
            } => TrainError::Config {
                field,
                value,
                reason,
            },
            other => TrainError::Config {
                field: "pipeline_schedule",
                value: String::new(),
                reason: other.to_string(),
            },
        }
    }
}

/// Result alias for the pipeline module.
pub type Result<T, E = ScheduleError> = std::result::Result<T, E>;
