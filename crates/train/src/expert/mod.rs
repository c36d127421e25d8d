//! Expert parallelism over the training engines (000 §专家并行 L2493–2523, Fig 5.15; F49
//! capacity, F50 all-to-all volume, F59 all-to-all cost): the model crate's mixture of experts
//! ([`model::moe`], one block's feed-forward) run over an EP group.
//!
//! - [`ExpertGroup`]: the dispatch / combine exchange ([`ExpertComm`]) over a process group.
//! - [`BlockGroups`]: a rank's block communication ([`BlockComm`]): its tensor-parallel group
//!   (or none) and its EP group (or none), so one block kernel sequence serves every layout.
//! - [`ExpertPart`]: what expert parallelism adds to an engine's rank. Its flat buffers keep
//!   the whole model's addresses: every expert has its place on every rank, the rank owns only
//!   its `E / ep` experts' ranges ([`Layout::owned_expert_ranges`]) and keeps the others at
//!   zero (their gradients are never written, so AdamW leaves them at zero). So the
//!   data-parallel reductions skip the experts' ranges (with `ep` = the data-parallel degree
//!   every rank owns different experts), the global norm adds the owners' sums of squares over
//!   the group, a checkpoint takes each expert from its owner, and the whole model is the
//!   group's sum over the experts' ranges.
use std::ops::Range;

use comm::dtype::{Element, ReduceOp};
use comm::group::ProcessGroup;
use model::Threads;
use model::block::BlockComm;
use model::layout::Layout;
use model::optim::{AdamW, StatePart, grad_sum_sq, scale_grads};

use crate::error::Result;
use crate::tensor::{Alone, TpGroup, TpPart, sum_in_rank_order, timed_on};
use crate::zero::replica::{intersect, minus};

mod trainer;

pub use model::moe::{
    ExpertComm, Experts, Local, MoeConfig, MoeLayout, MoeStats, Objective, dispatch, gate,
};
pub(crate) use trainer::share_pieces;

/// [`ExpertComm`] over an EP process group, timing its exchanges.
pub struct ExpertGroup<'a> {
    /// The EP group.
    pub group: &'a ProcessGroup,
    /// Seconds spent in its collectives.
    pub seconds: f64,
}

impl<'a> ExpertGroup<'a> {
    /// The exchange over `group`.
    pub fn new(group: &'a ProcessGroup) -> Self {
        Self {
            group,
            seconds: 0.0,
        }
    }

    fn timed(&mut self, op: impl FnOnce(&ProcessGroup) -> comm::Result<()>) -> model::Result<()> {
        timed_on(self.group, &mut self.seconds, op)
    }
}

impl<T: Element> ExpertComm<T> for ExpertGroup<'_> {
    fn size(&self) -> usize {
        self.group.size()
    }
    fn rank(&self) -> usize {
        self.group.rank()
    }
    fn all_gather_i64(&mut self, input: &[i64], output: &mut [i64]) -> model::Result<()> {
        self.timed(|g| g.all_gather(input, output))
    }
    fn all_reduce_sum(&mut self, buf: &mut [T]) -> model::Result<()> {
        self.timed(|g| g.all_reduce(buf, ReduceOp::Sum))
    }
    fn all_reduce_sum_i64(&mut self, buf: &mut [i64]) -> model::Result<()> {
        self.timed(|g| g.all_reduce(buf, ReduceOp::Sum))
    }
    fn all_to_all_v(
        &mut self,
        input: &[T],
        send: &[usize],
        output: &mut [T],
        recv: &[usize],
    ) -> model::Result<()> {
        self.timed(|g| g.all_to_all_v(input, send, output, recv))
    }
}

/// A rank's block communication over its groups: the tensor-parallel group its blocks are
/// split over (none: whole blocks) and the EP group its experts exchange rows over (none: each
/// rank computes every expert). One [`BlockComm`] for every layout.
pub struct BlockGroups<'a> {
    /// The tensor-parallel group.
    pub tp: Option<TpGroup<'a>>,
    /// The expert exchange.
    pub experts: Option<ExpertGroup<'a>>,
}

