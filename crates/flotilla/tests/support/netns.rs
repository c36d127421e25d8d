//! Several "hosts" on one machine: Linux network namespaces joined by a bridge.
//!
//! [`Hosts::up`] creates `n` namespaces `fl<pid>x<k>h<i>` (the test process id and a per-process
//! counter make names unique, so concurrent tests and test binaries never collide) and one bridge
//! namespace `fl<pid>x<k>br` holding bridge `br0`. Host i gets a veth pair: `eth0` inside its
//! namespace with address `10.47.0.<i+1>/24`, its peer `p<i>` in the bridge namespace, enslaved
//! to `br0`. `lo` is up everywhere. With a rate, every host's `eth0` gets
//! `tc qdisc add dev eth0 root tbf rate RATE burst 256kb latency 50ms`: each direction of every
//! host pair is limited at the sender's egress.
//!
//! Because ranks in different network namespaces have different host identities (hostname /
//! boot id / netns inode), ranks in one namespace share memory and ranks in different ones talk
//! TCP over the veth/bridge path, as on a real cluster.
//!
//! Dropping [`Hosts`] (also while unwinding from a panic) kills whatever still runs in the
//! namespaces and deletes them; deleting a namespace destroys its veth ends.
//!
//! Where namespaces cannot be made (not root, no `ip`, `ip netns add` refused, no veth/bridge/tbf
//! support), [`Hosts::up`] returns [`Unavailable`] with the reason: tests print `SKIP: ...` and
//! pass, unless `FLOTILLA_NETNS_REQUIRED=1` (then they fail, so CI notices a lost capability).

#![allow(dead_code)]

use std::fmt;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Why the harness cannot run here.
#[derive(Debug)]
pub struct Unavailable(pub String);

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The /24 every host sits in (private; it exists only inside the namespaces).
pub const SUBNET: [u8; 3] = [10, 47, 0];

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// `n` emulated hosts; see the module docs.
pub struct Hosts {
    prefix: String,
    n: usize,
    created: Vec<String>,
}

