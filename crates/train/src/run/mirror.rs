//! Checkpoints in object storage (`--ckpt-dir s3://bucket/prefix`, feature `s3`): saved
//! locally first, uploaded in the background, committed remotely last (004 28.6: a fast local
//! tier, then the durable one).
//!
//! The run's checkpoint directory is a local cache of the remote ([`cache_dir`]); every rank
//! saves there as usual. The lead rank:
//! - before anything is resumed, fetches the remote's newest committed step into the cache
//!   when it is newer than the cache's own (verified before it becomes visible; falling back
//!   past remote steps that fail), so a run on a fresh machine resumes from the remote;
//! - after every step, hands each newly committed local step to a `ckpt::remote::Stager`,
//!   which uploads it on a background thread, `COMMIT` last;
//! - at the end of the run (or of a pre-emption's save), waits until the last step is durably
//!   committed remotely.
//!
//! The cache must be reachable by every rank of the job (one host, or a shared file system):
//! the other ranks resume from what the lead fetched there.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Result, TrainError};

/// Longest wait at the end of a run for the last step's upload.
pub const UPLOAD_TIMEOUT: Duration = Duration::from_secs(600);

/// Whether `dir` names object storage (`s3://...` or `file://...`) rather than a directory.
pub fn is_remote(dir: &Path) -> bool {
    data::cache::is_remote(dir)
}

/// The local cache directory of the checkpoints at `url`: `FLOTILLA_CKPT_CACHE` (or the
/// system's temporary directory's `flotilla-ckpt-cache`), then the URL with `/` and `:`
/// replaced.
///
/// # Errors
/// [`TrainError::Refused`] in a build without the `s3` feature.
pub fn cache_dir(url: &str) -> Result<PathBuf> {
    if !cfg!(feature = "s3") {
        return Err(no_s3(url));
    }
    let base = std::env::var_os("FLOTILLA_CKPT_CACHE").map_or_else(
        || std::env::temp_dir().join("flotilla-ckpt-cache"),
        PathBuf::from,
    );
    let cache = data::CacheConfig {
        dir: Some(base),
        ..data::CacheConfig::default()
    };
    Ok(cache.dir_for(url))
}

fn no_s3(url: &str) -> TrainError {
    TrainError::Refused(format!(
        "--ckpt-dir {url} needs flotilla built with `--features s3` (object storage)"
    ))
}

/// The lead rank's side of a remote checkpoint directory.
#[cfg_attr(not(feature = "s3"), allow(dead_code))]
pub struct Mirror {
    #[cfg(feature = "s3")]
    stager: ckpt::remote::Stager,
    url: String,
    dir: PathBuf,
    /// The newest step handed to the stager (or already remote).
    staged: Option<u64>,
    /// The newest step this run handed to the stager: what [`Mirror::finish`] waits for.
    pending: Option<u64>,
}

#[cfg(feature = "s3")]
fn remote_err(url: &str) -> impl FnOnce(ckpt::remote::RemoteError) -> TrainError {
    let url = url.to_string();
    move |e| TrainError::Refused(format!("checkpoints at {url}: {e}"))
}

