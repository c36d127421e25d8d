//! CLI glue over the `launch` agent: where this node sits in the job ([`NodePlan`]: flags, then
//! Slurm or torchrun-style environment), the agent settings of commands that run as a gang of
//! workers without restarts (`bench comm`, [`run_node`]), and a training worker's link to its
//! agent (`launch::Supervision`: heartbeats, chaos). `train` adds heartbeats, the watchdog, restarts
//! and chaos to [`agent_config`]'s settings.

use crate::flag_range::MAX_NPROC;
use anyhow::{Context, Result, bail};
use std::net::SocketAddr;
use std::time::Duration;

/// A worker's identity, read from the environment the agent set.
pub use launch::WorkerEnv as Worker;

/// Where this node's workers sit in the job.
pub struct NodeSpec {
    /// Workers on this node.
    pub nproc: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index.
    pub node_rank: usize,
    /// Store address: node 0 binds it (port 0 picks one; single-node only).
    pub rdzv: SocketAddr,
    /// How long the job may run before it is stopped.
    pub job_timeout: Duration,
}

/// Runs this binary's `args` as `nproc` workers of this node and waits for them; the first
/// failure stops every worker of the job (no restarts).
pub fn run_node(spec: &NodeSpec, args: &[String]) -> Result<()> {
    let mut cfg = agent_config(spec, args.to_vec())?;
    // Without restarts there is no next generation to shrink into: always the whole gang.
    cfg.min_nnodes = cfg.nnodes;
    launch::run(&cfg)?;
    Ok(())
}

/// The agent's settings for `spec` running this binary with `args`: exit statuses watched,
/// no heartbeats, no restarts, no chaos (callers adjust what they need). The job is elastic
/// only if the environment says so ([`elastic_minimum`]); callers holding a [`NodePlan`] set
/// `min_nnodes` from [`NodePlan::min_nnodes`].
pub fn agent_config(spec: &NodeSpec, args: Vec<String>) -> Result<launch::AgentConfig> {
    let program =
        std::env::current_exe().map_err(|e| anyhow::anyhow!("locate the flotilla binary: {e}"))?;
    Ok(launch::AgentConfig {
        command: launch::WorkerCommand {
            program,
            args,
            env: Vec::new(),
        },
        nproc: spec.nproc,
        nnodes: spec.nnodes,
        min_nnodes: elastic_minimum(spec.nnodes),
        node_rank: spec.node_rank,
        rdzv: spec.rdzv,
        rdzv_standbys: Vec::new(),
        watch: None,
        max_restarts: 0,
        chaos: launch::Chaos::default(),
        chaos_seed: 0,
        steps: 0,
        ckpt_dir: None,
        job_timeout: spec.job_timeout,
        admission_timeout: Duration::from_secs(300),
        kill_grace: Duration::from_secs(2),
        term: None,
        term_grace: Duration::from_secs(30),
        log_dir: None,
        run_id: "none".into(),
        metrics_addr: None,
        agreement: Vec::new(),
        straggler: launch::straggler::Policy::Warn,
        ft: None,
    })
}

/// The fewest nodes a generation of an `nnodes`-node job may run on: MIN of a torchrun-style
/// `NNODES=MIN:MAX` in the environment whose MAX is `nnodes`, else `nnodes` (a rigid job).
/// This is how an elastic range reaches the agent when no flag carries it (001 section 12.8:
/// recovery goes on with the nodes that remain).
pub fn elastic_minimum(nnodes: usize) -> usize {
    match launch::NodeEnv::detect() {
        Ok(Some(launch::NodeEnv {
            source: "torchrun",
            nnodes: Some(r),
            ..
        })) if r.max == nnodes => r.min,
        _ => nnodes,
    }
}

/// Worker processes per node when neither --nproc nor the environment says.
pub const DEFAULT_NPROC: usize = 2;

