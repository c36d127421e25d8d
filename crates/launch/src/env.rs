//! The environment: a worker's identity (set by the agent), and a node's place in the job as a
//! scheduler describes it (Slurm, or torchrun-style variables), read when flags are absent
//! (001 section 12.5: the scheduler decides who runs where; the launcher reads its answer).

use crate::elastic::NodeRange;
use crate::error::{LaunchError, Result};
use comm::group::Rendezvous;
use comm::store::Secret;
use std::ffi::OsString;

/// The worker's global rank.
pub const ENV_RANK: &str = "FLOTILLA_RANK";
/// Ranks in the job.
pub const ENV_WORLD: &str = "FLOTILLA_WORLD_SIZE";
/// The rendezvous store's address.
pub const ENV_RDZV: &str = "FLOTILLA_RDZV";
/// The membership generation the worker belongs to (0, then one more per restart).
pub const ENV_GENERATION: &str = "FLOTILLA_GENERATION";
/// The job secret.
pub const ENV_SECRET: &str = "FLOTILLA_SECRET";
/// Heartbeat period in milliseconds; absent: the worker publishes no heartbeats.
pub const ENV_HEARTBEAT_MS: &str = "FLOTILLA_HEARTBEAT_MS";
/// Workers on this worker's node, under torchrun's name (`model::memory` gives each its share
/// of the node's memory by it).
pub const ENV_LOCAL_WORLD: &str = "LOCAL_WORLD_SIZE";
/// The resolved chaos plan for this worker (see [`crate::chaos::Chaos`]); absent: none.
pub const ENV_CHAOS: &str = "FLOTILLA_CHAOS";

/// Where a worker sits, as torchrun tells its workers (`torch.distributed.run`): the variables
/// every tool of that ecosystem reads, set by the agent beside Flotilla's own. `GROUP_RANK` is
/// the node's place among the generation's members, `MASTER_ADDR:MASTER_PORT` the rendezvous
/// store, `TORCHELASTIC_RESTART_COUNT` the generation (one per restart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TorchrunIdentity {
    /// Global rank (`RANK`).
    pub rank: usize,
    /// Rank on this node (`LOCAL_RANK`).
    pub local_rank: usize,
    /// Ranks in the job (`WORLD_SIZE`).
    pub world: usize,
    /// Workers on this node (`LOCAL_WORLD_SIZE`).
    pub local_world: usize,
    /// This node's place among the generation's nodes (`GROUP_RANK`).
    pub group_rank: usize,
    /// Nodes in the generation (`GROUP_WORLD_SIZE`).
    pub group_world: usize,
    /// The rendezvous store (`MASTER_ADDR`, `MASTER_PORT`).
    pub master: std::net::SocketAddr,
    /// Restarts so far (`TORCHELASTIC_RESTART_COUNT`).
    pub restarts: u64,
    /// Restarts allowed (`TORCHELASTIC_MAX_RESTARTS`).
    pub max_restarts: u64,
}

impl TorchrunIdentity {
    /// The variables, as (name, value) pairs.
    pub fn vars(&self) -> Vec<(String, String)> {
        let v = |k: &str, x: &dyn ToString| (k.to_string(), x.to_string());
        vec![
            v("RANK", &self.rank),
            v("LOCAL_RANK", &self.local_rank),
            v("WORLD_SIZE", &self.world),
            v(ENV_LOCAL_WORLD, &self.local_world),
            v("GROUP_RANK", &self.group_rank),
            v("GROUP_WORLD_SIZE", &self.group_world),
            v("ROLE_RANK", &self.rank),
            v("ROLE_WORLD_SIZE", &self.world),
            v("MASTER_ADDR", &self.master.ip()),
            v("MASTER_PORT", &self.master.port()),
            v("TORCHELASTIC_RESTART_COUNT", &self.restarts),
            v("TORCHELASTIC_MAX_RESTARTS", &self.max_restarts),
        ]
    }
}

/// A worker's identity, as the agent put it in the environment.
pub struct WorkerEnv {
    /// Global rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world: usize,
    /// Ranks on this worker's node (`LOCAL_WORLD_SIZE`; the world when absent).
    pub local_world: usize,
    /// The store, secret and generation to join.
    pub rdv: Rendezvous,
    /// Heartbeat period, if the agent watches heartbeats.
    pub heartbeat: Option<std::time::Duration>,
    /// The chaos plan text, if any.
    pub chaos: Option<String>,
}

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> Result<T> {
    value.trim().parse().map_err(|_| LaunchError::Env {
        name: name.into(),
        value: value.into(),
        why: format!("expected a {}", std::any::type_name::<T>()),
    })
}

