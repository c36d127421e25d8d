//! A dataset manifest that is a FIFO or a link to `/dev/zero`, through the binary: `data
//! verify` and `data inspect` exit non-zero within a deadline, naming the manifest, instead of
//! blocking on the FIFO or reading the device until memory runs out.
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
