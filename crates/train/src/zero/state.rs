//! A ZeRO rank's part of a checkpoint: the pieces of every tensor that fall in the segments'
//! parts it owns ([`super::ShardPlan`]), written in parallel with the other ranks'. An owned
//! range of the flat buffer cuts tensors anywhere, so each tensor's part is described as the few
//! row-major boxes that cover it exactly ([`flat_boxes`]): a partial first row, whole rows, a
//! partial last row (recursively for more dimensions). A reader of any layout reads them back
//! like any other pieces (`ckpt` covers and verifies them), which is how a ZeRO run resumes on
//! plain data parallel, another stage, or the reverse.

use std::ops::Range;

use ckpt::{Slice, f32_bytes};
use model::layout::{Layout, ParamEntry};

use super::{Stage, Zero};

/// Row-major boxes of a tensor of `shape` that cover exactly its flat elements `range`, each
/// with the flat sub-range it covers, in order (consecutive, so each box's bytes are one
/// contiguous run of the flat buffer).
pub fn flat_boxes(shape: &[usize], range: Range<usize>) -> Vec<(Slice, Range<usize>)> {
    let mut out = Vec::new();
    boxes(shape, range.clone(), range.start, &mut Vec::new(), &mut out);
    out
}

fn boxes(
    shape: &[usize],
    range: Range<usize>,
    base: usize,
    prefix: &mut Vec<(u64, u64)>,
    out: &mut Vec<(Slice, Range<usize>)>,
) {
    if range.is_empty() {
        return;
    }
    let Some((&rows, rest)) = shape.split_first() else {
        out.push((Slice::new(prefix), base..base + 1));
        return;
    };
    let row: usize = rest.iter().product();
    if row == 0 || rows == 0 {
        return;
    }
    let full = |prefix: &Vec<(u64, u64)>, first: usize, n: usize| {
        let mut e = prefix.clone();
        e.push((first as u64, n as u64));
        e.extend(rest.iter().map(|&d| (0, d as u64)));
        Slice::new(&e)
    };
    let (mut r0, r1) = (range.start / row, range.end / row);
    let mut at = base;
    if r0 == r1 || !range.start.is_multiple_of(row) {
        // A partial first row (or the whole range inside one row).
        let end = if r0 == r1 { range.end } else { (r0 + 1) * row };
        prefix.push((r0 as u64, 1));
        boxes(
            rest,
            range.start - r0 * row..end - r0 * row,
            at,
            prefix,
            out,
        );
        prefix.pop();
        at += end - range.start;
        r0 += 1;
        if r0 > r1 {
            return;
        }
    }
    if r1 > r0 {
        let n = (r1 - r0) * row;
        out.push((full(prefix, r0, r1 - r0), at..at + n));
        at += n;
    }
    if r1 * row < range.end && r1 >= r0 {
        prefix.push((r1 as u64, 1));
        boxes(rest, 0..range.end - r1 * row, at, prefix, out);
        prefix.pop();
    }
}

/// Maps a layout entry's flat elements (relative to the entry) to boxes of the saved tensor,
/// each with the sub-range it holds, in order.
pub type Place<'p> = &'p dyn Fn(&ParamEntry, Range<usize>) -> Vec<(Slice, Range<usize>)>;

/// One piece of a rank's checkpoint: the index of its tensor (in [`crate::checkpoint`]'s
/// order: every layout entry of the parameters, then of each moment), the box, the bytes.
pub type StatePiece<'a> = (usize, Slice, &'a [u8]);

