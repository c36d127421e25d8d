//! Store failover: the job's rendezvous store survives the loss of the node hosting it, so an
//! elastic job goes on when node 0 dies, and a node that comes back finds the job again (001
//! sections 12.5-12.8: no single point of failure, recovery from the last checkpoint; 004
//! section 28.8: admission per generation, older generations fenced off).
//!
//! Re-hosting with generation fencing. `--rdzv H0:P0,H1:P1,...` lists K endpoints; node k < K
//! binds endpoint k when it starts and keeps a *standby* store there (empty, never used). The
//! store the job uses is *active*: it holds [`LEADER_KEY`], the node that decides the
//! generations (the leader: node 0 at the start).
//!
//! When an agent's store requests fail (the host of the store died: its links close at once, or
//! requests time out), and its workers were not pre-empted, it stops its workers and
//! [`Stores::take_over`] walks the endpoints after the lost one, in list order (wrapping):
//! - its own endpoint: it activates its standby, fenced at the lost generation + 1
//!   ([`comm::store::StoreServer::fence`]): nothing a worker or agent of an older generation
//!   still says is accepted there. It seeds the job's counters (restarts, excluded stragglers),
//!   marks the old leader lost (not waited for at admission) and leads from there;
//! - another endpoint that answers: it waits (at most the take-over wait) for that node's agent
//!   to activate it, then follows it;
//! - an endpoint that does not answer (its host is gone too): the next one.
//!
//! Every agent walks the same list from the same place, so all survivors meet at the first live
//! node after the lost one: the lowest live node after node 0. The workers of the next
//! generation are spawned with the new store's address (`FLOTILLA_RDZV`).
//!
//! A node that starts (or restarts) while the job runs first asks the other endpoints for an
//! active store ([`Stores::start`]), takes the one at the highest generation, and registers
//! there: its registration arrives after the member list, so it waits, and the leader ends the
//! generation to admit it at the next one while the job is below MAX
//! ([`crate::gang::Gang::waiting_node`]).
//!
//! Limits: the old leader, if only cut off, is not told to stop; it cannot form a generation
//! without MIN nodes, so MIN above MAX/2 keeps two halves from both running.

use crate::error::{LaunchError, Result};
use crate::exit::EXIT_PREEMPTED;
use crate::gang::{EXCLUDED_KEY, Gang, POLL};
use crate::process::LocalWorker;
use comm::store::{Secret, StoreClient, StoreServer};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The key of an active store naming the leader (absent from a standby).
pub const LEADER_KEY: &str = "launch/leader";
/// How long the workers of a pre-empted job may take to exit after its store went away.
pub const PREEMPTION_GRACE: Duration = Duration::from_secs(1);
/// How long a look at another endpoint may spend connecting.
const PROBE_CONNECT: Duration = Duration::from_millis(300);
/// Per-request timeout of a look at another endpoint.
const PROBE_REQUEST: Duration = Duration::from_secs(2);

/// An active store found at an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Active {
    /// Where it is.
    pub addr: SocketAddr,
    /// Its generation.
    pub generation: u64,
    /// The node leading the job there.
    pub leader: usize,
}

/// Where the job's stores are and how long to wait for them.
#[derive(Debug, Clone)]
pub struct Endpoints {
    /// The `--rdzv` list: node k hosts the k-th endpoint (port 0: a single node's free port).
    pub list: Vec<SocketAddr>,
    /// This node.
    pub node: usize,
    /// How long to wait for endpoint 0's store when the job starts.
    pub connect_timeout: Duration,
    /// Per-request timeout of the agent's store client.
    pub request_timeout: Duration,
    /// How long a survivor waits for a live endpoint's agent to activate its store.
    pub takeover_wait: Duration,
}

/// A take-over done: the store the job uses now, and the line an agent says about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Takeover {
    /// The job's store now.
    pub to: Active,
    /// What happened, in words.
    pub line: String,
}

/// The job's store endpoints, and this node's own store (active or standby) if it has one.
pub struct Stores {
    endpoints: Vec<SocketAddr>,
    server: Option<StoreServer>,
    node: usize,
    secret: Secret,
    /// How long a survivor waits for a live endpoint's agent to activate its store.
    takeover_wait: Duration,
    /// The leader found when this agent started.
    leader_at_start: usize,
}

