//! Hierarchical all-reduce for g ranks on each of h hosts: reduce-scatter inside each host,
//! all-reduce of each shard across hosts, all-gather inside each host (000 F66, 004 E10).
//!
//! 1. Ring reduce-scatter over the host team (this host's ranks in group-rank order) with the
//!    balanced g-way partition: local rank i ends with shard i reduced over its host.
//! 2. Ring all-reduce of shard i over the cross-host team (the ranks with local index i on every
//!    host, in host order): shard i is now reduced over the whole group.
//! 3. Ring all-gather over the host team: every rank ends with every shard.
//!
//! Only n/g bytes per rank cross hosts, over h-1 hops each way, and the g cross-host rings run in
//! parallel on different ranks. Cost, with α_in, β_in inside a host and α_out, β_out between hosts
//! (000 F66 / 004 E10), n bytes per rank:
//! `2(g−1)(α_in + (n/g)β_in⁻¹) + 2(h−1)(α_out + (n/(g·h))β_out⁻¹)`, plus reduction
//! `(g-1)/g·n·γ + (h-1)/h·(n/g)·γ`. Steps: 2(g-1) + 2(h-1).
//!
//! Determinism: the ring reduce-scatters reduce each piece in a fixed ring order on one rank and
//! the all-gathers only copy, so every rank ends with identical bytes.
//!
//! Deadlock freedom: the phases run in sequence, and within a phase every ring runs on a team
//! disjoint from the other rings of that phase (hosts are disjoint; cross-host teams differ in
//! local index), so each phase is a set of independent rings, each deadlock-free (see
//! [`super::ring`]). A rank that finishes a phase early can only send its next phase's messages on
//! links whose earlier messages its peer has already consumed or will consume first (links are
//! FIFO, and host-team and cross-host links are different links).

use super::direct_read::{DrAllReduce, Peers};
use super::ring::{RingAllGather, RingAllReduce, RingReduceScatter};
use super::{Ctx, Team, partition};
use crate::dtype::ReduceOp;
use crate::error::Result;
use std::ops::Range;

/// Hierarchical all-reduce: intra-host reduce-scatter, inter-host ring all-reduce of the shard,
/// intra-host all-gather.
pub struct HierAllReduce {
    intra_rs: RingReduceScatter,
    inter: RingAllReduce,
    intra_ag: RingAllGather,
    /// This rank's shard of the buffer (bytes).
    shard: Range<usize>,
    /// Single-copy intra-host phases, when local peers' memory may be read.
    intra_dr: Option<DrAllReduce>,
    /// Processes of `host_team`'s members, when `intra_dr` is set.
    local_pids: Vec<i32>,
    host_team: Team,
    cross_team: Team,
    count: usize,
    esz: usize,
}

impl HierAllReduce {
    /// Plans an all-reduce of `count` elements of `esz` bytes for group rank `group_rank`, where
    /// `host_of[r]` is the host index of group rank r. None unless there are at least two hosts
    /// and every host has the same number g ≥ 1 of ranks.
    pub fn new(group_rank: usize, host_of: &[usize], count: usize, esz: usize) -> Option<Self> {
        let my_host = *host_of.get(group_rank)?;
        let mut hosts = host_of.to_vec();
        hosts.sort_unstable();
        hosts.dedup();
        if hosts.len() < 2 {
            return None;
        }
        let per_host: Vec<Vec<usize>> = hosts
            .iter()
            .map(|&h| (0..host_of.len()).filter(|&r| host_of[r] == h).collect())
            .collect();
        let g = per_host[0].len();
        if g == 0 || per_host.iter().any(|ranks| ranks.len() != g) {
            return None;
        }
        let host_idx = hosts.binary_search(&my_host).ok()?;
        let local = per_host[host_idx].iter().position(|&r| r == group_rank)?;
        let host_team = Team {
            ranks: per_host[host_idx].clone(),
            me: local,
        };
        let cross_team = Team {
            ranks: per_host.iter().map(|ranks| ranks[local]).collect(),
            me: host_idx,
        };
        let shards = partition(count, g, esz);
        let shard = shards[local].clone();
        Some(HierAllReduce {
            intra_rs: RingReduceScatter::new(host_team.clone(), shards.clone()),
            inter: RingAllReduce::new(cross_team.clone(), shard.len() / esz, esz),
            intra_ag: RingAllGather::new(host_team.clone(), shards),
            shard,
            intra_dr: None,
            local_pids: Vec::new(),
            cross_team,
            host_team,
            count,
            esz,
        })
    }

