//! Staged mode: a background thread copies locally committed steps to the remote store.
//!
//! The training loop commits each step to a fast local root as usual, then calls
//! [`Stager::stage`] and carries on. One worker thread uploads queued steps in order with
//! [`upload_step`](super::upload_step). Each step has a [`StageStatus`] recording *locally
//! committed* (the local `COMMIT`'s modification time) and *durably committed* (the time the
//! remote `COMMIT` put succeeded, or the error) separately. The durable commit is also persisted
//! in `<local root>/step-<N>/REMOTE` ([`RemoteRecord`], written atomically: tmp file, fsync,
//! rename, dir fsync) only *after* the remote `COMMIT` put succeeded, so a `REMOTE` file always
//! means the remote holds the step; a new [`Stager`] reads these records back.
//!
//! Queue policy: at most [`StagerConfig::queue_capacity`] steps wait behind the one in flight.
//! A request finding the queue full waits up to [`StagerConfig::enqueue_timeout`] for room,
//! then is refused with [`RemoteError::QueueFull`]; nothing already queued is dropped, and the
//! refused step stays committed locally, so the caller may stage it (or a newer step) later.
//! Staging a step that is already queued, in flight or durable is a no-op; staging a step whose
//! upload failed queues it again. Every blocking call takes a timeout and waits on a condition
//! variable.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::{
    RemoteError, RemoteStore, Result, UploadFailPoint, upload_step, upload_step_with_fail_point,
};
use crate::fsio::{read_capped, write_atomic};
use crate::manifest::{COMMIT_FILE, CommitMarker, MAX_MARKER_BYTES};
use crate::reader::{Checkpoint, Verify, list_committed, step_dir_name};

pub use crate::manifest::REMOTE_RECORD_FILE;
/// Value of [`RemoteRecord::format`].
const RECORD_FORMAT: &str = "flotilla-ckpt-remote";
/// How long the idle worker sleeps between checks for shutdown (it is woken on every request).
const IDLE_WAIT: Duration = Duration::from_secs(1);
/// How long dropping a [`Stager`] waits for an upload in flight before leaving it to finish.
const DROP_WAIT: Duration = Duration::from_secs(10);

/// Content of `<local root>/step-<N>/REMOTE`: proof that the remote durably holds the step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRecord {
    /// Always `flotilla-ckpt-remote`.
    pub format: String,
    /// The step.
    pub step: u64,
    /// URL of the remote that holds it.
    pub remote: String,
    /// Hex xxh3-128 of the manifest, as in the commit marker: ties the record to one version.
    pub manifest_xxh3_128: String,
    /// When the step was committed locally (Unix milliseconds).
    pub locally_committed_unix_ms: u64,
    /// When the remote `COMMIT` put succeeded (Unix milliseconds).
    pub durably_committed_unix_ms: u64,
}

/// Reads `<local_root>/step-<step>/REMOTE`, or `None` if there is none.
pub fn read_record(local_root: &Path, step: u64) -> Result<Option<RemoteRecord>> {
    let path = local_root
        .join(step_dir_name(step))
        .join(REMOTE_RECORD_FILE);
    if std::fs::symlink_metadata(&path).is_err() {
        return Ok(None);
    }
    let bytes = read_capped(&path, MAX_MARKER_BYTES)?;
    let bad = |reason: String| RemoteError::Corrupt {
        step,
        key: path.display().to_string(),
        reason,
    };
    let record: RemoteRecord =
        serde_json::from_slice(&bytes).map_err(|e| bad(format!("unparsable: {e}")))?;
    if record.format != RECORD_FORMAT || record.step != step {
        return Err(bad(format!(
            "format {:?}, step {}",
            record.format, record.step
        )));
    }
    Ok(Some(record))
}

/// Where a staged step is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StageState {
    /// Waiting behind other uploads.
    Queued,
    /// Being uploaded.
    Uploading,
    /// The remote `COMMIT` put succeeded at this time and `REMOTE` was written.
    Durable {
        /// When the remote commit succeeded.
        at: SystemTime,
    },
    /// The upload (or writing `REMOTE`) failed; the step is still committed locally.
    Failed {
        /// When it failed.
        at: SystemTime,
        /// The error, formatted.
        error: String,
    },
}

/// The status of one staged step: locally and durably committed, recorded separately.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageStatus {
    /// The step.
    pub step: u64,
    /// When it was committed locally (modification time of its local `COMMIT`).
    pub locally_committed: SystemTime,
    /// Its remote state.
    pub state: StageState,
}

