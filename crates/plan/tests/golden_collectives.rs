//! Golden tests: alpha-beta collective costs. Each test names the seed file and line (000 =
//! 000_7a796c6865dceb08.txt, 004 = 004_fff1170a72f11f87.txt) and states the unit convention.

use plan::collectives::*;
use plan::hardware::Link;
use plan::units::*;

fn close(got: f64, want: f64, rel: f64) {
    assert!(
        (got - want).abs() <= rel * want.abs().max(1e-300),
        "got {got}, want {want} (rel {rel})"
    );
}

fn link(alpha: f64, beta: f64) -> Link {
    Link { alpha, beta }
}

/// 004 eq. 28.14 (lines 194-196): p = 8, m = 256 MiB, α = 5 µs, β = 25 GiB/s (binary units,
/// unidirectional, effective). t_ring = 14·(5 µs + 1.25 ms) = 0.01757 s.
#[test]
fn seed004_eq28_14_ring_allreduce() {
    let l = link(5.0 * US, 25.0 * GIB);
    close(
        ring_all_reduce(&l, 256.0 * MIB, 8, RingFactor::Exact),
        0.01757,
        1e-3,
    );
    // Per-round transfer of m/p = 32 MiB is 0.00125 s.
    close(32.0 * MIB / l.beta, 0.00125, 1e-9);
}

/// 004 line 198 (TV-C2, TV-C3): the startup share is 14α = 70 µs; at m = 8 KiB the transfer term
/// is 0.534 µs and the total 70.534 µs.
#[test]
fn seed004_line198_small_message_latency_dominates() {
    let l = link(5.0 * US, 25.0 * GIB);
    close(
        ring_all_reduce(&l, 0.0, 8, RingFactor::Exact),
        70.0 * US,
        1e-12,
    );
    close(
        ring_all_reduce(&l, 8.0 * KIB, 8, RingFactor::Exact),
        70.534 * US,
        1e-4,
    );
}

/// 004 notes §4.6 (derived from eq. 28.13, not stated in the seed): tree with the eq. 28.14
/// parameters is 0.06003 s at 256 MiB (slower than ring) and 31.83 µs at 8 KiB (faster).
#[test]
fn seed004_eq28_13_tree_vs_ring() {
    let l = link(5.0 * US, 25.0 * GIB);
    close(tree_all_reduce(&l, 256.0 * MIB, 8), 0.06003, 1e-3);
    close(tree_all_reduce(&l, 8.0 * KIB, 8), 31.83 * US, 1e-3);
    assert!(
        tree_all_reduce(&l, 8.0 * KIB, 8) < ring_all_reduce(&l, 8.0 * KIB, 8, RingFactor::Exact)
    );
    // Halving-doubling (log-depth latency, ring bandwidth) beats both at 8 KiB: 30.53 µs.
    let (algo, t) = best_all_reduce(&l, 8.0 * KIB, 8, RingFactor::Exact);
    assert_eq!(algo, AllReduceAlgo::HalvingDoubling);
    close(t, 30.534 * US, 1e-4);
    assert_ne!(
        best_all_reduce(&l, 256.0 * MIB, 8, RingFactor::Exact).0,
        AllReduceAlgo::Tree
    );
}

/// 004 exercise 28.6 (line 468): p = 8 vs 64 → 14α + 1.75 m/β vs 126α + 1.96875 m/β; startup ×9.
#[test]
fn seed004_ex28_6_ring_scaling_in_p() {
    let lat = link(1.0, f64::INFINITY);
    assert_eq!(ring_all_reduce(&lat, 1.0, 8, RingFactor::Exact), 14.0);
    assert_eq!(ring_all_reduce(&lat, 1.0, 64, RingFactor::Exact), 126.0);
    let bw = link(0.0, 1.0);
    assert_eq!(ring_all_reduce(&bw, 1.0, 8, RingFactor::Exact), 1.75);
    assert_eq!(ring_all_reduce(&bw, 1.0, 64, RingFactor::Exact), 1.96875);
}

