//! `flotilla train --chaos`: workers killed, stopped or stalled mid-run are caught (exit
//! status, heartbeat timeout, watchdog), the whole gang restarts from the last committed
//! checkpoint, and the run ends bit-identical to an uninterrupted one; an elastic job
//! (`NNODES=2:3`) that loses one of its three agents goes on with the other two.
//!
//! The scenarios run one at a time (a lock), so the small detection timeouts bound failures on a
//! loaded machine rather than racing other tests' workers.
#[path = "support/cli.rs"]
mod cli;

use cli::loss_at;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};

const STEPS: u64 = 8;

/// One scenario at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// MICRO on 2 workers x 2 rows, one thread each, every step logged, for `STEPS` steps, bounded
/// by a job timeout, plus `extra`.
fn args(extra: &[&str]) -> Vec<String> {
    let mut args = cli::train_micro_without(&["--threads", "--batch", "--nproc"]);
    let steps = STEPS.to_string();
    let common = [
        "--threads",
        "1",
        "--batch",
        "2",
        "--nproc",
        "2",
        "--log-every",
        "1",
        "--steps",
        &steps,
        "--job-timeout-s",
        "300",
    ];
    args.extend(common.iter().chain(extra).map(|s| s.to_string()));
    args
}

fn run(extra: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(args(extra))
        .output()
        .expect("run flotilla");
    text(out)
}

fn text(out: Output) -> (bool, String, String) {
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// The uninterrupted run's stdout and saved model directory (made once).
fn straight() -> &'static (String, tempfile::TempDir) {
    static STRAIGHT: OnceLock<(String, tempfile::TempDir)> = OnceLock::new();
    STRAIGHT.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let save = dir.path().join("model");
        let (ok, out, err) = run(&["--save", save.to_str().unwrap()]);
        assert!(ok, "straight run failed: {err}\n{out}");
        (out, dir)
    })
}

/// The number after `prefix` in the first line of `out` containing it.
fn number_after(out: &str, prefix: &str) -> u64 {
    let at = out
        .find(prefix)
        .unwrap_or_else(|| panic!("no {prefix:?} in:\n{out}"));
    out[at + prefix.len()..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect::<String>()
        .parse()
        .unwrap_or_else(|_| panic!("no number after {prefix:?} in:\n{out}"))
}

/// Checks the recovered run against the straight one: the losses of every step after the
/// restart, and the saved model byte for byte. Returns (resumed step, recovery seconds).
fn check_recovered(out: &str, save: &Path) -> (u64, f64) {
    let (reference, dir) = straight();
    let restart = out
        .find("# restart 1/")
        .unwrap_or_else(|| panic!("no restart in:\n{out}"));
    let after = &out[restart..];
    let resumed = number_after(after, "resumes from step ");
    for step in resumed + 1..=STEPS {
        assert_eq!(
            loss_at(after, step, STEPS),
            loss_at(reference, step, STEPS),
            "step {step} after the restart:\n{out}"
        );
    }
    for file in ["model.safetensors", "flotilla.json"] {
        let a = std::fs::read(dir.path().join("model").join(file)).unwrap();
        let b = std::fs::read(save.join(file)).unwrap();
        assert!(a == b, "{file} differs from the uninterrupted run's");
    }
    let tag = "time from failure to training again: ";
    let at = after.find(tag).unwrap_or_else(|| panic!("{out}"));
    let secs: f64 = after[at + tag.len()..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        out.contains("job finished in generation 1 after 1 restart(s)"),
        "{out}"
    );
    (resumed, secs)
}

/// A checkpointed run (every 2 steps, synchronous) that saves its model, with the chaos and
/// detection options `extra`; returns the outcome and the saved model's directory (kept alive by
/// the returned temporary directory).
fn recovering_run(extra: &[&str]) -> (bool, String, String, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (ck, save) = (dir.path().join("ck"), dir.path().join("model"));
    let mut all = vec![
        "--ckpt-dir",
        ck.to_str().unwrap(),
        "--ckpt-every",
        "2",
        "--ckpt-sync",
        "--save",
        save.to_str().unwrap(),
    ];
    all.extend_from_slice(extra);
    let (ok, out, err) = run(&all);
    (ok, out, err, save, dir)
}

#[test]
fn a_worker_killed_at_a_random_step_is_replaced_bit_identically() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    straight();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("chaos seed {seed}");
    let seed_text = seed.to_string();
    let (ok, out, err, save, _dir) =
        recovering_run(&["--chaos", "kill@random", "--chaos-seed", &seed_text]);
    assert!(ok, "seed {seed}: {err}\n{out}");
    let plan = out
        .lines()
        .find(|l| l.starts_with("# chaos: kill@"))
        .unwrap_or_else(|| panic!("no chaos plan in:\n{out}"));
    let rank = number_after(plan, "): rank ");
    let step = number_after(plan, "SIGKILL itself after step ");
    assert!(
        out.contains(&format!(
            "generation 0 failed: rank {rank} was killed by signal 9 (SIGKILL) after step {step}"
        )),
        "seed {seed}: {out}"
    );
    let (resumed, secs) = check_recovered(&out, &save);
    // Lost at most the steps since the last checkpoint (every 2 steps).
    assert!(
        resumed <= step && step - resumed <= 2 && resumed % 2 == 0,
        "seed {seed}: killed after {step}, resumed from {resumed}"
    );
    let lost = number_after(&out, "steps lost: ");
    assert_eq!(lost, step - resumed, "{out}");
    eprintln!("kill after step {step}: resumed from {resumed}, training again after {secs} s");
}

