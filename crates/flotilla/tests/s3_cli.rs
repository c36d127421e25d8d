//! Object storage from the command line (feature `s3`), against a real local S3-compatible
//! server (moto, `FLOTILLA_S3_SERVER` or `moto_server` on PATH; `.ci/run` installs it):
//! checkpoints saved to `s3://` and resumed on a "fresh machine" (an empty local cache), and a
//! run trained from an `s3://` dataset made by `data prepare -o s3://`, both ending
//! bit-identical (every byte of `--save`'s model) to the same runs on local directories.
#![cfg(feature = "s3")]
#[path = "support/cli.rs"]
mod cli;

use std::path::Path;
use std::process::Command;

use cli::{MICRO, loss_at};
use objstore::test_server::{BUCKET, S3Server};

/// Runs `flotilla args...` reaching `server`, with checkpoint caches under `ckpt_cache`;
/// asserts success and returns stdout.
fn flotilla(server: &S3Server, ckpt_cache: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(args)
        .envs(server.env())
        .env("FLOTILLA_CKPT_CACHE", ckpt_cache)
        // The default data cache goes there too, not into the machine's /tmp.
        .env("TMPDIR", ckpt_cache)
        .output()
        .expect("run flotilla");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "flotilla {args:?} failed: {stderr}\n{stdout}"
    );
    stdout
}

/// `train` [`MICRO`] for `steps` steps with `extra` arguments.
fn train(server: &S3Server, ckpt_cache: &Path, steps: &str, extra: &[&str]) -> String {
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&["--steps", steps, "--log-every", "1"]);
    args.extend_from_slice(extra);
    flotilla(server, ckpt_cache, &args)
}

/// The snapshot id of the local dataset in `dir`.
fn snapshot(dir: &str) -> String {
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(Path::new(dir).join("manifest.json")).unwrap())
            .unwrap();
    m["snapshot"].as_str().unwrap().to_string()
}

/// Every file `--save` wrote in `dir`, by name, with its bytes.
fn saved(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "nothing saved in {}", dir.display());
    files
}

#[test]
fn checkpoints_in_s3_resume_on_a_fresh_machine_bit_identically() {
    let server = S3Server::start();
    let tmp = tempfile::tempdir().unwrap();
    let p = |name: &str| tmp.path().join(name).display().to_string();
    let local = train(
        &server,
        tmp.path(),
        "6",
        &[
            "--ckpt-dir",
            &p("local"),
            "--ckpt-every",
            "3",
            "--save",
            &p("a"),
        ],
    );

    // Three steps, saved to the bucket; then the machine is "lost": the next run has an empty
    // local cache, fetches step 3 from the bucket and goes on to step 6.
    let url = format!("s3://{BUCKET}/runs/r1");
    let first = train(
        &server,
        &tmp.path().join("machine-1"),
        "3",
        &["--ckpt-dir", &url, "--ckpt-every", "3"],
    );
    assert!(
        first.contains(&format!("step 3 durably committed to {url}")),
        "{first}"
    );
    let second = train(
        &server,
        &tmp.path().join("machine-2"),
        "6",
        &["--ckpt-dir", &url, "--ckpt-every", "3", "--save", &p("b")],
    );
    assert!(
        second.contains(&format!("fetched step 3 from {url}")),
        "{second}"
    );
    assert!(
        second.contains(&format!("step 6 durably committed to {url}")),
        "{second}"
    );
    for step in 4..=6 {
        assert_eq!(
            loss_at(&second, step, 6),
            loss_at(&local, step, 6),
            "step {step}"
        );
    }
    assert!(saved(&tmp.path().join("a")) == saved(&tmp.path().join("b")));

    // A third machine at the end: it fetches step 6, has nothing to train and nothing to
    // upload, and succeeds.
    let done = train(
        &server,
        &tmp.path().join("machine-3"),
        "6",
        &["--ckpt-dir", &url, "--ckpt-every", "3"],
    );
    assert!(
        done.contains(&format!("fetched step 6 from {url}")) && done.contains("nothing left"),
        "{done}"
    );
    assert!(!done.contains("durably committed"), "{done}");

    // The bucket holds both steps, each with its COMMIT object.
    let store = objstore::RemoteStore::open(&url, &server.options()).unwrap();
    let mut dirs = store.list_dirs().unwrap();
    dirs.sort();
    assert_eq!(dirs, vec!["step-3", "step-6"]);
    for d in dirs {
        assert!(store.object_size(&format!("{d}/COMMIT")).unwrap().is_some());
    }
}

