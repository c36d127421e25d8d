//! Stragglers named (issue 29), through the binary: with `--chaos slow@5:1:3` rank 1's steps
//! take three times as long from step 6 on; the run names rank 1 with a slowdown between 2x
//! and 4.5x within 10 steps of the fault, in the log and the metrics file, and trains the same
//! numbers as an undisturbed run (a slow rank changes the timing only).
#[path = "support/cli.rs"]
mod cli;

use std::time::Duration;

const STEPS: u64 = 16;

/// MICRO, a little wider so a step's compute stands above the scheduling noise, on 2 workers
/// of one thread each for `STEPS` steps, plus `extra`.
fn args(metrics: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["train"]
        .iter()
        .chain(cli::MICRO)
        .map(|s| s.to_string())
        .collect();
    let steps = STEPS.to_string();
    let more = [
        "--nproc",
        "2",
        "--threads",
        "1",
        "--d-model",
        "64",
        "--seq-len",
        "64",
        "--steps",
        &steps,
        "--log-every",
        "1",
        "--metrics",
        metrics,
        "--job-timeout-s",
        "120",
    ];
    a.extend(more.iter().chain(extra).map(|s| s.to_string()));
    a
}

fn run(dir: &std::path::Path, name: &str, extra: &[&str]) -> (String, String) {
    let metrics = dir.join(format!("{name}.jsonl"));
    let a = args(metrics.to_str().unwrap(), extra);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let scratch = dir.join(name);
    std::fs::create_dir_all(&scratch).unwrap();
    let (st, out, err) = cli::run_with_deadline(&scratch, &a, Duration::from_secs(120));
    assert!(st.success(), "{name}: {err}\n{out}");
    (out, std::fs::read_to_string(metrics).unwrap())
}

#[test]
fn a_slow_rank_is_named_with_its_slowdown_and_changes_no_number() {
    let dir = tempfile::tempdir().unwrap();
    let (plain, _) = run(dir.path(), "plain", &[]);
    assert!(!plain.contains("# straggler:"), "{plain}");
    let (slow, metrics) = run(
        dir.path(),
        "slow",
        &["--chaos", "slow@5:1:3", "--chaos-seed", "1"],
    );
    let line = slow
        .lines()
        .find(|l| l.starts_with("# straggler: rank "))
        .unwrap_or_else(|| panic!("no straggler named:\n{slow}"));
    assert!(line.starts_with("# straggler: rank 1 is "), "{line}");
    let x: f64 = line["# straggler: rank 1 is ".len()..]
        .split('x')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    // The estimate is 3 x (rank 1's compute / rank 0's) for the steps it saw; on two shared
    // cores the two computes differ by up to ~20% (3.06-3.10x when measured alone, 3.55x in a
    // CI run of 2026-12-06 beside the other test of this file), so the band is wide; the naming
    // threshold is 1.75x.
    assert!((2.0..=4.5).contains(&x), "slowdown {x}: {slow}");
    let step: u64 = line
        .rsplit("to step ")
        .next()
        .unwrap()
        .trim_end_matches(')')
        .parse()
        .unwrap();
    assert!(step > 5 && step <= 15, "named at step {step}: {line}");
    // The metrics file has the same straggler as a record.
    let rec = metrics
        .lines()
        .find(|l| l.contains(r#""kind":"straggler""#))
        .unwrap_or_else(|| panic!("no straggler record:\n{metrics}"));
    assert!(
        rec.contains(r#""rank":1"#) && rec.contains(&format!(r#""step":{step}"#)),
        "{rec}"
    );
    // `flotilla report` marks the straggler on the throughput chart and, the launcher having
    // written the goodput ledger, draws it with the straggler waits.
    assert!(metrics.contains(r#""kind":"goodput""#), "{metrics}");
    let m = dir.path().join("slow.jsonl");
    let out = dir.path().join("report");
    let (ok, _, err) = cli::flotilla(&[
        "report",
        m.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let tput = std::fs::read_to_string(out.join("throughput.svg")).unwrap();
    assert!(
        tput.contains("straggler named") && tput.contains("rank 1 "),
        "no straggler on the throughput chart"
    );
    let goodput = std::fs::read_to_string(out.join("goodput.svg")).unwrap();
    for label in [
        "Goodput",
        "productive steps",
        "straggler waits",
        "generation 0",
        "run",
    ] {
        assert!(goodput.contains(label), "goodput chart: no {label}");
    }
    assert!(out.join("goodput.png").is_file());
    // Same losses as the undisturbed run, step for step.
    for s in 1..=STEPS {
        assert_eq!(
            cli::loss_at(&slow, s, STEPS),
            cli::loss_at(&plain, s, STEPS),
            "step {s}"
        );
    }
}

#[test]
fn exclude_is_refused_outside_an_elastic_job_and_bad_policies_are_named() {
    let (ok, _, err) = cli::flotilla(&["train", "--nproc", "2", "--straggler", "exclude"]);
    assert!(
        !ok && err.contains("--straggler exclude") && err.contains("MIN:MAX"),
        "{err}"
    );
    let (ok, _, err) = cli::flotilla(&["train", "--straggler", "drop"]);
    assert!(!ok && err.contains("expected warn or exclude"), "{err}");
}
