//! `flotilla data prepare`: text, JSON Lines and Parquet files to a sharded, hashed dataset.
//! Text and JSON Lines may be gzip or zstd compressed (`.gz`, `.zst`; see [`Compression`]),
//! Parquet pages snappy, gzip or zstd compressed.
//!
//! The pipeline, with bounded memory whatever the input size:
//!
//! 1. [`discover`] expands paths, globs and directories into files, in a fixed order.
//! 2. Documents are read in batches of about [`PrepareConfig::batch_bytes`] of text (plain text
//!    cut by [`TextDocs`], a JSON Lines string field, a Parquet string column). A document
//!    longer than [`PrepareConfig::max_doc_bytes`] is cut at line boundaries into several.
//! 3. Each batch is tokenized in parallel (rayon, [`PrepareConfig::threads`]) while the next
//!    batch is read; the tokenizer's end-of-text id, if it has one, ends every document.
//! 4. Documents are written in input order into `shard-00000.fts`, `shard-00001.fts`, ...; a
//!    shard is closed once its token bytes reach [`PrepareConfig::shard_bytes`], so no
//!    document spans two shards. The output is byte-identical for any thread count.
//! 5. The manifest is written last, atomically: a directory without one holds an interrupted
//!    run, whose leftovers the next run removes ([`prepare_output_dir`]).

mod compress;
mod inputs;
mod output;
#[cfg(feature = "parquet")]
mod parquet;
mod readers;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rayon::prelude::*;

pub use compress::Compression;
pub use inputs::{InputFile, InputFormat, TextDocs, discover};
pub use output::{prepare_output_dir, shard_file_name};

use crate::error::{DataError, Result};
use crate::manifest::Manifest;
use crate::tokenizer::Tokenizer;
use output::Sharder;
use readers::{DocReader, JsonlReader, TextReader};

/// Default target shard size: 64 MiB of token ids.
pub const DEFAULT_SHARD_BYTES: u64 = 64 << 20;
/// Default cap on one document's text; longer ones are cut at line boundaries.
pub const DEFAULT_MAX_DOC_BYTES: usize = 64 << 20;
/// Default text read per tokenization batch.
pub const DEFAULT_BATCH_BYTES: usize = 32 << 20;

/// What to prepare and how.
#[derive(Debug, Clone)]
pub struct PrepareConfig {
    /// Input files, directories and glob patterns (see [`discover`]).
    pub inputs: Vec<String>,
    /// The dataset directory to write.
    pub output: PathBuf,
    /// Read every input in this format; `None` infers it from each file's extension. Whole-file
    /// compression (`.gz`, `.zst`) always comes from the extension.
    pub format: Option<InputFormat>,
    /// How plain text is cut into documents.
    pub text_docs: TextDocs,
    /// The JSON Lines field or Parquet column holding the text.
    pub field: String,
    /// Count and skip malformed JSON Lines lines instead of failing on the first one.
    pub skip_bad_lines: bool,
    /// Target shard size in bytes of token ids.
    pub shard_bytes: u64,
    /// Tokenizer threads; 0 uses every core.
    pub threads: usize,
    /// Replace a dataset already in `output`.
    pub force: bool,
    /// Cap on one document's text in bytes.
    pub max_doc_bytes: usize,
    /// Text read per tokenization batch, in bytes.
    pub batch_bytes: usize,
}

impl PrepareConfig {
    /// A configuration with every option at its default.
    pub fn new(inputs: Vec<String>, output: PathBuf) -> Self {
        PrepareConfig {
            inputs,
            output,
            format: None,
            text_docs: TextDocs::default(),
            field: "text".into(),
            skip_bad_lines: false,
            shard_bytes: DEFAULT_SHARD_BYTES,
            threads: 0,
            force: false,
            max_doc_bytes: DEFAULT_MAX_DOC_BYTES,
            batch_bytes: DEFAULT_BATCH_BYTES,
        }
    }

    /// The manifest's `preprocessing` string: the tool version and every option that changes
    /// the output bytes (not `threads`, `force` or `batch_bytes`, which do not).
    pub fn preprocessing(&self, tokenizer: &str) -> String {
        format!(
            "flotilla-data {} prepare: format={} text-docs={} field={} tokenizer={} shard-bytes={} \
             max-doc-bytes={} skip-bad-lines={} eot-appended",
            env!("CARGO_PKG_VERSION"),
            self.format.map_or("auto", InputFormat::name),
            self.text_docs,
            self.field,
            tokenizer,
            self.shard_bytes,
            self.max_doc_bytes,
            self.skip_bad_lines,
        )
    }
}

