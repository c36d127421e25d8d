//! The per-host agent: runs this node's workers generation after generation until the job
//! succeeds, the restarts are spent or the job times out (001 sections 12.6-12.8).
//!
//! One generation: gang admission of every node ([`crate::gang`]); spawn the local workers;
//! watch exits and heartbeats ([`crate::watchdog`]) and the job's failure key. On a failure
//! anywhere: stop every local worker (SIGTERM, then SIGKILL after a grace), and node 0 counts a
//! restart, applies chaos `corrupt-newest` if asked, and bumps the generation; the workers of
//! the next generation resume from the newest committed checkpoint that loads.
//!
//! Elastic jobs (`--nnodes MIN:MAX`, [`crate::elastic`]): each generation runs on the nodes
//! node 0 admitted (contiguous rank blocks, node 0 first, world = members x nproc); every other
//! agent renews a lease, and node 0 fails the generation when a member's lease stands still for
//! the lease timeout (the heartbeat timeout), so the next generation goes on without the lost
//! host as long as MIN nodes remain. The workers resume from the last committed checkpoint
//! whatever the new world size (resharded state, elastic data cursor in crates/train).

use crate::chaos::{self, Chaos, Fault};
use crate::elastic::{LeaseKeeper, Membership, NodeRange};
use crate::env::{
    ENV_CHAOS, ENV_GENERATION, ENV_HEARTBEAT_MS, ENV_LOCAL_WORLD, ENV_RANK, ENV_RDZV, ENV_SECRET,
    ENV_WORLD,
};
use crate::error::{LaunchError, Result};
use crate::gang::{Admitted, Decision, Gang, Next};
use crate::heartbeat::Beat;
use crate::process::{LocalWorker, WorkerCommand, stop_all};
use crate::watchdog::{Failure, FailureKind, WatchRules, WorkerWatch};
use comm::CommError;
use comm::store::{Secret, StoreClient, StoreServer};
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How often the agent looks at its workers and the store, at the least: a worker's exit wakes
/// it at once ([`crate::process::wait_for_exit`]).
const POLL: Duration = Duration::from_millis(100);
/// After a first local failure, how long to let the rest of the picture arrive (a killed rank's
/// peers fail a moment later) before naming the root cause.
const ATTRIBUTION_GRACE: Duration = Duration::from_millis(300);
/// Per-request timeout of the agent's store connection.
const STORE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long node 0 lets the other members read a failure before it moves the job on (they
/// follow anyway, later: the store refuses the old generation).
const FAILURE_SEEN_WAIT: Duration = Duration::from_secs(2);
/// Lease timeout of an elastic job whose heartbeats are not watched.
const DEFAULT_LEASE_TIMEOUT: Duration = Duration::from_secs(30);

/// Everything the agent needs to run a node's share of a job.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The worker program and arguments.
    pub command: WorkerCommand,
    /// Workers on this node.
    pub nproc: usize,
    /// Nodes in the job (at most; node ranks are `0..nnodes`).
    pub nnodes: usize,
    /// Fewest nodes a generation may run on: `nnodes` for a rigid job, less for an elastic one
    /// (`--nnodes MIN:MAX`, see [`crate::elastic`]).
    pub min_nnodes: usize,
    /// This node.
    pub node_rank: usize,
    /// The store's address: node 0 binds it (port 0 picks one; single node only).
    pub rdzv: SocketAddr,
    /// Heartbeat and watchdog limits; `None`: only exit statuses are watched.
    pub watch: Option<WatchRules>,
    /// Restarts allowed for the whole job.
    pub max_restarts: u64,
    /// Faults to inject (generation 0 only).
    pub chaos: Chaos,
    /// Seed of the chaos plan's random choices.
    pub chaos_seed: u64,
    /// Steps of the run, for resolving `random` chaos steps.
    pub steps: u64,
    /// The run's checkpoint directory (chaos `corrupt-newest`).
    pub ckpt_dir: Option<PathBuf>,
    /// Deadline of the whole job.
    pub job_timeout: Duration,
    /// Deadline of each gang admission (and of node 0's decision after a failure).
    pub admission_timeout: Duration,
    /// Time between SIGTERM and SIGKILL when stopping workers.
    pub kill_grace: Duration,
}

