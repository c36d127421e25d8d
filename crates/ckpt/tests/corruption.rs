//! One flipped byte in any piece file (first, middle, last byte of each), the manifest or the commit marker rejects the version with
//! a message naming the file, and the loader falls back to the previous step.

mod common;

use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, CkptError, Verify, open_latest, step_dir_name};
use common::{fixture, save};

fn flip(path: &Path, pos: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[pos] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

/// Two committed steps; returns the directory of the newer one.
fn two_steps(root: &Path) -> PathBuf {
    save(root, 1, &fixture(), 4, 1);
    save(root, 2, &fixture(), 4, 2);
    root.join(step_dir_name(2))
}

/// Opens the latest step and checks it fell back to step 1, rejecting step 2 with `check`.
fn assert_falls_back(root: &Path, verify: Verify, check: impl Fn(&CkptError) -> bool) {
    let opened = open_latest(root, verify).unwrap();
    assert_eq!(opened.checkpoint.step(), 1);
    assert_eq!(opened.rejected.len(), 1);
    assert_eq!(opened.rejected[0].step, 2);
    assert!(
        check(&opened.rejected[0].error),
        "{}",
        opened.rejected[0].error
    );
}

#[test]
fn flipped_piece_byte_rejects_version_naming_file() {
    let dir = tempfile::tempdir().unwrap();
    let step2 = two_steps(dir.path());
    let manifest = Checkpoint::open(dir.path(), 2, Verify::ManifestOnly)
        .unwrap()
        .manifest()
        .clone();
    for rank in 0..4 {
        let name = ckpt::rank_file_name(rank);
        let path = step2.join(&name);
        let len = std::fs::metadata(&path).unwrap().len() as usize;
        // The first byte of the first piece, one in the middle and the file's last byte.
        let data_start = manifest
            .pieces
            .iter()
            .filter(|p| p.file == name)
            .map(|p| p.offset as usize)
            .min()
            .unwrap();
        for pos in [data_start, (data_start + len) / 2, len - 1] {
            flip(&path, pos);
            assert_falls_back(dir.path(), Verify::AllPieces, |e| {
                matches!(e, CkptError::PieceChecksum { file, step: 2, .. } if *file == name)
                    && e.to_string().contains(&name)
            });
            // Lazily verified: the open succeeds but the read that touches the piece fails.
            let ckpt = Checkpoint::open(dir.path(), 2, Verify::ManifestOnly).unwrap();
            let errors: Vec<_> = fixture()
                .iter()
                .filter_map(|t| ckpt.read_tensor(&t.name).err())
                .collect();
            assert_eq!(errors.len(), 1, "{name} byte {pos}");
            assert!(errors[0].to_string().contains(&name));
            flip(&path, pos);
        }
    }
    assert_eq!(
        open_latest(dir.path(), Verify::AllPieces)
            .unwrap()
            .checkpoint
            .step(),
        2
    );
}

#[test]
fn truncated_piece_file_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let step2 = two_steps(dir.path());
    let path = step2.join("rank-00003.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    assert_falls_back(
        dir.path(),
        Verify::AllPieces,
        |e| matches!(e, CkptError::FileTooShort { file, .. } if file == "rank-00003.safetensors"),
    );
}

#[test]
fn any_flipped_manifest_byte_rejects_version() {
    let dir = tempfile::tempdir().unwrap();
    let path = two_steps(dir.path()).join("manifest.json");
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    // Every 11th byte (and the last): the checksum covers all bytes alike, and a full sweep
    // only costs time.
    for pos in (0..len).step_by(11).chain([len - 1]) {
        flip(&path, pos);
        assert_falls_back(dir.path(), Verify::ManifestOnly, |e| {
            matches!(e, CkptError::ManifestChecksum { step: 2, .. })
                && e.to_string().contains("manifest.json")
        });
        flip(&path, pos);
    }
}

#[test]
fn any_flipped_marker_byte_rejects_version() {
    let dir = tempfile::tempdir().unwrap();
    let path = two_steps(dir.path()).join("COMMIT");
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    for pos in 0..len {
        flip(&path, pos);
        let opened = open_latest(dir.path(), Verify::ManifestOnly).unwrap();
        assert_eq!(opened.checkpoint.step(), 1, "marker byte {pos}");
        let msg = opened.rejected[0].error.to_string();
        assert!(
            msg.contains("COMMIT") || msg.contains("manifest.json"),
            "{msg}"
        );
        flip(&path, pos);
    }
}