/// 000 L2985-3007 (E59): 70B BF16 gradients 140 GB (decimal), N = 64, β = 50 GB/s, α = 1.5 µs:
/// 5,512.5 ms bandwidth + 0.189 ms latency = 5,512.69 ms; at 60% of β, 9.19 s (L3017).
#[test]
fn seed000_l2985_ring_70b_64gpus() {
    let l = link(1.5 * US, 50.0 * GB);
    close(
        ring_all_reduce(&l, 140.0 * GB, 64, RingFactor::Exact),
        5.512689,
        1e-6,
    );
    let slow = link(1.5 * US, 0.6 * 50.0 * GB);
    close(
        ring_all_reduce(&slow, 140.0 * GB, 64, RingFactor::Exact),
        9.1877,
        1e-3,
    );
}

/// 000 L2957 (E57): 70B, 1,000 GPUs at 50 GB/s: the seed's "≈2 × 140/50 = 5.6 s" uses the
/// approximate ring factor; the exact factor gives 5.594 s (bandwidth term only, α = 0).
#[test]
fn seed000_l2957_ring_factor_convention() {
    let l = link(0.0, 50.0 * GB);
    close(
        ring_all_reduce(&l, 140.0 * GB, 1000, RingFactor::Approx),
        5.6,
        1e-12,
    );
    close(
        ring_all_reduce(&l, 140.0 * GB, 1000, RingFactor::Exact),
        5.5944,
        1e-9,
    );
}

/// 000 L1687-1721 (E9): 3 GB all-reduce on 128 nodes × 8 GPUs, HDR 25 GB/s per port, NVLink
/// 300 GB/s taken per direction. Flat bound (bandwidth only) 239.77 ms; hierarchical 48.54 ms
/// with the unstated α_inter = 5 µs, α_intra = 0.5 µs that the seed's number needs.
#[test]
fn seed000_l1697_flat_vs_hierarchical_3gb() {
    let inter0 = link(0.0, 25.0 * GB);
    close(
        ring_all_reduce(&inter0, 3.0 * GB, 1024, RingFactor::Exact),
        0.23977,
        1e-4,
    );
    let intra = link(0.5 * US, 300.0 * GB);
    let inter = link(5.0 * US, 25.0 * GB);
    close(
        hierarchical_all_reduce(&intra, &inter, 3.0 * GB, 8, 128, RingFactor::Exact),
        0.04854,
        1e-3,
    );
    // "observed 100 ms is 51.5 ms above the hierarchical ideal"
    close(0.100 - 0.04854, 0.0515, 1e-3);
}

/// 000 L3159-3167 (E65): Llama 70B, 140 GB, 16 nodes × 8; NVLink 450 GB/s, IB 50 GB/s.
/// Flat ring ≈ 5,557 ms (α = 2 µs → 5,556.76 ms); hierarchical ≈ 1,200.8 ms (α_inter = 5 µs,
/// α_intra = 0 reproduces 1,200.84 ms).
#[test]
fn seed000_l3163_hierarchical_70b_128gpus() {
    let flat = link(2.0 * US, 50.0 * GB);
    close(
        ring_all_reduce(&flat, 140.0 * GB, 128, RingFactor::Exact),
        5.557,
        2e-4,
    );
    let intra = link(0.0, 450.0 * GB);
    let inter = link(5.0 * US, 50.0 * GB);
    close(
        hierarchical_all_reduce(&intra, &inter, 140.0 * GB, 8, 16, RingFactor::Exact),
        1.20084,
        1e-5,
    );
}