#[test]
fn training_from_an_s3_dataset_is_bit_identical_to_the_local_one() {
    let server = S3Server::start();
    let tmp = tempfile::tempdir().unwrap();
    let p = |name: &str| tmp.path().join(name).display().to_string();
    let text: String = (0..3000)
        .map(|i| {
            format!(
                "Sentence {i} of the corpus, with words {} and {}.\n",
                i * 7 % 13,
                i % 5
            )
        })
        .collect();
    std::fs::write(tmp.path().join("corpus.txt"), text).unwrap();
    let corpus = p("corpus.txt");
    let url = format!("s3://{BUCKET}/datasets/corpus");
    let prep = [
        "data",
        "prepare",
        &corpus,
        "--tokenizer",
        "byte",
        "--shard-size",
        "64KiB",
        "--no-progress",
    ];
    flotilla(
        &server,
        tmp.path(),
        &[&prep[..], &["-o", &p("ds")]].concat(),
    );
    let up = flotilla(&server, tmp.path(), &[&prep[..], &["-o", &url]].concat());
    assert!(up.contains(&format!("to {url} (manifest last)")), "{up}");

    let cache = p("data-cache");
    let local = train(
        &server,
        tmp.path(),
        "5",
        &["--dataset", &p("ds"), "--save", &p("a")],
    );
    let remote = train(
        &server,
        tmp.path(),
        "5",
        &["--dataset", &url, "--data-cache", &cache, "--save", &p("b")],
    );
    for step in 1..=5 {
        assert_eq!(
            loss_at(&remote, step, 5),
            loss_at(&local, step, 5),
            "step {step}"
        );
    }
    assert!(saved(&tmp.path().join("a")) == saved(&tmp.path().join("b")));

    // `data verify` and `data inspect` read the bucket too (through the default cache).
    let verified = flotilla(
        &server,
        tmp.path(),
        &["data", "verify", &url, "--json", "--no-progress"],
    );
    let v: serde_json::Value = serde_json::from_str(verified.trim()).unwrap();
    assert_eq!(v["snapshot"], serde_json::json!(snapshot(&p("ds"))), "{v}");
    let inspected = flotilla(&server, tmp.path(), &["data", "inspect", &url, "--json"]);
    assert!(inspected.contains(&snapshot(&p("ds"))), "{inspected}");

    // The bench measures the loader on the warm cache and says what the fetches did.
    let bench = flotilla(
        &server,
        tmp.path(),
        &[
            "data",
            "bench",
            "--dataset",
            &url,
            "--data-cache",
            &p("bench-cache"),
            "--seq-len",
            "32",
            "--json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(bench.trim()).unwrap();
    let fetched = &v["fetched"][0];
    assert!(fetched["shards"].as_u64().unwrap() >= 1, "{v}");
    assert!(v["loader_gbps"].as_f64().unwrap() > 0.0, "{v}");
}

#[test]
fn a_preempted_run_leaves_its_step_durable_in_s3_and_resumes_there_on_a_fresh_machine() {
    const STEPS: &str = "1500";
    let server = S3Server::start();
    let tmp = tempfile::tempdir().unwrap();
    let p = |name: &str| tmp.path().join(name).display().to_string();
    let common = ["--log-every", "1", "--term-grace-s", "30"];
    let local = train(
        &server,
        tmp.path(),
        STEPS,
        &[&common[..], &["--ckpt-dir", &p("local"), "--save", &p("a")]].concat(),
    );

    let url = format!("s3://{BUCKET}/runs/preempted");
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&["--steps", STEPS, "--ckpt-dir", &url]);
    args.extend_from_slice(&common);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_flotilla"));
    cmd.args(&args)
        .envs(server.env())
        .env("FLOTILLA_CKPT_CACHE", tmp.path().join("machine-1"));
    let mut run = cli::Running::start(&mut cmd);
    run.wait_for(&format!("step      3/{STEPS}"));
    // SAFETY: kill(2) on the process this test started; no memory involved.
    unsafe { libc::kill(run.child.id() as libc::pid_t, libc::SIGTERM) };
    let (code, out, err, _) = run.finish();
    assert_eq!(code, Some(75), "{out}\n{err}");
    let step = cli::stop_step(&out);
    assert!(
        out.contains(&format!("step {step} durably committed to {url}")),
        "{out}"
    );

    let resumed = train(
        &server,
        &tmp.path().join("machine-2"),
        STEPS,
        &[&common[..], &["--ckpt-dir", &url, "--save", &p("b")]].concat(),
    );
    assert!(
        resumed.contains(&format!("fetched step {step} from {url}")),
        "{resumed}"
    );
    let last: u64 = STEPS.parse().unwrap();
    assert_eq!(loss_at(&resumed, last, last), loss_at(&local, last, last));
    assert!(saved(&tmp.path().join("a")) == saved(&tmp.path().join("b")));
}
