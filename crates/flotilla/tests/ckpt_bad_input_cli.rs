//! Hostile or damaged files a run writes and reads back, through the binary: a run state that
//! lies (absurd row counts, an absurd step, a step that is not the manifest's, a deeply nested
//! field) behind a recomputed commit marker is set aside naming the manifest, and the run
//! resumes from the step before, within a deadline; a second job on a checkpoint directory is
//! refused naming the holder, and a dead holder's lock is taken over; a saved model (`--save`)
//! with a flipped byte is refused by `generate` naming the file.
#[path = "support/cli.rs"]
mod cli;

use std::path::Path;
use std::time::Duration;

use cli::MICRO;

/// How long one run may take before the test calls it hung.
const DEADLINE: Duration = Duration::from_secs(60);

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `train` for `steps` steps saving every 2 into `ck` (synchronously), killed at the
/// deadline; returns (success, stdout, stderr).
fn train(scratch: &Path, steps: &str, ck: &Path) -> (bool, String, String) {
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&[
        "--steps",
        steps,
        "--log-every",
        "1",
        "--ckpt-dir",
        s(ck),
        "--ckpt-every",
        "2",
        "--ckpt-sync",
    ]);
    let (status, out, err) = cli::run_with_deadline(scratch, &args, DEADLINE);
    (status.success(), out, err)
}

/// Rewrites the run state of `ck`'s step `step` with `edit` and recomputes its commit marker,
/// as a tool that knows the format would: only the run state's own checks can catch it.
fn rewrite_state(ck: &Path, step: u64, edit: impl FnOnce(&mut serde_json::Value)) {
    let dir = ck.join(format!("step-{step}"));
    let path = dir.join("manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut manifest["state"]);
    let bytes = serde_json::to_vec(&manifest).unwrap();
    write_with_marker(&dir, step, &bytes);
}

/// Writes `bytes` as `dir`'s manifest with a commit marker that vouches for them.
fn write_with_marker(dir: &Path, step: u64, bytes: &[u8]) {
    std::fs::write(dir.join("manifest.json"), bytes).unwrap();
    let marker = ckpt::CommitMarker {
        format: "flotilla-ckpt".into(),
        step,
        manifest_bytes: bytes.len() as u64,
        manifest_xxh3_128: ckpt::checksum_hex(bytes),
    };
    std::fs::write(dir.join("COMMIT"), serde_json::to_vec(&marker).unwrap()).unwrap();
}

/// `depth` nested JSON arrays around a 1.
fn nested(depth: usize) -> String {
    format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
}

/// A copy of the checkpoint directory `from` in `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

#[test]
fn a_lying_run_state_is_set_aside_naming_the_manifest() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    let (ok, out, err) = train(tmp.path(), "4", &good);
    assert!(ok, "{err}\n{out}");

    type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "absurd rows",
            Box::new(|v| v["rows_drawn"] = 1_000_000_000_000_000u64.into()),
            "rows drawn",
        ),
        (
            "absurd consistent counts",
            Box::new(|v| {
                v["batches_drawn"] = (1u64 << 50).into();
                v["rows_drawn"] = (1u64 << 52).into();
            }),
            "per step",
        ),
        (
            "absurd step",
            Box::new(|v| v["step"] = (u64::MAX / 2).into()),
            "manifest's step 4",
        ),
        (
            "step off by one",
            Box::new(|v| v["step"] = 3.into()),
            "manifest's step 4",
        ),
        (
            "nested field",
            Box::new(|v| v["extra"] = serde_json::from_str(&nested(100)).unwrap()),
            "unknown field",
        ),
    ];
    for (i, (what, edit, needle)) in cases.into_iter().enumerate() {
        let ck = tmp.path().join(format!("case{i}"));
        copy_dir(&good, &ck);
        rewrite_state(&ck, 4, edit);
        let (ok, out, err) = train(tmp.path(), "6", &ck);
        assert!(ok, "{what}: {err}\n{out}");
        let manifest = ck.join("step-4").join("manifest.json");
        let rejected = out
            .lines()
            .find(|l| l.starts_with("# checkpoint rejected (lost): step 4"))
            .unwrap_or_else(|| panic!("{what}: step 4 not rejected:\n{out}"));
        assert!(
            rejected.contains(&manifest.display().to_string()) && rejected.contains(needle),
            "{what}: {rejected}"
        );
        assert!(
            out.contains(&format!("# resumed from {} step 2", s(&ck))),
            "{what}: {out}"
        );
        // Nothing lost: the lying step is kept aside for inspection.
        assert!(ck.join("step-4.rejected").is_dir(), "{what}");
        assert_eq!(ckpt::list_committed(&ck).unwrap(), vec![2, 4, 6], "{what}");
    }

    // Nested deeper than the JSON parser follows: the manifest itself is refused.
    let ck = tmp.path().join("deep");
    copy_dir(&good, &ck);
    let path = ck.join("step-4").join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let deep = text.replacen(
        "\"state\": {",
        &format!("\"state\": {{\"x\": {},", nested(100_000)),
        1,
    );
    assert_ne!(deep, text);
    write_with_marker(&ck.join("step-4"), 4, deep.as_bytes());
    let (ok, out, err) = train(tmp.path(), "6", &ck);
    assert!(ok, "deep nesting: {err}\n{out}");
    assert!(
        out.contains("# checkpoint rejected (lost): step 4") && out.contains("manifest"),
        "{out}"
    );
    assert!(
        out.contains(&format!("# resumed from {} step 2", s(&ck))),
        "{out}"
    );
}

