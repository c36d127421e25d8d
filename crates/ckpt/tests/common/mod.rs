//! Shared test helpers: deterministic tensor contents, shardings, and a multi-rank save.
//!
//! Expected bytes are computed from a formula of each element's *global* linear index, never
//! through the crate's own copy routine, so a resharding bug cannot hide behind itself.
#![allow(dead_code)]

use std::path::Path;

use ckpt::{
    CheckpointMeta, DType, FailPoint, Manifest, Piece, RankWriter, Slice, TensorMeta, commit,
    commit_with_fail_point,
};

/// Builds a tensor description.
pub fn tensor(name: &str, dtype: DType, shape: &[u64]) -> TensorMeta {
    TensorMeta {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    }
}

/// A fixture covering 1-3 dims, a scalar, a zero-size tensor and several dtypes.
pub fn fixture() -> Vec<TensorMeta> {
    vec![
        tensor("a", DType::F32, &[37]),
        tensor("b", DType::BF16, &[9, 14]),
        tensor("c", DType::I64, &[5, 3, 7]),
        tensor("s", DType::F32, &[]),
        tensor("z", DType::F16, &[0, 4]),
        tensor("u", DType::U8, &[2, 11]),
    ]
}

/// The bytes of `slice` of `meta`, row-major, where each element's bytes are a hash of
/// `(seed, tensor name, global linear index)`.
pub fn expected_slice(meta: &TensorMeta, slice: &Slice, seed: u64) -> Vec<u8> {
    let elem = meta.dtype.size();
    let name_hash = meta.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let volume = slice.volume().unwrap() as usize;
    let mut out = Vec::with_capacity(volume * elem);
    let n = slice.ndim();
    let mut idx = vec![0u64; n];
    for _ in 0..volume {
        let mut lin = 0u64;
        for ((&i, e), &dim) in idx.iter().zip(&slice.0).zip(&meta.shape) {
            lin = lin * dim + e.offset + i;
        }
        let v = (lin ^ seed ^ name_hash).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        out.extend_from_slice(&v.to_le_bytes()[..elem]);
        for d in (0..n).rev() {
            idx[d] += 1;
            if idx[d] < slice.0[d].len {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// Cuts `len` into `parts` contiguous ranges of deliberately uneven sizes (piece i gets about
/// `(i + 1)` shares); empty ranges are dropped.
pub fn uneven_ranges(len: u64, parts: u64) -> Vec<(u64, u64)> {
    let total = parts * (parts + 1) / 2;
    let bound = |i: u64| len * (i * (i + 1) / 2) / total;
    (0..parts)
        .map(|i| (bound(i), bound(i + 1) - bound(i)))
        .filter(|&(_, l)| l > 0)
        .collect()
}

/// Cuts `len` into `parts` near-equal contiguous ranges; empty ranges are dropped.
pub fn even_ranges(len: u64, parts: u64) -> Vec<(u64, u64)> {
    let bound = |i: u64| len * i / parts;
    (0..parts)
        .map(|i| (bound(i), bound(i + 1) - bound(i)))
        .filter(|&(_, l)| l > 0)
        .collect()
}

/// Cartesian product of per-dimension ranges: a grid of boxes.
pub fn grid(per_dim: &[Vec<(u64, u64)>]) -> Vec<Slice> {
    per_dim.iter().fold(vec![Slice(vec![])], |acc, ranges| {
        acc.into_iter()
            .flat_map(|s| {
                ranges.iter().map(move |&(o, l)| {
                    let mut e = s.0.clone();
                    e.push(ckpt::Extent { offset: o, len: l });
                    Slice(e)
                })
            })
            .collect()
    })
}

/// The saving sharding: an uneven grid (dim 0 in 3 parts, last dim in 2, 1-d tensors in 5).
pub fn save_pieces(meta: &TensorMeta) -> Vec<Slice> {
    let n = meta.shape.len();
    let per_dim: Vec<_> = meta
        .shape
        .iter()
        .enumerate()
        .map(|(d, &len)| match (n, d) {
            (1, _) => uneven_ranges(len, 5),
            (_, 0) => uneven_ranges(len, 3),
            (_, d) if d == n - 1 => uneven_ranges(len, 2),
            _ => vec![(0, len)],
        })
        .collect();
    grid(&per_dim)
}

/// The metadata every test commits with.
pub fn meta(tensors: &[TensorMeta], world: u32, step: u64) -> CheckpointMeta {
    CheckpointMeta {
        run_id: "run-1".into(),
        world_size: world,
        layout: serde_json::json!({"dp": world}),
        config_hash: "cfg".into(),
        tensors: tensors.to_vec(),
        state: serde_json::json!({"optimizer_step": step, "rng": [1, 2, 3], "loader": {"pos": 7}}),
    }
}

/// Every rank writes its round-robin share of [`save_pieces`]; returns all ranks' piece lists.
pub fn write_ranks(
    root: &Path,
    step: u64,
    tensors: &[TensorMeta],
    world: u32,
    seed: u64,
    fail: Option<FailPoint>,
) -> ckpt::Result<Vec<Piece>> {
    let mut all = Vec::new();
    for rank in 0..world {
        let mut plan = Vec::new();
        for (t, meta) in tensors.iter().enumerate() {
            for (i, slice) in save_pieces(meta).into_iter().enumerate() {
                if (i + t) % world as usize == rank as usize {
                    plan.push((meta, slice));
                }
            }
        }
        let refs: Vec<_> = plan.iter().map(|(m, s)| (*m, s)).collect();
        let mut w = RankWriter::create(root, step, rank, &refs)?;
        if let Some(p) = fail {
            w = w.with_fail_point(p);
        }
        for (meta, slice) in &plan {
            w.write_piece(meta, slice, &expected_slice(meta, slice, seed))?;
        }
        all.extend(w.finish()?);
    }
    Ok(all)
}

/// Saves and commits `tensors` at `step` from `world` ranks.
pub fn save(root: &Path, step: u64, tensors: &[TensorMeta], world: u32, seed: u64) -> Manifest {
    let pieces = write_ranks(root, step, tensors, world, seed, None).unwrap();
    commit(root, step, pieces, meta(tensors, world, step)).unwrap()
}

/// Like [`save`] but stops at `point`; returns the error it stopped with.
pub fn save_failing(
    root: &Path,
    step: u64,
    tensors: &[TensorMeta],
    seed: u64,
    point: FailPoint,
) -> ckpt::CkptError {
    let pieces = match write_ranks(root, step, tensors, 4, seed, Some(point)) {
        Ok(p) => p,
        Err(e) => return e,
    };
    commit_with_fail_point(root, step, pieces, meta(tensors, 4, step), point).unwrap_err()
}

/// Rewrites a committed step's manifest through `edit` and re-seals the commit marker, so only
/// manifest validation (not the checksum) stands between the edit and the reader.
pub fn rewrite_manifest(root: &Path, step: u64, edit: impl FnOnce(&mut serde_json::Value)) {
    let dir = root.join(ckpt::step_dir_name(step));
    let path = dir.join("manifest.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut v);
    let bytes = serde_json::to_vec(&v).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    let marker = ckpt::CommitMarker {
        format: "flotilla-ckpt".into(),
        step,
        manifest_bytes: bytes.len() as u64,
        manifest_xxh3_128: ckpt::checksum_hex(&bytes),
    };
    std::fs::write(dir.join("COMMIT"), serde_json::to_vec(&marker).unwrap()).unwrap();
}
