//! `flotilla train` under a real Slurm (Debian's `slurm-wlm` and `munge`, which `.ci/run`
//! installs): the tests start `munged`, `slurmctld` and `slurmd` themselves (in a scratch
//! directory, on free ports): one node, and two nodes, each `slurmd` in a network-namespace
//! host of its own (`support/netns.rs`). They submit `examples/slurm/flotilla.sbatch` in both
//! modes (agent: a Flotilla agent per node starting the workers; srun: Slurm starting one task
//! per rank), 2 ranks in all. Each job trains, is pre-empted with `scancel --signal=TERM
//! --batch` (what the script's `--signal=B:TERM@60` does at the time limit) after step 40,
//! commits that step, exits 75, requeues itself, resumes there when Slurm runs it again, and
//! saves a model byte for byte equal to an undisturbed 2-rank run's outside Slurm.
//!
//! Needs root (slurmd runs jobs as their user) and the Slurm binaries; prints SKIP without
//! them (and without network namespaces, for the two-node test).
#[path = "support/cli.rs"]
mod cli;
#[path = "support/netns.rs"]
mod netns;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const STEPS: u64 = 300;

/// A shell script that mounts again, where it runs, every cgroup file system this machine has
/// under /sys/fs/cgroup (as /proc/self/mounts lists them: a v1 tmpfs with its controllers, or
/// the v2 hierarchy), then runs its arguments.
fn cgroups_then_exec() -> String {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut script = String::new();
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [src, at, fs, opts, ..] = f[..]
            && at.starts_with("/sys/fs/cgroup")
            && ["tmpfs", "cgroup", "cgroup2"].contains(&fs)
        {
            script += &format!("mkdir -p {at} && mount -t {fs} -o {opts} {src} {at}; ");
        }
    }
    script + "exec \"$@\""
}

