//! Pre-emption through the binary: SIGTERM to the launcher, to one worker, to a one-process
//! run, or to every task of an `--srun` job (as Slurm sends it) stops the run after the same
//! step on every rank, commits that step's checkpoint within `--term-grace-s` and exits 75; the
//! rerun resumes at that step and ends with the saved model byte-for-byte equal to an
//! undisturbed run's. A worker that cannot save in time is killed at the grace. Also: the
//! torchrun variables the workers see, torchrun's flag spellings and `PET_*` variables, and
//! `--log-dir` in torchrun's layout.
//!
//! The scenarios run one at a time (a lock): their timing (a signal after step 3) should not
//! race other scenarios' workers for the cores.
#[path = "support/cli.rs"]
mod cli;

use cli::{MICRO, Running, loss_at};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

const STEPS: u64 = 12;
/// The exit code of a pre-empted run (launch::EXIT_PREEMPTED).
const PREEMPTED: i32 = 75;
/// `--term-grace-s` of the scenarios.
const GRACE_S: f64 = 20.0;

/// One scenario at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// MICRO on `nproc` processes x 2 rows, one thread each, every step logged, for `STEPS` steps,
/// plus `extra`.
fn args(nproc: &str, extra: &[&str]) -> Vec<String> {
    let mut args = vec!["train".to_string()];
    let mut micro = MICRO.iter();
    while let Some(&arg) = micro.next() {
        if arg == "--threads" || arg == "--batch" || arg == "--nproc" {
            micro.next();
        } else {
            args.push(arg.into());
        }
    }
    let steps = STEPS.to_string();
    let grace = GRACE_S.to_string();
    let common = [
        "--threads",
        "1",
        "--batch",
        "2",
        "--log-every",
        "1",
        "--steps",
        &steps,
        "--no-plan",
        "--term-grace-s",
        &grace,
    ];
    args.extend(common.iter().map(|s| s.to_string()));
    if !nproc.is_empty() {
        args.extend(["--nproc".to_string(), nproc.to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn flotilla() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flotilla"))
}

fn term(pid: u32) {
    // SAFETY: kill(2) on a process this test started (or its child); no memory involved.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
}

/// The pids of `pid`'s children (its workers), oldest first.
fn children(pid: u32) -> Vec<u32> {
    let path = format!("/proc/{pid}/task/{pid}/children");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    text.split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect()
}

/// The committed steps of `dir`, as `flotilla ckpt ls` lists them.
fn committed(dir: &Path) -> Vec<u64> {
    let (ok, out, err) = cli::flotilla(&["ckpt", "ls", dir.to_str().unwrap()]);
    assert!(ok, "{err}");
    out.lines()
        .filter(|l| l.contains("committed"))
        .filter_map(|l| {
            l.strip_prefix("step-")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// An undisturbed run: its stdout, and its saved model in `model/` of the directory.
type Reference = (String, tempfile::TempDir);

/// The undisturbed run of `layout` on `nproc` processes.
fn undisturbed(nproc: &str, layout: &[&str]) -> Reference {
    let dir = tempfile::tempdir().unwrap();
    let (save, ck) = (dir.path().join("model"), dir.path().join("ck"));
    let mut extra = layout.to_vec();
    // Its own fresh checkpoint directory (--ckpt-sync needs one): saved at the end only.
    extra.extend([
        "--save",
        save.to_str().unwrap(),
        "--ckpt-dir",
        ck.to_str().unwrap(),
    ]);
    let out = flotilla().args(args(nproc, &extra)).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    (stdout, dir)
}

/// The undisturbed data-parallel run (made once): 2 workers under the launcher.
fn straight() -> &'static Reference {
    static STRAIGHT: OnceLock<Reference> = OnceLock::new();
    STRAIGHT.get_or_init(|| undisturbed("2", &[]))
}

/// After a pre-emption that printed `out` and exited `code` in `took` after the signal: the
/// stop step, committed and reported within the grace.
fn check_preempted(code: Option<i32>, out: &str, err: &str, took: Duration, ck: &Path) -> u64 {
    assert_eq!(code, Some(PREEMPTED), "{out}\n{err}");
    let step = cli::stop_step(out);
    assert!((3..STEPS).contains(&step), "{out}");
    assert_eq!(committed(ck).last(), Some(&step), "{out}");
    assert!(
        took.as_secs_f64() < GRACE_S,
        "exit {took:?} after the signal"
    );
    assert!(
        err.contains(&format!(
            "stopped after step {step}, its checkpoint committed"
        )),
        "{err}"
    );
    step
}

/// The rerun of a pre-empted run resumes at `step` and ends like the undisturbed one: every
/// loss after it, and the saved model byte for byte.
fn check_resumed(cmd: &mut Command, step: u64, save: &Path, (reference, dir): &Reference) {
    let out = cmd.output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("step {step}\n")) && stdout.contains("# resumed from"),
        "{stdout}"
    );
    assert!(
        !stdout.contains(&format!("step {step:>6}/{STEPS}")),
        "step {step} trained twice:\n{stdout}"
    );
    for s in step + 1..=STEPS {
        assert_eq!(
            loss_at(&stdout, s, STEPS),
            loss_at(reference, s, STEPS),
            "step {s}"
        );
    }
    for file in ["model.safetensors", "flotilla.json"] {
        let a = std::fs::read(dir.path().join("model").join(file)).unwrap();
        let b = std::fs::read(save.join(file)).unwrap();
        assert!(a == b, "{file} differs from the undisturbed run's");
    }
}

/// SIGTERM to `target(launcher pid)` after step 3 of a run of `layout` on `nproc`; then the
/// rerun, checked against `reference`.
fn preempt_and_resume(
    nproc: &str,
    layout: &[&str],
    reference: &Reference,
    target: impl Fn(u32) -> u32,
) {
    let tmp = tempfile::tempdir().unwrap();
    let (ck, save) = (tmp.path().join("ck"), tmp.path().join("model"));
    let mut extra = layout.to_vec();
    extra.extend([
        "--ckpt-dir",
        ck.to_str().unwrap(),
        "--save",
        save.to_str().unwrap(),
    ]);
    let mut run = Running::start(flotilla().args(args(nproc, &extra)));
    run.wait_for(&format!("step      3/{STEPS}"));
    term(target(run.child.id()));
    let (code, out, err, took) = run.finish();
    let step = check_preempted(code, &out, &err, took, &ck);
    check_resumed(flotilla().args(args(nproc, &extra)), step, &save, reference);
}

#[test]
fn sigterm_to_the_launcher_saves_and_the_rerun_loses_no_step() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    preempt_and_resume("2", &[], straight(), |launcher| launcher);
}

/// The mesh engines stop alike: DP1 x TP2 (asynchronous pieces) and a two-stage pipeline
/// saving synchronously.
#[test]
fn tensor_and_pipeline_layouts_stop_at_a_step_and_resume() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pipeline = [
        "--pp",
        "2",
        "--layers",
        "2",
        "--grad-accum",
        "2",
        "--ckpt-sync",
    ];
    for layout in [&["--tp", "2"][..], &pipeline[..]] {
        let reference = undisturbed("2", layout);
        preempt_and_resume("2", layout, &reference, |launcher| launcher);
    }
}

#[test]
fn sigterm_to_one_worker_stops_every_rank_at_the_same_step() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    preempt_and_resume("2", &[], straight(), |launcher| {
        let workers = children(launcher);
        assert_eq!(workers.len(), 2, "{workers:?}");
        workers[1]
    });
}

