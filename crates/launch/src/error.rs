//! The launcher's one error type.

use std::time::Duration;

/// Everything the agent can fail with; each variant names the bad value or the failed party.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    // === Bad input ===
    /// A command-line value that does not parse or is out of range.
    #[error("invalid {what} '{value}': {why}")]
    Invalid {
        /// The option or setting (e.g. `--chaos`).
        what: &'static str,
        /// The value as given.
        value: String,
        /// What is wrong with it.
        why: String,
    },
    /// An environment variable that does not parse.
    #[error("{name}='{value}' is not valid: {why}")]
    Env {
        /// The variable.
        name: String,
        /// Its value.
        value: String,
        /// What is wrong with it.
        why: String,
    },

    // === Processes and files ===
    /// A worker could not be started.
    #[error("spawn worker rank {rank}: {source}")]
    Spawn {
        /// The rank it would have had.
        rank: usize,
        /// The OS error.
        source: std::io::Error,
    },
    /// Another I/O failure, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The checkpoint directory could not be read (chaos `corrupt-newest`).
    #[error("checkpoint: {0}")]
    Ckpt(#[from] ckpt::CkptError),

    // === Coordination ===
    /// The rendezvous store failed or refused a request.
    #[error("rendezvous store: {0}")]
    Store(#[from] comm::CommError),
    /// Not every node's agent registered for a generation before the deadline (004 Alg. 28.2).
    #[error(
        "gang admission for generation {generation} timed out after {waited:?}: node(s) {missing:?} did not register"
    )]
    Admission {
        /// The generation being admitted.
        generation: u64,
        /// How long this agent waited.
        waited: Duration,
        /// Node ranks that never registered.
        missing: Vec<usize>,
    },
    /// Node 0 gave up on the job (restarts exhausted there, or it timed out).
    #[error("the job was aborted: {0}")]
    Aborted(String),
    /// Node 0 did not decide how to go on after a failure within the deadline.
    #[error("no restart decision from node 0 within {0:?} after generation {1} failed")]
    NoDecision(Duration, u64),
    /// A node left out of an elastic generation saw the job neither move on nor end in time.
    #[error(
        "node {node} was left out of generation {generation}, and the job neither started another generation nor ended within {waited:?}"
    )]
    Excluded {
        /// This node.
        node: usize,
        /// The generation it was left out of.
        generation: u64,
        /// How long it waited.
        waited: Duration,
    },

    // === Outcomes ===
    /// A worker refused its configuration: the job ends without a restart.
    #[error("{0} (not restarted: the same configuration would be refused again)")]
    Refused(String),
    /// A failure after `--max-restarts` restarts.
    #[error("{last} (restarts exhausted: {restarts} of --max-restarts {max} used)")]
    RestartsExhausted {
        /// Restarts already made.
        restarts: u64,
        /// The limit.
        max: u64,
        /// The failure that ended the job.
        last: String,
    },
    /// SIGTERM stopped the job (see [`crate::exit`]: the binary exits with 75).
    #[error(transparent)]
    Preempted(#[from] crate::exit::Preempted),
    /// The whole job ran past its deadline.
    #[error("job did not finish within {0:?}; workers stopped")]
    JobTimeout(Duration),
}

/// The launcher's result type.
pub type Result<T> = std::result::Result<T, LaunchError>;

impl LaunchError {
    /// A bad value of `what`.
    pub fn invalid(what: &'static str, value: impl Into<String>, why: impl Into<String>) -> Self {
        LaunchError::Invalid {
            what,
            value: value.into(),
            why: why.into(),
        }
    }

    /// An I/O error while doing `context`.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        LaunchError::Io {
            context: context.into(),
            source,
        }
    }
}
