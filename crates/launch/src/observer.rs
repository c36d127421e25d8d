//! The run loop's [`Observer`] for a worker: each step boundary goes to the agent (heartbeat,
//! chaos, straggler policy, the SIGTERM notice) and to the live metrics (`--metrics-port`);
//! the lead rank's lines and progress go to a [`Progress`] that the command line provides.

use train::run::Observer;

use crate::http::Live;
use crate::metrics::StepFigures;
use crate::straggler::Report;
use crate::supervision::Supervision;

/// Where a worker's lines and progress go (the command line's progress bar, or plain lines).
pub trait Progress {
    /// A line for the person running the job.
    fn line(&mut self, text: &str);
    /// Training starts (again) at `step` of `steps`.
    fn start(&mut self, step: u64, steps: u64);
    /// Step `s` is complete.
    fn step(&mut self, s: &train::StepStats);
    /// The loop is over.
    fn finish(&mut self);
}

/// A worker's observer: its [`Progress`], its link to the agent and its live figures.
pub struct Supervised<P> {
    /// Lines and progress.
    pub progress: P,
    /// The heartbeat, chaos fault, SIGTERM handler and store of this worker.
    pub sup: Supervision,
    /// The live metrics this worker publishes.
    pub live: Live,
}

impl<P: Progress> Observer for Supervised<P> {
    fn line(&mut self, text: &str) {
        self.progress.line(text);
    }

    fn resumed(&mut self, step: u64, steps: u64) {
        self.progress.start(step, steps);
        self.sup.resumed(step);
    }

    fn starting(&mut self) {
        self.sup.starting();
    }

    fn completed(&mut self, s: &train::StepStats) -> Result<(), train::BoxError> {
        self.progress.step(s);
        let compute = std::time::Duration::from_secs_f64((s.seconds - s.comm_seconds).max(0.0));
        self.sup.completed(s.step, compute).map_err(Into::into)
    }

    fn finishing(&mut self) {
        self.progress.finish();
        self.sup.finishing();
    }

    fn recorded(&mut self, r: &train::metrics_log::StepRecord) {
        let f = StepFigures {
            step: r.step,
            loss: r.loss,
            val_loss: r.val_loss,
            tokens_per_s: r.tokens_per_s,
            mfu: r.mfu,
            step_s: r.step_s,
            comm_s: r.comm_s,
            data_s: r.data_s,
            ckpt_pause_s: r.ckpt_pause_s,
        };
        self.live.add_step(self.sup.rank, f);
    }

    fn straggler(&mut self, st: &train::straggler::Straggler) {
        let (rank, slowdown, step) = (st.rank, st.slowdown, st.step);
        self.sup.straggler(&Report {
            rank,
            slowdown,
            step,
        });
    }

    fn stop_requested(&mut self) -> bool {
        self.sup.term.is_some_and(|t| t.requested().is_some())
    }
}
