//! The quorum of per-step fault tolerance, kept in the rendezvous store: which replicas take
//! part in each attempt of each step, when a replica was declared down, when a restarted one is
//! ready, and every rank's commit vote (004 §28.8: recovery without stopping the whole job;
//! TorchFT's per-step quorum).
//!
//! Keys (all under `ft/`):
//! - `down/{r}`: how many times replica `r` was declared down (by its agent): its
//!   *incarnation*. A member of a quorum carries the incarnation it was admitted with; a
//!   higher count means that incarnation is gone.
//! - `event/{n}` (with the counter `events`): one key per membership event (a replica declared
//!   down, a rank of a restarted replica ready), so waiting for "something changed" is a
//!   blocking wait on the next event's key.
//! - `ready/{r}/{inc}/{i}`: rank `i` of replica `r`'s incarnation `inc` is built and waits to
//!   be admitted.
//! - `dropped/{r}`: the step whose quorum first left replica `r` out.
//! - `q/{s}/{a}`: the quorum of attempt `a` of step `s`, written once (compare-and-set) by the
//!   first rank to compose it, read by every other.
//! - `admit/{r}/{inc}`: `s a`, the attempt that admitted that incarnation.
//! - `v/{s}/{a}/{rank}`: a rank's commit vote on that attempt.
//! - `done`: the last step is committed (a replica still waiting to rejoin gives up).
use std::time::Duration;

use comm::store::StoreClient;

use crate::error::{Result, TrainError};

/// One replica in a quorum: its id and the incarnation admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// Replica id (`0..replicas`).
    pub replica: usize,
    /// Its incarnation (times it was declared down before this one started).
    pub inc: u64,
}

/// The replicas of one attempt of one step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quorum {
    /// The step (1-based: the step being trained).
    pub step: u64,
    /// The attempt (0 first; each failed attempt of a step is retried with the next).
    pub attempt: u64,
    /// The members, in replica order.
    pub members: Vec<Member>,
    /// Membership events seen when it was composed.
    pub events: u64,
}

impl Quorum {
    /// `r:inc,r:inc|events`.
    fn encode(&self) -> String {
        let m: Vec<String> = (self.members.iter())
            .map(|m| format!("{}:{}", m.replica, m.inc))
            .collect();
        format!("{}|{}", m.join(","), self.events)
    }

    fn decode(step: u64, attempt: u64, v: &[u8]) -> Result<Quorum> {
        let bad = || TrainError::FaultTolerance(format!("malformed quorum of step {step}"));
        let s = std::str::from_utf8(v).map_err(|_| bad())?;
        let (m, e) = s.split_once('|').ok_or_else(bad)?;
        let mut members = Vec::new();
        for part in m.split(',').filter(|p| !p.is_empty()) {
            let (r, i) = part.split_once(':').ok_or_else(bad)?;
            members.push(Member {
                replica: r.parse().map_err(|_| bad())?,
                inc: i.parse().map_err(|_| bad())?,
            });
        }
        Ok(Quorum {
            step,
            attempt,
            members,
            events: e.parse().map_err(|_| bad())?,
        })
    }

    /// Whether replica `r` takes part.
    pub fn has(&self, r: usize) -> bool {
        self.members.iter().any(|m| m.replica == r)
    }

    /// The replica ids, in order.
    pub fn replicas(&self) -> Vec<usize> {
        self.members.iter().map(|m| m.replica).collect()
    }
}

/// The store keys of the protocol.
pub(crate) struct Keys<'a> {
    pub(crate) store: &'a StoreClient,
}

/// Milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn parse_u64(v: Option<Vec<u8>>) -> u64 {
    v.and_then(|b| String::from_utf8(b).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

impl Keys<'_> {
    /// Replica `r`'s current incarnation.
    pub(crate) fn inc(&self, r: usize) -> Result<u64> {
        Ok(parse_u64(self.store.get(&format!("ft/down/{r}"))?))
    }

    /// Membership events so far.
    pub(crate) fn events(&self) -> Result<u64> {
        Ok(parse_u64(self.store.get("ft/events")?))
    }

    /// Records an event (`what` in words) and wakes every waiter.
    pub(crate) fn event(&self, what: &str) -> Result<()> {
        let n = self.store.add("ft/events", 1)?;
        self.store.set(&format!("ft/event/{n}"), what.as_bytes())?;
        Ok(())
    }

    /// Blocks until event `after + 1` exists or `timeout` passes; whether it came.
    pub(crate) fn wait_event(&self, after: u64, timeout: Duration) -> Result<bool> {
        let key = format!("ft/event/{}", after + 1);
        Ok(self.store.wait_for(&[key], timeout)?.is_some())
    }

    /// Declares replica `r` down (its agent): the next incarnation.
    pub fn declare_down(store: &StoreClient, r: usize, why: &str) -> Result<u64> {
        let inc = store.add(&format!("ft/down/{r}"), 1)? as u64;
        store.set(
            &format!("ft/downat/{r}/{inc}"),
            unix_ms().to_string().as_bytes(),
        )?;
        Keys { store }.event(&format!("replica {r} down ({why})"))?;
        Ok(inc)
    }

    /// How long ago replica `r` was declared down, starting incarnation `inc` (the agent that
    /// restarts it and the restarted ranks share a host, hence a clock).
    pub(crate) fn declared_at(&self, r: usize, inc: u64) -> Option<Duration> {
        let at = parse_u64(
            self.store
                .get(&format!("ft/downat/{r}/{inc}"))
                .ok()
                .flatten(),
        );
        (at > 0).then(|| Duration::from_millis(unix_ms().saturating_sub(at)))
    }

    /// Rank `i` of replica `r`'s incarnation `inc` is ready to join.
    pub(crate) fn ready(&self, r: usize, inc: u64, i: usize) -> Result<()> {
        self.store.set(&format!("ft/ready/{r}/{inc}/{i}"), b"1")?;
        self.event(&format!("replica {r} rank {i} ready"))
    }

    /// Whether all `size` ranks of replica `r`'s incarnation `inc` are ready.
    pub(crate) fn all_ready(&self, r: usize, inc: u64, size: usize) -> Result<bool> {
        for i in 0..size {
            if self
                .store
                .get(&format!("ft/ready/{r}/{inc}/{i}"))?
                .is_none()
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The step whose quorum first left replica `r` out, if any did.
    pub(crate) fn dropped(&self, r: usize) -> Result<Option<u64>> {
        let v = self.store.get(&format!("ft/dropped/{r}"))?;
        Ok(v.map(|v| parse_u64(Some(v))))
    }

    pub(crate) fn set_dropped(&self, r: usize, step: u64) -> Result<()> {
        Ok(self
            .store
            .set(&format!("ft/dropped/{r}"), step.to_string().as_bytes())?)
    }

    /// Offers `q` as its step's attempt; returns the one that won (ours or an earlier one).
    pub(crate) fn offer(&self, q: &Quorum) -> Result<Quorum> {
        let key = format!("ft/q/{}/{}", q.step, q.attempt);
        let ours = q.encode();
        let won = self.store.compare_set(&key, None, ours.as_bytes())?;
        match won {
            Some(v) if v != ours.as_bytes() => Quorum::decode(q.step, q.attempt, &v),
            _ => Ok(q.clone()),
        }
    }

    /// The quorum of attempt `a` of step `s`, if composed.
    pub(crate) fn quorum(&self, s: u64, a: u64) -> Result<Option<Quorum>> {
        match self.store.get(&format!("ft/q/{s}/{a}"))? {
            Some(v) => Quorum::decode(s, a, &v).map(Some),
            None => Ok(None),
        }
    }

    /// Marks replica `r`'s incarnation `inc` admitted at attempt `a` of step `s`.
    pub(crate) fn admit(&self, r: usize, inc: u64, s: u64, a: u64) -> Result<()> {
        let key = format!("ft/admit/{r}/{inc}");
        self.store
            .compare_set(&key, None, format!("{s} {a}").as_bytes())?;
        Ok(())
    }

    /// Waits up to `timeout` for the attempt that admits replica `r`'s incarnation `inc`;
    /// None if the job finished first ([`Keys::finish`]).
    pub(crate) fn admitted(
        &self,
        r: usize,
        inc: u64,
        timeout: Duration,
    ) -> Result<Option<(u64, u64)>> {
        let key = format!("ft/admit/{r}/{inc}");
        let deadline = std::time::Instant::now() + timeout;
        let v = loop {
            if let Some(mut v) = self.store.wait_for(&[&key], Duration::from_secs(1))? {
                break v.remove(0);
            }
            if self.store.get("ft/done")?.is_some() {
                return Ok(None);
            }
            if std::time::Instant::now() >= deadline {
                return Err(TrainError::FaultTolerance(format!(
                    "replica {r} was not admitted within {:.0} s",
                    timeout.as_secs_f64()
                )));
            }
        };
        let s = String::from_utf8_lossy(&v);
        let mut it = s.split(' ').map(|t| t.parse::<u64>());
        match (it.next(), it.next()) {
            (Some(Ok(s)), Some(Ok(a))) => Ok(Some((s, a))),
            _ => Err(TrainError::FaultTolerance(format!(
                "malformed admission of replica {r}: {s}"
            ))),
        }
    }

    /// The job trained its last step: a replica still waiting to rejoin gives up.
    pub(crate) fn finish(&self) -> Result<()> {
        Ok(self.store.set("ft/done", b"1")?)
    }

    /// This rank's vote on attempt `a` of step `s`.
    pub(crate) fn vote(&self, s: u64, a: u64, rank: usize, vote: Vote) -> Result<()> {
        Ok(self
            .store
            .set(&format!("ft/v/{s}/{a}/{rank}"), vote.word().as_bytes())?)
    }

    /// The votes of `ranks` on attempt `a` of step `s`, once all exist, waiting up to `timeout`
    /// (None: not all came).
    pub(crate) fn votes(
        &self,
        s: u64,
        a: u64,
        ranks: &[usize],
        timeout: Duration,
    ) -> Result<Option<Vec<Vote>>> {
        let keys: Vec<String> = ranks.iter().map(|r| format!("ft/v/{s}/{a}/{r}")).collect();
        let votes = self.store.wait_for(&keys, timeout)?;
        Ok(votes.map(|vals| vals.iter().map(|v| Vote::parse(v)).collect()))
    }
}

/// A rank's vote on an attempt of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vote {
    /// Its reductions completed: commit.
    Commit,
    /// Commit, and this rank was asked to stop (SIGTERM): every rank stops after the step.
    CommitStop,
    /// Its reductions failed: every rank retries the step.
    Retry,
}

impl Vote {
    fn word(self) -> &'static str {
        match self {
            Vote::Commit => "commit",
            Vote::CommitStop => "stop",
            Vote::Retry => "retry",
        }
    }

    fn parse(v: &[u8]) -> Vote {
        match v {
            b"commit" => Vote::Commit,
            b"stop" => Vote::CommitStop,
            _ => Vote::Retry,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quorum_survives_its_encoding() {
        let q = Quorum {
            step: 7,
            attempt: 1,
            members: vec![Member { replica: 0, inc: 0 }, Member { replica: 2, inc: 3 }],
            events: 9,
        };
        assert_eq!(Quorum::decode(7, 1, q.encode().as_bytes()).unwrap(), q);
        assert!(Quorum::decode(7, 1, b"0:x|1").is_err());
        assert!(Quorum::decode(7, 1, b"0:0").is_err());
        assert_eq!(Vote::parse(b"stop"), Vote::CommitStop);
        assert_eq!(Vote::parse(b"garbage"), Vote::Retry);
    }
}