impl Stores {
    /// Binds this node's endpoint if it has one and connects to the job's store: an active
    /// store on another endpoint if there is one (the job runs already: this node joins it),
    /// else endpoint 0 (node 0 leads, as when every node starts together).
    pub fn start(at: &Endpoints, secret: &Secret) -> Result<(Stores, StoreClient)> {
        let mut endpoints = at.list.clone();
        let server = match endpoints.get(at.node) {
            Some(&addr) => Some(StoreServer::bind(addr, secret.clone())?),
            None => None,
        };
        if let Some(s) = &server {
            // Port 0 (a single node): the port the system picked.
            endpoints[at.node] = s.local_addr();
        }
        let request_timeout = at.request_timeout;
        let mut stores = Stores {
            endpoints,
            server,
            node: at.node,
            secret: secret.clone(),
            takeover_wait: at.takeover_wait,
            leader_at_start: 0,
        };
        if stores.endpoints.len() > 1
            && let Some(found) = stores.probe()
        {
            let store = StoreClient::connect(found.addr, secret, found.generation, PROBE_REQUEST)?
                .with_timeout(request_timeout);
            stores.leader_at_start = found.leader;
            return Ok((stores, store));
        }
        let store = StoreClient::connect(stores.endpoints[0], secret, 0, at.connect_timeout)?
            .with_timeout(request_timeout);
        if stores.endpoints.len() > 1 && at.node == 0 {
            store.set_generation(store.generation()?);
            store.set(LEADER_KEY, b"0")?;
        }
        Ok((stores, store))
    }

    /// The leader when this agent started (0 unless it joined a job that failed over).
    pub fn leader_at_start(&self) -> usize {
        self.leader_at_start
    }

    /// Whether the job can outlive its store's host (more than one endpoint).
    pub fn replicated(&self) -> bool {
        self.endpoints.len() > 1
    }

    /// How long an agent whose store went away waits for its workers to exit (with the
    /// pre-emption code if the job was pre-empted: node 0 ends a pre-empted job's store only
    /// once every worker passed its last barrier) before it takes the loss for a failure:
    /// `single` with one endpoint (the job ends either way), at most [`PREEMPTION_GRACE`] with
    /// several, since the workers of a job whose store died may hang in store requests of
    /// their own and the survivors should go on at once.
    pub fn gone_wait(&self, single: Duration) -> Duration {
        if self.replicated() {
            single.min(PREEMPTION_GRACE)
        } else {
            single
        }
    }

    /// The active store at the highest generation among the other endpoints, if any.
    fn probe(&self) -> Option<Active> {
        let mut best: Option<Active> = None;
        for (k, &addr) in self.endpoints.iter().enumerate() {
            if k == self.node {
                continue;
            }
            match StoreClient::connect(addr, &self.secret, 0, PROBE_CONNECT)
                .and_then(|c| look(&c.with_timeout(PROBE_REQUEST)))
            {
                Ok(Some(a)) if best.is_none_or(|b| a.generation > b.generation) => best = Some(a),
                Ok(_) => {}
                Err(e) => tracing::debug!("no active store at {addr}: {e}"),
            }
        }
        best
    }

    /// `r` as it came, unless it failed because this follower's store stopped answering (an
    /// I/O error) and the job has standbys: then [`Stores::take_over`]'s result (no worker runs
    /// at the agent's admission and decision waits, where this is used).
    pub fn unless_lost<T>(
        &self,
        r: Result<T>,
        store: &StoreClient,
        gang: &Gang<'_>,
        g: u64,
        restarts: u64,
        max_restarts: u64,
    ) -> Result<std::result::Result<T, Takeover>> {
        match r {
            Err(LaunchError::Store(comm::CommError::Io { .. }))
                if self.replicated() && !gang.leads() =>
            {
                let noticed = Instant::now();
                let t = self.take_over(store, gang, g, restarts, max_restarts, noticed)?;
                t.map(Err)
                    .ok_or_else(|| LaunchError::invalid("--rdzv", self.list(), "no store"))
            }
            r => r.map(Ok),
        }
    }

    /// After `store` was lost in generation `g` (noticed at `noticed`; this agent's workers
    /// stopped): finds or becomes the job's next store (see the module docs), moves `store` and
    /// its clones there, and returns it; `None` if the job has a single endpoint. `restarts` is
    /// this agent's count so far; a new leader refuses to go on past `max_restarts`.
    pub fn take_over(
        &self,
        store: &StoreClient,
        gang: &Gang<'_>,
        g: u64,
        restarts: u64,
        max_restarts: u64,
        noticed: Instant,
    ) -> Result<Option<Takeover>> {
        if !self.replicated() {
            return Ok(None);
        }
        let lost = store.addr();
        let n = self.endpoints.len();
        let from = self.endpoints.iter().position(|&a| a == lost);
        let old_leader = gang.leader();
        for k in (1..=n).map(|i| (from.unwrap_or(n - 1) + i) % n) {
            if Some(k) == from {
                continue;
            }
            if k == self.node {
                if restarts >= max_restarts {
                    return Err(LaunchError::RestartsExhausted {
                        restarts,
                        max: max_restarts,
                        last: format!("the store at {lost} was lost"),
                    });
                }
                let to = self.activate(store, gang, g, restarts + 1, old_leader)?;
                let line = took_over(lost, &to, true, noticed);
                return Ok(Some(Takeover { to, line }));
            }
            if let Some(to) = self.await_active(self.endpoints[k], g) {
                store.redirect(to.addr);
                store.set_generation(to.generation);
                gang.set_leader(to.leader);
                let line = took_over(lost, &to, false, noticed);
                return Ok(Some(Takeover { to, line }));
            }
        }
        Err(LaunchError::invalid(
            "--rdzv",
            self.list(),
            format!("the store at {lost} was lost and no other endpoint took over"),
        ))
    }

