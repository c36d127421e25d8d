//! The per-host agent of a Flotilla job: it starts the node's workers, watches their exit
//! statuses and heartbeats, and when any worker of the job fails it stops the whole gang and
//! starts it again, one generation later, from the last committed checkpoint.
//!
//! Sources: file 001 sections 12.5-12.8 (scheduling, checkpoints and failure recovery: heartbeat
//! timeouts, watchdogs, restart from the most recent checkpoint, recovery drills) and file 004
//! section 28.8 with Algorithm 28.2 (gang admission: nothing starts until the whole gang is
//! admitted, with a deadline; completion messages from an older generation are not trusted).
//!
//! - [`agent`]: the restart loop of one node;
//! - [`agree`]: agreement at admission (run configurations compared, duplicate ranks refused);
//! - [`gang`]: coordination of the nodes' agents through the rendezvous store;
//! - [`elastic`]: `--nnodes MIN:MAX`, generation membership and node leases;
//! - [`failover`]: the store re-hosted on the next endpoint of `--rdzv H0:P0,H1:P1,...` when
//!   its host is lost, and nodes that come back admitted at the next generation;
//! - [`heartbeat`]: the worker's heartbeat thread and the beat format;
//! - [`watchdog`]: failure rules (exit, signal, heartbeat silence, stalled step);
//! - [`process`]: spawning and stopping worker processes (and their logs);
//! - [`srun`]: one task per rank under Slurm, without an agent;
//! - [`metrics`] and [`http`]: the job's live figures, served as a Prometheus endpoint;
//! - [`straggler`]: `--straggler warn|exclude`, what the job does with a slow rank;
//! - [`supervision`]: a worker's link to its agent (heartbeat, chaos, SIGTERM, stragglers);
//! - [`chaos`]: injected faults for recovery tests ([`partition`]: a node cut off the network;
//!   [`soak`]: many random faults over one run);
//! - [`ft`]: per-step fault tolerance's replica restarts (`--ft`);
//! - [`env`](mod@env): worker identity, Slurm and torchrun-style environments;
//! - [`exit`]: the exit-code table (success, failed, pre-empted, refused);
//! - [`term`]: SIGTERM as a pre-emption notice.
//!
//! Generations: the store's generation counter is the job's membership generation. Workers get
//! it in `FLOTILLA_GENERATION`; their process group and every key they write carry it, and the
//! store refuses requests stamped with an older one, so a straggler of a failed generation can
//! neither join nor disturb the next.

pub mod agent;
pub mod agree;
pub mod chaos;
mod chaos_plan;
pub mod elastic;
pub mod env;
pub mod error;
pub mod exit;
pub mod failover;
pub mod ft;
pub mod gang;
mod generation;
pub mod heartbeat;
pub mod http;
pub mod metrics;
pub mod observer;
pub mod partition;
pub mod process;
pub mod soak;
pub mod srun;
pub mod straggler;
pub mod supervision;
pub mod term;
pub mod watchdog;

pub use agent::{AgentConfig, JobReport, run};
pub use chaos::{Chaos, Fault};
pub use elastic::NodeRange;
pub use env::{NodeEnv, WorkerEnv};
pub use error::{LaunchError, Result};
pub use exit::{EXIT_PREEMPTED, EXIT_REFUSED, Exit, Preempted};
pub use heartbeat::Heartbeat;
pub use process::WorkerCommand;
pub use srun::SrunRank;
pub use supervision::Supervision;
pub use term::Termination;
pub use watchdog::WatchRules;