fn required<T: std::str::FromStr>(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<T> {
    let v = get(name).ok_or_else(|| LaunchError::Env {
        name: name.into(),
        value: String::new(),
        why: "is not set".into(),
    })?;
    parse(name, &v)
}

impl WorkerEnv {
    /// This process's identity if an agent started it as a worker (`FLOTILLA_RANK` is set).
    pub fn from_env() -> Result<Option<WorkerEnv>> {
        let get = |k: &str| std::env::var(k).ok();
        if get(ENV_RANK).is_none() {
            return Ok(None);
        }
        let secret = Secret::from_env_required()?;
        let generation = match get(ENV_GENERATION) {
            Some(g) => parse(ENV_GENERATION, &g)?,
            None => 0,
        };
        let world = required(&get, ENV_WORLD)?;
        let w = WorkerEnv {
            rank: required(&get, ENV_RANK)?,
            world,
            local_world: match get(ENV_LOCAL_WORLD) {
                Some(n) => parse(ENV_LOCAL_WORLD, &n)?,
                None => world,
            },
            rdv: Rendezvous {
                addr: required(&get, ENV_RDZV)?,
                secret,
                generation,
            },
            heartbeat: match get(ENV_HEARTBEAT_MS) {
                Some(ms) => Some(std::time::Duration::from_millis(
                    parse::<u64>(ENV_HEARTBEAT_MS, &ms)?.max(1),
                )),
                None => None,
            },
            chaos: get(ENV_CHAOS).filter(|c| !c.is_empty()),
        };
        if w.rank >= w.world {
            return Err(LaunchError::Env {
                name: ENV_RANK.into(),
                value: w.rank.to_string(),
                why: format!("not below {ENV_WORLD}={}", w.world),
            });
        }
        Ok(Some(w))
    }
}

/// A node's place in the job as the scheduler's environment gives it; `None` fields were not
/// given there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeEnv {
    /// Which scheduler convention supplied it ("torchrun" or "slurm").
    pub source: &'static str,
    /// Nodes in the job: `N`, or torchrun's elastic `MIN:MAX` (see [`crate::elastic`]).
    pub nnodes: Option<NodeRange>,
    /// This node's index.
    pub node_rank: Option<usize>,
    /// Worker processes per node.
    pub nproc_per_node: Option<usize>,
    /// Host of node 0 (where the store runs).
    pub master_addr: Option<String>,
    /// Port of the store.
    pub master_port: Option<u16>,
}

/// The store port Slurm jobs use when `MASTER_PORT` is not set.
pub const DEFAULT_PORT: u16 = 29500;

impl NodeEnv {
    /// Reads the process environment (see [`NodeEnv::from_lookup`]).
    pub fn detect() -> Result<Option<NodeEnv>> {
        NodeEnv::from_lookup(|k| std::env::var_os(k))
    }

