//! The exit codes of `flotilla` and of its workers: one table, read by the agent (which worker
//! exits to restart, which end the job) and by the binary (what it exits with), and printed in
//! docs/LAUNCH.md. A scheduler decides on them: Slurm's `RequeueExit=75` (or the sbatch
//! script's `scontrol requeue` on 75, examples/slurm/), a Kubernetes Job's `podFailurePolicy`.
//!
//! | code | meaning | what to do |
//! |---:|---|---|
//! | 0 | success: the run trained every step (or had none left) | nothing |
//! | 1 | failed: an error the message names (restarts spent, I/O, a lost peer) | read the error |
//! | 2 | usage: the command line does not parse (clap) | fix the command |
//! | 75 | pre-empted: SIGTERM, a checkpoint committed, stopped cleanly | requeue: it resumes there |
//! | 78 | refused configuration: a restart would be refused again | fix the configuration |
//!
//! 75 and 78 are sysexits' `EX_TEMPFAIL` ("temporary failure; the user is invited to retry")
//! and `EX_CONFIG`.

use crate::error::LaunchError;
use std::time::Duration;

/// How a `flotilla` process ended (see the module's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The command did what was asked.
    Success,
    /// An error the message names.
    Failed,
    /// The command line does not parse (clap's own code).
    Usage,
    /// Stopped by SIGTERM after committing a checkpoint: requeue the job to resume it.
    Preempted,
    /// A configuration the run refuses; restarting or requeueing would be refused again.
    Refused,
}

impl Exit {
    /// The process exit code.
    pub const fn code(self) -> i32 {
        match self {
            Exit::Success => 0,
            Exit::Failed => 1,
            Exit::Usage => 2,
            Exit::Preempted => 75,
            Exit::Refused => 78,
        }
    }

    /// The kind of end an exit code stands for (`None`: not one of the table's).
    pub fn from_code(code: i32) -> Option<Exit> {
        [
            Exit::Success,
            Exit::Failed,
            Exit::Usage,
            Exit::Preempted,
            Exit::Refused,
        ]
        .into_iter()
        .find(|e| e.code() == code)
    }
}

impl Exit {
    /// How a command that failed with the error whose chain is `chain` ends: pre-empted if a
    /// [`Preempted`] is in it, refused if the agent ended the job on a worker's refusal or
    /// `refused` says a cause is a refusal (the crates this one does not know), else failed.
    pub fn of_error<'a>(
        chain: impl IntoIterator<Item = &'a (dyn std::error::Error + 'static)>,
        refused: impl Fn(&(dyn std::error::Error + 'static)) -> bool,
    ) -> Exit {
        let mut exit = Exit::Failed;
        for cause in chain {
            match cause.downcast_ref::<LaunchError>() {
                Some(LaunchError::Preempted(_)) => return Exit::Preempted,
                Some(LaunchError::Refused(_)) => exit = Exit::Refused,
                _ if cause.is::<Preempted>() => return Exit::Preempted,
                _ if refused(cause) => exit = Exit::Refused,
                _ => {}
            }
        }
        exit
    }
}

/// The exit code of a worker that refused its configuration (sysexits' `EX_CONFIG`): a layout
/// that cannot be placed, degrees that do not divide, a checkpoint of another model. Restarting
/// would refuse again, so the agent ends the job instead of spending its restarts.
pub const EXIT_REFUSED: i32 = Exit::Refused.code();

/// The exit code of a pre-empted run (sysexits' `EX_TEMPFAIL`): SIGTERM arrived, the run
/// stopped after its current step and committed a checkpoint of it (when it has a checkpoint
/// directory), so a requeued job loses no step.
pub const EXIT_PREEMPTED: i32 = Exit::Preempted.code();

/// A run that stopped because it was pre-empted (SIGTERM): the binary exits with
/// [`EXIT_PREEMPTED`] when this is in its error's chain.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("pre-empted by SIGTERM: {what}")]
pub struct Preempted {
    /// What was saved and how long it took, in words.
    pub what: String,
}

impl Preempted {
    /// A worker's pre-emption: it stopped after `step` and committed its checkpoint, `elapsed`
    /// after its own SIGTERM with `grace` allowed (`None`: another rank received the signal).
    pub fn after_step(step: u64, elapsed: Option<Duration>, grace: Duration) -> Self {
        let when = match elapsed {
            Some(e) => format!(
                "{:.2} s after the signal ({} --term-grace-s {})",
                e.as_secs_f64(),
                if e <= grace { "within" } else { "PAST" },
                grace.as_secs_f64()
            ),
            None => "(another rank received the signal)".into(),
        };
        Preempted {
            what: format!(
                "stopped after step {step}, its checkpoint committed {when}; exit \
                 {EXIT_PREEMPTED}: requeue to resume at step {step}"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_round_trips() {
        for e in [
            Exit::Success,
            Exit::Failed,
            Exit::Usage,
            Exit::Preempted,
            Exit::Refused,
        ] {
            assert_eq!(Exit::from_code(e.code()), Some(e));
        }
        assert_eq!(Exit::from_code(3), None);
        assert_eq!((EXIT_PREEMPTED, EXIT_REFUSED), (75, 78));
        let p = Preempted::after_step(
            7,
            Some(Duration::from_millis(1500)),
            Duration::from_secs(30),
        );
        assert!(p.to_string().contains("step 7"), "{p}");
        assert!(p.to_string().contains("within --term-grace-s 30"), "{p}");
    }
}