impl<'a> BlockGroups<'a> {
    /// The groups of a rank with tensor-parallel part `tp` and expert part `experts`.
    pub fn new(tp: Option<&'a TpPart>, experts: Option<&'a ExpertPart>) -> Self {
        Self {
            tp: tp.map(TpGroup::of),
            experts: experts.map(|p| ExpertGroup::new(&p.group)),
        }
    }

    /// Seconds spent in the blocks' collectives (tensor-parallel sums and expert exchanges).
    pub fn seconds(&self) -> f64 {
        self.tp.as_ref().map_or(0.0, |g| g.seconds)
            + self.experts.as_ref().map_or(0.0, |e| e.seconds)
    }
}

impl<T: Element> BlockComm<T> for BlockGroups<'_> {
    fn splits(&self) -> bool {
        self.tp.is_some()
    }
    fn sum(&mut self, buf: &mut [T]) -> model::Result<()> {
        match &mut self.tp {
            Some(g) => g.sum(buf),
            None => Alone.sum(buf),
        }
    }
    fn sequence(&self) -> bool {
        self.tp
            .as_ref()
            .is_some_and(|g| BlockComm::<T>::sequence(g))
    }
    fn part(&self) -> (usize, usize) {
        self.tp.as_ref().map_or((0, 1), |g| BlockComm::<T>::part(g))
    }
    fn gather(&mut self, rows: &[T], whole: &mut [T]) -> model::Result<()> {
        match &mut self.tp {
            Some(g) => g.gather(rows, whole),
            None => Alone.gather(rows, whole),
        }
    }
    fn scatter(&mut self, whole: &mut [T], rows: &mut [T]) -> model::Result<()> {
        match &mut self.tp {
            Some(g) => g.scatter(whole, rows),
            None => Alone.scatter(whole, rows),
        }
    }
    fn experts(&mut self) -> Option<&mut dyn ExpertComm<T>> {
        self.experts.as_mut().map(|e| e as &mut dyn ExpertComm<T>)
    }
}

/// What expert parallelism adds to an engine's rank: its EP group and the experts' ranges of
/// the flat buffers (see the module doc).
pub struct ExpertPart {
    /// The EP group: `ep` data-parallel replicas splitting the experts.
    pub group: ProcessGroup,
    /// The ranks holding this rank's experts in the other EP groups (None: one EP group, ep
    /// = the data-parallel degree), over which the experts' gradients are averaged.
    pub replicas: Option<ProcessGroup>,
    /// Every expert's range (merged), owned or not.
    pub all: Vec<Range<usize>>,
    /// This rank's experts' ranges.
    pub owned: Vec<Range<usize>>,
    /// The other ranks' experts' ranges: zero here, never stepped (their moments' pages
    /// are never touched).
    pub others: Vec<Range<usize>>,
}

impl ExpertPart {
    /// The part of rank `group.rank()` of the EP `group` over buffers laid out as `layout` (the
    /// model's: every expert at its whole-model address).
    pub fn new(layout: &Layout, group: ProcessGroup) -> Self {
        let (all, owned) = (
            layout.expert_ranges(),
            layout.owned_expert_ranges(group.size(), group.rank()),
        );
        Self {
            others: cut_out(&all, &owned),
            all,
            owned,
            group,
            replicas: None,
        }
    }

    /// This part with the experts' replica group `replicas` (see [`expert_groups`]).
    pub fn with_replicas(mut self, replicas: Option<ProcessGroup>) -> Self {
        self.replicas = replicas;
        self
    }

    /// The experts' gradients after the backward: averaged over the replica group (each EP
    /// group's ranks hold the same experts), then scaled by `scale` (the micro-batches' `1/m`).
    /// A collective over the replica group.
    pub fn finish_grads(&self, th: &Threads, grads: &mut [f32], scale: f32) -> Result<()> {
        let scale = match &self.replicas {
            Some(g) => {
                for r in &self.owned {
                    g.all_reduce(&mut grads[r.clone()], ReduceOp::Sum)?;
                }
                scale / g.size() as f32
            }
            None => scale,
        };
        if scale != 1.0 {
            for r in &self.owned {
                scale_grads(th, &mut grads[r.clone()], scale);
            }
        }
        Ok(())
    }

