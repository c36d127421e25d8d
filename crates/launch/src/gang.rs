//! Job-level coordination of the agents through the store hosted by the leader (004 section
//! 28.8, Algorithm 28.2: gang admission with a deadline; nothing runs until the whole gang is
//! there). The leader is node 0 until its store is lost; then the node whose standby store took
//! over ([`crate::failover`]). "Node 0" below means the leader.
//!
//! Keys, all under `launch/g{generation}/` and written with that generation's stamp, so the
//! store refuses anything an agent or worker of an older generation still tries to say:
//! - `node/{i}`: node i's agent is ready to start its workers (admission): its
//!   [`Registration`] (identity and run configuration), written only if no other agent holds
//!   the rank; node 0 refuses the job when a registration's configuration differs from its own
//!   ([`crate::agree`]);
//! - `members`: the nodes node 0 admitted, in rank order ([`Membership`]); with `--nnodes
//!   MIN:MAX` that is every registered node once all MAX are there, or once at least MIN are
//!   and every missing node is lost (its lease stood still, see [`crate::elastic`]) or the
//!   admission deadline has passed; or `refused: WHY` when admission was refused (compare-and-
//!   set: a refusal and the member list exclude each other);
//! - `failed`: the first failure of the generation, as text (compare-and-set: first wins);
//!   every agent polls it and stops its workers when it appears;
//! - `failure-seen/{i}`: member i read the failure and stopped its workers (node 0 waits a
//!   moment for these before it moves the job on);
//! - `verdict`: node 0's decision after a failure, `abort: ...` (else the generation moves on);
//! - `done/{i}`, `complete`, `ack/{i}`: node i's workers all succeeded; node 0 saw all nodes
//!   done; node i saw that.
//!
//! `launch/restarts` counts the job's restarts (node 0 adds to it); `launch/lease/{i}` is node
//! i's lease counter in an elastic job (it spans generations); `launch/excluded` lists the nodes
//! dropped as stragglers (so a leader taking over keeps them out); the store's generation
//! counter is the generation itself, bumped by node 0 only.

use crate::agree::{self, Registration};
use crate::elastic::{Leases, Membership, NodeRange};
use crate::error::{LaunchError, Result};
use crate::heartbeat::{self, Beat};
use comm::CommError;
use comm::store::StoreClient;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often an agent re-reads the store while waiting for another agent.
pub const POLL: Duration = Duration::from_millis(100);

/// Node 0's decision after a failed generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Start this generation.
    Restart(u64),
    /// Give up, for this reason.
    Abort(String),
}

/// The outcome of gang admission for this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admitted {
    /// This node runs in the generation, with these members.
    Member(Membership),
    /// The generation runs without this node (it registered too late): these are its members.
    Excluded(Membership),
}

/// What an excluded node saw while it waited for the job to move on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// A new generation it may register for.
    Generation(u64),
    /// The job completed without it.
    Complete,
    /// Node 0 gave up on the job, for this reason.
    Abort(String),
}

/// One agent's view of the job's keys.
pub struct Gang<'a> {
    store: &'a StoreClient,
    /// Nodes the job may run on.
    pub nodes: NodeRange,
    /// This node.
    pub node: usize,
    /// Node 0: the other nodes' leases.
    leases: Mutex<Leases>,
    /// What this agent registers with: its identity and run configuration.
    registration: Registration,
    /// Node 0: nodes dropped from the job (`--straggler exclude`), never admitted again (the
    /// other nodes keep a copy read at admission, for a failover).
    excluded: Mutex<Vec<usize>>,
    /// The node that decides the generations (node 0 until a failover).
    leader: AtomicUsize,
    /// The last step read in any heartbeat ([`Gang::beat`]) plus one; 0: none.
    last_step: AtomicU64,
}

/// The store key listing the nodes dropped as stragglers.
pub(crate) const EXCLUDED_KEY: &str = "launch/excluded";

/// The prefix of a `members` value that refuses admission.
const REFUSED: &str = "refused: ";
/// How long node 0 waits for the registered nodes to read a refusal before its store goes.
const REFUSAL_LINGER: Duration = Duration::from_secs(5);

