//! Checkpoint policy: retention plans and deletes, garbage collection of crash leftovers, and
//! the Young/Daly interval with the seed test vectors.
//!
//! This file holds the helpers shared by the retention and garbage-collection tests.
mod gc;
mod interval;
mod retention;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use ckpt::{CheckpointMeta, DType, RankWriter, Slice, TensorMeta, commit};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Commits step `step` under `root` through the public writer API: one rank, one 16-byte
/// tensor. The only place that knows the writer API.
pub(crate) fn save_step(root: &Path, step: u64) {
    let w = TensorMeta {
        name: "w".into(),
        dtype: DType::U8,
        shape: vec![16],
    };
    let data: Vec<u8> = (0..16).map(|i| (i as u64 + step) as u8).collect();
    let rows = Slice::new(&[(0, 16)]);
    let pieces = RankWriter::write_all(root, step, 0, &[(&w, &rows, &data)]).unwrap();
    let meta = CheckpointMeta {
        run_id: "policy-test".into(),
        world_size: 1,
        layout: serde_json::json!("single"),
        config_hash: "0".into(),
        tensors: vec![w],
        state: serde_json::json!({"optimizer_step": step}),
    };
    commit(root, step, pieces, meta).unwrap();
}

/// A directory `root/name` holding one file of `bytes` bytes.
pub(crate) fn leftover(root: &Path, name: &str, bytes: usize) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("rank-00000.bin"), vec![7u8; bytes]).unwrap();
    dir
}

/// The names directly under `root`, sorted.
pub(crate) fn names(root: &Path) -> BTreeSet<String> {
    std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

pub(crate) fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}