#[test]
fn sigterm_to_a_one_process_run_saves_and_resumes() {
    // One process: no launcher, the trainer itself takes the signal. Its loss differs from two
    // ranks', so its own undisturbed run is the reference for the model.
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let (ck, save) = (tmp.path().join("ck"), tmp.path().join("model"));
    let reference = tmp.path().join("ref");
    let ok = flotilla()
        .args(args(
            "1",
            &["--batch", "4", "--save", reference.to_str().unwrap()],
        ))
        .status()
        .unwrap();
    assert!(ok.success());
    let extra = [
        "--batch",
        "4",
        "--ckpt-dir",
        ck.to_str().unwrap(),
        "--save",
        save.to_str().unwrap(),
    ];
    let mut run = Running::start(flotilla().args(args("1", &extra)));
    run.wait_for(&format!("step      3/{STEPS}"));
    term(run.child.id());
    let (code, out, err, took) = run.finish();
    let step = check_preempted(code, &out, &err, took, &ck);
    let rerun = flotilla().args(args("1", &extra)).output().unwrap();
    let stdout = String::from_utf8_lossy(&rerun.stdout);
    assert!(rerun.status.success(), "{stdout}");
    assert!(stdout.contains(&format!("# resumed from {} step {step}", ck.display())));
    for file in ["model.safetensors", "flotilla.json"] {
        let a = std::fs::read(reference.join(file)).unwrap();
        let b = std::fs::read(save.join(file)).unwrap();
        assert!(a == b, "{file} differs from the undisturbed run's");
    }
}

/// A worker that cannot reach its next step boundary (stalled by chaos) is killed at the
/// grace: the job still exits 75, says not every worker saved, and what is left is the last
/// committed checkpoint.
#[test]
fn a_worker_that_cannot_save_in_time_is_killed_at_the_grace() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let mut a = args(
        "2",
        &[
            "--ckpt-dir",
            ck.to_str().unwrap(),
            "--ckpt-every",
            "2",
            "--chaos",
            "stall@4:1",
            "--watchdog-s",
            "120",
        ],
    );
    a.extend(["--term-grace-s".into(), "1.5".into()]);
    let mut run = Running::start(flotilla().args(&a));
    run.wait_for(&format!("step      4/{STEPS}"));
    std::thread::sleep(Duration::from_millis(300));
    term(run.child.id());
    let (code, out, err, took) = run.finish();
    assert_eq!(code, Some(PREEMPTED), "{out}\n{err}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert!(
        out.contains("not every worker saved within --term-grace-s 1.5"),
        "{out}"
    );
    // Step 4's asynchronous save commits during step 5, which rank 1 never joins.
    let last = committed(&ck).last().copied();
    assert!(matches!(last, Some(2 | 4)), "{last:?}:\n{out}");
}

