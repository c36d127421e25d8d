//! `flotilla data prepare | inspect | verify` through the binary.
#[path = "support/cli.rs"]
mod cli;

use cli::flotilla;
use std::path::Path;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn prepare_inspect_verify_and_catch_a_flipped_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("corpus.txt");
    let text: String = (0..50)
        .map(|i| format!("Document number {i}.\nIt has two lines.\n\n"))
        .collect();
    std::fs::write(&input, text).unwrap();
    let out = tmp.path().join("ds");
    let (ok, stdout, stderr) = flotilla(&[
        "data",
        "prepare",
        s(&input),
        "--output",
        s(&out),
        "--tokenizer",
        "byte",
        "--shard-size",
        "1KiB",
        "--threads",
        "2",
        "--no-progress",
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("50 documents"), "{stdout}");
    assert!(stdout.contains("MB/s of text"), "{stdout}");
    let shards: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".fts"))
        .collect();
    assert!(shards.len() >= 2, "{shards:?}");

    let (ok, again, stderr) = flotilla(&[
        "data",
        "prepare",
        s(&input),
        "-o",
        s(&out),
        "--tokenizer",
        "byte",
    ]);
    assert!(!ok && stderr.contains("--force"), "{again}{stderr}");

    let (ok, stdout, stderr) = flotilla(&["data", "inspect", s(&out), "--samples", "2"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("byte (vocab 257"), "{stdout}");
    assert!(stdout.contains("shard-00001.fts"), "{stdout}");
    assert!(
        stdout.contains("\"Document number 0.\\nIt has two lines.\""),
        "{stdout}"
    );
    assert!(stdout.contains("\"Document number 1."), "{stdout}");
    assert!(!stdout.contains("Document number 2."), "{stdout}");

    let (ok, json, stderr) = flotilla(&["data", "inspect", s(&out), "--json"]);
    assert!(ok, "{stderr}");
    let m: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(m["docs"], 50);
    assert_eq!(m["tokenizer"], "byte");

    let (ok, stdout, stderr) = flotilla(&["data", "verify", s(&out), "--threads", "2"]);
    assert!(ok, "{stdout}{stderr}");
    assert!(
        stdout.contains("ok   shard-00000.fts") && stdout.contains("GB/s"),
        "{stdout}"
    );

    let (ok, json, stderr) = flotilla(&["data", "verify", s(&out), "--json"]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["shards"][0]["file"], "shard-00000.fts");
    assert_eq!(
        (&v["shards"][0]["ok"], &v["failed"]),
        (&true.into(), &serde_json::json!([]))
    );
    assert!(v["gb_per_s"].as_f64().unwrap() > 0.0, "{v}");

    // Flip one byte of the second shard's token ids: verify must fail and name that shard.
    let victim = out.join("shard-00001.fts");
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[100] ^= 0x20;
    std::fs::write(&victim, bytes).unwrap();
    let (ok, stdout, stderr) = flotilla(&["data", "verify", s(&out)]);
    assert!(!ok, "{stdout}");
    assert!(stdout.contains("BAD  shard-00001.fts"), "{stdout}");
    assert!(stdout.contains("ok   shard-00000.fts"), "{stdout}");
    assert!(
        stderr.contains("1 of") && stderr.contains("shard-00001.fts"),
        "{stderr}"
    );
    let (ok, json, _) = flotilla(&["data", "verify", s(&out), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(
        !ok && v["failed"] == serde_json::json!(["shard-00001.fts"]),
        "{v}"
    );
    assert!(v["shards"][1]["error"].is_string(), "{v}");

    // A missing shard is an error too.
    std::fs::remove_file(&victim).unwrap();
    let (ok, _, stderr) = flotilla(&["data", "verify", s(&out)]);
    assert!(
        !ok && stderr.contains("shard-00001.fts") && stderr.contains("missing"),
        "{stderr}"
    );
}

#[test]
fn prepare_reports_a_bad_jsonl_line_with_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("docs.jsonl");
    std::fs::write(&input, "{\"text\": \"ok\"}\n{\"txt\": \"typo\"}\n").unwrap();
    let out = tmp.path().join("ds");
    let (ok, _, stderr) = flotilla(&[
        "data",
        "prepare",
        s(&input),
        "-o",
        s(&out),
        "--tokenizer",
        "byte",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("docs.jsonl:2:") && stderr.contains("no field \"text\""),
        "{stderr}"
    );
    assert!(!out.join("manifest.json").exists());
    let (ok, stdout, stderr) = flotilla(&[
        "data",
        "prepare",
        s(&input),
        "-o",
        s(&out),
        "--tokenizer",
        "byte",
        "--skip-bad-lines",
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("skipped records: 1"), "{stdout}");
    let (ok, _, stderr) = flotilla(&[
        "data",
        "prepare",
        s(&input),
        "-o",
        s(&out),
        "--shard-size",
        "lots",
    ]);
    assert!(!ok && stderr.contains("--shard-size"), "{stderr}");
}

#[test]
fn a_tokenizer_json_dataset_decodes_with_the_same_file_only() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tmp.path().join("tokenizer.json");
    let json = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "unk_token": "<unk>",
        "vocab": {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}}}"#;
    std::fs::write(&tok, json).unwrap();
    let input = tmp.path().join("a.txt");
    std::fs::write(&input, "hello world\n\nworld hello").unwrap();
    let out = tmp.path().join("ds");
    let (ok, stdout, stderr) = flotilla(&[
        "data",
        "prepare",
        s(&input),
        "-o",
        s(&out),
        "--tokenizer",
        s(&tok),
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("2 documents, 6 tokens") && stdout.contains("hf:"),
        "{stdout}"
    );
    let (ok, stdout, _) = flotilla(&["data", "inspect", s(&out)]);
    assert!(ok && stdout.contains("ids [2, 3]"), "{stdout}");
    let (ok, stdout, stderr) = flotilla(&["data", "inspect", s(&out), "--tokenizer", s(&tok)]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("\"hello world\"") && stdout.contains("\"world hello\""),
        "{stdout}"
    );
    std::fs::write(&tok, json.replace("\"world\": 3", "\"world\": 3, \"x\": 4")).unwrap();
    let (ok, _, stderr) = flotilla(&["data", "inspect", s(&out), "--tokenizer", s(&tok)]);
    assert!(!ok && stderr.contains("was tokenized with hf:"), "{stderr}");
}
