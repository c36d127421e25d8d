//! Flotilla's training engines and the trainer loop.
//!
//! - [`config`]: the typed training config, validated up front.
//! - [`source`]: where batches come from (built-in corpora or text files).
//! - [`trainer`]: the single-process trainer (forward, backward, clip,
//!   AdamW, schedule) with per-step metrics.
//! - [`metrics`]: tokens/s and MFU against the measured GEMM peak.
//! - [`pipeline`]: pipeline-parallel schedules (GPipe, 1F1B, interleaved) as checked action lists.
//! - [`tensor`]: Megatron tensor parallelism of a block (column/row-parallel linears, f/g operators).
//! - [`expert`]: expert parallelism (MoE router, capacity, all-to-all dispatch/combine).
//! - [`forecast`]: the planner's prediction of a step beside the measured one.
//! - [`goodput`]: the job's goodput ledger from its metrics, beside the planner's.
//! - [`straggler`]: per-rank arrival skew at the step's collectives; slow ranks named.
//! - [`run`]: the one run loop every layout's engine runs under, and its typed [`run::RunConfig`].
pub mod checkpoint;
pub mod config;
pub mod ddp;
pub mod error;
pub mod expert;
pub mod forecast;
pub mod ft;
pub mod generation;
pub mod goodput;
mod grad;
pub mod metrics;
pub mod metrics_log;
pub mod peer_wait;
pub mod pipeline;
pub mod planner;
pub mod run;
pub mod saved;
pub mod source;
pub mod straggler;
pub mod tensor;
pub mod trainer;
pub mod zero;

pub use checkpoint::{CheckpointConfig, Checkpointer, SaveSummary};
pub use config::{DataSpec, TrainConfig};
pub use error::{BoxError, TrainError};
pub use trainer::{StateMemory, StepStats, Trainer};