/// Runs a setup command; its failure is an [`Unavailable`] naming the command and its stderr.
fn sh(args: &[&str]) -> Result<(), Unavailable> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| Unavailable(format!("cannot run `{}`: {e}", args.join(" "))))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Unavailable(format!(
            "`{}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

fn is_root() -> bool {
    // Effective uid from /proc (no libc dependency): "Uid: real effective saved fs".
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// Whether the environment demands the netns tests run (then unavailability fails them).
pub fn required() -> bool {
    std::env::var("FLOTILLA_NETNS_REQUIRED").is_ok_and(|v| v == "1")
}

impl Hosts {
    /// Creates `n` hosts on a bridge, each host's egress limited to `rate` (tc syntax, e.g.
    /// `1gbit`) if given.
    pub fn up(n: usize, rate: Option<&str>) -> Result<Hosts, Unavailable> {
        assert!((1..=250).contains(&n), "1..=250 hosts");
        if !is_root() {
            return Err(Unavailable("network namespaces need root".into()));
        }
        if Command::new("ip")
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_err()
        {
            return Err(Unavailable("`ip` (iproute2) is not installed".into()));
        }
        let prefix = format!(
            "fl{}x{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut h = Hosts {
            prefix,
            n,
            created: Vec::new(),
        };
        // On any failure `h` drops and removes what was made so far.
        let br = h.bridge_ns();
        sh(&["ip", "netns", "add", &br])?;
        h.created.push(br.clone());
        sh(&["ip", "-n", &br, "link", "set", "lo", "up"])?;
        sh(&["ip", "-n", &br, "link", "add", "br0", "type", "bridge"])?;
        sh(&["ip", "-n", &br, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let ns = h.ns(i);
            sh(&["ip", "netns", "add", &ns])?;
            h.created.push(ns.clone());
            let port = format!("p{i}");
            let addr = format!("{}/24", h.ip(i));
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
            sh(&[
                "ip", "-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", &port,
                "netns", &br,
            ])?;
            sh(&["ip", "-n", &br, "link", "set", &port, "master", "br0"])?;
            sh(&["ip", "-n", &br, "link", "set", &port, "up"])?;
            sh(&["ip", "-n", &ns, "addr", "add", &addr, "dev", "eth0"])?;
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            if let Some(rate) = rate {
                sh(&[
                    "ip", "netns", "exec", &ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                    "rate", rate, "burst", "256kb", "latency", "50ms",
                ])?;
            }
        }
        Ok(h)
    }

    /// [`Hosts::up`], or `None` after printing `SKIP: <why>` (a panic instead when
    /// `FLOTILLA_NETNS_REQUIRED=1`).
    pub fn up_or_skip(test: &str, n: usize, rate: Option<&str>) -> Option<Hosts> {
        match Hosts::up(n, rate) {
            Ok(h) => Some(h),
            Err(why) if required() => {
                panic!(
                    "{test}: network namespaces required (FLOTILLA_NETNS_REQUIRED=1) but unavailable: {why}"
                )
            }
            Err(why) => {
                eprintln!("SKIP: {test}: network namespaces unavailable: {why}");
                None
            }
        }
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Namespace name of host `i`.
    pub fn ns(&self, i: usize) -> String {
        format!("{}h{i}", self.prefix)
    }

    fn bridge_ns(&self) -> String {
        format!("{}br", self.prefix)
    }

    /// Address of host `i`.
    pub fn ip(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], i as u8 + 1)
    }

    /// A command that runs `program` inside host `i` (`ip netns exec`), in its own process
    /// group so [`run_with_timeout`] can stop it and everything it started.
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.arg("netns").arg("exec").arg(self.ns(i)).arg(program);
        c.stdin(Stdio::null()).process_group(0);
        c
    }

    /// [`Hosts::command`] for a `flotilla` job's process on host `i`: the job's `secret`, the
    /// collectives' timeout `timeout_s`, and none of the launcher variables of the test's own
    /// environment (node rank, store address, transport and algorithm overrides).
    pub fn job_command(
        &self,
        i: usize,
        program: impl AsRef<std::ffi::OsStr>,
        secret: &str,
        timeout_s: u64,
    ) -> Command {
        let mut c = self.command(i, program);
        c.env("FLOTILLA_SECRET", secret)
            .env("FLOTILLA_TIMEOUT_S", timeout_s.to_string());
        for var in [
            "NODE_RANK",
            "NPROC_PER_NODE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "FLOTILLA_ALGO",
            "FLOTILLA_ADDR",
            "FLOTILLA_HOST_ID",
            "FLOTILLA_TRANSPORT",
        ] {
            c.env_remove(var);
        }
        c
    }

    /// Pids of processes still running in host `i`.
    pub fn pids(&self, i: usize) -> Vec<u32> {
        pids_in(&self.ns(i))
    }
}

fn pids_in(ns: &str) -> Vec<u32> {
    Command::new("ip")
        .args(["netns", "pids", ns])
        .stderr(Stdio::null())
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn kill(target: &str) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", target])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Only processes inside our own, uniquely named namespaces: ones this test started.
        for ns in &self.created {
            for pid in pids_in(ns) {
                kill(&pid.to_string());
            }
        }
        for ns in self.created.iter().rev() {
            let _ = Command::new("ip")
                .args(["netns", "del", ns])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The result of a command run by [`run_all`].
pub struct Outcome {
    pub status: Option<ExitStatus>,
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Outcome {
    pub fn success(&self) -> bool {
        !self.timed_out && self.status.is_some_and(|s| s.success())
    }
}

/// Every host's outcome and output, for a failed assertion's message.
pub fn report(out: &[Outcome]) -> String {
    let mut report = String::new();
    for (i, o) in out.iter().enumerate() {
        report += &format!(
            "--- host {i}: {:?} after {:.1} s, timed out {}\n{}\n{}\n",
            o.status,
            o.elapsed.as_secs_f64(),
            o.timed_out,
            o.stdout,
            o.stderr
        );
    }
    report
}

fn scratch_file(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "flotilla-netns-{}-{}-{tag}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Starts every command (each in its own process group, see [`Hosts::command`]), waits for all
/// of them, and kills the process group of any still running after `timeout`. Output goes to
/// scratch files (no pipe can fill up) and is returned.
pub fn run_all(cmds: Vec<Command>, timeout: Duration) -> Vec<Outcome> {
    run_all_watching(cmds, timeout, |_, _| true)
}

/// Sends SIGKILL to process group `pgid` (a command of [`run_all_watching`]: a whole host's
/// launcher and workers).
pub fn kill_group(pgid: u32) {
    kill(&format!("-{pgid}"));
}

impl Hosts {
    /// Cuts host `i` off the network (`ip link set eth0 down` inside it): its processes live
    /// on but reach no other host, as when a host's link or switch port fails.
    pub fn link_down(&self, i: usize) -> Result<(), Unavailable> {
        sh(&[
            "ip",
            "netns",
            "exec",
            &self.ns(i),
            "ip",
            "link",
            "set",
            "eth0",
            "down",
        ])
    }
}

/// [`run_all`], and while they run, `watch` is shown everyone's output so far (stdout, in
/// command order) and the commands' process group ids every 20 ms, until it returns `true`
/// (it may act on the hosts meanwhile: cut one off, kill one with [`kill_group`]).
pub fn run_all_watching(
    cmds: Vec<Command>,
    timeout: Duration,
    mut watch: impl FnMut(&[String], &[u32]) -> bool,
) -> Vec<Outcome> {
    let t0 = Instant::now();
    let mut watched = false;
    let mut running = Vec::new();
    for mut c in cmds {
        let (o, e) = (scratch_file("out"), scratch_file("err"));
        c.stdout(std::fs::File::create(&o).expect("scratch file"));
        c.stderr(std::fs::File::create(&e).expect("scratch file"));
        let child = c.spawn().expect("spawn a command");
        running.push((child, o, e, None::<ExitStatus>, None::<Duration>));
        // Node 0 binds the store first; later nodes retry anyway, this only avoids noise.
        std::thread::sleep(Duration::from_millis(50));
    }
    let deadline = t0 + timeout;
    let mut timed_out = false;
    loop {
        let mut all_done = true;
        for (child, _, _, st, el) in running.iter_mut() {
            if st.is_none() {
                match child.try_wait() {
                    Ok(Some(s)) => {
                        *st = Some(s);
                        *el = Some(t0.elapsed());
                    }
                    Ok(None) => all_done = false,
                    Err(_) => {}
                }
            }
        }
        if all_done {
            break;
        }
        if !watched {
            let outs: Vec<String> = running
                .iter()
                .map(|(_, o, ..)| std::fs::read_to_string(o).unwrap_or_default())
                .collect();
            let pgids: Vec<u32> = running.iter().map(|(c, ..)| c.id()).collect();
            watched = watch(&outs, &pgids);
        }
        if Instant::now() >= deadline {
            timed_out = true;
            for (child, _, _, st, _) in running.iter_mut() {
                if st.is_none() {
                    // The whole process group: the launcher and its workers.
                    kill(&format!("-{}", child.id()));
                    let _ = child.kill();
                    *st = child.wait().ok();
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    running
        .into_iter()
        .map(|(_, o, e, st, el)| {
            let read = |p: &PathBuf| {
                let s = std::fs::read_to_string(p).unwrap_or_default();
                let _ = std::fs::remove_file(p);
                s
            };
            Outcome {
                timed_out: timed_out && el.is_none(),
                status: st,
                stdout: read(&o),
                stderr: read(&e),
                elapsed: el.unwrap_or_else(|| t0.elapsed()),
            }
        })
        .collect()
}