#[test]
fn a_stopped_worker_is_caught_by_its_missing_heartbeat() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    straight();
    let (ok, out, err, save, _dir) =
        recovering_run(&["--chaos", "hang@3:1", "--heartbeat-timeout-s", "4"]);
    assert!(ok, "{err}\n{out}");
    assert!(
        out.contains("generation 0 failed: rank 1 missed heartbeats for"),
        "{out}"
    );
    let (resumed, secs) = check_recovered(&out, &save);
    assert_eq!(resumed, 2, "{out}");
    eprintln!("SIGSTOP after step 3: training again after {secs} s");
}

#[test]
fn a_stalled_worker_is_caught_by_the_watchdog_and_a_corrupt_checkpoint_is_skipped() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    straight();
    // Rank 0 stalls outside a step while rank 1 waits inside the next one: rank 0 is named.
    let (ok, out, err, save, dir) =
        recovering_run(&["--chaos", "stall@5:0,corrupt-newest", "--watchdog-s", "6"]);
    let ck = dir.path().join("ck");
    assert!(ok, "{err}\n{out}");
    assert!(
        out.contains("generation 0 failed: rank 0 stalled: its step did not advance for"),
        "{out}"
    );
    assert!(
        out.contains("corrupted the newest committed checkpoint, step 4"),
        "{out}"
    );
    assert!(out.contains("checkpoint rejected (lost): step 4"), "{out}");
    let (resumed, secs) = check_recovered(&out, &save);
    assert_eq!(resumed, 2, "{out}");
    assert!(ck.join("step-4.rejected").is_dir());
    eprintln!("stall after step 5 + corrupt step 4: training again after {secs} s");
}

#[test]
fn without_restarts_a_failure_ends_the_job_and_is_named() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (ok, out, err) = run(&["--max-restarts", "0", "--chaos", "kill@2:1"]);
    assert!(!ok, "{out}");
    assert!(
        err.contains("rank 1 was killed by signal 9 (SIGKILL) after step 2")
            && err.contains("restarts exhausted: 0 of --max-restarts 0"),
        "{err}"
    );
    // Bad chaos plans and bad timeouts are refused by name before anything starts.
    for (extra, needle) in [
        (&["--chaos", "explode@3"][..], "explode@3"),
        (&["--chaos", "kill@8"][..], "--steps 8"),
        (&["--chaos", "corrupt-newest"][..], "--ckpt-dir"),
        (&["--watchdog-s", "0"][..], "--watchdog-s"),
    ] {
        let (ok, _, err) = run(extra);
        assert!(!ok && err.contains(needle), "{extra:?}: {err}");
    }
}

