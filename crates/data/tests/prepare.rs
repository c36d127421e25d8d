//! `data::prepare`: inputs to shards and back through `Dataset`.

mod common;

use common::config;
use std::path::{Path, PathBuf};

use data::prepare::{InputFormat, PrepareConfig, TextDocs, parse_byte_size, prepare};
use data::{
    ByteTokenizer, DataError, Dataset, Gpt2Tokenizer, MANIFEST_FILE, PrepareSummary, Tokenizer,
};

/// Runs `prepare` with no progress callback.
fn run(cfg: &PrepareConfig, tok: &(dyn Tokenizer + Sync)) -> data::Result<PrepareSummary> {
    prepare(cfg, tok, &mut |_| {})
}

/// Every document of the dataset in `dir`, in order, as token ids.
fn read_docs(dir: &Path) -> Vec<Vec<u32>> {
    let ds = Dataset::open(dir).unwrap();
    let mut docs = Vec::new();
    for i in 0..ds.num_shards() {
        let shard = ds.shard(i).unwrap();
        for d in 0..shard.info().docs {
            let r = shard.doc_range(d).unwrap();
            let mut ids = vec![0; (r.end - r.start) as usize];
            shard.read_tokens(r.start, &mut ids).unwrap();
            docs.push(ids);
        }
    }
    docs
}

/// The dataset's documents decoded by the byte tokenizer, end-of-text removed.
fn read_texts(dir: &Path) -> Vec<String> {
    read_docs(dir)
        .into_iter()
        .map(|mut ids| {
            assert_eq!(
                ids.pop(),
                Some(ByteTokenizer::EOT),
                "every document ends with EOT"
            );
            ByteTokenizer.decode(&ids).unwrap()
        })
        .collect()
}

fn write(path: &Path, text: &str) -> PathBuf {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::write(path, text).unwrap();
    path.to_path_buf()
}

const TEXT: &str = "first line\nsame doc\r\n\n\nsecond doc\n   \nthird\nlast line";

#[test]
fn text_paragraphs_are_documents_by_default() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(&tmp.path().join("a.txt"), TEXT);
    let out = tmp.path().join("ds");
    let s = run(&config(&[&input], &out), &ByteTokenizer).unwrap();
    let want = ["first line\nsame doc", "second doc", "third\nlast line"];
    assert_eq!(read_texts(&out), want);
    assert_eq!((s.docs, s.shards, s.files), (3, 1, 1));
    assert_eq!(
        s.tokens,
        want.iter().map(|d| d.len() as u64 + 1).sum::<u64>()
    );
    assert_eq!(
        s.text_bytes,
        want.iter().map(|d| d.len() as u64).sum::<u64>()
    );
    assert!(s.manifest.preprocessing.contains("text-docs=paragraph"));
}

#[test]
fn text_lines_and_whole_files_are_documents_when_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(&tmp.path().join("a.md"), TEXT);
    let out = tmp.path().join("lines");
    let mut cfg = config(&[&input], &out);
    cfg.text_docs = TextDocs::Line;
    run(&cfg, &ByteTokenizer).unwrap();
    let want = ["first line", "same doc", "second doc", "third", "last line"];
    assert_eq!(read_texts(&out), want);

    cfg.text_docs = TextDocs::File;
    cfg.output = tmp.path().join("files");
    run(&cfg, &ByteTokenizer).unwrap();
    assert_eq!(read_texts(&cfg.output), [TEXT]);
}

#[test]
fn long_documents_are_cut_at_line_boundaries() {
    let tmp = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..20).map(|i| format!("line number {i:02}")).collect();
    let input = write(&tmp.path().join("long.txt"), &lines.join("\n"));
    let out = tmp.path().join("ds");
    let mut cfg = config(&[&input], &out);
    cfg.text_docs = TextDocs::File;
    cfg.max_doc_bytes = 60; // four 15-byte lines with their newlines
    let s = run(&cfg, &ByteTokenizer).unwrap();
    let docs = read_texts(&out);
    assert_eq!(docs.len(), 5);
    assert_eq!(s.split_docs, 4);
    assert!(docs.iter().all(|d| d.len() <= 60));
    assert_eq!(
        docs.concat(),
        lines.join("\n"),
        "cutting loses and adds nothing"
    );
    assert!(docs[..4].iter().all(|d| d.ends_with('\n')), "{docs:?}");
}

