//! Fuzz targets for the checkpoint parsers of untrusted bytes, with a fixed budget for CI
//! ([`CASES`] cases each, a second or two): the manifest (arbitrary bytes, random byte edits
//! and numbers of a valid one replaced by hostile values, each re-sealed with a matching
//! commit marker so only validation stands in the way), the commit marker, and a rank file's
//! safetensors header (bytes edited inside it; the manifest's header hash must catch every
//! edit). Every input must be refused or loaded without a panic, and whatever loads must read
//! back every tensor at its recorded size.

mod common;
#[path = "common/json_paths.rs"]
mod json_paths;

use std::path::Path;

use ckpt::{Checkpoint, CommitMarker, Verify, step_dir_name};
use common::{fixture, save};
use json_paths::{at_path, number_paths};
use proptest::prelude::*;

/// Cases per target.
const CASES: u32 = 256;

/// A committed step 1 with the fixture, saved by 2 ranks; and its manifest's bytes.
fn committed() -> (tempfile::TempDir, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    save(dir.path(), 1, &fixture(), 2, 1);
    let bytes = std::fs::read(dir.path().join(step_dir_name(1)).join("manifest.json")).unwrap();
    (dir, bytes)
}

/// Writes `bytes` as step 1's manifest under `root` with a marker that vouches for them.
fn reseal(root: &Path, bytes: &[u8]) {
    let dir = root.join(step_dir_name(1));
    std::fs::write(dir.join("manifest.json"), bytes).unwrap();
    let marker = CommitMarker {
        format: "flotilla-ckpt".into(),
        step: 1,
        manifest_bytes: bytes.len() as u64,
        manifest_xxh3_128: ckpt::checksum_hex(bytes),
    };
    std::fs::write(dir.join("COMMIT"), serde_json::to_vec(&marker).unwrap()).unwrap();
}

/// Opens step 1 and reads every tensor: an error is fine, a panic is not, and a tensor that
/// reads must have its recorded size.
fn open_and_read(root: &Path) -> Result<(), TestCaseError> {
    let Ok(c) = Checkpoint::open(root, 1, Verify::AllPieces) else {
        return Ok(());
    };
    for t in c.manifest().tensors.clone() {
        if let Ok(bytes) = c.read_tensor(&t.name) {
            let volume: u64 = t.shape.iter().product();
            prop_assert_eq!(bytes.len() as u64, volume * t.dtype.size() as u64);
        }
    }
    Ok(())
}

/// Values a hostile tool would put in place of a number.
fn hostile_number() -> impl Strategy<Value = serde_json::Value> {
    prop_oneof![
        Just(serde_json::json!(0)),
        Just(serde_json::json!(u64::MAX)),
        Just(serde_json::json!(u64::MAX / 2 + 1)),
        Just(serde_json::json!(1u64 << 44)),
        Just(serde_json::json!(-1)),
        Just(serde_json::json!(1.5)),
        any::<u64>().prop_map(|n| serde_json::json!(n)),
        (0u64..4096).prop_map(|n| serde_json::json!(n)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, ..ProptestConfig::default() })]

    /// Arbitrary bytes as a manifest.
    #[test]
    fn manifest_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let (dir, _) = committed();
        reseal(dir.path(), &bytes);
        prop_assert!(Checkpoint::open(dir.path(), 1, Verify::AllPieces).is_err());
    }

    /// A valid manifest with a few bytes replaced.
    #[test]
    fn manifest_byte_edits(edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6)) {
        let (dir, mut bytes) = committed();
        for (at, b) in edits {
            let len = bytes.len();
            bytes[at % len] = b;
        }
        reseal(dir.path(), &bytes);
        open_and_read(dir.path())?;
    }

    /// A valid manifest with numbers (offsets, lengths, shapes, extents, sizes) replaced by
    /// hostile values.
    #[test]
    fn manifest_hostile_numbers(
        picks in proptest::collection::vec((any::<usize>(), hostile_number()), 1..4),
    ) {
        let (dir, bytes) = committed();
        let mut v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let mut paths = Vec::new();
        number_paths(&v, &mut Vec::new(), &mut paths);
        for (i, value) in picks {
            *at_path(&mut v, &paths[i % paths.len()]) = value;
        }
        reseal(dir.path(), &serde_json::to_vec(&v).unwrap());
        open_and_read(dir.path())?;
    }

    /// Arbitrary bytes, and edits of a valid marker, as a commit marker.
    #[test]
    fn commit_marker(bytes in proptest::collection::vec(any::<u8>(), 0..256), step in any::<u64>()) {
        if let Ok(m) = CommitMarker::parse(&bytes, step) {
            prop_assert_eq!(m.step, step);
            prop_assert!(m.manifest_bytes <= ckpt::manifest::MAX_MANIFEST_BYTES);
        }
    }

    /// A rank file's safetensors header with bytes edited (length prefix included): the
    /// manifest's header hash refuses every such file.
    #[test]
    fn rank_file_header_edits(edits in proptest::collection::vec((any::<usize>(), 1u8..=255), 1..4)) {
        let (dir, _) = committed();
        let file = dir.path().join(step_dir_name(1)).join(ckpt::rank_file_name(0));
        let mut bytes = std::fs::read(&file).unwrap();
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut seen = std::collections::HashSet::new();
        for (at, x) in edits {
            // Each byte changed at most once, so no two edits cancel.
            if seen.insert(at % header) {
                bytes[at % header] ^= x;
            }
        }
        std::fs::write(&file, &bytes).unwrap();
        prop_assert!(Checkpoint::open(dir.path(), 1, Verify::ManifestOnly).is_err());
        open_and_read(dir.path())?;
    }
}