fn key(g: u64, what: &str) -> String {
    format!("launch/g{g}/{what}")
}

impl<'a> Gang<'a> {
    /// Coordination through `store` for node `node` of a job on `nodes` nodes (`3` or a
    /// [`NodeRange`]); node 0 judges the others' leases with `lease_timeout`.
    pub fn new(
        store: &'a StoreClient,
        nodes: impl Into<NodeRange>,
        node: usize,
        lease_timeout: Duration,
    ) -> Gang<'a> {
        Gang {
            store,
            nodes: nodes.into(),
            node,
            leases: Mutex::new(Leases::new(lease_timeout)),
            registration: Registration::new(Vec::new()),
            excluded: Mutex::new(Vec::new()),
            leader: AtomicUsize::new(0),
            last_step: AtomicU64::new(0),
        }
    }

    /// The store this agent coordinates through.
    pub(crate) fn store(&self) -> &StoreClient {
        self.store
    }

    /// This agent registers with the run configuration `fields` (see [`crate::agree`]): node
    /// 0 refuses admission to nodes whose fields differ from its own.
    pub fn with_agreement(mut self, fields: Vec<(String, String)>) -> Gang<'a> {
        self.registration = Registration::new(fields);
        self
    }

    /// The digest of this agent's run configuration ([`Registration::digest`]).
    pub fn digest(&self) -> String {
        self.registration.digest()
    }

    /// Registers this node for generation `g` unless another agent holds its rank: `Ok(None)`
    /// when registered, else that agent's identity.
    fn register(&self, g: u64) -> Result<Option<String>> {
        let me = self.registration.encode();
        let k = key(g, &format!("node/{}", self.node));
        match self.store.compare_set(&k, None, me.as_bytes())? {
            Some(v) if v == me.as_bytes() => Ok(None),
            Some(v) => Ok(Some(Registration::decode(&v).map_or_else(
                || String::from_utf8_lossy(&v).into_owned(),
                |r| r.agent,
            ))),
            None => Err(LaunchError::invalid(
                "store",
                k,
                "compare-and-set of an absent key left it absent",
            )),
        }
    }

    /// Refuses admission to generation `g` for the whole job with `why` unless the member list
    /// is already out; the error this agent ends with either way.
    fn refuse(&self, g: u64, why: String) -> Result<LaunchError> {
        let text = format!("{REFUSED}{why}");
        self.store
            .compare_set(&key(g, "members"), None, text.as_bytes())?;
        Ok(LaunchError::Refused(why))
    }

    /// Node 0, after refusing generation `g`: waits (at most [`REFUSAL_LINGER`]) until the
    /// registered nodes `nodes` have read the refusal, so they end with it instead of a lost
    /// store.
    fn linger_refused(&self, g: u64, nodes: &[usize]) {
        let seen: Vec<String> = nodes
            .iter()
            .filter(|&&n| n != self.node)
            .map(|n| key(g, &format!("refusal-seen/{n}")))
            .collect();
        if !seen.is_empty()
            && let Err(e) = self.store.wait(&seen, REFUSAL_LINGER)
        {
            tracing::debug!("not every node saw the refusal: {e}");
        }
    }

    /// Registers this node for generation `g`; node 0 then decides the members (see the module
    /// docs) within `timeout`, the others wait for that decision (a little longer). On timeout
    /// with fewer than MIN nodes, names the missing ones (no worker has been started).
    ///
    /// Refused (for the whole job, before any worker starts) when a node's run configuration
    /// differs from node 0's, or when another agent already registered this node's rank while
    /// admission was open; a second agent arriving after the member list is out is refused
    /// alone (an elastic job instead treats it as a node returning: it waits for the next
    /// generation).
    pub fn admit(&self, g: u64, timeout: Duration) -> Result<Admitted> {
        let start = Instant::now();
        if let Some(holder) = self.register(g)? {
            let why = agree::duplicate(self.node, g, &holder, &self.registration.agent);
            match self.store.get(&key(g, "members"))? {
                None => return Err(self.refuse(g, why)?),
                Some(m) if m.starts_with(REFUSED.as_bytes()) => {
                    return Err(LaunchError::Refused(why));
                }
                Some(m) if self.nodes.is_elastic() => {
                    if let Some(m) = Membership::decode(&m) {
                        return Ok(Admitted::Excluded(m));
                    }
                }
                Some(_) => {}
            }
            return Err(LaunchError::Refused(why));
        }
        if !self.leads() {
            // Node 0 decides within `timeout` of its own start; allow for it starting later.
            let wait = timeout + timeout.min(Duration::from_secs(30));
            let text = match self.store.wait_one(&key(g, "members"), wait) {
                Ok(t) => t,
                Err(CommError::Store(_)) => {
                    return Err(LaunchError::Admission {
                        generation: g,
                        waited: start.elapsed(),
                        missing: vec![self.leader()],
                    });
                }
                Err(e) => return Err(e.into()),
            };
            if let Some(why) = text.strip_prefix(REFUSED.as_bytes()) {
                let seen = key(g, &format!("refusal-seen/{}", self.node));
                if let Err(e) = self.store.set(&seen, b"1") {
                    tracing::debug!("refusal acknowledgement: {e}");
                }
                return Err(LaunchError::Refused(
                    String::from_utf8_lossy(why).into_owned(),
                ));
            }
            let m = Membership::decode(&text).ok_or_else(|| {
                LaunchError::invalid(
                    "membership",
                    String::from_utf8_lossy(&text),
                    format!("node 0 published a malformed member list for generation {g}"),
                )
            })?;
            self.load_excluded();
            return Ok(match m.slot(self.node) {
                Some(_) => Admitted::Member(m),
                None => Admitted::Excluded(m),
            });
        }
        let deadline = start + timeout;
        loop {
            let now = Instant::now();
            let mut leases = self.leases();
            leases.poll(self.store, (0..self.nodes.max).filter(|&n| n != self.node))?;
            let mut registered = Vec::new();
            let mut missing = Vec::new();
            let mut refusals = Vec::new();
            let excluded = self
                .excluded
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            for i in 0..self.nodes.max {
                // A node that registered and then went silent is not admitted: it would only
                // fail the generation again; nor is one dropped as a straggler.
                let live = leases.lost(i, now).is_none() && !excluded.contains(&i);
                match self.store.get(&key(g, &format!("node/{i}")))? {
                    Some(r) if live => {
                        registered.push(i);
                        if let Some(r) = Registration::decode(&r) {
                            let d = self.registration.differences(0, &r, i);
                            if !d.is_empty() {
                                refusals.push(agree::mismatch(0, i, &d));
                            }
                        }
                    }
                    _ => missing.push(i),
                }
            }
            if let Some(m) = self.store.get(&key(g, "members"))?
                && let Some(why) = m.strip_prefix(REFUSED.as_bytes())
            {
                self.linger_refused(g, &registered);
                return Err(LaunchError::Refused(
                    String::from_utf8_lossy(why).into_owned(),
                ));
            }
            if !refusals.is_empty() {
                let e = self.refuse(g, refusals.join("; "))?;
                self.linger_refused(g, &registered);
                return Err(e);
            }
            let enough = registered.len() >= self.nodes.min;
            let all_lost =
                (missing.iter()).all(|&i| leases.lost(i, now).is_some() || excluded.contains(&i));
            if missing.is_empty() || (enough && (all_lost || now >= deadline)) {
                // Only elastic members renew leases: a rigid job's members, never renewing,
                // would all be judged lost at the next admission after the lease timeout.
                for &n in registered
                    .iter()
                    .filter(|&&n| n != self.node && self.nodes.is_elastic())
                {
                    leases.admitted(n, now);
                }
                let m = Membership { nodes: registered };
                let text = m.encode();
                let now = self
                    .store
                    .compare_set(&key(g, "members"), None, text.as_bytes())?;
                // A duplicate agent refused the generation in the meantime: the next poll
                // reads the refusal.
                if now.as_deref() == Some(text.as_bytes()) {
                    return Ok(Admitted::Member(m));
                }
                continue;
            }
            if now >= deadline {
                return Err(LaunchError::Admission {
                    generation: g,
                    waited: start.elapsed(),
                    missing,
                });
            }
            drop(leases);
            std::thread::sleep(POLL);
        }
    }

    /// The lease record (a poisoned lock still holds valid observations).
    fn leases(&self) -> MutexGuard<'_, Leases> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An excluded node: waits (at most `timeout`) for the job to start a new generation,
    /// complete without it, or abort. Generation `g` is the one it was left out of.
    pub fn await_next(&self, g: u64, timeout: Duration) -> Result<Next> {
        let start = Instant::now();
        loop {
            let now = self.store.generation()?;
            if now > g {
                self.store.set_generation(now);
                return Ok(Next::Generation(now));
            }
            let read = |what: &str| match self.store.get(&key(g, what)) {
                Ok(v) => Ok(v.map(|v| String::from_utf8_lossy(&v).into_owned())),
                // The generation moved on meanwhile: the next look at it says so.
                Err(CommError::StaleGeneration { .. }) => Ok(None),
                Err(e) => Err(e),
            };
            if read("complete")?.is_some() {
                // Node 0 waits a moment for this from a node it dropped (`--straggler
                // exclude`) before its store goes away.
                if let Err(e) = self.store.set(&key(g, &format!("ack/{}", self.node)), b"1") {
                    tracing::debug!("end-of-job acknowledgement: {e}");
                }
                return Ok(Next::Complete);
            }
            if let Some(v) = read("verdict")? {
                let why = v.strip_prefix("abort: ").unwrap_or(&v);
                return Ok(Next::Abort(why.to_string()));
            }
            if start.elapsed() >= timeout {
                return Err(LaunchError::Excluded {
                    node: self.node,
                    generation: g,
                    waited: start.elapsed(),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// Another member: says it read generation `g`'s failure (best effort: node 0 may have
    /// moved on already, and only waits a moment for this).
    pub fn failure_seen(&self, g: u64) {
        if let Err(e) = self
            .store
            .set(&key(g, &format!("failure-seen/{}", self.node)), b"1")
        {
            tracing::debug!("failure acknowledgement: {e}");
        }
    }

    /// Node 0: waits, at most `bound`, until every member of `m` not known lost has read
    /// generation `g`'s failure, so the generation moves on after they know why it ended.
    pub fn await_failure_seen(&self, g: u64, m: &Membership, bound: Duration) -> Result<()> {
        let now = Instant::now();
        let keys: Vec<String> = {
            let leases = self.leases();
            m.nodes
                .iter()
                .filter(|&&n| n != self.node && leases.lost(n, now).is_none())
                .map(|n| key(g, &format!("failure-seen/{n}")))
                .collect()
        };
        if keys.is_empty() {
            return Ok(());
        }
        match self.store.wait(&keys, bound) {
            Ok(_) | Err(CommError::Store(_)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Publishes `failure` as generation `g`'s failure unless one is there; returns the one
    /// that stands (the first).
    pub fn report_failure(&self, g: u64, failure: &str) -> Result<String> {
        let now = self
            .store
            .compare_set(&key(g, "failed"), None, failure.as_bytes())?;
        Ok(now.map_or_else(
            || failure.to_string(),
            |v| String::from_utf8_lossy(&v).into_owned(),
        ))
    }

    /// Generation `g`'s failure, if any agent reported one.
    pub fn failure(&self, g: u64) -> Result<Option<String>> {
        Ok(self
            .store
            .get(&key(g, "failed"))?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }

    /// Counts one more restart for the job; returns the count (node 0).
    pub fn count_restart(&self) -> Result<u64> {
        Ok(self.store.add("launch/restarts", 1)?.max(0) as u64)
    }

    /// Node 0: gives up on the job after generation `g` (members `m`), then waits (at most
    /// `linger`) until the other members have read that, before its store goes away.
    pub fn abort(&self, g: u64, m: &Membership, why: &str, linger: Duration) -> Result<()> {
        self.store
            .set(&key(g, "verdict"), format!("abort: {why}").as_bytes())?;
        let seen: Vec<String> = (m.nodes.iter())
            .filter(|&&n| n != self.node)
            .map(|i| key(g, &format!("abort-seen/{i}")))
            .collect();
        if !seen.is_empty()
            && let Err(e) = self.store.wait(&seen, linger)
        {
            tracing::warn!("not every node saw the job abort: {e}");
        }
        Ok(())
    }

    /// Node 0: moves the job from generation `g` to the next and stamps this agent with it.
    pub fn advance(&self, g: u64) -> Result<u64> {
        let next = self.store.bump_generation(g)?;
        self.store.set_generation(next);
        Ok(next)
    }

    /// Other nodes: waits (at most `timeout`) for node 0 to restart or abort after `g` failed.
    pub fn await_decision(&self, g: u64, timeout: Duration) -> Result<Decision> {
        let deadline = Instant::now() + timeout;
        loop {
            let now = self.store.generation()?;
            if now > g {
                self.store.set_generation(now);
                return Ok(Decision::Restart(now));
            }
            match self.store.get(&key(g, "verdict")) {
                Ok(Some(v)) => {
                    let v = String::from_utf8_lossy(&v);
                    if let Some(why) = v.strip_prefix("abort: ") {
                        let seen = key(g, &format!("abort-seen/{}", self.node));
                        if let Err(e) = self.store.set(&seen, b"1") {
                            tracing::debug!("abort acknowledgement: {e}");
                        }
                        return Ok(Decision::Abort(why.to_string()));
                    }
                }
                Ok(None) | Err(CommError::StaleGeneration { .. }) => {}
                Err(e) => return Err(e.into()),
            }
            if Instant::now() >= deadline {
                return Err(LaunchError::NoDecision(timeout, g));
            }
            std::thread::sleep(POLL);
        }
    }

    /// Rank `rank`'s latest heartbeat in generation `g` (`None`: none yet, or malformed).
    pub fn beat(&self, g: u64, rank: usize) -> Result<Option<Beat>> {
        let beat = (self.store.get(&heartbeat::key(g, rank))?).and_then(|v| Beat::decode(&v));
        if let Some(step) = beat.and_then(|b| b.step) {
            self.last_step.fetch_max(step + 1, Ordering::SeqCst);
        }
        Ok(beat)
    }

    /// This node's workers of generation `g` all succeeded.
    pub fn mark_done(&self, g: u64) -> Result<()> {
        self.store
            .set(&key(g, &format!("done/{}", self.node)), b"1")?;
        Ok(())
    }

    /// Whether the job is complete in generation `g` (members `m`). Node 0 declares it (every
    /// member done) and then waits, at most `linger`, for the others to acknowledge before its
    /// store goes away; other members acknowledge it.
    pub fn complete(&self, g: u64, m: &Membership, linger: Duration) -> Result<bool> {
        if self.leads() {
            for i in &m.nodes {
                if self.store.get(&key(g, &format!("done/{i}")))?.is_none() {
                    return Ok(false);
                }
            }
            self.store.set(&key(g, "complete"), b"1")?;
            // Dropped nodes still renewing their lease (a dead one is not waited for).
            let mut dropped = self
                .excluded
                .lock()
                .map_or_else(|p| p.into_inner().clone(), |e| e.clone());
            if !dropped.is_empty() {
                let mut leases = self.leases();
                leases.poll(self.store, dropped.iter().copied())?;
                let now = Instant::now();
                dropped.retain(|&n| leases.lost(n, now).is_none());
            }
            let acks: Vec<String> = (m.nodes.iter())
                .filter(|&&n| n != self.node)
                .chain(&dropped)
                .map(|i| key(g, &format!("ack/{i}")))
                .collect();
            if !acks.is_empty()
                && let Err(e) = self.store.wait(&acks, linger)
            {
                tracing::warn!("not every node acknowledged the end of the job: {e}");
            }
            return Ok(true);
        }
        if self.store.get(&key(g, "complete"))?.is_none() {
            return Ok(false);
        }
        // Node 0 may shut its store down as soon as the ack lands, before the reply reaches us:
        // the job is complete either way.
        if let Err(e) = self.store.set(&key(g, &format!("ack/{}", self.node)), b"1") {
            tracing::debug!("end-of-job acknowledgement: {e}");
        }
        Ok(true)
    }
}

// Leadership, membership changes and what survives a failover (split off for size).
#[path = "gang_members.rs"]
mod members;

#[cfg(test)]
#[path = "gang_tests.rs"]
mod tests;
