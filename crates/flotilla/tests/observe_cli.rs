//! Watching a run through the binary (docs/OBSERVE.md): the Prometheus endpoint of
//! `--metrics-port`, scraped over HTTP while the job trains and parsed as the exposition
//! format.
#[path = "support/cli.rs"]
mod cli;

use cli::{MICRO, Running};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Starts `flotilla args...`.
fn start(args: &[&str]) -> Running {
    Running::start(
        Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .args(args)
            .stdin(Stdio::null()),
    )
}

/// The endpoint's port, from the line the run printed (`... http://0.0.0.0:PORT/metrics ...`).
fn endpoint_port(run: &mut Running) -> u16 {
    let line = run.wait_for("# metrics endpoint: ");
    let addr = line.split_whitespace().nth(3).unwrap();
    let addr = addr
        .trim_start_matches("http://")
        .trim_end_matches("/metrics");
    addr.rsplit_once(':').unwrap().1.parse().unwrap()
}

/// SIGTERM, then the exit (at most two minutes).
fn stop(run: Running) {
    // SAFETY: kill(2) on our own child's pid, with a valid signal number.
    unsafe { libc::kill(run.child.id() as i32, libc::SIGTERM) };
    run.finish();
}

/// GET `path` from 127.0.0.1:`port`: (status line, content type, body).
fn get(port: u16, path: &str) -> (String, String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.lines().next().unwrap_or_default().to_string();
    let ctype = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Type: "))
        .unwrap_or_default()
        .to_string();
    (status, ctype, body.to_string())
}

/// One scrape, parsed: each family's type, and each sample (`name{labels}`) with its value.
struct Exposition {
    types: HashMap<String, String>,
    samples: HashMap<String, f64>,
}