    /// ep.
    pub fn ep(&self) -> usize {
        self.group.size()
    }

    /// `ranges` with every expert's range cut out (the parts a data-parallel reduction sums).
    pub fn dense_parts(&self, ranges: &[Range<usize>]) -> Vec<Range<usize>> {
        cut_out(ranges, &self.all)
    }

    /// `buckets` (a data-parallel reduction's, in the backward's descending order) with every
    /// expert's range cut out, still descending: the pieces of one bucket last to first.
    pub fn dense_buckets(&self, buckets: &[Range<usize>]) -> Vec<Range<usize>> {
        buckets
            .iter()
            .flat_map(|b| {
                let mut pieces = cut_out(std::slice::from_ref(b), &self.all);
                pieces.reverse();
                pieces
            })
            .collect()
    }

    /// One AdamW step of `params` (the flat buffers' elements from `start` on, `opt`'s state
    /// in the same coordinates) from `grads`, skipping the other ranks' experts: each stepped
    /// element gets exactly [`AdamW::step`]'s update, and the others' moments stay untouched
    /// (their zero pages never become resident).
    ///
    /// # Errors
    /// What [`AdamW::step_parts`] refuses.
    pub fn step_owned(
        &self,
        th: &Threads,
        opt: &mut AdamW,
        (params, grads): (&mut [f32], &[f32]),
        start: usize,
        (lr, decay): (f32, &[Range<usize>]),
    ) -> Result<()> {
        let span = start..start + params.len();
        let keep = minus(&span, &self.others);
        let mut parts = Vec::with_capacity(keep.len());
        let (mut rest, mut at) = (params, start);
        for r in keep {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - at);
            let (mine, tail) = tail.split_at_mut(r.len());
            let local = r.start - start..r.end - start;
            parts.push(StatePart {
                at: local.start,
                params: mine,
                grads: &grads[local],
            });
            (rest, at) = (tail, r.end);
        }
        Ok(opt.step_parts(th, &mut parts, lr, decay)?)
    }

    /// Elements of the other ranks' experts within `span` (their moments are never touched).
    pub fn others_len(&self, span: &Range<usize>) -> usize {
        self.others
            .iter()
            .filter_map(|r| intersect(r, span))
            .map(|r| r.len())
            .sum()
    }

    /// Zeroes the experts this rank does not own in `buf`, a slice of the flat buffers starting
    /// at element `start` (after a whole-model initialisation or load).
    pub fn zero_within(&self, buf: &mut [f32], start: usize) {
        let span = start..start + buf.len();
        for r in &self.others {
            if let Some(x) = intersect(r, &span) {
                buf[x.start - start..x.end - start].fill(0.0);
            }
        }
    }

    /// Scales `range` of `grads`: its dense parts by `dense`, its experts' parts by `experts`.
    pub fn scale_apart(
        &self,
        th: &Threads,
        grads: &mut [f32],
        range: &Range<usize>,
        (dense, experts): (f32, f32),
    ) {
        for piece in minus(range, &self.all) {
            scale_grads(th, &mut grads[piece], dense);
        }
        for r in self.all.iter().filter_map(|e| intersect(e, range)) {
            scale_grads(th, &mut grads[r], experts);
        }
    }

    /// Σ over the group of the squares of this rank's experts' gradients, added in rank order
    /// (the same bits on every rank).
    pub fn sum_sq(&self, th: &Threads, grads: &[f32]) -> Result<f64> {
        let mine = self
            .owned
            .iter()
            .fold(0.0, |a, r| a + grad_sum_sq(th, &grads[r.clone()]));
        sum_in_rank_order(&self.group, mine)
    }

    /// Sum of squares of `grads` outside the experts' ranges.
    pub fn dense_sum_sq(&self, th: &Threads, grads: &[f32]) -> f64 {
        self.dense_parts(std::slice::from_ref(&(0..grads.len())))
            .into_iter()
            .fold(0.0, |a, r| a + grad_sum_sq(th, &grads[r]))
    }

    /// Fills the experts' `ranges` of `buf` (every expert's, in `buf`'s layout: this rank's
    /// [`ExpertPart::all`], or a whole model's) from their owners, a collective over the
    /// group: each rank holds zeros outside its own, so the group's sum is exact.
    pub fn complete(&self, buf: &mut [f32], ranges: &[Range<usize>]) -> Result<()> {
        for r in ranges {
            self.group.all_reduce(&mut buf[r.clone()], ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// Whether this rank writes the flat element `at` of a checkpoint when it lies in an
    /// expert's range (None: a dense element): the experts it owns, on the first of their
    /// replicas.
    pub fn owns(&self, at: usize) -> Option<bool> {
        let first = self.replicas.as_ref().is_none_or(|g| g.rank() == 0);
        self.all
            .iter()
            .any(|r| r.contains(&at))
            .then(|| first && self.owned.iter().any(|r| r.contains(&at)))
    }
}

/// This rank's EP group and its experts' replica group over the data-parallel `group`, split
/// into EP groups of `ep` consecutive ranks (the mesh's convention, `comm::mesh`): rank `r`
/// holds the experts of index `r mod ep` in its EP group, the same as every rank `r' ≡ r (mod
/// ep)`, its replicas (None when `ep` is the whole group). Refuses `ep` not dividing the
/// group. A collective over `group`.
pub fn expert_groups(
    group: &ProcessGroup,
    ep: usize,
) -> Result<(ProcessGroup, Option<ProcessGroup>)> {
    let dp = group.size();
    if ep == 0 || !dp.is_multiple_of(ep) {
        return Err(crate::TrainError::Config {
            field: "ep",
            value: ep.to_string(),
            reason: format!("must divide the data-parallel degree {dp} (dp % ep == 0)"),
        });
    }
    if ep == dp {
        return Ok((group.clone(), None));
    }
    let missing = || crate::TrainError::Config {
        field: "ep",
        value: ep.to_string(),
        reason: "this rank is in no expert group".into(),
    };
    let (mut mine, mut replicas) = (None, None);
    for k in 0..dp / ep {
        let ranks: Vec<usize> = (k * ep..(k + 1) * ep).collect();
        if let Some(g) = group.subgroup(&format!("ep{k}"), &ranks)? {
            mine = Some(g);
        }
    }
    for j in 0..ep {
        let ranks: Vec<usize> = (0..dp / ep).map(|k| k * ep + j).collect();
        if let Some(g) = group.subgroup(&format!("experts{j}"), &ranks)? {
            replicas = Some(g);
        }
    }
    match (mine, replicas) {
        (Some(m), Some(r)) => Ok((m, Some(r))),
        _ => Err(missing()),
    }
}

/// `ranges` minus `holes`, each range's pieces in ascending order.
pub fn cut_out(ranges: &[Range<usize>], holes: &[Range<usize>]) -> Vec<Range<usize>> {
    ranges.iter().flat_map(|r| minus(r, holes)).collect()
}

#[cfg(test)]
mod tests {
    use super::cut_out;
    use std::ops::Range;

    /// One range as a list.
    fn one(r: Range<usize>) -> Vec<Range<usize>> {
        std::iter::once(r).collect()
    }

    #[test]
    fn cutting_out_keeps_the_rest_in_order() {
        assert_eq!(cut_out(&one(0..10), &[2..4, 6..7]), vec![0..2, 4..6, 7..10]);
        assert_eq!(cut_out(&[0..10, 12..20], &one(8..14)), vec![0..8, 14..20]);
        assert_eq!(cut_out(&one(3..5), &one(0..10)), Vec::<Range<usize>>::new());
        assert_eq!(cut_out(&one(3..5), &[]), one(3..5));
    }
}