#[test]
fn an_overlong_line_is_cut_at_character_boundaries() {
    let tmp = tempfile::tempdir().unwrap();
    let line = "é".repeat(50); // 100 bytes of two-byte characters
    let input = write(&tmp.path().join("a.txt"), &line);
    let out = tmp.path().join("ds");
    let mut cfg = config(&[&input], &out);
    cfg.text_docs = TextDocs::Line;
    cfg.max_doc_bytes = 33;
    run(&cfg, &ByteTokenizer).unwrap();
    let docs = read_texts(&out);
    assert!(
        docs.len() >= 4 && docs.iter().all(|d| d.len() <= 33),
        "{docs:?}"
    );
    assert_eq!(docs.concat(), line, "no character was broken");
}

#[test]
fn jsonl_reads_the_named_field() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(
        &tmp.path().join("d.jsonl"),
        "{\"body\": \"one\", \"id\": 1}\n\n{\"id\": 2, \"body\": \"two\\nlines\"}\n",
    );
    let out = tmp.path().join("ds");
    let mut cfg = config(&[&input], &out);
    cfg.field = "body".into();
    run(&cfg, &ByteTokenizer).unwrap();
    assert_eq!(read_texts(&out), ["one", "two\nlines"]);
}

#[test]
fn a_bad_jsonl_line_is_an_error_naming_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        ("{\"text\": 3}", "is a number"),
        ("[\"text\"]", "expected a JSON object"),
        ("{\"other\": \"x\"}", "no field \"text\""),
        ("{\"text\": \"unterminated", "not valid JSON"),
    ];
    for (i, (bad, problem)) in cases.iter().enumerate() {
        let input = write(
            &tmp.path().join(format!("bad{i}.jsonl")),
            &format!("{{\"text\": \"fine\"}}\n{bad}\n{{\"text\": \"fine\"}}\n"),
        );
        let out = tmp.path().join(format!("ds{i}"));
        let err = run(&config(&[&input], &out), &ByteTokenizer).unwrap_err();
        match &err {
            DataError::BadRecord { path, line, .. } => assert_eq!((path, *line), (&input, 2)),
            other => panic!("expected BadRecord, got {other:?}"),
        }
        let msg = err.to_string();
        assert!(msg.contains(&format!("bad{i}.jsonl:2:")), "{msg}");
        assert!(msg.contains(problem), "{msg}");
        assert!(!out.join(MANIFEST_FILE).exists());
    }
}

#[test]
fn skip_bad_lines_counts_and_skips_them() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(
        &tmp.path().join("d.ndjson"),
        "{\"text\": \"a\"}\nnot json\n{\"text\": null}\n{\"text\": \"b\"}",
    );
    let out = tmp.path().join("ds");
    let mut cfg = config(&[&input], &out);
    cfg.skip_bad_lines = true;
    let s = run(&cfg, &ByteTokenizer).unwrap();
    assert_eq!(read_texts(&out), ["a", "b"]);
    assert_eq!(s.skipped, 2);
}

#[test]
fn shards_hold_whole_documents_tokenized_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let paragraphs: Vec<String> = (0..60)
        .map(|i| {
            format!(
                "Paragraph {i} says héllo, world{}",
                " and more".repeat(i % 7)
            )
        })
        .collect();
    let input = write(&tmp.path().join("p.txt"), &paragraphs.join("\n\n"));
    let out = tmp.path().join("ds");
    let mut cfg = config(&[&input], &out);
    cfg.shard_bytes = 200;
    cfg.batch_bytes = 300; // many batches
    let gpt2 = Gpt2Tokenizer::new().unwrap();
    let s = run(&cfg, &gpt2).unwrap();
    assert!(s.shards > 3, "{} shards", s.shards);
    let expected: Vec<Vec<u32>> = paragraphs
        .iter()
        .map(|p| {
            let mut ids = gpt2.encode(p);
            ids.push(Gpt2Tokenizer::EOT);
            ids
        })
        .collect();
    assert_eq!(read_docs(&out), expected);
    // Every shard but the last reached the target, and only its last document took it there.
    let m = &s.manifest;
    assert_eq!(
        (m.tokenizer.as_str(), m.vocab_size, m.eot),
        ("gpt2", 50257, Some(50256))
    );
    for (i, e) in m.shards.iter().enumerate() {
        assert_eq!(e.file, format!("shard-{i:05}.fts"));
        if i + 1 < m.shards.len() {
            assert!(e.tokens * 2 >= 200, "shard {i} closed early: {e:?}");
        }
    }
}