/// This node's place in the job: flags first, then the scheduler's environment (torchrun-style
/// or Slurm, see [`launch::NodeEnv`]), then defaults (one node, [`DEFAULT_NPROC`] workers, a
/// free loopback port).
pub struct NodePlan {
    /// Workers on this node.
    pub nproc: usize,
    /// Nodes in the job (the most a generation runs on).
    pub nnodes: usize,
    /// Fewest nodes a generation may run on (`nnodes` unless elastic: `--nnodes MIN:MAX`).
    pub min_nnodes: usize,
    /// This node.
    pub node_rank: usize,
    /// The store's address.
    pub rdzv: SocketAddr,
    /// Standby store endpoints (`--rdzv H0:P0,H1:P1,...` past the first): node k hosts the
    /// k-th, which takes the job over if the store before it is lost (`launch::failover`).
    pub standbys: Vec<SocketAddr>,
    /// The scheduler convention that supplied a value, if any did.
    pub source: Option<&'static str>,
}

impl NodePlan {
    /// Resolves the flags `--nproc`, `--nnodes` (`N`, or a [`launch::NodeRange`] `MIN:MAX`),
    /// `--node-rank` and `--rdzv` (`None`: not given).
    pub fn resolve(
        nproc: Option<usize>,
        nnodes: Option<impl Into<launch::NodeRange>>,
        node_rank: Option<usize>,
        rdzv: Option<&str>,
    ) -> Result<NodePlan> {
        let given = [
            nproc.is_some(),
            nnodes.is_some(),
            node_rank.is_some(),
            rdzv.is_some(),
        ];
        let env = if given.iter().all(|&g| g) {
            None
        } else {
            launch::NodeEnv::detect()?
        };
        NodePlan::combine(nproc, nnodes.map(Into::into), node_rank, rdzv, env)
    }

    /// [`NodePlan::resolve`] with the scheduler's environment given.
    fn combine(
        nproc: Option<usize>,
        nnodes: Option<launch::NodeRange>,
        node_rank: Option<usize>,
        rdzv: Option<&str>,
        env: Option<launch::NodeEnv>,
    ) -> Result<NodePlan> {
        let e = env.clone().unwrap_or_default();
        let rdzv_text = rdzv.map(str::to_string).or_else(|| {
            e.master_addr
                .as_ref()
                .map(|h| format!("{h}:{}", e.master_port.unwrap_or(launch::env::DEFAULT_PORT)))
        });
        let mut endpoints = match rdzv_text {
            Some(t) => t
                .split(',')
                .map(|one| resolve_endpoint(&t, one.trim()))
                .collect::<Result<Vec<_>>>()?,
            None => vec!["127.0.0.1:0".parse().context("loopback address")?],
        };
        let rdzv = endpoints.remove(0);
        let nodes = nnodes.or(e.nnodes).unwrap_or(launch::NodeRange::from(1));
        let plan = NodePlan {
            nproc: nproc.or(e.nproc_per_node).unwrap_or(DEFAULT_NPROC),
            nnodes: nodes.max,
            min_nnodes: nodes.min,
            node_rank: node_rank.or(e.node_rank).unwrap_or(0),
            rdzv,
            standbys: endpoints,
            source: env.map(|e| e.source),
        };
        if plan.nproc == 0 || plan.nnodes == 0 || plan.node_rank >= plan.nnodes {
            bail!(
                "need nproc >= 1 and node rank < nnodes (got nproc {}, nnodes {}, node rank {}{})",
                plan.nproc,
                nodes,
                plan.node_rank,
                plan.source
                    .map_or_else(String::new, |s| format!("; from the {s} environment"))
            );
        }
        if plan.nproc as u64 > MAX_NPROC {
            // `--nproc` is bounded where it is parsed; NPROC_PER_NODE and Slurm's counts here.
            bail!(
                "nproc {}{}: at most {MAX_NPROC} workers per node",
                plan.nproc,
                plan.source
                    .map_or_else(String::new, |s| format!(" from the {s} environment"))
            );
        }
        Ok(plan)
    }
}

