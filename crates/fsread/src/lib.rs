//! # flotilla-fsread: opening and reading untrusted files so that no path can hang or exhaust
//! the reader
//!
//! Every file Flotilla reads whole (dataset and checkpoint manifests, commit markers, saved
//! models and their sidecars, job secrets, configuration files) goes through here, one helper
//! for every crate, each mapping [`ReadError`] into its own error enum.
//!
//! [`open_regular`] opens with `O_NONBLOCK`, so a FIFO planted where a file is expected does not
//! block the open waiting for a writer, and then checks with `fstat` on the opened descriptor
//! (no race with a rename) that it is a regular file: a FIFO, a device such as `/dev/zero`, a
//! directory or a socket is refused naming the path and what it is. With [`Links::Follow`] a
//! symbolic link to one of those is caught by the same check; [`Links::Refuse`] refuses a
//! symbolic link in the last component outright (`O_NOFOLLOW`: checkpoint files, which must
//! stay inside their directory). [`read_bounded`] also refuses a file over a stated cap before
//! reading and reads at most cap + 1 bytes, so a file that grows while being read cannot make
//! it allocate more.

use std::fs::{File, FileType, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Whether a symbolic link in the last component of a path is followed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Links {
    /// Follow it (the file it leads to must still be regular).
    Follow,
    /// Refuse it ([`ReadError::Symlink`]).
    Refuse,
}

/// Why a file was not read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Opening, `fstat` or reading failed.
    #[error("{op} {}: {source}", .path.display())]
    Io {
        /// What was being done (`open`, `stat`, `read`).
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The last component is a symbolic link, and [`Links::Refuse`] was asked.
    #[error("refusing symbolic link {}", .path.display())]
    Symlink {
        /// The link.
        path: PathBuf,
    },
    /// The path is a FIFO, a device, a directory or a socket.
    #[error("{}: is {kind}, not a regular file", .path.display())]
    NotAFile {
        /// The path (as given; a symbolic link is reported under its own name).
        path: PathBuf,
        /// What it is (`a FIFO`, `a character device`, `a directory`, ...).
        kind: &'static str,
    },
    /// The file is not UTF-8 text ([`read_text_bounded`]).
    #[error("{}: not UTF-8 text (byte {at})", .path.display())]
    NotText {
        /// The file.
        path: PathBuf,
        /// Offset of the first byte that is not valid UTF-8.
        at: usize,
    },
    /// The file is larger than the cap.
    #[error("{}: {size} bytes exceeds the cap of {cap} bytes per file", .path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size in bytes (at least `cap + 1` if it grew while being read).
        size: u64,
        /// The cap in bytes.
        cap: u64,
    },
}

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
/// file (and a symbolic link, with [`Links::Refuse`]); returns the file and its length.
///
/// # Errors
/// [`ReadError::Io`] if it cannot be opened or `fstat`ed; [`ReadError::Symlink`];
/// [`ReadError::NotAFile`] naming the path and what it is.
pub fn open_regular(path: &Path, links: Links) -> Result<(File, u64), ReadError> {
    let io = |op| {
        move |source| ReadError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    };
    let flags = match links {
        Links::Follow => libc::O_NONBLOCK,
        Links::Refuse => libc::O_NONBLOCK | libc::O_NOFOLLOW,
    };
    let file = match OpenOptions::new().read(true).custom_flags(flags).open(path) {
        Ok(f) => f,
        Err(e) if links == Links::Refuse && e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(ReadError::Symlink {
                path: path.to_path_buf(),
            });
        }
        Err(e) => return Err(io("open")(e)),
    };
    let meta = file.metadata().map_err(io("stat"))?;
    if !meta.is_file() {
        return Err(ReadError::NotAFile {
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
/// As [`open_regular`]; [`ReadError::TooLarge`] naming the path and the cap.
pub fn read_bounded(path: &Path, cap: u64, links: Links) -> Result<Vec<u8>, ReadError> {
    let (file, size) = open_regular(path, links)?;
    let too_large = |size| ReadError::TooLarge {
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
        .map_err(|source| ReadError::Io {
            op: "read",
            path: path.to_path_buf(),
            source,
        })?;
    let read = bytes.len() as u64;
    if read > cap {
        return Err(too_large(read));
    }
    Ok(bytes)
}

/// [`read_bounded`] of a text file: its bytes must be UTF-8.
///
/// # Errors
/// As [`read_bounded`]; [`ReadError::NotText`] naming the path and the first bad byte.
pub fn read_text_bounded(path: &Path, cap: u64, links: Links) -> Result<String, ReadError> {
    String::from_utf8(read_bounded(path, cap, links)?).map_err(|e| ReadError::NotText {
        path: path.to_path_buf(),
        at: e.utf8_error().valid_up_to(),
    })
}

#[cfg(test)]
mod tests;
