//! Per-step fault tolerance (`--ft`): the job's data-parallel replica groups agree on a quorum
//! every step, and a replica that fails is left out while the others go on; its restart
//! rejoins at a step boundary with the parameters and optimizer state of a live replica, read
//! over the network, not from storage (001 §12.5-12.8: at scale a failure every few hours;
//! 004 §28.7-28.8: checkpoint restarts as the main loss of goodput). TorchFT's model, with
//! hybrid sharding (HSDP): ZeRO shards the state inside each replica group, fault tolerance
//! works across the groups, and a replica group fails and rejoins as a unit.
//!
//! One step under `--ft` ([`FaultTolerance`]):
//! 1. [`FaultTolerance::begin`]: the quorum of this attempt of the step (the first rank to
//!    arrive composes it from the last committed one, leaving out replicas whose agent declared
//!    them down, and admitting a restarted replica once it is ready and the step is
//!    [`FtConfig::join_after`] steps past the one that dropped it); the cross-replica groups are
//!    rebuilt when the members changed, and a joiner receives the state from the first
//!    surviving member.
//! 2. The step's gradients are summed inside the replica group (ZeRO) and then across the
//!    quorum's replicas ([`FaultTolerance::sum`]); the mean divides by the replicas present.
//! 3. [`FaultTolerance::commit`]: every rank of every member votes; the step's optimizer update
//!    runs only if every vote says its sums completed. Otherwise (a replica died during the
//!    step) every survivor retries the same step, on the same batch, with the next attempt's
//!    quorum: a step is never lost on a survivor, and no survivor applies a sum the others did
//!    not see.
//!
//! The lost replica's rows of the global batch are **skipped**, not re-assigned: each replica
//! keeps reading the rows of its place in the full data-parallel world, so a step without
//! replica `r` trains on the other replicas' rows only and the mean is over them. Skipping keeps
//! every survivor's step the same size (re-assigning would make the survivors' steps
//! `R/(R-1)` times longer, the slowdown fault tolerance is there to avoid) and keeps the data
//! order a function of the quorum history alone: two runs with the same fault schedule
//! (`--chaos kill@S:R`, whose kills land between steps) train on the same rows and end
//! bit-identical. A rejoin happens at a step fixed by the schedule (the drop step plus
//! `join_after`), the survivors waiting there for the joiner if it is not ready yet.
mod compose;
mod quorum;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use comm::group::{GroupConfig, ProcessGroup, Rendezvous};
use comm::store::StoreClient;

use crate::error::{Result, TrainError};
use quorum::Keys;
pub use quorum::{Member, Quorum, Vote};

/// How a fault-tolerant job is cut into replicas.
#[derive(Clone, Debug, PartialEq)]
pub struct FtConfig {
    /// Ranks per replica group (ZeRO shards inside it; 1 without `--dp-shard`).
    pub replica_size: usize,
    /// Replica groups in the job.
    pub replicas: usize,
    /// Steps after the step that dropped a replica before its restart may rejoin.
    pub join_after: u64,
    /// How long the survivors wait at that step for a joiner that is not ready.
    pub join_timeout: Duration,
    /// How long a retry waits for a member of the failed attempt to be declared down.
    pub retry_timeout: Duration,
}

/// What a fault-tolerant rank keeps for the current and last committed steps.
struct State {
    /// The quorum of the attempt in progress.
    current: Option<Quorum>,
    /// The quorum of the last committed step (None before the first one: everyone).
    committed: Option<Quorum>,
    /// Attempt of the step in progress.
    attempt: u64,
    /// The cross-replica group of the current members (None: alone).
    group: Option<(Vec<Member>, ProcessGroup)>,
    /// A sum of this attempt failed.
    broken: bool,
    /// Whether this rank's vote on the current attempt is cast.
    voted: bool,
    /// The ranks agreed to stop after the committed step.
    stop_agreed: bool,
    /// A joiner's admission (step, attempt), until its first commit.
    admitted: Option<(u64, u64)>,
    /// Lines to report.
    lines: Vec<String>,
    /// This rank was asked to stop (SIGTERM): said in its next vote.
    stop_wanted: bool,
    /// When the current step's first attempt began (for the retry time).
    began: Option<Instant>,
    /// Seconds spent in failed attempts and waiting for quorums, not yet reported.
    lost_s: f64,
}

/// This rank's side of the per-step quorum.
pub struct FaultTolerance {
    cfg: FtConfig,
    rdv: Rendezvous,
    store: StoreClient,
    /// Global rank.
    rank: usize,
    /// Replica id and rank inside it.
    replica: usize,
    inner: usize,
    /// This process's incarnation of its replica.
    inc: u64,
    state: Mutex<State>,
}

