//! Small filesystem helpers shared by the writer and the reader: symlink-refusing opens, capped
//! reads (both through the shared `fsread` helper), durable atomic writes and the checksum
//! format.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use crate::error::{CkptError, Result, io_err};

/// Hex xxh3-128 of `bytes`, the checksum format used for pieces and the manifest.
pub fn checksum_hex(bytes: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(bytes))
}

impl From<fsread::ReadError> for CkptError {
    fn from(e: fsread::ReadError) -> Self {
        match e {
            fsread::ReadError::Io { op, path, source } => CkptError::Io { op, path, source },
            fsread::ReadError::Symlink { path } => CkptError::Symlink { path },
            fsread::ReadError::NotAFile { path, .. } => CkptError::NotAFile { path },
            fsread::ReadError::TooLarge { path, size, cap } => CkptError::SizeLimit {
                what: format!("file {}", path.display()),
                size,
                limit: cap,
            },
            fsread::ReadError::NotText { path, at } => CkptError::Io {
                op: "read",
                path,
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("not UTF-8 text (byte {at})"),
                ),
            },
        }
    }
}

/// Opens `path` read-only, refusing a symbolic link in the last component and anything that is
/// not a regular file, without blocking on a planted FIFO ([`fsread::open_regular`]).
pub(crate) fn open_read(path: &Path) -> Result<File> {
    Ok(fsread::open_regular(path, fsread::Links::Refuse)?.0)
}

/// Whether `path` exists and is a real directory (not a symlink to one).
pub(crate) fn is_real_dir(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
}

/// Length of an open file.
pub(crate) fn file_len(file: &File, path: &Path) -> Result<u64> {
    Ok(file.metadata().map_err(io_err("stat", path))?.len())
}

/// Reads a whole small file, refusing it if it is larger than `cap` bytes (checked before
/// allocating), a symbolic link or not a regular file ([`fsread::read_bounded`]).
pub(crate) fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>> {
    Ok(fsread::read_bounded(path, cap, fsread::Links::Refuse)?)
}

/// Fsyncs a directory so that entries created or renamed in it are durable.
pub(crate) fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("fsync dir", dir))
}

/// Writes `bytes` to `<path>.tmp`, fsyncs it, renames it over `path` and fsyncs the directory.
///
/// `partial_then_stop`, a test hook, writes only the first half to the tmp file and returns
/// `Ok(false)` without renaming, as a crash mid-write would leave things.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], partial_then_stop: bool) -> Result<bool> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    let mut f = File::create(&tmp).map_err(io_err("create", &tmp))?;
    let upto = if partial_then_stop {
        bytes.len() / 2
    } else {
        bytes.len()
    };
    f.write_all(&bytes[..upto]).map_err(io_err("write", &tmp))?;
    if partial_then_stop {
        return Ok(false);
    }
    f.sync_all().map_err(io_err("fsync", &tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io_err("rename", &tmp))?;
    fsync_dir(dir)?;
    Ok(true)
}

/// Asks the kernel to start writing `len` bytes at `offset` of `file` back to disk without
/// waiting (`sync_file_range(SYNC_FILE_RANGE_WRITE)`), so write-back overlaps the writes that
/// follow. A hint only: errors are ignored, and durability still comes from the final fsync.
pub fn start_writeback(file: &File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain syscall on a descriptor this `File` owns; no memory is passed.
        unsafe {
            libc::sync_file_range(
                file.as_raw_fd(),
                offset as libc::off64_t,
                len as libc::off64_t,
                libc::SYNC_FILE_RANGE_WRITE,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, offset, len);
}
