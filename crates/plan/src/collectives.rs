//! Alpha-beta collective costs (000 Chapter 6, F15–F16, F59, F66; 004 eqs. 28.10–28.14).
//! `m` is the full message per device in bytes, `p` the group size; every function returns
//! seconds and is 0 for a group of one. The formulas are the `cost` crate's, which the runtime
//! selector (`comm::model`) prices with too; this module picks the planner's conventions
//! (no reduction term, textbook halving-doubling, one inter-node port per device) and places
//! groups on nodes.

use crate::cluster::Cluster;
use crate::hardware::Link;
use crate::nccl::{Collective, best};
use crate::units::RingFactor;
use serde::{Deserialize, Serialize};

/// All-reduce algorithm choices (000 Table 6.5; gloo's `docs/algorithms.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AllReduceAlgo {
    /// Reduce-scatter then all-gather around a ring.
    Ring,
    /// Unchunked binary tree reduce + broadcast.
    Tree,
    /// Recursive halving (reduce-scatter) and doubling (all-gather).
    HalvingDoubling,
}

/// Ring all-reduce: 2(p-1)·α + 2·f(p)·m/β with f = (p-1)/p exact (004 eq. 28.12; 000 F16).
/// 004 eq. 28.14: p = 8, m = 256 MiB, α = 5 µs, β = 25 GiB/s → 0.01757 s.
pub fn ring_all_reduce(link: &Link, m: f64, p: u64, rf: RingFactor) -> f64 {
    call(link, m, p).ring_all_reduce(rf)
}

/// Ring reduce-scatter: (p-1)·α + f(p)·m/β (000 F59, Table 6.4).
pub fn reduce_scatter(link: &Link, m: f64, p: u64, rf: RingFactor) -> f64 {
    call(link, m, p).ring_reduce_scatter(rf)
}

/// Ring all-gather of a result of `m` bytes: (p-1)·α + f(p)·m/β (000 F59).
pub fn all_gather(link: &Link, m: f64, p: u64, rf: RingFactor) -> f64 {
    call(link, m, p).ring_all_gather(rf)
}

/// Tree all-reduce: 2·⌈log2 p⌉·(α + m/β) (004 eq. 28.13, unchunked reduce + broadcast).
pub fn tree_all_reduce(link: &Link, m: f64, p: u64) -> f64 {
    call(link, m, p).tree_all_reduce()
}

/// Halving-doubling all-reduce: 2·⌈log2 p⌉·α + 2(p-1)/p·m/β (Thakur et al. 2005; gloo
/// `docs/algorithms.md` "2·lg(P) steps, 2·S bytes"): the textbook formula, without the
/// runtime's store-and-forward penalty or non-power-of-two fold.
pub fn halving_doubling_all_reduce(link: &Link, m: f64, p: u64) -> f64 {
    call(link, m, p).halving_doubling_all_reduce(::cost::HalvingDoubling::TEXTBOOK)
}

/// All-to-all with `m` bytes per device in total: (p-1)·α + f(p)·m/β (000 F59: "(N-1)/N·M per
/// worker", one message to each peer).
pub fn all_to_all(link: &Link, m: f64, p: u64, rf: RingFactor) -> f64 {
    call(link, m, p).pairwise_all_to_all(rf)
}

/// Hierarchical all-reduce over `nodes` × `local` devices (000 F66, L3163): intra-node
/// reduce-scatter over `local`, inter-node ring all-reduce of m/local over `nodes` (each device
/// on its own inter-node port), intra-node all-gather. 000 E65 (70B, 16 × 8, NVLink 450, IB
/// 50 GB/s) ≈ 1,200.8 ms.
pub fn hierarchical_all_reduce(
    intra: &Link,
    inter: &Link,
    m: f64,
    local: u64,
    nodes: u64,
    rf: RingFactor,
) -> f64 {
    let one_per_core = 1.0;
    let intra = call(intra, m, local).hierarchical_ring_phase(one_per_core, rf);
    let inter =
        call(inter, m, nodes).hierarchical_inter_phase(local, ::cost::Egress::PerDevice, rf);
    ::cost::hierarchical_all_reduce(intra, inter, None)
}

