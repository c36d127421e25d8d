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
