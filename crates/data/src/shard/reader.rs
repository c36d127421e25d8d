//! Reading one shard through a read-only memory map.

use std::path::{Path, PathBuf};

use memmap2::Mmap;
use xxhash_rust::xxh3::Xxh3;

use super::fault::Guard;
use super::{END_MAGIC, FOOTER_LEN, HEADER_LEN, Header, combine, file_len, hex128, index_offset};
use crate::error::{DataError, Result};
use crate::fsread::open_regular;

/// Maps every page of `map` in one pass, since verification reads all of them anyway (instead
/// of one page fault per 4 KiB). Page-cache folios of 2 MiB (what the kernel's read-ahead builds
/// for much of a file read sequentially) are mapped with one page-table entry each.
///
/// Not advised: `MADV_HUGEPAGE`. It makes a cold read build 2 MiB folios throughout, so that
/// later epochs copy rows without page walks, but on the 2-vCPU VM the first pass over each
/// new 2 MiB folio ran about 4x slower (a cold first epoch: loader 0.4 GB/s against 1.6
/// without the advice, docs/PERFORMANCE.md), which costs more than it saves.
///
/// # Errors
/// The error of `MADV_POPULATE_READ` for pages that cannot be read (EIO, EFAULT): touching them
/// would raise SIGBUS instead.
fn populate(map: &Mmap) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        match map.advise(memmap2::Advice::PopulateRead) {
            Ok(()) => return Ok(()),
            // A kernel before 5.14 does not know the advice: touch the pages instead.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            // EIO, EFAULT: the pages cannot be read; touching them would raise SIGBUS.
            Err(e) => return Err(e),
        }
    }
    // Elsewhere (or an old kernel): touch one byte per page.
    let mut sum = 0u8;
    for page in map.chunks(4096) {
        sum = sum.wrapping_add(page[0]);
    }
    std::hint::black_box(sum);
    Ok(())
}

/// What a shard holds, as recorded in its header (and in the manifest).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardInfo {
    /// The shard file.
    pub path: PathBuf,
    /// File length in bytes.
    pub bytes: u64,
    /// Token ids in the shard.
    pub tokens: u64,
    /// Documents in the shard.
    pub docs: u64,
    /// Vocabulary size: every id is below it.
    pub vocab: u32,
    /// Bytes per token id (2 or 4).
    pub width: u32,
    /// Name of the tokenizer that produced the ids.
    pub tokenizer: String,
    /// The footer checksum (see the module docs).
    pub checksum: u128,
}

/// An open, mapped shard.
///
/// [`Shard::open`] checks only what is cheap (magic, version, header fields, exact file length,
/// end magic); [`Shard::verify`] hashes every byte and checks the document index. Readers of a
/// [`crate::Dataset`] always get verified shards.
pub struct Shard {
    info: ShardInfo,
    /// The map's SIGBUS registration ([`super::fault`]); declared before `map` so that it is
    /// released before the map is unmapped.
    guard: Guard,
    map: Mmap,
}

impl Shard {
    /// Maps `path` and checks its header and length.
    ///
    /// # Errors
    /// [`DataError::Io`] if the file cannot be opened or mapped, [`DataError::NotAFile`] if it is
    /// not a regular file; [`DataError::CorruptShard`]
    /// naming the file for a foreign file, an unknown version, bad header fields, a length other
    /// than the header implies (truncated or extended), or a missing end marker.
    pub fn open(path: &Path) -> Result<Shard> {
        let io = |source| DataError::Io {
            path: path.to_path_buf(),
            source,
        };
        // Not blocking on a FIFO, refusing anything but a regular file (mapping a device
        // such as /dev/zero would "succeed").
        let (file, _) = open_regular(path)?;
        // SAFETY: the map is read-only and shards are immutable once renamed into place; a
        // process that truncates a mapped shard underneath us makes reads of the pages past
        // its new end fault, which the guard turns into an error (`Shard::intact`).
        let map = unsafe { memmap2::MmapOptions::new().map(&file) }.map_err(io)?;
        let guard = Guard::register(map.as_ptr(), map.len());
        populate(&map).map_err(io)?;
        let corrupt = |problem: String| DataError::CorruptShard {
            path: path.to_path_buf(),
            problem,
        };
        let header = Header::decode(&map).map_err(corrupt)?;
        let expected = file_len(header.tokens, header.docs, header.width).ok_or_else(|| {
            corrupt(format!(
                "header counts overflow: {} tokens, {} documents",
                header.tokens, header.docs
            ))
        })?;
        let actual = map.len() as u64;
        if actual != expected {
            let how = if actual < expected {
                "truncated"
            } else {
                "too long"
            };
            return Err(corrupt(format!(
                "{how}: the file is {actual} bytes, its header ({} tokens, {} documents) implies {expected}",
                header.tokens, header.docs
            )));
        }
        if &map[map.len() - 8..] != END_MAGIC {
            return Err(corrupt("end marker missing (incomplete write?)".into()));
        }
        let mut sum = [0u8; 16];
        sum.copy_from_slice(&map[map.len() - 24..map.len() - 8]);
        let shard = Shard {
            info: ShardInfo {
                path: path.to_path_buf(),
                bytes: actual,
                tokens: header.tokens,
                docs: header.docs,
                vocab: header.vocab,
                width: header.width,
                tokenizer: header.tokenizer,
                checksum: u128::from_le_bytes(sum),
            },
            guard,
            map,
        };
        shard.intact()?;
        Ok(shard)
    }