impl Mirror {
    /// Opens the remote `url` over the local cache `dir`: fetches the remote's newest step if
    /// it is newer than the cache's, and starts the uploader. Returns the mirror and a line
    /// saying what was fetched, if anything.
    ///
    /// # Errors
    /// The store's errors naming the URL; without the `s3` feature, [`cache_dir`]'s.
    #[cfg(feature = "s3")]
    pub fn open(url: &str, dir: &Path) -> Result<(Mirror, Option<String>)> {
        use ckpt::remote::{RemoteOptions, RemoteStore, Stager, StagerConfig};
        let open = || {
            RemoteStore::open(url, &RemoteOptions::default()).map_err(|e| remote_err(url)(e.into()))
        };
        let store = open()?;
        std::fs::create_dir_all(dir).map_err(|source| TrainError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let local = ckpt::list_committed(dir)?.last().copied();
        let remote = ckpt::remote::list_remote_committed(&store)
            .map_err(remote_err(url))?
            .last()
            .copied();
        let (mut line, mut fetched_step) = (None, None);
        if remote > local {
            let fetched = ckpt::remote::fetch_latest(&store, dir).map_err(remote_err(url))?;
            let step = fetched.checkpoint.step();
            fetched_step = Some(step);
            let skipped: Vec<String> = fetched
                .rejected
                .iter()
                .map(|r| format!("step {} ({})", r.step, r.error))
                .collect();
            line = Some(format!(
                "# checkpoint: fetched step {step} from {url} into {}{}",
                dir.display(),
                if skipped.is_empty() {
                    String::new()
                } else {
                    format!("; set aside {}", skipped.join(", "))
                }
            ));
        }
        let stager =
            Stager::start(open()?, dir, StagerConfig::default()).map_err(remote_err(url))?;
        let durable = stager
            .statuses()
            .iter()
            .filter(|s| matches!(s.state, ckpt::remote::StageState::Durable { .. }))
            .map(|s| s.step)
            .max();
        // Already remote: what is durable and what was just fetched. Of the steps an earlier
        // run committed locally but never uploaded, only the newest is staged.
        let never_uploaded = local.filter(|&l| Some(l) > durable);
        let staged = durable
            .max(fetched_step)
            .max(never_uploaded.and_then(|l| l.checked_sub(1)));
        let mirror = Mirror {
            stager,
            url: url.to_string(),
            dir: dir.to_path_buf(),
            staged,
            pending: None,
        };
        Ok((mirror, line))
    }

    /// Without the `s3` feature a remote is refused ([`cache_dir`] says why).
    #[cfg(not(feature = "s3"))]
    pub fn open(url: &str, _dir: &Path) -> Result<(Mirror, Option<String>)> {
        Err(no_s3(url))
    }

    /// Hands every step committed locally since the last call to the uploader. Called after
    /// every training step: one directory listing, and the commit markers read only when a
    /// newer step directory is there.
    ///
    /// # Errors
    /// The stager's (its queue stayed full, or it stopped).
    pub fn stage_new(&mut self) -> Result<()> {
        let io = |source| TrainError::Io {
            path: self.dir.clone(),
            source,
        };
        let newer = std::fs::read_dir(&self.dir)
            .map_err(io)?
            .filter_map(|e| {
                e.ok()?
                    .file_name()
                    .to_str()
                    .and_then(ckpt::names::parse_step_name)
            })
            .any(|step| Some(step) > self.staged);
        if !newer {
            return Ok(());
        }
        #[cfg(feature = "s3")]
        for step in ckpt::list_committed(&self.dir)? {
            if Some(step) > self.staged {
                self.stager.stage(step).map_err(remote_err(&self.url))?;
                (self.staged, self.pending) = (Some(step), Some(step));
            }
        }
        Ok(())
    }

    /// Stages what is left and waits until the newest step this run staged is durably
    /// committed remotely; the line to report (none when this run staged nothing).
    ///
    /// # Errors
    /// The upload's failure, or [`UPLOAD_TIMEOUT`] passing first.
    pub fn finish(mut self) -> Result<Option<String>> {
        self.stage_new()?;
        let Some(step) = self.pending else {
            return Ok(None);
        };
        #[cfg(feature = "s3")]
        {
            let began = std::time::Instant::now();
            self.stager
                .wait(step, UPLOAD_TIMEOUT)
                .map_err(remote_err(&self.url))?;
            let waited = began.elapsed();
            self.stager
                .shutdown(Duration::from_secs(10))
                .map_err(remote_err(&self.url))?;
            Ok(Some(format!(
                "# checkpoint: step {step} durably committed to {} (waited {:.1} ms for the upload)",
                self.url,
                waited.as_secs_f64() * 1e3
            )))
        }
        #[cfg(not(feature = "s3"))]
        Ok(Some(format!("# checkpoint: step {step} not uploaded")))
    }
}
