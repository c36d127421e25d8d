//! The byte tokenizer: ids 0..=255 are the UTF-8 bytes of the text, 256 is end-of-text.

use super::{EOT_TEXT, Tokenizer};
use crate::error::{DataError, Result};

/// One id per byte of UTF-8, plus end-of-text (256). Vocabulary 257.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Name accepted by `TokenizerKind::from_str`.
    pub const NAME: &'static str = "byte";
    /// The end-of-text id.
    pub const EOT: u32 = 256;
    /// Vocabulary size: 256 bytes plus end-of-text.
    pub const VOCAB: usize = 257;
}

impl Tokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        // Bytes accumulate until an end-of-text id, so a character split across ids survives.
        let mut out = String::with_capacity(ids.len());
        let mut bytes = Vec::with_capacity(ids.len());
        for &id in ids {
            match u8::try_from(id) {
                Ok(b) => bytes.push(b),
                Err(_) if id == Self::EOT => {
                    out.push_str(&String::from_utf8_lossy(&bytes));
                    bytes.clear();
                    out.push_str(EOT_TEXT);
                }
                Err(_) => {
                    return Err(DataError::UnknownToken {
                        id,
                        tokenizer: Self::NAME,
                        vocab: Self::VOCAB,
                    });
                }
            }
        }
        out.push_str(&String::from_utf8_lossy(&bytes));
        Ok(out)
    }

    fn vocab_size(&self) -> usize {
        Self::VOCAB
    }

    fn eot(&self) -> Option<u32> {
        Some(Self::EOT)
    }

    fn name(&self) -> &'static str {
        Self::NAME
    }
}
