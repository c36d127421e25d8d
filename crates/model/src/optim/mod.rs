//! The optimizer over flat f32 buffers: parameters and gradients each live
//! in one flat buffer, and weight decay applies to ranges of it (taken from
//! the model's layout table).
//!
//! - [`adamw`]: AdamW matching PyTorch's `torch.optim.AdamW` bit for bit.
//! - [`schedule`]: learning-rate schedules (warmup, linear or cosine decay).
//! - [`clip`]: deterministic global gradient norm, clipping, finiteness checks.
//! - [`bf16`]: bf16 parameters and gradients with f32 master weights.
pub mod adamw;
pub mod bf16;
pub mod clip;
pub mod schedule;

pub use adamw::StatePart;
pub use adamw::{AdamW, AdamWConfig};
pub use bf16::Bf16Store;
pub use clip::{
    check_finite, check_max_norm, clip_coef, clip_grad_norm, grad_norm, grad_sum_sq, scale_grads,
};
pub use schedule::{SCHEDULE_NAMES, Schedule};