/// Settings of a [`Stager`].
#[derive(Debug, Clone)]
pub struct StagerConfig {
    /// Steps that may wait behind the one in flight (at least 1).
    pub queue_capacity: usize,
    /// How long [`Stager::stage`] waits for room in a full queue before refusing.
    pub enqueue_timeout: Duration,
    /// Tests only: every upload stops abruptly at this point, as a crash would.
    pub fail_point: Option<UploadFailPoint>,
}

impl Default for StagerConfig {
    fn default() -> Self {
        StagerConfig {
            queue_capacity: 4,
            enqueue_timeout: Duration::from_secs(10),
            fail_point: None,
        }
    }
}

#[derive(Default)]
struct State {
    queue: VecDeque<u64>,
    status: BTreeMap<u64, StageStatus>,
    shutdown: bool,
    worker_exited: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits on the condition variable for at most `timeout`.
    fn wait<'a>(&self, guard: MutexGuard<'a, State>, timeout: Duration) -> MutexGuard<'a, State> {
        self.changed
            .wait_timeout(guard, timeout)
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }
}

/// Marks the worker as gone however its thread ends (even by a panic).
struct ExitGuard(Arc<Shared>);

impl Drop for ExitGuard {
    fn drop(&mut self) {
        self.0.lock().worker_exited = true;
        self.0.changed.notify_all();
    }
}

/// Uploads locally committed steps in the background (see the module doc).
pub struct Stager {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
    local_root: PathBuf,
    config: StagerConfig,
}

impl std::fmt::Debug for Stager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stager")
            .field("local_root", &self.local_root)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The local marker of `step` with its modification time.
fn local_marker(local_root: &Path, step: u64) -> Result<(CommitMarker, SystemTime)> {
    let path = local_root.join(step_dir_name(step)).join(COMMIT_FILE);
    let bytes = read_capped(&path, MAX_MARKER_BYTES)?;
    let marker: CommitMarker =
        serde_json::from_slice(&bytes).map_err(|e| RemoteError::Corrupt {
            step,
            key: path.display().to_string(),
            reason: format!("unparsable local marker: {e}"),
        })?;
    let mtime = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| SystemTime::now());
    Ok((marker, mtime))
}

/// Uploads `step` and, once its remote `COMMIT` is in place, writes its `REMOTE` record.
fn upload_and_record(
    store: &RemoteStore,
    local_root: &Path,
    step: u64,
    fail: Option<UploadFailPoint>,
) -> Result<SystemTime> {
    match fail {
        Some(point) => upload_step_with_fail_point(store, local_root, step, point)?,
        None => upload_step(store, local_root, step)?,
    };
    let durable = SystemTime::now();
    let (marker, local) = local_marker(local_root, step)?;
    let record = RemoteRecord {
        format: RECORD_FORMAT.into(),
        step,
        remote: store.url().to_string(),
        manifest_xxh3_128: marker.manifest_xxh3_128,
        locally_committed_unix_ms: unix_ms(local),
        durably_committed_unix_ms: unix_ms(durable),
    };
    let bytes = serde_json::to_vec_pretty(&record).map_err(|source| {
        crate::error::CkptError::Serialize {
            what: "remote record",
            source,
        }
    })?;
    let path = local_root
        .join(step_dir_name(step))
        .join(REMOTE_RECORD_FILE);
    write_atomic(&path, &bytes, false)?;
    Ok(durable)
}

fn worker(
    shared: Arc<Shared>,
    store: RemoteStore,
    local_root: PathBuf,
    fail: Option<UploadFailPoint>,
) {
    let _exit = ExitGuard(shared.clone());
    loop {
        let step = {
            let mut st = shared.lock();
            loop {
                if st.shutdown {
                    return;
                }
                if let Some(step) = st.queue.pop_front() {
                    if let Some(s) = st.status.get_mut(&step) {
                        s.state = StageState::Uploading;
                    }
                    shared.changed.notify_all();
                    break step;
                }
                st = shared.wait(st, IDLE_WAIT);
            }
        };
        let state = match upload_and_record(&store, &local_root, step, fail) {
            Ok(at) => StageState::Durable { at },
            Err(e) => StageState::Failed {
                at: SystemTime::now(),
                error: e.to_string(),
            },
        };
        if let Some(s) = shared.lock().status.get_mut(&step) {
            s.state = state;
        }
        shared.changed.notify_all();
    }
}

