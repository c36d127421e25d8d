//! Worker processes of one generation on this host: spawn, poll, stop.

use crate::error::{LaunchError, Result};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
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
    /// A pidfd of the child (Linux 5.3+), readable once it exits; None where the kernel has none.
    pidfd: Option<OwnedFd>,
    /// Its exit status, once reaped.
    pub status: Option<ExitStatus>,
}

impl LocalWorker {
    /// Starts `cmd` with `env` for `rank`. The worker gets SIGKILL if the agent dies, so no
    /// worker outlives its agent. With `logs`, its stdout and stderr are also written to
    /// `stdout.log` and `stderr.log` there (created, truncated), line by line as they reach the
    /// agent's own.
    pub fn spawn(
        cmd: &WorkerCommand,
        rank: usize,
        env: &[(String, String)],
        logs: Option<&Path>,
    ) -> Result<Self> {
        let mut c = Command::new(&cmd.program);
        c.args(&cmd.args);
        for (k, v) in cmd.env.iter().chain(env) {
            c.env(k, v);
        }
        let files = match logs {
            Some(dir) => {
                let io = |what: &str, e| LaunchError::io(format!("{what} {}", dir.display()), e);
                std::fs::create_dir_all(dir).map_err(|e| io("create the log directory", e))?;
                let open = |name: &str| {
                    std::fs::File::create(dir.join(name)).map_err(|e| io("create a log in", e))
                };
                c.stdout(Stdio::piped()).stderr(Stdio::piped());
                Some((open("stdout.log")?, open("stderr.log")?))
            }
            None => None,
        };
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            c.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = c
            .spawn()
            .map_err(|source| LaunchError::Spawn { rank, source })?;
        if let Some((out, err)) = files {
            if let Some(pipe) = child.stdout.take() {
                tee(pipe, out, false);
            }
            if let Some(pipe) = child.stderr.take() {
                tee(pipe, err, true);
            }
        }
        // SAFETY: pidfd_open(2) on our own unreaped child (its pid cannot be reused meanwhile);
        // a non-negative return is a new descriptor that nothing else owns.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, child.id() as libc::pid_t, 0) };
        let pidfd = (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) });
        Ok(LocalWorker {
            rank,
            child,
            pidfd,
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

/// Copies a worker's output stream, line by line, to its log file and to the agent's stdout
/// (or stderr). The thread ends when the worker's end of the pipe closes (its exit); a write
/// that fails stops that copy only, never the worker (the pipe is drained on).
fn tee(from: impl Read + Send + 'static, mut file: std::fs::File, to_stderr: bool) {
    std::thread::spawn(move || {
        let mut from = BufReader::new(from);
        let mut line = Vec::new();
        let (mut to_file, mut to_console) = (true, true);
        while from.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
            to_file = to_file && file.write_all(&line).is_ok();
            to_console = to_console
                && if to_stderr {
                    std::io::stderr().lock().write_all(&line).is_ok()
                } else {
                    std::io::stdout().lock().write_all(&line).is_ok()
                };
            line.clear();
        }
    });
}

/// Blocks until one of the `workers` still running exits, or `timeout` passes, whichever is
/// first: each worker's pidfd becomes readable when it exits, so an agent hears of an exit at
/// once rather than at its next poll (the local agent of `flotilla bench comm` ended jobs up to
/// its 100 ms poll late). Sleeps `timeout` where no running worker has a pidfd.
pub fn wait_for_exit(workers: &[LocalWorker], timeout: Duration) {
    let mut fds: Vec<libc::pollfd> = workers
        .iter()
        .filter(|w| w.running())
        .filter_map(|w| w.pidfd.as_ref())
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    if fds.is_empty() {
        std::thread::sleep(timeout);
        return;
    }
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
    // SAFETY: poll(2) over descriptors we own, with the length of the vector it reads. An
    // interrupted or failed poll only returns early; the caller checks its workers either way.
    unsafe {
        libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms);
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
        wait_for_exit(workers, Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> WorkerCommand {
        WorkerCommand {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            env: Vec::new(),
        }
    }

    /// An exit wakes the waiter: a worker that exits at once ends a 60 s wait long before it
    /// runs out (the bound is the wake-up's existence, not its speed).
    #[test]
    fn an_exit_ends_the_wait_early() {
        let mut w = LocalWorker::spawn(&sh("exit 3"), 0, &[], None).unwrap();
        assert!(w.pidfd.is_some(), "this kernel has pidfd_open");
        let t0 = Instant::now();
        wait_for_exit(std::slice::from_ref(&w), Duration::from_secs(60));
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
        assert_eq!(w.poll().unwrap().and_then(|s| s.code()), Some(3));
    }

    /// A wait on workers that keep running lasts its timeout, and one on no running worker
    /// sleeps it.
    #[test]
    fn a_wait_without_exits_lasts_its_timeout() {
        let mut w = LocalWorker::spawn(&sh("sleep 30"), 1, &[], None).unwrap();
        let t0 = Instant::now();
        wait_for_exit(std::slice::from_ref(&w), Duration::from_millis(50));
        assert!(t0.elapsed() >= Duration::from_millis(50));
        assert!(w.poll().unwrap().is_none());
        stop_all(std::slice::from_mut(&mut w), Duration::from_secs(5)).unwrap();
        assert!(!w.running());
        let t1 = Instant::now();
        wait_for_exit(std::slice::from_ref(&w), Duration::from_millis(50));
        assert!(t1.elapsed() >= Duration::from_millis(50));
    }
}
