//! Each formula against a worked value: the seeds' examples where they state one (000 =
//! 000_7a796c6865dceb08.txt, 004 = 004_fff1170a72f11f87.txt), else small numbers worked by hand.

use super::*;

fn c(alpha: f64, beta: f64, gamma: f64, n: f64, p: u64) -> Call {
    Call {
        alpha,
        beta,
        gamma,
        n,
        p,
    }
}

const US: f64 = 1e-6;
const GB: f64 = 1e9;
const KIB: f64 = 1024.0;
const MIB: f64 = 1_048_576.0;
const GIB: f64 = 1_073_741_824.0;
const EXACT: RingFactor = RingFactor::Exact;

fn close(got: f64, want: f64, rel: f64) {
    assert!(
        (got - want).abs() <= rel * want.abs().max(1e-300),
        "got {got}, want {want} (rel {rel})"
    );
}

/// 004 eq. 28.14 (TV-C1): p = 8, m = 256 MiB, α = 5 µs, β = 25 GiB/s → 0.01757 s; at m = 0 the
/// 14α = 70 µs of line 198, at 8 KiB 70.534 µs.
#[test]
fn ring_all_reduce_matches_eq_28_14() {
    let (a, b) = (5.0 * US, 25.0 * GIB);
    close(
        c(a, b, 0.0, 256.0 * MIB, 8).ring_all_reduce(EXACT),
        0.01757,
        1e-9,
    );
    close(
        c(a, b, 0.0, 0.0, 8).ring_all_reduce(EXACT),
        70.0 * US,
        1e-12,
    );
    close(
        c(a, b, 0.0, 8.0 * KIB, 8).ring_all_reduce(EXACT),
        70.534 * US,
        1e-4,
    );
    // The reduction term: 7/8 of the buffer reduced once.
    let with_gamma = c(a, b, 1e-10, 256.0 * MIB, 8).ring_all_reduce(EXACT);
    close(with_gamma - 0.01757, 0.875 * 256.0 * MIB * 1e-10, 1e-9);
}

/// 004 exercise 28.6: p = 8 vs 64 → 14α + 1.75 m/β vs 126α + 1.96875 m/β.
#[test]
fn ring_all_reduce_scales_as_exercise_28_6() {
    assert_eq!(
        c(1.0, f64::INFINITY, 0.0, 1.0, 8).ring_all_reduce(EXACT),
        14.0
    );
    assert_eq!(
        c(1.0, f64::INFINITY, 0.0, 1.0, 64).ring_all_reduce(EXACT),
        126.0
    );
    assert_eq!(c(0.0, 1.0, 0.0, 1.0, 8).ring_all_reduce(EXACT), 1.75);
    assert_eq!(c(0.0, 1.0, 0.0, 1.0, 64).ring_all_reduce(EXACT), 1.96875);
}

/// 000 L2985 (E59): 140 GB on 64 GPUs, β = 50 GB/s, α = 1.5 µs → 5,512.69 ms; 000 L2957 (E57):
/// 1,000 GPUs with the seed's approximate factor 2 × 140/50 = 5.6 s, exact 5.5944 s.
#[test]
fn ring_all_reduce_matches_000_e57_and_e59() {
    close(
        c(1.5 * US, 50.0 * GB, 0.0, 140.0 * GB, 64).ring_all_reduce(EXACT),
        5.512689,
        1e-6,
    );
    let approx = c(0.0, 50.0 * GB, 0.0, 140.0 * GB, 1000).ring_all_reduce(RingFactor::Approx);
    close(approx, 5.6, 1e-12);
    close(
        c(0.0, 50.0 * GB, 0.0, 140.0 * GB, 1000).ring_all_reduce(EXACT),
        5.5944,
        1e-9,
    );
}

