//! Per-step fault tolerance through the binary (`flotilla train --ft`, issue 29): replicas lost
//! to a deterministic chaos schedule or to SIGKILLs from outside are left out while the others
//! train on, and rejoin with a live replica's state; the same schedule gives the same bits; the
//! goodput ledger against restart-from-checkpoint with the same faults.
#[path = "support/cli.rs"]
mod cli;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc::channel;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The tests run jobs of 3 to 6 processes: one at a time on a small machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().unwrap()).path()
}

/// A small job of `nproc` workers for `steps` steps, every step logged.
fn job(nproc: usize, steps: u64, extra: &[&str]) -> Vec<String> {
    let n = nproc.to_string();
    let s = steps.to_string();
    let mut a: Vec<String> = [
        "train",
        "--config",
        "tiny",
        "--layers",
        "2",
        "--d-model",
        "64",
        "--heads",
        "2",
        "--seq-len",
        "64",
        "--batch",
        "4",
        "--threads",
        "1",
        "--nproc",
        &n,
        "--steps",
        &s,
        "--log-every",
        "1",
        "--peak-gflops",
        "10",
        "--heartbeat-timeout-s",
        "5",
        "--job-timeout-s",
        "300",
    ]
    .iter()
    .map(|x| x.to_string())
    .collect();
    a.extend(extra.iter().map(|x| x.to_string()));
    a
}

fn run(args: &[String]) -> (bool, String, String) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (st, out, err) = cli::run_with_deadline(scratch(), &args, Duration::from_secs(240));
    (st.success(), out, err)
}

/// Every "step N/M" line's step, in order.
fn steps_logged(out: &str) -> Vec<u64> {
    out.lines()
        .filter_map(|l| l.strip_prefix("step "))
        .filter_map(|l| l.split('/').next()?.trim().parse().ok())
        .collect()
}

fn count(out: &str, pat: &str) -> usize {
    out.lines().filter(|l| l.contains(pat)).count()
}

/// Runs the schedule `chaos` twice under `--ft` (`layout` flags, `nproc` workers), checks each
/// fault was survived and rejoined, and that both saved models are byte for byte the same.
fn schedule_repeats(nproc: usize, layout: &[&str], chaos: &str, faults: usize) {
    let _g = serial();
    let mut saved = Vec::new();
    for i in 0..2 {
        let dir = scratch().join(format!("ft-{nproc}-{i}"));
        let _ = std::fs::remove_dir_all(&dir);
        let mut extra = vec![
            "--ft",
            "--ft-join-after",
            "3",
            "--chaos",
            chaos,
            "--max-restarts",
        ];
        extra.extend(["5", "--save", dir.to_str().unwrap()]);
        extra.extend(layout);
        let (ok, out, err) = run(&job(nproc, 24, &extra));
        assert!(ok, "run {i} failed:\n{out}\n{err}");
        assert_eq!(
            count(&out, "# ft: replica") - count(&out, "received the state"),
            2 * faults,
            "{out}"
        );
        assert_eq!(count(&out, "its ranks restarted"), faults, "{out}");
        assert_eq!(count(&out, "rejoin time"), faults, "{out}");
        assert_eq!(count(&out, "trained without replica"), faults, "{out}");
        // No step lost on the survivors: every step committed and logged once, in order.
        assert_eq!(steps_logged(&out), (1..=24).collect::<Vec<_>>(), "{out}");
        assert!(out.contains("job finished in generation 0"), "{out}");
        saved.push(std::fs::read(dir.join("model.safetensors")).unwrap());
    }
    assert!(
        saved[0] == saved[1],
        "the same fault schedule gave different parameters"
    );
}

#[test]
fn a_fault_schedule_on_three_replicas_repeats_bit_identically() {
    schedule_repeats(3, &[], "kill@5:1,kill@13:0", 2);
}

#[test]
fn zero1_inside_two_rank_replica_groups_survives_and_repeats() {
    // Rank 3 is replica 1's second rank: its loss takes replica 1 down as a unit.
    schedule_repeats(
        6,
        &["--zero", "1", "--dp-shard", "2"],
        "kill@5:3,kill@13:0",
        2,
    );
}

