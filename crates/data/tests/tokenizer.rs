//! Tokenizer round trips, known GPT-2 ids and error cases.

use data::{ByteTokenizer, DataError, Gpt2Tokenizer, Tokenizer, TokenizerKind};

const SAMPLES: &[&str] = &[
    "Hello world",
    "",
    "The quick brown fox jumps over the lazy dog.\n\tTabs and  double  spaces.",
    "Grüße aus Köln — naïve café, 東京, Ελληνικά, emoji 🚀🦀!",
    "<|endoftext|> is ordinary text when encoded",
];

#[test]
fn byte_round_trips_and_ids_are_bytes() {
    let tok = ByteTokenizer;
    for text in SAMPLES {
        let ids = tok.encode(text);
        assert_eq!(ids.len(), text.len());
        assert!(ids.iter().all(|&id| id < 256));
        assert_eq!(tok.decode(&ids).unwrap(), *text);
    }
    assert_eq!(tok.encode("Hi"), vec![72, 105]);
    assert_eq!(
        (tok.vocab_size(), tok.eot(), tok.name()),
        (257, Some(256), "byte")
    );
}

#[test]
fn byte_decode_eot_and_lossy_bytes() {
    let tok = ByteTokenizer;
    assert_eq!(
        tok.decode(&[104, 105, 256, 33]).unwrap(),
        "hi<|endoftext|>!"
    );
    // 0xC3 0xA9 is "é"; a lone 0xC3 or 0xFF is invalid and decodes to U+FFFD, not an error.
    assert_eq!(tok.decode(&[0xC3, 0xA9]).unwrap(), "é");
    assert_eq!(tok.decode(&[0x61, 0xFF, 0x62]).unwrap(), "a\u{FFFD}b");
    assert_eq!(tok.decode(&[0xC3]).unwrap(), "\u{FFFD}");
}

#[test]
fn byte_decode_names_bad_id() {
    let err = ByteTokenizer.decode(&[65, 257, 9999]).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::UnknownToken {
                id: 257,
                vocab: 257,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("257"), "{err}");
}

#[test]
fn gpt2_known_ids() {
    let tok = Gpt2Tokenizer::new().unwrap();
    assert_eq!(tok.encode("Hello world"), vec![15496, 995]);
    assert_eq!(tok.encode(" the"), vec![262]);
    assert_eq!(tok.encode("!"), vec![0]);
    assert_eq!(
        (tok.vocab_size(), tok.eot(), tok.name()),
        (50257, Some(50256), "gpt2")
    );
    assert_eq!(tok.decode(&[50256]).unwrap(), "<|endoftext|>");
    // Special-token spelling in input text is not the end-of-text id.
    assert!(!tok.encode("<|endoftext|>").contains(&50256));
}

#[test]
fn gpt2_round_trips_including_non_ascii() {
    let tok = Gpt2Tokenizer::new().unwrap();
    for text in SAMPLES {
        let ids = tok.encode(text);
        assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
        assert_eq!(tok.decode(&ids).unwrap(), *text);
    }
}

#[test]
fn gpt2_split_character_decodes_lossily() {
    let tok = Gpt2Tokenizer::new().unwrap();
    let ids = tok.encode("🚀");
    assert!(
        ids.len() > 1,
        "expected the emoji to span several byte tokens: {ids:?}"
    );
    let partial = tok.decode(&ids[..1]).unwrap();
    assert!(partial.contains('\u{FFFD}'), "{partial:?}");
}

#[test]
fn gpt2_decode_names_bad_id() {
    let tok = Gpt2Tokenizer::new().unwrap();
    let err = tok.decode(&[15496, 50257, 60000]).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::UnknownToken {
                id: 50257,
                vocab: 50257,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn kind_parses_and_builds() {
    assert_eq!(
        "byte".parse::<TokenizerKind>().unwrap(),
        TokenizerKind::Byte
    );
    assert_eq!(
        " GPT2 ".parse::<TokenizerKind>().unwrap(),
        TokenizerKind::Gpt2
    );
    for kind in TokenizerKind::ALL {
        assert_eq!(kind.to_string().parse::<TokenizerKind>().unwrap(), kind);
        let tok = kind.build().unwrap();
        assert_eq!(tok.name(), kind.name());
        assert_eq!(tok.vocab_size(), kind.vocab_size());
        assert_eq!(tok.decode(&tok.encode("round trip")).unwrap(), "round trip");
    }
}

#[test]
fn kind_error_lists_accepted_names() {
    let err = "bpe".parse::<TokenizerKind>().unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("'bpe'") && msg.contains("byte") && msg.contains("gpt2"),
        "{msg}"
    );
}