    /// Checks that no read of the map has faulted since it was opened: the file shrank on disk
    /// (truncated under the run), and whatever was read from its lost pages was zeros. Every
    /// reader calls it after copying, so those zeros are never used.
    ///
    /// # Errors
    /// [`DataError::CorruptShard`] naming the file.
    pub fn intact(&self) -> Result<()> {
        if self.guard.faulted() {
            return Err(DataError::CorruptShard {
                path: self.info.path.clone(),
                problem: "changed on disk while in use: a read past its new end faulted (the \
                          file was truncated under the run); its reads are refused from here on"
                    .into(),
            });
        }
        Ok(())
    }

    /// What the header says.
    pub fn info(&self) -> &ShardInfo {
        &self.info
    }

    /// Hashes the whole file and checks the document index.
    ///
    /// `expected` is the checksum recorded elsewhere (the manifest); the footer's is always
    /// checked.
    ///
    /// # Errors
    /// [`DataError::ChecksumMismatch`] naming where the disagreeing hash was recorded;
    /// [`DataError::CorruptShard`] for an index that does not start at 0, decreases, or does not
    /// end at the token count.
    pub fn verify(&self, expected: Option<u128>) -> Result<()> {
        let body = &self.map[HEADER_LEN as usize..self.map.len() - FOOTER_LEN as usize];
        let actual = combine(&self.map[..HEADER_LEN as usize], hash_streamed(body));
        let mismatch = |recorded_in, want: u128| DataError::ChecksumMismatch {
            path: self.info.path.clone(),
            recorded_in,
            expected: hex128(want),
            actual: hex128(actual),
        };
        self.intact()?;
        if actual != self.info.checksum {
            return Err(mismatch("the shard's footer", self.info.checksum));
        }
        if let Some(want) = expected
            && want != actual
        {
            return Err(mismatch("the manifest", want));
        }
        self.check_index()?;
        self.intact()
    }

    fn check_index(&self) -> Result<()> {
        let mut prev = None;
        for d in 0..=self.info.docs {
            let off = self.index_entry(d);
            let ok = match prev {
                None => off == 0,
                Some(p) => off >= p && off <= self.info.tokens,
            };
            if !ok {
                return Err(DataError::CorruptShard {
                    path: self.info.path.clone(),
                    problem: format!(
                        "document index entry {d} is {off} (previous {prev:?}, {} tokens)",
                        self.info.tokens
                    ),
                });
            }
            prev = Some(off);
        }
        if prev != Some(self.info.tokens) {
            return Err(DataError::CorruptShard {
                path: self.info.path.clone(),
                problem: format!(
                    "document index ends at {prev:?}, not at the token count {}",
                    self.info.tokens
                ),
            });
        }
        Ok(())
    }

    fn index_entry(&self, d: u64) -> u64 {
        let base = index_offset(self.info.tokens, self.info.width).expect("checked at open");
        let at = (base + d * 8) as usize;
        u64::from_le_bytes(self.map[at..at + 8].try_into().unwrap())
    }

    /// Token range `[start, end)` of document `d`, or `None` past the last document.
    pub fn doc_range(&self, d: u64) -> Option<std::ops::Range<u64>> {
        (d < self.info.docs).then(|| self.index_entry(d)..self.index_entry(d + 1))
    }