/// The workers of the agent `pid` (its children).
fn workers_of(pid: u32) -> Vec<u32> {
    let path = format!("/proc/{pid}/task/{pid}/children");
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Steps per second over the steps logged in `window` (their arrival times).
fn rate(times: &[(u64, Instant)], from: u64, to: u64) -> Option<f64> {
    let at = |s: u64| times.iter().find(|(k, _)| *k == s).map(|(_, t)| *t);
    let (a, b) = (at(from)?, at(to)?);
    Some((to - from) as f64 / b.duration_since(a).as_secs_f64().max(1e-9))
}

#[test]
fn five_sigkills_from_outside_leave_the_survivors_stepping() {
    sigkills_from_outside(3, &[]);
}

#[test]
fn five_sigkills_from_outside_with_zero1_inside_two_rank_replica_groups() {
    sigkills_from_outside(6, &["--zero", "1", "--dp-shard", "2"]);
}

/// SIGKILLs a random worker of a 3-replica `--ft` job (`nproc` workers, `layout`) five times,
/// each after the previous victim rejoined and a random gap; the survivors must commit every
/// step, each loss be replaced and rejoin; prints the survivors' pace around each fault.
fn sigkills_from_outside(nproc: usize, layout: &[&str]) {
    let _g = serial();
    const STEPS: u64 = 150;
    let mut extra = vec!["--ft", "--ft-join-after", "8", "--max-restarts", "5"];
    extra.extend(layout);
    let args = job(nproc, STEPS, &extra);
    let mut child = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    // A fixed seed picks the victims and the gaps: random, and the same on every run.
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let (mut out, mut times) = (String::new(), Vec::new());
    let (mut kills, mut killed_at) = (Vec::new(), None::<u64>);
    let mut wait_until = 10 + next(10);
    let deadline = Instant::now() + Duration::from_secs(240);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "the job did not end:\n{out}");
        let Ok((t, line)) = rx.recv_timeout(Duration::from_millis(50)) else {
            continue;
        };
        out.push_str(&line);
        out.push('\n');
        if line.contains("rejoined at step") {
            killed_at = None;
        }
        let Some(step) = line.strip_prefix("step ").and_then(|l| l.split('/').next()) else {
            continue;
        };
        let step: u64 = step.trim().parse().unwrap();
        times.push((step, t));
        // The next kill once the last victim rejoined and the gap has passed.
        if kills.len() < 5 && killed_at.is_none() && step >= wait_until && step + 25 < STEPS {
            let ws = workers_of(child.id());
            if ws.len() == nproc {
                let victim = ws[next(nproc as u64) as usize];
                // SAFETY: kill(2) on a worker of our own child; no memory is involved.
                unsafe { libc::kill(victim as i32, libc::SIGKILL) };
                kills.push(step);
                killed_at = Some(step);
                wait_until = step + 20 + next(6);
            }
        }
    };
    while let Ok((_, line)) = rx.recv_timeout(Duration::from_secs(2)) {
        out.push_str(&line);
        out.push('\n');
    }
    assert!(status.success(), "the job failed:\n{out}");
    assert_eq!(kills.len(), 5, "{out}");
    assert_eq!(count(&out, "its ranks restarted"), 5, "{out}");
    assert_eq!(count(&out, "rejoin time"), 5, "{out}");
    // No step lost on the survivors: every step was committed and logged once, in order.
    assert_eq!(steps_logged(&out), (1..=STEPS).collect::<Vec<_>>(), "{out}");
    // The survivors' pace around each fault (a measurement, printed: docs/PERFORMANCE.md).
    for k in &kills {
        let before = rate(&times, k.saturating_sub(10), *k);
        let after = rate(&times, *k, k + 10);
        if let (Some(b), Some(a)) = (before, after) {
            println!(
                "{nproc} workers {layout:?}: fault after step {k}: {b:.1} steps/s over the 10 steps before, {a:.1} over \
                 the 10 after: {:.2} of the rate before",
                a / b
            );
        }
    }
    for l in out.lines().filter(|l| l.contains("rejoin time")) {
        println!("{l}");
    }
}

/// The run row of a goodput ledger.
fn ledger_run(out: &str) -> String {
    out.lines()
        .find(|l| l.starts_with("# goodput ledger, run:"))
        .unwrap_or_else(|| panic!("no ledger:\n{out}"))
        .to_string()
}