#[test]
fn output_is_identical_for_any_thread_count() {
    let tmp = tempfile::tempdir().unwrap();
    let text: String = (0..400)
        .map(|i| format!("doc {i} {}\n\n", "xyz ".repeat(i % 13)))
        .collect();
    let input = write(&tmp.path().join("t.txt"), &text);
    let mut outs = Vec::new();
    for threads in [1, 3] {
        let out = tmp.path().join(format!("ds{threads}"));
        let mut cfg = config(&[&input], &out);
        cfg.threads = threads;
        cfg.shard_bytes = 1000;
        cfg.batch_bytes = 500;
        run(&cfg, &Gpt2Tokenizer::new().unwrap()).unwrap();
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        files.sort();
        outs.push(files);
    }
    assert!(outs[0].len() > 3);
    assert_eq!(outs[0], outs[1]);
}

#[test]
fn leftovers_of_an_interrupted_run_are_removed_and_nothing_else() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(&tmp.path().join("in/a.txt"), "hello\n\nworld");
    let out = tmp.path().join("ds");
    let leftovers = [
        "shard-00000.fts",
        "shard-00007.fts",
        "shard-00008.fts.tmp",
        "manifest.json.tmp",
    ];
    for name in leftovers {
        write(&out.join(name), "half-written");
    }
    let keep = ["notes.txt", "shard-1.fts", "manifest.json.bak"];
    for name in keep {
        write(&out.join(name), "not ours");
    }
    let s = run(&config(&[&input], &out), &ByteTokenizer).unwrap();
    assert_eq!(s.removed_files, 4);
    assert_eq!(read_texts(&out), ["hello", "world"]);
    assert!(!out.join("shard-00007.fts").exists() && !out.join("shard-00008.fts.tmp").exists());
    for name in keep {
        assert_eq!(std::fs::read_to_string(out.join(name)).unwrap(), "not ours");
    }
}

#[test]
fn an_existing_dataset_is_replaced_only_with_force() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(&tmp.path().join("a.txt"), "one\n\ntwo\n\nthree");
    let out = tmp.path().join("ds");
    let mut cfg = config(&[&input], &out);
    cfg.shard_bytes = 4;
    run(&cfg, &ByteTokenizer).unwrap();
    assert_eq!(Dataset::open(&out).unwrap().num_shards(), 3);
    let err = run(&cfg, &ByteTokenizer).unwrap_err();
    assert!(matches!(err, DataError::DatasetExists { .. }), "{err:?}");
    assert!(err.to_string().contains("--force"));
    cfg.force = true;
    cfg.shard_bytes = 1 << 20;
    let s = run(&cfg, &ByteTokenizer).unwrap();
    assert_eq!(s.removed_files, 4, "the manifest and three shards");
    assert_eq!(Dataset::open(&out).unwrap().num_shards(), 1);
    assert!(!out.join("shard-00001.fts").exists());
}

