//! A dataset manifest that is a FIFO or a link to `/dev/zero`, through the binary: `data
//! verify` and `data inspect` exit non-zero within a deadline, naming the manifest, instead of
//! blocking on the FIFO or reading the device until memory runs out. Shards truncated under a
//! running `train`: the run ends with an error naming a shard, not by SIGBUS.
#[path = "support/cli.rs"]
mod cli;

use std::path::Path;
use std::time::Duration;

/// How long one command may take before the test calls it hung.
const DEADLINE: Duration = Duration::from_secs(30);

/// Runs `flotilla args...` killing it at [`DEADLINE`]; returns (success, stderr).
fn run_with_deadline(scratch: &Path, args: &[&str]) -> (bool, String) {
    let (status, _, err) = cli::run_with_deadline(scratch, args, DEADLINE);
    (status.success(), err)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A small prepared dataset in `root/ds` (made through the library: `data prepare` itself is
/// tested in data_cli.rs).
fn dataset(root: &Path) -> std::path::PathBuf {
    let input = root.join("corpus.txt");
    let text: String = (0..20).map(|i| format!("Document {i}.\n\n")).collect();
    std::fs::write(&input, text).unwrap();
    let out = root.join("ds");
    let cfg = data::PrepareConfig::new(vec![s(&input).into()], out.clone());
    data::prepare(&cfg, &data::ByteTokenizer, &mut |_| {}).unwrap();
    out
}

/// Both commands on `ds`, whose manifest is `what`: each fails in time naming the manifest
/// and saying what it is.
fn assert_refused(scratch: &Path, ds: &Path, what: &str) {
    let manifest = ds.join("manifest.json");
    for cmd in ["verify", "inspect"] {
        let (ok, err) = run_with_deadline(scratch, &["data", cmd, s(ds)]);
        assert!(
            !ok,
            "data {cmd} with a manifest that is {what} succeeded: {err}"
        );
        assert!(
            err.contains(&manifest.display().to_string()) && err.contains(what),
            "data {cmd}, manifest {what}: {err}"
        );
    }
}

#[test]
fn a_fifo_or_device_manifest_is_refused_in_time() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    let manifest = ds.join("manifest.json");
    let (ok, err) = run_with_deadline(tmp.path(), &["data", "verify", s(&ds)]);
    assert!(ok, "{err}");
    std::fs::rename(&manifest, tmp.path().join("manifest.saved")).unwrap();

    let c = std::ffi::CString::new(s(&manifest)).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    assert_refused(tmp.path(), &ds, "FIFO");
    std::fs::remove_file(&manifest).unwrap();

    std::os::unix::fs::symlink("/dev/zero", &manifest).unwrap();
    assert_refused(tmp.path(), &ds, "character device");
}

#[test]
fn shards_truncated_under_a_run_end_it_with_an_error_naming_the_shard() {
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempfile::tempdir().unwrap();
    let ds = tmp.path().join("ds");
    // 200k tokens in 64 KiB shards: every shard stays mapped for the whole run.
    let synth = [
        "data",
        "synth",
        "--out",
        s(&ds),
        "--tokens",
        "2e5",
        "--vocab",
        "257",
        "--shard-size",
        "64KiB",
        "--doc-tokens",
        "1000",
        "--no-progress",
    ];
    let (status, _, err) = cli::run_with_deadline(tmp.path(), &synth, DEADLINE);
    assert!(status.success(), "{err}");
    let mut args = vec![
        "train",
        "--steps",
        "1000000",
        "--log-every",
        "1",
        "--dataset",
        s(&ds),
    ];
    args.extend_from_slice(cli::MICRO);
    let out_path = tmp.path().join("train.out");
    let err_path = tmp.path().join("train.err");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(&args)
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    // Past the first verified epoch's start: a few steps done.
    while !std::fs::read_to_string(&out_path)
        .unwrap()
        .contains("step     10/")
    {
        assert!(child.try_wait().unwrap().is_none(), "train ended early");
        assert!(start.elapsed() < DEADLINE, "train never reached step 10");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut shards = Vec::new();
    for e in std::fs::read_dir(&ds).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x != "json") {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(4096)
                .unwrap();
            shards.push(path.display().to_string());
        }
    }
    assert!(!shards.is_empty());
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > DEADLINE {
            child.kill().unwrap();
            panic!("train still running after its shards were truncated");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = std::fs::read_to_string(&err_path).unwrap();
    assert_eq!(status.signal(), None, "killed by a signal: {status}\n{err}");
    assert!(!status.success());
    assert!(
        shards.iter().any(|p| err.contains(p)) && err.contains("changed on disk while in use"),
        "{err}"
    );
}