/// One cluster at a time (the machine's cores are few).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The daemons of a cluster, stopped (SIGTERM, then SIGKILL) when dropped; then its hosts.
struct Cluster {
    dir: tempfile::TempDir,
    daemons: Vec<Child>,
    /// The network-namespace hosts of a multi-node cluster (node i in host i, the controller
    /// in host 0), and the `/etc/netns/NS/hosts` files naming the nodes there.
    hosts: Option<(netns::Hosts, Vec<PathBuf>)>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for d in self.daemons.iter_mut().rev() {
            // SAFETY: kill(2) on a daemon this test started.
            unsafe {
                libc::kill(d.id() as libc::pid_t, libc::SIGTERM);
            }
            let t0 = Instant::now();
            while d.try_wait().ok().flatten().is_none() && t0.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = d.kill();
            let _ = d.wait();
        }
        for dir in self.hosts.iter().flat_map(|(_, dirs)| dirs) {
            let _ = std::fs::remove_dir_all(dir);
        }
        if self.hosts.is_some() {
            // Only if no other namespace uses it (remove_dir refuses a non-empty directory).
            let _ = std::fs::remove_dir("/etc/netns");
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `cmd` to completion; its stdout (panics, with stderr, on failure).
fn ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Polls `what` every 100 ms until it returns Some, for at most `limit`; on timeout panics
/// with `desc` and `context()` (the daemons' logs, the job's output).
fn wait_until<T>(
    limit: Duration,
    desc: &str,
    context: impl Fn() -> String,
    mut what: impl FnMut() -> Option<T>,
) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = what() {
            return v;
        }
        assert!(
            t0.elapsed() < limit,
            "{desc}: not within {limit:?}\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Cluster {
    /// Starts a cluster of one node (`nodes` None: this host) or one node per network-namespace
    /// host of `nodes`, or says why it cannot (SKIP).
    fn start(nodes: Option<netns::Hosts>) -> Option<Cluster> {
        let have = |b: &str| {
            ["/usr/sbin", "/usr/bin"]
                .iter()
                .any(|d| Path::new(d).join(b).exists())
        };
        if !["munged", "slurmctld", "slurmd", "sbatch", "scontrol"]
            .iter()
            .all(|b| have(b))
        {
            eprintln!("SKIP: slurm-wlm and munge are not installed (.ci/run installs them)");
            return None;
        }
        // SAFETY: geteuid(2) reads this process's credentials.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIP: slurmd needs root to run jobs");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let p = |n: &str| root.join(n).to_str().unwrap().to_string();
        for d in ["state", "log"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        let host = ok(Command::new("hostname").arg("-s")).trim().to_string();
        let key: Vec<u8> = (0..1024).map(|i| (i * 7919 % 251) as u8).collect();
        std::fs::write(p("munge.key"), key).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(p("munge.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
        // (name, address) of every node; the controller runs beside node 0.
        let names: Vec<(String, String)> = match &nodes {
            None => vec![(host.clone(), "127.0.0.1".to_string())],
            Some(h) => (0..h.len())
                .map(|i| (format!("fn{i}"), h.ip(i).to_string()))
                .collect(),
        };
        // Inside a namespace `ip netns exec` mounts /etc/netns/NS/hosts on /etc/hosts: there
        // the node names resolve (the store's host is the first of the job's node list).
        let mut etc = vec![];
        if let Some(h) = &nodes {
            let mut hosts = "127.0.0.1 localhost\n".to_string();
            for (name, addr) in &names {
                hosts += &format!("{addr} {name}\n");
            }
            for i in 0..h.len() {
                let d = PathBuf::from("/etc/netns").join(h.ns(i));
                std::fs::create_dir_all(&d).unwrap();
                std::fs::write(d.join("hosts"), &hosts).unwrap();
                etc.push(d);
            }
        }
        let node_lines: String = names
            .iter()
            .map(|(n, a)| {
                format!("NodeName={n} NodeAddr={a} CPUs=2 RealMemory=1000 State=UNKNOWN\n")
            })
            .collect();
        let conf = format!(
            "ClusterName=flotillatest\nSlurmctldHost={ctl}({ctladdr})\n\
             AuthType=auth/munge\nAuthInfo=socket={sock}\nCredType=cred/munge\n\
             SlurmUser=root\nSlurmdUser=root\nSlurmctldPort={ctld}\nSlurmdPort={slurmd}\n\
             StateSaveLocation={state}\nSlurmdSpoolDir={spool}\n\
             SlurmctldPidFile={ctldpid}\nSlurmdPidFile={slurmdpid}\n\
             SlurmctldLogFile={ctldlog}\nSlurmdLogFile={slurmdlog}\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n\
             SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n\
             JobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\n\
             JobAcctGatherType=jobacct_gather/none\nMpiDefault=none\nSwitchType=switch/none\n\
             ReturnToService=2\nJobRequeue=1\nKillWait=30\nMinJobAge=600\n{node_lines}\
             PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n",
            // slurmctld knows itself by this machine's host name (namespaces share it).
            ctl = host,
            ctladdr = names[0].1,
            sock = p("munge.sock"),
            ctld = free_port(),
            slurmd = free_port(),
            state = p("state"),
            spool = p("spool-%n"),
            ctldpid = p("slurmctld.pid"),
            slurmdpid = p("slurmd-%n.pid"),
            ctldlog = p("log/slurmctld.log"),
            slurmdlog = p("log/slurmd-%n.log"),
        );
        std::fs::write(p("slurm.conf"), conf).unwrap();
        for (name, _) in &names {
            std::fs::create_dir(p(&format!("spool-{name}"))).unwrap();
        }
        let mut cluster = Cluster {
            dir,
            daemons: vec![],
            hosts: nodes.map(|h| (h, etc)),
        };
        let log = |n: &str| std::fs::File::create(p(&format!("log/{n}.out"))).unwrap();
        let spawn = |cluster: &mut Cluster, node: usize, args: &[&str], name: &str| {
            let mut c = cluster.on(node, args[0]);
            let child = c
                .args(&args[1..])
                .stdout(log(name))
                .stderr(log(name))
                .spawn()
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            cluster.daemons.push(child);
        };
        let munged = [
            "munged".to_string(),
            "-F".into(),
            "-f".into(),
            format!("--socket={}", p("munge.sock")),
            format!("--key-file={}", p("munge.key")),
            format!("--log-file={}", p("log/munged.log")),
            format!("--pid-file={}", p("munged.pid")),
            format!("--seed-file={}", p("munged.seed")),
        ];
        let munged: Vec<&str> = munged.iter().map(String::as_str).collect();
        spawn(&mut cluster, 0, &munged, "munged");
        wait_until(
            Duration::from_secs(10),
            "munged's socket",
            String::new,
            || Path::new(&p("munge.sock")).exists().then_some(()),
        );
        let conf = p("slurm.conf");
        spawn(
            &mut cluster,
            0,
            &["slurmctld", "-D", "-i", "-f", &conf],
            "slurmctld",
        );
        let cgroups = cgroups_then_exec();
        for (i, (name, _)) in names.iter().enumerate() {
            let slurmd = ["slurmd", "-D", "-N", name, "-f", &conf];
            // `ip netns exec` mounts a fresh /sys without the cgroup hierarchies slurmd
            // checks for: mount this machine's there again first.
            let mut wrapped = vec!["sh", "-c", &cgroups, "sh"];
            wrapped.extend(slurmd);
            let args: &[&str] = if cluster.hosts.is_some() {
                &wrapped
            } else {
                &slurmd
            };
            spawn(&mut cluster, i, args, &format!("slurmd-{name}"));
        }
        let logs = || cluster.logs();
        wait_until(Duration::from_secs(60), "every node idle", logs, || {
            let out = cluster
                .slurm("sinfo")
                .args(["-h", "-N", "-o", "%t"])
                .output()
                .ok()?;
            let states = String::from_utf8_lossy(&out.stdout).into_owned();
            (states.matches("idle").count() == names.len()).then_some(())
        });
        Some(cluster)
    }

    /// `program` on node `node`'s host (this one for a one-node cluster), with this cluster's
    /// configuration.
    fn on(&self, node: usize, program: &str) -> Command {
        let mut c = match &self.hosts {
            Some((h, _)) => h.command(node, program),
            None => Command::new(program),
        };
        c.env("SLURM_CONF", self.dir.path().join("slurm.conf"));
        c
    }

    /// The tail of every daemon log, for a failure's message.
    fn logs(&self) -> String {
        let mut out = String::new();
        let dir = self.dir.path().join("log");
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            out += &format!("--- {}\n", e.path().display());
            for l in tail.iter().rev() {
                out += &format!("{l}\n");
            }
        }
        out
    }

    /// A Slurm command talking to this cluster (from the controller's host).
    fn slurm(&self, program: &str) -> Command {
        self.on(0, program)
    }

    /// A field of `scontrol show job`'s record of `job` (e.g. `JobState`).
    fn job_field(&self, job: &str, field: &str) -> String {
        let out = ok(self.slurm("scontrol").args(["show", "job", job]));
        out.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{field}=")))
            .unwrap_or_default()
            .to_string()
    }
}

/// `train` with MICRO on 2 ranks x 2 rows, one thread each, `STEPS` steps, saving the model.
fn train_args(save: &Path) -> Vec<String> {
    let mut args = vec![];
    let mut micro = cli::MICRO.iter();
    while let Some(&arg) = micro.next() {
        if ["--threads", "--batch", "--nproc"].contains(&arg) {
            micro.next();
        } else {
            args.push(arg.to_string());
        }
    }
    let steps = STEPS.to_string();
    let more = [
        "--threads",
        "1",
        "--batch",
        "2",
        "--log-every",
        "1",
        "--no-plan",
    ];
    args.extend(more.iter().map(|s| s.to_string()));
    args.extend([
        "--steps".into(),
        steps,
        "--save".into(),
        save.display().to_string(),
    ]);
    args
}

/// The number after `tag` in `text`.
fn number_after(text: &str, tag: &str) -> u64 {
    let at = text
        .find(tag)
        .unwrap_or_else(|| panic!("no {tag:?} in:\n{text}"));
    text[at + tag.len()..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number after {tag:?}"))
}

/// One job of `mode` with 2 ranks over the cluster's nodes: trains, is pre-empted after step
/// 40, requeues, resumes and finishes.
fn preempted_job(cluster: &Cluster, mode: &str, reference: &Path) {
    let nodes = cluster.hosts.as_ref().map_or(1, |(h, _)| h.len());
    let work = cluster.dir.path().join(mode);
    std::fs::create_dir(&work).unwrap();
    let (ck, save, out) = (work.join("ck"), work.join("model"), work.join("job.out"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/slurm/flotilla.sbatch");
    let mut sbatch = cluster.slurm("sbatch");
    sbatch
        .arg("--parsable")
        .arg(format!("--output={}", out.display()))
        .current_dir(&work)
        .env("FLOTILLA", env!("CARGO_BIN_EXE_flotilla"))
        .env("CKPT", &ck)
        .env("GRACE", "20")
        .env("FLOTILLA_MODE", mode);
    // 2 ranks in all: per node 2 / nodes workers (agent) or tasks (srun).
    let per_node = (2 / nodes).to_string();
    sbatch
        .arg(format!("--nodes={nodes}"))
        .env("NPROC", &per_node);
    match mode {
        "agent" => sbatch.args(["--ntasks-per-node=1", "--cpus-per-task=2"]),
        _ => sbatch.args([
            format!("--ntasks-per-node={per_node}"),
            "--cpus-per-task=1".into(),
        ]),
    };
    sbatch.arg(&script).args(train_args(&save));
    let job = ok(&mut sbatch).trim().to_string();
    let text = || std::fs::read_to_string(&out).unwrap_or_default();
    let context = || format!("{}\njob output:\n{}", cluster.logs(), text());
    wait_until(Duration::from_secs(120), "step 40", context, || {
        text()
            .contains(&format!("step     40/{STEPS}"))
            .then_some(())
    });
    ok(cluster
        .slurm("scancel")
        .args(["--signal=TERM", "--batch", &job]));
    wait_until(Duration::from_secs(60), "the requeue", context, || {
        (cluster.job_field(&job, "Restarts") == "1" && text().contains("# flotilla exited"))
            .then_some(())
    });
    let first = text();
    assert!(first.contains("# flotilla exited 75"), "{mode}:\n{first}");
    // Every process ended as pre-empted: none (an agent on another node) with an error.
    assert!(!first.contains("flotilla: error"), "{mode}:\n{first}");
    let step = number_after(&first, "# stop requested (SIGTERM): stopping after step ");
    assert!((40..STEPS).contains(&step), "{mode}: {step}");
    assert!(
        first.contains(&format!(
            "stopped after step {step}, its checkpoint committed"
        )) && first.contains("within --term-grace-s 20"),
        "{mode}:\n{first}"
    );
    // Requeued jobs wait two minutes before they are eligible again; the test does not: while
    // the job waits for its begin time, it is moved to now (again, should the requeue set the
    // time after an earlier update).
    wait_until(
        Duration::from_secs(180),
        "the requeued job's end",
        context,
        || {
            let state = cluster.job_field(&job, "JobState");
            if state == "PENDING" && cluster.job_field(&job, "Reason") == "BeginTime" {
                let _ = cluster
                    .slurm("scontrol")
                    .args(["update", &format!("jobid={job}"), "StartTime=now"])
                    .output();
            }
            ["COMPLETED", "FAILED", "CANCELLED"]
                .contains(&state.as_str())
                .then_some(())
        },
    );
    let all = text();
    assert_eq!(cluster.job_field(&job, "JobState"), "COMPLETED", "{all}");
    let second = &all[all.find("(restart 1)").unwrap_or_else(|| panic!("{all}"))..];
    assert!(
        second.contains(&format!("# resumed from {} step {step}\n", ck.display())),
        "{mode}:\n{second}"
    );
    assert!(second.contains("# flotilla exited 0"), "{mode}:\n{second}");
    for file in ["model.safetensors", "flotilla.json"] {
        let a = std::fs::read(reference.join(file)).unwrap();
        let b = std::fs::read(save.join(file)).unwrap();
        assert!(a == b, "{mode}: {file} differs from the undisturbed run's");
    }
    println!(
        "{mode} mode on {nodes} node(s): job {job} pre-empted after step {step}, requeued, \
         resumed, finished"
    );
}

/// The undisturbed 2-rank run outside Slurm: its saved model.
fn reference(dir: &Path) -> PathBuf {
    let reference = dir.join("reference");
    let mut args = vec!["train".to_string(), "--nproc".into(), "2".into()];
    args.extend(train_args(&reference));
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(&args)
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    reference
}

#[test]
fn sbatch_in_both_modes_trains_is_preempted_requeues_and_resumes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(cluster) = Cluster::start(None) else {
        return;
    };
    let reference = reference(cluster.dir.path());
    preempted_job(&cluster, "agent", &reference);
    preempted_job(&cluster, "srun", &reference);
}

/// The same on two nodes, each `slurmd` in a network-namespace host: one rank per node, the
/// store on the first node, TCP between them.
#[test]
fn two_nodes_in_both_modes_are_preempted_and_resume() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(hosts) = netns::Hosts::up_or_skip("slurm two nodes", 2, None) else {
        return;
    };
    let Some(cluster) = Cluster::start(Some(hosts)) else {
        return;
    };
    let reference = reference(cluster.dir.path());
    preempted_job(&cluster, "agent", &reference);
    preempted_job(&cluster, "srun", &reference);
}