/// A collective of `m` bytes over `p` devices on `link`, priced as the planner does: without the
/// reduction's arithmetic (γ = 0; devices reduce far faster than links carry).
fn call(link: &Link, m: f64, p: u64) -> ::cost::Call {
    ::cost::Call {
        alpha: link.alpha,
        beta: link.beta,
        gamma: 0.0,
        n: m,
        p,
    }
}

/// Time of one all-reduce with `algo`.
pub fn all_reduce(algo: AllReduceAlgo, link: &Link, m: f64, p: u64, rf: RingFactor) -> f64 {
    match algo {
        AllReduceAlgo::Ring => ring_all_reduce(link, m, p, rf),
        AllReduceAlgo::Tree => tree_all_reduce(link, m, p),
        AllReduceAlgo::HalvingDoubling => halving_doubling_all_reduce(link, m, p),
    }
}

/// The fastest flat all-reduce algorithm for (m, p) and its time: tree for small messages, ring
/// or halving-doubling for large (000 Q17, 004 line 190).
pub fn best_all_reduce(link: &Link, m: f64, p: u64, rf: RingFactor) -> (AllReduceAlgo, f64) {
    [
        AllReduceAlgo::Ring,
        AllReduceAlgo::Tree,
        AllReduceAlgo::HalvingDoubling,
    ]
    .into_iter()
    .map(|a| (a, all_reduce(a, link, m, p, rf)))
    .fold((AllReduceAlgo::Ring, f64::INFINITY), |b, x| {
        if x.1 < b.1 { x } else { b }
    })
}

/// Where a communication group of `size` members, `stride` ranks apart, sits on a cluster of
/// nodes with `per_node` devices (ranks are numbered TP-fastest, then PP, then DP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Placement {
    /// The whole group is inside one node.
    IntraNode,
    /// `local` members per node on `nodes` nodes (hierarchical collectives apply).
    Spanning { local: u64, nodes: u64 },
}

/// Places a group: inside a node if stride·size ≤ per_node, else `local = per_node/stride`
/// members per node (at least 1).
pub fn placement(size: u64, stride: u64, per_node: u64) -> Placement {
    if size <= 1 || stride.saturating_mul(size) <= per_node {
        Placement::IntraNode
    } else {
        let local = (per_node / stride.max(1)).clamp(1, size);
        Placement::Spanning {
            local,
            nodes: size.div_ceil(local),
        }
    }
}

/// All-reduce over a placed group: the intra link inside a node, hierarchical (or flat on the
/// inter link when one member per node) across nodes.
pub fn group_all_reduce(
    intra: &Link,
    inter: &Link,
    m: f64,
    size: u64,
    pl: Placement,
    rf: RingFactor,
) -> f64 {
    match pl {
        Placement::IntraNode => best_all_reduce(intra, m, size, rf).1,
        Placement::Spanning { local: 1, .. } => best_all_reduce(inter, m, size, rf).1,
        Placement::Spanning { local, nodes } => {
            hierarchical_all_reduce(intra, inter, m, local, nodes, rf)
                .min(best_all_reduce(inter, m, size, rf).1)
        }
    }
}

/// The slowest link a placed group uses (all-to-all, reduce-scatter and all-gather are charged on
/// it, a conservative choice).
pub fn group_link(intra: &Link, inter: &Link, pl: Placement) -> Link {
    match pl {
        Placement::IntraNode => *intra,
        Placement::Spanning { .. } => *inter,
    }
}

/// All-reduce over a placed group of `cluster`: NCCL's model ([`crate::nccl::best`]) with
/// `collectives = "nccl"`, else [`group_all_reduce`].
pub fn cluster_all_reduce(c: &Cluster, m: f64, size: u64, pl: Placement) -> f64 {
    match &c.nccl {
        Some(t) => best(t, &c.intra, &c.inter, Collective::AllReduce, m, size, pl).time,
        None => group_all_reduce(&c.intra, &c.inter, m, size, pl, c.ring),
    }
}
