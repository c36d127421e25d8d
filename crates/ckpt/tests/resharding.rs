//! Saved by 4 ranks under one (uneven) sharding, loaded bit-identically by 1, 2, 3 and 8 ranks
//! under others.

mod common;

use ckpt::{Checkpoint, DType, Slice, TensorMeta, Verify, open_latest};
use common::{even_ranges, expected_slice, fixture, grid, save, tensor};
use proptest::prelude::*;

/// The slices each of `world` loading ranks owns, under a sharding different from the save's:
/// 2 ranks split the last dim, 3 split dim 0, 8 use a 2 x 4 grid (dim 0 x last dim).
fn load_layout(meta: &TensorMeta, world: u64) -> Vec<Vec<Slice>> {
    let n = meta.shape.len();
    let per_dim: Vec<Vec<(u64, u64)>> = meta
        .shape
        .iter()
        .enumerate()
        .map(|(d, &len)| {
            let parts = match (world, d) {
                (1, _) => 1,
                (2, d) if d == n - 1 => 2,
                (3, 0) => 3,
                (8, 0) if n == 1 => 8,
                (8, 0) => 2,
                (8, d) if d == n - 1 => 4,
                _ => 1,
            };
            even_ranges(len, parts)
        })
        .collect();
    let boxes = grid(&per_dim);
    let mut ranks = vec![Vec::new(); world as usize];
    for (i, b) in boxes.into_iter().enumerate() {
        ranks[i % world as usize].push(b);
    }
    ranks
}

/// Every rank of every load layout gets exactly the bytes the formula predicts, and the ranks
/// together cover the tensor.
fn check_all_layouts(ckpt: &Checkpoint, tensors: &[TensorMeta], seed: u64) {
    for meta in tensors {
        for world in [1u64, 2, 3, 8] {
            let mut covered = 0;
            for (rank, slices) in load_layout(meta, world).iter().enumerate() {
                for s in slices {
                    let got = ckpt.read_slice(&meta.name, s).unwrap();
                    let want = expected_slice(meta, s, seed);
                    assert!(
                        got == want,
                        "{} world {world} rank {rank} slice {s}",
                        meta.name
                    );
                    covered += s.volume().unwrap();
                }
            }
            assert_eq!(covered, Slice::full(&meta.shape).volume().unwrap());
        }
    }
}

#[test]
fn four_rank_save_loads_on_1_2_3_8_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = fixture();
    let manifest = save(dir.path(), 10, &tensors, 4, 42);
    // The save sharding really is uneven and spread over all 4 ranks' files.
    let files: std::collections::BTreeSet<_> = manifest.pieces.iter().map(|p| &p.file).collect();
    assert_eq!(files.len(), 4);
    let opened = open_latest(dir.path(), Verify::AllPieces).unwrap();
    assert!(opened.rejected.is_empty());
    assert_eq!(opened.checkpoint.step(), 10);
    assert_eq!(opened.checkpoint.state()["loader"]["pos"], 7);
    check_all_layouts(&opened.checkpoint, &tensors, 42);
}

#[test]
fn whole_tensor_and_cross_piece_slices() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = fixture();
    save(dir.path(), 1, &tensors, 4, 7);
    let ckpt = Checkpoint::open(dir.path(), 1, Verify::ManifestOnly).unwrap();
    for meta in &tensors {
        let full = Slice::full(&meta.shape);
        assert_eq!(
            ckpt.read_tensor(&meta.name).unwrap(),
            expected_slice(meta, &full, 7)
        );
    }
    let c = &tensors[2];
    let s = Slice::new(&[(1, 3), (1, 2), (2, 5)]);
    assert_eq!(ckpt.read_slice("c", &s).unwrap(), expected_slice(c, &s, 7));
    assert!(
        ckpt.read_slice("c", &Slice::new(&[(4, 2), (0, 1), (0, 1)]))
            .is_err()
    );
    assert!(ckpt.read_slice("c", &Slice::new(&[(0, 1)])).is_err());
    assert!(ckpt.read_slice("nope", &Slice::new(&[])).is_err());
}

