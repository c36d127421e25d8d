//! Writing one shard: stream documents into a temporary file, then publish it atomically.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::Xxh3;

use super::{END_MAGIC, HEADER_LEN, Header, MAX_TOKENIZER_NAME, ShardInfo, combine, token_width};
use crate::error::{DataError, Result};

/// Streams documents into a new shard.
///
/// The shard is written as `<path>.tmp` and renamed to `path` only by [`ShardWriter::finish`],
/// after an `fsync`, so a shard file under its final name is always complete. Dropping an
/// unfinished writer removes the temporary file.
pub struct ShardWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: Option<ChunkedFile>,
    body: Xxh3,
    header: Header,
    /// Document end offsets, in tokens (the index without its leading 0).
    ends: Vec<u64>,
    scratch: Vec<u8>,
}

impl ShardWriter {
    /// Starts a shard at `path` for ids below `vocab`, produced by the tokenizer `tokenizer`.
    ///
    /// # Errors
    /// [`DataError::InvalidArgument`] for a zero vocabulary or a tokenizer name longer than
    /// [`MAX_TOKENIZER_NAME`] bytes; [`DataError::Io`] if the temporary file cannot be created.
    pub fn create(path: &Path, vocab: u32, tokenizer: &str) -> Result<Self> {
        if vocab == 0 {
            return Err(DataError::InvalidArgument {
                field: "vocab",
                value: 0,
                requirement: "a shard needs a vocabulary of at least one id".into(),
            });
        }
        if tokenizer.len() > MAX_TOKENIZER_NAME {
            return Err(DataError::InvalidArgument {
                field: "tokenizer name length",
                value: tokenizer.len() as u64,
                requirement: format!("at most {MAX_TOKENIZER_NAME} bytes ({tokenizer:?})"),
            });
        }
        let tmp = tmp_path(path);
        let io = |source| DataError::Io {
            path: tmp.clone(),
            source,
        };
        let mut out = ChunkedFile::new(File::create(&tmp).map_err(io)?);
        out.write_all(&[0u8; HEADER_LEN as usize]).map_err(io)?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp: tmp.clone(),
            out: Some(out),
            body: Xxh3::new(),
            header: Header {
                width: token_width(vocab),
                tokens: 0,
                docs: 0,
                vocab,
                tokenizer: tokenizer.to_string(),
            },
            ends: Vec::new(),
            scratch: Vec::new(),
        })
    }

    /// Tokens written so far.
    pub fn tokens(&self) -> u64 {
        self.header.tokens
    }

    /// Documents written so far.
    pub fn docs(&self) -> u64 {
        self.header.docs
    }

    /// Bytes the token array takes so far (what a target shard size is compared with).
    pub fn token_bytes(&self) -> u64 {
        self.header.tokens * u64::from(self.header.width)
    }

    /// Appends one document.
    ///
    /// # Errors
    /// [`DataError::TokenOutOfRange`] if an id is not below the vocabulary (nothing of the
    /// document is written then); [`DataError::Io`] on a write failure.
    pub fn push_doc(&mut self, ids: &[u32]) -> Result<()> {
        let vocab = self.header.vocab;
        if let Some(pos) = ids.iter().position(|&id| id >= vocab) {
            return Err(DataError::TokenOutOfRange {
                id: ids[pos],
                position: pos,
                vocab: vocab as usize,
            });
        }
        self.scratch.clear();
        if self.header.width == 2 {
            self.scratch
                .extend(ids.iter().flat_map(|&id| (id as u16).to_le_bytes()));
        } else {
            self.scratch
                .extend(ids.iter().flat_map(|&id| id.to_le_bytes()));
        }
        let scratch = std::mem::take(&mut self.scratch);
        let written = self.write_body(&scratch);
        self.scratch = scratch;
        written?;
        self.header.tokens += ids.len() as u64;
        self.header.docs += 1;
        self.ends.push(self.header.tokens);
        Ok(())
    }

    fn write_body(&mut self, bytes: &[u8]) -> Result<()> {
        self.body.update(bytes);
        let out = self.out.as_mut().expect("writer is open until finish");
        out.write_all(bytes).map_err(|source| DataError::Io {
            path: self.tmp.clone(),
            source,
        })
    }

    /// Writes the index, footer and header, syncs, and renames the file to its final name.
    ///
    /// # Errors
    /// [`DataError::Io`] on any write, sync or rename failure (the temporary file is removed).
    pub fn finish(mut self) -> Result<ShardInfo> {
        let pad = self.token_bytes().next_multiple_of(8) - self.token_bytes();
        self.write_body(&[0u8; 8][..pad as usize])?;
        let mut index = Vec::with_capacity((self.ends.len() + 1) * 8);
        index.extend_from_slice(&0u64.to_le_bytes());
        for end in &self.ends {
            index.extend_from_slice(&end.to_le_bytes());
        }
        self.write_body(&index)?;
        let header = self.header.encode();
        let checksum = combine(&header, self.body.digest128());
        let tmp = self.tmp.clone();
        let io = |source| DataError::Io {
            path: tmp.clone(),
            source,
        };
        let mut out = self.out.take().expect("writer is open until finish");
        out.write_all(&checksum.to_le_bytes()).map_err(io)?;
        out.write_all(END_MAGIC).map_err(io)?;
        let mut file = out.into_inner().map_err(io)?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&header).map_err(io)?;
        file.sync_all().map_err(io)?;
        let bytes = file.metadata().map_err(io)?.len();
        drop(file);
        std::fs::rename(&self.tmp, &self.path).map_err(io)?;
        Ok(ShardInfo {
            path: self.path.clone(),
            bytes,
            tokens: self.header.tokens,
            docs: self.header.docs,
            vocab: self.header.vocab,
            width: self.header.width,
            tokenizer: self.header.tokenizer.clone(),
            checksum,
        })
    }
}

