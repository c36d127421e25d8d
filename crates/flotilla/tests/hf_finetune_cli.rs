//! Hugging Face in: `flotilla train --init-hf`, `flotilla generate --hf`, `--export-dtype`.
//!
//! Without Python: a model exported by `flotilla train --export-hf` loads back with
//! `--init-hf` and is placed under every layout that takes it (one process, ZeRO-3, --tp 2:
//! zero steps later the export is bit-identical), `generate --hf` continues exactly as
//! `generate --model` on the same weights, and the refusals name what is wrong before any
//! worker starts.
//!
//! With Python (`FLOTILLA_HF_CHECK_PYTHON` naming an interpreter that imports `torch`,
//! `transformers`, `safetensors` and `tokenizers`; `.ci/run` sets it): `scripts/
//! hf_finetune_check.py` makes GPT-2 and Llama models with Transformers and checks the
//! first-batch loss, 20 steps of training, the export and greedy generation against
//! Transformers. Without it that test is skipped with a note on stderr.
#[path = "support/cli.rs"]
mod cli;

use cli::{MICRO, flotilla};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `flotilla train MICRO extra...`, which must succeed; its stdout.
fn train(extra: &[&str]) -> String {
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(extra);
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "train {extra:?} failed:\n{out}\n{err}");
    out
}

/// `flotilla train --init-hf dir extra...` (training flags only: the shape is the directory's).
fn finetune(dir: &Path, extra: &[&str]) -> (bool, String, String) {
    let mut args = vec![
        "train",
        "--init-hf",
        s(dir),
        "--threads",
        "1",
        "--batch",
        "2",
        "--peak-gflops",
        "100",
        "--no-progress",
        "--no-plan",
    ];
    args.extend_from_slice(extra);
    flotilla(&args)
}

fn weights(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("model.safetensors")).unwrap()
}

#[test]
fn an_export_loads_back_under_every_layout_and_generates_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let (hf, saved) = (tmp.path().join("hf"), tmp.path().join("saved"));
    train(&["--steps", "3", "--export-hf", s(&hf), "--save", s(&saved)]);
    for (name, layout) in [
        ("one", &["--nproc", "1"][..]),
        ("zero3", &["--nproc", "2", "--zero", "3"][..]),
        ("tp2", &["--nproc", "2", "--tp", "2"][..]),
    ] {
        let out = tmp.path().join(name);
        let mut extra = vec!["--steps", "0", "--export-hf", s(&out)];
        extra.extend_from_slice(layout);
        let (ok, stdout, err) = finetune(&hf, &extra);
        assert!(ok, "{name}: {stdout}\n{err}");
        assert!(
            stdout.contains("# initialised from the Hugging Face GPT2LMHeadModel"),
            "{name}: {stdout}"
        );
        assert!(weights(&out) == weights(&hf), "{name}: weights changed");
    }
    // And it trains from there: the first loss is the loaded model's, not a fresh one's.
    let (ok, out, err) = finetune(&hf, &["--nproc", "1", "--steps", "2", "--seq-len", "16"]);
    assert!(ok && out.contains("# done: 2 steps"), "{out}\n{err}");

    let generate = |args: &[&str]| {
        let mut a = vec![
            "generate",
            "--prompt",
            "1 2 3",
            "--tokens",
            "8",
            "--temperature",
            "0",
        ];
        a.extend_from_slice(args);
        let (ok, out, err) = flotilla(&a);
        assert!(ok, "{args:?}: {err}");
        out
    };
    let from_hf = generate(&["--hf", s(&hf), "--ids"]);
    assert_eq!(from_hf, generate(&["--model", s(&saved)]));
    assert_eq!(from_hf.split_whitespace().count(), 3 + 8, "{from_hf}");
}

#[test]
fn a_bf16_export_halves_the_weights_and_loads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let (f32_dir, bf16_dir) = (tmp.path().join("f32"), tmp.path().join("bf16"));
    train(&["--steps", "1", "--export-hf", s(&f32_dir)]);
    let (ok, out, err) = finetune(
        &f32_dir,
        &[
            "--nproc",
            "1",
            "--steps",
            "0",
            "--export-hf",
            s(&bf16_dir),
            "--export-dtype",
            "bf16",
        ],
    );
    assert!(ok && out.contains("bfloat16 weights"), "{out}\n{err}");
    let config = std::fs::read_to_string(bf16_dir.join("config.json")).unwrap();
    assert!(config.contains("\"torch_dtype\": \"bfloat16\""), "{config}");
    let (a, b) = (weights(&f32_dir).len(), weights(&bf16_dir).len());
    assert!(b < a * 6 / 10, "bf16 {b} bytes vs f32 {a}");
    // The bf16 weights import (widened) and train.
    let (ok, out, err) = finetune(&bf16_dir, &["--nproc", "1", "--steps", "1"]);
    assert!(ok, "{out}\n{err}");
}