/// What a finished job looked like from this node.
#[derive(Debug, Clone, PartialEq)]
pub struct JobReport {
    /// Restarts made (as this node counted them).
    pub restarts: u64,
    /// The generation that finished.
    pub generation: u64,
}

/// How a generation ended on this node.
enum Outcome {
    Complete,
    Failed {
        what: String,
        detected: Instant,
        last_step: Option<u64>,
    },
}

/// Recovery in progress: reported once the new generation trains again.
struct Recovery {
    detected: Instant,
    last_step: Option<u64>,
    resumed_reported: bool,
}

/// Runs this node's part of the job to the end (see the module docs).
pub fn run(cfg: &AgentConfig) -> Result<JobReport> {
    validate(cfg)?;
    let secret = match Secret::from_env()? {
        Some(s) => s,
        None if cfg.nnodes == 1 => Secret::generate()?,
        None => {
            return Err(LaunchError::invalid(
                ENV_SECRET,
                "",
                format!(
                    "a job across {} nodes needs a shared secret: set {ENV_SECRET} (or FLOTILLA_SECRET_FILE) on every node",
                    cfg.nnodes
                ),
            ));
        }
    };
    let server = if cfg.node_rank == 0 {
        Some(StoreServer::bind(cfg.rdzv, secret.clone())?)
    } else {
        None
    };
    let addr = server.as_ref().map_or(cfg.rdzv, |s| s.local_addr());
    let store =
        StoreClient::connect(addr, &secret, 0, cfg.admission_timeout)?.with_timeout(STORE_TIMEOUT);
    let mut g = store.generation()?;
    store.set_generation(g);
    let nodes = NodeRange::new(cfg.min_nnodes, cfg.nnodes)?;
    let lease_timeout = cfg
        .watch
        .as_ref()
        .map_or(DEFAULT_LEASE_TIMEOUT, |w| w.heartbeat_timeout);
    let gang = Gang::new(&store, nodes, cfg.node_rank, lease_timeout);
    let _lease = if nodes.is_elastic() && cfg.node_rank != 0 {
        Some(LeaseKeeper::start(&store, cfg.node_rank)?)
    } else {
        None
    };
    let say = |line: String| say(cfg, line);
    let fault = chaos_plan(cfg, &store, g)?;
    if let Some(f) = fault
        && cfg.node_rank == 0
    {
        say(format!(
            "chaos: {f} (seed {}): rank {} will {} after step {} in generation 0",
            cfg.chaos_seed,
            f.rank,
            match f.kind {
                chaos::FaultKind::Kill => "SIGKILL itself",
                chaos::FaultKind::Hang => "SIGSTOP itself",
                chaos::FaultKind::Stall => "stop progressing",
            },
            f.step
        ));
    }
    let job_deadline = Instant::now() + cfg.job_timeout;
    let mut restarts = 0;
    let mut recovery: Option<Recovery> = None;
    loop {
        let members = match gang.admit(g, cfg.admission_timeout)? {
            Admitted::Member(m) => m,
            Admitted::Excluded(m) => {
                let nodes = &m.nodes;
                say(format!(
                    "not admitted to generation {g} (it runs on nodes {nodes:?}); waiting for the next"
                ));
                let left = job_deadline.saturating_duration_since(Instant::now());
                match gang.await_next(g, left)? {
                    Next::Generation(next) => {
                        g = next;
                        continue;
                    }
                    Next::Complete => {
                        return Ok(JobReport {
                            restarts,
                            generation: g,
                        });
                    }
                    Next::Abort(why) => return Err(LaunchError::Aborted(why)),
                }
            }
        };
        if nodes.is_elastic() && cfg.node_rank == 0 {
            say(format!(
                "generation {g} admitted nodes {:?} ({} of --nnodes {nodes}): world {}",
                members.nodes,
                members.len(),
                members.len() * cfg.nproc
            ));
        }
        let mut workers = spawn_generation(cfg, g, &members, addr, &secret, fault)?;
        let outcome = watch_generation(
            cfg,
            &gang,
            g,
            &members,
            &mut workers,
            &mut recovery,
            job_deadline,
        );
        let outcome = match outcome {
            Ok(o) => o,
            Err(e) => {
                stop_all(&mut workers, cfg.kill_grace)?;
                return Err(e);
            }
        };
        stop_all(&mut workers, cfg.kill_grace)?;
        let (what, detected, last_step) = match outcome {
            Outcome::Complete => {
                return Ok(JobReport {
                    restarts,
                    generation: g,
                });
            }
            Outcome::Failed {
                what,
                detected,
                last_step,
            } => (what, detected, last_step),
        };
        say(format!(
            "generation {g} failed: {what}; stopped this node's workers"
        ));
        if cfg.node_rank != 0 {
            gang.failure_seen(g);
        }
        if cfg.node_rank == 0 && crate::watchdog::is_refusal(&what) {
            let e = LaunchError::Refused(what);
            let linger = cfg.kill_grace + Duration::from_secs(5);
            gang.abort(g, &members, &e.to_string(), linger)?;
            return Err(e);
        }
        if cfg.node_rank == 0 {
            restarts = gang.count_restart()?;
            if restarts > cfg.max_restarts {
                let e = LaunchError::RestartsExhausted {
                    restarts: restarts - 1,
                    max: cfg.max_restarts,
                    last: what,
                };
                let linger = cfg.kill_grace + Duration::from_secs(5);
                gang.abort(g, &members, &e.to_string(), linger)?;
                return Err(e);
            }
            if cfg.chaos.corrupt_newest
                && g == 0
                && let Some(dir) = &cfg.ckpt_dir
            {
                match chaos::corrupt_newest(dir)? {
                    Some(step) => say(format!(
                        "chaos: corrupted the newest committed checkpoint, step {step} in {}",
                        dir.display()
                    )),
                    None => say(format!(
                        "chaos: no committed checkpoint in {} to corrupt",
                        dir.display()
                    )),
                }
            }
            gang.await_failure_seen(g, &members, FAILURE_SEEN_WAIT)?;
            g = gang.advance(g)?;
            say(format!(
                "restart {restarts}/{}: generation {g} starts every worker from the last committed checkpoint",
                cfg.max_restarts
            ));
        } else {
            match gang.await_decision(g, cfg.admission_timeout)? {
                Decision::Restart(next) => {
                    restarts += 1;
                    g = next;
                    say(format!("restarting with generation {g}"));
                }
                Decision::Abort(why) => return Err(LaunchError::Aborted(why)),
            }
        }
        recovery = Some(Recovery {
            detected,
            last_step,
            resumed_reported: false,
        });
    }
}

