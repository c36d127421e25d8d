//! Binomial-tree broadcast, reduce and all-reduce (unchunked).
//!
//! Members are numbered relative to the root, `v = (me - root) mod p`. Member v's parent is v with
//! its lowest set bit cleared; its children are `v + 2^k` for every `2^k` below that bit (every
//! `2^k < p` for the root), as far as they exist. Broadcast: receive from the parent, then send to
//! the children, largest subtree first. Reduce is the mirror image: reduce the children's partial
//! results into the buffer, smallest subtree first (the order they finish in), then send to the
//! parent. Either takes ⌈log2 p⌉ steps, each moving the whole buffer over one link.
//!
//! Cost (004 eq. 28.13, the unchunked tree), p ranks, n bytes, per-byte reduction cost γ:
//! - broadcast: `⌈log2 p⌉·(α + n·β⁻¹)`; the root sends up to ⌈log2 p⌉·n bytes.
//! - reduce: `⌈log2 p⌉·(α + n·β⁻¹ + n·γ)`; every non-root member sends n bytes once.
//! - all-reduce (reduce to member 0, broadcast from it): `2⌈log2 p⌉·(α + n·β⁻¹) + ⌈log2 p⌉·n·γ`.
//!
//! Latency is logarithmic but every step carries the whole buffer, so these suit small messages;
//! large ones want the ring or the pipelined double tree.
//!
//! Determinism: the root combines in a fixed order, `((x op c1) op c2) …` down the tree, fixed by
//! the tree's shape, never by arrival; the all-reduce broadcasts the root's bytes, so every rank
//! ends with identical bytes. The reduce does not touch the group's scratch buffer: each child's
//! data is combined into `buf` as it arrives.
//!
//! Deadlock freedom: each step is a single transfer between a parent and a child, and every member
//! only waits on its own children (reduce) or its own parent (broadcast); the wait-for graph is the
//! tree itself, which has no cycle, and messages between a pair are consumed in the order sent.

use super::{Ctx, Team};
use crate::dtype::ReduceOp;
use crate::engine::Xfer;
use crate::error::Result;

/// The binomial tree around one member: group ranks of its parent and children.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Binomial {
    parent: Option<usize>,
    /// Children by increasing subtree size (`v+1`, `v+2`, `v+4`, …).
    children: Vec<usize>,
}

impl Binomial {
    fn new(team: &Team, root: usize) -> Binomial {
        let p = team.size();
        let v = (team.me + p - root % p) % p;
        let to_rank = |u: usize| team.peer(root + u);
        let low = if v == 0 {
            p.next_power_of_two()
        } else {
            v & v.wrapping_neg()
        };
        let parent = (v != 0).then(|| to_rank(v - low));
        let children = (0..usize::BITS)
            .map(|k| 1usize << k)
            .take_while(|&d| d < low)
            .filter(|&d| v + d < p)
            .map(|d| to_rank(v + d))
            .collect();
        Binomial { parent, children }
    }
}

/// Binomial-tree broadcast from team member `root`.
pub struct TreeBroadcast {
    team: Team,
    tree: Binomial,
}

impl TreeBroadcast {
    /// Plans a broadcast from member `root` (an index into the team).
    pub fn new(team: Team, root: usize) -> Self {
        let tree = Binomial::new(&team, root);
        TreeBroadcast { team, tree }
    }

    /// Runs it in place: afterwards every member's `buf` holds the root's bytes.
    pub fn run(&self, ctx: &mut Ctx<'_>, buf: &mut [u8]) -> Result<()> {
        if self.team.size() == 1 || buf.is_empty() {
            return Ok(());
        }
        if let Some(parent) = self.tree.parent {
            ctx.exchange(&mut [Xfer::Recv {
                peer: parent,
                buf: &mut *buf,
            }])?;
        }
        // Largest subtree first: it has the most steps still ahead of it.
        for &child in self.tree.children.iter().rev() {
            ctx.exchange(&mut [Xfer::Send {
                peer: child,
                data: &*buf,
            }])?;
        }
        Ok(())
    }
}

/// Binomial-tree reduce to team member `root`.
pub struct TreeReduce {
    team: Team,
    tree: Binomial,
}

impl TreeReduce {
    /// Plans a reduce to member `root` (an index into the team).
    pub fn new(team: Team, root: usize) -> Self {
        let tree = Binomial::new(&team, root);
        TreeReduce { team, tree }
    }

