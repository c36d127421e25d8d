//! Placement of a mesh on hosts: which groups may span hosts, and the pipeline stage order.
//!
//! Rules, from the bandwidth hierarchy (000 §2.20 "hierarchy-aware parallelism", L2607):
//! - **TP inside one host, or refuse.** Megatron-style TP all-reduces the activations twice per
//!   block in the forward pass and twice in the backward pass: 4 blocking all-reduces per layer
//!   per micro-batch, each of about 2·M_act bytes (000 §2.15, F46, F47). Across hosts each one
//!   runs at inter-host bandwidth, ≈9× slower than the intra-node fabric (000 E32), so "TP groups
//!   must share a node" (001 line 61). `force` accepts it with a warning.
//! - **EP preferably inside one host.** Two all-to-alls per MoE layer (000 §2.18, F50) that
//!   burst many-to-one; keep expert groups in one fast domain (004 Ex. 28.7). A warning only.
//! - **PP stages in host order.** Each pipeline hands activations from stage to stage (000 F42);
//!   [`order_stages`] permutes stages so that consecutive stages share a host where possible,
//!   minimising the hops [`cross_host_hops`] counts.

use super::{Axis, MeshLayout, MeshShape};
use crate::error::{CommError, Result};
use std::collections::BTreeMap;

/// Exact stage ordering (Held–Karp over subsets of slabs) up to this many stages; greedy above.
const EXACT_STAGES: usize = 12;

/// Offending groups spelled out in a message; the rest are counted.
const SHOWN_GROUPS: usize = 3;

fn check_hosts(world: usize, host_of: &[usize]) -> Result<()> {
    if host_of.len() != world {
        return Err(CommError::InvalidArgument(format!(
            "mesh placement: host_of names {} ranks, the mesh has {world}",
            host_of.len()
        )));
    }
    Ok(())
}

/// Cross-host hops of all pipelines: the number of (pipeline, consecutive stage pair) whose two
/// ranks sit on different hosts. `host_of[r]` is rank `r`'s host index.
pub fn cross_host_hops(layout: &MeshLayout, host_of: &[usize]) -> Result<usize> {
    check_hosts(layout.world(), host_of)?;
    Ok(layout
        .groups(Axis::Pp)
        .iter()
        .map(|p| {
            p.windows(2)
                .filter(|w| host_of[w[0]] != host_of[w[1]])
                .count()
        })
        .sum())
}

/// The stage order (`order[k]` = slab running stage `k`, as [`MeshLayout::with_stage_order`]
/// takes it) that minimises [`cross_host_hops`] for ranks on hosts `host_of`. The identity is
/// kept unless another order is strictly better, so a host-contiguous launch is left alone.
///
/// Slab `s` holds ranks `[s·T·D, (s+1)·T·D)`, and every pipeline takes position `tp + T·dp` in
/// each slab, so placing slab `b` right after slab `a` costs the number of positions where
/// their hosts differ (a Hamming distance). The best order is a shortest Hamiltonian path over
/// slabs: exact by dynamic programming over subsets for up to 12 stages, nearest-neighbour
/// above that. Deterministic, so every rank computes the same order.
pub fn order_stages(shape: MeshShape, host_of: &[usize]) -> Result<Vec<usize>> {
    shape.validate(host_of.len())?;
    let p = shape.pp;
    let width = shape.tp * shape.dp;
    let slab = |s: usize| &host_of[s * width..(s + 1) * width];
    let dist: Vec<Vec<usize>> = (0..p)
        .map(|a| {
            (0..p)
                .map(|b| slab(a).iter().zip(slab(b)).filter(|(x, y)| x != y).count())
                .collect()
        })
        .collect();
    let cost = |order: &[usize]| -> usize { order.windows(2).map(|w| dist[w[0]][w[1]]).sum() };
    let identity: Vec<usize> = (0..p).collect();
    let mut best = if p <= EXACT_STAGES {
        shortest_path(&dist)
    } else {
        nearest_neighbour(&dist)
    };
    // Distances are symmetric, so a path and its reverse cost the same: start from the lower
    // slab, keeping slab 0 on stage 0 where the order allows.
    if best.first() > best.last() {
        best.reverse();
    }
    Ok(if cost(&best) < cost(&identity) {
        best
    } else {
        identity
    })
}

/// Held–Karp: the cheapest order visiting every node once (open path, any start).
fn shortest_path(dist: &[Vec<usize>]) -> Vec<usize> {
    let n = dist.len();
    if n <= 1 {
        return (0..n).collect();
    }
    let full = 1usize << n;
    // best[mask][last]: cheapest path over `mask` ending at `last`; from[..]: previous node.
    let mut best = vec![vec![usize::MAX; n]; full];
    let mut from = vec![vec![usize::MAX; n]; full];
    for i in 0..n {
        best[1 << i][i] = 0;
    }
    for mask in 1..full {
        for last in 0..n {
            let c = best[mask][last];
            if c == usize::MAX || mask & (1 << last) == 0 {
                continue;
            }
            for next in (0..n).filter(|&x| mask & (1 << x) == 0) {
                let m2 = mask | (1 << next);
                let c2 = c + dist[last][next];
                if c2 < best[m2][next] {
                    best[m2][next] = c2;
                    from[m2][next] = last;
                }
            }
        }
    }
    let mut last = (0..n).min_by_key(|&l| best[full - 1][l]).unwrap_or(0);
    let mut mask = full - 1;
    let mut path = Vec::with_capacity(n);
    while last != usize::MAX {
        path.push(last);
        let prev = from[mask][last];
        mask &= !(1 << last);
        last = prev;
    }
    path.reverse();
    path
}

