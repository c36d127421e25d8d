//! The train crate's error type.
use thiserror::Error;

/// What went wrong while setting up or running training.
#[derive(Debug, Error)]
pub enum TrainError {
    /// The model engine refused (bad config, shapes, non-finite loss ...).
    #[error(transparent)]
    Model(#[from] model::ModelError),
    /// The data layer refused (bad file, tokenizer, ids ...).
    #[error(transparent)]
    Data(#[from] data::DataError),
    /// A collective failed (peer lost, timeout, bad frame ...).
    #[error(transparent)]
    Comm(#[from] comm::CommError),
    /// The checkpoint layer refused (I/O, corruption, a save still in flight ...).
    #[error(transparent)]
    Ckpt(#[from] ckpt::CkptError),
    /// A checkpoint cannot resume this run.
    #[error("cannot resume from step {step}: {reason}")]
    Resume {
        /// The checkpoint's step.
        step: u64,
        /// What differs.
        reason: String,
    },
    /// A training setting is invalid.
    #[error("invalid training config: {field} = {value}: {reason}")]
    Config {
        field: &'static str,
        value: String,
        reason: String,
    },
}

/// Result alias for the train crate.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;
