//! `flotilla train` under a real Slurm (Debian's `slurm-wlm` and `munge`, which `.ci/run`
//! installs): the test starts `munged`, `slurmctld` and one `slurmd` itself (one node, in a
//! scratch directory, on free ports), then submits `examples/slurm/flotilla.sbatch` in both
//! modes (agent: one Flotilla agent starting 2 workers; srun: Slurm starting 2 tasks, one per
//! rank). Each job trains, is pre-empted with `scancel --signal=TERM --batch` (what the
//! script's `--signal=B:TERM@60` does at the time limit) after step 40, commits that step,
//! exits 75, requeues itself, resumes there when Slurm runs it again, and saves a model byte
//! for byte equal to an undisturbed run's outside Slurm.
//!
//! Needs root (slurmd runs jobs as their user) and the Slurm binaries; prints SKIP without them.
#[path = "support/cli.rs"]
mod cli;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const STEPS: u64 = 300;

/// The daemons of a one-node cluster, stopped (SIGTERM, then SIGKILL) when dropped.
struct Cluster {
    dir: tempfile::TempDir,
    daemons: Vec<Child>,
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

/// Polls `what` every 100 ms until it returns Some, for at most `limit`.
fn wait_until<T>(limit: Duration, desc: &str, mut what: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = what() {
            return v;
        }
        assert!(t0.elapsed() < limit, "{desc}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Cluster {
    /// Starts the cluster, or says why it cannot (SKIP).
    fn start() -> Option<Cluster> {
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
        for d in ["state", "spool", "log"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        let key: Vec<u8> = (0..1024).map(|i| (i * 7919 % 251) as u8).collect();
        std::fs::write(p("munge.key"), key).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(p("munge.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
        let host = ok(Command::new("hostname").arg("-s")).trim().to_string();
        let conf = format!(
            "ClusterName=flotillatest\nSlurmctldHost={host}(127.0.0.1)\n\
             AuthType=auth/munge\nAuthInfo=socket={sock}\nCredType=cred/munge\n\
             SlurmUser=root\nSlurmdUser=root\nSlurmctldPort={ctld}\nSlurmdPort={slurmd}\n\
             StateSaveLocation={state}\nSlurmdSpoolDir={spool}\n\
             SlurmctldPidFile={ctldpid}\nSlurmdPidFile={slurmdpid}\n\
             SlurmctldLogFile={ctldlog}\nSlurmdLogFile={slurmdlog}\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n\
             SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n\
             JobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\n\
             JobAcctGatherType=jobacct_gather/none\nMpiDefault=none\nSwitchType=switch/none\n\
             ReturnToService=2\nJobRequeue=1\nKillWait=30\nMinJobAge=600\n\
             NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN\n\
             PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n",
            sock = p("munge.sock"),
            ctld = free_port(),
            slurmd = free_port(),
            state = p("state"),
            spool = p("spool"),
            ctldpid = p("slurmctld.pid"),
            slurmdpid = p("slurmd.pid"),
            ctldlog = p("log/slurmctld.log"),
            slurmdlog = p("log/slurmd.log"),
        );
        std::fs::write(p("slurm.conf"), conf).unwrap();
        let mut cluster = Cluster {
            dir,
            daemons: vec![],
        };
        let log = |n: &str| std::fs::File::create(p(&format!("log/{n}.out"))).unwrap();
        let mut spawn = |c: &mut Command, name: &str| {
            let child = c
                .env("SLURM_CONF", p("slurm.conf"))
                .stdout(log(name))
                .stderr(log(name))
                .spawn()
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            cluster.daemons.push(child);
        };
        spawn(
            Command::new("munged").args([
                "-F",
                "-f",
                &format!("--socket={}", p("munge.sock")),
                &format!("--key-file={}", p("munge.key")),
                &format!("--log-file={}", p("log/munged.log")),
                &format!("--pid-file={}", p("munged.pid")),
                &format!("--seed-file={}", p("munged.seed")),
            ]),
            "munged",
        );
        wait_until(Duration::from_secs(10), "munged's socket", || {
            Path::new(&p("munge.sock")).exists().then_some(())
        });
        spawn(
            Command::new("slurmctld").args(["-D", "-i", "-f", &p("slurm.conf")]),
            "slurmctld",
        );
        spawn(
            Command::new("slurmd").args(["-D", "-N", &host, "-f", &p("slurm.conf")]),
            "slurmd",
        );
        wait_until(Duration::from_secs(60), "an idle node", || {
            let out = cluster
                .slurm("sinfo")
                .args(["-h", "-o", "%t"])
                .output()
                .ok()?;
            String::from_utf8_lossy(&out.stdout)
                .contains("idle")
                .then_some(())
        });
        Some(cluster)
    }

    /// A Slurm command talking to this cluster.
    fn slurm(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", self.dir.path().join("slurm.conf"));
        c
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

/// One job of `mode`: trains, is pre-empted after step 40, requeues, resumes and finishes.
fn preempted_job(cluster: &Cluster, mode: &str, reference: &Path) {
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
    match mode {
        "agent" => sbatch.args(["--ntasks-per-node=1", "--cpus-per-task=2"]),
        _ => sbatch.args(["--ntasks-per-node=2", "--cpus-per-task=1"]),
    };
    sbatch.arg(&script).args(train_args(&save));
    let job = ok(&mut sbatch).trim().to_string();
    let text = || std::fs::read_to_string(&out).unwrap_or_default();
    wait_until(Duration::from_secs(120), "step 40", || {
        text()
            .contains(&format!("step     40/{STEPS}"))
            .then_some(())
    });
    ok(cluster
        .slurm("scancel")
        .args(["--signal=TERM", "--batch", &job]));
    wait_until(Duration::from_secs(60), "the requeue", || {
        (cluster.job_field(&job, "Restarts") == "1" && text().contains("# flotilla exited"))
            .then_some(())
    });
    let first = text();
    assert!(first.contains("# flotilla exited 75"), "{mode}:\n{first}");
    let step = number_after(&first, "# stop requested (SIGTERM): stopping after step ");
    assert!((40..STEPS).contains(&step), "{mode}: {step}");
    assert!(
        first.contains(&format!(
            "stopped after step {step}, its checkpoint committed"
        )) && first.contains("within --term-grace-s 20"),
        "{mode}:\n{first}"
    );
    // Requeued jobs wait two minutes before they are eligible again; the test does not.
    ok(cluster
        .slurm("scontrol")
        .args(["update", &format!("jobid={job}"), "StartTime=now"]));
    wait_until(Duration::from_secs(180), "the requeued job's end", || {
        let state = cluster.job_field(&job, "JobState");
        ["COMPLETED", "FAILED", "CANCELLED"]
            .contains(&state.as_str())
            .then_some(())
    });
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
    println!("{mode} mode: job {job} pre-empted after step {step}, requeued, resumed, finished");
}

#[test]
fn sbatch_in_both_modes_trains_is_preempted_requeues_and_resumes() {
    let Some(cluster) = Cluster::start() else {
        return;
    };
    let reference: PathBuf = cluster.dir.path().join("reference");
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
    preempted_job(&cluster, "agent", &reference);
    preempted_job(&cluster, "srun", &reference);
}
