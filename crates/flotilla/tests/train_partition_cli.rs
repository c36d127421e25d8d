//! `flotilla train --chaos partition@...` and `--chaos soak:N` (issue 29) through the binary:
//! three agents on this machine as three nodes of a rigid job, one worker each.
//!
//! A partition cuts node 2 (its agent and worker) off the network for a while: nothing is
//! closed, so the other nodes notice it only when their collectives time out waiting for rank
//! 2 (`FLOTILLA_TIMEOUT_S`, [`COLLECTIVE_TIMEOUT_S`] here); the generation fails, node 2 heals,
//! follows the job into the next generation, and every node resumes from the last committed
//! checkpoint: the saved model is byte for byte the undisturbed run's. A short soak (4 faults of
//! every kind drawn from a seed) ends the same way, with the goodput ledger beside the
//! planner's figure. The scenarios run one at a time (a lock): the timeouts are short.
#[path = "support/cli.rs"]
mod cli;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};

const STEPS: u64 = 16;
/// The collectives' timeout: how long the other nodes wait for a silent one (the partition
/// lasts twice that by default).
const COLLECTIVE_TIMEOUT_S: &str = "4";
const NODES: usize = 3;

static SERIAL: Mutex<()> = Mutex::new(());

/// What each node printed, and whether it succeeded.
struct Job {
    ok: Vec<bool>,
    out: Vec<String>,
    err: Vec<String>,
}

impl Job {
    fn report(&self) -> String {
        let mut r = String::new();
        for i in 0..self.out.len() {
            r += &format!(
                "--- node {i}: ok {}\n{}\n{}\n",
                self.ok[i], self.out[i], self.err[i]
            );
        }
        r
    }
}

/// MICRO on [`NODES`] agents of one worker (one thread, 2 rows) as a rigid job with a store on
/// a free local port, checkpoints every 2 steps in `dir`/ck, the model saved in `dir`/model,
/// plus `extra` on every node.
fn job(dir: &Path, extra: &[&str]) -> Job {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let rdzv = format!("127.0.0.1:{port}");
    let (ck, save) = (dir.join("ck"), dir.join("model"));
    let steps = STEPS.to_string();
    let nodes = NODES.to_string();
    let children: Vec<_> = (0..NODES)
        .map(|i| {
            let mut args = cli::train_micro_without(&["--threads", "--batch", "--nproc"]);
            let node = i.to_string();
            let common = [
                "--threads",
                "1",
                "--batch",
                "2",
                "--nproc",
                "1",
                "--nnodes",
                &nodes,
                "--node-rank",
                &node,
                "--rdzv",
                &rdzv,
                "--log-every",
                "1",
                "--steps",
                &steps,
                "--ckpt-dir",
                ck.to_str().unwrap(),
                "--ckpt-every",
                "2",
                "--ckpt-sync",
                "--save",
                save.to_str().unwrap(),
                "--heartbeat-timeout-s",
                "3",
                "--admission-timeout-s",
                "60",
                "--job-timeout-s",
                "240",
            ];
            args.extend(common.iter().chain(extra).map(|s| s.to_string()));
            let child = Command::new(env!("CARGO_BIN_EXE_flotilla"))
                .args(&args)
                .env("FLOTILLA_SECRET", "partition-test-secret-0123456789")
                .env("FLOTILLA_TIMEOUT_S", COLLECTIVE_TIMEOUT_S)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start an agent");
            // Node 0 binds the store first; the others retry anyway.
            std::thread::sleep(std::time::Duration::from_millis(50));
            child
        })
        .collect();
    let mut j = Job {
        ok: Vec::new(),
        out: Vec::new(),
        err: Vec::new(),
    };
    for c in children {
        let o = c.wait_with_output().unwrap();
        j.ok.push(o.status.success());
        j.out.push(String::from_utf8_lossy(&o.stdout).into());
        j.err.push(String::from_utf8_lossy(&o.stderr).into());
    }
    j
}

/// The undisturbed job's saved model directory (made once).
fn straight() -> &'static tempfile::TempDir {
    static STRAIGHT: OnceLock<tempfile::TempDir> = OnceLock::new();
    STRAIGHT.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let j = job(dir.path(), &[]);
        assert!(
            j.ok.iter().all(|&ok| ok),
            "straight job failed:\n{}",
            j.report()
        );
        dir
    })
}

