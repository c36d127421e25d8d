//! Hugging Face `tokenizer.json` files (feature `hf-tokenizer`), with a hand-written one.

use data::prepare::TextDocs;
use data::{DataError, Dataset, HfTokenizer, Tokenizer, TokenizerSpec};

use super::{config, read_docs, run, write};

/// A word-level tokenizer: whitespace and punctuation split, unknown words to `<unk>` (0).
const TOKENIZER_JSON: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 1, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null,
  "decoder": null,
  "model": {
    "type": "WordLevel",
    "vocab": {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3, "again": 4},
    "unk_token": "<unk>"
  }
}"#;

#[test]
fn a_tokenizer_json_loads_encodes_and_names_itself_by_hash() {
    let tok = HfTokenizer::from_bytes(TOKENIZER_JSON.as_bytes(), None).unwrap();
    assert_eq!(
        (tok.vocab_size(), tok.eot()),
        (5, Some(1)),
        "</s> is the default EOT"
    );
    assert!(
        tok.name().starts_with("hf:") && tok.name().len() == 19,
        "{}",
        tok.name()
    );
    assert_eq!(tok.encode("hello world again"), [2, 3, 4]);
    // A special token's spelling in the text is ordinary text, never the EOT id.
    assert!(!tok.try_encode("hello </s> world").unwrap().contains(&1));
    assert_eq!(tok.decode(&[2, 3]).unwrap(), "hello world");
    assert!(matches!(
        tok.decode(&[9]),
        Err(DataError::UnknownToken { id: 9, .. })
    ));

    let with_eot = HfTokenizer::from_bytes(TOKENIZER_JSON.as_bytes(), Some("<unk>")).unwrap();
    assert_eq!(with_eot.eot(), Some(0));
    let err = HfTokenizer::from_bytes(TOKENIZER_JSON.as_bytes(), Some("<eos>")).unwrap_err();
    assert!(
        err.to_string()
            .contains("\"<eos>\" is not in the vocabulary"),
        "{err}"
    );
    let err = HfTokenizer::from_bytes(b"{\"model\": 1}", None).unwrap_err();
    assert!(matches!(err, DataError::TokenizerFailed { .. }), "{err:?}");
}

#[test]
fn prepare_with_a_tokenizer_json() {
    let tmp = tempfile::tempdir().unwrap();
    let json = write(&tmp.path().join("tok/tokenizer.json"), TOKENIZER_JSON);
    let spec: TokenizerSpec = json.to_str().unwrap().parse().unwrap();
    assert_eq!(spec, TokenizerSpec::File(json.clone()));
    let tok = spec.build(None).unwrap();
    let input = write(&tmp.path().join("a.txt"), "hello world\nagain\nhello\n");
    let out = tmp.path().join("ds");
    let mut cfg = config(&[&input], &out);
    cfg.text_docs = TextDocs::Line;
    cfg.shard_bytes = 4;
    let tok_ref: &(dyn Tokenizer + Sync) = tok.as_ref();
    let s = run(&cfg, tok_ref).unwrap();
    assert_eq!(read_docs(&out), [vec![2, 3, 1], vec![4, 1], vec![2, 1]]);
    assert_eq!(s.shards, 3, "each document reaches the 4-byte target");
    let m = Dataset::open(&out).unwrap().manifest().clone();
    assert_eq!(
        (m.tokenizer.as_str(), m.vocab_size, m.eot),
        (tok.name(), 5, Some(1))
    );
}