/// Parses the OpenMetrics text format strictly enough to fail on anything malformed: every
/// sample belongs to a family declared by `# TYPE` (a counter's samples end `_total`), every
/// value is a number, and the exposition ends with `# EOF`.
fn parse(body: &str) -> Exposition {
    let mut types = HashMap::new();
    let mut samples = HashMap::new();
    let mut lines = body.lines().peekable();
    while let Some(line) = lines.next() {
        if line == "# EOF" {
            assert!(lines.peek().is_none(), "text after # EOF:\n{body}");
            return Exposition { types, samples };
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name type");
            let known = ["gauge", "counter", "info", "histogram", "unknown"];
            assert!(known.contains(&kind), "{line}");
            assert!(
                types.insert(name.to_string(), kind.to_string()).is_none(),
                "family {name} declared twice:\n{body}"
            );
            continue;
        }
        if line.starts_with("# HELP ") || line.starts_with("# UNIT ") {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("a sample: series value");
        let name = series.split('{').next().unwrap();
        let family = match name.strip_suffix("_total") {
            Some(f) if types.get(f).is_some_and(|k| k == "counter") => f,
            _ => name,
        };
        assert!(
            types.contains_key(family),
            "sample {line} of no family:\n{body}"
        );
        assert!(name.starts_with("flotilla_"), "{line}");
        let v: f64 = value.parse().unwrap_or_else(|_| panic!("value of {line}"));
        samples.insert(series.to_string(), v);
    }
    panic!("no # EOF:\n{body}");
}

/// Scrapes `port` until `flotilla_step` exceeds `after` (at most a minute).
fn scrape_past(port: u16, after: f64) -> Exposition {
    let what = format!("step past {after}");
    scrape_until(port, &what, |e| {
        e.samples.get("flotilla_step").is_some_and(|&s| s > after)
    })
}

/// Scrapes `port` until `done` holds for the exposition (at most a minute; `what` names it).
fn scrape_until(port: u16, what: &str, done: impl Fn(&Exposition) -> bool) -> Exposition {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, ctype, body) = get(port, "/metrics");
        assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
        assert!(ctype.starts_with("application/openmetrics-text"), "{ctype}");
        let e = parse(&body);
        if done(&e) {
            return e;
        }
        assert!(Instant::now() < deadline, "never saw {what}:\n{body}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `train` on MICRO with `extra` (a later flag overrides MICRO's).
fn train_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["train"];
    a.extend_from_slice(MICRO);
    a.extend_from_slice(&["--threads", "1", "--no-plan", "--steps", "100000"]);
    a.extend_from_slice(extra);
    a
}

#[test]
fn the_launcher_serves_every_rank_while_the_job_trains() {
    let mut run = start(&train_args(&["--nproc", "2", "--metrics-port", "0"]));
    let port = endpoint_port(&mut run);
    let first = scrape_past(port, 0.0);
    let types = |name: &str| first.types.get(name).map(String::as_str);
    for (name, kind) in [
        ("flotilla_step", "gauge"),
        ("flotilla_loss", "gauge"),
        ("flotilla_tokens_per_second", "gauge"),
        ("flotilla_mfu_ratio", "gauge"),
        ("flotilla_step_exposed_comm_seconds", "gauge"),
        ("flotilla_exposed_comm_seconds", "counter"),
        ("flotilla_data_stall_percent", "gauge"),
        ("flotilla_last_checkpoint_pause_seconds", "gauge"),
        ("flotilla_checkpoint_pause_seconds", "counter"),
        ("flotilla_restarts", "counter"),
        ("flotilla_rank_step_time_seconds", "gauge"),
    ] {
        assert_eq!(types(name), Some(kind), "{name}");
    }
    let s = &first.samples;
    assert_eq!(s["flotilla_world_size"], 2.0);
    assert_eq!(s["flotilla_restarts_total"], 0.0);
    assert!(s["flotilla_loss"] > 0.0 && s["flotilla_tokens_per_second"] > 0.0);
    // Each rank publishes its own step time from its own thread, which may come after the
    // first scrape that shows a step (CI of 2026-12-06 scraped before rank 0's was there).
    let r0_time = "flotilla_rank_step_time_seconds{rank=\"0\"}";
    scrape_until(port, "rank 0's step time", |e| {
        e.samples.get(r0_time).is_some_and(|&x| x > 0.0)
    });
    // Rank 1 publishes too (from its own thread, so a step or more behind rank 0 at times).
    let step = s["flotilla_step"];
    let r1 = "flotilla_rank_step{rank=\"1\"}";
    scrape_until(port, "rank 1 at rank 0's step", |e| {
        e.samples.get(r1).is_some_and(|&x| x >= step)
    });
    assert!(get(port, "/nothing").0.starts_with("HTTP/1.1 404"));
    stop(run);
}

#[test]
fn the_endpoint_outlives_a_failed_generation_and_counts_the_restart() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let mut run = start(&train_args(&[
        "--nproc",
        "2",
        "--metrics-port",
        "0",
        "--chaos",
        "kill@3:1",
        "--max-restarts",
        "2",
        "--ckpt-dir",
        ck.to_str().unwrap(),
        "--ckpt-every",
        "2",
    ]));
    let port = endpoint_port(&mut run);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let (_, _, body) = get(port, "/metrics");
        let e = parse(&body);
        let s = &e.samples;
        if s["flotilla_restarts_total"] >= 1.0 && s.get("flotilla_step").is_some_and(|&v| v > 3.0) {
            // The figures are the new generation's, every rank of it.
            assert!(s["flotilla_generation"] >= 1.0, "{body}");
            assert!(s.contains_key("flotilla_rank_step{rank=\"1\"}"), "{body}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no restart seen:\n{body}\n{}",
            run.out
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    stop(run);
}

#[test]
fn a_one_process_run_serves_its_own_figures() {
    let mut run = start(&train_args(&["--metrics-port", "0"]));
    let port = endpoint_port(&mut run);
    let first = scrape_past(port, 0.0);
    let step = first.samples["flotilla_step"];
    assert_eq!(first.samples["flotilla_world_size"], 1.0);
    scrape_past(port, step);
    stop(run);
}

/// `train` on MICRO for 6 steps with `extra`: (exit code, stdout, stderr).
fn train6(extra: &[&str]) -> (Option<i32>, String, String) {
    let mut a = vec!["train"];
    a.extend_from_slice(MICRO);
    a.extend_from_slice(&["--threads", "1", "--no-plan", "--steps", "6"]);
    a.extend_from_slice(extra);
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(&a)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// The validation losses printed: (step, loss).
fn val_losses(out: &str) -> Vec<(u64, f64)> {
    out.lines()
        .filter_map(|l| {
            let (head, rest) = l.split_once(" validation loss ")?;
            let step = head
                .strip_prefix("step")?
                .trim()
                .split('/')
                .next()?
                .parse()
                .ok()?;
            Some((step, rest.split_whitespace().next()?.parse().ok()?))
        })
        .collect()
}

#[test]
fn eval_every_reports_the_held_out_loss_without_disturbing_training() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m.jsonl");
    let m = m.to_str().unwrap();
    let (code, plain, err) = train6(&["--log-every", "1"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = train6(&["--log-every", "1", "--eval-every", "4", "--metrics", m]);
    assert_eq!(code, Some(0), "{err}");
    let vals = val_losses(&out);
    assert_eq!(
        vals.iter().map(|v| v.0).collect::<Vec<_>>(),
        [4, 6],
        "{out}"
    );
    // Near the uniform loss ln(8192) of an untrained model, and finite.
    assert!(vals.iter().all(|v| (v.1 - 9.01).abs() < 0.5), "{out}");
    // The held-out split is drawn apart: training saw the same batches with and without.
    for step in 1..=6 {
        assert_eq!(cli::loss_at(&out, step, 6), cli::loss_at(&plain, step, 6));
    }
    let text = std::fs::read_to_string(m).unwrap();
    let with: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("\"val_loss\":"))
        .collect();
    assert_eq!(with.len(), 2, "{text}");
    assert!(with[0].contains("\"step\":4,"), "{text}");
}

#[test]
fn eval_every_runs_under_each_layout_or_is_refused_before_spawning() {
    // Data parallel and ZeRO-3 hold the same model after the same steps: the same held-out
    // loss (the split is the same rows on every rank, averaged).
    let mut seen = vec![];
    for layout in [
        &["--nproc", "2"][..],
        &["--nproc", "2", "--zero", "3"],
        &["--nproc", "2", "--tp", "2"],
        &["--nproc", "2", "--experts", "2", "--ep", "2"],
    ] {
        let mut extra = layout.to_vec();
        extra.extend_from_slice(&["--eval-every", "3"]);
        let (code, out, err) = train6(&extra);
        assert_eq!(code, Some(0), "{layout:?}: {out}\n{err}");
        let vals = val_losses(&out);
        assert_eq!(
            vals.iter().map(|v| v.0).collect::<Vec<_>>(),
            [3, 6],
            "{layout:?}: {out}"
        );
        seen.push(vals[1].1);
    }
    assert!(
        (seen[0] - seen[1]).abs() < 1e-4,
        "DP {} vs ZeRO-3 {}",
        seen[0],
        seen[1]
    );
    for (layout, why) in [
        (
            &["--nproc", "2", "--pp", "2", "--layers", "2"][..],
            "--eval-every with --pp 2",
        ),
        (&["--eval-batches", "0"], "--eval-batches"),
    ] {
        let mut extra = layout.to_vec();
        extra.extend_from_slice(&["--eval-every", "3"]);
        let (code, out, err) = train6(&extra);
        assert_eq!(
            code,
            Some(if why == "--eval-batches" { 2 } else { 78 }),
            "{layout:?}: {err}"
        );
        assert!(err.contains(why), "{layout:?}: {err}");
        assert!(!out.contains("step "), "{layout:?} trained:\n{out}");
    }
}

#[test]
fn trace_writes_a_chrome_trace_per_rank() {
    let dir = tempfile::tempdir().unwrap();
    let (tr, ck) = (dir.path().join("trace"), dir.path().join("ck"));
    let (tr_s, ck_s) = (tr.to_str().unwrap(), ck.to_str().unwrap());
    let (code, out, err) = train6(&[
        "--nproc",
        "2",
        "--trace",
        tr_s,
        "--ckpt-dir",
        ck_s,
        "--ckpt-every",
        "2",
    ]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("# trace of rank 0 in "), "{out}");
    for rank in 0..2 {
        let text = std::fs::read_to_string(tr.join(format!("rank-{rank}.json"))).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).expect("trace JSON");
        let events = v["traceEvents"].as_array().expect("traceEvents");
        let mut names = std::collections::HashSet::new();
        for e in events {
            assert_eq!(e["pid"].as_u64(), Some(rank), "{e}");
            let ph = e["ph"].as_str().unwrap();
            assert!(["X", "M", "i"].contains(&ph), "{e}");
            if ph == "X" {
                assert!(e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() >= 0.0);
                assert!(e["cat"].is_string() && e["tid"].is_u64(), "{e}");
            }
            names.insert(e["name"].as_str().unwrap().to_string());
        }
        for want in [
            "process_name",
            "thread_name",
            "step 1",
            "step 6",
            "data wait",
            "compute",
            "all_reduce",
            "checkpoint copy",
        ] {
            assert!(names.contains(want), "rank {rank}: no {want} in {names:?}");
        }
    }
}

#[test]
fn report_draws_the_runs_plots() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("metrics.jsonl");
    let (code, _, err) = train6(&["--eval-every", "3", "--metrics", m.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["report", dir.path().to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["steps"], 6);
    let files: Vec<String> = v["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect();
    assert_eq!(files.len(), 6, "{files:?}");
    for f in &files {
        let bytes = std::fs::read(f).unwrap();
        if f.ends_with(".png") {
            // The PNG signature, then IHDR with the plot's size (1200 x 700).
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{f}");
            assert_eq!(&bytes[12..16], b"IHDR", "{f}");
            let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
            let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
            assert_eq!((w, h), (1200, 700), "{f}");
            assert!(
                bytes.len() > 10_000,
                "{f}: {} bytes, nearly empty",
                bytes.len()
            );
        } else {
            let text = String::from_utf8(bytes).unwrap();
            assert!(
                text.starts_with("<svg") && text.trim_end().ends_with("</svg>"),
                "{f}"
            );
            assert!(text.contains("\nstep\n"), "{f}: no x axis label");
        }
    }
    let loss = std::fs::read_to_string(dir.path().join("report/loss.svg")).unwrap();
    for label in [
        "training loss",
        "validation loss (held-out split)",
        "loss (nats/token)",
    ] {
        assert!(loss.contains(label), "{label}");
    }
    let breakdown = std::fs::read_to_string(dir.path().join("report/breakdown.svg")).unwrap();
    for label in [
        "compute",
        "exposed communication",
        "data wait",
        "checkpoint pause",
    ] {
        assert!(breakdown.contains(label), "{label}");
    }
    // Nothing to plot: a clear error.
    let empty = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["report", empty.path().to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("no metrics file"),
        "{stderr}"
    );
}