impl Stager {
    /// Starts the worker thread, which owns `store`. Steps of `local_root` that already have a
    /// `REMOTE` record matching their local marker start out as durable.
    pub fn start(store: RemoteStore, local_root: &Path, config: StagerConfig) -> Result<Self> {
        if config.queue_capacity == 0 {
            return Err(RemoteError::Config(
                "stager queue capacity must be at least 1".into(),
            ));
        }
        let mut state = State::default();
        for step in list_committed(local_root)? {
            let (Ok(Some(record)), Ok((marker, local))) = (
                read_record(local_root, step),
                local_marker(local_root, step),
            ) else {
                continue;
            };
            if record.manifest_xxh3_128 == marker.manifest_xxh3_128 {
                let at = UNIX_EPOCH + Duration::from_millis(record.durably_committed_unix_ms);
                let status = StageStatus {
                    step,
                    locally_committed: local,
                    state: StageState::Durable { at },
                };
                state.status.insert(step, status);
            }
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            changed: Condvar::new(),
        });
        let (thread_shared, root, fail) =
            (shared.clone(), local_root.to_path_buf(), config.fail_point);
        let worker = std::thread::Builder::new()
            .name("ckpt-stager".into())
            .spawn(move || worker(thread_shared, store, root, fail))
            .map_err(RemoteError::Runtime)?;
        Ok(Stager {
            shared,
            worker: Some(worker),
            local_root: local_root.to_path_buf(),
            config,
        })
    }

    /// Queues locally committed `step` for upload (see the module doc for the queue policy).
    pub fn stage(&self, step: u64) -> Result<()> {
        // Refuse anything that is not a verified local commit before queueing it.
        Checkpoint::open(&self.local_root, step, Verify::ManifestOnly)?;
        let (_, locally_committed) = local_marker(&self.local_root, step)?;
        let start = Instant::now();
        let deadline = start + self.config.enqueue_timeout;
        let mut st = self.shared.lock();
        loop {
            if st.shutdown || st.worker_exited {
                return Err(RemoteError::Stopped);
            }
            if let Some(s) = st.status.get(&step)
                && !matches!(s.state, StageState::Failed { .. })
            {
                return Ok(());
            }
            if st.queue.len() < self.config.queue_capacity {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RemoteError::QueueFull {
                    step,
                    capacity: self.config.queue_capacity,
                    waited_ms: start.elapsed().as_millis(),
                });
            }
            st = self.shared.wait(st, deadline - now);
        }
        st.queue.push_back(step);
        let status = StageStatus {
            step,
            locally_committed,
            state: StageState::Queued,
        };
        st.status.insert(step, status);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// The status of `step`, if it was ever staged (or found durable at start).
    pub fn status(&self, step: u64) -> Option<StageStatus> {
        self.shared.lock().status.get(&step).cloned()
    }

    /// The status of every known step, ascending.
    pub fn statuses(&self) -> Vec<StageStatus> {
        self.shared.lock().status.values().cloned().collect()
    }

    /// Blocks until `step` is durably committed (returning when) or its upload failed, for at
    /// most `timeout`.
    pub fn wait(&self, step: u64, timeout: Duration) -> Result<SystemTime> {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut st = self.shared.lock();
        loop {
            match st.status.get(&step).map(|s| &s.state) {
                None => return Err(RemoteError::UnknownStep { step }),
                Some(StageState::Durable { at }) => return Ok(*at),
                Some(StageState::Failed { error, .. }) => {
                    return Err(RemoteError::UploadFailed {
                        step,
                        reason: error.clone(),
                    });
                }
                Some(StageState::Queued | StageState::Uploading) => {}
            }
            if st.worker_exited {
                return Err(RemoteError::Stopped);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RemoteError::Timeout {
                    step,
                    waited_ms: start.elapsed().as_millis(),
                });
            }
            st = self.shared.wait(st, deadline - now);
        }
    }

    /// Stops the worker: queued steps are dropped (they stay committed locally), an upload in
    /// flight is waited for up to `timeout`. Returns `Ok` once the worker has exited, or
    /// [`RemoteError::Stopped`] if it was still busy at the deadline (it then finishes that
    /// upload on its own and exits).
    pub fn shutdown(mut self, timeout: Duration) -> Result<()> {
        if self.stop(timeout) {
            Ok(())
        } else {
            Err(RemoteError::Stopped)
        }
    }

    /// Signals the worker to stop and waits up to `timeout` for it; joins it if it exited.
    fn stop(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        st.shutdown = true;
        for step in std::mem::take(&mut st.queue) {
            st.status.remove(&step);
        }
        self.shared.changed.notify_all();
        while !st.worker_exited {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = self.shared.wait(st, deadline - now);
        }
        drop(st);
        if let Some(handle) = self.worker.take() {
            // The worker has left its loop; joining only collects the thread.
            let _ = handle.join();
        }
        true
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        if self.worker.is_some() {
            self.stop(DROP_WAIT);
        }
    }
}
