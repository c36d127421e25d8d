//! `flotilla train --config FILE.toml` through the binary.
#[path = "support/cli.rs"]
mod cli;

use cli::{MICRO, flotilla};

/// A micro model in a config file: two layers, so the command line can be seen to change it.
const MICRO_TOML: &str = r#"
# Tables only group keys; `_` and `-` are alike.
[model]
config = "tiny"
layers = 2
d_model = 32
heads = 2
seq-len = 32

[train]
batch = 4
threads = 2
steps = 2
lr = 3e-3
data = "markov"

[run]
peak_gflops = 100.0
no_progress = true
"#;

/// The `# model: ...` line `train` printed.
fn model_line(out: &str) -> &str {
    out.lines()
        .find(|l| l.starts_with("# model: "))
        .unwrap_or_else(|| panic!("no model line in:\n{out}"))
}

#[test]
fn the_file_sets_options_and_the_command_line_overrides_them() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("micro.toml");
    std::fs::write(&cfg, MICRO_TOML).unwrap();
    let cfg = cfg.to_str().unwrap();

    let (ok, out, err) = flotilla(&["train", "--config", cfg]);
    assert!(ok, "train failed: {err}");
    assert!(
        model_line(&out).starts_with("# model: 2 layers, d_model 32, heads 2/2"),
        "{out}"
    );
    assert!(
        out.contains("step      2/2 loss"),
        "the file's steps = 2: {out}"
    );

    // Flags after (or before) --config win over the file's values.
    let (ok, out, err) = flotilla(&["train", "--layers", "1", "--config", cfg, "--steps", "3"]);
    assert!(ok, "train failed: {err}");
    assert!(model_line(&out).starts_with("# model: 1 layers"), "{out}");
    assert!(out.contains("step      3/3 loss"), "{out}");

    // A repeated flag overrides itself (args_override_self).
    let (ok, out, err) = flotilla(&["train", "--config", cfg, "--steps", "5", "--steps", "1"]);
    assert!(ok, "train failed: {err}");
    assert!(out.contains("step      1/1 loss"), "{out}");
}

#[test]
fn the_example_config_runs() {
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/train-small.toml"
    );
    let mut args = vec!["train", "--config", example];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&["--steps", "2"]);
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "train failed: {err}");
    assert!(
        model_line(&out).starts_with("# model: 1 layers, d_model 32"),
        "{out}"
    );
    assert!(out.contains("step      2/2 loss"), "{out}");
}

#[test]
fn config_mistakes_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("typo.toml");
    std::fs::write(&cfg, "[model]\nlayres = 2\n").unwrap();
    let (ok, _, err) = flotilla(&["train", "--config", cfg.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        err.contains("typo.toml") && err.contains("`model.layres`") && err.contains("--layers"),
        "{err}"
    );

    std::fs::write(&cfg, "steps = \"many\"\n").unwrap();
    let (ok, _, err) = flotilla(&["train", "--config", cfg.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        err.contains("typo.toml") && err.contains("--steps"),
        "{err}"
    );

    let missing = dir.path().join("missing.toml");
    let (ok, _, err) = flotilla(&["train", "--config", missing.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("missing.toml"), "{err}");
}
