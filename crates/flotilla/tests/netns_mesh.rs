//! Placement across hosts (issue 8; 000 "层级感知并行", §2.20): two network-namespace "hosts"
//! with one worker each run `flotilla train --tp 2`, a tensor-parallel group that would span
//! both hosts. Without `--force-placement` every worker refuses before training, naming the
//! group, its hosts and why, and the agent ends the job at once instead of restarting it (the
//! same layout would be refused again). Forced, the job trains, prints the placement warning
//! and the planner's linter warns about the same layout (`tp-across-nodes`). Needs root and
//! iproute2; elsewhere each test prints `SKIP: ...` and passes (set FLOTILLA_NETNS_REQUIRED=1 to
//! make that a failure).

#[path = "support/cli.rs"]
mod cli;
#[path = "support/netns.rs"]
mod netns;

use cli::micro_on_node;
use netns::{Hosts, Outcome, run_all};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// One job at a time: the machine may have only 2 cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const PORT: u16 = 29540;
const STEPS: u64 = 3;
const JOB_TIMEOUT_S: u64 = 60;
const TEST_TIMEOUT: Duration = Duration::from_secs(90);

/// MICRO with one worker per host, TP 2 across the two hosts.
fn train_args(node: usize, rdzv: &str, extra: &[&str]) -> Vec<String> {
    let mut args = micro_on_node(node, rdzv);
    let steps = STEPS.to_string();
    let job_timeout = JOB_TIMEOUT_S.to_string();
    let rest = [
        "--nnodes",
        "2",
        "--steps",
        &steps,
        "--log-every",
        "1",
        "--tp",
        "2",
        "--max-restarts",
        "3",
        "--admission-timeout-s",
        "20",
        "--job-timeout-s",
        &job_timeout,
    ];
    args.extend(rest.iter().map(|s| s.to_string()));
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Runs the two-host job with `extra` flags; returns each host's outcome and a report.
fn run_job(hosts: &Hosts, extra: &[&str]) -> (Vec<Outcome>, String) {
    let rdzv = format!("{}:{PORT}", hosts.ip(0));
    let cmds = (0..hosts.len())
        .map(|i| {
            let mut c = hosts.job_command(i, BIN, "netns-mesh-secret-0123456789abcdef", 30);
            c.args(train_args(i, &rdzv, extra));
            c
        })
        .collect();
    let out = run_all(cmds, TEST_TIMEOUT);
    let report = netns::report(&out);
    (out, report)
}

#[test]
fn a_tp_group_across_two_hosts_is_refused_and_not_restarted() {
    let _serial = serial();
    let test = "a_tp_group_across_two_hosts_is_refused_and_not_restarted";
    let Some(hosts) = Hosts::up_or_skip(test, 2, None) else {
        return;
    };
    let (out, report) = run_job(&hosts, &[]);
    for o in &out {
        assert!(!o.success() && !o.timed_out, "{report}");
    }
    let all = out
        .iter()
        .map(|o| format!("{}{}", o.stdout, o.stderr))
        .collect::<String>();
    // The worker's refusal names the group, both hosts and why.
    for needle in [
        "mesh placement",
        "tp group",
        "--force-placement",
        "refused its configuration",
        "not restarted",
    ] {
        assert!(
            all.to_lowercase().contains(&needle.to_lowercase()),
            "no {needle:?}\n{report}"
        );
    }
    assert!(
        !all.contains("restart 1/"),
        "a refusal was restarted\n{report}"
    );
    assert!(!all.contains("step      1/"), "it trained\n{report}");
}

#[test]
fn forced_it_trains_and_the_planner_warns() {
    let _serial = serial();
    let test = "forced_it_trains_and_the_planner_warns";
    let Some(hosts) = Hosts::up_or_skip(test, 2, None) else {
        return;
    };
    let (out, report) = run_job(&hosts, &["--force-placement"]);
    assert!(out[0].success() && out[1].success(), "{report}");
    let out0 = &out[0].stdout;
    for needle in [
        "# mesh: dp 1 x pp 1 x tp 2 over 2 workers on 2 host(s)",
        "# warning (placement, forced): ",
        "# planner warning [tp-across-nodes]: tp 2 > 1 devices per node",
        &format!("step {STEPS:>6}/{STEPS} loss "),
        "# done: ",
    ] {
        assert!(out0.contains(needle), "no {needle:?}\n{report}");
    }
}
