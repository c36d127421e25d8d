//! A damaged safetensors header in a rank file, through the binary: `ckpt verify` fails naming
//! the file (the header lies outside every chunk checksum; the manifest's header hash covers
//! it), and `train` rejects that step and resumes from the one before it.
#[path = "support/cli.rs"]
mod cli;

use std::path::Path;

use cli::{MICRO, flotilla};

/// `train` for `steps` steps saving every 2 into `ck`; returns stdout.
fn train(steps: &str, ck: &str) -> String {
    let mut args = vec!["train"];
    args.extend_from_slice(MICRO);
    args.extend_from_slice(&[
        "--steps",
        steps,
        "--log-every",
        "1",
        "--ckpt-dir",
        ck,
        "--ckpt-every",
        "2",
        "--ckpt-sync",
    ]);
    let (ok, out, err) = flotilla(&args);
    assert!(ok, "train failed: {err}\n{out}");
    out
}

/// Flips the low bit of the last digit of the first data offset in `file`'s header: the
/// header stays valid JSON (a '6' becomes a '7', no leading zero appears), only its offsets
/// are wrong.
fn flip_header_digit(file: &Path) {
    let mut bytes = std::fs::read(file).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let text = std::str::from_utf8(&bytes[8..8 + len]).unwrap();
    let pat = "\"data_offsets\":[";
    let start = text.find(pat).unwrap() + pat.len();
    let pos = 8 + start + text[start..].find(',').unwrap() - 1;
    assert!(bytes[pos].is_ascii_digit());
    bytes[pos] ^= 1;
    serde_json::from_slice::<serde_json::Value>(&bytes[8..8 + len]).unwrap();
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn a_damaged_header_fails_verify_and_train_falls_back() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ckpt");
    let ck_arg = ck.to_str().unwrap();
    let first = train("4", ck_arg);
    assert!(first.contains("# checkpoint step 4:"), "{first}");
    let (ok, out, err) = flotilla(&["ckpt", "verify", ck_arg]);
    assert!(ok, "{out}{err}");

    let name = ckpt::rank_file_name(0);
    let file = ck.join("step-4").join(&name);
    flip_header_digit(&file);
    let (ok, out, err) = flotilla(&["ckpt", "verify", ck_arg]);
    assert!(!ok, "verify passed a damaged header:\n{out}{err}");
    let bad = out
        .lines()
        .find(|l| l.starts_with("BAD  step-4:"))
        .unwrap_or_else(|| panic!("no BAD line for step 4:\n{out}{err}"));
    assert!(
        bad.contains(&file.display().to_string()) && bad.contains("header"),
        "{bad}"
    );
    assert!(out.contains("ok   step-2:"), "{out}");

    let resumed = train("6", ck_arg);
    let rejected = resumed
        .lines()
        .find(|l| l.starts_with("# checkpoint rejected (lost): step 4"))
        .unwrap_or_else(|| panic!("step 4 not rejected:\n{resumed}"));
    assert!(rejected.contains(&name), "{rejected}");
    assert!(
        resumed.contains(&format!("# resumed from {ck_arg} step 2")),
        "{resumed}"
    );
    // The damaged step was set aside and steps 4 and 6 committed afresh.
    assert!(ck.join("step-4.rejected").is_dir());
    assert_eq!(ckpt::list_committed(&ck).unwrap(), vec![2, 4, 6]);
    let (ok, out, err) = flotilla(&["ckpt", "verify", ck_arg]);
    assert!(ok, "{out}{err}");
}
