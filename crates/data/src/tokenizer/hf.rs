//! A Hugging Face `tokenizer.json`, loaded through the `tokenizers` crate.

use std::path::Path;

use sha2::{Digest, Sha256};

use super::Tokenizer;
use crate::error::{DataError, Result};
use crate::fsread::read_bounded;

/// A tokenizer loaded from a Hugging Face `tokenizer.json`.
///
/// Its name is `hf:` plus the first 16 hex digits of the SHA-256 of the file's bytes, so shards
/// and manifests record exactly which file produced them (it fits a shard header's 24 bytes).
/// Special-token spellings in the input are encoded as ordinary text, as the [`Tokenizer`]
/// trait requires, so a document containing `</s>` does not gain a stray end-of-text id.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    name: String,
    vocab: usize,
    eot: Option<u32>,
}

impl HfTokenizer {
    /// Largest `tokenizer.json` read (real ones are a few MB), so a wrong path cannot exhaust
    /// memory.
    pub const MAX_JSON_BYTES: u64 = 256 << 20;

    /// End-of-text spellings tried, in order, when no end-of-text token is named.
    pub const EOT_CANDIDATES: [&'static str; 3] = ["<|endoftext|>", "</s>", "<eos>"];

    /// Name prefix: `hf:` then the first 16 hex digits of the file's SHA-256.
    pub const NAME_PREFIX: &'static str = "hf:";

    /// Loads `path`. `eot` names the end-of-text token; when `None`, the first of
    /// [`HfTokenizer::EOT_CANDIDATES`] in the vocabulary is used, and none is fine (no id is
    /// appended then).
    ///
    /// # Errors
    /// [`DataError::Io`] if the file cannot be read, [`DataError::NotAFile`] if it is not a
    /// regular file, [`DataError::FileTooLarge`] over
    /// [`HfTokenizer::MAX_JSON_BYTES`], and as [`HfTokenizer::from_bytes`].
    pub fn from_file(path: &Path, eot: Option<&str>) -> Result<Self> {
        let bytes = read_bounded(path, Self::MAX_JSON_BYTES)?;
        Self::from_bytes(&bytes, eot).map_err(|e| match e {
            DataError::TokenizerFailed { reason, .. } => DataError::TokenizerFailed {
                tokenizer: path.display().to_string(),
                reason,
            },
            other => other,
        })
    }

    /// Loads a tokenizer from the bytes of a `tokenizer.json`.
    ///
    /// # Errors
    /// [`DataError::TokenizerFailed`] if the JSON does not describe a tokenizer this build can
    /// load, if `eot` is given but is not a token, or if the vocabulary is empty or exceeds
    /// `u32` ids.
    pub fn from_bytes(bytes: &[u8], eot: Option<&str>) -> Result<Self> {
        let digest = Sha256::digest(bytes);
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        let name = format!("{}{hex}", Self::NAME_PREFIX);
        let failed = |reason: String| DataError::TokenizerFailed {
            tokenizer: name.clone(),
            reason,
        };
        let mut inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| failed(format!("not a loadable tokenizer.json: {e}")))?;
        inner.set_encode_special_tokens(true);
        // Ids may be sparse: the vocabulary must cover the largest id, not just count entries.
        let max_id = inner.get_vocab(true).into_values().max();
        let vocab = match max_id {
            Some(id) if id < u32::MAX => (id as usize + 1).max(inner.get_vocab_size(true)),
            Some(id) => return Err(failed(format!("token id {id} does not fit below u32::MAX"))),
            None => return Err(failed("the vocabulary is empty".into())),
        };
        let eot = match eot {
            Some(token) => Some(inner.token_to_id(token).ok_or_else(|| {
                failed(format!(
                    "end-of-text token {token:?} is not in the vocabulary"
                ))
            })?),
            None => Self::EOT_CANDIDATES
                .iter()
                .find_map(|t| inner.token_to_id(t)),
        };
        Ok(HfTokenizer {
            inner,
            name,
            vocab,
            eot,
        })
    }
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HfTokenizer({}, vocab {})", self.name, self.vocab)
    }
}

impl Tokenizer for HfTokenizer {
    /// Encodes `text`; if the tokenizer fails on it, returns no ids (use
    /// [`Tokenizer::try_encode`] to see the error, as `prepare` does).
    fn encode(&self, text: &str) -> Vec<u32> {
        self.try_encode(text).unwrap_or_default()
    }

    fn try_encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding =
            self.inner
                .encode_fast(text, false)
                .map_err(|e| DataError::TokenizerFailed {
                    tokenizer: self.name.clone(),
                    reason: format!("encoding failed: {e}"),
                })?;
        Ok(encoding.get_ids().to_vec())
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab) {
            return Err(DataError::UnknownToken {
                id,
                tokenizer: "hf",
                vocab: self.vocab,
            });
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| DataError::TokenizerFailed {
                tokenizer: self.name.clone(),
                reason: format!("decoding failed: {e}"),
            })
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn eot(&self) -> Option<u32> {
        self.eot
    }

    fn name(&self) -> &str {
        &self.name
    }
}