/// Greedy: from slab 0, always to the nearest unvisited slab (lowest index on ties).
fn nearest_neighbour(dist: &[Vec<usize>]) -> Vec<usize> {
    let n = dist.len();
    let mut seen = vec![false; n];
    let mut path = Vec::with_capacity(n);
    let mut cur = 0;
    while path.len() < n {
        seen[cur] = true;
        path.push(cur);
        match (0..n).filter(|&x| !seen[x]).min_by_key(|&x| dist[cur][x]) {
            Some(x) => cur = x,
            None => break,
        }
    }
    path
}

/// Checks where `layout`'s groups fall on hosts (`host_of[r]`: host index of rank `r`;
/// `host_names[h]`, if given, labels host `h`). A TP group spanning hosts is an error (the
/// message names each such group, its hosts and why), or with `force` a warning. EP groups
/// spanning hosts are a warning. Returns the warnings.
pub fn check_placement(
    layout: &MeshLayout,
    host_of: &[usize],
    host_names: &[String],
    force: bool,
) -> Result<Vec<String>> {
    check_hosts(layout.world(), host_of)?;
    let shape = layout.shape();
    let mut warnings = Vec::new();
    let tp = spanning(layout, Axis::Tp, host_of, host_names);
    if !tp.is_empty() {
        let mut per_host: BTreeMap<usize, usize> = BTreeMap::new();
        host_of
            .iter()
            .for_each(|&h| *per_host.entry(h).or_default() += 1);
        let smallest = per_host.values().copied().min().unwrap_or(0);
        let msg = format!(
            "{}. Tensor parallelism all-reduces activations 4 times per layer per micro-batch \
             (2 forward + 2 backward, each about 2·M_act bytes on the critical path; 000 §2.15, \
             F46, F47), and across hosts each one runs at inter-host bandwidth, about 9x slower \
             than inside a node (000 E32), so a TP group must stay inside one host (000 §2.20, \
             hierarchy-aware parallelism; 001 line 61). Use tp <= {smallest} (the fewest ranks \
             on one host) with ranks numbered host by host, or force the mesh to run anyway",
            describe(&tp, Axis::Tp, shape.dp * shape.pp)
        );
        if !force {
            return Err(CommError::Config(format!("mesh placement: {msg}")));
        }
        warnings.push(format!("forced: {msg}"));
    }
    let ep = spanning(layout, Axis::Ep, host_of, host_names);
    if shape.ep > 1 && !ep.is_empty() {
        warnings.push(format!(
            "{}: its 2 all-to-alls per MoE layer (000 §2.18, F50) cross hosts; expert groups \
             are best kept in one fast domain (004 Ex. 28.7)",
            describe(&ep, Axis::Ep, shape.tp * shape.pp * (shape.dp / shape.ep))
        ));
    }
    Ok(warnings)
}

/// One line per group along `axis` that spans hosts: `group i (ranks [..]) spans hosts: ...`.
fn spanning(
    layout: &MeshLayout,
    axis: Axis,
    host_of: &[usize],
    host_names: &[String],
) -> Vec<String> {
    layout
        .groups(axis)
        .iter()
        .enumerate()
        .filter_map(|(i, ranks)| {
            let mut by_host: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
            for &r in ranks {
                by_host.entry(host_of[r]).or_default().push(r);
            }
            (by_host.len() > 1).then(|| {
                let hosts: Vec<String> = by_host
                    .iter()
                    .map(|(&h, rs)| match host_names.get(h) {
                        Some(name) => format!("host {h} '{name}' has ranks {rs:?}"),
                        None => format!("host {h} has ranks {rs:?}"),
                    })
                    .collect();
                format!(
                    "{} group {i} (ranks {ranks:?}) spans {} hosts: {}",
                    axis.name().to_uppercase(),
                    by_host.len(),
                    hosts.join(", ")
                )
            })
        })
        .collect()
}

fn describe(lines: &[String], axis: Axis, groups: usize) -> String {
    let mut s = lines
        .iter()
        .take(SHOWN_GROUPS)
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    if lines.len() > SHOWN_GROUPS {
        s.push_str(&format!(
            "; and {} more {} groups",
            lines.len() - SHOWN_GROUPS,
            axis.name().to_uppercase()
        ));
    }
    s.push_str(&format!(
        " ({} of {groups} {} groups span hosts)",
        lines.len(),
        axis.name().to_uppercase()
    ));
    s
}