    /// The stored bytes of `count` tokens from token `start` (little-endian ids of the shard's
    /// width). A caller that copies them checks [`Shard::intact`] after the copy.
    ///
    /// # Errors
    /// [`DataError::InvalidArgument`] if the range runs past the shard's tokens.
    pub fn token_bytes(&self, start: u64, count: usize) -> Result<&[u8]> {
        self.check_range(start, count)?;
        let w = self.info.width as usize;
        let from = HEADER_LEN as usize + start as usize * w;
        Ok(&self.map[from..from + count * w])
    }

    /// Hints the CPU to start loading the cache lines of `count` tokens from token `start`
    /// (x86-64: `prefetcht0` per 64-byte line; elsewhere nothing). Out-of-range is ignored.
    pub fn prefetch(&self, start: u64, count: usize) {
        let Ok(bytes) = self.token_bytes(start, count) else {
            return;
        };
        #[cfg(target_arch = "x86_64")]
        prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T0 }>(bytes);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = bytes;
    }

    fn check_range(&self, start: u64, count: usize) -> Result<()> {
        let end = start.checked_add(count as u64);
        if end.is_none_or(|e| e > self.info.tokens) {
            return Err(DataError::InvalidArgument {
                field: "token range start",
                value: start,
                requirement: format!(
                    "{start} + {count} must not pass the {} tokens of {}",
                    self.info.tokens,
                    self.info.path.display()
                ),
            });
        }
        Ok(())
    }

    /// Copies `out.len()` token ids starting at token `start` into `out`, widened to `u32`.
    ///
    /// # Errors
    /// [`DataError::InvalidArgument`] if the range runs past the shard's tokens.
    pub fn read_tokens(&self, start: u64, out: &mut [u32]) -> Result<()> {
        let bytes = self.token_bytes(start, out.len())?;
        if self.info.width == 2 {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = u32::from(u16::from_le_bytes([b[0], b[1]]));
            }
        } else {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        self.intact()
    }
}

/// Bytes hashed between prefetches in [`hash_streamed`].
const HASH_STEP: usize = 4 << 10;

/// How far ahead of the bytes being hashed [`hash_streamed`] prefetches.
const HASH_AHEAD: usize = 32 << 10;

/// The xxh3-128 of `bytes` (the same value as `xxh3_128(bytes)`), hashed [`HASH_STEP`] bytes
/// at a time with the lines [`HASH_AHEAD`] bytes further on prefetched into L2.
///
/// The hash is a memory stream, and one stream per core is bounded by the misses the core
/// keeps in flight, not by the hash: one standalone core over 1 GiB hashed 6.9-7.8 GB/s
/// plain and 9.0-10.8 GB/s with this prefetch (L1-resident it runs 47 GB/s). A verified first
/// epoch hashes every byte once before copying its rows (docs/PERFORMANCE.md, data pipeline).
fn hash_streamed(bytes: &[u8]) -> u128 {
    let mut h = Xxh3::new();
    for (i, chunk) in bytes.chunks(HASH_STEP).enumerate() {
        #[cfg(target_arch = "x86_64")]
        {
            let ahead = i * HASH_STEP + HASH_AHEAD;
            if let Some(next) = bytes.get(ahead..(ahead + HASH_STEP).min(bytes.len())) {
                prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T1 }>(next);
            }
        }
        h.update(chunk);
    }
    h.digest128()
}

/// Prefetches every 64-byte line of `bytes` with the hint `HINT` (`_MM_HINT_T0`: into L1,
/// `_MM_HINT_T1`: into L2).
#[cfg(target_arch = "x86_64")]
fn prefetch_lines<const HINT: i32>(bytes: &[u8]) {
    for line in bytes.chunks(64) {
        // SAFETY: prefetch is a hint on a valid address of a live mapping; it never faults.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(line.as_ptr().cast()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_streamed_hash_is_xxh3_128() {
        let bytes: Vec<u8> = (0..3 * HASH_AHEAD + 17)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        for len in [
            0,
            1,
            255,
            HASH_STEP - 1,
            HASH_STEP,
            HASH_STEP + 1,
            HASH_AHEAD + 5,
            bytes.len(),
        ] {
            assert_eq!(
                hash_streamed(&bytes[..len]),
                xxhash_rust::xxh3::xxh3_128(&bytes[..len]),
                "length {len}"
            );
        }
    }
}