/// The job's worker fault: node 0 resolves its plan and publishes it; the other nodes take
/// that one (their own seeds may differ), waiting for it at most the admission timeout.
fn chaos_plan(cfg: &AgentConfig, store: &StoreClient, g: u64) -> Result<Option<Fault>> {
    let key = format!("launch/g{g}/chaos");
    if cfg.node_rank == 0 {
        let world = cfg.nproc * cfg.nnodes;
        let fault = cfg.chaos.resolve(cfg.chaos_seed, cfg.steps, world)?;
        let text = fault.map_or_else(|| "none".to_string(), |f| f.to_string());
        store.set(&key, text.as_bytes())?;
        return Ok(fault);
    }
    let text = store.wait_one(&key, cfg.admission_timeout)?;
    match String::from_utf8_lossy(&text).as_ref() {
        "none" => Ok(None),
        f => Fault::parse(f).map(Some),
    }
}

/// Prints an agent line (prefixed with the node on multi-node jobs).
fn say(cfg: &AgentConfig, line: String) {
    if cfg.nnodes > 1 {
        println!("# node {}: {line}", cfg.node_rank)
    } else {
        println!("# {line}")
    }
}

fn validate(cfg: &AgentConfig) -> Result<()> {
    if cfg.nproc == 0 {
        return Err(LaunchError::invalid(
            "--nproc",
            "0",
            "at least one worker is needed",
        ));
    }
    if cfg.min_nnodes == 0 || cfg.min_nnodes > cfg.nnodes {
        return Err(LaunchError::invalid(
            "--nnodes",
            format!("{}:{}", cfg.min_nnodes, cfg.nnodes),
            "expected N or MIN:MAX with 1 <= MIN <= MAX",
        ));
    }
    if cfg.nnodes == 0 || cfg.node_rank >= cfg.nnodes {
        return Err(LaunchError::invalid(
            "--node-rank",
            cfg.node_rank.to_string(),
            format!("must be below --nnodes {}", cfg.nnodes),
        ));
    }
    if cfg.nnodes > 1 && cfg.rdzv.port() == 0 {
        return Err(LaunchError::invalid(
            "--rdzv",
            cfg.rdzv.to_string(),
            format!(
                "a job across {} nodes needs HOST:PORT with a fixed port every node can reach",
                cfg.nnodes
            ),
        ));
    }
    Ok(())
}