/// Waits up to the deadline for `path` to hold a lock holder's record.
fn wait_for_holder(path: &Path) -> String {
    let start = std::time::Instant::now();
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if !text.is_empty() {
            return text;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{} never recorded a holder",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn two_jobs_cannot_share_a_checkpoint_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&[
        "--steps",
        "1000000",
        "--ckpt-dir",
        s(&ck),
        "--ckpt-every",
        "20",
    ]);
    let mut first = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(&args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let holder = wait_for_holder(&ck.join("LOCK"));
    let pid = format!("pid {}", first.id());
    assert!(holder.contains(&pid), "{holder}");

    // The second job is refused at once, naming the directory and the holder.
    let (ok, out, err) = train(tmp.path(), "4", &ck);
    assert!(!ok, "a second job shared {}:\n{out}", ck.display());
    assert!(
        err.contains(&ck.display().to_string()) && err.contains(&pid) && err.contains("in use"),
        "{err}"
    );
    assert!(
        first.try_wait().unwrap().is_none(),
        "the first job was disturbed"
    );

    // Killed without a chance to release it, the first job's lock is taken over.
    first.kill().unwrap();
    first.wait().unwrap();
    let (ok, out, err) = train(tmp.path(), "4", &ck);
    assert!(ok, "{err}\n{out}");
    assert!(
        out.contains(&format!(
            "# checkpoint directory lock taken over from {pid} "
        )),
        "{out}"
    );
    // A clean exit leaves no holder behind.
    assert!(!ck.join("LOCK").exists());
}

#[test]
fn a_damaged_saved_model_is_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let save = tmp.path().join("model");
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&["--data", "grammar", "--tokenizer", "byte", "--steps", "2"]);
    args.extend_from_slice(&["--save", s(&save)]);
    let (status, out, err) = cli::run_with_deadline(tmp.path(), &args, DEADLINE);
    assert!(status.success(), "{err}\n{out}");
    let generate = [
        "generate",
        "--model",
        s(&save),
        "--tokens",
        "4",
        "--temperature",
        "0",
    ];
    let (status, _, err) = cli::run_with_deadline(tmp.path(), &generate, DEADLINE);
    assert!(status.success(), "{err}");

    let file = save.join("model.safetensors");
    let good = std::fs::read(&file).unwrap();
    // A weight's lowest bit (the last byte is a weight's), the header's length prefix, a
    // byte of the header's JSON, and a truncation.
    let header_len = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let mut cases: Vec<(&str, Vec<u8>, &str)> = Vec::new();
    for (what, at) in [
        ("weight", good.len() - 4),
        ("prefix", 0),
        ("header", 8 + header_len / 2),
    ] {
        let mut bad = good.clone();
        bad[at] ^= 1;
        cases.push((what, bad, "damaged"));
    }
    cases.push(("truncated", good[..good.len() - 4].to_vec(), "truncated"));
    for (what, bytes, needle) in cases {
        std::fs::write(&file, &bytes).unwrap();
        let (status, _, err) = cli::run_with_deadline(tmp.path(), &generate, DEADLINE);
        assert!(!status.success(), "{what}: a damaged model loaded");
        assert!(
            err.contains(&file.display().to_string()) && err.contains(needle),
            "{what}: {err}"
        );
    }
}

