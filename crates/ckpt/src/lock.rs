//! One job per checkpoint directory: [`DirLock`], an exclusive `flock(2)` on the directory's
//! `LOCK` file, held for the whole job (by the launcher, across worker restarts) and naming its
//! holder (host, process id, start time) in the file.
//!
//! Two jobs sharing a directory would interleave their steps, each committing over the other's
//! and resuming from a step the other saved. The second job is therefore refused, naming the
//! directory and the holder recorded in the file.
//!
//! **Stale locks.** Whether the holder is alive is decided by the kernel, not by guessing from
//! a process id: an `flock` belongs to the holder's open file, which the kernel closes when the
//! process ends in any way (SIGKILL and a crash included), so a `LOCK` file whose lock is free
//! names a holder that is gone, and the next job takes it over (and says so, naming the dead
//! holder). A process id recorded in a file could have been reused by an unrelated process; the
//! lock cannot outlive its holder. On NFS (v4) the server releases the lock of a client that
//! died when its lease expires (about 90 s), so a job on another host waits at most that long.
//!
//! A holder that exits cleanly removes the file (and the directory, if taking the lock created
//! it and nothing else was written there); a job that opened the file just before it went
//! sees that its name no longer leads to it and opens the new one, so two jobs never hold
//! two files of the same name.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::error::{CkptError, Result, io_err};

/// Name of the lock file inside a checkpoint directory.
pub const LOCK_FILE: &str = "LOCK";

/// Largest holder record read from a lock file.
const MAX_HOLDER_BYTES: u64 = 4096;

/// An exclusive lock on a checkpoint directory, released when dropped (or when the process
/// ends).
#[derive(Debug)]
pub struct DirLock {
    /// Holds the `flock` until dropped.
    _file: File,
    path: PathBuf,
    /// The directory, when taking the lock created it (removed again on release if empty).
    dir: Option<PathBuf>,
}

impl DirLock {
    /// Takes `dir`'s lock (creating `dir` if missing) for this process, recording this host,
    /// process id and the time. Returns the lock and, when it was taken over, the record of
    /// the previous holder, which had ended without releasing it (see the module doc).
    ///
    /// # Errors
    /// [`CkptError::Locked`] naming the directory and the live holder's record;
    /// [`CkptError::Io`] if the directory or the file cannot be created, or the lock file is a
    /// symbolic link or not a regular file ([`CkptError::NotAFile`]).
    pub fn acquire(dir: &Path) -> Result<(DirLock, Option<String>)> {
        let created = !dir.exists();
        std::fs::create_dir_all(dir).map_err(io_err("create dir", dir))?;
        let path = dir.join(LOCK_FILE);
        let mut file = loop {
            let file = open_lock_file(&path)?;
            // SAFETY: a plain syscall on a descriptor `file` owns; no memory is passed.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                    return Err(io_err("lock", &path)(e));
                }
                let mut file = file;
                return Err(CkptError::Locked {
                    dir: dir.to_path_buf(),
                    holder: read_holder(&mut file, &path)?
                        .unwrap_or_else(|| "a holder that has not recorded itself yet".into()),
                });
            }
            // A holder that released it meanwhile unlinked the file this one opened: the lock
            // is only ours if the name still leads to the file locked.
            if same_file(&file, &path) {
                break file;
            }
        };
        let previous = read_holder(&mut file, &path)?;
        file.set_len(0).map_err(io_err("truncate", &path))?;
        file.seek(SeekFrom::Start(0))
            .and_then(|_| file.write_all(holder_record().as_bytes()))
            .and_then(|()| file.sync_data())
            .map_err(io_err("write", &path))?;
        let lock = DirLock {
            _file: file,
            path,
            dir: created.then(|| dir.to_path_buf()),
        };
        Ok((lock, previous))
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Unlinked while still held, so a job that opened the old file finds it gone (see
        // `acquire`); the kernel releases the lock when the file closes. A directory that the
        // lock created and nothing else used goes too (a refused run leaves nothing behind).
        let _ = std::fs::remove_file(&self.path);
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Opens (creating) the lock file at `path`, refusing a symbolic link or a non-regular file.
fn open_lock_file(path: &Path) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => CkptError::Symlink {
                path: path.to_path_buf(),
            },
            _ => io_err("open", path)(e),
        })?;
    if !file.metadata().map_err(io_err("stat", path))?.is_file() {
        return Err(CkptError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    Ok(file)
}

/// Whether `path` names the open `file` (same device and inode).
fn same_file(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// The holder recorded in an open lock file, if any (empty: none).
fn read_holder(file: &mut File, path: &Path) -> Result<Option<String>> {
    let mut bytes = Vec::new();
    file.seek(SeekFrom::Start(0))
        .and_then(|_| {
            Read::by_ref(file)
                .take(MAX_HOLDER_BYTES)
                .read_to_end(&mut bytes)
        })
        .map_err(io_err("read", path))?;
    let text = String::from_utf8_lossy(&bytes);
    let text = text.trim();
    Ok((!text.is_empty()).then(|| text.chars().filter(|c| !c.is_control()).collect()))
}

/// This process as a lock holder: `pid P on host H since UNIX-SECONDS`.
fn holder_record() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!(
        "pid {} on host {} since {since} (unix time)",
        std::process::id(),
        host.trim()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lock_refuses_and_a_released_one_is_taken() {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("ck");
        let (held, previous) = DirLock::acquire(&ck).unwrap();
        assert!(previous.is_none());
        // Another open file description (as another process would have) is refused.
        let err = DirLock::acquire(&ck).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&ck.display().to_string())
                && msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        drop(held);
        assert!(
            !ck.exists(),
            "a clean release of a lock that made the directory removes it"
        );
        let (_again, previous) = DirLock::acquire(&ck).unwrap();
        assert!(previous.is_none(), "a clean release leaves no holder");
    }

    #[test]
    fn a_dead_holders_record_is_reported_when_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(LOCK_FILE), "pid 1 on host gone since 0").unwrap();
        let (_lock, previous) = DirLock::acquire(dir.path()).unwrap();
        assert_eq!(previous.as_deref(), Some("pid 1 on host gone since 0"));
    }

    #[test]
    fn a_symlinked_lock_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/dev/null", dir.path().join(LOCK_FILE)).unwrap();
        assert!(matches!(
            DirLock::acquire(dir.path()),
            Err(CkptError::Symlink { .. })
        ));
    }
}