/// Starts this node's workers of generation `g`: ranks `slot * nproc ..` of a world of
/// `members x nproc`, where `slot` is this node's place among the members.
fn spawn_generation(
    cfg: &AgentConfig,
    g: u64,
    members: &Membership,
    addr: SocketAddr,
    secret: &Secret,
    fault: Option<Fault>,
) -> Result<Vec<LocalWorker>> {
    let world = cfg.nproc * members.len();
    let slot = members.slot(cfg.node_rank).ok_or_else(|| {
        LaunchError::invalid(
            "--node-rank",
            cfg.node_rank.to_string(),
            format!("not a member of generation {g} ({:?})", members.nodes),
        )
    })?;
    let mut env = vec![
        (ENV_WORLD.to_string(), world.to_string()),
        (ENV_LOCAL_WORLD.to_string(), cfg.nproc.to_string()),
        (ENV_RDZV.to_string(), addr.to_string()),
        (ENV_GENERATION.to_string(), g.to_string()),
        (ENV_SECRET.to_string(), secret.to_env_value()?),
    ];
    if let Some(rules) = &cfg.watch {
        env.push((
            ENV_HEARTBEAT_MS.into(),
            rules.period().as_millis().to_string(),
        ));
    }
    if let Some(f) = fault.filter(|_| g == 0) {
        env.push((ENV_CHAOS.into(), f.to_string()));
    }
    let mut workers = Vec::with_capacity(cfg.nproc);
    for local in 0..cfg.nproc {
        let rank = slot * cfg.nproc + local;
        env.push((ENV_RANK.into(), rank.to_string()));
        match LocalWorker::spawn(&cfg.command, rank, &env) {
            Ok(w) => workers.push(w),
            Err(e) => {
                stop_all(&mut workers, cfg.kill_grace)?;
                return Err(e);
            }
        }
        env.pop();
    }
    Ok(workers)
}

/// The failure a worker's exit status shows, if any.
fn exit_failure(w: &LocalWorker, beat: Option<Beat>) -> Option<Failure> {
    let st = w.status?;
    let kind = match (st.code(), st.signal()) {
        (Some(0), _) => return None,
        (Some(c), _) => FailureKind::Exit(c),
        (None, Some(s)) => FailureKind::Signal(s),
        (None, None) => FailureKind::Exit(-1),
    };
    Some(Failure {
        rank: w.rank,
        kind,
        step: beat.and_then(|b| b.step),
        busy: beat.is_some_and(|b| b.busy),
    })
}