/// Reduce-scatter and all-gather are each half the ring all-reduce's steps and bytes (000 F59);
/// the pairwise all-to-all has the all-gather's (000 E68: 8 GPUs, 262,144 B per peer, 3 µs,
/// 50 GB/s → 7 messages of 8.24 µs).
#[test]
fn ring_phases_and_all_to_all() {
    let (a, b, n) = (5.0 * US, 25.0 * GIB, 256.0 * MIB);
    close(
        2.0 * c(a, b, 0.0, n, 8).ring_reduce_scatter(EXACT),
        c(a, b, 0.0, n, 8).ring_all_reduce(EXACT),
        1e-15,
    );
    assert_eq!(
        c(a, b, 0.0, n, 8).ring_all_gather(EXACT),
        c(a, b, 0.0, n, 8).ring_reduce_scatter(EXACT)
    );
    close(
        c(1.0, 1.0, 0.5, 8.0, 4).ring_reduce_scatter(EXACT),
        3.0 + 6.0 + 3.0,
        1e-15,
    );
    let per_peer = 64.0 * 4096.0;
    let a2a = c(3.0 * US, 50.0 * GB, 0.0, 8.0 * per_peer, 8).pairwise_all_to_all(EXACT);
    close(a2a, 7.0 * message(3.0 * US, 50.0 * GB, per_peer), 1e-12);
    close(message(3.0 * US, 50.0 * GB, per_peer), 8.24288 * US, 1e-5);
}

/// 004 eq. 28.13 with the eq. 28.14 parameters: the tree is 0.06003 s at 256 MiB and 31.83 µs
/// at 8 KiB; halving-doubling (textbook) 30.534 µs at 8 KiB.
#[test]
fn tree_and_halving_doubling_match_eq_28_13() {
    let (a, b) = (5.0 * US, 25.0 * GIB);
    close(
        c(a, b, 0.0, 256.0 * MIB, 8).tree_all_reduce(),
        0.06003,
        1e-9,
    );
    close(
        c(a, b, 0.0, 8.0 * KIB, 8).tree_all_reduce(),
        31.83 * US,
        1e-3,
    );
    let hd = c(a, b, 0.0, 8.0 * KIB, 8).halving_doubling_all_reduce(HalvingDoubling::TEXTBOOK);
    close(hd, 30.534 * US, 1e-4);
    // Tree halves: 3 rounds of (α + n/β [+ n·γ]) each; the all-reduce reduces once per round.
    assert_eq!(c(1.0, 1.0, 0.0, 2.0, 8).tree_broadcast(), 9.0);
    assert_eq!(c(1.0, 1.0, 0.5, 2.0, 8).tree_reduce(), 12.0);
    assert_eq!(c(1.0, 1.0, 0.5, 2.0, 8).tree_all_reduce(), 18.0 + 3.0);
}

/// Halving-doubling as the runtime prices it: a power of two pays only the store-and-forward
/// factor; p = 6 folds (2⌈lg 6⌉ - 1 = 5 steps, plus 2α + (n + n/p)/β + n·γ).
#[test]
fn halving_doubling_store_and_forward_and_fold() {
    let run = HalvingDoubling {
        store_and_forward: 1.25,
        fold: true,
    };
    // p = 8, α = 1, β = 1, n = 8: 6 + 1.25·2·7 = 23.5 (textbook 6 + 14 = 20).
    assert_eq!(
        c(1.0, 1.0, 0.0, 8.0, 8).halving_doubling_all_reduce(run),
        23.5
    );
    assert_eq!(
        c(1.0, 1.0, 0.0, 8.0, 8).halving_doubling_all_reduce(HalvingDoubling::TEXTBOOK),
        20.0
    );
    // p = 6, n = 6: 5 + 1.25·2·5 + (2 + 6 + 1) = 26.5; textbook 6 + 10 = 16.
    close(
        c(1.0, 1.0, 0.0, 6.0, 6).halving_doubling_all_reduce(run),
        26.5,
        1e-15,
    );
    close(
        c(1.0, 1.0, 0.0, 6.0, 6).halving_doubling_all_reduce(HalvingDoubling::TEXTBOOK),
        16.0,
        1e-15,
    );
    // Reduce-scatter, p = 6, γ = 0.5: 3 + 1.25·5 + 2.5 + (2 + 6 + 1 + 3) = 23.75.
    close(
        c(1.0, 1.0, 0.5, 6.0, 6).halving_doubling_reduce_scatter(run),
        23.75,
        1e-15,
    );
    // The (Bruck) all-gather never folds: 3 + 1.25·5 = 9.25.
    close(
        c(1.0, 1.0, 0.0, 6.0, 6).halving_doubling_all_gather(run),
        9.25,
        1e-15,
    );
}

