//! Worker processes of one generation on this host: spawn, poll, stop.

use crate::error::{LaunchError, Result};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// What to run as a worker: a program, its arguments and extra environment.
#[derive(Debug, Clone)]
pub struct WorkerCommand {
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Environment added for every worker (identity variables are added per rank).
    pub env: Vec<(String, String)>,
}

/// One local worker.
pub struct LocalWorker {
    /// Global rank.
    pub rank: usize,
    child: Child,
    /// Its exit status, once reaped.
    pub status: Option<ExitStatus>,
}

impl LocalWorker {
    /// Starts `cmd` with `env` for `rank`. The worker gets SIGKILL if the agent dies, so no
    /// worker outlives its agent.
    pub fn spawn(cmd: &WorkerCommand, rank: usize, env: &[(String, String)]) -> Result<Self> {
        let mut c = Command::new(&cmd.program);
        c.args(&cmd.args);
        for (k, v) in cmd.env.iter().chain(env) {
            c.env(k, v);
        }
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            c.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = c
            .spawn()
            .map_err(|source| LaunchError::Spawn { rank, source })?;
        Ok(LocalWorker {
            rank,
            child,
            status: None,
        })
    }

    /// Reaps the worker if it has exited; its status (now or from before).
    pub fn poll(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self
                .child
                .try_wait()
                .map_err(|e| LaunchError::io(format!("wait for rank {}", self.rank), e))?;
        }
        Ok(self.status)
    }

    /// Still running (not yet reaped).
    pub fn running(&self) -> bool {
        self.status.is_none()
    }

    fn signal(&self, sig: i32) {
        if self.status.is_none() {
            // SAFETY: kill(2) on our own unreaped child's pid; no memory is involved.
            unsafe {
                libc::kill(self.child.id() as libc::pid_t, sig);
            }
        }
    }
}

/// Stops every worker still running: SIGTERM (and SIGCONT, for a stopped one), then SIGKILL
/// after `grace`. Returns once all are reaped; bounded, since SIGKILL cannot be caught.
pub fn stop_all(workers: &mut [LocalWorker], grace: Duration) -> Result<()> {
    for w in workers.iter() {
        w.signal(libc::SIGTERM);
        // A stopped worker acts on the pending SIGTERM once continued.
        w.signal(libc::SIGCONT);
    }
    let deadline = Instant::now() + grace;
    let mut killed = false;
    loop {
        let mut running = 0;
        for w in workers.iter_mut() {
            if w.poll()?.is_none() {
                running += 1;
            }
        }
        if running == 0 {
            return Ok(());
        }
        if !killed && Instant::now() >= deadline {
            for w in workers.iter() {
                w.signal(libc::SIGKILL);
            }
            killed = true;
        }
        if killed && Instant::now() >= deadline + Duration::from_secs(30) {
            let left: Vec<usize> = workers
                .iter()
                .filter(|w| w.running())
                .map(|w| w.rank)
                .collect();
            return Err(LaunchError::io(
                format!("ranks {left:?} survived SIGKILL for 30 s"),
                std::io::Error::from(std::io::ErrorKind::TimedOut),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