#[test]
fn a_checkpoint_wins_over_init_hf_and_resumes_bit_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let (hf, ck) = (tmp.path().join("hf"), tmp.path().join("ck"));
    train(&["--steps", "1", "--export-hf", s(&hf)]);
    let straight = finetune(&hf, &["--nproc", "1", "--steps", "4", "--log-every", "1"]);
    assert!(straight.0, "{}\n{}", straight.1, straight.2);
    let run = |steps: &str| {
        let (ok, out, err) = finetune(
            &hf,
            &[
                "--nproc",
                "1",
                "--steps",
                steps,
                "--log-every",
                "1",
                "--ckpt-dir",
                s(&ck),
            ],
        );
        assert!(ok, "{out}\n{err}");
        out
    };
    run("2");
    let resumed = run("4");
    assert!(
        resumed.contains("# initialised from the Hugging Face")
            && resumed.contains(&format!("# resumed from {} step 2", ck.display())),
        "{resumed}"
    );
    let last = |out: &str| cli::loss_at(out, 4, 4);
    assert_eq!(last(&resumed), last(&straight.1));
}

#[test]
fn init_hf_refusals_name_the_flag_or_file() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    train(&["--steps", "1", "--export-hf", s(&hf)]);

    let (ok, _, err) = finetune(&hf, &["--d-model", "64"]);
    assert!(!ok && err.contains("--d-model"), "{err}");
    let (ok, _, err) = finetune(&hf, &["--nproc", "2", "--pp", "2", "--steps", "1"]);
    assert!(
        !ok && err.contains("--pp 2") && err.contains("--init-hf"),
        "{err}"
    );
    let (ok, _, err) = finetune(&hf, &["--seq-len", "4096"]);
    assert!(!ok && err.contains("--seq-len 4096"), "{err}");
    let missing = tmp.path().join("missing");
    let (ok, _, err) = finetune(&missing, &["--steps", "1"]);
    assert!(!ok && err.contains("config.json"), "{err}");

    // Rope scaling is refused by name.
    let llama = tmp.path().join("llama");
    std::fs::create_dir(&llama).unwrap();
    std::fs::write(
        llama.join("config.json"),
        r#"{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}"#,
    )
    .unwrap();
    let (ok, _, err) = finetune(&llama, &["--steps", "1"]);
    assert!(!ok && err.contains("yarn"), "{err}");
}

/// A Python that can run the end-to-end check, if `FLOTILLA_HF_CHECK_PYTHON` names one.
fn checker() -> Option<String> {
    let Some(py) = std::env::var("FLOTILLA_HF_CHECK_PYTHON")
        .ok()
        .filter(|s| !s.is_empty())
    else {
        eprintln!(
            "SKIP hf_finetune: FLOTILLA_HF_CHECK_PYTHON is not set (CI sets it to a venv with \
             torch, transformers, safetensors and tokenizers; see .ci/run)"
        );
        return None;
    };
    let probe = Command::new(&py)
        .args(["-c", "import torch, transformers, safetensors, tokenizers"])
        .output();
    match probe {
        Ok(o) if o.status.success() => Some(py),
        Ok(o) => panic!(
            "FLOTILLA_HF_CHECK_PYTHON={py} cannot import torch/transformers/safetensors/tokenizers: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!("FLOTILLA_HF_CHECK_PYTHON={py} cannot run: {e}"),
    }
}

#[test]
fn hugging_face_models_fine_tune_and_match_transformers() {
    let Some(py) = checker() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/hf_finetune_check.py");
    let (out_path, err_path) = (tmp.path().join("stdout.txt"), tmp.path().join("stderr.txt"));
    let mut child = Command::new(&py)
        .args([s(&script), env!("CARGO_BIN_EXE_flotilla"), s(tmp.path())])
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .expect("start the check script");
    let deadline = Instant::now() + Duration::from_secs(600);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("hf_finetune_check.py still running after 600 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap();
    let stderr = std::fs::read_to_string(&err_path).unwrap();
    eprintln!("{stdout}");
    assert!(status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("hf_finetune_check: ok"), "{stdout}");
}