    /// Runs the intra-host phases as single-copy reads (see [`super::direct_read`]);
    /// `pids[r]` is the process of group rank r.
    pub fn with_direct_read(mut self, pids: &[i32]) -> Self {
        let local: Vec<i32> = self.host_team.ranks.iter().map(|&r| pids[r]).collect();
        self.intra_dr = Some(DrAllReduce::new(
            Peers::new(self.host_team.clone(), local.clone()),
            self.count,
            self.esz,
        ));
        self.local_pids = local;
        self
    }

    fn parts(&self) -> super::hier_pipeline::Parts<'_> {
        super::hier_pipeline::Parts {
            host_team: &self.host_team,
            cross_team: &self.cross_team,
            local_pids: &self.local_pids,
            esz: self.esz,
        }
    }

    /// Runs it in place (the caller applies the final average, if any).
    pub fn run(
        &self,
        ctx: &mut Ctx<'_>,
        buf: &mut [u8],
        op: ReduceOp,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        if self.intra_dr.is_some() && buf.len() >= 2 * super::hier_pipeline::SEGMENT_BYTES {
            return super::hier_pipeline::run(self.parts(), ctx, buf, op);
        }
        if let Some(dr) = &self.intra_dr {
            // Single copy: reduce my shard from the local peers' buffers, all-reduce it across
            // hosts (nobody on this host reads it meanwhile), then gather the finished shards.
            let addrs = dr.reduce_own_chunk(ctx, buf, op, scratch)?;
            self.inter.run(ctx, &mut buf[dr.own_chunk()], op)?;
            return dr.gather_chunks(ctx, buf, &addrs);
        }
        self.intra_rs.run(ctx, buf, op)?;
        self.inter.run(ctx, &mut buf[self.shard.clone()], op)?;
        self.intra_ag.run(ctx, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit;
    use super::*;
    use crate::dtype::DType;

    fn check(host_of: &[usize]) {
        let p = host_of.len();
        let cases: Vec<(usize, DType, ReduceOp)> = [0, 1, 2, 5, 37, 3001]
            .into_iter()
            .flat_map(|c| {
                [DType::F32, DType::I64, DType::BF16]
                    .into_iter()
                    .map(move |d| (c, d, ReduceOp::Sum))
            })
            .chain([
                (37, DType::F32, ReduceOp::Max),
                (3001, DType::I64, ReduceOp::Max),
            ])
            .collect();
        let outs = testkit::run_ranks(p, |me, ctx| {
            let mut res = Vec::new();
            for (i, &(count, dtype, op)) in cases.iter().enumerate() {
                testkit::begin(ctx, dtype);
                let mut buf = testkit::input(dtype, me, count, i);
                let algo =
                    HierAllReduce::new(me, host_of, count, dtype.size()).expect("even layout");
                algo.run(ctx, &mut buf, op, &mut Vec::new()).unwrap();
                res.push(buf);
            }
            res
        });
        for (i, &(count, dtype, op)) in cases.iter().enumerate() {
            let inputs: Vec<Vec<u8>> = (0..p).map(|r| testkit::input(dtype, r, count, i)).collect();
            let want = testkit::reference(dtype, op, &inputs);
            for (r, out) in outs.iter().enumerate() {
                assert!(
                    out[i] == outs[0][i],
                    "{host_of:?} count={count} {dtype:?}: rank {r} differs from rank 0"
                );
                assert!(
                    out[i] == want,
                    "{host_of:?} count={count} {dtype:?} {op:?}: rank {r} is wrong"
                );
            }
        }
    }

    #[test]
    fn two_hosts_of_two() {
        check(&[0, 0, 1, 1]);
    }

    #[test]
    fn two_hosts_of_three() {
        check(&[0, 0, 0, 1, 1, 1]);
    }

    #[test]
    fn interleaved_hosts_and_one_rank_per_host() {
        check(&[1, 0, 1, 0, 2, 2]);
        check(&[2, 0, 1]);
    }

    #[test]
    fn rejects_uneven_or_single_host() {
        assert!(HierAllReduce::new(0, &[0, 0, 1], 10, 4).is_none());
        assert!(HierAllReduce::new(0, &[0, 0, 0, 0], 10, 4).is_none());
        assert!(HierAllReduce::new(5, &[0, 1], 10, 4).is_none());
        assert!(HierAllReduce::new(1, &[0, 1], 10, 4).is_some());
    }
}
