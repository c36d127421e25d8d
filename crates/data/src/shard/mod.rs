//! The binary token shard: one file of whole documents' token ids, mapped read-only.
//!
//! Layout, version 1 (all integers little-endian; the seeds' running-example shard, 000 L759,
//! with a document index and a checksum added):
//!
//! ```text
//! [0, 64)            header
//!    0..8   magic  "FLTSHARD"
//!    8..12  version u32 = 1
//!   12..16  bytes per token u32: 2 (u16 ids, vocab <= 65536) or 4 (u32 ids)
//!   16..24  token count u64
//!   24..32  document count u64
//!   32..36  vocabulary size u32
//!   36..40  zero
//!   40..64  tokenizer name, UTF-8, NUL-padded
//! [64, 64 + tokens*width)            the token ids, every document's ids back to back
//! zero padding to a multiple of 8
//! (documents + 1) x u64              document index: offsets in tokens, 0 first, token count last
//! last 24 bytes                      footer: checksum (16 bytes) then "FLTSEND\0"
//! ```
//!
//! The checksum is `xxh3_128(header ++ xxh3_128(body))`, where the body is every byte between the
//! header and the footer: it covers every byte of the file, and lets the writer stream the body
//! before it knows the counts that go in the header. The expected file length follows from the
//! header alone, so truncation is caught by one `stat` before anything is hashed.

mod fault;
mod reader;
mod writer;

pub use reader::{Shard, ShardInfo};
pub use writer::ShardWriter;

/// First eight bytes of every shard.
pub const MAGIC: &[u8; 8] = b"FLTSHARD";
/// Last eight bytes of every shard.
pub const END_MAGIC: &[u8; 8] = b"FLTSEND\0";
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;
/// Header length in bytes.
pub const HEADER_LEN: u64 = 64;
/// Footer length in bytes: the 16-byte checksum and [`END_MAGIC`].
pub const FOOTER_LEN: u64 = 24;
/// Longest tokenizer name the header holds.
pub const MAX_TOKENIZER_NAME: usize = 24;
/// File extension of shards.
pub const EXTENSION: &str = "fts";

/// Bytes per token id for a vocabulary: 2 when every id fits a `u16`, else 4.
pub fn token_width(vocab: u32) -> u32 {
    if vocab <= 1 << 16 { 2 } else { 4 }
}

/// Byte offset of the document index, given the token count and width; `None` on overflow.
fn index_offset(tokens: u64, width: u32) -> Option<u64> {
    let end = HEADER_LEN.checked_add(tokens.checked_mul(u64::from(width))?)?;
    end.checked_next_multiple_of(8)
}

/// Total file length implied by a header; `None` when the counts overflow a `u64`.
pub fn file_len(tokens: u64, docs: u64, width: u32) -> Option<u64> {
    let index_bytes = docs.checked_add(1)?.checked_mul(8)?;
    index_offset(tokens, width)?
        .checked_add(index_bytes)?
        .checked_add(FOOTER_LEN)
}

/// The whole-file checksum from the header bytes and the body's hash.
fn combine(header: &[u8], body_hash: u128) -> u128 {
    let mut buf = [0u8; HEADER_LEN as usize + 16];
    buf[..HEADER_LEN as usize].copy_from_slice(header);
    buf[HEADER_LEN as usize..].copy_from_slice(&body_hash.to_le_bytes());
    xxhash_rust::xxh3::xxh3_128(&buf)
}

/// A checksum as the 32 hex digits the manifest stores.
pub fn hex128(hash: u128) -> String {
    format!("{hash:032x}")
}

/// The header's fields.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Header {
    width: u32,
    tokens: u64,
    docs: u64,
    vocab: u32,
    tokenizer: String,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_LEN as usize] {
        let mut h = [0u8; HEADER_LEN as usize];
        h[0..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&self.width.to_le_bytes());
        h[16..24].copy_from_slice(&self.tokens.to_le_bytes());
        h[24..32].copy_from_slice(&self.docs.to_le_bytes());
        h[32..36].copy_from_slice(&self.vocab.to_le_bytes());
        let name = self.tokenizer.as_bytes();
        h[40..40 + name.len()].copy_from_slice(name);
        h
    }

    /// Parses and checks a header; the error string names the field.
    fn decode(h: &[u8]) -> Result<Header, String> {
        if h.len() < HEADER_LEN as usize {
            return Err(format!(
                "file is {} bytes, shorter than the {HEADER_LEN}-byte header",
                h.len()
            ));
        }
        if &h[0..8] != MAGIC {
            return Err(format!(
                "not a Flotilla token shard: first bytes are {:?}, expected {:?}",
                String::from_utf8_lossy(&h[0..8]),
                String::from_utf8_lossy(MAGIC)
            ));
        }
        let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap());
        let version = u32_at(8);
        if version != VERSION {
            return Err(format!(
                "format version {version}, this build reads {VERSION}"
            ));
        }
        let width = u32_at(12);
        if width != 2 && width != 4 {
            return Err(format!("bytes per token is {width}, expected 2 or 4"));
        }
        let vocab = u32_at(32);
        if vocab == 0 || token_width(vocab) > width {
            return Err(format!(
                "vocabulary size {vocab} does not fit {width}-byte token ids"
            ));
        }
        let name = &h[40..64];
        let len = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        let tokenizer = std::str::from_utf8(&name[..len])
            .map_err(|_| "tokenizer name is not UTF-8".to_string())?
            .to_string();
        Ok(Header {
            width,
            tokens: u64_at(16),
            docs: u64_at(24),
            vocab,
            tokenizer,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrips() {
        let h = Header {
            width: 2,
            tokens: 7,
            docs: 2,
            vocab: 257,
            tokenizer: "byte".into(),
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn lengths() {
        assert_eq!(token_width(65536), 2);
        assert_eq!(token_width(65537), 4);
        // 64 + 3*2 = 70 -> 72, + 2*8 index, + 24 footer.
        assert_eq!(file_len(3, 1, 2), Some(72 + 16 + 24));
        assert_eq!(file_len(u64::MAX, 1, 4), None);
    }
}
