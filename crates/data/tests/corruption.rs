//! A damaged shard is detected before any sample from it is returned, and the error names it.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::write_dataset;
use data::{DataError, Dataset, Loader, LoaderConfig, Shard};

const SHARDS: usize = 4;

/// A fresh four-shard dataset; returns its directory guard and the path of shard 2.
fn dataset() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let docs: Vec<Vec<u64>> = (0..SHARDS)
        .map(|s| vec![300 + 10 * s as u64, 200])
        .collect();
    write_dataset(dir.path(), &docs);
    let victim = dir.path().join("shard-00002.fts");
    (dir, victim)
}

/// Runs a loader over the whole dataset until it fails; asserts no batch before the failure held
/// a row of shard 2, and returns the error text.
fn load_until_error(dir: &Path) -> String {
    let ds = Arc::new(Dataset::open(dir).unwrap());
    let mut c = LoaderConfig::new(16, 4, 9);
    c.workers = 3;
    let mut l = Loader::new(vec![ds], &c, None).unwrap();
    for _ in 0..1000 {
        match l.next() {
            Ok(b) => assert!(
                b.samples.iter().all(|s| s.shard != 2),
                "a row of the damaged shard was returned: {:?}",
                b.samples
            ),
            Err(e) => {
                // The failure is sticky: nothing after it is delivered.
                assert!(l.next().is_err());
                return e.to_string();
            }
        }
    }
    panic!("the damaged shard was never detected");
}

