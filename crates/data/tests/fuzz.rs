//! Fuzz targets for the data pipeline's parsers of untrusted bytes, with a fixed budget for CI
//! (a second or two each: [`CASES`] cases of the targets that build a dataset and start a
//! loader per case, [`BYTES_CASES`] of arbitrary bytes): the dataset manifest (numbers of a valid one
//! replaced by hostile values, its snapshot id recomputed so only validation stands in the
//! way), a shard file (bytes edited anywhere, or arbitrary bytes), and a loader's resume state.
//! Every input must be refused or read without a panic, and what opens must serve a batch or
//! refuse it.

mod common;
#[path = "../../ckpt/tests/common/json_paths.rs"]
mod json_paths;

use std::path::Path;
use std::sync::Arc;

use common::write_dataset;
use data::{Dataset, Loader, LoaderConfig, LoaderState, Manifest, Shard};
use json_paths::{at_path, number_paths};
use proptest::prelude::*;

/// Cases per target that builds a dataset (about 30 ms a case).
const CASES: u32 = 64;
/// Cases of arbitrary bytes as a shard.
const BYTES_CASES: u32 = 512;

/// A fresh two-shard dataset.
fn dataset() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_dataset(dir.path(), &[vec![300, 200], vec![250, 90, 40]]);
    dir
}

/// Opens the dataset in `dir` and draws a few batches: an error is fine, a panic is not.
fn open_and_load(dir: &Path) {
    let Ok(ds) = Dataset::open(dir) else {
        return;
    };
    let mut c = LoaderConfig::new(16, 4, 9);
    c.workers = 1;
    let Ok(mut l) = Loader::new(vec![Arc::new(ds)], &c, None) else {
        return;
    };
    for _ in 0..4 {
        if l.next().is_err() {
            return;
        }
    }
}

/// Values a hostile tool would put in place of a number.
fn hostile_number() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0),
        Just(1),
        Just(2),
        Just(u64::MAX),
        Just(u64::MAX / 2 + 1),
        Just(u64::from(u32::MAX) + 1),
        0u64..2048,
        any::<u64>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, ..ProptestConfig::default() })]

    /// A valid manifest with numbers (totals, counts, vocabulary, widths) replaced by hostile
    /// values, the snapshot id recomputed.
    #[test]
    fn manifest_hostile_numbers(
        picks in proptest::collection::vec((any::<usize>(), hostile_number()), 1..4),
    ) {
        let dir = dataset();
        let path = dir.path().join("manifest.json");
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let mut paths = Vec::new();
        number_paths(&v, &mut Vec::new(), &mut paths);
        for (i, n) in picks {
            *at_path(&mut v, &paths[i % paths.len()]) = n.into();
        }
        let bytes = match serde_json::from_value::<Manifest>(v.clone()) {
            Ok(mut m) => {
                m.snapshot = m.compute_snapshot();
                serde_json::to_vec(&m).unwrap()
            }
            Err(_) => serde_json::to_vec(&v).unwrap(),
        };
        std::fs::write(&path, bytes).unwrap();
        open_and_load(dir.path());
    }

    /// A valid shard with bytes edited anywhere (header, tokens, index, footer).
    #[test]
    fn shard_byte_edits(edits in proptest::collection::vec((any::<usize>(), 1u8..=255), 1..5)) {
        let dir = dataset();
        let path = dir.path().join("shard-00001.fts");
        let mut bytes = std::fs::read(&path).unwrap();
        let len = bytes.len();
        for (at, x) in edits {
            bytes[at % len] ^= x;
        }
        std::fs::write(&path, &bytes).unwrap();
        if let Ok(s) = Shard::open(&path) {
            let _ = s.verify(None);
        }
        open_and_load(dir.path());
    }

    /// Arbitrary text, and hostile numbers in a valid state, as a loader's resume state.
    #[test]
    fn loader_state(text in ".{0,64}", cursor in hostile_number(), steps in hostile_number()) {
        let _ = LoaderState::from_json(&text);
        let dir = dataset();
        let ds = Arc::new(Dataset::open(dir.path()).unwrap());
        let c = LoaderConfig::new(16, 4, 9);
        let mut state = Loader::new(vec![ds.clone()], &c, None).unwrap().state();
        state.cursor = cursor;
        state.steps = steps;
        if let Ok(mut l) = Loader::new(vec![ds], &c, Some(&state)) {
            let _ = l.next();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: BYTES_CASES, ..ProptestConfig::default() })]

    /// Arbitrary bytes as a shard.
    #[test]
    fn shard_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.fts");
        std::fs::write(&path, &bytes).unwrap();
        if let Ok(s) = Shard::open(&path) {
            let _ = s.verify(None);
        }
    }
}
