//! Unit tests of the cost model and the selector.

use super::*;

fn topo(size: usize, hosts: usize, tcp: LinkParams) -> Topology {
    let mut links = BTreeMap::new();
    links.insert("tcp".to_string(), tcp);
    links.insert("shm".to_string(), DEFAULT_SHM);
    Topology {
        size,
        hosts,
        ranks_per_host: Some(size / hosts),
        intra: LinkKind::Shm,
        links,
        gamma: 0.0,
        cores: 64,
        direct_read: None,
        round: 0.0,
        concurrent: None,
        per_byte: BTreeMap::new(),
        latency: BTreeMap::new(),
        burst: BTreeMap::new(),
    }
}

/// 004 eq. 28.14 (TV-C1): p = 8, m = 256 MiB, α = 5 µs, β = 25 GiB/s → 0.01757 s.
#[test]
fn ring_matches_eq_28_14() {
    let t = topo(
        8,
        8,
        LinkParams {
            alpha: 5e-6,
            beta: 25.0 * (1u64 << 30) as f64,
        },
    );
    let s = predict(OpKind::AllReduce, Algo::Ring, 256 << 20, &t).unwrap();
    assert!((s - 0.01757).abs() < 1e-5, "{s}");
}

/// 000 E62-style: 70B BF16 gradients (140 GB) on 64 GPUs at 50 GB/s with α = 1.5 µs:
/// 2·63/64·140e9/50e9 + 2·63·1.5e-6 = 5.5127 s (the text's 5,512.7 ms).
#[test]
fn ring_matches_70b_example() {
    let t = topo(
        64,
        64,
        LinkParams {
            alpha: 1.5e-6,
            beta: 50e9,
        },
    );
    let s = predict(OpKind::AllReduce, Algo::Ring, 140_000_000_000, &t).unwrap();
    assert!((s - 5.5127).abs() < 1e-3, "{s}");
}

#[test]
fn small_messages_pick_log_steps_large_pick_ring() {
    let t = topo(8, 1, DEFAULT_TCP);
    let small = select(OpKind::AllReduce, 64, &t, None);
    assert!(
        matches!(
            small.algo,
            Algo::HalvingDoubling | Algo::Tree | Algo::Direct
        ),
        "{small}"
    );
    let large = select(OpKind::AllReduce, 256 << 20, &t, None);
    assert!(
        matches!(large.algo, Algo::Ring | Algo::HalvingDoubling),
        "{large}"
    );
}

#[test]
fn hierarchical_wins_on_slow_inter_host_link() {
    let t = topo(
        4,
        2,
        LinkParams {
            alpha: 50e-6,
            beta: 125e6,
        },
    );
    let s = select(OpKind::AllReduce, 64 << 20, &t, None);
    assert_eq!(s.algo, Algo::Hierarchical, "{s}");
}

/// 2 hosts x 2 ranks on a 125 MB/s link; one core per host.
fn shaped(latency: Option<f64>, burst: Option<f64>) -> Topology {
    let mut t = topo(
        4,
        2,
        LinkParams {
            alpha: 7e-6,
            beta: 125e6,
        },
    );
    t.cores = 1;
    if let Some(l) = latency {
        t.latency
            .insert(probe_key(OpKind::AllReduce, Algo::Ring), l);
    }
    if let Some(b) = burst {
        t.burst.insert("tcp".into(), b);
    }
    t
}

#[test]
fn a_wire_bound_link_is_not_slowed_by_core_sharing() {
    // Two ranks per core would halve a CPU-bound rate; the 125 MB/s wire is far below the
    // host's copy rate (shared memory, 6 GB/s), so it stays the limit.
    let t = shaped(None, None);
    assert_eq!(t.oversubscription(), 2.0);
    assert_eq!(t.shared_rate(125e6), 125e6);
    // On one host every byte is the CPU's.
    let one = topo(4, 1, DEFAULT_TCP);
    let mut one = one;
    one.cores = 1;
    assert_eq!(one.shared_rate(1e9), 0.25e9);
}

#[test]
fn a_measured_latency_replaces_the_formulas_latency_part() {
    let (op, ring) = (OpKind::AllReduce, Algo::Ring);
    let t = shaped(Some(80e-6), None);
    let n = 1 << 20;
    let bw = |x| formula(op, ring, x, &t).unwrap() - formula(op, ring, 0, &t).unwrap();
    let p = predict(op, ring, n, &t).unwrap();
    let want = 80e-6 + bw(n) - bw(LATENCY_PROBE_BYTES);
    assert!((p - want).abs() < 1e-12, "{p} vs {want}");
    // Algorithms that were not probed keep their formula.
    let tree = predict(op, Algo::Tree, n, &t).unwrap();
    assert_eq!(tree, formula(op, Algo::Tree, n, &t).unwrap());
}