#[test]
fn two_agents_as_two_nodes_restart_together() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    straight();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let rdzv = format!("127.0.0.1:{port}");
    let dir = tempfile::tempdir().unwrap();
    let (ck, save) = (dir.path().join("ck"), dir.path().join("model"));
    let node = |rank: &str| {
        Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .args(args(&[
                "--nproc",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--rdzv",
                &rdzv,
                "--ckpt-dir",
                ck.to_str().unwrap(),
                "--ckpt-every",
                "2",
                "--ckpt-sync",
                "--chaos",
                "kill@3:1",
                "--save",
                save.to_str().unwrap(),
            ]))
            .env("FLOTILLA_SECRET", "two-node-test-secret")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start an agent")
    };
    let (n0, n1) = (node("0"), node("1"));
    let (ok1, out1, err1) = text(n1.wait_with_output().unwrap());
    let (ok0, out0, err0) = text(n0.wait_with_output().unwrap());
    assert!(ok0 && ok1, "node 0: {err0}\n{out0}\nnode 1: {err1}\n{out1}");
    // Rank 1 ran on node 1; node 0 stopped its healthy rank 0 on the job's failure key.
    assert!(
        out1.contains("# node 1: generation 0 failed: rank 1 was killed by signal 9"),
        "{out1}"
    );
    assert!(
        out0.contains("# node 0: generation 0 failed: rank 1 was killed"),
        "{out0}"
    );
    assert!(out1.contains("restarting with generation 1"), "{out1}");
    let (resumed, _) = check_recovered(&out0.replace("# node 0: ", "# "), &save);
    assert_eq!(resumed, 2, "{out0}");
}