impl Drop for ShardWriter {
    fn drop(&mut self) {
        // Still open means `finish` never ran (or failed): leave nothing half-written behind.
        if self.out.take().is_some() || !self.path.exists() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Bytes per write of [`ChunkedFile`]: a multiple of the 2 MiB huge page.
const CHUNK: usize = 4 << 20;

/// A write buffer that hands the file only whole [`CHUNK`]s at offsets that are multiples of
/// `CHUNK` (and one short tail at the end).
///
/// `BufWriter` flushes wherever a document overflows its buffer, so after the 64-byte header
/// every write starts off any 2 MiB boundary, and the page cache keeps the new shard in small
/// folios. Aligned 4 MiB writes let the kernel (ext4, XFS, tmpfs with large folios) cache it in
/// 2 MiB folios, which the loader's mapping then reaches with one page-table entry per 2 MiB:
/// the shuffled row gather of a freshly prepared dataset walks no 4 KiB page tables (the row
/// copy of a first epoch ran 4.4 GB/s a core over 4 KiB entries, 7.3 GB/s over 2 MiB ones;
/// docs/PERFORMANCE.md, data pipeline).
struct ChunkedFile {
    file: File,
    buf: Vec<u8>,
}

impl ChunkedFile {
    fn new(file: File) -> Self {
        Self {
            file,
            buf: Vec::with_capacity(CHUNK),
        }
    }

    /// Appends `bytes`, writing every chunk that fills.
    fn write_all(&mut self, mut bytes: &[u8]) -> std::io::Result<()> {
        while !bytes.is_empty() {
            let take = bytes.len().min(CHUNK - self.buf.len());
            self.buf.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.buf.len() == CHUNK {
                self.file.write_all(&self.buf)?;
                self.buf.clear();
            }
        }
        Ok(())
    }

    /// Writes out the buffered tail and returns the file.
    fn into_inner(mut self) -> std::io::Result<File> {
        self.file.write_all(&self.buf)?;
        Ok(self.file)
    }
}

/// The temporary name a shard is written under.
pub(crate) fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}