#[test]
fn a_bursting_link_prices_small_ops_at_latency_and_large_ones_at_the_sustained_rate() {
    let (op, ring) = (OpKind::AllReduce, Algo::Ring);
    let t = shaped(Some(80e-6), Some(2e9));
    // 4 KiB: the ring's 6 KiB per host cross at 2 GB/s inside the burst, so the op costs its
    // measured latency plus about 2 us, not the 49 us of 6 KiB at 125 MB/s.
    let small = predict(op, ring, 4096, &t).unwrap();
    assert!((80e-6..84e-6).contains(&small), "{small}");
    // 64 KiB back to back: 96 KiB per host per op cannot average more than 125 MB/s.
    let large = predict(op, ring, 64 << 10, &t).unwrap();
    let wire = 1.5 * 65536.0 / 125e6;
    assert!((large - wire).abs() / wire < 0.02, "{large} vs {wire}");
    // Without the burst the same op is additive: the latency plus the bytes beyond the
    // probe's at 125 MB/s.
    let plain = predict(op, ring, 64 << 10, &shaped(Some(80e-6), None)).unwrap();
    let want = 80e-6 + wire - 1.5 * LATENCY_PROBE_BYTES as f64 / 125e6;
    assert!((plain - want).abs() < 1e-9, "{plain} vs {want}");
}

#[test]
fn a_measured_latency_refines_the_prediction_but_not_the_choice() {
    let (op, n) = (OpKind::AllReduce, 4096);
    let before = select(op, n, &shaped(None, None), None);
    // The ring measured far below every other algorithm: its prediction follows, the
    // choice stays the formulas' (a timing that moves between runs must not move the bits).
    let t = shaped(Some(1e-6), None);
    let after = select(op, n, &t, None);
    assert_eq!(after.algo, before.algo, "{after}");
    let ring = after
        .candidates
        .iter()
        .find(|c| c.algo == Algo::Ring)
        .unwrap();
    assert_eq!(ring.predicted_s, predict(op, Algo::Ring, n, &t).unwrap());
    assert!(ring.predicted_s < ring.ranked_s, "{ring:?}");
}

#[test]
fn forced_algorithm_is_kept_and_reported() {
    let t = topo(4, 1, DEFAULT_TCP);
    let s = select(OpKind::AllReduce, 1024, &t, Some(Algo::Tree));
    assert_eq!((s.algo, s.source), (Algo::Tree, "forced"));
    assert!(s.predicted_s.is_some());
}

/// The pipelined hierarchical all-reduce (single-copy reads within hosts, at least two
/// segments) runs its intra-host and inter-host phases at once, so it costs about the slower
/// phase; the unpipelined one (rings within hosts) costs their sum.
#[test]
fn the_pipelined_hierarchical_all_reduce_costs_its_slower_phase() {
    let mut t = topo(
        4,
        2,
        LinkParams {
            alpha: 7e-6,
            beta: 1.25e9,
        },
    );
    t.cores = 1;
    t.direct_read = Some(5e9);
    let (op, hier) = (OpKind::AllReduce, Algo::Hierarchical);
    let n = 64 << 20;
    // Each host's egress carries n bytes; within a host, one core reads (g-1)/g n twice for
    // each of its two ranks: 26.8 ms, hidden behind the 53.7 ms on the wire.
    let wire = n as f64 / 1.25e9;
    let piped = predict(op, hier, n, &t).unwrap();
    assert!(piped > wire && piped < 1.05 * wire, "{piped} vs {wire}");
    // Below two segments the phases run one after the other.
    let small = 2 * crate::algo::hier_pipeline::SEGMENT_BYTES - 4;
    let intra = 2.0 * 0.5 * small as f64 * 2.0 / 5e9;
    let unpiped = predict(op, hier, small, &t).unwrap();
    assert!(unpiped > intra + small as f64 / 1.25e9, "{unpiped}");
    t.direct_read = None;
    let serial = predict(op, hier, n, &t).unwrap();
    assert!(serial > piped + 0.01, "{serial} vs {piped}");
}

/// `select` explains exactly the choice `choose` makes for an op, ties included (both take the
/// first of equals in `Algo::ALL` order).
#[test]
fn select_explains_the_choice_that_choose_makes() {
    let mut tied = topo(4, 1, DEFAULT_TCP);
    tied.latency
        .insert(probe_key(OpKind::AllReduce, Algo::Ring), 1e-3);
    let layouts = [
        topo(8, 1, DEFAULT_TCP),
        topo(
            4,
            2,
            LinkParams {
                alpha: 50e-6,
                beta: 125e6,
            },
        ),
        shaped(Some(80e-6), Some(2e9)),
        tied,
        topo(1, 1, DEFAULT_TCP),
    ];
    for t in &layouts {
        for op in [
            OpKind::AllReduce,
            OpKind::AllGather,
            OpKind::Broadcast,
            OpKind::AllToAll,
        ] {
            for bytes in [0, 8, 4096, 1 << 20, 64 << 20] {
                let s = select(op, bytes, t, None);
                assert_eq!(s.algo, choose(op, bytes, t, None), "{s}");
                assert_eq!(s.source, "model");
            }
        }
    }
}
