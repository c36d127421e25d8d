//! One task per rank under Slurm (`srun flotilla train --srun ...`): Slurm starts every rank
//! itself, so there is no agent. Each process reads its identity from Slurm's variables
//! (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the node's task count, the first host of
//! the node list as the store's host) and rank 0 hosts the rendezvous store there.
//!
//! What the agent does and Slurm then does instead: restarts after a failure (Slurm's
//! `--requeue` with `scontrol requeue`, or `RequeueExit`; the job resumes from the last
//! committed checkpoint), node replacement (the requeued job gets whatever nodes Slurm gives
//! it; the run resumes on any world size), pre-emption (Slurm signals every task; each stops
//! after the same step, the ranks agreeing, saves and exits 75). What does not hold: heartbeats,
//! the watchdog, per-step restarts within the job and `--chaos` (no agent to watch or restart),
//! elastic `--nnodes MIN:MAX` (Slurm's allocation is the world).

use crate::env::{DEFAULT_PORT, WorkerEnv, first_host};
use crate::error::{LaunchError, Result};
use comm::group::Rendezvous;
use comm::store::{Secret, StoreServer};
use std::ffi::OsString;
use std::net::{SocketAddr, ToSocketAddrs};

/// A rank that Slurm started: its identity, and the store it hosts if it is rank 0.
pub struct SrunRank {
    /// Rank, world and rendezvous, as a worker under the agent has them (no heartbeat, no
    /// chaos).
    pub worker: WorkerEnv,
    /// Rank on this node (`SLURM_LOCALID`).
    pub local_rank: usize,
    /// The rendezvous store, bound by rank 0 on every interface at the store's port, held
    /// for the life of the run.
    pub store: Option<StoreServer>,
}

/// Tasks on node `node` from Slurm's compressed count list: `2(x3),1` is 2, 2, 2, 1.
pub fn tasks_on_node(list: &str, node: usize) -> Option<usize> {
    let mut seen = 0;
    for item in list.split(',') {
        let (count, times) = match item.split_once("(x") {
            Some((c, t)) => (c, t.trim_end_matches(')').trim().parse::<usize>().ok()?),
            None => (item, 1),
        };
        let count = count.trim().parse::<usize>().ok()?;
        if node < seen + times {
            return Some(count);
        }
        seen += times;
    }
    None
}

impl SrunRank {
    /// This process's identity from the environment Slurm's `srun` gave it; rank 0 binds the
    /// store. Refused, naming the variable, outside an srun step.
    pub fn from_env() -> Result<SrunRank> {
        let rank = SrunRank::identify(|k| std::env::var_os(k))?;
        let store = if rank.worker.rank == 0 {
            let any: SocketAddr = ([0, 0, 0, 0], rank.worker.rdv.addr.port()).into();
            Some(StoreServer::bind(any, rank.worker.rdv.secret.clone())?)
        } else {
            None
        };
        Ok(SrunRank { store, ..rank })
    }

    /// [`SrunRank::from_env`] over a variable lookup, binding nothing.
    pub fn identify(lookup: impl Fn(&str) -> Option<OsString>) -> Result<SrunRank> {
        let get = |k: &str| {
            lookup(k)
                .map(|v| v.to_string_lossy().trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let missing = |k: &str| LaunchError::Env {
            name: k.into(),
            value: String::new(),
            why: "is not set: --srun runs each rank as a task srun starts (one task per rank)"
                .into(),
        };
        let num = |k: &str| -> Result<usize> {
            let v = get(k).ok_or_else(|| missing(k))?;
            v.parse().map_err(|_| LaunchError::Env {
                name: k.into(),
                value: v,
                why: "expected a number".into(),
            })
        };
        let (rank, world) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?);
        if rank >= world {
            return Err(LaunchError::Env {
                name: "SLURM_PROCID".into(),
                value: rank.to_string(),
                why: format!("not below SLURM_NTASKS={world}"),
            });
        }
        let host = match get("MASTER_ADDR") {
            Some(h) => h,
            None => {
                let list = get("SLURM_STEP_NODELIST")
                    .or_else(|| get("SLURM_JOB_NODELIST"))
                    .ok_or_else(|| missing("SLURM_JOB_NODELIST"))?;
                first_host(&list)?
            }
        };
        let port = match get("MASTER_PORT") {
            Some(p) => p.parse::<u16>().map_err(|_| LaunchError::Env {
                name: "MASTER_PORT".into(),
                value: p,
                why: "expected a port number".into(),
            })?,
            None => DEFAULT_PORT,
        };
        let addr = (host.as_str(), port)
            .to_socket_addrs()
            .map_err(|e| LaunchError::io(format!("resolving the store host {host}"), e))?
            .min_by_key(|a| !a.is_ipv4())
            .ok_or_else(|| {
                LaunchError::io(
                    format!("resolving the store host {host}"),
                    std::io::Error::from(std::io::ErrorKind::NotFound),
                )
            })?;
        let node = num("SLURM_NODEID").unwrap_or(0);
        let local_world = get("SLURM_STEP_TASKS_PER_NODE")
            .or_else(|| get("SLURM_TASKS_PER_NODE"))
            .and_then(|l| tasks_on_node(&l, node))
            .unwrap_or(world);
        let worker = WorkerEnv {
            rank,
            world,
            local_world,
            rdv: Rendezvous {
                addr,
                secret: Secret::from_lookup(&lookup)?.ok_or_else(|| {
                    LaunchError::invalid(
                        "--srun",
                        "",
                        "needs the job secret in FLOTILLA_SECRET or FLOTILLA_SECRET_FILE \
                         (the same on every task: set it in the sbatch script)",
                    )
                })?,
                generation: 0,
            },
            heartbeat: None,
            chaos: None,
        };
        Ok(SrunRank {
            worker,
            local_rank: num("SLURM_LOCALID")?,
            store: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<OsString> {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn task_counts() {
        assert_eq!(tasks_on_node("2(x3),1", 0), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 2), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(tasks_on_node("2(x3),1", 4), None);
        assert_eq!(tasks_on_node("4", 0), Some(4));
        assert_eq!(tasks_on_node("x", 0), None);
    }

    #[test]
    fn identity_from_slurm() {
        let r = SrunRank::identify(lookup(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_JOB_NODELIST", "localhost,n2"),
            ("MASTER_PORT", "29555"),
            ("FLOTILLA_SECRET", "s3cret-s3cret-s3cret"),
        ]))
        .unwrap();
        assert_eq!((r.worker.rank, r.worker.world, r.local_rank), (3, 4, 1));
        assert_eq!(r.worker.local_world, 2);
        assert_eq!(r.worker.rdv.addr.port(), 29555);
        assert!(r.worker.rdv.addr.ip().is_loopback());
        let e = SrunRank::identify(lookup(&[("SLURM_NTASKS", "4")]))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("SLURM_PROCID") && e.contains("srun"), "{e}");
        let e = SrunRank::identify(lookup(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_JOB_NODELIST", "localhost"),
        ]))
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("FLOTILLA_SECRET"), "{e}");
    }
}