/// Where a run stands, reported after every batch.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// Input files.
    pub files: usize,
    /// Total size of the input files.
    pub input_bytes: u64,
    /// Input bytes consumed so far (the reader runs one batch ahead of the writer).
    pub input_bytes_done: u64,
    /// Documents written.
    pub docs: u64,
    /// Token ids written.
    pub tokens: u64,
    /// Shards finished.
    pub shards: usize,
}

/// What a finished run did.
#[derive(Debug, Clone)]
pub struct PrepareSummary {
    /// Input files read.
    pub files: usize,
    /// Total size of the input files.
    pub input_bytes: u64,
    /// Bytes of document text tokenized (UTF-8).
    pub text_bytes: u64,
    /// Documents written.
    pub docs: u64,
    /// Token ids written (end-of-text ids included).
    pub tokens: u64,
    /// Shards written.
    pub shards: usize,
    /// Bytes of shard files written.
    pub bytes_written: u64,
    /// Records skipped: bad JSON Lines lines (with `skip_bad_lines`) and Parquet nulls.
    pub skipped: u64,
    /// Extra documents made by cutting documents over the cap.
    pub split_docs: u64,
    /// Files of an earlier run removed from the output directory first.
    pub removed_files: usize,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// The manifest written.
    pub manifest: Manifest,
}

impl PrepareSummary {
    /// Text tokenized per second, in MB (10^6 bytes).
    pub fn text_mb_per_s(&self) -> f64 {
        self.text_bytes as f64 / 1e6 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Token ids written per second.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Every figure as JSON, for the dataset at `output` (`uploaded`: bytes uploaded to it,
    /// when it is in object storage).
    pub fn to_json(&self, output: &str, uploaded: Option<u64>) -> serde_json::Value {
        serde_json::json!({"output": output, "files": self.files, "input_bytes": self.input_bytes,
            "text_bytes": self.text_bytes, "docs": self.docs, "tokens": self.tokens,
            "shards": self.shards, "bytes_written": self.bytes_written, "skipped": self.skipped,
            "split_docs": self.split_docs, "removed_files": self.removed_files,
            "seconds": self.elapsed.as_secs_f64(), "text_mb_per_s": self.text_mb_per_s(),
            "tokens_per_s": self.tokens_per_s(), "tokenizer": self.manifest.tokenizer,
            "snapshot": self.manifest.snapshot, "uploaded_bytes": uploaded})
    }

    /// The same as lines for a person.
    pub fn lines(&self, output: &str, uploaded: Option<u64>) -> Vec<String> {
        let mut lines = vec![
            format!(
                "prepared {output}: {} documents, {} tokens, {} shards, {} bytes ({})",
                self.docs, self.tokens, self.shards, self.bytes_written, self.manifest.tokenizer
            ),
            format!(
                "read {} input file(s) ({:.1} MB, {:.1} MB of text) in {:.2} s: {:.1} MB/s of text, \
                 {:.2} M tokens/s",
                self.files,
                self.input_bytes as f64 / 1e6,
                self.text_bytes as f64 / 1e6,
                self.elapsed.as_secs_f64(),
                self.text_mb_per_s(),
                self.tokens_per_s() / 1e6
            ),
            format!(
                "skipped records: {}, documents cut at --max-doc-size: {}, files of an earlier run \
                 removed: {}",
                self.skipped, self.split_docs, self.removed_files
            ),
            format!("snapshot {}", self.manifest.snapshot),
        ];
        if let Some(bytes) = uploaded {
            lines.push(format!(
                "uploaded {bytes} bytes to {output} (manifest last)"
            ));
        }
        lines
    }
}

/// Parses a size such as `64MiB`, `1GiB`, `500MB`, `4096` (bytes); binary suffixes KiB, MiB,
/// GiB, TiB and decimal KB, MB, GB, TB, case-insensitive, an optional `B` alone, and an
/// optional space. The size must be positive.
///
/// # Errors
/// [`DataError::InvalidOption`] naming `option` and the text.
pub fn parse_byte_size(option: &'static str, text: &str) -> Result<u64> {
    let bad = || DataError::InvalidOption {
        option,
        value: text.to_string(),
        requirement: "a positive size such as 64MiB, 1GiB, 500MB or 1048576 (bytes)".into(),
    };
    let s = text.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(split);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let unit: u64 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(bad()),
    };
    match n.checked_mul(unit) {
        Some(v) if v > 0 => Ok(v),
        _ => Err(bad()),
    }
}

/// One document and the input file it came from.
struct Doc {
    file: usize,
    text: String,
}

/// Reads documents from the input files in order, a batch at a time.
struct DocStream<'a> {
    cfg: &'a PrepareConfig,
    files: &'a [InputFile],
    next_file: usize,
    reader: Option<Box<dyn DocReader>>,
    /// Bytes, skips and splits of files already finished.
    done_bytes: u64,
    done_skipped: u64,
    done_splits: u64,
}

