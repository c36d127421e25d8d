//! Plain-text files to one token stream.
//!
//! Files are read whole (each at most a stated cap), decoded as UTF-8 (invalid sequences become
//! U+FFFD), tokenized, and concatenated with the tokenizer's end-of-text id between files when it
//! has one, so a model trained on the stream sees document boundaries.

use std::path::Path;

use crate::error::{DataError, Result};
use crate::fsread::read_bounded;
use crate::tokenizer::Tokenizer;

/// Default per-file cap: 1 GiB.
pub const MAX_FILE_BYTES: u64 = 1 << 30;

/// Reads and tokenizes `paths` in order, each file at most [`MAX_FILE_BYTES`].
///
/// # Errors
/// See [`load_tokens_capped`].
pub fn load_tokens<P, T>(paths: &[P], tokenizer: &T) -> Result<Vec<u32>>
where
    P: AsRef<Path>,
    T: Tokenizer + ?Sized,
{
    load_tokens_capped(paths, tokenizer, MAX_FILE_BYTES)
}

/// Reads and tokenizes `paths` in order, refusing any file over `max_file_bytes`.
///
/// # Errors
/// - [`DataError::NoInputFiles`] if `paths` is empty;
/// - [`DataError::Io`] naming a file that cannot be opened or read;
/// - [`DataError::FileTooLarge`] naming a file over the cap (checked before reading, and again
///   while reading in case the file grows);
/// - [`DataError::EmptyInput`] if the files hold no tokens at all.
pub fn load_tokens_capped<P, T>(paths: &[P], tokenizer: &T, max_file_bytes: u64) -> Result<Vec<u32>>
where
    P: AsRef<Path>,
    T: Tokenizer + ?Sized,
{
    if paths.is_empty() {
        return Err(DataError::NoInputFiles);
    }
    let mut tokens = Vec::new();
    for (i, path) in paths.iter().enumerate() {
        let text = read_text(path.as_ref(), max_file_bytes)?;
        if i > 0 {
            tokens.extend(tokenizer.eot());
        }
        tokens.extend(tokenizer.encode(&text));
    }
    if tokens.is_empty() {
        let paths = paths.iter().map(|p| p.as_ref().to_path_buf()).collect();
        return Err(DataError::EmptyInput { paths });
    }
    Ok(tokens)
}

/// Reads one file as UTF-8 (invalid sequences become U+FFFD), refusing it over `cap` bytes or
/// if it is not a regular file ([`read_bounded`]).
///
/// # Errors
/// [`DataError::Io`], [`DataError::NotAFile`] or [`DataError::FileTooLarge`], naming `path`.
pub fn read_text(path: &Path, cap: u64) -> Result<String> {
    let bytes = read_bounded(path, cap)?;
    Ok(match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    })
}