/// One endpoint `one` of the `--rdzv` list `list`: HOST:PORT, IPv4 preferred.
fn resolve_endpoint(list: &str, one: &str) -> Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    let mut addrs: Vec<SocketAddr> = one
        .to_socket_addrs()
        .with_context(|| format!("--rdzv '{list}': expected HOST:PORT[,HOST:PORT...] that resolves ('{one}' does not)"))?
        .collect();
    addrs.sort_by_key(|a| !a.is_ipv4());
    addrs
        .first()
        .copied()
        .with_context(|| format!("--rdzv '{list}': no address for '{one}'"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_environment_which_overrides_defaults() {
        let slurm = launch::NodeEnv {
            source: "slurm",
            nnodes: Some(launch::NodeRange::from(2)),
            node_rank: Some(1),
            nproc_per_node: Some(4),
            master_addr: Some("127.0.0.1".into()),
            master_port: Some(29511),
        };
        let p = NodePlan::combine(None, None, None, None, Some(slurm.clone())).unwrap();
        assert_eq!((p.nproc, p.nnodes, p.node_rank), (4, 2, 1));
        assert_eq!(p.rdzv.to_string(), "127.0.0.1:29511");
        assert_eq!(p.source, Some("slurm"));
        let p =
            NodePlan::combine(Some(1), None, Some(0), Some("127.0.0.1:7"), Some(slurm)).unwrap();
        assert_eq!((p.nproc, p.nnodes, p.node_rank), (1, 2, 0));
        assert_eq!(p.rdzv.port(), 7);
        let p = NodePlan::combine(None, None, None, None, None).unwrap();
        assert_eq!((p.nproc, p.nnodes, p.node_rank), (DEFAULT_NPROC, 1, 0));
        assert_eq!(p.rdzv.port(), 0);
        let elastic = launch::NodeRange::new(2, 3).unwrap();
        let p = NodePlan::combine(Some(1), Some(elastic), Some(2), None, None).unwrap();
        assert_eq!((p.min_nnodes, p.nnodes, p.node_rank), (2, 3, 2));
        let p = NodePlan::resolve(Some(1), Some(4usize), Some(0), Some("127.0.0.1:7")).unwrap();
        assert_eq!((p.min_nnodes, p.nnodes), (4, 4));
        let e = NodePlan::combine(None, Some(2.into()), Some(2), None, None)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("node rank 2"), "{e}");
        // `--nnodes MIN:MAX` as a clap flag of type `Option<launch::NodeRange>`.
        #[derive(clap::Parser)]
        struct Flags {
            #[arg(long)]
            nnodes: Option<launch::NodeRange>,
        }
        use clap::Parser;
        let f = Flags::try_parse_from(["t", "--nnodes", "2:3"]).unwrap();
        assert_eq!(f.nnodes, Some(elastic));
        let e = Flags::try_parse_from(["t", "--nnodes", "3:2"])
            .err()
            .unwrap();
        assert!(e.to_string().contains("3:2"), "{e}");
        let e = NodePlan::combine(None, None, None, Some("nowhere"), None)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--rdzv 'nowhere'"), "{e}");
        // A list: the first endpoint is the store, the others its standbys.
        let p = NodePlan::combine(
            Some(1),
            Some(elastic),
            Some(1),
            Some("127.0.0.1:7, 127.0.0.2:8"),
            None,
        )
        .unwrap();
        assert_eq!(p.rdzv.to_string(), "127.0.0.1:7");
        assert_eq!(p.standbys, vec!["127.0.0.2:8".parse().unwrap()]);
        let e = NodePlan::combine(None, None, None, Some("127.0.0.1:7,nowhere"), None)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("'nowhere' does not"), "{e}");
    }

    #[test]
    fn the_environment_cannot_ask_for_unbounded_workers() {
        let torchrun = launch::NodeEnv {
            source: "torchrun",
            nproc_per_node: Some(100_000),
            ..launch::NodeEnv::default()
        };
        let e = NodePlan::combine(None, None, None, None, Some(torchrun))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("nproc 100000 from the torchrun environment"),
            "{e}"
        );
        assert!(e.contains("at most 1024"), "{e}");
    }
}
