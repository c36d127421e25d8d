//! `--json` on `ckpt verify`, `ckpt convert`, `ckpt gc`, `data prepare`, `data verify` and
//! `bench model`: one JSON value on stdout and nothing else, whose fields are the real figures.
//! With `--no-progress` (and stderr not a terminal anyway) no bar is drawn.
#[path = "support/cli.rs"]
mod cli;

use std::path::Path;

use cli::{MICRO, flotilla};
use serde_json::Value;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs `flotilla args...`; returns (success, the one JSON value printed, stderr). Fails the
/// test unless stdout is exactly one line of JSON.
fn json_of(args: &[&str]) -> (bool, Value, String) {
    let (ok, out, err) = flotilla(args);
    assert_eq!(
        out.lines().count(),
        1,
        "{args:?}: stdout:\n{out}\nstderr:\n{err}"
    );
    let v = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"));
    (ok, v, err)
}

fn u64_of(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

fn steps_of(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(u64_of).collect()
}

#[test]
fn ckpt_verify_convert_and_gc_print_json() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ckpt");
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&["--steps", "3", "--ckpt-dir", s(&ck), "--ckpt-every", "1"]);
    args.push("--ckpt-sync");
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "train failed: {err}\n{out}");
    assert_eq!(ckpt::list_committed(&ck).unwrap(), vec![1, 2, 3]);
    let newest = ckpt::Checkpoint::open(&ck, 3, ckpt::Verify::ManifestOnly).unwrap();
    let step_bytes = newest.manifest().piece_bytes();
    assert!(step_bytes > 0);

    let (ok, v, err) = json_of(&["ckpt", "verify", s(&ck), "--json", "--no-progress"]);
    assert!(ok, "{err}");
    let steps = v["steps"].as_array().unwrap();
    let numbers: Vec<u64> = steps.iter().map(|r| u64_of(&r["step"])).collect();
    assert_eq!(numbers, [1, 2, 3]);
    for r in steps {
        assert_eq!(
            (&r["ok"], &r["error"]),
            (&Value::Bool(true), &Value::Null),
            "{r}"
        );
        assert_eq!(u64_of(&r["bytes"]), step_bytes, "{r}");
        assert!(r["gb_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert_eq!(v["failed"], serde_json::json!([]));

    let hf = dir.path().join("hf");
    let (ok, v, err) = json_of(&["ckpt", "convert", s(&ck), "--hf", s(&hf), "--json"]);
    assert!(ok, "{err}");
    assert_eq!(v["step"], 3);
    // Every parameter is an f32 of the step's model tensors: a third of the step (model, exp_avg,
    // exp_avg_sq).
    assert_eq!(u64_of(&v["parameters"]) * 4 * 3, step_bytes, "{v}");
    let on_disk: u64 = ["config.json", "model.safetensors"]
        .iter()
        .map(|f| std::fs::metadata(hf.join(f)).unwrap().len())
        .sum();
    assert_eq!(u64_of(&v["bytes"]), on_disk);

    let resharded = dir.path().join("resharded");
    let (ok, v, err) = json_of(&[
        "ckpt",
        "convert",
        s(&ck),
        "--reshard",
        "2",
        "--out",
        s(&resharded),
        "--json",
        "--no-progress",
    ]);
    assert!(ok, "{err}");
    assert_eq!(
        (&v["step"], &v["world"], &v["from_world"]),
        (&3.into(), &2.into(), &1.into())
    );
    assert_eq!(
        u64_of(&v["bytes"]),
        step_bytes,
        "every byte written once: {v}"
    );
    let written = ckpt::Checkpoint::open(&resharded, 3, ckpt::Verify::AllPieces).unwrap();
    assert_eq!(u64_of(&v["pieces"]), written.manifest().pieces.len() as u64);

    // A staging leftover below the newest committed step, then retention down to one step.
    let leftover = ck.join(ckpt::tmp_dir_name(2));
    std::fs::create_dir(&leftover).unwrap();
    std::fs::write(leftover.join("rank-00000.bin"), [0u8; 100]).unwrap();
    let gc = ["ckpt", "gc", s(&ck), "--keep-last", "1", "--json"];
    let (ok, v, err) = json_of(&[&gc[..], &["--dry-run"]].concat());
    assert!(ok, "{err}");
    assert_eq!(v["dry_run"], true);
    let plan = &v["retention"]["plan"];
    assert_eq!(
        (steps_of(&plan["keep"]), steps_of(&plan["delete"])),
        (vec![3], vec![1, 2])
    );
    assert_eq!(v["retention"]["policy"]["keep_last"], 1);
    let removed = &v["gc"]["removed"][0];
    assert_eq!(
        (&removed["step"], &removed["kind"]),
        (&2.into(), &"staging".into())
    );
    assert_eq!((u64_of(&removed["bytes"]), u64_of(&v["removed"])), (100, 3));
    let retention = v["retention"]["removed"].as_array().unwrap();
    let retention_bytes: u64 = retention.iter().map(|r| u64_of(&r["bytes"])).sum();
    assert!(
        retention_bytes > 2 * step_bytes,
        "pieces and manifests: {v}"
    );
    assert_eq!(u64_of(&v["bytes"]), retention_bytes + 100);
    assert!(leftover.is_dir(), "a dry run removes nothing");

    // A flipped byte in step 1: the JSON still comes out, naming it; the exit status fails.
    let file = ck.join("step-1").join(ckpt::rank_file_name(0));
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let (ok, v, err) = json_of(&["ckpt", "verify", s(&ck), "--json", "--no-progress"]);
    assert!(!ok && err.contains("1 of 3"), "{err}");
    assert_eq!(v["failed"], serde_json::json!(["step-1"]));
    assert_eq!(v["steps"][0]["ok"], false);
    let error = v["steps"][0]["error"].as_str().unwrap();
    assert!(error.contains(ckpt::rank_file_name(0).as_str()), "{error}");

    let (ok, v, err) = json_of(&gc);
    assert!(ok, "{err}");
    assert_eq!((&v["dry_run"], u64_of(&v["removed"])), (&false.into(), 3));
    assert_eq!(ckpt::list_committed(&ck).unwrap(), vec![3]);
    assert!(!leftover.exists());
}

#[test]
fn data_prepare_and_verify_print_json() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("corpus.txt");
    let text: String = (0..50)
        .map(|i| format!("Document number {i}.\nIt has two lines.\n\n"))
        .collect();
    std::fs::write(&input, &text).unwrap();
    let ds = tmp.path().join("ds");
    let (ok, v, err) = json_of(&[
        "data",
        "prepare",
        s(&input),
        "-o",
        s(&ds),
        "--tokenizer",
        "byte",
        "--shard-size",
        "1KiB",
        "--json",
        "--no-progress",
    ]);
    assert!(ok, "{err}");
    let manifest = data::Dataset::open(&ds).unwrap().manifest().clone();
    assert_eq!((u64_of(&v["docs"]), u64_of(&v["files"])), (50, 1));
    assert_eq!(u64_of(&v["tokens"]), manifest.tokens);
    assert_eq!(u64_of(&v["shards"]), manifest.shards.len() as u64);
    assert!(u64_of(&v["shards"]) >= 2, "{v}");
    assert_eq!(u64_of(&v["input_bytes"]), text.len() as u64);
    let shard_bytes: u64 = manifest.shards.iter().map(|sh| sh.bytes).sum();
    assert_eq!(u64_of(&v["bytes_written"]), shard_bytes);
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(
        (&v["tokenizer"], &v["snapshot"]),
        (&"byte".into(), &manifest.snapshot.clone().into())
    );

    let (ok, v, err) = json_of(&["data", "verify", s(&ds), "--json", "--no-progress"]);
    assert!(ok, "{err}");
    assert_eq!(v["snapshot"], manifest.snapshot);
    assert_eq!(u64_of(&v["bytes"]), shard_bytes);
    assert_eq!(v["shards"].as_array().unwrap().len(), manifest.shards.len());
    assert_eq!(v["failed"], serde_json::json!([]));
}

#[test]
fn bench_model_prints_json() {
    // MICRO's model, batch and threads (not its training-only flags).
    let model = MICRO
        .iter()
        .position(|&a| a == "--config")
        .map(|at| &MICRO[at..at + 14])
        .unwrap();
    let mut args = vec!["bench", "model"];
    args.extend_from_slice(model);
    args.extend_from_slice(&[
        "--steps",
        "3",
        "--untimed",
        "1",
        "--gemm",
        "256",
        "--gemm-reps",
        "1",
        "--profile",
        "--json",
    ]);
    let (ok, v, err) = json_of(&args);
    assert!(ok, "{err}");
    assert_eq!(
        (&v["config"], &v["layers"], &v["d_model"]),
        (&"tiny".into(), &1.into(), &32.into())
    );
    assert_eq!(
        (&v["seq_len"], &v["batch"], &v["threads"]),
        (&32.into(), &4.into(), &2.into())
    );
    assert!(u64_of(&v["params"]) > 0);
    assert_eq!(v["gemm"][0]["n"], 256);
    assert!(v["gemm"][0]["gflops"].as_f64().unwrap() > 0.0, "{v}");
    let t = &v["throughput"];
    assert_eq!(t["steps"], 3);
    for key in ["tokens_per_s", "step_ms", "median_ms", "gflops", "mfu"] {
        let x = t[key].as_f64().unwrap_or_else(|| panic!("{key}: {v}"));
        assert!(x.is_finite() && x > 0.0, "{key} = {x}");
    }
    let tokens_per_s = t["tokens_per_s"].as_f64().unwrap();
    let want = 4.0 * 32.0 / (t["step_ms"].as_f64().unwrap() / 1e3);
    assert!(
        (tokens_per_s / want - 1.0).abs() < 1e-9,
        "{tokens_per_s} vs {want}"
    );
    assert!(v["loss_first"].as_f64().unwrap() > 0.0 && v["loss_last"].as_f64().unwrap() > 0.0);
    let profile = v["profile"].as_array().unwrap();
    assert!(
        profile.iter().any(|r| r["seconds"].as_f64().unwrap() > 0.0),
        "{v}"
    );
}