/// A tmpfs of `bytes` mounted at `at`, unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    /// Mounts it, or says why not (not root, no mount namespace rights).
    fn mount(at: &Path, bytes: u64) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(at).unwrap();
        let out = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={bytes}"),
                "tmpfs",
                s(at),
            ])
            .output()
            .map_err(|e| e.to_string())?;
        match out.status.success() {
            true => Ok(Tmpfs(at.to_path_buf())),
            false => Err(String::from_utf8_lossy(&out.stderr).into()),
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// Bytes of the files under `dir`.
fn du(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            match e.file_type().unwrap().is_dir() {
                true => du(&e.path()),
                false => e.metadata().unwrap().len(),
            }
        })
        .sum()
}

#[test]
fn a_full_disk_fails_the_save_clearly_and_keeps_the_previous_step() {
    let tmp = tempfile::tempdir().unwrap();
    // One step's size, measured on the ordinary disk.
    let probe = tmp.path().join("probe");
    let (ok, out, err) = train(tmp.path(), "2", &probe);
    assert!(ok, "{err}\n{out}");
    let step = du(&probe.join("step-2"));
    // Room for one step and a half: step 2 fits, step 4 runs out of space half-way.
    let at = tmp.path().join("small");
    let _fs = match Tmpfs::mount(&at, (step * 3 / 2).div_ceil(4096) * 4096) {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("skipped: cannot mount a tmpfs here ({why})");
            return;
        }
    };
    for sync in [true, false] {
        let ck = at.join(format!("ck-sync-{sync}"));
        let mut args = vec!["train"];
        args.extend_from_slice(MICRO);
        args.extend_from_slice(&["--steps", "6", "--ckpt-dir", s(&ck), "--ckpt-every", "2"]);
        if sync {
            args.push("--ckpt-sync");
        }
        let (status, out, err) = cli::run_with_deadline(tmp.path(), &args, DEADLINE);
        assert!(
            !status.success(),
            "sync {sync}: a save to a full disk passed:\n{out}"
        );
        assert!(
            err.contains("No space left on device") && err.contains(s(&ck)),
            "sync {sync}: {err}"
        );
        // Step 2 committed and intact, nothing later presented as complete.
        assert_eq!(ckpt::list_committed(&ck).unwrap(), vec![2], "sync {sync}");
        let (ok, out, err) = cli::flotilla(&["ckpt", "verify", s(&ck)]);
        assert!(ok, "sync {sync}: {out}{err}");
        std::fs::remove_dir_all(&ck).unwrap();
    }
    // With several workers the launcher does not restart a job that ran out of space.
    let ck = at.join("ck-nproc-2");
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&["--nproc", "2", "--steps", "6", "--ckpt-dir", s(&ck)]);
    args.extend_from_slice(&["--ckpt-every", "2", "--max-restarts", "3"]);
    let (status, out, err) = cli::run_with_deadline(tmp.path(), &args, DEADLINE);
    assert!(!status.success(), "{out}");
    assert!(err.contains("No space left on device"), "{err}");
    assert!(
        !out.contains("restart") && !err.contains("restarting"),
        "{out}\n{err}"
    );
    assert_eq!(ckpt::list_committed(&ck).unwrap(), vec![2]);
}
