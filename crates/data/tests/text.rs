//! Loading text files into one token stream.

use std::path::PathBuf;

use data::{ByteTokenizer, DataError, Gpt2Tokenizer, Tokenizer, load_tokens, load_tokens_capped};

/// A fresh scratch directory for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flotilla-data-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn files_are_joined_with_eot() {
    let dir = scratch("join");
    let (a, b) = (dir.join("a.txt"), dir.join("b.txt"));
    std::fs::write(&a, "ab").unwrap();
    std::fs::write(&b, "c").unwrap();
    assert_eq!(
        load_tokens(&[&a, &b], &ByteTokenizer).unwrap(),
        vec![97, 98, 256, 99]
    );
    assert_eq!(load_tokens(&[&a], &ByteTokenizer).unwrap(), vec![97, 98]);

    let gpt2 = Gpt2Tokenizer::new().unwrap();
    std::fs::write(&a, "Hello world").unwrap();
    let ids = load_tokens(&[&a, &a], &gpt2).unwrap();
    assert_eq!(ids, vec![15496, 995, 50256, 15496, 995]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn invalid_utf8_is_read_lossily() {
    let dir = scratch("lossy");
    let p = dir.join("bad.txt");
    std::fs::write(&p, b"a\xFFb").unwrap();
    let ids = load_tokens(&[&p], &ByteTokenizer).unwrap();
    assert_eq!(ByteTokenizer.decode(&ids).unwrap(), "a\u{FFFD}b");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn missing_file_error_names_path() {
    let dir = scratch("missing");
    let p = dir.join("nope.txt");
    let err = load_tokens(&[&p], &ByteTokenizer).unwrap_err();
    assert!(
        matches!(&err, DataError::Io { path, .. } if *path == p),
        "{err}"
    );
    assert!(err.to_string().contains("nope.txt"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn empty_input_is_an_error() {
    let dir = scratch("empty");
    let p = dir.join("empty.txt");
    std::fs::write(&p, "").unwrap();
    let err = load_tokens(&[&p], &ByteTokenizer).unwrap_err();
    assert!(
        matches!(&err, DataError::EmptyInput { paths } if paths == std::slice::from_ref(&p)),
        "{err}"
    );
    assert!(err.to_string().contains("empty.txt"), "{err}");
    let none: [&std::path::Path; 0] = [];
    assert!(matches!(
        load_tokens(&none, &ByteTokenizer),
        Err(DataError::NoInputFiles)
    ));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn oversized_file_is_refused() {
    let dir = scratch("cap");
    let p = dir.join("big.txt");
    std::fs::write(&p, "0123456789").unwrap();
    assert_eq!(
        load_tokens_capped(&[&p], &ByteTokenizer, 10).unwrap().len(),
        10
    );
    let err = load_tokens_capped(&[&p], &ByteTokenizer, 9).unwrap_err();
    assert!(
        matches!(
            &err,
            DataError::FileTooLarge {
                size: 10,
                cap: 9,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("big.txt"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn works_through_a_trait_object() {
    let dir = scratch("dyn");
    let p = dir.join("t.txt");
    std::fs::write(&p, "xy").unwrap();
    let tok = data::TokenizerKind::Byte.build().unwrap();
    assert_eq!(load_tokens(&[&p], tok.as_ref()).unwrap(), vec![120, 121]);
    std::fs::remove_dir_all(dir).unwrap();
}
