//! Tokenizers: text to token ids and back.
//!
//! Two are built in: [`ByteTokenizer`] (one id per UTF-8 byte plus end-of-text, vocabulary 257)
//! and [`Gpt2Tokenizer`] (GPT-2's byte-level BPE, `r50k_base`, vocabulary 50257). Pick one by
//! name with [`TokenizerKind`]. [`HfTokenizer`] loads a Hugging Face `tokenizer.json`; [`TokenizerSpec`] names any of them (`byte`, `gpt2` or a file path).

mod byte;
mod byte_hf;
mod gpt2;
mod gpt2_hf;
mod hf;
mod spec;

use std::fmt;
use std::str::FromStr;

pub use byte::ByteTokenizer;
pub use gpt2::Gpt2Tokenizer;
pub use hf::HfTokenizer;
pub use spec::TokenizerSpec;

use crate::error::{DataError, Result};

/// Text written for an end-of-text id by both built-in tokenizers' `decode`.
pub const EOT_TEXT: &str = "<|endoftext|>";

/// Converts text to token ids and back.
pub trait Tokenizer {
    /// Encodes `text` as ordinary text: special-token spellings such as `<|endoftext|>` in the
    /// input are encoded like any other characters, never as the end-of-text id.
    fn encode(&self, text: &str) -> Vec<u32>;

    /// Encodes `text` like [`Tokenizer::encode`], reporting a failure instead of hiding it.
    /// The built-in tokenizers never fail; a loaded one (Hugging Face `tokenizer.json`) can.
    ///
    /// # Errors
    /// [`DataError::TokenizerFailed`] with the tokenizer's reason.
    fn try_encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encode(text))
    }

    /// Decodes `ids` to text. Byte sequences that are not valid UTF-8 (a multi-byte character
    /// split across ids, or a stray byte) are replaced by U+FFFD rather than failing.
    ///
    /// # Errors
    /// [`DataError::UnknownToken`] naming the first id outside the vocabulary.
    fn decode(&self, ids: &[u32]) -> Result<String>;

    /// Number of ids; every id produced by `encode` is below it.
    fn vocab_size(&self) -> usize;

    /// The end-of-text id, if the tokenizer has one.
    fn eot(&self) -> Option<u32>;

    /// A tokenizer for one more worker thread, encoding exactly as `self` does, or `None` when
    /// threads may simply share `self`. GPT-2's returns its own tables: its regex keeps a
    /// scratch pool that threads sharing one instance contend on (measured: two threads
    /// sharing it did the work of one).
    ///
    /// # Errors
    /// As the tokenizer's constructor.
    fn for_thread(&self) -> Result<Option<Box<dyn Tokenizer + Send + Sync>>> {
        Ok(None)
    }

    /// Short name, as recorded in shard headers and manifests: a [`TokenizerKind`] name, or
    /// `hf:<16 hex digits>` for a loaded `tokenizer.json`.
    fn name(&self) -> &str;
}

/// The built-in tokenizers, selectable by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenizerKind {
    /// [`ByteTokenizer`]: `"byte"`.
    Byte,
    /// [`Gpt2Tokenizer`]: `"gpt2"`.
    Gpt2,
}

impl TokenizerKind {
    /// Every kind, in the order their names are listed in errors.
    pub const ALL: [TokenizerKind; 2] = [TokenizerKind::Byte, TokenizerKind::Gpt2];

    /// The name `FromStr` accepts for this kind.
    pub const fn name(self) -> &'static str {
        match self {
            TokenizerKind::Byte => ByteTokenizer::NAME,
            TokenizerKind::Gpt2 => Gpt2Tokenizer::NAME,
        }
    }

    /// Vocabulary size of this kind, known without building it.
    pub const fn vocab_size(self) -> usize {
        match self {
            TokenizerKind::Byte => ByteTokenizer::VOCAB,
            TokenizerKind::Gpt2 => Gpt2Tokenizer::VOCAB,
        }
    }

    /// The Hugging Face fast tokenizer files (`tokenizer.json`, `tokenizer_config.json`) that
    /// encode exactly as this kind, for an export that `AutoTokenizer` loads.
    ///
    /// # Errors
    /// As [`TokenizerKind::build`], and GPT-2's conversion ([`Gpt2Tokenizer::hf_files`]).
    pub fn hf_files(self) -> Result<[(&'static str, String); 2]> {
        match self {
            TokenizerKind::Byte => Ok(ByteTokenizer::hf_files()),
            TokenizerKind::Gpt2 => Gpt2Tokenizer::new()?.hf_files(),
        }
    }

    /// Builds the tokenizer. GPT-2's tables are built once per process and shared.
    ///
    /// # Errors
    /// [`DataError::TokenizerInit`] if GPT-2's embedded tables fail to load.
    pub fn build(self) -> Result<Box<dyn Tokenizer + Send + Sync>> {
        Ok(match self {
            TokenizerKind::Byte => Box::new(ByteTokenizer),
            TokenizerKind::Gpt2 => Box::new(Gpt2Tokenizer::new()?),
        })
    }
}

impl fmt::Display for TokenizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses a kind's name, ignoring case and surrounding whitespace.
impl FromStr for TokenizerKind {
    type Err = DataError;

    fn from_str(s: &str) -> Result<Self> {
        let wanted = s.trim();
        TokenizerKind::ALL
            .into_iter()
            .find(|kind| kind.name().eq_ignore_ascii_case(wanted))
            .ok_or_else(|| DataError::UnknownTokenizer {
                name: s.to_string(),
                accepted: TokenizerKind::ALL.map(TokenizerKind::name).join(", "),
            })
    }
}
