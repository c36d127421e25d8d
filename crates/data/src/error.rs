//! One structured error enum for the whole crate.
//!
//! Every variant names what was wrong: the argument field, the file path, the token id and its
//! position, or the buffer sizes that disagreed, so a failed data pipeline says *what* and *where*.

use std::path::PathBuf;

/// Errors of the data pipeline.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    // === Arguments ===
    /// A constructor or method argument is outside its valid range.
    #[error("invalid {field} = {value}: {requirement}")]
    InvalidArgument {
        /// Name of the argument (`vocab`, `branching`, `seq_len`, `batch`, ...).
        field: &'static str,
        /// The value that was given.
        value: u64,
        /// What the value must satisfy, with the values it was compared against.
        requirement: String,
    },

    // === Tokenizers ===
    /// A token id has no entry in the tokenizer's vocabulary.
    #[error("token id {id} is not in the {tokenizer} vocabulary (size {vocab})")]
    UnknownToken {
        /// The offending id.
        id: u32,
        /// Name of the tokenizer that rejected it.
        tokenizer: &'static str,
        /// Vocabulary size of that tokenizer.
        vocab: usize,
    },
    /// A tokenizer name did not parse.
    #[error("unknown tokenizer '{name}' (accepted: {accepted})")]
    UnknownTokenizer {
        /// The name that was given.
        name: String,
        /// Comma-separated list of accepted names.
        accepted: String,
    },
    /// Building a tokenizer's tables failed.
    #[error("could not build the {tokenizer} tokenizer: {reason}")]
    TokenizerInit {
        /// Name of the tokenizer.
        tokenizer: &'static str,
        /// Why construction failed.
        reason: String,
    },

    // === Token streams ===
    /// A token id is not below the vocabulary size.
    #[error("token id {id} at position {position} is out of range for vocabulary size {vocab}")]
    TokenOutOfRange {
        /// The offending id.
        id: u32,
        /// Its index in the token stream.
        position: usize,
        /// The vocabulary size it was checked against.
        vocab: usize,
    },
    /// A token buffer is too short to cut even one (input, target) window from.
    #[error("token buffer holds {len} tokens but seq_len {seq_len} needs at least {needed}")]
    BufferTooShort {
        /// Tokens in the buffer.
        len: usize,
        /// Requested sequence length.
        seq_len: usize,
        /// Minimum number of tokens required (`seq_len + 1`).
        needed: usize,
    },
    /// An output slice does not have the length the batch shape requires.
    #[error("{field} has length {got} but batch {batch} x seq_len {seq_len} needs {expected}")]
    SliceLength {
        /// Which slice (`inputs` or `targets`).
        field: &'static str,
        /// Its actual length.
        got: usize,
        /// The required length.
        expected: usize,
        /// Requested batch size.
        batch: usize,
        /// Sequence length of the sampler.
        seq_len: usize,
    },

    // === Files ===
    /// Opening or reading a file failed.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A file exceeds the per-file size cap.
    #[error("{}: {size} bytes exceeds the cap of {cap} bytes per file", .path.display())]
    FileTooLarge {
        /// The file that is too large.
        path: PathBuf,
        /// Its size in bytes (at least `cap + 1` if it grew while being read).
        size: u64,
        /// The cap in bytes.
        cap: u64,
    },
    /// No text files were given.
    #[error("no input text files given")]
    NoInputFiles,
    /// The given files produced no tokens at all.
    #[error("no tokens in the input files: {}", display_paths(.paths))]
    EmptyInput {
        /// The files that were read.
        paths: Vec<PathBuf>,
    },
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, DataError>;

fn display_paths(paths: &[PathBuf]) -> String {
    let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    names.join(", ")
}