/// `--srun`: two tasks started as srun starts them (Slurm's variables, no agent), both sent
/// SIGTERM as Slurm does; they stop after the same step, rank 0 commits it, both exit 75, and
/// the rerun ends like two workers under the launcher.
#[test]
fn srun_tasks_train_stop_on_sigterm_and_resume() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    straight();
    let tmp = tempfile::tempdir().unwrap();
    let (ck, save) = (tmp.path().join("ck"), tmp.path().join("model"));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let extra = [
        "--srun",
        "--ckpt-dir",
        ck.to_str().unwrap(),
        "--save",
        save.to_str().unwrap(),
    ];
    let task = |rank: usize| {
        let mut c = flotilla();
        c.args(args("", &extra))
            .env("SLURM_JOB_ID", "42")
            .env("SLURM_PROCID", rank.to_string())
            .env("SLURM_LOCALID", rank.to_string())
            .env("SLURM_NTASKS", "2")
            .env("SLURM_NODEID", "0")
            .env("SLURM_TASKS_PER_NODE", "2")
            .env("SLURM_JOB_NODELIST", "localhost")
            .env("MASTER_PORT", &port)
            .env("FLOTILLA_SECRET", "srun-test-secret-0123456789abcdef");
        c
    };
    let mut rank0 = Running::start(&mut task(0));
    let rank1 = Running::start(&mut task(1));
    rank0.wait_for(&format!("step      3/{STEPS}"));
    term(rank0.child.id());
    term(rank1.child.id());
    let (code, out, err, took) = rank0.finish();
    let step = check_preempted(code, &out, &err, took, &ck);
    let (code1, _, err1, _) = rank1.finish();
    assert_eq!(code1, Some(PREEMPTED), "{err1}");
    let mut r0 = task(0);
    let r1 = task(1).stdout(Stdio::null()).spawn().unwrap();
    check_resumed(&mut r0, step, &save, straight());
    let st = r1.wait_with_output().unwrap();
    assert!(st.status.success());
}

/// Workers see torchrun's variables; torchrun's flag spellings and `PET_*` variables are
/// accepted; `--log-dir` keeps each rank's output in torchrun's layout.
#[test]
fn torchrun_conventions() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let logs = tmp.path().join("logs");
    let mut a = args("", &["--nproc_per_node", "2", "--max_restarts", "0"]);
    a.extend(["--log-dir".into(), logs.to_str().unwrap().into()]);
    a.extend(["--rdzv-id".into(), "job7".into()]);
    a.extend(["--master-addr".into(), "127.0.0.1".into()]);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut run = Running::start(flotilla().args(&a).env("PET_MASTER_PORT", port.to_string()));
    run.wait_for(&format!("step      2/{STEPS}"));
    let workers = children(run.child.id());
    assert_eq!(workers.len(), 2, "{workers:?}");
    for (local, pid) in workers.iter().enumerate() {
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let env: Vec<String> = env
            .split(|&b| b == 0)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .collect();
        for want in [
            format!("RANK={local}"),
            format!("LOCAL_RANK={local}"),
            "WORLD_SIZE=2".into(),
            "LOCAL_WORLD_SIZE=2".into(),
            "GROUP_RANK=0".into(),
            "GROUP_WORLD_SIZE=1".into(),
            "MASTER_ADDR=127.0.0.1".into(),
            format!("MASTER_PORT={port}"),
            "TORCHELASTIC_RESTART_COUNT=0".into(),
            "TORCHELASTIC_MAX_RESTARTS=0".into(),
        ] {
            assert!(env.contains(&want), "worker {local}: no {want} in {env:?}");
        }
    }
    let (code, out, err, _) = run.finish();
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("(2 ranks)"), "{out}");
    for local in ["0", "1"] {
        let dir = logs.join("job7").join("attempt_0").join(local);
        let stdout = std::fs::read_to_string(dir.join("stdout.log")).unwrap();
        assert!(dir.join("stderr.log").exists());
        if local == "0" {
            assert!(
                stdout.contains(&format!("step {STEPS:>6}/{STEPS}")),
                "{stdout}"
            );
        }
    }
    // PET_NPROC_PER_NODE stands for --nproc; a flag torchrun has and Flotilla does not is
    // refused by name.
    let out = flotilla()
        .args(args("", &["--steps", "1"]))
        .env("PET_NPROC_PER_NODE", "2")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("(2 ranks)"));
    let (ok, _, err) = cli::flotilla(&["train", "--rdzv-backend", "c10d"]);
    assert!(!ok && err.contains("--rdzv-backend"), "{err}");
    let (ok, _, err) = cli::flotilla(&["train", "--srun", "--nproc", "2"]);
    assert!(!ok && err.contains("--nproc"), "{err}");
}