/// What [`FaultTolerance::begin`] found.
pub struct Begun {
    /// The state is to be sent to new members: the donor's place in the cross-replica group.
    pub transfer_from: Option<usize>,
    /// This rank receives it (a joiner).
    pub receiving: bool,
    /// The step this attempt trains (a joiner's admission step).
    pub step: u64,
}

impl FaultTolerance {
    /// Rank `rank` of a fault-tolerant job cut as `cfg`. A replica whose agent declared it down
    /// before (a restart) registers as ready and waits to be admitted.
    pub fn join(rdv: &Rendezvous, rank: usize, cfg: FtConfig) -> Result<FaultTolerance> {
        let g = cfg.replica_size.max(1);
        if cfg.replicas * g == 0 || rank >= cfg.replicas * g {
            return Err(TrainError::FaultTolerance(format!(
                "rank {rank} is outside {} replicas of {g}",
                cfg.replicas
            )));
        }
        let store = rdv.connect(Duration::from_secs(30))?;
        let (replica, inner) = (rank / g, rank % g);
        let inc = Keys { store: &store }.inc(replica)?;
        let ft = FaultTolerance {
            cfg,
            rdv: rdv.clone(),
            store,
            rank,
            replica,
            inner,
            inc,
            state: Mutex::new(State {
                current: None,
                committed: None,
                attempt: 0,
                group: None,
                broken: false,
                voted: false,
                stop_agreed: false,
                admitted: None,
                lines: Vec::new(),
                stop_wanted: false,
                began: None,
                lost_s: 0.0,
            }),
        };
        if inc > 0 {
            ft.keys().ready(replica, inc, inner)?;
        }
        Ok(ft)
    }

    fn keys(&self) -> Keys<'_> {
        Keys { store: &self.store }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This rank's replica.
    pub fn replica(&self) -> usize {
        self.replica
    }

    /// This process's incarnation of its replica (0: first start).
    pub fn incarnation(&self) -> u64 {
        self.inc
    }

    /// Ranks per replica group.
    pub fn replica_size(&self) -> usize {
        self.cfg.replica_size.max(1)
    }

    /// Steps after a replica's drop before its restart may rejoin.
    pub fn join_after(&self) -> u64 {
        self.cfg.join_after
    }

    /// Replicas in the job.
    pub fn replicas(&self) -> usize {
        self.cfg.replicas
    }

    /// Whether this process is a restarted replica that has not committed a step yet.
    pub fn joining(&self) -> bool {
        self.inc > 0 && self.state().committed.is_none()
    }

    /// Replicas taking part in the attempt in progress (1 before any).
    pub fn participants(&self) -> usize {
        self.state().current.as_ref().map_or(1, |q| q.members.len())
    }

    /// Whether this rank prints the job's lines: rank 0 of the first replica present.
    pub fn is_lead(&self) -> bool {
        let st = self.state();
        let first = (st.current.as_ref().or(st.committed.as_ref()))
            .and_then(|q| q.members.first().map(|m| m.replica))
            .unwrap_or(0);
        self.inner == 0 && first == self.replica
    }

    /// Lines to report since the last call.
    pub fn take_lines(&self) -> Vec<String> {
        std::mem::take(&mut self.state().lines)
    }

    /// Seconds from the first attempt of the last committed step to its commit when that step
    /// needed more than one attempt (0 otherwise), since the last call.
    pub fn take_lost_seconds(&self) -> f64 {
        std::mem::take(&mut self.state().lost_s)
    }

    /// Notes whether this rank was asked to stop; its next vote says so.
    pub fn request_stop(&self, stop: bool) {
        self.state().stop_wanted |= stop;
    }

    /// Whether this rank's replica saves the checkpoints: the first member of the last
    /// committed step's quorum.
    pub fn saves(&self) -> bool {
        let st = self.state();
        st.committed
            .as_ref()
            .and_then(|q| q.members.first())
            .is_some_and(|m| m.replica == self.replica)
    }

    /// The attempt at which the last committed step succeeded (0: at the first).
    pub fn committed_attempt(&self) -> u64 {
        self.state().committed.as_ref().map_or(0, |q| q.attempt)
    }

    /// Whether the ranks agreed to stop after the last committed step.
    pub fn stop_agreed(&self) -> bool {
        self.state().stop_agreed
    }

    /// The global ranks of replica `r`.
    fn ranks_of(&self, r: usize) -> std::ops::Range<usize> {
        let g = self.cfg.replica_size.max(1);
        r * g..(r + 1) * g
    }