/// An elastic job (torchrun's `NNODES=2:3`) of three agents on this machine: agent 2 is killed
/// (SIGKILL; its worker follows it) mid-run, and agents 0 and 1 go on as generation 1 with world
/// 2 from the last committed checkpoint (issue 6; the netns test does the same across hosts).
#[test]
fn an_elastic_job_goes_on_when_one_of_three_agents_is_killed() {
    use std::process::{Child, Stdio};
    use std::time::{Duration, Instant};
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let rdzv = format!("127.0.0.1:{port}");
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    const LONG: u64 = 40;
    let steps = LONG.to_string();
    let out_file = |rank: usize| dir.path().join(format!("node{rank}.out"));
    let err_file = |rank: usize| dir.path().join(format!("node{rank}.err"));
    let node = |rank: usize| -> Child {
        Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .args(args(&[
                "--nproc",
                "1",
                "--node-rank",
                &rank.to_string(),
                "--rdzv",
                &rdzv,
                "--steps",
                &steps,
                "--ckpt-dir",
                ck.to_str().unwrap(),
                "--ckpt-every",
                "2",
                "--ckpt-sync",
                "--heartbeat-timeout-s",
                "5",
                "--admission-timeout-s",
                "20",
                "--job-timeout-s",
                "90",
            ]))
            .env("NNODES", "2:3")
            .env_remove("NODE_RANK")
            .env_remove("NPROC_PER_NODE")
            .env("FLOTILLA_SECRET", "elastic-test-secret")
            .env("FLOTILLA_TIMEOUT_S", "30")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(out_file(rank)).unwrap())
            .stderr(std::fs::File::create(err_file(rank)).unwrap())
            .spawn()
            .expect("start an agent")
    };
    let mut nodes: Vec<Child> = (0..3).map(node).collect();
    let read = |rank: usize| {
        let out = std::fs::read_to_string(out_file(rank)).unwrap_or_default();
        let err = std::fs::read_to_string(err_file(rank)).unwrap_or_default();
        (out, err)
    };
    let report = || {
        (0..3)
            .map(|r| {
                let (o, e) = read(r);
                format!("--- node {r}:\n{o}\n{e}\n")
            })
            .collect::<String>()
    };
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(120);
    let cut = format!("step {:>6}/{LONG} loss ", 4);
    while !read(0).0.contains(&cut) {
        if Instant::now() >= deadline || nodes[0].try_wait().unwrap().is_some() {
            nodes.iter_mut().for_each(|n| drop(n.kill()));
            panic!("node 0 never reached step 4:\n{}", report());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    nodes[2].kill().unwrap();
    let mut ok = [false; 2];
    for (i, n) in nodes.iter_mut().enumerate().take(2) {
        loop {
            if let Some(st) = n.try_wait().unwrap() {
                ok[i] = st.success();
                break;
            }
            if Instant::now() >= deadline {
                drop(n.kill());
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    drop(nodes[2].wait());
    let wall = t0.elapsed();
    let (out0, out1) = (read(0).0, read(1).0);
    assert!(ok[0] && ok[1], "{}", report());
    for line in [
        "# node 0: generation 0 admitted nodes [0, 1, 2] (3 of --nnodes 2:3): world 3",
        "# node 0: generation 1 admitted nodes [0, 1] (2 of --nnodes 2:3): world 2",
        "# job finished in generation 1 after 1 restart(s)",
    ] {
        assert!(out0.contains(line), "no {line:?}:\n{}", report());
    }
    assert!(
        out1.contains("# node 1: restarting with generation 1"),
        "{}",
        report()
    );
    let resumed = number_after(&out0, "generation 1 resumes from step ");
    assert!(
        resumed >= 2 && resumed.is_multiple_of(2),
        "resumed at {resumed}:\n{}",
        report()
    );
    let last: f64 = loss_at(&out0, LONG, LONG).parse().unwrap();
    let first: f64 = loss_at(&out0, 1, LONG).parse().unwrap();
    assert!(last.is_finite() && last < first, "{first} -> {last}");
    assert!(
        wall < Duration::from_secs(60),
        "took {wall:?}:\n{}",
        report()
    );
}

/// Chaos in every generation (issue 29): the plan's first fault strikes in generation 0, the
/// second in generation 1 (the restart the first caused); both are recovered and the saved
/// model is byte for byte the uninterrupted run's.
#[test]
fn a_fault_in_each_generation_is_recovered_bit_identically() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (reference, dir) = straight();
    let metrics = tempfile::tempdir().unwrap();
    let m = metrics.path().join("m.jsonl");
    let (ok, out, err, save, _dir) = recovering_run(&[
        "--chaos",
        "kill@2:1,kill@5:0",
        "--max-restarts",
        "2",
        "--metrics",
        m.to_str().unwrap(),
    ]);
    assert!(ok, "{err}\n{out}");
    // The goodput ledger: generation 1 trained step 5 again in generation 2 (resumed from 4).
    for line in [
        "# goodput ledger, generation 0: 2 steps",
        "# goodput ledger, generation 1: 3 steps",
        "lost steps recomputed 1 (",
        "# goodput ledger, run: 9 steps",
        "# goodput beside the planner: measured ",
        "(2 failures)",
    ] {
        assert!(out.contains(line), "no {line:?} in:\n{out}");
    }
    let tail = std::fs::read_to_string(&m).unwrap();
    assert!(
        tail.lines().last().unwrap().contains(r#""kind":"goodput""#),
        "{tail}"
    );
    for line in [
        "# chaos: kill@2:1 (seed ",
        "rank 1 will SIGKILL itself after step 2 in generation 0",
        "generation 0 failed: rank 1 was killed by signal 9 (SIGKILL) after step 2",
        "# chaos: kill@5:0 (seed ",
        "rank 0 will SIGKILL itself after step 5 in generation 1",
        "generation 1 failed: rank 0 was killed by signal 9 (SIGKILL) after step 5",
        "job finished in generation 2 after 2 restart(s)",
    ] {
        assert!(out.contains(line), "no {line:?} in:\n{out}");
    }
    let last = out.rfind("# restart 2/").unwrap();
    assert_eq!(
        loss_at(&out[last..], STEPS, STEPS),
        loss_at(reference, STEPS, STEPS)
    );
    for file in ["model.safetensors", "flotilla.json"] {
        let a = std::fs::read(dir.path().join("model").join(file)).unwrap();
        let b = std::fs::read(save.join(file)).unwrap();
        assert!(a == b, "{file} differs from the uninterrupted run's");
    }
    // More failing faults than the restarts could ever reach are refused up front.
    let (ok, _, err) = run(&["--chaos", "kill@2:1,kill@3:1", "--max-restarts", "0"]);
    assert!(
        !ok && err.contains("--chaos") && err.contains("could fire"),
        "{err}"
    );
}
