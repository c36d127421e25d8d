//! Small datasets written through the public shard API, for the loader tests.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use data::prepare::PrepareConfig;
use data::{Dataset, Manifest, ShardWriter};

/// Vocabulary of the test datasets.
pub const VOCAB: u32 = 1000;

/// The token at position `i` of shard `shard` (so any row's content can be checked).
pub fn token_at(shard: usize, i: u64) -> u32 {
    ((shard as u64 * 7919 + i * 31 + i / 7) % u64::from(VOCAB)) as u32
}

/// Writes a dataset whose shard `s` holds the documents of lengths `docs[s]`, and opens it.
pub fn write_dataset(dir: &Path, docs: &[Vec<u64>]) -> Arc<Dataset> {
    std::fs::create_dir_all(dir).unwrap();
    let mut infos = Vec::new();
    for (s, lens) in docs.iter().enumerate() {
        let path = dir.join(format!("shard-{s:05}.fts"));
        let mut w = ShardWriter::create(&path, VOCAB, "test").unwrap();
        let mut at = 0u64;
        for &len in lens {
            let ids: Vec<u32> = (at..at + len).map(|i| token_at(s, i)).collect();
            w.push_doc(&ids).unwrap();
            at += len;
        }
        infos.push(w.finish().unwrap());
    }
    Manifest::new("test", VOCAB, None, "tests", &infos)
        .write_atomic(dir)
        .unwrap();
    Arc::new(Dataset::open(dir).unwrap())
}

/// A `prepare` config of `inputs` into `out`, every other setting at its default.
pub fn config(inputs: &[&Path], out: &Path) -> PrepareConfig {
    let inputs = inputs
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    PrepareConfig::new(inputs, out.to_path_buf())
}
