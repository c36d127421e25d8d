//! The model crate's error type.
use thiserror::Error;

/// Everything that can go wrong in the model engine, naming what was wrong.
#[derive(Debug, Error)]
pub enum ModelError {
    /// A config field has an invalid value.
    #[error("invalid model config: {field} = {value}: {reason}")]
    Config {
        field: &'static str,
        value: String,
        reason: String,
    },
    /// A buffer handed to the engine has the wrong length.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// A token id outside the vocabulary.
    #[error("{what}: token id {id} at position {pos} is outside the vocabulary (size {vocab})")]
    Token {
        what: &'static str,
        id: u32,
        pos: usize,
        vocab: usize,
    },
    /// The loss (or a gradient) became NaN or infinite.
    #[error("non-finite {what} at step {step}: {value}")]
    NonFinite {
        what: &'static str,
        step: u64,
        value: f64,
    },
    /// The thread pool could not be built.
    #[error("thread pool with {threads} threads: {reason}")]
    Threads { threads: usize, reason: String },
    /// An optimizer or schedule setting is invalid.
    #[error("invalid optimizer setting: {field} = {value}: {reason}")]
    Optim {
        field: &'static str,
        value: String,
        reason: String,
    },
    /// A config's buffers need more memory than this machine has available.
    #[error(
        "{what} need {:.2} GB, but this process has {:.2} GB available: {hint}",
        *.need as f64 / 1e9,
        *.available as f64 / 1e9
    )]
    Memory {
        what: String,
        need: u64,
        available: u64,
        hint: String,
    },
    /// Import or export of a weights file failed.
    #[error("{path}: {reason}")]
    Io { path: String, reason: String },
    /// A split block's collective over its group failed ([`crate::block::BlockComm`]).
    #[error("block communication: {0}")]
    Comm(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Result alias for the model crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