/// Direct algorithms, p = 4, α = 1, β = 1, n = 2, γ = 0.5.
#[test]
fn direct_formulas() {
    assert_eq!(
        c(1.0, 1.0, 0.5, 2.0, 4).direct_all_reduce(),
        1.0 + 6.0 + 3.0
    );
    assert_eq!(
        c(1.0, 1.0, 0.5, 2.0, 4).direct_reduce_scatter(),
        1.0 + 1.5 + 0.75
    );
    assert_eq!(c(1.0, 1.0, 0.0, 2.0, 4).direct_all_gather(), 2.5);
    assert_eq!(c(1.0, 1.0, 0.0, 0.0, 5).dissemination_barrier(), 3.0);
    assert_eq!(c(1.0, 1.0, 0.0, 0.0, 8).dissemination_barrier(), 3.0);
}

/// Pipelined schedules: the chain broadcast of 4 MiB in 1 MiB segments over 4 ranks takes
/// 4 + 4 - 2 = 6 segment steps; the double tree of 1 MiB in 256 KiB segments per half over
/// 8 ranks takes 2 + 6 - 1 = 7 rounds of α + n/β + 0.75·n·γ.
#[test]
fn pipelined_broadcast_and_double_tree() {
    let (a, b) = (10.0 * US, 1.0 * GB);
    close(
        c(a, b, 0.0, 4.0 * MIB, 4).ring_broadcast(MIB),
        6.0 * message(a, b, MIB),
        1e-15,
    );
    // A buffer smaller than a segment is one segment.
    close(
        c(a, b, 0.0, 1000.0, 4).ring_broadcast(MIB),
        3.0 * message(a, b, 1000.0),
        1e-15,
    );
    let n = MIB;
    let want = 7.0 * (a + n / b + 0.75 * n * 1e-10);
    close(
        c(a, b, 1e-10, n, 8).double_tree_all_reduce(256.0 * KIB),
        want,
        1e-12,
    );
}

/// Single-copy reads, p = 4, α = 1, β_r = 2, one rank per core, n = 4.
#[test]
fn direct_read_formulas() {
    assert_eq!(
        c(1.0, 2.0, 0.0, 4.0, 4).direct_read_all_reduce(1.0),
        6.0 + 3.0
    );
    assert_eq!(
        c(1.0, 2.0, 0.0, 4.0, 4).direct_read_reduce_scatter(1.0),
        3.0 + 1.5 + 0.5
    );
    assert_eq!(
        c(1.0, 2.0, 0.0, 4.0, 4).direct_read_all_gather(1.0),
        3.0 + 1.5
    );
    assert_eq!(
        c(1.0, 2.0, 0.0, 4.0, 4).direct_read_broadcast(1.0),
        3.0 + 2.0
    );
    // Two ranks per core double the copies, not the latency.
    assert_eq!(
        c(1.0, 2.0, 0.0, 4.0, 4).direct_read_all_gather(2.0),
        3.0 + 3.0
    );
}

/// 000 L3159-3167 (E65): 140 GB, 16 nodes × 8, NVLink 450 GB/s (α 0), IB 50 GB/s per device
/// (α 5 µs) → 1,200.84 ms; 000 L1687-1721 (E9): 3 GB on 128 × 8, NVLink 300, HDR 25 GB/s,
/// α 0.5 / 5 µs → 48.54 ms.
#[test]
fn hierarchical_matches_000_e65_and_e9() {
    let hier = |(ai, bi): (f64, f64), (ao, bo): (f64, f64), m: f64, nodes: u64| {
        let intra = c(ai, bi, 0.0, m, 8).hierarchical_ring_phase(1.0, EXACT);
        let inter = c(ao, bo, 0.0, m, nodes).hierarchical_inter_phase(8, Egress::PerDevice, EXACT);
        hierarchical_all_reduce(intra, inter, None)
    };
    let e65 = hier((0.0, 450.0 * GB), (5.0 * US, 50.0 * GB), 140.0 * GB, 16);
    close(e65, 1.20084, 1e-5);
    let e9 = hier((0.5 * US, 300.0 * GB), (5.0 * US, 25.0 * GB), 3.0 * GB, 128);
    close(e9, 0.04854, 1e-3);
}