fn flip(path: &Path, offset: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[offset as usize] ^= 0x40;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_flipped_token_byte_is_caught_before_use() {
    let (dir, victim) = dataset();
    flip(&victim, 64 + 101);
    let err = load_until_error(dir.path());
    assert!(
        err.contains("shard-00002.fts") && err.contains("checksum mismatch"),
        "{err}"
    );
}

#[test]
fn flips_anywhere_in_the_file_are_caught() {
    let (dir, victim) = dataset();
    let len = std::fs::metadata(&victim).unwrap().len();
    // Header (token count, tokenizer name), body, index, checksum, end marker.
    for offset in [17, 45, 64, len / 2, len - 40, len - 20, len - 3] {
        let copy = dir.path().join("copy.fts");
        std::fs::copy(&victim, &copy).unwrap();
        flip(&copy, offset);
        let caught = Shard::open(&copy).and_then(|s| s.verify(None));
        assert!(
            caught.is_err(),
            "flip at byte {offset} of {len} went unnoticed"
        );
    }
    std::fs::remove_file(dir.path().join("copy.fts")).unwrap();
    flip(&victim, len / 2);
    let err = load_until_error(dir.path());
    assert!(err.contains("shard-00002.fts"), "{err}");
}

#[test]
fn a_truncated_shard_fails_at_open() {
    let (dir, victim) = dataset();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&victim)
        .unwrap();
    f.set_len(f.metadata().unwrap().len() - 100).unwrap();
    let err = Dataset::open(dir.path()).err().unwrap();
    assert!(matches!(err, DataError::CorruptShard { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("shard-00002.fts") && text.contains("truncated"),
        "{text}"
    );
    // The shard on its own says the same from its header.
    let text = Shard::open(&victim).err().unwrap().to_string();
    assert!(text.contains("truncated"), "{text}");
}

#[test]
fn a_deleted_shard_fails_at_open() {
    let (dir, victim) = dataset();
    std::fs::remove_file(&victim).unwrap();
    let err = Dataset::open(dir.path()).err().unwrap();
    assert!(matches!(err, DataError::MissingShard { .. }), "{err:?}");
    assert!(err.to_string().contains("shard-00002.fts"));
}

#[test]
fn a_foreign_file_is_named() {
    let (dir, victim) = dataset();
    let len = std::fs::metadata(&victim).unwrap().len() as usize;
    std::fs::write(&victim, vec![b'x'; len]).unwrap();
    let err = load_until_error(dir.path());
    assert!(
        err.contains("shard-00002.fts") && err.contains("not a Flotilla token shard"),
        "{err}"
    );
}

#[test]
fn a_swapped_shard_disagrees_with_the_manifest() {
    let (dir, victim) = dataset();
    // A valid shard of the same size but other content: its own footer checks out.
    let other = dir.path().join("other");
    write_dataset(&other, &[vec![320, 200], vec![1], vec![320, 200]]);
    std::fs::copy(other.join("shard-00000.fts"), &victim).unwrap();
    let err = load_until_error(dir.path());
    assert!(
        err.contains("shard-00002.fts") && err.contains("manifest"),
        "{err}"
    );
}

#[test]
fn an_edited_manifest_is_refused() {
    let (dir, _) = dataset();
    let path = dir.path().join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let edited = text.replacen("\"tokens\": 500", "\"tokens\": 501", 1);
    assert_ne!(edited, text);
    std::fs::write(&path, edited).unwrap();
    let err = Dataset::open(dir.path()).err().unwrap().to_string();
    assert!(err.contains("manifest.json"), "{err}");
}

/// The loader verifies shards ahead of the readers (a background thread walks the order): a
/// damaged shard found ahead must still fail exactly at the first batch that needs it, with
/// every batch before it delivered, not earlier and not later.
#[test]
fn a_damaged_shard_found_ahead_fails_at_the_first_batch_that_needs_it() {
    let dir = tempfile::tempdir().unwrap();
    // Four shards of 1250 sequences, a small shuffle window: shards are used one after another.
    write_dataset(dir.path(), &vec![vec![20_000]; SHARDS]);
    let run = |pause: bool| {
        let ds = Arc::new(Dataset::open(dir.path()).unwrap());
        let mut c = LoaderConfig::new(16, 4, 9);
        c.workers = 2;
        c.shuffle_window = 64;
        let mut l = Loader::new(vec![ds], &c, None).unwrap();
        let mut batches: Vec<Vec<u32>> = Vec::new();
        while batches.len() < 2000 {
            match l.next() {
                Ok(b) => batches.push(b.samples.iter().map(|s| s.shard).collect()),
                Err(e) => return (batches, Some(e.to_string())),
            }
            if pause && batches.len() == 1 {
                // The readers stop at the prefetch depth; the verifier goes on ahead and meets
                // the damaged shard first.
                std::thread::sleep(std::time::Duration::from_millis(300));
            }
        }
        (batches, None)
    };
    let (intact, none) = run(false);
    assert!(none.is_none(), "intact dataset failed: {none:?}");
    // The second shard in the order of first use is damaged.
    let mut order: Vec<u32> = Vec::new();
    for s in intact.iter().flatten() {
        if !order.contains(s) {
            order.push(*s);
        }
    }
    let victim = order[1];
    let first_needing = intact.iter().position(|b| b.contains(&victim)).unwrap();
    assert!(
        first_needing > 16,
        "the victim is needed only after the prefetch depth"
    );
    flip(&dir.path().join(format!("shard-{victim:05}.fts")), 64 + 101);
    let (delivered, err) = run(true);
    let err = err.expect("the damaged shard was never detected");
    assert!(err.contains(&format!("shard-{victim:05}.fts")), "{err}");
    assert_eq!(
        delivered,
        intact[..first_needing],
        "the batches before the first one needing the damaged shard are delivered, and only those"
    );
}

#[test]
fn verify_reports_progress_to_the_last_byte_and_names_the_bad_shard() {
    let (dir, victim) = dataset();
    flip(&victim, 64 + 101);
    let ds = Dataset::open(dir.path()).unwrap();
    let mut calls = Vec::new();
    let report =
        data::verify_dataset_with_progress(&ds, 2, |done, total| calls.push((done, total)))
            .unwrap();
    let total = ds.manifest().bytes;
    assert_eq!(calls.len(), SHARDS);
    assert!(calls.windows(2).all(|w| w[0].0 < w[1].0), "{calls:?}");
    assert_eq!(calls.last(), Some(&(total, total)));
    let json = report.to_json();
    assert_eq!(json["failed"], serde_json::json!(["shard-00002.fts"]));
    assert_eq!(json["bytes"], total);
    assert_eq!(json["shards"][2]["ok"], false);
}
