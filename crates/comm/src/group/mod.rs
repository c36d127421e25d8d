//! Process groups: the world and sub-groups created collectively from rank lists, each with its
//! own links, a group-wide sequence number per op, a flight recorder and calibrated α/β.
//!
//! ```no_run
//! use comm::group::{GroupConfig, ProcessGroup, Rendezvous};
//! use comm::store::{Secret, StoreServer};
//! use comm::ReduceOp;
//! # fn main() -> comm::Result<()> {
//! let secret = Secret::generate()?;
//! let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone())?;
//! let rdv = Rendezvous { addr: server.local_addr(), secret, generation: 0 };
//! // ...in each of `size` ranks:
//! let g = ProcessGroup::new(&rdv, "world", 0, 1, GroupConfig::default())?;
//! let mut grads = vec![1.0f32; 1024];
//! g.all_reduce(&mut grads, ReduceOp::Avg)?;
//! # Ok(()) }
//! ```

pub mod calibrate;
pub mod config;
mod connect;
mod core;
mod gate;
mod ops;
mod work;

pub use self::core::{OpOptions, ProcessGroup, Rendezvous, Scratch, group_id};
pub use config::{Choice, GroupConfig, TransportPolicy};
pub use connect::default_host_id;
pub use work::Work;
