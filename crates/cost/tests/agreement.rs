//! The runtime selector (`comm::model`) and the planner (`plan::collectives`) price through the
//! same formulas: where they price the same thing they agree to the bit, and where they differ
//! by design (the selector's store-and-forward factor, its shared host link) the difference is
//! exactly that parameter's.

use comm::OpKind;
use comm::algo::Algo;
use comm::group::{GroupConfig, calibrate};
use comm::model::{DEFAULT_SHM, LinkParams, STORE_AND_FORWARD, Topology, formula};
use plan::collectives as pc;
use plan::hardware::Link;
use plan::units::RingFactor;
use std::collections::BTreeMap;

/// `hosts` hosts of `size / hosts` ranks, a core for every rank, no reduction cost, no measured
/// round: the selector's formulas with nothing but α and β, as the planner's.
fn topology(size: usize, hosts: usize, tcp: LinkParams) -> Topology {
    let host_of: Vec<usize> = (0..size).map(|r| r * hosts / size).collect();
    let mut t = calibrate::topology(&host_of, size, false, &GroupConfig::default());
    t.links = BTreeMap::from([("tcp".to_string(), tcp), ("shm".to_string(), DEFAULT_SHM)]);
    t.gamma = 0.0;
    t.cores = 64;
    t
}

const SIZES: [f64; 5] = [0.0, 8.0, 4096.0, 1_048_576.0, 268_435_456.0];

/// The planner's function for each (op, algorithm) the selector prices the same way.
type Planned = fn(&Link, f64, u64) -> f64;
const SAME: [(OpKind, Algo, Planned); 5] = [
    (OpKind::AllReduce, Algo::Ring, |l, n, p| {
        pc::ring_all_reduce(l, n, p, RingFactor::Exact)
    }),
    (OpKind::ReduceScatter, Algo::Ring, |l, n, p| {
        pc::reduce_scatter(l, n, p, RingFactor::Exact)
    }),
    (OpKind::AllGather, Algo::Ring, |l, n, p| {
        pc::all_gather(l, n, p, RingFactor::Exact)
    }),
    (OpKind::AllToAll, Algo::Pairwise, |l, n, p| {
        pc::all_to_all(l, n, p, RingFactor::Exact)
    }),
    (OpKind::AllReduce, Algo::Tree, pc::tree_all_reduce),
];

/// One rank per host over the eq. 28.14 link (α = 5 µs, β = 25 GiB/s) and a slow one: ring
/// all-reduce, reduce-scatter, all-gather, pairwise all-to-all and tree all-reduce agree bit for
/// bit, for every group size and buffer.
#[test]
fn selector_and_planner_agree_on_flat_collectives() {
    let links = [(5e-6, 25.0 * (1u64 << 30) as f64), (50e-6, 125e6)];
    for (alpha, beta) in links {
        let l = Link { alpha, beta };
        for p in [2usize, 3, 4, 6, 8, 64] {
            let t = topology(p, p, LinkParams { alpha, beta });
            for &n in &SIZES {
                for (op, algo, planned) in SAME {
                    let selector = formula(op, algo, n as usize, &t);
                    let planner = planned(&l, n, p as u64);
                    assert_eq!(selector, Some(planner), "{op:?} {algo:?} p {p} n {n}");
                }
            }
        }
    }
}

/// Halving-doubling on a power of two: the selector's price is the planner's textbook one plus
/// the store-and-forward share of the bandwidth term, (s - 1)·2(p-1)/p·n/β.
#[test]
fn halving_doubling_differs_by_store_and_forward_only() {
    let l = Link {
        alpha: 5e-6,
        beta: 25.0 * (1u64 << 30) as f64,
    };
    for p in [2usize, 4, 8, 64] {
        let t = topology(
            p,
            p,
            LinkParams {
                alpha: l.alpha,
                beta: l.beta,
            },
        );
        for &n in &SIZES {
            let runtime =
                formula(OpKind::AllReduce, Algo::HalvingDoubling, n as usize, &t).unwrap();
            let textbook = pc::halving_doubling_all_reduce(&l, n, p as u64);
            let frac = (p - 1) as f64 / p as f64;
            let extra = (STORE_AND_FORWARD - 1.0) * 2.0 * frac * n / l.beta;
            assert!(
                (runtime - textbook - extra).abs() <= 1e-12 * runtime,
                "p {p} n {n}: {runtime} vs {textbook} + {extra}"
            );
        }
    }
}

/// Hierarchical all-reduce, g ranks on each of h hosts, rings inside hosts: the selector's host
/// link of β carries the g shards that the planner sends over g ports of β/g each, so the two
/// agree (to rounding) once the planner's per-device β is the host link's share.
#[test]
fn hierarchical_agrees_once_the_host_link_is_shared() {
    let tcp = LinkParams {
        alpha: 7e-6,
        beta: 1.25e9,
    };
    for (g, h) in [(2usize, 2usize), (4, 2), (2, 8), (8, 16)] {
        let t = topology(g * h, h, tcp);
        let intra = Link {
            alpha: DEFAULT_SHM.alpha,
            beta: DEFAULT_SHM.beta,
        };
        let inter = Link {
            alpha: tcp.alpha,
            beta: tcp.beta / g as f64,
        };
        for &n in &SIZES {
            let runtime = formula(OpKind::AllReduce, Algo::Hierarchical, n as usize, &t).unwrap();
            let planned = pc::hierarchical_all_reduce(
                &intra,
                &inter,
                n,
                g as u64,
                h as u64,
                RingFactor::Exact,
            );
            assert!(
                (runtime - planned).abs() <= 1e-12 * runtime,
                "g {g} h {h} n {n}: {runtime} vs {planned}"
            );
        }
    }
}