impl Zero {
    /// This rank's pieces of the parameters (from the whole `params` for stages 1 and 2, from
    /// the shard for stage 3) and of AdamW's moments `m` and `v` (shard coordinates), for the
    /// tensors of `layout` in the order of `crate::checkpoint::state_metas`. `place` maps an
    /// entry's flat elements to boxes of the saved tensor ([`flat_boxes`] of its own shape, or
    /// a tensor-parallel shard's boxes of the whole tensor: `crate::tensor::TpPart::place`).
    pub fn state_pieces<'a>(
        &'a self,
        layout: &Layout,
        (params, m, v): (&'a [f32], &'a [f32], &'a [f32]),
        place: Place<'_>,
    ) -> Vec<StatePiece<'a>> {
        let entries = layout.entries.len();
        let mut out = Vec::new();
        for (which, shard) in [(0, None), (1, Some(m)), (2, Some(v))] {
            for (i, e) in layout.entries.iter().enumerate() {
                let er = e.range();
                for s in 0..self.plan.segments().len() {
                    let owned = self.plan.owned(s);
                    let (a, b) = (er.start.max(owned.start), er.end.min(owned.end));
                    if a >= b {
                        continue;
                    }
                    // Where the owned elements a..b live: the shard (moments, stage-3
                    // parameters) or the whole parameter buffer.
                    let local = self.plan.local(s).start + (a - owned.start);
                    let src: &[f32] = match (shard, self.stage, self.master()) {
                        (Some(buf), _, _) => &buf[local..local + (b - a)],
                        // bf16: the f32 master weights, not their bf16 values.
                        (None, _, Some(master)) => &master[local..local + (b - a)],
                        (None, Stage::Three, None) => &self.shard[local..local + (b - a)],
                        (None, _, None) => &params[a..b],
                    };
                    for (slice, sub) in place(e, a - er.start..b - er.start) {
                        let from = sub.start - (a - er.start);
                        let bytes = f32_bytes(&src[from..from + sub.len()]);
                        out.push((which * entries + i, slice, bytes));
                    }
                }
            }
        }
        out
    }

    /// Loads whole-model state into this rank's shards: `master` (parameters) into `params`
    /// (stages 1 and 2) or the shard (stage 3), and returns this rank's parts of `m` and `v`.
    pub fn load_state(
        &mut self,
        params: &mut super::Window,
        master: &[f32],
        m: &[f32],
        v: &[f32],
    ) -> (Vec<f32>, Vec<f32>) {
        let n = self.plan.len();
        let (mut ms, mut vs) = (vec![0f32; n], vec![0f32; n]);
        for s in 0..self.plan.segments().len() {
            let (owned, local) = (self.plan.owned(s), self.plan.local(s));
            ms[local.clone()].copy_from_slice(&m[owned.clone()]);
            vs[local.clone()].copy_from_slice(&v[owned.clone()]);
            if self.stage == Stage::Three {
                self.shard[local].copy_from_slice(&master[owned]);
            }
        }
        match self.stage {
            Stage::Three => self.release_params(params),
            _ => params.copy_from_slice(master),
        }
        if self.master.is_some() {
            // bf16: the saved f32 weights are the master; the parameters their bf16 values.
            let mut mine = vec![0f32; n];
            for s in 0..self.plan.segments().len() {
                mine[self.plan.local(s)].copy_from_slice(&master[self.plan.owned(s)]);
            }
            let whole: &mut [f32] = match self.stage {
                Stage::Three => &mut self.shard,
                _ => params,
            };
            whole.iter_mut().for_each(|x| *x = super::bf16_value(*x));
            self.master = Some(mine);
        }
        (ms, vs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of `range` is covered once, by boxes whose flat runs are consecutive.
    fn check(shape: &[usize], range: Range<usize>) {
        let bx = flat_boxes(shape, range.clone());
        let mut at = range.start;
        for (slice, sub) in &bx {
            assert_eq!(sub.start, at, "{shape:?} {range:?}: {bx:?}");
            let vol: u64 = slice.0.iter().map(|e| e.len).product();
            assert_eq!(vol as usize, sub.len(), "{shape:?} {range:?}: {bx:?}");
            // The box's first element is at flat index sub.start.
            let mut flat = 0usize;
            for (k, e) in slice.0.iter().enumerate() {
                let stride: usize = shape[k + 1..].iter().product();
                flat += e.offset as usize * stride;
            }
            assert_eq!(flat, sub.start, "{shape:?} {range:?}: {bx:?}");
            at = sub.end;
        }
        assert_eq!(at, range.end.max(range.start));
        assert!(bx.len() <= 2 * shape.len() + 1, "{bx:?}");
    }

    #[test]
    fn boxes_cover_any_flat_range() {
        for shape in [vec![7usize], vec![4, 5], vec![3, 4, 5], vec![1, 6]] {
            let n: usize = shape.iter().product();
            for a in 0..=n {
                for b in a..=n {
                    check(&shape, a..b);
                }
            }
        }
    }
}