impl DocStream<'_> {
    fn open(&self, file: &InputFile) -> Result<Box<dyn DocReader>> {
        let cfg = self.cfg;
        Ok(match file.format {
            InputFormat::Text => Box::new(TextReader::open(
                &file.path,
                file.compression,
                cfg.text_docs,
                cfg.max_doc_bytes,
            )?),
            InputFormat::Jsonl => Box::new(JsonlReader::open(
                &file.path,
                file.compression,
                &cfg.field,
                cfg.skip_bad_lines,
                cfg.max_doc_bytes,
            )?),
            #[cfg(feature = "parquet")]
            InputFormat::Parquet => Box::new(parquet::ParquetReader::open(
                &file.path,
                &cfg.field,
                cfg.max_doc_bytes,
            )?),
            #[cfg(not(feature = "parquet"))]
            InputFormat::Parquet => return Err(parquet_disabled(file)),
        })
    }

    /// Up to `batch_bytes` of documents (at least one unless the inputs are exhausted).
    fn next_batch(&mut self) -> Result<Vec<Doc>> {
        let mut batch = Vec::new();
        let mut bytes = 0;
        while bytes < self.cfg.batch_bytes {
            if self.reader.is_none() {
                let Some(file) = self.files.get(self.next_file) else {
                    break;
                };
                self.reader = Some(self.open(file)?);
                self.next_file += 1;
            }
            let reader = self.reader.as_mut().expect("opened above");
            match reader.next_doc()? {
                Some(text) => {
                    bytes += text.len();
                    batch.push(Doc {
                        file: self.next_file - 1,
                        text,
                    });
                }
                None => {
                    self.done_bytes += self.files[self.next_file - 1].bytes;
                    self.done_skipped += reader.skipped();
                    self.done_splits += reader.splits();
                    self.reader = None;
                }
            }
        }
        Ok(batch)
    }

    fn consumed(&self) -> u64 {
        self.done_bytes + self.reader.as_ref().map_or(0, |r| r.consumed())
    }
}

#[cfg(not(feature = "parquet"))]
fn parquet_disabled(file: &InputFile) -> DataError {
    DataError::FeatureDisabled {
        what: format!("the Parquet input {}", file.path.display()),
        feature: "parquet",
    }
}

/// The tokenizer each pool thread uses: its own from [`Tokenizer::for_thread`], else the
/// shared one.
struct PerThread<'a> {
    shared: &'a (dyn Tokenizer + Sync),
    own: Vec<Box<dyn Tokenizer + Send + Sync>>,
}

impl<'a> PerThread<'a> {
    fn new(shared: &'a (dyn Tokenizer + Sync), threads: usize) -> Result<Self> {
        let mut own = Vec::new();
        if threads > 1 {
            for _ in 0..threads {
                match shared.for_thread()? {
                    Some(t) => own.push(t),
                    None => break,
                }
            }
        }
        Ok(PerThread { shared, own })
    }

    /// The tokenizer for the calling thread (a pool thread, or any other: the shared one).
    fn get(&self) -> &(dyn Tokenizer + Sync) {
        match rayon::current_thread_index().and_then(|i| self.own.get(i)) {
            Some(t) => t.as_ref(),
            None => self.shared,
        }
    }
}

/// Tokenizes a batch in parallel, appending `eot` to each document.
fn tokenize(batch: &[Doc], tokenizers: &PerThread, files: &[InputFile]) -> Result<Vec<Vec<u32>>> {
    let eot = tokenizers.shared.eot();
    batch
        .par_iter()
        .map(|doc| {
            let mut ids = tokenizers
                .get()
                .try_encode(&doc.text)
                .map_err(|e| match e {
                    DataError::TokenizerFailed { tokenizer, reason } => {
                        DataError::TokenizerFailed {
                            tokenizer,
                            reason: format!(
                                "{reason} (a document of {})",
                                files[doc.file].path.display()
                            ),
                        }
                    }
                    other => other,
                })?;
            ids.extend(eot);
            Ok(ids)
        })
        .collect()
}