    /// Reads torchrun-style variables (`MASTER_ADDR`, `MASTER_PORT`, `NNODES`, `NODE_RANK`,
    /// `NPROC_PER_NODE`) if `NNODES` or `NODE_RANK` is set, else Slurm's (`SLURM_NNODES`,
    /// `SLURM_NODEID`, `SLURM_NTASKS_PER_NODE` or `SLURM_GPUS_ON_NODE`, and the first host of
    /// `SLURM_JOB_NODELIST`) if `SLURM_JOB_ID` is set; `None` when neither is present.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<OsString>) -> Result<Option<NodeEnv>> {
        let get = |k: &str| {
            lookup(k)
                .map(|v| v.to_string_lossy().trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let opt = |k: &str| -> Result<Option<usize>> {
            get(k).map(|v| parse::<usize>(k, &v)).transpose()
        };
        let range = |k: &str| -> Result<Option<NodeRange>> {
            get(k)
                .map(|v| {
                    v.parse::<NodeRange>().map_err(|e| LaunchError::Env {
                        name: k.into(),
                        value: v.clone(),
                        why: e.to_string(),
                    })
                })
                .transpose()
        };
        let port = get("MASTER_PORT")
            .map(|v| parse::<u16>("MASTER_PORT", &v))
            .transpose()?;
        if get("NNODES").is_some() || get("NODE_RANK").is_some() {
            return Ok(Some(NodeEnv {
                source: "torchrun",
                nnodes: range("NNODES")?,
                node_rank: opt("NODE_RANK")?,
                nproc_per_node: opt("NPROC_PER_NODE")?,
                master_addr: get("MASTER_ADDR"),
                master_port: port,
            }));
        }
        if get("SLURM_JOB_ID").is_none() {
            return Ok(None);
        }
        let per_node = match get("SLURM_NTASKS_PER_NODE") {
            // "2" or "2(x3)": the count before any repetition suffix.
            Some(v) => Some(parse::<usize>(
                "SLURM_NTASKS_PER_NODE",
                v.split('(').next().unwrap_or(&v),
            )?),
            None => opt("SLURM_GPUS_ON_NODE")?,
        };
        let master = match get("MASTER_ADDR") {
            Some(a) => Some(a),
            None => get("SLURM_JOB_NODELIST")
                .map(|l| first_host(&l))
                .transpose()?,
        };
        Ok(Some(NodeEnv {
            source: "slurm",
            nnodes: range("SLURM_NNODES")?,
            node_rank: opt("SLURM_NODEID")?,
            nproc_per_node: per_node,
            master_addr: master,
            master_port: Some(port.unwrap_or(DEFAULT_PORT)),
        }))
    }
}

/// The first host of a Slurm node list: `gpu[03-05,9],cpu1` gives `gpu03`, `a1,b2` gives `a1`,
/// `n[7]-ib` gives `n7-ib`.
pub fn first_host(list: &str) -> Result<String> {
    let bad = |why: &str| LaunchError::Env {
        name: "SLURM_JOB_NODELIST".into(),
        value: list.into(),
        why: why.into(),
    };
    // The first top-level item: commas inside brackets do not separate hosts.
    let mut depth = 0usize;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1).ok_or_else(|| bad("unbalanced ']'"))?,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let item = list[..end].trim();
    let Some(open) = item.find('[') else {
        return if item.is_empty() {
            Err(bad("empty node list"))
        } else {
            Ok(item.to_string())
        };
    };
    let close = item[open..]
        .find(']')
        .map(|c| open + c)
        .ok_or_else(|| bad("unbalanced '['"))?;
    let inner = &item[open + 1..close];
    let first = inner
        .split(',')
        .next()
        .and_then(|r| r.split('-').next())
        .map(str::trim)
        .filter(|f| !f.is_empty() && f.chars().all(|c| c.is_ascii_digit()))
        .ok_or_else(|| bad("expected digits inside the brackets"))?;
    Ok(format!("{}{first}{}", &item[..open], &item[close + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Result<Option<NodeEnv>> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        NodeEnv::from_lookup(move |k| {
            pairs
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| OsString::from(v))
        })
    }

    #[test]
    fn nothing_set_is_none() {
        assert_eq!(env(&[("HOME", "/root")]).unwrap(), None);
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29400"),
            ("NNODES", "4"),
            ("NODE_RANK", "2"),
            ("NPROC_PER_NODE", "8"),
            ("SLURM_JOB_ID", "77"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(e.source, "torchrun");
        assert_eq!(
            (e.nnodes, e.node_rank, e.nproc_per_node),
            (Some(NodeRange::from(4)), Some(2), Some(8))
        );
        let elastic = env(&[("NNODES", "2:4"), ("NODE_RANK", "1")])
            .unwrap()
            .unwrap();
        assert_eq!(elastic.nnodes, Some(NodeRange::new(2, 4).unwrap()));
        assert_eq!(e.master_addr.as_deref(), Some("10.0.0.1"));
        assert_eq!(e.master_port, Some(29400));
    }

    #[test]
    fn slurm_variables() {
        let e = env(&[
            ("SLURM_JOB_ID", "77"),
            ("SLURM_NNODES", "3"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2(x3)"),
            ("SLURM_JOB_NODELIST", "gpu[07-09,12],login1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(e.source, "slurm");
        assert_eq!(
            (e.nnodes, e.node_rank, e.nproc_per_node),
            (Some(NodeRange::from(3)), Some(1), Some(2))
        );
        assert_eq!(e.master_addr.as_deref(), Some("gpu07"));
        assert_eq!(e.master_port, Some(DEFAULT_PORT));
        let gpus = env(&[("SLURM_JOB_ID", "1"), ("SLURM_GPUS_ON_NODE", "4")])
            .unwrap()
            .unwrap();
        assert_eq!(gpus.nproc_per_node, Some(4));
    }

    #[test]
    fn node_lists() {
        assert_eq!(first_host("a1,b2").unwrap(), "a1");
        assert_eq!(first_host("node[001-004]").unwrap(), "node001");
        assert_eq!(first_host("n[7]-ib,m[1-2]").unwrap(), "n7-ib");
        assert_eq!(first_host(" single ").unwrap(), "single");
        for bad in ["", "x[1-2", "x]1", "x[]", "x[a-b]"] {
            let e = first_host(bad).unwrap_err().to_string();
            assert!(e.contains("SLURM_JOB_NODELIST"), "{bad}: {e}");
        }
    }

    #[test]
    fn bad_values_are_named() {
        let e = env(&[("NNODES", "two")]).unwrap_err().to_string();
        assert!(e.contains("NNODES='two'"), "{e}");
        let e = env(&[("NNODES", "3:2")]).unwrap_err().to_string();
        assert!(e.contains("NNODES='3:2'"), "{e}");
        let e = env(&[("SLURM_JOB_ID", "1"), ("MASTER_PORT", "99999")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("MASTER_PORT"), "{e}");
    }
}