/// Watches generation `g` on this node until it completes or fails somewhere.
fn watch_generation(
    cfg: &AgentConfig,
    gang: &Gang<'_>,
    g: u64,
    members: &Membership,
    workers: &mut [LocalWorker],
    recovery: &mut Option<Recovery>,
    job_deadline: Instant,
) -> Result<Outcome> {
    let say = |line: String| say(cfg, line);
    let now = Instant::now();
    let mut watches: Vec<WorkerWatch> = workers
        .iter()
        .map(|w| WorkerWatch::new(w.rank, now))
        .collect();
    let mut marked_done = false;
    loop {
        let now = Instant::now();
        if now >= job_deadline {
            return Err(LaunchError::JobTimeout(cfg.job_timeout));
        }
        // Node 0 may end the generation and move on before this node reads why: the store then
        // refuses this generation's requests, which says the same.
        let seen_step = last_step(&watches);
        let moved_on = |e: LaunchError| match e {
            LaunchError::Store(CommError::StaleGeneration { current, .. })
                if cfg.node_rank != 0 =>
            {
                Ok(Outcome::Failed {
                    what: format!(
                        "node 0 ended generation {g} (the job is in generation {current})"
                    ),
                    detected: now,
                    last_step: seen_step,
                })
            }
            e => Err(e),
        };
        let mut failures = Vec::new();
        for (w, watch) in workers.iter_mut().zip(watches.iter_mut()) {
            let was_running = w.running();
            w.poll()?;
            if let Some(rules) = &cfg.watch
                && was_running
            {
                let beat = match gang.beat(g, w.rank) {
                    Ok(b) => b,
                    Err(e) => return moved_on(e),
                };
                watch.observe(beat, now);
                if w.running()
                    && let Some(f) = watch.check(rules, now)
                {
                    failures.push(f);
                }
            }
            if let Some(f) = exit_failure(w, watch.beat()) {
                failures.push(f);
            }
            watch.done = w.status.is_some_and(|s| s.success());
        }
        if let Some(r) = recovery.as_mut() {
            report_recovery(r, g, &watches, &say);
            if watches.iter().any(|w| w.first_step_at.is_some()) {
                *recovery = None;
            }
        }
        let stalled_step = failures
            .iter()
            .find(|f| matches!(f.kind, FailureKind::Stalled(_)))
            .and_then(|f| f.step);
        if let Some(step) = stalled_step {
            for (w, watch) in workers.iter().zip(watches.iter()) {
                if w.running() && failures.iter().all(|f| f.rank != w.rank) {
                    failures.extend(watch.stalled_with(step, now));
                }
            }
        }
        if !failures.is_empty() {
            // Let the peers of a killed rank finish failing, then name the most telling cause.
            std::thread::sleep(ATTRIBUTION_GRACE);
            for (w, watch) in workers.iter_mut().zip(watches.iter()) {
                if w.running() {
                    w.poll()?;
                    if let Some(f) = exit_failure(w, watch.beat()) {
                        failures.push(f);
                    }
                }
            }
            failures.sort_by_key(Failure::blame_order);
            let what = match gang.report_failure(g, &failures[0].to_string()) {
                Ok(w) => w,
                Err(e) => return moved_on(e),
            };
            return Ok(Outcome::Failed {
                what,
                detected: now,
                last_step: last_step(&watches),
            });
        }
        if cfg.node_rank == 0
            && cfg.min_nnodes < cfg.nnodes
            && let Some((node, still)) = gang.lost_member(members)?
        {
            let lost = format!(
                "node {node} lost: its agent renewed no lease for {:.1} s",
                still.as_secs_f64()
            );
            return Ok(Outcome::Failed {
                what: gang.report_failure(g, &lost)?,
                detected: now,
                last_step: last_step(&watches),
            });
        }
        let failure = match gang.failure(g) {
            Ok(f) => f,
            Err(e) => return moved_on(e),
        };
        if let Some(what) = failure {
            return Ok(Outcome::Failed {
                what,
                detected: now,
                last_step: last_step(&watches),
            });
        }
        if watches.iter().all(|w| w.done) {
            if !marked_done {
                gang.mark_done(g)?;
                marked_done = true;
            }
            if gang.complete(g, members, cfg.admission_timeout)? {
                return Ok(Outcome::Complete);
            }
        }
        crate::process::wait_for_exit(workers, POLL);
    }
}

/// The last step any local worker reported.
fn last_step(watches: &[WorkerWatch]) -> Option<u64> {
    watches.iter().filter_map(|w| w.beat()?.step).max()
}

/// Prints where the new generation resumed, and once it completes a step, how long recovery took.
fn report_recovery(r: &mut Recovery, g: u64, watches: &[WorkerWatch], say: &impl Fn(String)) {
    if !r.resumed_reported
        && let Some(resumed) = watches.iter().filter_map(|w| w.beat()?.resumed).min()
    {
        r.resumed_reported = true;
        let lost = r.last_step.map_or(0, |s| s.saturating_sub(resumed));
        let last = r
            .last_step
            .map_or_else(|| "none".to_string(), |s| s.to_string());
        say(format!(
            "generation {g} resumes from step {resumed}; steps lost: {lost} (last completed step before the failure: {last})"
        ));
    }
    if let Some(at) = watches.iter().filter_map(|w| w.first_step_at).min() {
        say(format!(
            "generation {g} is training again; time from failure to training again: {:.2} s",
            at.saturating_duration_since(r.detected).as_secs_f64()
        ));
    }
}