/// `N` in "lost steps recomputed N".
fn recomputed(row: &str) -> u64 {
    let at = row.find("recomputed ").unwrap() + "recomputed ".len();
    row[at..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn the_goodput_ledger_shows_the_work_saved_against_restarts() {
    let _g = serial();
    let chaos = "kill@8:1,kill@19:2,kill@30:0";
    let ft_metrics = scratch().join("ft.jsonl");
    let rs_metrics = scratch().join("restart.jsonl");
    let ckpt = scratch().join("restart-ckpt");
    let _ = std::fs::remove_file(&ft_metrics);
    let _ = std::fs::remove_file(&rs_metrics);
    let ft = job(
        3,
        40,
        &[
            "--ft",
            "--ft-join-after",
            "4",
            "--chaos",
            chaos,
            "--max-restarts",
            "3",
            "--metrics",
            ft_metrics.to_str().unwrap(),
        ],
    );
    let (ok, ft_out, err) = run(&ft);
    assert!(ok, "{ft_out}\n{err}");
    let rs = job(
        3,
        40,
        &[
            "--chaos",
            chaos,
            "--max-restarts",
            "3",
            "--ckpt-every",
            "5",
            "--ckpt-dir",
            ckpt.to_str().unwrap(),
            "--metrics",
            rs_metrics.to_str().unwrap(),
        ],
    );
    let (ok, rs_out, err) = run(&rs);
    assert!(ok, "{rs_out}\n{err}");
    let (ft_row, rs_row) = (ledger_run(&ft_out), ledger_run(&rs_out));
    println!("--ft:     {ft_row}\nrestarts: {rs_row}");
    // Under --ft one generation, each fault costing the one step it hit; with restarts every
    // fault loses the steps since the last checkpoint on every rank, and a restart.
    assert_eq!(
        count(&ft_out, "# goodput ledger, generation"),
        1,
        "{ft_out}"
    );
    // At most the one step each fault hit (none when the loss was declared before the
    // survivors composed that step's quorum: a matter of timing).
    assert!(recomputed(&ft_row) <= 3, "{ft_row}");
    // Each loss is a failure of the ledger (the metrics file's goodput record).
    let metrics = std::fs::read_to_string(&ft_metrics).unwrap();
    let goodput = metrics
        .lines()
        .rfind(|l| l.contains("\"goodput\""))
        .unwrap_or_default();
    assert!(goodput.contains("\"failures\":3"), "{goodput}");
    assert!(ft_row.contains("restart 0.00 s"), "{ft_row}");
    assert_eq!(
        count(&rs_out, "# goodput ledger, generation"),
        4,
        "{rs_out}"
    );
    assert!(recomputed(&rs_row) > 3, "{rs_row}");
    assert!(
        recomputed(&rs_row) > recomputed(&ft_row),
        "{ft_row}\n{rs_row}"
    );
}

#[test]
fn what_ft_does_not_build_is_refused_before_any_worker_starts() {
    let _g = serial();
    for (extra, named) in [
        (vec!["--tp", "2"], "--tp 2"),
        (vec!["--zero", "1"], "--zero 1 without --dp-shard"),
        (vec!["--zero", "2", "--dp-shard", "2"], "--zero 2"),
        (vec!["--eval-every", "2"], "--eval-every"),
    ] {
        let mut e = vec!["--ft"];
        e.extend(extra);
        let (ok, out, err) = run(&job(4, 4, &e));
        assert!(!ok, "{extra:?} ran:\n{out}", extra = e);
        assert!(err.contains(named) && err.contains("--ft"), "{err}");
        assert!(!out.contains("step "), "{out}");
    }
    let (ok, _, err) = run(&job(1, 4, &["--ft"]));
    assert!(!ok && err.contains("at least two"), "{err}");
}

#[test]
fn checkpoints_under_ft_are_saved_by_a_live_replica_and_resume_exactly() {
    let _g = serial();
    let ck = scratch().join("ft-ckpt");
    let (resumed, whole) = (scratch().join("ft-resumed"), scratch().join("ft-whole"));
    for d in [&ck, &resumed, &whole] {
        let _ = std::fs::remove_dir_all(d);
    }
    let (ck_s, resumed_s, whole_s) = (
        ck.to_str().unwrap(),
        resumed.to_str().unwrap(),
        whole.to_str().unwrap(),
    );
    let ft = [
        "--ft",
        "--ft-join-after",
        "3",
        "--ckpt-dir",
        ck_s,
        "--ckpt-every",
        "4",
    ];
    // Replica 0, the saver, is lost after step 5: replica 1 saves until it rejoins.
    let mut first = ft.to_vec();
    first.extend(["--chaos", "kill@5:0"]);
    let (ok, out, err) = run(&job(3, 20, &first));
    assert!(ok, "{out}\n{err}");
    for step in [4, 8, 12, 16, 20] {
        assert!(out.contains(&format!("# checkpoint step {step}:")), "{out}");
    }
    assert!(out.contains("rejoined at step 9"), "{out}");
    let (ok, v, err) = cli::flotilla(&["ckpt", "verify", ck_s, "--no-progress"]);
    assert!(ok, "{v}\n{err}");
    // Resumed to step 24, it ends where one run of 24 steps with the same fault ends.
    let mut more = ft.to_vec();
    more.extend(["--save", resumed_s]);
    let (ok, out, err) = run(&job(3, 24, &more));
    assert!(ok && out.contains("step 20"), "{out}\n{err}");
    let one = [
        "--ft",
        "--ft-join-after",
        "3",
        "--chaos",
        "kill@5:0",
        "--save",
        whole_s,
    ];
    let (ok, out, err) = run(&job(3, 24, &one));
    assert!(ok, "{out}\n{err}");
    let model = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(
        model(&resumed) == model(&whole),
        "resuming a --ft run from its checkpoint changed the parameters"
    );
}
