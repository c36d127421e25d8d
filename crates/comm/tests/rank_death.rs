//! Real processes: SIGKILL (or SIGSTOP) one rank in the middle of an all-reduce; every other
//! rank must return an error naming the op and the lost rank within the timeout + 2 s.
//!
//! The test binary re-executes itself as the ranks (`child_rank` does nothing unless
//! `FLOTILLA_TEST_CHILD` is set); the store lives in the test process, as a launcher's would.

use comm::ReduceOp;
use comm::group::{GroupConfig, ProcessGroup, Rendezvous, TransportPolicy};
use comm::local::LocalRendezvous;
use comm::store::{Secret, StoreClient};
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const OP_TIMEOUT_S: u64 = 3;

#[test]
fn child_rank() {
    let Ok(spec) = std::env::var("FLOTILLA_TEST_CHILD") else {
        return;
    };
    let v: Vec<&str> = spec.split(',').collect();
    let (rank, size, addr, transport) = (
        v[0].parse().unwrap(),
        v[1].parse().unwrap(),
        v[2].parse().unwrap(),
        v[3],
    );
    let rdv = Rendezvous {
        addr,
        secret: Secret::from_env_required().unwrap(),
        generation: 0,
    };
    let cfg = GroupConfig {
        timeout: Duration::from_secs(OP_TIMEOUT_S),
        transport: if transport == "tcp" {
            TransportPolicy::TcpOnly
        } else {
            TransportPolicy::Auto
        },
        ..GroupConfig::default()
    };
    let g = ProcessGroup::new(&rdv, "world", rank, size, cfg).unwrap();
    let store = StoreClient::connect(addr, &rdv.secret, 0, Duration::from_secs(10)).unwrap();
    let mut buf = vec![1.0f32; 4 << 20];
    for i in 0.. {
        if let Err(e) = g.all_reduce(&mut buf, ReduceOp::Sum) {
            println!("FLOTILLA_ERR: {e}");
            std::process::exit(3);
        }
        buf.iter_mut().for_each(|x| *x = 1.0);
        if i == 2 {
            store.set(&format!("progress/{rank}"), b"1").unwrap();
        }
    }
}

fn spawn_ranks(size: usize, local: &LocalRendezvous, transport: &str) -> Vec<Child> {
    let exe = std::env::current_exe().unwrap();
    (0..size)
        .map(|r| {
            Command::new(&exe)
                .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
                .env(
                    "FLOTILLA_TEST_CHILD",
                    format!("{r},{size},{},{transport}", local.rdv.addr),
                )
                .env("FLOTILLA_SECRET", local.rdv.secret.to_env_value().unwrap())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect()
}

fn run_fault(transport: &str, stop_instead_of_kill: bool) {
    let size = 4;
    let victim = 2;
    let local = LocalRendezvous::start().unwrap();
    let mut children = spawn_ranks(size, &local, transport);
    let store = StoreClient::connect(
        local.rdv.addr,
        &local.rdv.secret,
        0,
        Duration::from_secs(10),
    )
    .unwrap();
    for r in 0..size {
        store
            .wait_one(&format!("progress/{r}"), Duration::from_secs(60))
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    let pid = children[victim].id() as i32;
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(
            pid,
            if stop_instead_of_kill {
                libc::SIGSTOP
            } else {
                libc::SIGKILL
            },
        )
    };
    let t_fault = Instant::now();
    let limit = Duration::from_secs(OP_TIMEOUT_S + 2);
    for (r, c) in children.iter_mut().enumerate() {
        if r == victim {
            continue;
        }
        let status = loop {
            if let Some(st) = c.try_wait().unwrap() {
                break st;
            }
            assert!(
                t_fault.elapsed() < limit + Duration::from_secs(5),
                "{transport}: rank {r} still running {:?} after the fault",
                t_fault.elapsed()
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        let took = t_fault.elapsed();
        let mut out = String::new();
        c.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        assert_eq!(
            status.code(),
            Some(3),
            "{transport}: rank {r} exited with {status}: {out}"
        );
        assert!(
            took <= limit,
            "{transport}: rank {r} needed {took:?} (limit {limit:?}): {out}"
        );
        assert!(out.contains("all_reduce #"), "{transport}: rank {r}: {out}");
        assert!(
            out.contains(&format!("rank {victim}")),
            "{transport}: rank {r} does not name rank {victim}: {out}"
        );
    }
    // SAFETY: our own child.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let _ = children[victim].wait();
}

#[test]
fn sigkill_mid_all_reduce_tcp() {
    run_fault("tcp", false);
}

#[test]
fn sigkill_mid_all_reduce_shm() {
    run_fault("auto", false);
}

#[test]
fn stopped_rank_times_out_tcp() {
    run_fault("tcp", true);
}

#[test]
fn stopped_rank_times_out_shm() {
    run_fault("auto", true);
}
