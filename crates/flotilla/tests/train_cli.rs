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

/// A config whose buffers cannot fit in this machine's memory is refused up front, naming what
/// needs how much, instead of aborting in the allocator; under the launcher it is not restarted.
#[test]
fn a_config_too_large_for_memory_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().to_str().unwrap();
    // 8 x 256 x 1e8 logits alone are 819 GB of f32.
    let huge_vocab = ["--vocab", "100000000", "--steps", "1", "--ckpt-dir", ckpt];
    let (ok, _, err) = flotilla(&[&["train", "--nproc", "1"], &huge_vocab[..]].concat());
    assert!(!ok);
    assert!(
        err.contains("the activations of a batch of 8 x 256 tokens need") && err.contains("GB"),
        "{err}"
    );
    assert!(!err.contains("memory allocation of"), "{err}");
    let (ok, _, err) = flotilla(&[&["train", "--nproc", "2"], &huge_vocab[..]].concat());
    assert!(!ok);
    assert!(err.contains("not restarted"), "{err}");
    assert!(!err.contains("restart 1/"), "{err}");
    // 33.9e9 parameters: the weights, gradients and moments alone are 542 GB.
    let (ok, _, err) = flotilla(&[
        "train",
        "--nproc",
        "1",
        "--d-model",
        "8192",
        "--heads",
        "16",
        "--layers",
        "48",
        "--batch",
        "1",
        "--seq-len",
        "16",
        "--steps",
        "1",
        "--ckpt-dir",
        ckpt,
    ]);
    assert!(!ok);
    assert!(err.contains("the training state of"), "{err}");
}

/// A worker's memory check counts only its share of the node (`LOCAL_WORLD_SIZE`, which the
/// launcher sets): a micro model that fits a whole machine is refused when a billion workers
/// would share it.
#[test]
fn the_memory_check_uses_this_workers_share_of_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().to_str().unwrap();
    let args = [&["train"], MICRO, &["--steps", "1", "--ckpt-dir", ckpt]].concat();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(&args)
        .env("LOCAL_WORLD_SIZE", "1000000000")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("but this process has"), "{err}");
    let (ok, _, err) = flotilla(&args);
    assert!(ok, "{err}");
}