/// 000 L1809 (E12): 5.2 GB gradients at 450 GB/s NVLink. The seed states 11.7 ms but its own
/// arithmetic (no ring factor, α = 0) is 11.56 ms — we use 11.56 ms; the exact ring all-reduce
/// over 8 GPUs would be 2·7/8·5.2/450 = 20.2 ms.
#[test]
fn seed000_l1809_gpt2_nvlink_sync() {
    let l = link(0.0, 450.0 * GB);
    close(l.msg_time(5.2 * GB), 0.011556, 1e-3);
    close(
        ring_all_reduce(&l, 5.2 * GB, 8, RingFactor::Exact),
        0.020222,
        1e-3,
    );
}

/// 000 L3069 and Table 6.2 (E61-E63): n* = α·β. NVLink 4 1.5 µs × 450 GB/s = 675 KB; NDR 2 µs ×
/// 50 = 100 KB; HDR 3.5 × 25 = 87.5 KB; PCIe 5 3.5 × 64 = 224 KB; RoCE 7.5 × 12.5 = 93.75 KB.
/// Fusing 100 × 4 KB messages: 100α = 200 µs vs α + 400 KB/β = 10 µs → 20×.
#[test]
fn seed000_table6_2_critical_sizes() {
    use plan::hardware::link_preset;
    for (name, want) in [
        ("nvlink4", 675.0 * KB),
        ("ib-ndr", 100.0 * KB),
        ("ib-hdr", 87.5 * KB),
        ("pcie5", 224.0 * KB),
        ("roce-100", 93.75 * KB),
    ] {
        close(link_preset("t", name).unwrap().critical_size(), want, 1e-9);
    }
    let l = link(2.0 * US, 50.0 * GB);
    let unfused = 100.0 * l.alpha;
    let fused = l.msg_time(400.0 * KB);
    close(fused, 10.0 * US, 1e-9);
    close(unfused / fused, 20.0, 1e-9);
}

/// 000 Table 6.3 (L3173-3187): α-β predictions with β = 50 GB/s, α ≈ 3.1 µs: 1 KB 3.1 µs,
/// 1 MB 23.1 µs, 64 MB 1.28 ms, 1 GB 20 ms, 10 GB 200 ms (one message, decimal units).
#[test]
fn seed000_table6_3_alpha_beta_predictions() {
    let l = link(3.1 * US, 50.0 * GB);
    close(l.msg_time(1.0 * KB), 3.12 * US, 1e-3);
    close(l.msg_time(1.0 * MB), 23.1 * US, 1e-3);
    close(l.msg_time(64.0 * MB), 1.2831 * MS, 1e-3);
    close(l.msg_time(1.0 * GB), 20.0 * MS, 1e-3);
    close(l.msg_time(10.0 * GB), 200.0 * MS, 1e-4);
}

/// 000 part 1 L179-181 (N21): 10 KB at 200 vs 400 Gb/s gives 1.90 → 1.70 µs (+10.5%) only with
/// α = 1.5 µs; the seed says α ≈ 1 µs, which would give 1.40 → 1.20 µs. We use α = 1.5 µs.
#[test]
fn seed000_part1_l181_alpha_from_worked_numbers() {
    let a = link(1.5 * US, 25.0 * GB).msg_time(10.0 * KB);
    let b = link(1.5 * US, 50.0 * GB).msg_time(10.0 * KB);
    close(a, 1.90 * US, 1e-9);
    close(b, 1.70 * US, 1e-9);
    close((a - b) / a, 0.10526, 1e-3);
}

/// 000 L3255-3275 (E68): MoE all-to-all, 8 GPUs, 64 experts, 512 tokens/GPU of 4,096 B, top-1:
/// 262,144 B per peer, 1.835 MB sent; one transfer 3 + 5.24 = 8.24 µs (seed rounds to 8 µs);
/// serial 7 transfers 57.7 µs (seed: 56 µs with the rounded 8 µs).
#[test]
fn seed000_l3263_moe_all_to_all() {
    let per_peer = 64.0 * 4096.0;
    assert_eq!(per_peer, 262_144.0);
    let l = link(3.0 * US, 50.0 * GB);
    close(l.msg_time(per_peer), 8.24288 * US, 1e-5);
    close(7.0 * l.msg_time(per_peer), 57.7 * US, 1e-3);
    // Our all-to-all formula on 8 × 262,144 B per device: 7α + 7/8 · 2.097 MB / β.
    close(
        all_to_all(&l, 8.0 * per_peer, 8, RingFactor::Exact),
        7.0 * l.msg_time(per_peer),
        1e-12,
    );
}