#[test]
fn all_versions_corrupt_reports_each() {
    let dir = tempfile::tempdir().unwrap();
    let step2 = two_steps(dir.path());
    let last = std::fs::metadata(step2.join("rank-00000.safetensors"))
        .unwrap()
        .len()
        - 1;
    flip(&step2.join("rank-00000.safetensors"), last as usize);
    flip(&dir.path().join(step_dir_name(1)).join("manifest.json"), 10);
    let err = open_latest(dir.path(), Verify::AllPieces).unwrap_err();
    let CkptError::NoCommittedStep { rejected, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(rejected.iter().map(|r| r.0).collect::<Vec<_>>(), vec![2, 1]);
    let msg = err.to_string();
    assert!(
        msg.contains("rank-00000.safetensors") && msg.contains("manifest.json"),
        "{msg}"
    );
}

/// Where to damage rank file `bytes`'s safetensors header: (what, byte, JSON still valid).
fn header_spots(bytes: &[u8]) -> Vec<(&'static str, usize, bool)> {
    let json_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let text = std::str::from_utf8(&bytes[8..8 + json_len]).unwrap();
    let after = |pat: &str| 8 + text.find(pat).unwrap() + pat.len();
    let offsets = after("\"data_offsets\":[");
    let pad = 8 + json_len - 1;
    assert_eq!(
        bytes[pad], b' ',
        "the header is padded to the data alignment"
    );
    vec![
        // The last digit of a data offset ('6' -> '7'; not the first, which could become a
        // leading zero): valid JSON, wrong offsets.
        (
            "offset digit",
            offsets + text[offsets - 8..].find(',').unwrap() - 1,
            true,
        ),
        // A letter of a dtype ('F' -> 'G', 'B' -> 'C', ...): valid JSON, unknown dtype.
        ("dtype letter", after("\"dtype\":\""), true),
        // The last digit of a piece name's slice (`a[0..7]`): valid JSON, a piece the
        // manifest does not have.
        ("name digit", 8 + text.find("]\":{").unwrap() - 1, true),
        // Trailing padding (' ' -> '!'): no longer JSON.
        ("padding", pad, false),
        // The opening brace: no longer JSON.
        ("brace", 8, false),
        // The length prefix.
        ("length prefix", 0, false),
    ]
}

#[test]
fn a_damaged_rank_file_header_rejects_the_version_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let step2 = two_steps(dir.path());
    let name = ckpt::rank_file_name(1);
    let path = step2.join(&name);
    let original = std::fs::read(&path).unwrap();
    for (what, pos, valid_json) in header_spots(&original) {
        flip(&path, pos);
        if valid_json {
            // Only the header hash can catch this one: the JSON parses and every piece's
            // bytes are untouched.
            let bytes = std::fs::read(&path).unwrap();
            let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            serde_json::from_slice::<serde_json::Value>(&bytes[8..8 + len]).unwrap();
        }
        for verify in [Verify::ManifestOnly, Verify::AllPieces] {
            assert_falls_back(dir.path(), verify, |e| {
                matches!(e, CkptError::Header { step: 2, path, .. } if path.ends_with(&name))
                    && e.to_string().contains(&name)
                    && e.to_string().contains("header")
            });
        }
        let err = Checkpoint::open(dir.path(), 2, Verify::AllPieces).unwrap_err();
        assert!(err.to_string().contains(&name), "{what}: {err}");
        flip(&path, pos);
    }
    assert_eq!(std::fs::read(&path).unwrap(), original);
    let opened = open_latest(dir.path(), Verify::AllPieces).unwrap();
    assert_eq!(opened.checkpoint.step(), 2);
    assert!(opened.rejected.is_empty());
}

#[test]
fn a_manifest_without_header_hashes_still_loads() {
    let dir = tempfile::tempdir().unwrap();
    let step2 = two_steps(dir.path());
    let c = Checkpoint::open(dir.path(), 2, Verify::ManifestOnly).unwrap();
    let recorded = &c.manifest().headers;
    assert_eq!(recorded.len(), 4, "one header per rank file: {recorded:?}");
    // As a manifest written before header hashes existed: no `headers` field at all.
    common::rewrite_manifest(dir.path(), 2, |m| {
        m.as_object_mut().unwrap().remove("headers").unwrap();
    });
    let c = Checkpoint::open(dir.path(), 2, Verify::AllPieces).unwrap();
    assert!(c.manifest().headers.is_empty());
    for t in fixture() {
        c.read_tensor(&t.name).unwrap();
    }
    // Its headers go unchecked (the pieces are still checked).
    flip(&step2.join(ckpt::rank_file_name(0)), 8);
    Checkpoint::open(dir.path(), 2, Verify::AllPieces).unwrap();
}

#[test]
fn a_manifest_missing_one_header_hash_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    two_steps(dir.path());
    let name = ckpt::rank_file_name(3);
    common::rewrite_manifest(dir.path(), 2, |m| {
        m["headers"].as_object_mut().unwrap().remove(&name).unwrap();
    });
    assert_falls_back(dir.path(), Verify::ManifestOnly, |e| {
        matches!(e, CkptError::Manifest { step: 2, .. }) && e.to_string().contains(&name)
    });
}

#[test]
fn commit_refuses_a_header_that_does_not_describe_the_pieces() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = fixture();
    let pieces = common::write_ranks(dir.path(), 5, &tensors, 2, 5, None).unwrap();
    let name = ckpt::rank_file_name(1);
    let path = dir.path().join(ckpt::tmp_dir_name(5)).join(&name);
    let (_, pos, _) = header_spots(&std::fs::read(&path).unwrap())[0];
    flip(&path, pos);
    let err = ckpt::commit(dir.path(), 5, pieces, common::meta(&tensors, 2, 5)).unwrap_err();
    assert!(
        matches!(&err, CkptError::Header { step: 5, path, .. } if path.ends_with(&name)),
        "{err}"
    );
    assert!(ckpt::list_committed(dir.path()).unwrap().is_empty());
}
