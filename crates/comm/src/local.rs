//! Running a group of ranks as threads of one process (tests, examples, single-process benches).

use crate::error::{CommError, Result};
use crate::group::{GroupConfig, ProcessGroup, Rendezvous};
use crate::store::{Secret, StoreServer};
use std::sync::Arc;

/// A rendezvous store served by this process, and the handle ranks use to reach it.
pub struct LocalRendezvous {
    /// Keeps the store alive.
    pub server: StoreServer,
    /// What ranks pass to [`ProcessGroup::new`].
    pub rdv: Rendezvous,
}

impl LocalRendezvous {
    /// Starts a store on 127.0.0.1 with a fresh secret, at generation 0.
    pub fn start() -> Result<LocalRendezvous> {
        let secret = Secret::generate()?;
        let server = StoreServer::bind(
            "127.0.0.1:0".parse().expect("valid address"),
            secret.clone(),
        )?;
        let rdv = Rendezvous {
            addr: server.local_addr(),
            secret,
            generation: 0,
        };
        Ok(LocalRendezvous { server, rdv })
    }
}

/// Runs `f` on `size` ranks (threads) of a fresh group called `world`, and returns each rank's
/// result in rank order. Group creation failures are returned as errors of that rank.
pub fn run_threads<R: Send + 'static>(
    size: usize,
    cfg: GroupConfig,
    f: impl Fn(ProcessGroup) -> Result<R> + Send + Sync + 'static,
) -> Result<Vec<Result<R>>> {
    let local = LocalRendezvous::start()?;
    let f = Arc::new(f);
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            let (rdv, cfg, f) = (local.rdv.clone(), cfg.clone(), f.clone());
            std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || ProcessGroup::new(&rdv, "world", rank, size, cfg).and_then(|g| f(g)))
                .map_err(|e| CommError::io("spawn rank thread", e))
        })
        .collect::<Result<_>>()?;
    Ok(handles
        .into_iter()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(CommError::InvalidArgument("rank thread panicked".into())))
        })
        .collect())
}
