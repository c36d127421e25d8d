//! Starting local worker processes for a job: the parent hosts the rendezvous store and spawns
//! `nproc` copies of this binary with their rank in the environment, then watches them; if one
//! fails, the others are stopped (nothing is left hanging).

use anyhow::{Context, Result, bail};
use comm::group::Rendezvous;
use comm::store::{Secret, StoreServer};
use std::net::SocketAddr;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Environment variables that carry a worker's identity.
pub const ENV_RANK: &str = "FLOTILLA_RANK";
pub const ENV_WORLD: &str = "FLOTILLA_WORLD_SIZE";
pub const ENV_RDZV: &str = "FLOTILLA_RDZV";
pub const ENV_GENERATION: &str = "FLOTILLA_GENERATION";
pub const ENV_SECRET: &str = "FLOTILLA_SECRET";

/// A worker's identity, read from the environment.
pub struct Worker {
    pub rank: usize,
    pub world: usize,
    pub rdv: Rendezvous,
}

fn var<T: std::str::FromStr>(name: &str) -> Result<T> {
    let v = std::env::var(name).with_context(|| format!("{name} is not set"))?;
    v.parse()
        .map_err(|_| anyhow::anyhow!("{name}='{v}' is not valid"))
}

impl Worker {
    /// The identity of this process if it was started as a worker.
    pub fn from_env() -> Result<Option<Worker>> {
        if std::env::var_os(ENV_RANK).is_none() {
            return Ok(None);
        }
        let secret = Secret::from_env_required()?;
        let w = Worker {
            rank: var(ENV_RANK)?,
            world: var(ENV_WORLD)?,
            rdv: Rendezvous {
                addr: var(ENV_RDZV)?,
                secret,
                generation: var(ENV_GENERATION).unwrap_or(0),
            },
        };
        if w.rank >= w.world {
            bail!("{ENV_RANK}={} is not below {ENV_WORLD}={}", w.rank, w.world);
        }
        Ok(Some(w))
    }
}

/// Where this node's workers sit in the job.
pub struct NodeSpec {
    pub nproc: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    /// Store address: node 0 binds it (port 0 picks one; single-node only).
    pub rdzv: SocketAddr,
    /// How long the job may run before it is stopped.
    pub job_timeout: Duration,
}

/// Runs this binary's `args` as `nproc` workers of this node and waits for them.
pub fn run_node(spec: &NodeSpec, args: &[String]) -> Result<()> {
    if spec.nproc == 0 || spec.nnodes == 0 || spec.node_rank >= spec.nnodes {
        bail!(
            "need nproc >= 1 and node_rank < nnodes (got nproc {}, nnodes {}, node_rank {})",
            spec.nproc,
            spec.nnodes,
            spec.node_rank
        );
    }
    if spec.nnodes > 1 && spec.rdzv.port() == 0 {
        bail!(
            "a job across {} nodes needs --rdzv HOST:PORT with a fixed port that every node can reach (got {})",
            spec.nnodes,
            spec.rdzv
        );
    }
    let secret = match Secret::from_env()? {
        Some(s) => s,
        None if spec.nnodes == 1 => Secret::generate()?,
        None => bail!(
            "a job across {} nodes needs a shared secret: set {ENV_SECRET} (or FLOTILLA_SECRET_FILE) on every node",
            spec.nnodes
        ),
    };
    let server = if spec.node_rank == 0 {
        Some(
            StoreServer::bind(spec.rdzv, secret.clone())
                .with_context(|| format!("start the rendezvous store on {}", spec.rdzv))?,
        )
    } else {
        None
    };
    let addr = server.as_ref().map_or(spec.rdzv, |s| s.local_addr());
    let exe = std::env::current_exe().context("locate the flotilla binary")?;
    let world = spec.nproc * spec.nnodes;
    let mut children: Vec<(usize, Child)> = Vec::new();
    for local in 0..spec.nproc {
        let rank = spec.node_rank * spec.nproc + local;
        let child = Command::new(&exe)
            .args(args)
            .env(ENV_RANK, rank.to_string())
            .env(ENV_WORLD, world.to_string())
            .env(ENV_RDZV, addr.to_string())
            .env(ENV_GENERATION, "0")
            .env(ENV_SECRET, secret.to_env_value()?)
            .spawn()
            .with_context(|| format!("spawn worker rank {rank}"))?;
        children.push((rank, child));
    }
    watch(children, spec.job_timeout)
}

/// Waits for every child; on the first failure (or the job timeout) kills the rest.
fn watch(mut children: Vec<(usize, Child)>, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut failed: Option<String> = None;
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait()? {
                Some(st) => {
                    let (rank, _) = children.remove(i);
                    if !st.success() && failed.is_none() {
                        failed = Some(format!("worker rank {rank} exited with {st}"));
                    }
                }
                None => i += 1,
            }
        }
        if failed.is_some() || Instant::now() >= deadline {
            for (_, c) in children.iter_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            return Err(anyhow::anyhow!(failed.unwrap_or_else(|| format!(
                "job did not finish within {timeout:?}; workers stopped"
            ))));
        }
        // Children exit rarely; a coarse sleep costs nothing on the measured path.
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}