    /// Runs it; the root's `buf` holds the result, other buffers hold partial results afterwards.
    /// `scratch` is not needed (children are combined into `buf` as their data arrives).
    pub fn run(
        &self,
        ctx: &mut Ctx<'_>,
        buf: &mut [u8],
        op: ReduceOp,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        let _ = scratch;
        if self.team.size() == 1 || buf.is_empty() {
            return Ok(());
        }
        // Smallest subtree first: the order in which the children finish.
        for &child in &self.tree.children {
            ctx.exchange(&mut [Xfer::RecvReduce {
                peer: child,
                acc: &mut *buf,
                op,
            }])?;
        }
        if let Some(parent) = self.tree.parent {
            ctx.exchange(&mut [Xfer::Send {
                peer: parent,
                data: &*buf,
            }])?;
        }
        Ok(())
    }
}

/// Binomial-tree all-reduce: reduce to member 0, then broadcast from member 0.
pub struct TreeAllReduce {
    reduce: TreeReduce,
    bcast: TreeBroadcast,
}

impl TreeAllReduce {
    /// Plans an all-reduce over the team.
    pub fn new(team: Team) -> Self {
        TreeAllReduce {
            reduce: TreeReduce::new(team.clone(), 0),
            bcast: TreeBroadcast::new(team, 0),
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
        self.reduce.run(ctx, buf, op, scratch)?;
        self.bcast.run(ctx, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{self, ALL_REDUCE_DTYPES};
    use super::*;
    use crate::dtype::DType;

    #[test]
    fn binomial_shape() {
        // p = 6, root 0: 0 -> {1, 2, 4}, 2 -> {3}, 4 -> {5}.
        let t = |me| Binomial::new(&Team::world(me, 6), 0);
        assert_eq!(
            t(0),
            Binomial {
                parent: None,
                children: vec![1, 2, 4]
            }
        );
        assert_eq!(
            t(2),
            Binomial {
                parent: Some(0),
                children: vec![3]
            }
        );
        assert_eq!(
            t(5),
            Binomial {
                parent: Some(4),
                children: vec![]
            }
        );
        // Root 4 of 6: relative rank of 1 is 3, parent relative 2 = rank 0.
        assert_eq!(
            Binomial::new(&Team::world(1, 6), 4),
            Binomial {
                parent: Some(0),
                children: vec![]
            }
        );
        // Every member but the root has exactly one parent, and it lists the member as a child.
        for p in 1..=17 {
            for root in [0, p / 2, p - 1] {
                let trees: Vec<Binomial> = (0..p)
                    .map(|m| Binomial::new(&Team::world(m, p), root))
                    .collect();
                let edges: usize = trees.iter().map(|t| t.children.len()).sum();
                assert_eq!(edges, p - 1);
                for (m, t) in trees.iter().enumerate() {
                    assert_eq!(t.parent.is_none(), m == root);
                    if let Some(par) = t.parent {
                        assert!(trees[par].children.contains(&m));
                    }
                }
            }
        }
    }

    #[test]
    fn all_reduce_matches_reference() {
        testkit::check_all_reduce(1..=8, ALL_REDUCE_DTYPES, |team, ctx, _, buf, op| {
            TreeAllReduce::new(team.clone()).run(ctx, buf, op, &mut Vec::new())
        });
    }

    #[test]
    fn all_reduce_on_sub_team() {
        testkit::check_sub_team(|team, ctx, _, buf, op| {
            TreeAllReduce::new(team.clone()).run(ctx, buf, op, &mut Vec::new())
        });
    }

    #[test]
    fn broadcast_and_reduce_from_every_root() {
        for p in 1..=7 {
            for count in [0, 1, 300] {
                let outs = testkit::run_ranks(p, |me, ctx| {
                    let team = Team::world(me, p);
                    let mut res = Vec::new();
                    for root in 0..p {
                        testkit::begin(ctx, DType::I64);
                        let mut b = testkit::input(DType::I64, me, count, root);
                        TreeBroadcast::new(team.clone(), root)
                            .run(ctx, &mut b)
                            .unwrap();
                        let mut r = testkit::input(DType::I64, me, count, root);
                        TreeReduce::new(team.clone(), root)
                            .run(ctx, &mut r, ReduceOp::Sum, &mut Vec::new())
                            .unwrap();
                        res.push((b, r));
                    }
                    res
                });
                for root in 0..p {
                    let inputs: Vec<Vec<u8>> = (0..p)
                        .map(|m| testkit::input(DType::I64, m, count, root))
                        .collect();
                    for (m, out) in outs.iter().enumerate() {
                        assert_eq!(
                            out[root].0, inputs[root],
                            "broadcast p={p} root={root} member {m}"
                        );
                    }
                    let want = testkit::reference(DType::I64, ReduceOp::Sum, &inputs);
                    assert_eq!(outs[root][root].1, want, "reduce p={p} root={root}");
                }
            }
        }
    }
}
