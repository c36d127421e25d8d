//! Agreement at gang admission (issue 29), through the binary with several agents on this
//! machine: nodes started with different hyperparameters (`--lr`) are refused before any
//! worker trains, naming the field and the nodes; two agents given the same `--node-rank` are
//! refused naming the rank. Every agent ends with the refusal's exit code (78), which nothing
//! retries.
#[path = "support/cli.rs"]
mod cli;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Starts the agent of node `node` of an `nnodes`-node job of MICRO on one worker, with
/// `extra` flags; its output goes to files in `dir`.
fn agent(dir: &std::path::Path, tag: &str, node: usize, rdzv: &str, extra: &[&str]) -> Child {
    let mut args = cli::micro_on_node(node, rdzv);
    args.extend(
        [
            "--steps",
            "3",
            "--admission-timeout-s",
            "30",
            "--job-timeout-s",
            "60",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string()),
    );
    Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(args)
        .env("FLOTILLA_SECRET", "admission-test-secret")
        .env("FLOTILLA_TIMEOUT_S", "30")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join(format!("{tag}.out"))).unwrap())
        .stderr(std::fs::File::create(dir.join(format!("{tag}.err"))).unwrap())
        .spawn()
        .expect("start an agent")
}

/// Waits (at most a minute) for every agent; returns each one's exit code and output.
fn finish(dir: &std::path::Path, agents: Vec<(&str, Child)>) -> Vec<(Option<i32>, String)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    agents
        .into_iter()
        .map(|(tag, mut c)| {
            let code = loop {
                if let Some(st) = c.try_wait().unwrap() {
                    break st.code();
                }
                if Instant::now() >= deadline {
                    drop(c.kill());
                    drop(c.wait());
                    break None;
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            let read = |ext: &str| {
                std::fs::read_to_string(dir.join(format!("{tag}.{ext}"))).unwrap_or_default()
            };
            (code, format!("--- {tag}:\n{}{}", read("out"), read("err")))
        })
        .collect()
}

fn rdzv() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("127.0.0.1:{}", l.local_addr().unwrap().port())
}

#[test]
fn nodes_with_different_learning_rates_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let rdzv = rdzv();
    let nodes = ["--nnodes", "2"];
    let a0 = agent(
        dir.path(),
        "n0",
        0,
        &rdzv,
        &[&nodes[..], &["--lr", "0.001"]].concat(),
    );
    let a1 = agent(
        dir.path(),
        "n1",
        1,
        &rdzv,
        &[&nodes[..], &["--lr", "0.002"]].concat(),
    );
    let out = finish(dir.path(), vec![("n0", a0), ("n1", a1)]);
    let all: String = out.iter().map(|(_, o)| o.as_str()).collect();
    for (code, text) in &out {
        assert_eq!(*code, Some(78), "{all}");
        assert!(
            text.contains("nodes 0 and 1 were started with different run configurations")
                && text.contains("lr (node 0: 0.001, node 1: 0.002)"),
            "{all}"
        );
        // Refused before training: no step ran anywhere.
        assert!(!text.contains("step      1/3"), "{all}");
    }
    assert!(all.contains("run configuration digest"), "{all}");
}

#[test]
fn two_agents_with_the_same_node_rank_are_refused_naming_the_rank() {
    let dir = tempfile::tempdir().unwrap();
    let rdzv = rdzv();
    // Three nodes, node 2 never started: admission stays open, so the second agent of node 1
    // is always seen before anything trains.
    let nodes = ["--nnodes", "3"];
    let agents = vec![
        ("n0", agent(dir.path(), "n0", 0, &rdzv, &nodes)),
        ("n1a", agent(dir.path(), "n1a", 1, &rdzv, &nodes)),
        ("n1b", agent(dir.path(), "n1b", 1, &rdzv, &nodes)),
    ];
    let out = finish(dir.path(), agents);
    let all: String = out.iter().map(|(_, o)| o.as_str()).collect();
    for (code, text) in &out {
        assert_eq!(*code, Some(78), "{all}");
        assert!(text.contains("duplicate --node-rank 1"), "{all}");
        assert!(!text.contains("step      1/3"), "{all}");
    }
}
