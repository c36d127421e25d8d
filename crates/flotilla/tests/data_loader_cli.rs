//! `flotilla data synth | stress | bench` and `flotilla train --dataset` through the binary.
#[path = "support/cli.rs"]
mod cli;

use cli::{MICRO, flotilla};
use std::path::Path;

/// A 200k-token synthetic dataset over a 257-id vocabulary, in shards of 64 KiB.
fn synth(dir: &Path) {
    let out = dir.to_str().unwrap();
    let (ok, stdout, stderr) = flotilla(&[
        "data",
        "synth",
        "--out",
        out,
        "--tokens",
        "2e5",
        "--vocab",
        "257",
        "--shard-size",
        "64KiB",
        "--doc-tokens",
        "1000",
        "--no-progress",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("200000 tokens") && stdout.contains("7 shards"),
        "{stdout}"
    );
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[test]
fn stress_and_bench_report_their_figures() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = tmp.path().join("ds");
    synth(&ds);
    let d = ds.to_str().unwrap();

    let (ok, out, err) = flotilla(&[
        "data",
        "stress",
        "--dataset",
        d,
        "--seq-len",
        "64",
        "--global-batch",
        "4",
        "--duration",
        "0.5",
        "--rate",
        "200000",
        "--json",
    ]);
    assert!(ok, "{err}");
    let r = json(&out);
    let rate = r["tokens_per_s"].as_f64().unwrap();
    // Paced at 200k tokens/s: it cannot run ahead of the target.
    assert!(rate > 0.0 && rate < 2.2e5, "{r}");
    // No descriptor growth (one may be open transiently while a worker maps a shard).
    let fds = |k: &str| r[k].as_u64().unwrap();
    assert!(
        fds("fds_after") <= fds("fds_before") + 1,
        "descriptor growth: {r}"
    );
    assert!(r["max_outstanding"].as_u64().unwrap() <= 64);

    let (ok, out, err) = flotilla(&[
        "data",
        "bench",
        "--dataset",
        d,
        "--seq-len",
        "64",
        "--global-batch",
        "8",
        "--epochs",
        "2.5",
        "--json",
    ]);
    assert!(ok, "{err}");
    let r = json(&out);
    assert_eq!(r["dataset_tokens"], 200000);
    assert!(r["loader_vs_raw"].as_f64().unwrap() > 0.0, "{r}");
    // 2.5 epochs of 3121 sequences in batches of 8: the first epoch's 391, then the rest.
    assert_eq!(r["loader_batches"], 976, "{r}");
    let gbps = |k: &str| r[k].as_f64().unwrap_or(-1.0);
    assert!(gbps("loader_first_epoch_gbps") > 0.0, "{r}");
    assert!(gbps("loader_later_epochs_gbps") > 0.0, "{r}");
    // Half an epoch of 3121 sequences of 64 tokens, rounded down to whole global batches.
    assert_eq!(r["resume_position"], 1560);
    assert_eq!(r["resume_step"], 195);
    assert!(r["resume_first_batch_ms"].as_f64().unwrap() > 0.0);
}

#[test]
fn train_reads_a_dataset_and_reports_the_stall() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = tmp.path().join("ds");
    synth(&ds);
    let d = ds.to_str().unwrap();
    let mut args = vec!["train", "--steps", "5", "--dataset", d];
    args.extend_from_slice(MICRO);
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "{err}");
    assert!(out.contains("# data: stall"), "{out}");

    // A dataset whose ids exceed the model's vocabulary is refused up front.
    args.extend_from_slice(&["--vocab", "100"]);
    let (ok, _, err) = flotilla(&args);
    assert!(!ok);
    assert!(err.contains("vocab") && err.contains("256"), "{err}");
}

/// Batches in flight that cannot fit in memory are refused before the loader starts, naming
/// the need (they were built until the kernel killed the process); so are collective sizes
/// whose buffers cannot fit (a rank aborted in the allocator).
#[test]
fn loads_too_large_for_memory_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path());
    let ds = dir.path().to_str().unwrap();
    let (ok, _, err) = flotilla(&[
        "data",
        "stress",
        "--dataset",
        ds,
        "--seq-len",
        "64",
        "--global-batch",
        "100000000",
        "--duration",
        "1",
    ]);
    assert!(!ok);
    assert!(
        err.contains("batches in flight of 100000000 rows x 65 tokens need"),
        "{err}"
    );
    let (ok, _, err) = flotilla(&[
        "data",
        "bench",
        "--dataset",
        ds,
        "--seq-len",
        "64",
        "--global-batch",
        "4",
        "--prefetch",
        "100000000",
    ]);
    assert!(!ok);
    assert!(err.contains("batches in flight"), "{err}");
    let (ok, _, err) = flotilla(&["bench", "comm", "--nproc", "2", "--sizes", "64G"]);
    assert!(!ok);
    assert!(
        err.contains("2 local ranks with 3 buffers of 68719476736 bytes"),
        "{err}"
    );
    assert!(!err.contains("memory allocation of"), "{err}");
}
