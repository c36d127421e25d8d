//! One generation of workers on this node: spawned with their identity (Flotilla's variables
//! and torchrun's), then watched until the generation completes, fails somewhere, or is
//! pre-empted (001 sections 12.6-12.8).

use crate::agent::{AgentConfig, say};
use crate::elastic::Membership;
use crate::env::{
    ENV_CHAOS, ENV_GENERATION, ENV_HEARTBEAT_MS, ENV_RANK, ENV_RDZV, ENV_SECRET, ENV_WORLD,
    TorchrunIdentity,
};
use crate::error::{LaunchError, Result};
use crate::exit::EXIT_PREEMPTED;
use crate::gang::Gang;
use crate::heartbeat::Beat;
use crate::process::{LocalWorker, stop_all};
use crate::term::Termination;
use crate::watchdog::{Failure, FailureKind, WorkerWatch};
use comm::CommError;
use comm::store::Secret;
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

/// How often the agent looks at its workers and the store, at the least: a worker's exit wakes
/// it at once ([`crate::process::wait_for_exit`]).
const POLL: Duration = Duration::from_millis(100);
/// After a first local failure, how long to let the rest of the picture arrive (a killed rank's
/// peers fail a moment later) before naming the root cause.
const ATTRIBUTION_GRACE: Duration = Duration::from_millis(300);
/// How a generation ended on this node.
pub(crate) enum Outcome {
    Complete,
    /// SIGTERM (to the agent, or a worker that then stopped the job): the workers were given
    /// the grace to save and exit; what happened, in words.
    Preempted(String),
    Failed {
        what: String,
        detected: Instant,
        last_step: Option<u64>,
    },
    /// Under per-step fault tolerance: these ranks failed; their replicas are replaced while
    /// the others train on ([`crate::ft`]).
    ReplicasLost(Vec<Failure>),
}

/// Recovery in progress: reported once the new generation trains again.
pub(crate) struct Recovery {
    pub(crate) detected: Instant,
    pub(crate) last_step: Option<u64>,
    pub(crate) resumed_reported: bool,
}

/// Starts this node's workers of generation `g`: ranks `slot * nproc ..` of a world of
/// `members x nproc`, where `slot` is this node's place among the members.
pub(crate) fn spawn_generation(
    cfg: &AgentConfig,
    g: u64,
    members: &Membership,
    addr: SocketAddr,
    secret: &Secret,
    fault: Option<String>,
) -> Result<Vec<LocalWorker>> {
    let slot = members.slot(cfg.node_rank).ok_or_else(|| {
        LaunchError::invalid(
            "--node-rank",
            cfg.node_rank.to_string(),
            format!("not a member of generation {g} ({:?})", members.nodes),
        )
    })?;
    let env = generation_env(cfg, g, members.len(), addr, secret, fault)?;
    let mut workers = Vec::with_capacity(cfg.nproc);
    for local in 0..cfg.nproc {
        match spawn_rank(cfg, g, (slot, members.len()), addr, &env, local) {
            Ok(w) => workers.push(w),
            Err(e) => {
                stop_all(&mut workers, cfg.kill_grace)?;
                return Err(e);
            }
        }
    }
    Ok(workers)
}

