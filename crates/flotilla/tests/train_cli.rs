//! `flotilla train` and `flotilla generate` through the binary.
#[path = "support/cli.rs"]
mod cli;

use cli::{MICRO, flotilla};

#[test]
fn train_saves_and_generate_continues_the_prompt() {
    let dir = std::env::temp_dir().join(format!("flotilla-train-cli-{}", std::process::id()));
    let save = dir.to_str().unwrap();
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&[
        "--data",
        "grammar",
        "--tokenizer",
        "byte",
        "--steps",
        "20",
        "--lr",
        "3e-3",
        "--save",
        save,
    ]);
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "train failed: {err}");
    assert!(out.contains("step     20/20 loss"), "{out}");
    assert!(
        out.contains("vocab 257"),
        "the byte tokenizer sets the vocabulary: {out}"
    );
    let (ok, out, err) = flotilla(&[
        "generate",
        "--model",
        save,
        "--prompt",
        "The dog",
        "--tokens",
        "20",
        "--temperature",
        "0",
    ]);
    assert!(ok, "generate failed: {err}");
    assert!(out.starts_with("The dog"), "{out}");
    assert!(out.trim_end_matches('\n').len() > "The dog".len(), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_settings_are_named() {
    let (ok, _, err) = flotilla(&["train", "--d-model", "256", "--heads", "3", "--steps", "1"]);
    assert!(!ok);
    assert!(err.contains("heads"), "{err}");
    let (ok, _, err) = flotilla(&["train", "--nproc", "2", "--bucket-mb", "0", "--steps", "1"]);
    assert!(!ok);
    assert!(err.contains("--bucket-mb 0"), "{err}");
    let (ok, _, err) = flotilla(&["train", "--data", "text", "--steps", "1"]);
    assert!(!ok);
    assert!(err.contains("no text files"), "{err}");
    let (ok, _, err) = flotilla(&["generate", "--model", "/nonexistent/model"]);
    assert!(!ok);
    assert!(err.contains("/nonexistent/model"), "{err}");
}
