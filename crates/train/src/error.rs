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
    /// The planner refused (its view of the run: a layout or cluster it cannot evaluate).
    #[error(transparent)]
    Plan(#[from] plan::PlanError),
    /// What the run's observer (heartbeats, chaos, printing) reported.
    #[error(transparent)]
    Observer(BoxError),
    /// The metrics file could not be written.
    #[error(transparent)]
    Metrics(#[from] crate::metrics_log::MetricsLogError),
    /// A checkpoint cannot resume this run.
    #[error("cannot resume from step {step}: {reason}")]
    Resume {
        /// The checkpoint's step.
        step: u64,
        /// What differs.
        reason: String,
    },
    /// A checkpoint's run state (in its manifest) is malformed or disagrees with the rest of
    /// the checkpoint: treated as damage, so a resume sets the step aside and falls back.
    #[error("{}: run state of step {step}: {reason}", path.display())]
    RunState {
        /// The manifest holding the state.
        path: std::path::PathBuf,
        /// The checkpoint's step.
        step: u64,
        /// What is wrong.
        reason: String,
    },
    /// A training setting is invalid.
    #[error("invalid training config: {field} = {value}: {reason}")]
    Config {
        field: &'static str,
        value: String,
        reason: String,
    },
    /// Per-step fault tolerance (`--ft`): a replica was lost during the step (the survivors
    /// retry it), or the quorum could not be formed.
    #[error("fault tolerance: {0}")]
    FaultTolerance(String),
    /// A configuration the run refuses before training, which a restart would refuse again (the
    /// worker exits with the launcher's refusal code instead of being restarted).
    #[error("{0}")]
    Refused(String),
    /// A file the run writes or reads beside training (a saved model, its sidecar).
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// A saved model (`--save`) whose file is not what its sidecar recorded.
    #[error("{}: {reason}", path.display())]
    SavedModel {
        /// The model file.
        path: std::path::PathBuf,
        /// What differs.
        reason: String,
    },
    /// What the run was doing when `source` failed.
    #[error("{what}")]
    Context {
        /// The step of the run that failed ("resuming from DIR", "saving a checkpoint" ...).
        what: String,
        /// The failure.
        #[source]
        source: Box<TrainError>,
    },
}

impl TrainError {
    /// Whether this error says a checkpoint is damaged (the checkpoint layer's verification,
    /// or a run state that disagrees with its checkpoint): a resume sets such a step aside
    /// and tries the one before, where any other error ends the resume.
    pub fn is_damage(&self) -> bool {
        matches!(self, TrainError::Ckpt(_) | TrainError::RunState { .. })
    }

    /// Whether this error, or one it wraps, is a refusal ([`TrainError::Refused`], or the
    /// model's refusal of a config too large for this machine's memory): a restart would only
    /// be refused again.
    ///
    /// A full disk or an exhausted quota (ENOSPC, EDQUOT, anywhere in the chain of causes) is
    /// one too: the restarted job would fill the same disk at the same save, so the launcher
    /// stops at once with the error instead of spending its restarts.
    pub fn is_refusal(&self) -> bool {
        match self {
            TrainError::Refused(_) | TrainError::Model(model::ModelError::Memory { .. }) => true,
            TrainError::Context { source, .. } => source.is_refusal(),
            other => out_of_space(other),
        }
    }
}

/// Whether `e` or one of its causes is an I/O error of a full disk or quota.
fn out_of_space(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>()
            && matches!(io.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Adds what the run was doing to an error, as anyhow's `context` does.
pub trait Context<T> {
    /// Wraps the error in [`TrainError::Context`] with `what()`.
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: Into<TrainError>> Context<T> for std::result::Result<T, E> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| TrainError::Context {
            what: what(),
            source: Box::new(e.into()),
        })
    }
}

/// An error from outside the crate (the run's observer: heartbeats, chaos, printing).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Result alias for the train crate.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;
