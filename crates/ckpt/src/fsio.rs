//! Small filesystem helpers shared by the writer and the reader: symlink-refusing opens, capped
//! reads, durable atomic writes and the checksum format.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use crate::error::{CkptError, Result, io_err};

/// Hex xxh3-128 of `bytes`, the checksum format used for pieces and the manifest.
pub fn checksum_hex(bytes: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(bytes))
}

/// Opens `path` read-only, refusing a symbolic link in the last component and anything that is
/// not a regular file (`O_NONBLOCK` keeps a planted FIFO from blocking the open).
pub(crate) fn open_read(path: &Path) -> Result<File> {
    let mut opts = OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    }
    let file = match opts.open(path) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(CkptError::Symlink {
                path: path.to_path_buf(),
            });
        }
        Err(e) => return Err(io_err("open", path)(e)),
    };
    if !file.metadata().map_err(io_err("stat", path))?.is_file() {
        return Err(CkptError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    Ok(file)
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
/// allocating).
pub(crate) fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>> {
    let file = open_read(path)?;
    let len = file_len(&file, path)?;
    if len > cap {
        return Err(CkptError::SizeLimit {
            what: format!("file {}", path.display()),
            size: len,
            limit: cap,
        });
    }
    let mut buf = Vec::with_capacity(len as usize);
    file.take(cap)
        .read_to_end(&mut buf)
        .map_err(io_err("read", path))?;
    Ok(buf)
}

/// Reads `bytes` bytes at `offset` of an open file whose length was already checked to cover
/// the range.
pub(crate) fn read_range(file: &mut File, path: &Path, offset: u64, bytes: u64) -> Result<Vec<u8>> {
    file.seek(SeekFrom::Start(offset))
        .map_err(io_err("seek", path))?;
    let mut buf = vec![0u8; bytes as usize];
    file.read_exact(&mut buf).map_err(io_err("read", path))?;
    Ok(buf)
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
