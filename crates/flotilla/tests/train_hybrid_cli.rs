//! Hybrid sharding (HSDP: `--zero N --dp-shard S` / `--dp-replicate R`) through the binary
//! (issue 27): the ZeRO state sharded inside groups of S ranks and replicated across the R
//! groups trains the losses of plain ZeRO over every rank, each rank holding 1/S of what it
//! shards; a hybrid checkpoint (the replica groups sharing the writing) resumes under plain
//! ZeRO and under hybrid sharding; bad degrees are refused before spawning with the equation;
//! bf16 under ZeRO keeps sharded f32 master weights and resumes.

#[path = "support/cli.rs"]
mod cli;

use cli::{MICRO, flotilla};
use std::sync::{Mutex, MutexGuard};

/// One job at a time: 4 workers on a 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `flotilla train` with [`MICRO`] on two blocks, 4 workers of one thread, every step logged,
/// then `extra`: (success, stdout, stderr).
fn train(extra: &[&str]) -> (bool, String, String) {
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&["--layers", "2", "--threads", "1", "--nproc", "4"]);
    args.extend_from_slice(&["--batch", "2", "--log-every", "1", "--no-plan"]);
    args.extend_from_slice(&["--max-restarts", "0"]);
    args.extend_from_slice(extra);
    flotilla(&args)
}

fn train_ok(extra: &[&str]) -> String {
    let (ok, out, err) = train(extra);
    assert!(ok, "{extra:?}:\n{out}\n{err}");
    out
}

/// Each step's loss, learning rate and gradient norm, as printed.
fn lines(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.starts_with("step "))
        .filter_map(|l| l.split(" loss ").nth(1))
        .map(|l| l.split(" tokens/s").next().unwrap_or(l).to_string())
        .collect()
}

/// The optimizer megabytes of the state line.
fn optimizer_mb(out: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.starts_with("# state per rank"))
        .unwrap_or_else(|| panic!("no state line:\n{out}"));
    let after = line.split("optimizer ").nth(1).unwrap();
    after.split(" MB").next().unwrap().parse().unwrap()
}

#[test]
fn hybrid_sharding_trains_the_losses_of_zero_and_shards_over_its_groups() {
    let _one = serial();
    let zero1 = train_ok(&["--steps", "3", "--zero", "1"]);
    let hybrid = train_ok(&["--steps", "3", "--zero", "1", "--dp-shard", "2"]);
    assert_eq!(lines(&hybrid), lines(&zero1), "{hybrid}");
    assert!(
        hybrid.contains("ZeRO-1 hybrid: sharded over 2, replicated over 2"),
        "{hybrid}"
    );
    // Moments over 2 ranks instead of 4: twice ZeRO-1's, within the printed rounding.
    let (h, z) = (optimizer_mb(&hybrid), optimizer_mb(&zero1));
    assert!((h - 2.0 * z).abs() <= 0.1, "hybrid {h} MB vs ZeRO-1 {z} MB");
}

#[test]
fn a_hybrid_checkpoint_resumes_under_zero_and_under_hybrid_sharding() {
    let _one = serial();
    let straight = lines(&train_ok(&["--steps", "4", "--zero", "3"]));
    for resume in [
        &["--zero", "1"][..],
        &["--zero", "2", "--dp-shard", "2"][..],
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let ck = tmp.path().join("ck");
        let ck = ck.to_str().unwrap();
        let saving = ["--zero", "3", "--dp-replicate", "2", "--ckpt-dir", ck];
        let mut first = saving.to_vec();
        first.extend_from_slice(&["--steps", "2"]);
        assert_eq!(lines(&train_ok(&first)), straight[..2]);
        let mut second = resume.to_vec();
        second.extend_from_slice(&["--steps", "4", "--ckpt-dir", ck]);
        let out = train_ok(&second);
        assert!(
            out.contains(&format!("# resumed from {ck} step 2")),
            "{out}"
        );
        assert_eq!(lines(&out), straight[2..], "{resume:?}:\n{out}");
    }
}

#[test]
fn bad_hybrid_degrees_are_refused_before_spawning() {
    for (extra, want) in [
        (&["--dp-shard", "2"][..], "add --zero 1, 2 or 3"),
        (
            &["--zero", "1", "--dp-shard", "3"][..],
            "--dp-shard 3 x --dp-replicate 1 = 3 must equal the data-parallel world of 4",
        ),
        (
            &["--zero", "1", "--dp-shard", "2", "--tp", "2"][..],
            "hybrid sharding is built for data parallelism alone",
        ),
    ] {
        let mut args = extra.to_vec();
        args.extend_from_slice(&["--steps", "1"]);
        let (ok, out, err) = train(&args);
        assert!(!ok && err.contains(want), "{extra:?}:\n{out}\n{err}");
        assert!(!out.contains("step "), "{extra:?} trained:\n{out}");
    }
}

/// `--bf16` under ZeRO (also hybrid): each rank keeps the f32 master weights of its parts
/// only; the runs print plain data parallel bf16's losses (within bf16's rounding of
/// differently ordered sums), and a ZeRO-3 bf16 save (the master weights) resumes to the
/// straight run's step lines.
#[test]
fn zero_trains_in_bf16_and_resumes() {
    let _one = serial();
    let loss = |out: &str| -> Vec<f64> {
        lines(out)
            .iter()
            .map(|l| l.split_whitespace().next().unwrap().parse().unwrap())
            .collect()
    };
    let want = loss(&train_ok(&["--steps", "3", "--bf16"]));
    for zero in [
        &["--zero", "1"][..],
        &["--zero", "3", "--dp-shard", "2"][..],
    ] {
        let mut args = zero.to_vec();
        args.extend_from_slice(&["--bf16", "--steps", "3"]);
        let straight = train_ok(&args);
        for (g, w) in loss(&straight).iter().zip(&want) {
            assert!((g - w).abs() <= 2e-3, "{zero:?}:\n{straight}");
        }
        let tmp = tempfile::tempdir().unwrap();
        let ck = tmp.path().join("ck");
        let ck = ck.to_str().unwrap();
        let mut first = zero.to_vec();
        first.extend_from_slice(&["--bf16", "--steps", "2", "--ckpt-dir", ck]);
        train_ok(&first);
        let mut second = zero.to_vec();
        second.extend_from_slice(&["--bf16", "--steps", "3", "--ckpt-dir", ck]);
        let out = train_ok(&second);
        assert!(
            out.contains(&format!("# resumed from {ck} step 2")),
            "{out}"
        );
        assert_eq!(lines(&out), lines(&straight)[2..], "{zero:?}:\n{out}");
    }
}
