//! Opening the files the data pipeline reads whole (dataset manifests, text inputs, a
//! `tokenizer.json`) and maps (shards) so that no path can hang or exhaust it: the shared
//! helper of the `fsread` crate (its doc says how), following symbolic links, with its
//! errors as [`DataError`]s.

use std::fs::File;
use std::path::Path;

use crate::error::{DataError, Result};

impl From<fsread::ReadError> for DataError {
    fn from(e: fsread::ReadError) -> Self {
        match e {
            fsread::ReadError::Io { path, source, .. } => DataError::Io { path, source },
            fsread::ReadError::Symlink { path } => DataError::NotAFile {
                path,
                kind: "a symbolic link",
            },
            fsread::ReadError::NotAFile { path, kind } => DataError::NotAFile { path, kind },
            fsread::ReadError::TooLarge { path, size, cap } => {
                DataError::FileTooLarge { path, size, cap }
            }
            fsread::ReadError::NotText { path, at } => DataError::Io {
                path,
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("not UTF-8 text (byte {at})"),
                ),
            },
        }
    }
}

/// Opens `path` read-only without blocking, refusing anything but a regular file; returns the
/// file and its length ([`fsread::open_regular`]).
///
/// # Errors
/// [`DataError::Io`] if it cannot be opened or `fstat`ed; [`DataError::NotAFile`] naming the
/// path and what it is (FIFO, device, directory, socket).
pub fn open_regular(path: &Path) -> Result<(File, u64)> {
    Ok(fsread::open_regular(path, fsread::Links::Follow)?)
}

/// Reads `path` whole if it is a regular file of at most `cap` bytes
/// ([`fsread::read_bounded`]).
///
/// # Errors
/// As [`open_regular`]; [`DataError::FileTooLarge`] naming the path and the cap.
pub fn read_bounded(path: &Path, cap: u64) -> Result<Vec<u8>> {
    Ok(fsread::read_bounded(path, cap, fsread::Links::Follow)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_keep_their_data_variants() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            read_bounded(dir.path(), 10),
            Err(DataError::NotAFile {
                kind: "a directory",
                ..
            })
        ));
        let path = dir.path().join("f");
        std::fs::write(&path, b"12345").unwrap();
        assert!(matches!(
            read_bounded(&path, 4),
            Err(DataError::FileTooLarge {
                size: 5,
                cap: 4,
                ..
            })
        ));
        assert!(matches!(
            read_bounded(&dir.path().join("missing"), 4),
            Err(DataError::Io { .. })
        ));
    }
}