/// A host link shared by its g ranks carries g times a per-device port's bytes; the reduction of
/// the inter-host phase is the shard's either way.
#[test]
fn hierarchical_egress_and_phases() {
    let across = c(1.0, 1.0, 0.5, 12.0, 3);
    let host = across.hierarchical_inter_phase(4, Egress::PerHost, EXACT);
    let dev = across.hierarchical_inter_phase(4, Egress::PerDevice, EXACT);
    // latency 2·2·1; bandwidth 2·(2/3)·12 + (2/3)·3·0.5 = 16 + 1, per device 2·(2/3)·3 + 1 = 5.
    assert_eq!(host.latency, 4.0);
    close(host.bandwidth, 17.0, 1e-15);
    close(dev.bandwidth, 5.0, 1e-15);
    // Intra by rings, g = 4, two ranks per core: 6α; 2·(2·(3/4)·4 + (3/4)·4·0.5) = 15.
    let ring = c(1.0, 1.0, 0.5, 4.0, 4).hierarchical_ring_phase(2.0, EXACT);
    assert_eq!((ring.latency, ring.bandwidth), (6.0, 15.0));
    // By single-copy reads at β_r = 2: (2 + 2·2)α; 2·(3/4)·4·(2/2 + 0.5) = 9.
    let read = c(1.0, 2.0, 0.5, 4.0, 4).hierarchical_direct_read_phase(2.0);
    assert_eq!((read.latency, read.bandwidth), (6.0, 9.0));
    // One rank per host, or one host: that phase is free.
    let alone = c(1.0, 1.0, 0.5, 4.0, 1);
    assert_eq!(alone.hierarchical_ring_phase(1.0, EXACT), Phase::default());
    assert_eq!(alone.hierarchical_direct_read_phase(1.0), Phase::default());
    assert_eq!(
        alone.hierarchical_inter_phase(4, Egress::PerHost, EXACT),
        Phase::default()
    );
}

/// Serial phases add; pipelined over k segments the slower phase dominates, plus the exposed
/// first reduce-scatter and last all-gather segment: intra (1, 10), inter (2, 40), k = 4 →
/// max(14, 48) + 1 + 2.5 = 51.5 against 53 serial.
#[test]
fn pipelined_hierarchical_costs_its_slower_phase() {
    let intra = Phase {
        latency: 1.0,
        bandwidth: 10.0,
    };
    let inter = Phase {
        latency: 2.0,
        bandwidth: 40.0,
    };
    assert_eq!(hierarchical_all_reduce(intra, inter, None), 53.0);
    assert_eq!(hierarchical_all_reduce(intra, inter, Some(4.0)), 51.5);
}

/// Every formula is 0 for a group of one (and of none).
#[test]
fn a_group_of_one_costs_nothing() {
    let hd = HalvingDoubling {
        store_and_forward: 1.25,
        fold: true,
    };
    for p in [0, 1] {
        let one = c(1.0, 1.0, 1.0, 8.0, p);
        let all = [
            one.ring_all_reduce(EXACT),
            one.ring_reduce_scatter(RingFactor::Approx),
            one.ring_all_gather(EXACT),
            one.ring_broadcast(1.0),
            one.pairwise_all_to_all(EXACT),
            one.tree_reduce(),
            one.tree_broadcast(),
            one.tree_all_reduce(),
            one.double_tree_all_reduce(1.0),
            one.halving_doubling_reduce_scatter(hd),
            one.halving_doubling_all_gather(hd),
            one.halving_doubling_all_reduce(hd),
            one.direct_all_reduce(),
            one.direct_reduce_scatter(),
            one.direct_all_gather(),
            one.dissemination_barrier(),
            one.direct_read_all_reduce(1.0),
            one.direct_read_reduce_scatter(1.0),
            one.direct_read_all_gather(1.0),
            one.direct_read_broadcast(1.0),
        ];
        assert!(all.iter().all(|&t| t == 0.0), "p = {p}: {all:?}");
    }
    assert_eq!(RingFactor::Approx.per_phase(1), 0.0);
    assert_eq!(log2_ceil(0), 0.0);
}
