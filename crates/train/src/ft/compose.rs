//! Composing a step's quorum ([`super::FaultTolerance::compose`]): the last committed
//! members less those declared down, plus restarted replicas that are ready once the step is
//! `join_after` past the one that dropped them.
use std::time::{Duration, Instant};

use super::FaultTolerance;
use super::quorum::{Member, Quorum};
use crate::error::{Result, TrainError};

impl FaultTolerance {
    /// Composes the quorum of attempt `attempt` of `step` (see the module docs) and offers it;
    /// returns the one every rank uses.
    pub(super) fn compose(&self, step: u64, attempt: u64) -> Result<Quorum> {
        let keys = self.keys();
        let started = Instant::now();
        loop {
            if let Some(q) = keys.quorum(step, attempt)? {
                return Ok(q);
            }
            let events = keys.events()?;
            let base = match attempt {
                0 => self.state().committed.clone(),
                a => keys.quorum(step, a - 1)?,
            };
            let base = base.map_or_else(
                || {
                    (0..self.cfg.replicas)
                        .map(|r| Member { replica: r, inc: 0 })
                        .collect()
                },
                |q| q.members,
            );
            let mut members = Vec::new();
            for m in &base {
                if keys.inc(m.replica)? == m.inc {
                    members.push(*m);
                }
            }
            if attempt > 0 && members.len() == base.len() {
                // A failed attempt whose members are all still up: wait for the failure to be
                // declared (or the quorum to be composed by another rank).
                if started.elapsed() > self.cfg.retry_timeout {
                    return Err(TrainError::FaultTolerance(format!(
                        "step {step} failed but no replica was declared down within {:.0} s",
                        self.cfg.retry_timeout.as_secs_f64()
                    )));
                }
                keys.wait_event(events, Duration::from_millis(200))?;
                continue;
            }
            let mut waiting = None;
            for r in 0..self.cfg.replicas {
                if members.iter().any(|m| m.replica == r) || base.iter().any(|m| m.replica == r) {
                    continue;
                }
                let Some(dropped) = keys.dropped(r)? else {
                    continue;
                };
                if step < dropped + self.cfg.join_after {
                    continue;
                }
                let inc = keys.inc(r)?;
                if inc > 0 && keys.all_ready(r, inc, self.cfg.replica_size.max(1))? {
                    members.push(Member { replica: r, inc });
                } else {
                    waiting = Some(r);
                }
            }
            if let Some(r) = waiting {
                if started.elapsed() < self.cfg.join_timeout {
                    keys.wait_event(events, Duration::from_millis(200))?;
                    continue;
                }
                // Not ready in time: go on without it and give it another `join_after` steps.
                keys.set_dropped(r, step)?;
                self.state().lines.push(format!(
                    "# ft: replica {r} was not ready to rejoin at step {step} within {:.0} s; \
                     training on without it",
                    self.cfg.join_timeout.as_secs_f64()
                ));
            }
            members.sort_by_key(|m| m.replica);
            let offered = Quorum {
                step,
                attempt,
                members,
                events,
            };
            let q = keys.offer(&offered)?;
            if q == offered {
                for m in &base {
                    if !q.has(m.replica) {
                        keys.set_dropped(m.replica, step)?;
                    }
                }
                for m in q.members.iter().filter(|m| !base.contains(m)) {
                    keys.admit(m.replica, m.inc, step, attempt)?;
                }
            }
            return Ok(q);
        }
    }
}
