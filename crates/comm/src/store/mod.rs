//! Rendezvous store, in the role of torch's `TCPStore`: a small authenticated key-value server
//! that ranks use to find each other, agree on values and wait for one another.
//!
//! - [`auth`]: the job [`Secret`] (from `FLOTILLA_SECRET` / `FLOTILLA_SECRET_FILE`) and the mutual
//!   HMAC-SHA256 challenge-response every connection starts with.
//! - [`proto`]: the length-prefixed binary frames, every length checked against a hard limit
//!   before anything is allocated.
//! - [`server`]: [`StoreServer`], one thread per connection over a mutex-guarded map, with a
//!   condition variable for blocking waits.
//! - [`client`]: [`StoreClient`], whose every call has a deadline.
//!
//! Fencing: the store carries a `generation`. Every data request is stamped with the client's
//! generation and is rejected, unapplied, unless it equals the store's: an older stamp yields
//! [`crate::CommError::StaleGeneration`], so a rank left over from a previous attempt of the job
//! cannot disturb the current one. Reading and bumping (compare-and-swap) the generation are
//! allowed whatever the stamp, for the launcher.
//!
//! ```no_run
//! use comm::store::{Secret, StoreClient, StoreServer};
//! use std::time::Duration;
//!
//! # fn main() -> comm::Result<()> {
//! let secret = Secret::generate()?;
//! let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone())?;
//! let client = StoreClient::connect(server.local_addr(), &secret, 0, Duration::from_secs(5))?;
//! client.set("rank0/addr", b"10.0.0.1:4000")?;
//! let addr = client.wait_one("rank0/addr", Duration::from_secs(30))?;
//! assert_eq!(client.add("arrived", 1)?, 1);
//! # let _ = addr;
//! # Ok(())
//! # }
//! ```

pub mod auth;
pub mod client;
pub mod proto;
pub mod server;

pub use auth::{Secret, hmac_sha256, verify_hmac_sha256};
pub use client::StoreClient;
pub use server::{ServerOptions, StoreServer};
