//! Remote storage and staged mode, against a real local S3-compatible server (moto, started by
//! each test) and against a `file://` remote.
//!
//! The S3 tests need `moto_server`: from `FLOTILLA_S3_SERVER`, else from `PATH`. When it is
//! missing they fail (they never pass silently): run `.ci/run`, or `pip install 'moto[server]'`.
//!
//! This file holds the saving helpers shared by every scenario and the `on_both` macro;
//! `remotes` starts the remotes, and the scenarios are grouped by theme in the other modules.
#![cfg(feature = "s3")]

use std::path::Path;

use ckpt::manifest::{COMMIT_FILE, MANIFEST_FILE};
use ckpt::{Checkpoint, CheckpointMeta, DType, RankWriter, Slice, TensorMeta, Verify, commit};

/// Runs each scenario against both remotes as `<scenario>::s3` and `<scenario>::file`.
macro_rules! on_both {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn s3() {
                super::$name(&super::Remote::s3());
            }
            #[test]
            fn file() {
                super::$name(&super::Remote::file());
            }
        }
    )*};
}

mod corruption;
mod remotes;
mod stager;
mod transfer;

// ---------------------------------------------------------------------------------------------
// Saving: the only code that touches the writer API.

/// Bytes of rank 0's extra tensor when `big`: over the multipart threshold of the remotes.
const BIG_BYTES: u64 = 6 << 20;

/// Contents of element `i` of `tensor` at `seed`.
fn byte(seed: u64, tensor: &str, i: u64) -> u8 {
    let h = tensor
        .bytes()
        .fold(seed, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
    ((i ^ h).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8
}

fn tensors(big: bool) -> Vec<TensorMeta> {
    let mut t = vec![TensorMeta {
        name: "w".into(),
        dtype: DType::U8,
        shape: vec![8, 512],
    }];
    if big {
        t.push(TensorMeta {
            name: "e".into(),
            dtype: DType::U8,
            shape: vec![BIG_BYTES],
        });
    }
    t
}

/// Commits `step` under `root` from two ranks (row halves of `w`; rank 0 also writes `e`).
pub(crate) fn save(root: &Path, step: u64, seed: u64, big: bool) {
    let metas = tensors(big);
    let mut pieces = Vec::new();
    let all_of_e = Slice::new(&[(0, BIG_BYTES)]);
    for rank in 0..2u64 {
        let rows = Slice::new(&[(4 * rank, 4), (0, 512)]);
        let mut plan = vec![(&metas[0], &rows)];
        if rank == 0 && big {
            plan.push((&metas[1], &all_of_e));
        }
        let mut writer = RankWriter::create(root, step, rank as u32, &plan).unwrap();
        for (meta, slice) in plan {
            let data: Vec<u8> = if meta.name == "w" {
                (4 * rank * 512..(4 * rank + 4) * 512)
                    .map(|i| byte(seed, "w", i))
                    .collect()
            } else {
                (0..BIG_BYTES).map(|i| byte(seed, "e", i)).collect()
            };
            writer.write_piece(meta, slice, &data).unwrap();
        }
        pieces.extend(writer.finish().unwrap());
    }
    let meta = CheckpointMeta {
        run_id: "remote-test".into(),
        world_size: 2,
        layout: serde_json::json!("rows"),
        config_hash: "0".into(),
        tensors: metas,
        state: serde_json::json!({ "seed": seed }),
    };
    commit(root, step, pieces, meta).unwrap();
}

/// Asserts that `ckpt` holds exactly what [`save`] wrote with `seed`.
pub(crate) fn assert_content(ckpt: &Checkpoint, seed: u64) {
    assert_eq!(ckpt.state()["seed"], seed, "step {}", ckpt.step());
    for meta in &ckpt.manifest().tensors {
        let got = ckpt.read_tensor(&meta.name).unwrap();
        let want: Vec<u8> = (0..got.len() as u64)
            .map(|i| byte(seed, &meta.name, i))
            .collect();
        assert!(got == want, "tensor {} of step {}", meta.name, ckpt.step());
    }
}

/// Every file of a committed step (piece files from the manifest, manifest, marker).
pub(crate) fn step_files(root: &Path, step: u64) -> Vec<String> {
    let ckpt = Checkpoint::open(root, step, Verify::ManifestOnly).unwrap();
    let mut files: Vec<String> = ckpt
        .manifest()
        .pieces
        .iter()
        .map(|p| p.file.clone())
        .collect();
    files.sort();
    files.dedup();
    files.extend([MANIFEST_FILE.to_string(), COMMIT_FILE.to_string()]);
    files
}