/// 000 L3201 (E67): naive reduce-then-broadcast O(N·M/β) vs ring ≈ 2M/β at N = 1,024 → 512×.
#[test]
fn seed000_l3201_ring_vs_naive() {
    let l = link(0.0, 1.0);
    let ring = ring_all_reduce(&l, 1.0, 1024, RingFactor::Approx);
    close(1024.0 / ring, 512.0, 1e-12);
}

/// 000 L2459 (E33) and L2627-2631 (E37): TP payloads. M_act = 2,048 × 4 × 4,096 × 2 B = 67.1 MB;
/// ×2 ≈ 134 MB per all-reduce; 96 layers × 2 × 134 MB = 25.77 GB forward. 175B stage (6 layers)
/// with the exact t = 8 factor 1.75: 6 × 2 × 1.75 × 201.3 MB = 4.23 GB.
#[test]
fn seed000_l2459_tp_volume() {
    let m_act = 2048.0 * 4.0 * 4096.0 * 2.0;
    assert_eq!(m_act, 67_108_864.0);
    close(96.0 * 2.0 * 2.0 * m_act, 25.77 * GB, 1e-3);
    let m175 = 2048.0 * 4.0 * 12288.0 * 2.0;
    close(m175, 201.3 * MB, 1e-3);
    let per_dev = 2.0 * RingFactor::Exact.per_phase(8) * m175;
    close(6.0 * 2.0 * per_dev, 4.23 * GB, 1e-3);
    close(96.0 * 2.0 * per_dev, 67.6 * GB, 1e-3);
}

/// 001 line 52 (§12.4): "175B fp16 gradients = 350 GB". The seed calls params × 2 the
/// "reduce + broadcast" volume; 350 GB is params × 2 *bytes*, the gradient size. A ring moves
/// 2(p-1)/p × 350 GB ≈ 700 GB per rank for large p (004 eq. 28.12) — the correct volume.
/// 001 line 70: a full 175B checkpoint "1 TB+" — 175e9 × (2 + 12) = 2.45 TB with Adam.
#[test]
fn seed001_l52_gradient_volume() {
    let grads = 175e9 * 2.0;
    close(grads, 350.0 * GB, 1e-12);
    let bw = link(0.0, 1.0);
    close(
        ring_all_reduce(&bw, grads, 1024, RingFactor::Exact),
        699.3 * GB,
        1e-3,
    );
    assert!(plan::storage::checkpoint_bytes(175e9, 14.0) > 1e12);
}

/// 001 §12.8 items 1-2 ("do the arithmetic first"; "TP inside the node, PP across nodes, DP
/// last"): the placement rule the step model uses. With 8 devices per node, TP 8 stays inside
/// the node; PP 8 with stride 8 spans 8 nodes one member each; DP 16 with stride 64 likewise.
#[test]
fn seed001_l97_parallelism_placement() {
    assert_eq!(placement(8, 1, 8), Placement::IntraNode);
    assert_eq!(
        placement(8, 8, 8),
        Placement::Spanning { local: 1, nodes: 8 }
    );
    assert_eq!(
        placement(16, 64, 8),
        Placement::Spanning {
            local: 1,
            nodes: 16
        }
    );
    // TP 4 × PP 1: DP members 4 apart, 2 per node → hierarchical all-reduce applies (001 l53).
    assert_eq!(
        placement(256, 4, 8),
        Placement::Spanning {
            local: 2,
            nodes: 128
        }
    );
}
