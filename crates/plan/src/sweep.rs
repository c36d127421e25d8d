//! Scale sweep: the best layout at each cluster size, with time, cost and whether it meets the
//! deadline — ranking by cost or time rather than throughput (004 example 27.3: "how many
//! devices for 12 days, at what cost").

use crate::cluster::Cluster;
use crate::error::Result;
use crate::job::Job;
use crate::search::{SearchOptions, search};
use crate::step::Evaluation;
use crate::units::fmt_time;
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// The best layout at one cluster size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepPoint {
    /// Nodes.
    pub nodes: u64,
    /// Devices.
    pub devices: u64,
    /// The fastest feasible layout, if any fits.
    pub best: Option<Evaluation>,
    /// Whether it trains `job.tokens` within `job.deadline` (true when there is no deadline).
    pub meets_deadline: bool,
}

/// Searches each node count in `nodes` (the rest of `cluster` unchanged).
pub fn sweep(
    job: &Job,
    cluster: &Cluster,
    nodes: &[u64],
    opts: &SearchOptions,
) -> Result<Vec<SweepPoint>> {
    let one = SearchOptions {
        top_k: 1,
        ..opts.clone()
    };
    nodes
        .iter()
        .filter(|&&n| n >= 1)
        .map(|&n| {
            let c = Cluster {
                nodes: n,
                ..cluster.clone()
            };
            let best = search(job, &c, &one)?.top.into_iter().next();
            let meets_deadline = match (&best, job.deadline_s) {
                (Some(e), Some(d)) => e.time_to_train_s <= d,
                (Some(_), None) => true,
                (None, _) => false,
            };
            Ok(SweepPoint {
                nodes: n,
                devices: c.devices(),
                best,
                meets_deadline,
            })
        })
        .collect()
}

/// The cheapest point that meets the deadline (device-hour plus electricity cost).
pub fn cheapest(points: &[SweepPoint]) -> Option<&SweepPoint> {
    points
        .iter()
        .filter(|p| p.meets_deadline && p.best.is_some())
        .min_by(|a, b| total_cost(a).total_cmp(&total_cost(b)))
}

fn total_cost(p: &SweepPoint) -> f64 {
    p.best
        .as_ref()
        .map_or(f64::INFINITY, |e| e.cost + e.energy_cost)
}

/// A table: nodes, devices, layout, tokens/s, time to train, cost, deadline.
pub fn render_sweep(points: &[SweepPoint]) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:>6} {:>8} {:<24} {:>12} {:>12} {:>14} {:>8}",
        "nodes", "devices", "best layout", "tokens/s", "time", "cost", "deadline"
    );
    for p in points {
        match &p.best {
            Some(e) => {
                let l = &e.layout;
                let _ = writeln!(
                    o,
                    "{:>6} {:>8} {:<24} {:>12.0} {:>12} {:>14.0} {:>8}",
                    p.nodes,
                    p.devices,
                    format!("tp{} pp{} dp{} z{}", l.tp, l.pp, l.dp, l.zero as u8),
                    e.tokens_per_s,
                    fmt_time(e.time_to_train_s),
                    e.cost + e.energy_cost,
                    if p.meets_deadline { "ok" } else { "missed" }
                );
            }
            None => {
                let _ = writeln!(o, "{:>6} {:>8} {:<24}", p.nodes, p.devices, "nothing fits");
            }
        }
    }
    if let Some(c) = cheapest(points) {
        let _ = writeln!(o, "cheapest meeting the deadline: {} nodes", c.nodes);
    }
    o
}
