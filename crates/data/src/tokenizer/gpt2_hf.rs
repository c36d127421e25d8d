//! GPT-2's tokenizer (`r50k_base`) as Hugging Face tokenizer files, so that an export of a
//! model trained with it loads with `AutoTokenizer.from_pretrained`.
//!
//! tiktoken keeps only each token's bytes and rank (its id); a BPE file lists merges. The
//! merge that made token `r` is found by running BPE on its bytes with the tokens ranked
//! below `r`: it ends in exactly two parts, the merge's pair, and merges are listed in rank
//! order, which is their priority.
use std::collections::HashMap;
use std::ops::Range;

use serde_json::{Map, json};

use super::Gpt2Tokenizer;
use super::byte_hf::{byte_level_bpe_files, byte_level_text};
use crate::error::{DataError, Result};

/// The two parts BPE with the tokens ranked below `below` leaves of `token`, if two.
fn last_merge<'a>(
    token: &'a [u8],
    below: u32,
    rank: &HashMap<&[u8], u32>,
) -> Option<(&'a [u8], &'a [u8])> {
    let mut parts: Vec<Range<usize>> = (0..token.len()).map(|i| i..i + 1).collect();
    loop {
        let best = (0..parts.len().saturating_sub(1))
            .filter_map(|i| {
                let r = *rank.get(&token[parts[i].start..parts[i + 1].end])?;
                (r < below).then_some((r, i))
            })
            .min();
        let Some((_, i)) = best else { break };
        parts[i].end = parts[i + 1].end;
        parts.remove(i + 1);
    }
    match parts.as_slice() {
        [a, b] => Some((&token[a.clone()], &token[b.clone()])),
        _ => None,
    }
}

impl Gpt2Tokenizer {
    /// `tokenizer.json` and `tokenizer_config.json` of a Hugging Face fast tokenizer that
    /// encodes exactly as this one: GPT-2's byte-level BPE (50 000 merges, ids as GPT-2's) and
    /// `<|endoftext|>` as the special token 50256.
    ///
    /// # Errors
    /// [`DataError::TokenizerInit`] if a token's bytes cannot be read or a token is not the
    /// merge of two lower-ranked ones (not the case for `r50k_base`).
    pub fn hf_files(&self) -> Result<[(&'static str, String); 2]> {
        let failed = |reason: String| DataError::TokenizerInit {
            tokenizer: Self::NAME,
            reason,
        };
        let tokens = (0..Self::EOT)
            .map(|id| {
                self.bpe
                    .decode_bytes(&[id])
                    .map_err(|e| failed(format!("token {id}: {e}")))
            })
            .collect::<Result<Vec<Vec<u8>>>>()?;
        let rank: HashMap<&[u8], u32> = (0u32..).zip(&tokens).map(|(r, t)| (&t[..], r)).collect();
        let mut vocab = Map::new();
        let mut merges = Vec::new();
        for (id, t) in (0u32..).zip(&tokens) {
            vocab.insert(byte_level_text(t), json!(id));
            if t.len() < 2 {
                continue;
            }
            let (a, b) = last_merge(t, id, &rank)
                .ok_or_else(|| failed(format!("token {id} is not a merge of lower ranks")))?;
            merges.push(format!("{} {}", byte_level_text(a), byte_level_text(b)));
        }
        Ok(byte_level_bpe_files(vocab, merges, Self::EOT))
    }
}

#[cfg(test)]
mod tests {
    use crate::{Gpt2Tokenizer, HfTokenizer, Tokenizer};

    #[test]
    fn the_gpt2_tokenizer_json_encodes_and_decodes_as_tiktoken() {
        let gpt2 = Gpt2Tokenizer::new().unwrap();
        let [(name, json), (config, _)] = gpt2.hf_files().unwrap();
        assert_eq!((name, config), ("tokenizer.json", "tokenizer_config.json"));
        let hf = HfTokenizer::from_bytes(json.as_bytes(), None).unwrap();
        assert_eq!(hf.vocab_size(), Gpt2Tokenizer::VOCAB);
        assert_eq!(hf.eot(), Some(Gpt2Tokenizer::EOT));
        for text in [
            "The quick brown fox jumps over the lazy dog.",
            "I'm sure they'll say it's 12345 dollars, isn't it?",
            "   leading spaces\n\n\ttabs and\r\nnewlines   ",
            "héllo wörld ✓ 日本語 🚀 naïve café",
            "<|endoftext|> is text here",
            "def f(x):\n    return x**2 + 0.5 # comment",
        ] {
            let ids = gpt2.encode(text);
            assert_eq!(hf.try_encode(text).unwrap(), ids, "{text:?}");
            assert_eq!(hf.decode(&ids).unwrap(), text, "{text:?}");
        }
    }
}
