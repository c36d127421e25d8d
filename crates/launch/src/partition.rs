//! `--chaos partition@STEP[:NODE[:SECONDS]]`: a node cut off the network, then healed.
//!
//! Mechanism: no firewall and no privileges. The node's workers and its agent each cut their own
//! process off with [`comm::partition::cut_for`]: every collective transfer and store request of
//! the process then waits, neither sending nor receiving, until the partition heals or its own
//! deadline passes. The workers cut themselves right after completing STEP (a heartbeat flush
//! first, so the agents have seen that step); the node's agent cuts itself as soon as it sees
//! one of its workers past STEP, and then sits the partition out ([`Cut::sit_out`]): it makes
//! no store request (the elastic lease thread's renewals wait in the cut), only sleeps until
//! the partition heals. Nothing is closed or reset, so on both sides of the cut the job learns
//! of it only through its timeouts, as from a real partition: the other nodes' collectives time
//! out waiting for the cut node's ranks (`FLOTILLA_TIMEOUT_S`) and their workers fail, or in an
//! elastic job node 0 sees the node's lease stand still. After healing, the cut node's agent
//! finds the generation over (node 0 has moved the job on) and follows it: in a rigid job the
//! next generation starts on every node from the last committed checkpoint; in an elastic job
//! it runs without the cut node, which waits, left out, until the job ends.
//!
//! The same works on a real host and in the network-namespace harness, since it needs nothing
//! from the host. Node 0 cannot be partitioned (it hosts the rendezvous store: cut off, it ends
//! the job everywhere), nor a job of one node (nothing to cut it from): both are refused.
//!
//! SECONDS defaults to twice the time the other nodes take to notice ([`detection`]); a shorter
//! partition than that is refused: healed before the peers' timeouts, it would be a pause that
//! fails nothing, and the plan's later faults (which belong to later generations) could never
//! fire.

use crate::chaos::{Chaos, Fault, FaultKind, MAX_PARTITION_SECS, bad};
use crate::error::{LaunchError, Result};
use crate::watchdog::WatchRules;
use std::time::{Duration, Instant};

/// The time the other nodes take to notice a silent node: the collectives' timeout (what a
/// worker of a rigid job waits for a peer's data, `FLOTILLA_TIMEOUT_S`, read as the workers
/// read it), and in an elastic job at least the lease timeout (`watch`'s heartbeat timeout).
pub fn detection(watch: Option<&WatchRules>, elastic: bool) -> Result<Duration> {
    let collectives = comm::group::GroupConfig::for_training()?.timeout;
    let lease = watch.map(|w| w.heartbeat_timeout).filter(|_| elastic);
    Ok(lease.map_or(collectives, |l| l.max(collectives)))
}

/// A partition's duration when the plan gives none: twice `detection`, in whole seconds (at
/// most [`MAX_PARTITION_SECS`]).
pub fn default_duration(detection: Duration) -> Duration {
    let secs = (2.0 * detection.as_secs_f64()).ceil() as u64;
    Duration::from_secs(secs.clamp(1, u64::from(MAX_PARTITION_SECS)))
}

/// Refuses the plan's partitions that could not do what they say in a job of `nnodes` nodes
/// whose peers notice a silent node after `detection` (see the module docs).
pub fn check(plan: &Chaos, nnodes: usize, detection: Duration) -> Result<()> {
    for f in &plan.faults {
        let FaultKind::Partition(secs) = f.kind else {
            continue;
        };
        if nnodes < 2 {
            return Err(bad(
                "partition",
                "a partition cuts a node off the others: it needs a job of at least 2 nodes \
                 (--nnodes), and cannot cut node 0, which hosts the store",
            ));
        }
        match f.rank {
            Some(0) => {
                return Err(bad(
                    "partition@...:0",
                    "node 0 hosts the rendezvous store: cut off, it ends the job on every node \
                     (the store has no failover to recover from that); partition another node",
                ));
            }
            Some(n) if n >= nnodes => {
                return Err(bad(
                    &format!("partition@...:{n}"),
                    format!("no node {n} in a job of --nnodes {nnodes}"),
                ));
            }
            _ => {}
        }
        let least = default_duration(detection);
        if let Some(s) = secs
            && Duration::from_secs(u64::from(s)) < least
        {
            return Err(bad(
                &format!("partition@...:{s}"),
                format!(
                    "a {s} s partition heals before the other nodes could notice it (their \
                     timeout is {:.1} s; FLOTILLA_TIMEOUT_S sets the collectives'): give at \
                     least {} s, twice that, or leave SECONDS out",
                    detection.as_secs_f64(),
                    least.as_secs()
                ),
            ));
        }
    }
    Ok(())
}

