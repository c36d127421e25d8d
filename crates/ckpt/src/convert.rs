//! Offline resharding: rewrite a committed step for another number of ranks, so a job can also
//! start from files already laid out for it (loading never needs this: any layout reads any
//! checkpoint directly).

use std::path::Path;

use crate::error::Result;
use crate::layout::{Slice, TensorMeta};
use crate::manifest::Manifest;
use crate::rank_file::RankWriter;
use crate::reader::Checkpoint;
use crate::writer::{CheckpointMeta, commit};

/// The rows (dimension 0) of a `ranks`-way even split that rank `rank` owns: the first
/// `rows % ranks` ranks get one more row. Scalars belong to rank 0.
pub fn rank_rows(shape: &[u64], rank: u32, ranks: u32) -> Option<Slice> {
    let Some((&rows, rest)) = shape.split_first() else {
        return (rank == 0).then(|| Slice(Vec::new()));
    };
    let (r, n) = (u64::from(rank), u64::from(ranks.max(1)));
    let (base, extra) = (rows / n, rows % n);
    let len = base + u64::from(r < extra);
    if len == 0 || rest.contains(&0) {
        return None;
    }
    let offset = r * base + r.min(extra);
    let mut extents = vec![(offset, len)];
    extents.extend(rest.iter().map(|&d| (0, d)));
    Some(Slice::new(&extents))
}

/// Writes step `src.step()` under `dst_root` as `ranks` ranks, each holding its
/// [`rank_rows`] of every tensor, read from `src` (every byte verified on the way) and
/// committed with the source's run id, config hash and state. Returns the new manifest.
pub fn reshard(src: &Checkpoint, dst_root: &Path, ranks: u32) -> Result<Manifest> {
    reshard_with_progress(src, dst_root, ranks, |_, _| {})
}

/// [`reshard`], calling `progress(bytes_written, bytes_total)` after each piece written (the
/// total is the source's [`Manifest::piece_bytes`]: every byte is written once).
pub fn reshard_with_progress(
    src: &Checkpoint,
    dst_root: &Path,
    ranks: u32,
    mut progress: impl FnMut(u64, u64),
) -> Result<Manifest> {
    let m = src.manifest();
    let (total, mut done) = (m.piece_bytes(), 0u64);
    let mut pieces = Vec::new();
    for rank in 0..ranks.max(1) {
        let plan: Vec<(&TensorMeta, Slice)> = m
            .tensors
            .iter()
            .filter_map(|t| rank_rows(&t.shape, rank, ranks).map(|s| (t, s)))
            .collect();
        let refs: Vec<(&TensorMeta, &Slice)> = plan.iter().map(|(t, s)| (*t, s)).collect();
        let mut writer = RankWriter::create(dst_root, m.step, rank, &refs)?;
        for (t, s) in &plan {
            let data = src.read_slice(&t.name, s)?;
            writer.write_piece(t, s, &data)?;
            done = done.saturating_add(data.len() as u64);
            progress(done, total);
        }
        pieces.extend(writer.finish()?);
    }
    let meta = CheckpointMeta {
        run_id: m.run_id.clone(),
        world_size: ranks.max(1),
        layout: serde_json::json!({
            "split": "dim0",
            "ranks": ranks.max(1),
            "resharded_from": m.layout,
        }),
        config_hash: m.config_hash.clone(),
        tensors: m.tensors.clone(),
        state: m.state.clone(),
    };
    commit(dst_root, m.step, pieces, meta)
}

#[cfg(test)]
mod tests {
    use super::rank_rows;
    use crate::layout::Slice;

    #[test]
    fn rows_split_evenly_with_the_remainder_first() {
        let got: Vec<_> = (0..3).map(|r| rank_rows(&[7, 2], r, 3)).collect();
        assert_eq!(
            got,
            [
                Some(Slice::new(&[(0, 3), (0, 2)])),
                Some(Slice::new(&[(3, 2), (0, 2)])),
                Some(Slice::new(&[(5, 2), (0, 2)])),
            ]
        );
        assert_eq!(rank_rows(&[2], 2, 3), None);
        assert_eq!(rank_rows(&[], 0, 3), Some(Slice(Vec::new())));
        assert_eq!(rank_rows(&[], 1, 3), None);
        assert_eq!(rank_rows(&[4, 0], 0, 2), None);
    }
}
