//! Whole-file compression of text and JSON Lines inputs: gzip (`.gz`) and zstd (`.zst`).
//!
//! The compression comes from the last extension (`corpus.jsonl.gz`), the format from the one
//! before it or from `--format`. A file is decompressed as it is read, through a fixed set of
//! buffers: the file is never read whole, and the decompressed bytes reach the line readers
//! (`readers.rs`) which hold at most one document's cap of them at a time. So a decompression
//! bomb (a small file that expands to terabytes) costs time, not memory: it is cut into
//! capped documents, or fails as over-long JSON lines, like the same bytes uncompressed would.
//! gzip's window is 32 KiB; zstd's is at most 128 MiB (libzstd's default limit for
//! decoding, 2^27; a frame that asks for more, such as `zstd --long=31` output, is an error).
//!
//! Corrupt, truncated or mislabelled data (a `.gz` that is not gzip) is a
//! [`DataError::BadInputFile`] naming the file and the codec, never a panic or a silent stop;
//! a failed read of the file itself stays a [`DataError::Io`].

use std::fmt;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};

use flate2::bufread::MultiGzDecoder;

use crate::error::{DataError, Result};

/// Compressed bytes read from the file per refill of the decoder's input buffer.
const COMPRESSED_BUF: usize = 256 << 10;

/// How an input file as a whole is compressed, told by its last extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Compression {
    /// Not compressed.
    #[default]
    None,
    /// gzip (`.gz`), one member or several concatenated (as `cat a.gz b.gz` or bgzip write).
    Gzip,
    /// Zstandard (`.zst`, `.zstd`), one frame or several.
    Zstd,
}

impl Compression {
    /// The codec's name, as error messages give it.
    pub const fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }

    /// The compression `path`'s last extension names (case-insensitive); `None` for any other.
    pub fn from_path(path: &Path) -> Compression {
        let ext = path.extension().and_then(|e| e.to_str());
        match ext.map(str::to_ascii_lowercase).as_deref() {
            Some("gz") => Compression::Gzip,
            Some("zst" | "zstd") => Compression::Zstd,
            _ => Compression::None,
        }
    }

    /// `path`'s file name without the compression extension (`a.jsonl.gz` gives `a.jsonl`),
    /// whose own extension names the format; `None` when there is no such name.
    pub fn inner_name(path: &Path) -> Option<&Path> {
        match Compression::from_path(path) {
            Compression::None => path.file_name().map(Path::new),
            _ => path.file_stem().map(Path::new),
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A reader that counts the bytes it passes on and remembers whether the file failed.
struct Counted {
    file: File,
    bytes: u64,
    failed: bool,
}

impl Read for Counted {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.file.read(buf) {
            Ok(n) => {
                self.bytes += n as u64;
                Ok(n)
            }
            Err(e) => {
                self.failed |= e.kind() != io::ErrorKind::Interrupted;
                Err(e)
            }
        }
    }
}

/// The decoder over the file, one variant per [`Compression`].
enum Codec {
    Plain(Counted),
    Gzip(MultiGzDecoder<BufReader<Counted>>),
    Zstd(zstd::stream::read::Decoder<'static, BufReader<Counted>>),
}

/// An input file's bytes, decompressed as they are read.
pub(crate) struct Decoded {
    path: PathBuf,
    compression: Compression,
    codec: Codec,
}

impl Decoded {
    /// Opens `path` to be read through `compression`'s decoder.
    ///
    /// # Errors
    /// [`DataError::Io`] if the file cannot be opened or the zstd context not made.
    pub(crate) fn open(path: &Path, compression: Compression) -> Result<Self> {
        let io = |source| DataError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = Counted {
            file: File::open(path).map_err(io)?,
            bytes: 0,
            failed: false,
        };
        let buffered = |file| BufReader::with_capacity(COMPRESSED_BUF, file);
        let codec = match compression {
            Compression::None => Codec::Plain(file),
            Compression::Gzip => Codec::Gzip(MultiGzDecoder::new(buffered(file))),
            Compression::Zstd => {
                Codec::Zstd(zstd::stream::read::Decoder::with_buffer(buffered(file)).map_err(io)?)
            }
        };
        Ok(Decoded {
            path: path.to_path_buf(),
            compression,
            codec,
        })
    }

    fn counted(&self) -> &Counted {
        match &self.codec {
            Codec::Plain(c) => c,
            Codec::Gzip(d) => d.get_ref().get_ref(),
            Codec::Zstd(d) => d.get_ref().get_ref(),
        }
    }

    /// Bytes of the file read so far, compressed (for progress against the file's size).
    pub(crate) fn file_bytes_read(&self) -> u64 {
        self.counted().bytes
    }

    /// The file, for error messages.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The error a failed read is: [`DataError::Io`] if reading the file failed (or it is not
    /// compressed), else [`DataError::BadInputFile`] saying the data did not decode.
    pub(crate) fn error(&self, source: io::Error) -> DataError {
        if self.compression == Compression::None || self.counted().failed {
            return DataError::Io {
                path: self.path.clone(),
                source,
            };
        }
        let codec = self.compression.name();
        DataError::BadInputFile {
            path: self.path.clone(),
            problem: format!(
                "{codec} decompression failed: {source} (the file is truncated or corrupt, or is not \
                 {codec} data despite its extension)"
            ),
        }
    }
}

impl Read for Decoded {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &mut self.codec {
            Codec::Plain(c) => c.read(buf),
            Codec::Gzip(d) => d.read(buf),
            Codec::Zstd(d) => d.read(buf),
        }
    }
}