/// The environment every worker of generation `g` on this node shares (its identity is added
/// per rank by [`spawn_rank`]).
pub(crate) fn generation_env(
    cfg: &AgentConfig,
    g: u64,
    members: usize,
    addr: SocketAddr,
    secret: &Secret,
    fault: Option<String>,
) -> Result<Vec<(String, String)>> {
    let mut env = vec![
        (ENV_WORLD.to_string(), (cfg.nproc * members).to_string()),
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
    if let Some(f) = fault {
        env.push((ENV_CHAOS.into(), f));
    }
    Ok(env)
}

/// Starts local worker `local` of generation `g` on this node, the node at place `slot` of
/// `members` nodes, with the generation's environment `common`.
pub(crate) fn spawn_rank(
    cfg: &AgentConfig,
    g: u64,
    (slot, members): (usize, usize),
    addr: SocketAddr,
    common: &[(String, String)],
    local: usize,
) -> Result<LocalWorker> {
    let world = cfg.nproc * members;
    let rank = slot * cfg.nproc + local;
    let mut env = common.to_vec();
    env.push((ENV_RANK.into(), rank.to_string()));
    let torchrun = TorchrunIdentity {
        rank,
        local_rank: local,
        world,
        local_world: cfg.nproc,
        group_rank: slot,
        group_world: members,
        master: addr,
        restarts: g,
        max_restarts: cfg.max_restarts,
    };
    env.extend(torchrun.vars());
    // torchrun's layout: DIR/RUN_ID/attempt_N/LOCAL_RANK/{stdout,stderr}.log.
    let logs = cfg.log_dir.as_ref().map(|d| {
        d.join(&cfg.run_id)
            .join(format!("attempt_{g}"))
            .join(local.to_string())
    });
    LocalWorker::spawn(&cfg.command, rank, &env, logs.as_deref())
}

/// The failure a worker's exit status shows, if any.
fn exit_failure(w: &LocalWorker, beat: Option<Beat>) -> Option<Failure> {
    let st = w.status?;
    let kind = match (st.code(), st.signal()) {
        // A pre-empted worker is no failure: the next look sees the pre-emption.
        (Some(0 | EXIT_PREEMPTED), _) => return None,
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

/// Watches generation `g` on this node until it completes or fails somewhere; `cut`, a chaos
/// partition of this node, is sat out when a local worker reaches its step.
// Eight plain inputs, each used in place: a struct holding them would only be unpacked here.
#[allow(clippy::too_many_arguments)]
pub(crate) fn watch_generation(
    cfg: &AgentConfig,
    gang: &Gang<'_>,
    g: u64,
    members: &Membership,
    workers: &mut [LocalWorker],
    recovery: &mut Option<Recovery>,
    job_deadline: Instant,
    mut cut: Option<crate::partition::Cut>,
) -> Result<Outcome> {
    let say = |line: String| say(cfg, line);
    let now = Instant::now();
    let mut watches: Vec<WorkerWatch> = workers
        .iter()
        .map(|w| WorkerWatch::new(w.rank, now))
        .collect();
    let mut marked_done = false;
    let mut straggler_said = false;
    loop {
        let now = Instant::now();
        if now >= job_deadline {
            return Err(LaunchError::JobTimeout(cfg.job_timeout));
        }
        // Node 0 may end the generation and move on before this node reads why: the store then
        // refuses this generation's requests, which says the same.
        let seen_step = last_step(&watches);
        let moved_on = |e: LaunchError| match e {
            LaunchError::Store(CommError::StaleGeneration { current, .. }) if !gang.leads() => {
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
        if let Some(p) = preempted(cfg, workers)? {
            return Ok(p);
        }
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
        // A chaos partition of this node: sit it out without a word to the store, then watch on.
        if let Some(c) = cut.take_if(|c| c.due(last_step(&watches))) {
            c.sit_out(job_deadline, &say)?;
            continue;
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
        if !failures.is_empty() && cfg.ft.is_some() {
            // Per-step fault tolerance: the failed replicas are replaced, the others go on.
            return Ok(Outcome::ReplicasLost(failures));
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
        if gang.leads()
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
        if gang.leads()
            && let Some(node) = gang.waiting_node(g, members)?
        {
            let grow = crate::failover::growth(node, g, members.len(), cfg.nnodes);
            return Ok(Outcome::Failed {
                what: gang.report_failure(g, &grow)?,
                detected: now,
                last_step: last_step(&watches),
            });
        }
        if gang.leads()
            && cfg.straggler == crate::straggler::Policy::Exclude
            && let Some((node, what)) = crate::straggler::to_exclude(
                gang,
                g,
                &members.nodes,
                cfg.nproc,
                cfg.min_nnodes,
                &mut straggler_said,
            )?
        {
            gang.exclude(node);
            return Ok(Outcome::Failed {
                what: gang.report_failure(g, &what)?,
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

/// How long an agent whose store went away waits for its workers to exit before it decides
/// whether they were pre-empted: node 0 ends a pre-empted job (and its store) once its own
/// workers have passed their last barrier, when the other nodes' workers are exiting too.
pub(crate) const STORE_GONE_WAIT: Duration = Duration::from_secs(5);

/// A pre-emption, if one began: this agent received SIGTERM, or a worker exited with
/// [`EXIT_PREEMPTED`] (it received SIGTERM itself, and its peers agreed to stop after the same
/// step). Every local worker still running gets SIGTERM (a second one is harmless) and the rest
/// of `--term-grace-s` to commit its checkpoint and exit, then SIGKILL.
pub(crate) fn preempted(cfg: &AgentConfig, workers: &mut [LocalWorker]) -> Result<Option<Outcome>> {
    // Statuses as last polled: the watch loop polls after this look, reading each exiting
    // worker's last heartbeat first.
    let code = |w: &LocalWorker| w.status.and_then(|s| s.code());
    let signalled = cfg.term.as_ref().and_then(Termination::requested);
    let by_worker = workers.iter().find(|w| code(w) == Some(EXIT_PREEMPTED));
    let (cause, since) = match (signalled, by_worker) {
        (Some(since), _) => ("this launcher received SIGTERM".to_string(), since),
        (None, Some(w)) => (
            format!(
                "a worker received SIGTERM (rank {} exited {EXIT_PREEMPTED} first)",
                w.rank
            ),
            Duration::ZERO,
        ),
        (None, None) => return Ok(None),
    };
    let t0 = Instant::now();
    stop_all(workers, cfg.term_grace.saturating_sub(since))?;
    let waited = since + t0.elapsed();
    let saved = workers.iter().all(|w| code(w) == Some(EXIT_PREEMPTED));
    let what = if saved {
        format!(
            "{cause}; every worker committed its checkpoint and exited {EXIT_PREEMPTED}, \
             {:.2} s after this agent knew (--term-grace-s {})",
            waited.as_secs_f64(),
            cfg.term_grace.as_secs_f64()
        )
    } else {
        let others: Vec<String> = workers
            .iter()
            .filter(|w| code(w) != Some(EXIT_PREEMPTED))
            .map(|w| match w.status.map(|s| (s.code(), s.signal())) {
                Some((Some(c), _)) => format!("rank {} exited {c}", w.rank),
                Some((None, Some(sig))) => format!("rank {} killed by signal {sig}", w.rank),
                _ => format!("rank {} ended", w.rank),
            })
            .collect();
        format!(
            "{cause}; not every worker saved within --term-grace-s {} ({}): the job resumes \
             from its last committed checkpoint",
            cfg.term_grace.as_secs_f64(),
            others.join(", ")
        )
    };
    Ok(Some(Outcome::Preempted(what)))
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
