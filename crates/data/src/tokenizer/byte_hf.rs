//! The byte tokenizer as Hugging Face tokenizer files, so that an export of a model trained
//! with it loads with `AutoTokenizer.from_pretrained`.

use serde_json::{Map, Value, json};

use super::{ByteTokenizer, EOT_TEXT};

/// GPT-2's byte-level alphabet: the character `ByteLevel` pre-tokenization writes for each
/// byte (printable Latin-1 bytes stand for themselves, the others are shifted past 255).
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return char::from(b);
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shifted).unwrap_or(char::REPLACEMENT_CHARACTER)
}

impl ByteTokenizer {
    /// `tokenizer.json` and `tokenizer_config.json` of a Hugging Face fast tokenizer that
    /// encodes exactly as this one: a byte-level BPE without merges whose id for each byte is
    /// the byte, and `<|endoftext|>` as the special token 256 (its end-of-text and padding).
    pub fn hf_files() -> [(&'static str, String); 2] {
        let vocab: Map<String, Value> = (0..=255u8)
            .map(|b| (byte_char(b).to_string(), json!(b)))
            .collect();
        byte_level_bpe_files(vocab, Vec::new(), ByteTokenizer::EOT)
    }
}

/// The text of `bytes` in the byte-level alphabet ([`byte_char`]), as a BPE vocabulary or
/// merge spells it.
pub(super) fn byte_level_text(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_char(b)).collect()
}

/// `tokenizer.json` and `tokenizer_config.json` of a GPT-2-style byte-level BPE: `vocab`
/// (byte-level text to id), `merges` (`"a b"`, by priority), `<|endoftext|>` as special
/// token `eot` (also beginning of text and padding), no normalizer or post-processor.
pub(super) fn byte_level_bpe_files(
    vocab: Map<String, Value>,
    merges: Vec<String>,
    eot: u32,
) -> [(&'static str, String); 2] {
    let byte_level = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{
            "id": eot, "content": EOT_TEXT, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true
        }],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges
        }
    });
    let config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT_TEXT,
        "eos_token": EOT_TEXT,
        "pad_token": EOT_TEXT,
        "model_max_length": 1_000_000_000_000_000_000u64,
        "clean_up_tokenization_spaces": false
    });
    [
        ("tokenizer.json", format!("{tokenizer:#}\n")),
        ("tokenizer_config.json", format!("{config:#}\n")),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HfTokenizer, Tokenizer};

    #[test]
    fn the_byte_tokenizer_json_encodes_and_decodes_as_the_byte_tokenizer() {
        let [(name, json), _] = ByteTokenizer::hf_files();
        assert_eq!(name, "tokenizer.json");
        let hf = HfTokenizer::from_bytes(json.as_bytes(), None).unwrap();
        assert_eq!(hf.vocab_size(), ByteTokenizer::VOCAB);
        assert_eq!(hf.eot(), Some(ByteTokenizer::EOT));
        let all: String = (0..=255u8).map(char::from).collect();
        for text in [
            "The dog ran.",
            "  two  spaces\n\ttab\r\n",
            "héllo wörld ✓ 日本語",
            "<|endoftext|> is text here",
            all.as_str(),
        ] {
            let ids = ByteTokenizer.encode(text);
            assert_eq!(hf.try_encode(text).unwrap(), ids, "{text:?}");
            assert_eq!(hf.decode(&ids).unwrap(), text, "{text:?}");
        }
        // Every byte has its own character.
        let chars: std::collections::HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(chars.len(), 256);
    }
}
