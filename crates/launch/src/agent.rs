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
//! whatever the new world size (resharded state, elastic data cursor in crates/train). With
//! several rendezvous endpoints the job also outlives node 0, and a node that comes back is
//! admitted at the next generation ([`crate::failover`]).

use crate::chaos::{self, Chaos, Fault};
use crate::chaos_plan::{chaos_plan, ft_chaos};
use crate::elastic::{LeaseKeeper, NodeRange};
use crate::env::ENV_SECRET;
use crate::error::{LaunchError, Result};
use crate::exit::Preempted;
use crate::failover::{self, Stores};
use crate::gang::{Admitted, Decision, Gang, Next};
use crate::generation::{
    Outcome, Recovery, STORE_GONE_WAIT, preempted, spawn_generation, watch_generation,
};
use crate::http::Endpoint;
use crate::metrics::{JobView, StoreSource};
use crate::process::{WorkerCommand, stop_all, wait_for_exit};
use crate::term::Termination;
use crate::watchdog::WatchRules;
use comm::store::Secret;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// Further store endpoints (`--rdzv H0:P0,H1:P1,...`): node k binds the k-th (counting
    /// `rdzv` as the 0th) as a standby that takes the job over if the store before it in the
    /// list is lost ([`crate::failover`]). Empty: losing node 0 ends the job.
    pub rdzv_standbys: Vec<SocketAddr>,
    /// Heartbeat and watchdog limits; `None`: only exit statuses are watched.
    pub watch: Option<WatchRules>,
    /// Restarts allowed for the whole job.
    pub max_restarts: u64,
    /// Faults to inject (the plan's g-th worker fault in generation g).
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
    /// Time between SIGTERM and SIGKILL when stopping workers after a failure (a training
    /// worker that handles SIGTERM as a pre-emption notice wants none: zero).
    pub kill_grace: Duration,
    /// The SIGTERM handler of this process, if installed: a SIGTERM then pre-empts the job
    /// (workers told, given `term_grace`, the job ends with [`crate::EXIT_PREEMPTED`]).
    pub term: Option<Termination>,
    /// How long the workers have, after SIGTERM, to commit a checkpoint and exit.
    pub term_grace: Duration,
    /// A directory for each worker's stdout and stderr in torchrun's layout
    /// (`DIR/RUN_ID/attempt_GENERATION/LOCAL_RANK/{stdout,stderr}.log`); `None`: none.
    pub log_dir: Option<PathBuf>,
    /// The run id naming the job's folder under `log_dir` (torchrun's `--rdzv-id`).
    pub run_id: String,
    /// Serve the job's figures for Prometheus at this address (`--metrics-port`,
    /// [`crate::http`]); the workers publish them in the store ([`crate::metrics`]).
    pub metrics_addr: Option<SocketAddr>,
    /// The run configuration as named fields (model, layout, hyperparameters, data, code
    /// version): every node registers it at admission and node 0 refuses nodes whose fields
    /// differ from its own ([`crate::agree`]). Empty: nothing to compare.
    pub agreement: Vec<(String, String)>,
    /// What node 0 does with a straggler the workers name ([`crate::straggler`]).
    pub straggler: crate::straggler::Policy,
    /// Per-step fault tolerance (`--ft`): the ranks per replica group; a failed worker then
    /// restarts only its replica ([`crate::ft`]). None: any failure restarts the job.
    pub ft: Option<usize>,
}

/// What a finished job looked like from this node.
#[derive(Debug, Clone, PartialEq)]
pub struct JobReport {
    /// Restarts made (as this node counted them).
    pub restarts: u64,
    /// The generation that finished.
    pub generation: u64,
}