    /// The endpoints as given to `--rdzv`.
    fn list(&self) -> String {
        let e: Vec<String> = self.endpoints.iter().map(ToString::to_string).collect();
        e.join(",")
    }

    /// Activates this node's standby store above generation `g` and leads the job from it.
    fn activate(
        &self,
        store: &StoreClient,
        gang: &Gang<'_>,
        g: u64,
        restarts: u64,
        old_leader: usize,
    ) -> Result<Active> {
        let server = self.server.as_ref().ok_or_else(|| {
            LaunchError::invalid(
                "--node-rank",
                self.node.to_string(),
                "this node hosts no store endpoint",
            )
        })?;
        let generation = server.fence(g + 1);
        let addr = server.local_addr();
        store.redirect(addr);
        store.set_generation(generation);
        store.set("launch/restarts", restarts.to_string().as_bytes())?;
        let excluded: Vec<String> = gang.excluded().iter().map(usize::to_string).collect();
        if !excluded.is_empty() {
            store.set(EXCLUDED_KEY, excluded.join(",").as_bytes())?;
        }
        // Last: followers take the store once it names its leader.
        store.set(LEADER_KEY, self.node.to_string().as_bytes())?;
        gang.set_leader(self.node);
        gang.mark_lost(old_leader);
        Ok(Active {
            addr,
            generation,
            leader: self.node,
        })
    }

    /// Waits (at most the take-over wait) for the store at `addr` to become active at
    /// generation `g` or later; `None` if it does not answer or does not become active.
    fn await_active(&self, addr: SocketAddr, g: u64) -> Option<Active> {
        let client = match StoreClient::connect(addr, &self.secret, 0, PROBE_CONNECT) {
            Ok(c) => c.with_timeout(PROBE_REQUEST),
            Err(e) => {
                tracing::debug!("store endpoint {addr} does not answer: {e}");
                return None;
            }
        };
        let deadline = Instant::now() + self.takeover_wait;
        loop {
            match look(&client) {
                Ok(Some(a)) if a.generation >= g => return Some(a),
                Ok(_) => {}
                // Fenced between the two reads: the next look sees it.
                Err(comm::CommError::StaleGeneration { .. }) => {}
                Err(e) => {
                    tracing::debug!("store endpoint {addr} went away: {e}");
                    return None;
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(POLL);
        }
    }
}

/// Whether a local worker exited with a failure (not success, not a pre-emption): the store's
/// loss is then no pre-emption's end, and the agent need not wait for the others to exit.
pub(crate) fn any_failed(workers: &[LocalWorker]) -> bool {
    workers
        .iter()
        .filter_map(|w| w.status)
        .any(|s| !s.success() && s.code() != Some(EXIT_PREEMPTED))
}

/// The agent's line after a take-over: `lost` was the store, `next` the one the job uses now.
fn took_over(lost: SocketAddr, next: &Active, leads: bool, detected: Instant) -> String {
    let (g, leader) = (next.generation, next.leader);
    let how = if leads {
        format!(
            "this node now hosts the job's store at {} and leads it",
            next.addr
        )
    } else {
        format!(
            "following node {leader}, which now hosts it at {}",
            next.addr
        )
    };
    format!(
        "store failover: the store at {lost} is lost; {how} from generation {g} ({:.2} s after the loss was noticed)",
        detected.elapsed().as_secs_f64()
    )
}

/// The start of the failure text with which the leader ends a generation to admit a node.
const GROWTH: &str = "growing: node ";

/// The failure text with which the leader ends generation `g` (`members` of at most `max`
/// nodes) so that the next one admits the waiting `node`.
pub(crate) fn growth(node: usize, g: u64, members: usize, max: usize) -> String {
    format!(
        "{GROWTH}{node} waits to join and generation {g} runs {members} of at most {max} nodes: the next generation admits it"
    )
}

/// Whether a generation's failure text is [`growth`]'s (not counted as a restart).
pub(crate) fn is_growth(what: &str) -> bool {
    what.starts_with(GROWTH)
}

/// The store behind `client`, if it is active (names a leader).
fn look(client: &StoreClient) -> comm::Result<Option<Active>> {
    let generation = client.generation()?;
    client.set_generation(generation);
    let leader = client.get(LEADER_KEY)?;
    Ok(leader
        .and_then(|v| String::from_utf8_lossy(&v).parse().ok())
        .map(|leader| Active {
            addr: client.addr(),
            generation,
            leader,
        }))
}

#[cfg(test)]
#[path = "failover_tests.rs"]
mod tests;
