//! Tests of the optimizer: AdamW against PyTorch, schedules, clipping and
//! bf16 storage.
mod adamw;
mod bf16_store;
mod clip;
mod reference;
mod schedule;

use model::ModelError;

/// The field an optimizer error names (panics on any other error).
pub(crate) fn optim_field(e: ModelError) -> &'static str {
    match e {
        ModelError::Optim { field, .. } => field,
        other => panic!("expected an Optim error, got {other}"),
    }
}

/// What a shape error names (panics on any other error).
pub(crate) fn shape_what(e: ModelError) -> &'static str {
    match e {
        ModelError::Shape { what, .. } => what,
        other => panic!("expected a Shape error, got {other}"),
    }
}
