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
    /// A path that must be a regular file is a FIFO, a device, a directory or a socket.
    #[error("{}: is {kind}, not a regular file", .path.display())]
    NotAFile {
        /// The path (as given; a symbolic link is reported under its own name).
        path: PathBuf,
        /// What it is (`a FIFO`, `a character device`, `a directory`, ...).
        kind: &'static str,
    },
    /// A token shard failed a check: foreign file, bad header, truncation, bad index.
    #[error("shard {}: {problem}", .path.display())]
    CorruptShard {
        /// The shard file.
        path: PathBuf,
        /// What is wrong, with the values that disagreed.
        problem: String,
    },
    /// A shard's bytes do not hash to the checksum recorded for it.
    #[error("shard {}: checksum mismatch: {recorded_in} records {expected}, the bytes hash to {actual}", .path.display())]
    ChecksumMismatch {
        /// The shard file.
        path: PathBuf,
        /// Where the expected hash came from (`footer` or `manifest`).
        recorded_in: &'static str,
        /// The recorded hash (hex).
        expected: String,
        /// The hash of the bytes on disk (hex).
        actual: String,
    },
    /// The manifest lists a shard that is not on disk.
    #[error("shard {} listed in the manifest is missing: {source}", .path.display())]
    MissingShard {
        /// The shard file that was expected.
        path: PathBuf,
        /// The error from looking it up.
        #[source]
        source: std::io::Error,
    },
    /// A dataset manifest is unreadable, malformed or inconsistent.
    #[error("manifest {}: {problem}", .path.display())]
    BadManifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// Datasets or a loader state that must agree do not.
    #[error("{what}: {detail}")]
    Mismatch {
        /// What was compared (`resume state`, `mixture`, ...).
        what: &'static str,
        /// The values that disagreed.
        detail: String,
    },
    /// A dataset holds fewer sequences than one needs.
    #[error(
        "dataset {name} has no sequence of seq_len {seq_len}: its longest shard holds {longest_shard_tokens} tokens and a sequence needs {needed}"
    )]
    DatasetTooSmall {
        /// The dataset (its directory).
        name: String,
        /// Requested sequence length.
        seq_len: usize,
        /// Tokens in the largest shard.
        longest_shard_tokens: u64,
        /// Tokens one sequence needs (`seq_len + 1`).
        needed: usize,
    },
    /// A loader did not deliver in time, or stopped.
    #[error("data loader: {0}")]
    Loader(String),
    /// No text files were given.
    #[error("no input text files given")]
    NoInputFiles,
    /// The given files produced no tokens at all.
    #[error("no tokens in the input files: {}", display_paths(.paths))]
    EmptyInput {
        /// The files that were read.
        paths: Vec<PathBuf>,
    },

    // === Dataset preparation ===
    /// An option's text value did not parse (`--shard-size`, `--format`, `--text-docs`, ...).
    #[error("invalid {option} {value:?}: {requirement}")]
    InvalidOption {
        /// The option (`--shard-size`, `--format`, ...).
        option: &'static str,
        /// The text that was given.
        value: String,
        /// What is accepted.
        requirement: String,
    },
    /// An input path, glob or directory matched no file.
    #[error("input {pattern:?}: {problem}")]
    BadInput {
        /// The path, glob or directory as given.
        pattern: String,
        /// What is wrong (no such file, no file matched, bad glob syntax, ...).
        problem: String,
    },
    /// An input file's format cannot be told from its name and `--format` was not given.
    #[error("{}: unknown input format (extension {extension:?}); name it with --format text|jsonl|parquet", .path.display())]
    UnknownFormat {
        /// The file.
        path: PathBuf,
        /// Its extension (empty when it has none).
        extension: String,
    },
    /// One record of an input file is malformed (a JSON Lines line, a Parquet row group).
    #[error("{}:{line}: {problem}", .path.display())]
    BadRecord {
        /// The input file.
        path: PathBuf,
        /// 1-based line (JSON Lines) or row-group index (Parquet).
        line: u64,
        /// What was wrong with it.
        problem: String,
    },
    /// A file is not readable in the format it was taken for (a Parquet file's metadata, ...).
    #[error("{}: {problem}", .path.display())]
    BadInputFile {
        /// The input file.
        path: PathBuf,
        /// What was wrong.
        problem: String,
    },
    /// A dataset in object storage could not be read.
    #[error("dataset {url}: {reason}")]
    Remote {
        /// The dataset's URL.
        url: String,
        /// What failed (the store's error, with the object's key).
        reason: String,
    },
    /// Something needs a cargo feature this build was compiled without.
    #[error("{what} needs flotilla built with `--features {feature}`")]
    FeatureDisabled {
        /// What was asked for (`Parquet input x.parquet`, `tokenizer.json`, ...).
        what: String,
        /// The cargo feature that provides it.
        feature: &'static str,
    },
    /// The output directory already holds a dataset and replacing it was not asked for.
    #[error("{} already holds a dataset ({}); pass --force to replace it", .dir.display(), crate::manifest::MANIFEST_FILE)]
    DatasetExists {
        /// The output directory.
        dir: PathBuf,
    },
    /// A tokenizer failed on some input or could not be loaded from a file.
    #[error("tokenizer {tokenizer}: {reason}")]
    TokenizerFailed {
        /// The tokenizer (its name or file).
        tokenizer: String,
        /// What failed.
        reason: String,
    },
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, DataError>;

fn display_paths(paths: &[PathBuf]) -> String {
    let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    names.join(", ")
}