/// Prepares a dataset as `cfg` says, calling `progress` after every batch.
///
/// # Errors
/// - input errors: [`DataError::NoInputFiles`], [`DataError::BadInput`],
///   [`DataError::UnknownFormat`], [`DataError::FeatureDisabled`] (Parquet without the
///   feature), [`DataError::BadRecord`] (file and line), [`DataError::BadInputFile`],
///   [`DataError::Io`];
/// - [`DataError::EmptyInput`] if the inputs hold no document;
/// - [`DataError::DatasetExists`] if `cfg.output` holds a dataset and `cfg.force` is unset;
/// - [`DataError::InvalidArgument`] for a zero size option (or `max_doc_bytes` below 8), a
///   thread pool that cannot start, or a vocabulary over `u32`; tokenizer and shard errors.
///
/// On any error no manifest is written, and the next run clears what this one left.
pub fn prepare(
    cfg: &PrepareConfig,
    tokenizer: &(dyn Tokenizer + Sync),
    progress: &mut dyn FnMut(&Progress),
) -> Result<PrepareSummary> {
    let start = Instant::now();
    check_sizes(cfg)?;
    let vocab = u32::try_from(tokenizer.vocab_size()).map_err(|_| DataError::InvalidArgument {
        field: "vocab",
        value: tokenizer.vocab_size() as u64,
        requirement: "token ids must fit a u32".into(),
    })?;
    let mut files = discover(&cfg.inputs, cfg.format)?;
    files.retain(|f| !output::is_output_file(&cfg.output, &f.path));
    #[cfg(not(feature = "parquet"))]
    if let Some(f) = files.iter().find(|f| f.format == InputFormat::Parquet) {
        return Err(parquet_disabled(f));
    }
    let removed_files = prepare_output_dir(&cfg.output, cfg.force)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(cfg.threads)
        .build()
        .map_err(|e| DataError::InvalidArgument {
            field: "threads",
            value: cfg.threads as u64,
            requirement: format!("could not start the thread pool: {e}"),
        })?;
    let tokenizers = PerThread::new(tokenizer, pool.current_num_threads())?;
    let mut stream = DocStream {
        cfg,
        files: &files,
        next_file: 0,
        reader: None,
        done_bytes: 0,
        done_skipped: 0,
        done_splits: 0,
    };
    let name = tokenizer.name().to_string();
    let mut sharder = Sharder::new(&cfg.output, vocab, &name, cfg.shard_bytes);
    let mut p = Progress {
        files: files.len(),
        input_bytes: files.iter().map(|f| f.bytes).sum(),
        ..Progress::default()
    };
    let mut text_bytes = 0u64;
    // Tokenize batch k on the pool while batch k + 1 is read; write in order on this thread.
    let mut batch = pool.install(|| stream.next_batch())?;
    while !batch.is_empty() {
        let (ids, next) = pool.install(|| {
            rayon::join(
                || tokenize(&batch, &tokenizers, &files),
                || stream.next_batch(),
            )
        });
        for doc in ids? {
            if !doc.is_empty() {
                sharder.push(&doc)?;
                p.docs += 1;
                p.tokens += doc.len() as u64;
            }
        }
        text_bytes += batch.iter().map(|d| d.text.len() as u64).sum::<u64>();
        p.shards = sharder.finished().len();
        p.input_bytes_done = stream.consumed();
        progress(&p);
        batch = next?;
    }
    if p.docs == 0 {
        return Err(DataError::EmptyInput {
            paths: files.into_iter().map(|f| f.path).collect(),
        });
    }
    let shards = sharder.finish()?;
    let manifest = Manifest::new(
        &name,
        vocab,
        tokenizer.eot(),
        &cfg.preprocessing(&name),
        &shards,
    );
    manifest.write_atomic(&cfg.output)?;
    p.shards = shards.len();
    p.input_bytes_done = p.input_bytes;
    progress(&p);
    Ok(PrepareSummary {
        files: files.len(),
        input_bytes: p.input_bytes,
        text_bytes,
        docs: p.docs,
        tokens: p.tokens,
        shards: shards.len(),
        bytes_written: manifest.bytes,
        skipped: stream.done_skipped,
        split_docs: stream.done_splits,
        removed_files,
        elapsed: start.elapsed(),
        manifest,
    })
}

fn check_sizes(cfg: &PrepareConfig) -> Result<()> {
    // A document cap below 8 bytes could not hold one character of every script.
    let sizes = [
        ("shard_bytes", cfg.shard_bytes, 1),
        ("max_doc_bytes", cfg.max_doc_bytes as u64, 8),
        ("batch_bytes", cfg.batch_bytes as u64, 1),
    ];
    for (field, value, least) in sizes {
        if value < least {
            return Err(DataError::InvalidArgument {
                field,
                value,
                requirement: format!("must be at least {least}"),
            });
        }
    }
    Ok(())
}
