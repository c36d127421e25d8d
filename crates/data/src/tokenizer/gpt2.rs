//! GPT-2's byte-level BPE (`r50k_base`) through the `tiktoken-rs` crate.

use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

use super::Tokenizer;
use crate::error::{DataError, Result};

/// The tables, built on first use and shared by every [`Gpt2Tokenizer`] in the process.
///
/// Building them parses 50k base64 merges and compiles the split regex: 25-40 ms measured in an
/// optimised build, plus several MB of tables, not worth repeating per tokenizer. (tiktoken-rs's
/// own `r50k_base_singleton` panics if building fails; this keeps the failure as an error.)
static R50K: OnceLock<std::result::Result<CoreBPE, String>> = OnceLock::new();

/// GPT-2's tokenizer: 50 000 BPE merges over 256 byte tokens plus end-of-text (50256).
#[derive(Clone, Copy)]
pub struct Gpt2Tokenizer {
    pub(super) bpe: &'static CoreBPE,
}

impl Gpt2Tokenizer {
    /// Name accepted by `TokenizerKind::from_str`.
    pub const NAME: &'static str = "gpt2";
    /// The end-of-text id (`<|endoftext|>`).
    pub const EOT: u32 = 50256;
    /// Vocabulary size.
    pub const VOCAB: usize = 50257;

    /// Returns the tokenizer, building the shared tables on the first call.
    ///
    /// # Errors
    /// [`DataError::TokenizerInit`] if the embedded tables fail to load (then on every call).
    pub fn new() -> Result<Self> {
        match R50K.get_or_init(|| tiktoken_rs::r50k_base().map_err(|e| format!("{e:#}"))) {
            Ok(bpe) => Ok(Gpt2Tokenizer { bpe }),
            Err(reason) => Err(DataError::TokenizerInit {
                tokenizer: Self::NAME,
                reason: reason.clone(),
            }),
        }
    }
}

impl std::fmt::Debug for Gpt2Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gpt2Tokenizer(r50k_base)")
    }
}

impl Tokenizer for Gpt2Tokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        decode(self.bpe, ids)
    }

    /// Fresh tables for the thread (25-40 ms, a few MB): every clone of a `CoreBPE` shares
    /// one regex program and its scratch pool, so only a new build gives a thread its own.
    fn for_thread(&self) -> Result<Option<Box<dyn Tokenizer + Send + Sync>>> {
        let bpe = tiktoken_rs::r50k_base().map_err(|e| DataError::TokenizerInit {
            tokenizer: Self::NAME,
            reason: format!("{e:#}"),
        })?;
        Ok(Some(Box::new(ThreadGpt2 { bpe })))
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

fn decode(bpe: &CoreBPE, ids: &[u32]) -> Result<String> {
    let bytes = bpe.decode_bytes(ids).map_err(|e| DataError::UnknownToken {
        id: e.token,
        tokenizer: Gpt2Tokenizer::NAME,
        vocab: Gpt2Tokenizer::VOCAB,
    })?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// GPT-2 with tables of its own, for one worker thread ([`Tokenizer::for_thread`]).
struct ThreadGpt2 {
    bpe: CoreBPE,
}

impl Tokenizer for ThreadGpt2 {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        decode(&self.bpe, ids)
    }

    fn vocab_size(&self) -> usize {
        Gpt2Tokenizer::VOCAB
    }

    fn eot(&self) -> Option<u32> {
        Some(Gpt2Tokenizer::EOT)
    }

    fn name(&self) -> &str {
        Gpt2Tokenizer::NAME
    }
}