#[test]
fn empty_or_missing_inputs_are_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds");
    let empty = write(&tmp.path().join("empty.txt"), "\n  \n\n");
    let err = run(&config(&[&empty], &out), &ByteTokenizer).unwrap_err();
    assert!(matches!(err, DataError::EmptyInput { .. }), "{err:?}");
    assert!(!out.join(MANIFEST_FILE).exists());

    let missing = tmp.path().join("nothing-*.txt");
    let err = run(&config(&[&missing], &out), &ByteTokenizer).unwrap_err();
    assert!(matches!(err, DataError::BadInput { .. }), "{err:?}");
    assert!(err.to_string().contains("nothing-*.txt"));

    let err = run(&config(&[], &out), &ByteTokenizer).unwrap_err();
    assert!(matches!(err, DataError::NoInputFiles), "{err:?}");

    let odd = write(&tmp.path().join("data.csv"), "a,b");
    let err = run(&config(&[&odd], &out), &ByteTokenizer).unwrap_err();
    assert!(matches!(err, DataError::UnknownFormat { .. }), "{err:?}");
    let mut cfg = config(&[&odd], &out);
    cfg.format = Some(InputFormat::Text);
    assert_eq!(run(&cfg, &ByteTokenizer).unwrap().docs, 1);
}

#[test]
fn directories_and_globs_expand_in_sorted_order() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("corpus");
    write(&root.join("b/2.txt"), "b2");
    write(&root.join("b/1.txt"), "b1");
    write(&root.join("a.jsonl"), "{\"text\": \"a\"}");
    write(&root.join(".hidden.txt"), "hidden");
    write(&root.join(".git/x.txt"), "hidden");
    write(&root.join("README"), "no extension: skipped in a directory");
    write(&tmp.path().join("g/z.txt"), "z");
    write(&tmp.path().join("g/y.txt"), "y");
    let glob = tmp.path().join("g/*.txt");
    let out = tmp.path().join("ds");
    let s = run(
        &config(&[&root, &glob, &root.join("b/1.txt")], &out),
        &ByteTokenizer,
    )
    .unwrap();
    assert_eq!(read_texts(&out), ["a", "b1", "b2", "y", "z"]);
    assert_eq!(s.files, 5, "a file named twice is read once");
}

#[test]
fn an_output_directory_inside_the_input_directory_is_not_read_back() {
    let tmp = tempfile::tempdir().unwrap();
    write(&tmp.path().join("a.txt"), "only\n\ndocuments");
    let out = tmp.path().join("ds");
    let mut cfg = config(&[tmp.path()], &out);
    run(&cfg, &ByteTokenizer).unwrap();
    cfg.force = true; // the old manifest.json must not be taken for a JSON Lines input
    let s = run(&cfg, &ByteTokenizer).unwrap();
    assert_eq!((s.files, s.docs), (1, 2));
    assert_eq!(read_texts(&out), ["only", "documents"]);
}

#[test]
fn sizes_parse_with_units() {
    let ok = [
        ("64MiB", 64 << 20),
        ("1GiB", 1 << 30),
        ("500 MB", 500_000_000),
        ("4096", 4096),
        ("2kib", 2048),
    ];
    for (text, want) in ok {
        assert_eq!(
            parse_byte_size("--shard-size", text).unwrap(),
            want,
            "{text}"
        );
    }
    for bad in [
        "",
        "0",
        "MiB",
        "12 parsecs",
        "-1",
        "99999999999999999999TiB",
    ] {
        let err = parse_byte_size("--shard-size", bad).unwrap_err();
        assert!(err.to_string().contains("--shard-size"), "{bad}: {err}");
    }
    assert_eq!("JSONL".parse::<InputFormat>().unwrap(), InputFormat::Jsonl);
    assert!("csv".parse::<InputFormat>().is_err());
    assert_eq!("line".parse::<TextDocs>().unwrap(), TextDocs::Line);
}

#[cfg(not(feature = "parquet"))]
#[test]
fn parquet_without_the_feature_says_how_to_get_it() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(&tmp.path().join("x.parquet"), "PAR1");
    let err = run(&config(&[&input], &tmp.path().join("ds")), &ByteTokenizer).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::FeatureDisabled {
                feature: "parquet",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("--features parquet"));
    assert!(
        !tmp.path().join("ds").exists(),
        "nothing is created before inputs are checked"
    );
}

#[cfg(feature = "parquet")]
#[path = "prepare/parquet_input.rs"]
mod parquet_input;

#[path = "prepare/hf_tokenizer.rs"]
mod hf_tokenizer;