    /// Starts an attempt of step `step`: its quorum (composed or read), the cross-replica
    /// group rebuilt if the members changed, and whether state must be transferred.
    /// None: the job ended before this (restarted) replica was admitted.
    pub fn begin(&self, step: u64) -> Result<Option<Begun>> {
        let waiting = {
            let st = self.state();
            self.inc > 0 && st.committed.is_none() && st.admitted.is_none()
        };
        if waiting {
            let bound = self.cfg.join_timeout * 4 + Duration::from_secs(600);
            let Some(a) = self.keys().admitted(self.replica, self.inc, bound)? else {
                return Ok(None);
            };
            let mut st = self.state();
            st.admitted = Some(a);
            st.attempt = st.attempt.max(a.1);
        }
        let (step, attempt) = {
            let mut st = self.state();
            st.began.get_or_insert_with(Instant::now);
            match st.admitted {
                // A joiner trains from its admission step, whatever its engine says.
                Some((s, _)) if st.committed.is_none() => (s, st.attempt),
                _ => (step, st.attempt),
            }
        };
        let q = match self.keys().quorum(step, attempt)? {
            Some(q) => q,
            None => self.compose(step, attempt)?,
        };
        let mine = q.members.iter().find(|m| m.replica == self.replica);
        if mine.is_none_or(|m| m.inc != self.inc) {
            return Err(TrainError::FaultTolerance(format!(
                "replica {} (incarnation {}) is not in the quorum of step {step} (attempt \
                 {attempt}): it was declared down",
                self.replica, self.inc
            )));
        }
        let joiners = self.joiners(&q);
        self.rebuild(&q)?;
        let mut st = self.state();
        st.current = Some(q.clone());
        st.broken = false;
        st.voted = false;
        let receiving = joiners.contains(&self.replica);
        let transfer_from = match joiners.is_empty() {
            true => None,
            false => {
                let donor = q.members.iter().position(|m| !joiners.contains(&m.replica));
                Some(donor.ok_or_else(|| {
                    TrainError::FaultTolerance(format!(
                        "step {step}: every replica of the quorum is a restart; no live replica \
                         holds the state"
                    ))
                })?)
            }
        };
        Ok(Some(Begun {
            transfer_from,
            receiving,
            step,
        }))
    }

    /// This rank trained the last step: replicas still waiting to rejoin give up.
    pub fn finish(&self) -> Result<()> {
        self.keys().finish()
    }

    /// The members of `q` new since the last committed quorum (every member for a joiner
    /// before its first commit is computed the same way: the admission lists it).
    fn joiners(&self, q: &Quorum) -> Vec<usize> {
        let st = self.state();
        let base: Vec<Member> = match &st.committed {
            Some(c) => c.members.clone(),
            None if self.inc > 0 => {
                // A joiner: the members it did not come with are everyone but the restarts,
                // which the composer listed as admitted at this step.
                return q
                    .members
                    .iter()
                    .filter(|m| m.inc > 0 && self.admitted_at(m, q))
                    .map(|m| m.replica)
                    .collect();
            }
            None => (0..self.cfg.replicas)
                .map(|r| Member { replica: r, inc: 0 })
                .collect(),
        };
        q.members
            .iter()
            .filter(|m| !base.contains(m))
            .map(|m| m.replica)
            .collect()
    }

    /// Whether member `m` was admitted at `q`'s step (any attempt up to `q`'s).
    fn admitted_at(&self, m: &Member, q: &Quorum) -> bool {
        match self.store.get(&format!("ft/admit/{}/{}", m.replica, m.inc)) {
            Ok(Some(v)) => {
                String::from_utf8_lossy(&v)
                    .split(' ')
                    .next()
                    .and_then(|s| s.parse::<u64>().ok())
                    == Some(q.step)
            }
            _ => false,
        }
    }

    /// Builds the cross-replica group of `q`'s members for this rank's place in its replica,
    /// unless the current one has the same members.
    fn rebuild(&self, q: &Quorum) -> Result<()> {
        if self
            .state()
            .group
            .as_ref()
            .is_some_and(|(m, _)| *m == q.members)
        {
            return Ok(());
        }
        self.state().group = None;
        if q.members.len() < 2 {
            let mut st = self.state();
            st.group = None;
            return Ok(());
        }
        let me = (q.members.iter())
            .position(|m| m.replica == self.replica)
            .unwrap_or(0);
        let mut cfg = GroupConfig::for_training()?;
        cfg.calibrate = false;
        cfg.connect_timeout = Duration::from_secs(20);
        cfg.timeout = self.cfg.retry_timeout.max(Duration::from_secs(10));
        cfg.diagnosis_grace = Duration::ZERO;
        cfg.quiet_failures = true;
        let name = format!("ftx{}s{}a{}", self.inner, q.step, q.attempt);
        let g = ProcessGroup::new(&self.rdv, &name, me, q.members.len(), cfg)?;
        self.state().group = Some((q.members.clone(), g));
        Ok(())
    }

    /// The cross-replica group of the attempt in progress (None: this replica is alone).
    pub fn group(&self) -> Option<ProcessGroup> {
        self.state().group.as_ref().map(|(_, g)| g.clone())
    }