/// A partition of this node that its agent has yet to sit out.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cut {
    fault: Fault,
    duration: Duration,
}

impl Cut {
    /// The partition among `faults` that cuts off node `node`, if any.
    pub(crate) fn of(faults: &[Fault], node: usize) -> Option<Cut> {
        faults.iter().find_map(|&f| {
            let duration = f.partition()?;
            (f.rank == node).then_some(Cut { fault: f, duration })
        })
    }

    /// Whether it begins: a local worker reported a step at or past the fault's.
    pub(crate) fn due(&self, seen: Option<u64>) -> bool {
        seen.is_some_and(|s| s >= self.fault.step)
    }

    /// Cuts this agent off for the partition's duration and sleeps through it (no store
    /// request leaves meanwhile), at most until `job_deadline`.
    pub(crate) fn sit_out(&self, job_deadline: Instant, say: &impl Fn(String)) -> Result<()> {
        let t0 = Instant::now();
        let left = job_deadline.saturating_duration_since(t0);
        if left.is_zero() {
            return Err(LaunchError::Aborted(format!(
                "chaos {}: the job deadline passed",
                self.fault
            )));
        }
        say(format!(
            "chaos: {}: this node is cut off the network for {} s after step {} (its agent and \
             workers neither send nor receive)",
            self.fault,
            self.duration.as_secs(),
            self.fault.step
        ));
        comm::partition::cut_for(self.duration);
        std::thread::sleep(self.duration.min(left));
        say(format!(
            "chaos: {}: partition healed after {:.1} s; rejoining the job",
            self.fault,
            t0.elapsed().as_secs_f64()
        ));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_that_cannot_do_what_they_say_are_refused() {
        let d = Duration::from_secs(3);
        assert_eq!(default_duration(d), Duration::from_secs(6));
        assert_eq!(
            default_duration(Duration::from_millis(1200)),
            Duration::from_secs(3)
        );
        let ok = Chaos::parse("partition@3:2:6,partition@4,partition@5:1").unwrap();
        assert!(check(&ok, 3, d).is_ok());
        for (plan, nnodes, needle) in [
            ("partition@3", 1, "at least 2 nodes"),
            ("partition@3:0", 3, "node 0 hosts the rendezvous store"),
            ("partition@3:3", 3, "no node 3"),
            ("partition@3:1:5", 3, "at least 6 s"),
        ] {
            let e = check(&Chaos::parse(plan).unwrap(), nnodes, d).unwrap_err();
            assert!(e.to_string().contains(needle), "{plan}: {e}");
        }
        for (plan, needle) in [
            ("partition@3:1:0", "SECONDS"),
            ("partition@3:1:99999", "SECONDS"),
            ("partition@3:x", "NODE"),
        ] {
            let e = Chaos::parse(plan).unwrap_err().to_string();
            assert!(e.contains(needle), "{plan}: {e}");
        }
    }

    #[test]
    fn a_cut_is_its_nodes_and_begins_at_its_step() {
        let faults = Fault::parse_list("slow@2:0:2,partition@4:2:6").unwrap();
        assert!(Cut::of(&faults, 1).is_none());
        let cut = Cut::of(&faults, 2).unwrap();
        assert_eq!(cut.duration, Duration::from_secs(6));
        assert!(!cut.due(None) && !cut.due(Some(3)));
        assert!(cut.due(Some(4)) && cut.due(Some(5)));
    }
}
