//! Opening the files the data pipeline reads whole (dataset manifests, text inputs, a
//! `tokenizer.json`) so that no path can hang or exhaust it.
//!
//! [`open_regular`] opens with `O_NONBLOCK`, so a FIFO planted where a file is expected does
//! not block the open waiting for a writer, and then checks with `fstat` on the opened
//! descriptor (no race with a rename) that it is a regular file: a FIFO, a device such as
//! `/dev/zero` (symbolic links are followed, so a link to one is caught too), a directory or a
//! socket is refused naming the path and what it is. [`read_bounded`] also refuses a file over
//! a stated cap before reading and reads at most cap + 1 bytes, so a file that grows while
//! being read cannot make it allocate more.
//!
//! The checkpoint crate has its own equivalent (`ckpt`'s `fsio::read_capped`, which also
//! refuses symbolic links); the two crates share no dependency to hold one copy.

use std::fs::{File, FileType, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use crate::error::{DataError, Result};

/// What a non-regular file is, for error messages.
fn kind(t: FileType) -> &'static str {
    if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Opens `path` read-only without blocking (`O_NONBLOCK`), refusing anything but a regular
/// file; returns the file and its length.
///
/// # Errors
/// [`DataError::Io`] if it cannot be opened or `fstat`ed; [`DataError::NotAFile`] naming the
/// path and what it is (FIFO, device, directory, socket).
pub fn open_regular(path: &Path) -> Result<(File, u64)> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(DataError::NotAFile {
            path: path.to_path_buf(),
            kind: kind(meta.file_type()),
        });
    }
    Ok((file, meta.len()))
}

/// Reads `path` whole if it is a regular file ([`open_regular`]) of at most `cap` bytes: the
/// size is checked before reading, and at most `cap + 1` bytes are read, so a file that grows
/// meanwhile is refused too.
///
/// # Errors
/// As [`open_regular`]; [`DataError::FileTooLarge`] naming the path and the cap.
pub fn read_bounded(path: &Path, cap: u64) -> Result<Vec<u8>> {
    let (file, size) = open_regular(path)?;
    let too_large = |size| DataError::FileTooLarge {
        path: path.to_path_buf(),
        size,
        cap,
    };
    if size > cap {
        return Err(too_large(size));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    file.take(cap.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    let read = bytes.len() as u64;
    if read > cap {
        return Err(too_large(read));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error of reading `path` with a 1 KiB cap, which must come back within 10 s.
    fn refused(path: &Path) -> DataError {
        let (tx, rx) = std::sync::mpsc::channel();
        let owned = path.to_path_buf();
        std::thread::spawn(move || tx.send(read_bounded(&owned, 1024)));
        match rx.recv_timeout(std::time::Duration::from_secs(10)) {
            Ok(Err(e)) => e,
            Ok(Ok(bytes)) => panic!("{} read: {} bytes", path.display(), bytes.len()),
            Err(_) => panic!("reading {} hung", path.display()),
        }
    }

    fn assert_not_a_file(path: &Path, what: &str) {
        let err = refused(path);
        assert!(
            matches!(&err, DataError::NotAFile { kind, .. } if kind.contains(what)),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains(&path.display().to_string()) && msg.contains(what),
            "{msg}"
        );
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("manifest.json");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_not_a_file(&fifo, "FIFO");
    }

    #[test]
    fn a_link_to_dev_zero_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("manifest.json");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        assert_not_a_file(&link, "character device");
    }

    #[test]
    fn a_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert_not_a_file(dir.path(), "directory");
    }

    #[test]
    fn an_oversized_file_is_refused_before_reading() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.json");
        // Sparse: 1 TiB claimed, nothing allocated; reading it would take forever.
        File::create(&path).unwrap().set_len(1 << 40).unwrap();
        let err = refused(&path);
        assert!(
            matches!(err, DataError::FileTooLarge { size, cap: 1024, .. } if size == 1 << 40),
            "{err}"
        );
        assert!(err.to_string().contains("big.json") && err.to_string().contains("1024"));
    }

    #[test]
    fn a_file_at_the_cap_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ok.json");
        std::fs::write(&path, vec![b'x'; 1024]).unwrap();
        assert_eq!(read_bounded(&path, 1024).unwrap().len(), 1024);
        assert!(matches!(
            read_bounded(&path, 1023),
            Err(DataError::FileTooLarge { size: 1024, .. })
        ));
    }
}