    /// Sums `buf` over the quorum's replicas (this rank's counterparts).
    pub fn sum<T: comm::Element>(&self, buf: &mut [T]) -> Result<()> {
        let Some(g) = self.group() else {
            return Ok(());
        };
        if self.state().broken {
            return Err(self.broken_error());
        }
        g.all_reduce(buf, comm::ReduceOp::Sum).map_err(|e| {
            self.state().broken = true;
            TrainError::FaultTolerance(format!("a replica was lost during the step: {e}"))
        })
    }

    fn broken_error(&self) -> TrainError {
        TrainError::FaultTolerance("an earlier sum of this attempt failed".into())
    }

    /// Votes on the attempt in progress and waits for every member's ranks: Ok when all
    /// committed (the update may run), an error (retry the step) otherwise. The vote carries
    /// this rank's stop request ([`FaultTolerance::request_stop`]).
    pub fn commit(&self, step: u64) -> Result<()> {
        let (q, broken, stop) = {
            let st = self.state();
            let q = st.current.clone().ok_or_else(|| {
                TrainError::FaultTolerance(format!("step {step} voted without a quorum"))
            })?;
            (q, st.broken, st.stop_wanted)
        };
        let vote = match (broken, stop) {
            (true, _) => Vote::Retry,
            (false, true) => Vote::CommitStop,
            (false, false) => Vote::Commit,
        };
        let keys = self.keys();
        keys.vote(q.step, q.attempt, self.rank, vote)?;
        self.state().voted = true;
        let ranks: Vec<usize> = (q.members.iter())
            .flat_map(|m| self.ranks_of(m.replica))
            .collect();
        let started = Instant::now();
        let votes = loop {
            if let Some(v) = keys.votes(q.step, q.attempt, &ranks, Duration::from_millis(200))? {
                break v;
            }
            // A member that never votes is dead once its agent says so.
            for m in &q.members {
                if keys.inc(m.replica)? != m.inc {
                    return Err(TrainError::FaultTolerance(format!(
                        "replica {} was lost before voting on step {step}",
                        m.replica
                    )));
                }
            }
            if started.elapsed() > self.cfg.retry_timeout {
                return Err(TrainError::FaultTolerance(format!(
                    "the votes on step {step} did not all arrive within {:.0} s",
                    self.cfg.retry_timeout.as_secs_f64()
                )));
            }
        };
        if votes.contains(&Vote::Retry) {
            return Err(TrainError::FaultTolerance(format!(
                "a replica's sums of step {step} failed"
            )));
        }
        let mut st = self.state();
        if let (Some(began), true) = (st.began.take(), q.attempt > 0) {
            st.lost_s += began.elapsed().as_secs_f64();
        }
        st.stop_agreed |= votes.contains(&Vote::CommitStop);
        let first = st.committed.is_none() && self.inc > 0;
        let dropped: Vec<usize> = (st.committed.as_ref())
            .map(|c| c.replicas().into_iter().filter(|r| !q.has(*r)).collect())
            .unwrap_or_default();
        if self.inner == 0
            && (first || (!dropped.is_empty() && q.members[0].replica == self.replica))
        {
            let since = self.keys().declared_at(self.replica, self.inc);
            let line = match first {
                true => format!(
                    "# ft: replica {} rejoined at step {step} with the state of a live replica \
                     ({} of {} replicas){}",
                    self.replica,
                    q.members.len(),
                    self.cfg.replicas,
                    since.map_or(String::new(), |s| format!(
                        "; rejoin time {:.2} s from its loss being declared",
                        s.as_secs_f64()
                    ))
                ),
                false => format!(
                    "# ft: step {step} trained without replica(s) {dropped:?} after {} \
                     attempt(s); {} of {} replicas go on",
                    q.attempt + 1,
                    q.members.len(),
                    self.cfg.replicas
                ),
            };
            st.lines.push(line);
        }
        st.committed = Some(q);
        st.attempt = 0;
        st.admitted = None;
        Ok(())
    }

    /// After a failed attempt: casts a retry vote if none was cast, and moves to the next
    /// attempt (its quorum waits for the failure to be declared).
    pub fn retry(&self) -> Result<()> {
        let (q, voted) = {
            let st = self.state();
            (st.current.clone(), st.voted)
        };
        if let (Some(q), false) = (&q, voted) {
            self.keys()
                .vote(q.step, q.attempt, self.rank, Vote::Retry)?;
        }
        let mut st = self.state();
        st.attempt = q.map_or(st.attempt, |q| q.attempt) + 1;
        st.group = None;
        st.current = None;
        Ok(())
    }
}

/// Declares replica `r` down in the job's store (its agent, after one of its ranks failed):
/// the quorums from now on leave its current incarnation out. Returns the new incarnation.
pub fn declare_down(store: &StoreClient, r: usize, why: &str) -> Result<u64> {
    Keys::declare_down(store, r, why)
}