/// The saved model of the job in `dir` is byte for byte the undisturbed job's.
fn assert_same_model(dir: &Path) {
    for file in ["model.safetensors", "flotilla.json"] {
        let a = std::fs::read(straight().path().join("model").join(file)).unwrap();
        let b = std::fs::read(dir.join("model").join(file)).unwrap();
        assert!(a == b, "{file} differs from the undisturbed job's");
    }
}

fn assert_has(text: &str, needle: &str, report: &str) {
    assert!(text.contains(needle), "no {needle:?} in:\n{report}");
}

#[test]
fn a_partitioned_node_is_noticed_by_its_silence_and_the_job_recovers_bit_identically() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    straight();
    let dir = tempfile::tempdir().unwrap();
    let j = job(
        dir.path(),
        &[
            "--chaos",
            "partition@5:2",
            "--chaos-seed",
            "1",
            "--max-restarts",
            "1",
        ],
    );
    let report = j.report();
    assert!(j.ok.iter().all(|&ok| ok), "{report}");
    // Node 0 resolved the fault: node 2, for the default of twice the collectives' timeout.
    assert_has(
        &j.out[0],
        "# node 0: chaos: partition@5:2:8 (seed 1): node 2 will be cut off the network for 8 s \
         after step 5 in generation 0",
        &report,
    );
    // Node 2's agent and worker cut themselves off and healed.
    assert_has(
        &j.out[2],
        "# node 2: chaos: partition@5:2:8: this node is cut off the network for 8 s after step 5",
        &report,
    );
    assert_has(&j.out[2], "partition healed after ", &report);
    assert_has(
        &j.err[2],
        "rank 2 (node 2) is cut off the network for 8 s",
        &report,
    );
    // The other nodes noticed by their timeout, waiting for rank 2: silence, not a closed link.
    for i in 0..2 {
        assert_has(&j.err[i], "timeout after 4s in ", &report);
        assert!(!j.err[i].contains("peer closed"), "node {i}: {report}");
    }
    // Rank 0 receives from rank 2 in the ring (rank 1 then waits for rank 0).
    let silent = "waiting for rank 2";
    assert!(
        j.err[0].contains(silent) || j.err[1].contains(silent),
        "no {silent:?} in:\n{report}"
    );
    assert_has(&j.out[0], "# node 0: generation 0 failed: ", &report);
    // Node 2 followed the job into generation 1, which resumed from the last checkpoint.
    assert_has(&j.out[2], "# node 2: restarting with generation 1", &report);
    assert_has(&j.out[0], "generation 1 resumes from step 4", &report);
    assert_has(
        &j.out[0],
        "# job finished in generation 1 after 1 restart(s)",
        &report,
    );
    assert_same_model(dir.path());
}

#[test]
fn a_short_soak_of_every_kind_of_fault_is_recovered_bit_identically() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    straight();
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m.jsonl");
    // Seed 9 draws slow, kill, partition, hang: episodes [slow, kill], [partition], [hang].
    let j = job(
        dir.path(),
        &[
            "--chaos",
            "soak:4",
            "--chaos-seed",
            "9",
            "--max-restarts",
            "3",
            "--metrics",
            m.to_str().unwrap(),
        ],
    );
    let report = j.report();
    assert!(j.ok.iter().all(|&ok| ok), "{report}");
    let out = &j.out[0];
    assert_has(
        out,
        "# node 0: chaos: soak:4 (seed 9): 1 kill, 1 hang, 1 partition, 1 slow; 3 fail their \
         generation (--max-restarts 3)",
        &report,
    );
    for (kind, g) in [("slow", 0), ("kill", 0), ("partition", 1), ("hang", 2)] {
        let tag = format!("# node 0: chaos: {kind}@");
        let line = (out.lines())
            .find(|l| l.starts_with(&tag))
            .unwrap_or_else(|| panic!("no {tag:?} in:\n{report}"));
        assert!(line.ends_with(&format!("in generation {g}")), "{line}");
    }
    for g in 0..3 {
        assert_has(out, &format!("# node 0: generation {g} failed: "), &report);
    }
    assert_has(
        out,
        "# job finished in generation 3 after 3 restart(s)",
        &report,
    );
    assert_has(out, "# goodput ledger, run: ", &report);
    assert_has(out, "# goodput beside the planner: measured ", &report);
    assert_has(out, "(3 failures)", &report);
    assert_same_model(dir.path());
}
