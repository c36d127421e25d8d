//! Multi-host behaviour on one machine: ranks in separate network namespaces (TCP between hosts,
//! shared memory within a host, hierarchical algorithms), driving the real `flotilla` binary with
//! `bench comm --check`. Needs root and iproute2; elsewhere each test prints `SKIP: ...` and
//! passes (set FLOTILLA_NETNS_REQUIRED=1 to make that a failure).

#[path = "support/netns.rs"]
mod netns;

use netns::{Hosts, Outcome, run_all};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One multi-rank job at a time: the machine may have only 2 cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const PORT: u16 = 29500;
/// Launcher's own limit (it stops its workers) and the test's hard limit (it kills the groups).
const JOB_TIMEOUT_S: u64 = 40;
const TEST_TIMEOUT: Duration = Duration::from_secs(50);

/// Runs `bench comm` on every host (`nproc` ranks each) with `extra` arguments; returns the
/// outcome per node, panicking with every node's output if one failed.
fn bench(hosts: &Hosts, nproc: usize, extra: &[&str]) -> Vec<Outcome> {
    let rdzv = format!("{}:{PORT}", hosts.ip(0));
    let cmds = (0..hosts.len())
        .map(|i| {
            let mut c = hosts.command(i, BIN);
            c.args(["bench", "comm", "--rdzv", &rdzv])
                .args(["--nnodes", &hosts.len().to_string()])
                .args(["--node-rank", &i.to_string()])
                .args(["--nproc", &nproc.to_string()])
                .args(["--job-timeout-s", &JOB_TIMEOUT_S.to_string()])
                .args([
                    "--target-seconds",
                    "0.02",
                    "--max-iters",
                    "3",
                    "--min-iters",
                    "1",
                ])
                .args(extra)
                .env("FLOTILLA_SECRET", "netns-test-secret-0123456789abcdef")
                .env("FLOTILLA_TIMEOUT_S", "20")
                .env_remove("FLOTILLA_ALGO")
                .env_remove("FLOTILLA_ADDR")
                .env_remove("FLOTILLA_HOST_ID")
                .env_remove("FLOTILLA_TRANSPORT");
            c
        })
        .collect();
    let t0 = Instant::now();
    let out = run_all(cmds, TEST_TIMEOUT);
    let ok = out.iter().all(Outcome::success);
    let mut report = String::new();
    for (i, o) in out.iter().enumerate() {
        report += &format!(
            "--- node {i}: {:?}{} after {:.1}s\nstdout:\n{}\nstderr:\n{}\n",
            o.status,
            if o.timed_out {
                " (killed: test timeout)"
            } else {
                ""
            },
            o.elapsed.as_secs_f64(),
            o.stdout,
            o.stderr
        );
    }
    eprintln!(
        "bench comm {} ({} hosts x {nproc}): {:.1}s",
        extra.join(" "),
        hosts.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(ok, "bench comm {} failed:\n{report}", extra.join(" "));
    out
}

fn json_rows(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON row '{l}': {e}")))
        .collect()
}

#[test]
fn two_hosts_two_ranks_check_every_op() {
    let _serial = serial();
    let Some(hosts) = Hosts::up_or_skip("two_hosts_two_ranks_check_every_op", 2, None) else {
        return;
    };
    let sizes = ["--sizes", "8,4K,100000,1M"];
    for algo in ["ring", "hierarchical"] {
        let out = bench(
            &hosts,
            2,
            &[
                &["--check", "--json", "--ops", "all_reduce", "--algo", algo][..],
                &sizes,
            ]
            .concat(),
        );
        let rows = json_rows(&out[0].stdout);
        assert_eq!(rows.len(), 4, "one row per size:\n{}", out[0].stdout);
        for r in &rows {
            assert_eq!(r["algo"], algo, "forced algorithm ran: {r}");
            assert_eq!(r["world"], 4, "{r}");
        }
    }
    // Auto selection over every op, with the topology printed.
    let out = bench(
        &hosts,
        2,
        &[
            &[
                "--check",
                "--json",
                "--calibrate",
                "--ops",
                "all_reduce,all_gather,reduce_scatter,broadcast,reduce,all_to_all",
            ][..],
            &sizes,
        ]
        .concat(),
    );
    let stdout = &out[0].stdout;
    // Two hosts of two ranks: both transports are in use (shm inside a namespace, TCP across).
    assert!(stdout.contains("hosts 2, ranks 4"), "topology:\n{stdout}");
    assert!(
        stdout.contains("# calibrated shm:"),
        "shm within a host:\n{stdout}"
    );
    assert!(
        stdout.contains("# calibrated tcp:"),
        "tcp between hosts:\n{stdout}"
    );
    // The group timed a small all-reduce with every algorithm, the hierarchical one included
    // (it spans hosts), and its spin follows the measured round.
    let probes = stdout
        .lines()
        .find(|l| l.starts_with("# latency probes (4096 B, median us): "))
        .unwrap_or_else(|| panic!("latency probes printed:\n{stdout}"));
    for algo in ["ring", "tree", "hierarchical"] {
        assert!(
            probes.contains(&format!("all_reduce/{algo} ")),
            "{algo}: {probes}"
        );
    }
    assert!(stdout.contains(" us (spin "), "spin printed:\n{stdout}");
    let rows = json_rows(stdout);
    assert_eq!(rows.len(), 6 * 4, "one row per op and size:\n{stdout}");
    let ar_1m = rows
        .iter()
        .find(|r| r["op"] == "all_reduce" && r["size_bytes"] == 1 << 20)
        .expect("1 MiB all_reduce row");
    let algo = ar_1m["algo"].as_str().expect("algo is a string");
    assert_ne!(algo, "-", "auto selection reported no algorithm: {ar_1m}");
    eprintln!("auto-selected all_reduce algorithm for 1 MiB over 2 hosts x 2 ranks: {algo}");
    // Only node 0's rank 0 prints rows.
    assert!(json_rows(&out[1].stdout).is_empty());
    // Integer (bytes compared) and half-precision (values compared) elements, every op; then
    // TCP between every pair, as Gloo does.
    for dtype in ["i32", "bf16"] {
        bench(
            &hosts,
            2,
            &[
                "--check",
                "--dtype",
                dtype,
                "--sizes",
                "4K,100000",
                "--ops",
                "all_reduce,all_gather,reduce_scatter,broadcast,reduce,all_to_all",
            ],
        );
    }
    bench(
        &hosts,
        2,
        &[
            &[
                "--check",
                "--transport",
                "tcp",
                "--ops",
                "all_reduce,all_gather",
            ][..],
            &sizes,
        ]
        .concat(),
    );
}

#[test]
fn three_hosts_all_reduce_check() {
    let _serial = serial();
    let Some(hosts) = Hosts::up_or_skip("three_hosts_all_reduce_check", 3, None) else {
        return;
    };
    // An odd host count, with one rank per host and then two (hierarchical with g = 2, h = 3).
    for (nproc, algo) in [
        (1, None),
        (1, Some("ring")),
        (1, Some("hierarchical")),
        (2, None),
        (2, Some("hierarchical")),
    ] {
        let mut args = vec![
            "--check",
            "--json",
            "--ops",
            "all_reduce",
            "--sizes",
            "8,4K,100000,1M",
        ];
        if let Some(a) = algo {
            args.extend(["--algo", a]);
        }
        let out = bench(&hosts, nproc, &args);
        let rows = json_rows(&out[0].stdout);
        assert_eq!(rows.len(), 4, "{}", out[0].stdout);
        for r in &rows {
            assert_eq!(r["world"], 3 * nproc, "{r}");
            if let Some(a) = algo {
                assert_eq!(r["algo"], a, "{r}");
            }
        }
    }
}

#[test]
fn namespaces_are_separate_hosts_and_cleaned_up_on_panic() {
    let _serial = serial();
    let test = "namespaces_are_separate_hosts_and_cleaned_up_on_panic";
    let mut names = Vec::new();
    let mut sleeper = None;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let Some(hosts) = Hosts::up_or_skip(test, 2, Some("1gbit")) else {
            return;
        };
        names = (0..2).map(|i| hosts.ns(i)).collect();
        // The tbf qdisc is installed, and host 1 reaches host 0 over the bridge.
        let mut tc = hosts.command(0, "tc");
        tc.args(["qdisc", "show", "dev", "eth0"]);
        let out = run_all(vec![tc], Duration::from_secs(10));
        assert!(
            out[0].success() && out[0].stdout.contains("tbf"),
            "{}",
            out[0].stdout
        );
        if std::process::Command::new("ping")
            .arg("-V")
            .output()
            .is_ok()
        {
            let mut ping = hosts.command(1, "ping");
            ping.args(["-c", "1", "-W", "2", &hosts.ip(0).to_string()]);
            let out = run_all(vec![ping], Duration::from_secs(10));
            assert!(
                out[0].success(),
                "ping: {} {}",
                out[0].stdout,
                out[0].stderr
            );
        }
        // Something left running when the test panics.
        sleeper = Some(
            hosts
                .command(1, "sleep")
                .arg("600")
                .spawn()
                .expect("spawn sleep"),
        );
        panic!("deliberate panic: the namespaces must still go away");
    }));
    if names.is_empty() {
        return; // skipped
    }
    assert!(r.is_err(), "the closure panicked");
    let list = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    let list = String::from_utf8_lossy(&list.stdout);
    for n in &names {
        assert!(!list.contains(n.as_str()), "{n} left behind:\n{list}");
    }
    let mut sleeper = sleeper.expect("sleep started");
    let t0 = Instant::now();
    while sleeper.try_wait().expect("try_wait").is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "process inside a dropped host survives"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_stuck_job_is_killed_with_its_workers() {
    let _serial = serial();
    let Some(hosts) = Hosts::up_or_skip("a_stuck_job_is_killed_with_its_workers", 2, None) else {
        return;
    };
    // Node 1 never starts: node 0's two workers wait at the rendezvous until the test's limit.
    let mut c = hosts.command(0, BIN);
    c.args([
        "bench",
        "comm",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--nproc",
        "2",
    ])
    .args(["--rdzv", &format!("{}:{PORT}", hosts.ip(0))])
    .env("FLOTILLA_SECRET", "netns-test-secret-0123456789abcdef");
    let out = run_all(vec![c], Duration::from_secs(2));
    assert!(out[0].timed_out && !out[0].success());
    let t0 = Instant::now();
    while !hosts.pids(0).is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "workers survived the kill: {:?}",
            hosts.pids(0)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