/// Runs this node's part of the job to the end (see the module docs).
pub fn run(cfg: &AgentConfig) -> Result<JobReport> {
    // Node 0 draws a soak's faults (it alone resolves and hands out each generation's).
    let drawn = AgentConfig {
        chaos: match cfg.node_rank {
            0 => crate::soak::expand(
                &cfg.chaos,
                cfg.chaos_seed,
                cfg.nnodes,
                cfg.min_nnodes < cfg.nnodes,
                cfg.steps,
            )?,
            _ => cfg.chaos.clone(),
        },
        ..cfg.clone()
    };
    let cfg = &drawn;
    validate(cfg)?;
    // Partitions last as long as the other nodes take to notice (read only when there are
    // any: it reads the collectives' settings from the environment).
    let partitions = (cfg.chaos.faults.iter()).any(|f| f.kind.name() == "partition");
    let detection = match partitions {
        true => crate::partition::detection(cfg.watch.as_ref(), cfg.min_nnodes < cfg.nnodes)?,
        false => Duration::ZERO,
    };
    crate::partition::check(&cfg.chaos, cfg.nnodes, detection)?;
    if let Some(n) = cfg.chaos.soak.filter(|_| cfg.node_rank == 0) {
        let count = |k: &str| {
            cfg.chaos
                .faults
                .iter()
                .filter(|f| f.kind.name() == k)
                .count()
        };
        say(
            cfg,
            format!(
                "chaos: soak:{n} (seed {}): {} kill, {} hang, {} partition, {} slow; {} fail \
                 their generation (--max-restarts {})",
                cfg.chaos_seed,
                count("kill"),
                count("hang"),
                count("partition"),
                count("slow"),
                cfg.chaos.failing(),
                cfg.max_restarts
            ),
        );
    }
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
    let (stores, store) = Stores::start(&endpoints(cfg), &secret)?;
    let mut g = store.generation()?;
    store.set_generation(g);
    let nodes = NodeRange::new(cfg.min_nnodes, cfg.nnodes)?;
    let lease_timeout = cfg
        .watch
        .as_ref()
        .map_or(DEFAULT_LEASE_TIMEOUT, |w| w.heartbeat_timeout);
    let gang = Gang::new(&store, nodes, cfg.node_rank, lease_timeout)
        .with_agreement(cfg.agreement.clone());
    gang.set_leader(stores.leader_at_start());
    if cfg.nnodes > 1 && !cfg.agreement.is_empty() {
        say(
            cfg,
            format!(
                "run configuration digest {} ({} fields, compared at admission)",
                gang.digest(),
                cfg.agreement.len()
            ),
        );
    }
    let _lease = if nodes.is_elastic() && (!gang.leads() || stores.replicated()) {
        Some(LeaseKeeper::start(&store, cfg.node_rank)?)
    } else {
        None
    };
    let say = |line: String| say(cfg, line);
    let view = JobView::default();
    let _endpoint = match cfg.metrics_addr {
        Some(at) => {
            let source = StoreSource::new(&store, view.clone())?;
            let ep = Endpoint::serve(at, Arc::new(source))?;
            say(format!(
                "metrics endpoint: http://{}/metrics (Prometheus / OpenMetrics text)",
                ep.addr()
            ));
            Some(ep)
        }
        None => None,
    };
    let job_deadline = Instant::now() + cfg.job_timeout;
    let mut restarts = 0;
    let mut recovery: Option<Recovery> = None;
    // The last step any failed generation reached (later chaos faults fall after it).
    let mut seen_step = 0;
    loop {
        let admitted = gang.admit(g, cfg.admission_timeout);
        let max = cfg.max_restarts;
        let members = match stores.unless_lost(admitted, &store, &gang, g, restarts, max)? {
            Err(t) => {
                say(t.line);
                (g, restarts) = (t.to.generation, restarts + 1);
                continue;
            }
            Ok(a) => a,
        };
        let members = match members {
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
        if nodes.is_elastic() && gang.leads() {
            say(format!(
                "generation {g} admitted nodes {:?} ({} of --nnodes {nodes}): world {}",
                members.nodes,
                members.len(),
                members.len() * cfg.nproc
            ));
        }
        view.set(g, members.len() * cfg.nproc, restarts);
        let addr = store.addr();
        let faults = match cfg.ft {
            Some(_) => ft_chaos(cfg, gang.leads(), &members.nodes, detection)?,
            None => chaos_plan(
                cfg,
                &store,
                gang.leads(),
                g,
                seen_step,
                &members.nodes,
                detection,
            )?,
        };
        // A partition is its node's alone: its workers cut themselves off, its agent too.
        let cut = crate::partition::Cut::of(&faults, cfg.node_rank);
        let faults: Vec<Fault> = (faults.into_iter())
            .filter(|f| f.partition().is_none() || f.rank == cfg.node_rank)
            .collect();
        let plan = (!faults.is_empty()).then(|| Fault::list(&faults));
        let mut workers = spawn_generation(cfg, g, &members, addr, &secret, plan.clone())?;
        let outcome = loop {
            match watch_generation(
                cfg,
                &gang,
                g,
                &members,
                &mut workers,
                &mut recovery,
                job_deadline,
                cut,
            ) {
                Ok(Outcome::ReplicasLost(failures)) => {
                    let slot = (members.slot(cfg.node_rank).unwrap_or(0), members.len());
                    let env = crate::generation::generation_env(
                        cfg,
                        g,
                        members.len(),
                        addr,
                        &secret,
                        plan.clone(),
                    )?;
                    let spawn =
                        |local| crate::generation::spawn_rank(cfg, g, slot, addr, &env, local);
                    let size = cfg.ft.unwrap_or(1);
                    for r in crate::ft::replace(
                        &store,
                        &mut workers,
                        &failures,
                        (cfg.nproc, size),
                        spawn,
                    )? {
                        restarts += 1;
                        say(format!(
                            "ft: replica {} lost ({}); declared down (incarnation {}), its ranks \
                             restarted ({restarts}/{}); the other replicas train on",
                            r.replica, r.why, r.incarnation, cfg.max_restarts
                        ));
                        if restarts > cfg.max_restarts {
                            stop_all(&mut workers, cfg.kill_grace)?;
                            return Err(LaunchError::RestartsExhausted {
                                restarts: restarts - 1,
                                max: cfg.max_restarts,
                                last: r.why,
                            });
                        }
                    }
                }
                o => break o,
            }
        };
        let outcome = match outcome {
            Ok(o) => o,
            // Node 0 ended a pre-empted job and its store with it: the workers here are
            // exiting with the pre-emption's code (within a bound), which is the outcome.
            Err(e @ LaunchError::Store(_)) if !gang.leads() => {
                let detected = Instant::now();
                let deadline = detected + stores.gone_wait(STORE_GONE_WAIT);
                loop {
                    for w in workers.iter_mut() {
                        w.poll()?;
                    }
                    if workers.iter().all(|w| !w.running())
                        || Instant::now() >= deadline
                        || (stores.replicated() && failover::any_failed(&workers))
                    {
                        break;
                    }
                    wait_for_exit(&workers, STORE_GONE_WAIT / 10);
                }
                match preempted(cfg, &mut workers)? {
                    Some(p) => p,
                    None => {
                        stop_all(&mut workers, cfg.kill_grace)?;
                        let max = cfg.max_restarts;
                        let Some(t) =
                            stores.take_over(&store, &gang, g, restarts, max, detected)?
                        else {
                            return Err(e);
                        };
                        say(t.line);
                        (g, restarts) = (t.to.generation, restarts + 1);
                        let last_step = gang.last_step_seen();
                        seen_step = seen_step.max(last_step.unwrap_or(0));
                        recovery = Some(Recovery {
                            detected,
                            last_step,
                            resumed_reported: false,
                        });
                        continue;
                    }
                }
            }
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
            Outcome::Preempted(what) => {
                say(format!("generation {g} pre-empted: {what}"));
                return Err(LaunchError::Preempted(Preempted { what }));
            }
            Outcome::Failed {
                what,
                detected,
                last_step,
            } => (what, detected, last_step),
            // Replaced in the watch loop above; were one to reach here, it fails the generation.
            Outcome::ReplicasLost(f) => (
                format!(
                    "replica ranks {:?} lost",
                    f.iter().map(|f| f.rank).collect::<Vec<_>>()
                ),
                Instant::now(),
                None,
            ),
        };
        seen_step = seen_step.max(last_step.unwrap_or(0));
        say(format!(
            "generation {g} failed: {what}; stopped this node's workers"
        ));
        if !gang.leads() {
            gang.failure_seen(g);
        }
        if gang.leads() && crate::watchdog::is_refusal(&what) {
            let e = LaunchError::Refused(what);
            let linger = cfg.kill_grace + Duration::from_secs(5);
            gang.abort(g, &members, &e.to_string(), linger)?;
            return Err(e);
        }
        if gang.leads() {
            // A generation ended to admit a waiting node is no failure: not counted.
            let grows = failover::is_growth(&what);
            restarts = if grows {
                restarts
            } else {
                gang.count_restart()?
            };
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
            say(if grows {
                format!(
                    "generation {g} admits the waiting node; every worker starts from the last committed checkpoint (not counted as a restart)"
                )
            } else {
                format!(
                    "restart {restarts}/{}: generation {g} starts every worker from the last committed checkpoint",
                    cfg.max_restarts
                )
            });
        } else {
            let decided = gang.await_decision(g, cfg.admission_timeout);
            let max = cfg.max_restarts;
            match stores.unless_lost(decided, &store, &gang, g, restarts, max)? {
                Err(t) => {
                    say(t.line);
                    (g, restarts) = (t.to.generation, restarts + 1);
                }
                Ok(Decision::Restart(next)) => {
                    g = next;
                    // The leader's count (a generation ended to admit a node is not one).
                    restarts = gang.restarts().unwrap_or(restarts + 1);
                    say(format!("restarting with generation {g}"));
                }
                Ok(Decision::Abort(why)) => return Err(LaunchError::Aborted(why)),
            }
        }
        recovery = Some(Recovery {
            detected,
            last_step,
            resumed_reported: false,
        });
    }
}

/// The job's store endpoints as this node sees them ([`crate::failover`]).
fn endpoints(cfg: &AgentConfig) -> failover::Endpoints {
    let mut list = vec![cfg.rdzv];
    list.extend(cfg.rdzv_standbys.iter().copied());
    let silence = cfg
        .watch
        .as_ref()
        .map_or(STORE_TIMEOUT, |w| w.heartbeat_timeout);
    failover::Endpoints {
        list,
        node: cfg.node_rank,
        connect_timeout: cfg.admission_timeout,
        // With standbys, a silent store is given up on as fast as a silent node.
        request_timeout: if cfg.rdzv_standbys.is_empty() {
            STORE_TIMEOUT
        } else {
            STORE_TIMEOUT.min(silence)
        },
        // A live survivor notices the loss and stops its workers within this.
        takeover_wait: STORE_GONE_WAIT + silence,
    }
}

/// Prints an agent line (prefixed with the node on multi-node jobs).
pub(crate) fn say(cfg: &AgentConfig, line: String) {
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
    let failing = cfg.chaos.failing() as u64;
    // Each failing fault fails a generation (or, under --ft, restarts a replica group).
    let (fit, each) = match cfg.ft {
        Some(_) => (cfg.max_restarts, "restarts a replica group (--ft)"),
        None => (cfg.max_restarts.saturating_add(1), "fails a generation"),
    };
    if failing > fit {
        return Err(LaunchError::invalid(
            "--chaos",
            format!("{failing} failing faults"),
            format!(
                "each {each}, and the job ends after --max-restarts {} restarts: only the first \
                 {fit} could fire",
                cfg.max_restarts,
            ),
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
