//! A chaos partition across hosts (issue 29): three network-namespace "hosts" run one elastic
//! job of 2 to 3 nodes with `--chaos partition@6:2`: host 2's agent and worker cut themselves
//! off ([`launch::partition`]: nothing sends or receives, nothing is closed) for twice the time
//! the others take to notice; node 0 notices host 2's lease standing still, drops it, and the
//! job goes on on hosts 0 and 1 from the last committed checkpoint. Host 2 heals later and
//! finds the job moved on without it. Needs root and iproute2; elsewhere it prints `SKIP: ...`
//! and passes (FLOTILLA_NETNS_REQUIRED=1 makes that a failure).

#[path = "support/cli.rs"]
mod cli;
#[path = "support/netns.rs"]
mod netns;

use cli::micro_on_node;
use netns::{Hosts, run_all};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const STEPS: u64 = 80;

#[test]
fn a_partitioned_host_is_dropped_from_an_elastic_job_when_its_lease_lapses() {
    let test = "a_partitioned_host_is_dropped_from_an_elastic_job_when_its_lease_lapses";
    let Some(hosts) = Hosts::up_or_skip(test, 3, None) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let rdzv = format!("{}:29500", hosts.ip(0));
    let steps = STEPS.to_string();
    let cmds = (0..hosts.len())
        .map(|i| {
            // Collectives wait 8 s for a silent host, the lease 3 s: the lease notices first,
            // and the partition lasts twice the longer, 16 s.
            let mut c = hosts.job_command(i, BIN, "netns-partition-secret-0123456789", 8);
            c.args(micro_on_node(i, &rdzv)).args([
                "--steps",
                &steps,
                "--log-every",
                "1",
                "--ckpt-dir",
                ck.to_str().unwrap(),
                "--ckpt-every",
                "2",
                "--ckpt-sync",
                "--heartbeat-timeout-s",
                "3",
                "--admission-timeout-s",
                "20",
                "--max-restarts",
                "1",
                "--job-timeout-s",
                "120",
                "--chaos",
                "partition@6:2",
                "--chaos-seed",
                "1",
            ]);
            c.env("NNODES", "2:3");
            c
        })
        .collect();
    let out = run_all(cmds, Duration::from_secs(150));
    let report = netns::report(&out);
    assert!(out[0].success() && out[1].success(), "{report}");
    assert!(!out[2].timed_out, "{report}");
    let (out0, out2) = (&out[0].stdout, &out[2].stdout);
    for line in [
        "# node 0: chaos: partition@6:2:16 (seed 1): node 2 will be cut off the network for 16 s",
        "# node 0: generation 0 failed: node 2 lost: its agent renewed no lease for ",
        "# node 0: generation 1 admitted nodes [0, 1] (2 of --nnodes 2:3): world 2",
        "# job finished in generation 1 after 1 restart(s)",
    ] {
        assert!(out0.contains(line), "no {line:?}\n{report}");
    }
    for line in [
        "# node 2: chaos: partition@6:2:16: this node is cut off the network for 16 s after step 6",
        "# node 2: chaos: partition@6:2:16: partition healed after ",
    ] {
        assert!(out2.contains(line), "no {line:?}\n{report}");
    }
    println!("{report}");
}
