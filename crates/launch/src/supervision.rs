//! A worker's link to its agent ([`Supervision`]): its heartbeat, the chaos fault it may
//! strike itself with, its SIGTERM handler, and where it reports a straggler. The training
//! run loop drives it through the binary's observer at every step boundary.
use std::time::Duration;

use crate::straggler::Report;
use crate::{Fault, Heartbeat, Preempted, Result, Termination};
use comm::group::Rendezvous;

/// A worker's link to its agent: its heartbeat, and the chaos fault it may have been handed.
#[derive(Default)]
pub struct Supervision {
    /// The heartbeat thread, if the agent watches heartbeats.
    pub hb: Option<Heartbeat>,
    /// The chaos faults this worker may have to strike itself with (one per generation; under
    /// `--ft` the whole plan, [`crate::ft`]).
    pub faults: Vec<Fault>,
    /// Global rank.
    pub rank: usize,
    /// The SIGTERM handler, installed when the run has a checkpoint directory to save in.
    pub term: Option<Termination>,
    /// The job's store, where a named straggler is reported to the agents (under an agent).
    pub rdv: Option<Rendezvous>,
}

impl Supervision {
    /// A process's supervision with no agent: only its SIGTERM handler, if any.
    pub fn preemptible(term: Option<Termination>) -> Self {
        Supervision {
            term,
            ..Supervision::default()
        }
    }

    /// The supervision of worker `w` under an agent: its heartbeat (if the agent watches
    /// heartbeats), its chaos fault, its SIGTERM handler and the job's store.
    ///
    /// # Errors
    /// The heartbeat could not start, or the fault does not parse.
    pub fn worker(w: &crate::WorkerEnv, term: Option<Termination>) -> crate::Result<Self> {
        let hb = w
            .heartbeat
            .map(|period| crate::Heartbeat::start(&w.rdv, w.rank, period))
            .transpose()?;
        Ok(Supervision {
            hb,
            faults: (w.chaos.as_deref().map(crate::Fault::parse_list))
                .transpose()?
                .unwrap_or_default(),
            rank: w.rank,
            term,
            rdv: Some(w.rdv.clone()),
        })
    }

    /// How a run that `ended` ends the command: a stop on SIGTERM is the pre-emption error
    /// (exit 75), with the time its checkpoint took against `grace`.
    pub fn ended(
        term: Option<Termination>,
        ended: train::run::Ended,
        grace: Duration,
    ) -> std::result::Result<(), Preempted> {
        match ended {
            train::run::Ended::Stopped { step } => {
                let since = term.and_then(|t| t.requested());
                Err(Preempted::after_step(step, since, grace))
            }
            train::run::Ended::Completed => Ok(()),
        }
    }

    /// Training starts (again) at `step`.
    pub fn resumed(&self, step: u64) {
        if let Some(hb) = &self.hb {
            hb.resumed(step);
        }
    }

    /// The next step starts.
    pub fn starting(&self) {
        if let Some(hb) = &self.hb {
            hb.started();
        }
    }

    /// `step` is complete after `compute` of work (its time not waiting for others): tell the
    /// agent, then let chaos strike if it is due (a `slow@` fault stretches the step here, so
    /// the rank arrives late at the step's exchange of arrival times).
    pub fn completed(&self, step: u64, compute: Duration) -> Result<()> {
        let slow: Duration = (self.faults.iter())
            .filter_map(|f| f.slow_delay(self.rank, step, compute))
            .sum();
        if !slow.is_zero() {
            std::thread::sleep(slow);
        }
        if let Some(hb) = &self.hb {
            hb.completed(step);
        }
        // Slow faults first: they only speak, and a failing fault of the same step may end
        // this process.
        let slow = self.faults.iter().filter(|f| !f.kind.fails());
        for f in slow.chain(self.faults.iter().filter(|f| f.kind.fails())) {
            let flush = || {
                if let Some(hb) = &self.hb {
                    hb.flush(step, Duration::from_secs(5));
                }
            };
            f.strike(self.rank, step, flush, Duration::from_secs(3600))?;
        }
        Ok(())
    }

    /// The lead rank named rank `r` slow: reported to the agents, whose `--straggler` policy
    /// acts on it (a failed report is only logged: the straggler is named either way).
    pub fn straggler(&self, r: &Report) {
        if let Some(rdv) = &self.rdv
            && let Err(e) = crate::straggler::report(rdv, r)
        {
            eprintln!("flotilla: reporting the straggler to the agents: {e}");
        }
    }

    /// The loop is over (final save and barrier follow).
    pub fn finishing(&self) {
        if let Some(hb) = &self.hb {
            hb.finishing();
        }
    }
}