#[test]
fn offline_reshard_4_to_3_keeps_every_byte_and_the_state() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let tensors = fixture();
    save(dir.path(), 10, &tensors, 4, 42);
    let src = Checkpoint::open(dir.path(), 10, Verify::AllPieces).unwrap();
    let manifest = ckpt::reshard(&src, out.path(), 3).unwrap();
    assert_eq!(manifest.world_size, 3);
    let files: std::collections::BTreeSet<_> = manifest.pieces.iter().map(|p| &p.file).collect();
    assert_eq!(files.len(), 3);
    let dst = Checkpoint::open(out.path(), 10, Verify::AllPieces).unwrap();
    assert_eq!(dst.state(), src.state());
    assert_eq!(dst.manifest().config_hash, src.manifest().config_hash);
    // Every rank's file holds exactly its rows of each tensor, and any layout still loads.
    for p in &manifest.pieces {
        let rank: u32 = p.file[5..10].parse().unwrap();
        let meta = dst.manifest().tensor(&p.tensor).unwrap();
        assert_eq!(
            Some(&p.slice),
            ckpt::rank_rows(&meta.shape, rank, 3).as_ref()
        );
    }
    check_all_layouts(&dst, &tensors, 42);
    // The step is committed in the target: a second reshard into it is refused.
    assert!(ckpt::reshard(&src, out.path(), 2).is_err());
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![
        DType::F64,
        DType::F32,
        DType::BF16,
        DType::I16,
        DType::U8,
    ])
}

/// A random box inside `shape` (possibly empty-free: every extent has len >= 1).
fn box_in(shape: Vec<u64>) -> impl Strategy<Value = Slice> {
    shape
        .into_iter()
        .map(|len| (0..len).prop_flat_map(move |o| (Just(o), 1..=len - o)))
        .collect::<Vec<_>>()
        .prop_map(|v| Slice::new(&v))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn resharding_round_trips(
        (shape, boxes) in prop::collection::vec(1u64..13, 1..=3)
            .prop_flat_map(|s| (Just(s.clone()), prop::collection::vec(box_in(s), 1..4))),
        dtype in dtype_strategy(),
        seed in any::<u64>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let tensors = vec![tensor("w", dtype, &shape), tensor("s", DType::F32, &[])];
        save(dir.path(), 3, &tensors, 4, seed);
        let ckpt = Checkpoint::open(dir.path(), 3, Verify::AllPieces).unwrap();
        check_all_layouts(&ckpt, &tensors, seed);
        for b in &boxes {
            prop_assert_eq!(ckpt.read_slice("w", b).unwrap(), expected_slice(&tensors[0], b, seed));
        }
    }
}

#[test]
fn reshard_and_verify_report_progress_to_the_last_byte() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    save(dir.path(), 10, &fixture(), 4, 42);
    let src = Checkpoint::open(dir.path(), 10, Verify::ManifestOnly).unwrap();
    let total = src.manifest().piece_bytes();
    let mut calls = Vec::new();
    let m = ckpt::reshard_with_progress(&src, out.path(), 3, |d, t| calls.push((d, t))).unwrap();
    assert_eq!(m.piece_bytes(), total);
    assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0), "{calls:?}");
    assert_eq!(calls.last(), Some(&(total, total)));

    let mut calls = Vec::new();
    let check = ckpt::verify_step(out.path(), 10, |d, t| calls.push((d, t)));
    assert!(check.result.is_ok() && check.bytes == total, "{check:?}");
    assert_eq!(calls.len(), m.pieces.len());
    assert_eq!(calls.last(), Some(&(total, total)));
    let json = check.to_json();
    assert_eq!(
        (&json["step"], &json["ok"], &json["bytes"]),
        (&10.into(), &true.into(), &total.into())
    );

    // A flipped byte fails the step, with the file named; a missing step fails at open.
    let file = out.path().join("step-10").join(ckpt::rank_file_name(1));
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let check = ckpt::verify_step(out.path(), 10, |_, _| {});
    let err = check.result.as_ref().unwrap_err().to_string();
    assert!(err.contains(&ckpt::rank_file_name(1)), "{err}");
    assert_eq!(check.to_json()["ok"], false);
    let missing = ckpt::verify_step(out.path(), 11, |_, _| {});
    assert!(missing.result.is_err() && missing.bytes == 0);
}
