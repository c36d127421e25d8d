//! NCCL's collective model (`cluster.collectives = "nccl"`, `plan::nccl`): the protocol regimes
//! by message size, hand-computed times from `src/graph/tuning.cc`'s constants, and the cluster
//! file's checks.

use plan::cluster::{Cluster, ClusterFile, CollectiveModel};
use plan::collectives::Placement;
use plan::nccl::{Algorithm, Collective, NcclTopo, Protocol, best};

fn dgx_a100() -> (NcclTopo, Cluster) {
    let mut f = ClusterFile::preset("a100-80", 16);
    f.inter = "ib-hdr".into();
    f.collectives = CollectiveModel::Nccl;
    let c = Cluster::from_file(&f).unwrap();
    (c.nccl.unwrap(), c)
}

/// 8 GPUs on NVLink 3 (300 GB/s): 1 GiB goes by ring/Simple, 8.4 + 14 x 3.4 = 56 us of latency
/// and 14/8 x 1 GiB / 300 GB/s; 8 KiB by ring/LL, 6.6 + 14 x 0.6 = 15 us and the LL cap
/// (87.7 GB/s on one Ampere node); in between LL128 wins somewhere.
#[test]
fn protocols_follow_the_message_size_inside_a_node() {
    let (t, c) = dgx_a100();
    let at = |m: f64| {
        best(
            &t,
            &c.intra,
            &c.inter,
            Collective::AllReduce,
            m,
            8,
            Placement::IntraNode,
        )
    };
    let gib = 1024.0 * 1024.0 * 1024.0;
    let big = at(gib);
    assert_eq!(
        (big.algorithm, big.protocol),
        (Algorithm::Ring, Protocol::Simple)
    );
    let expect = 56e-6 + gib * 14.0 / (8.0 * 300e9);
    assert!(
        (big.time / expect - 1.0).abs() < 1e-9,
        "{big:?} vs {expect}"
    );
    let small = at(8192.0);
    assert_eq!(
        (small.algorithm, small.protocol),
        (Algorithm::Ring, Protocol::Ll)
    );
    let expect = 15e-6 + 8192.0 * 14.0 / (8.0 * 87.7e9);
    assert!(
        (small.time / expect - 1.0).abs() < 1e-9,
        "{small:?} vs {expect}"
    );
    let mut seen = Vec::new();
    let mut m = 1024.0;
    while m <= gib {
        let p = at(m).protocol;
        if seen.last() != Some(&p) {
            seen.push(p);
        }
        m *= 2.0;
    }
    assert_eq!(seen, [Protocol::Ll, Protocol::Ll128, Protocol::Simple]);
    // Against alpha-beta's 14 x 1.5 us, LL's steps are cheaper for small messages.
    let ab = plan::collectives::ring_all_reduce(&c.intra, 8192.0, 8, c.ring);
    assert!(small.time < ab, "{small:?} vs {ab}");
}

/// Across nodes the tree's log2 depth beats the ring's 2(n - 1) steps for small messages at
/// scale; large messages still go by ring. Reduce-scatter and all-gather are rings of n - 1 steps.
#[test]
fn across_nodes_the_tree_wins_small_and_the_ring_large() {
    let (t, c) = dgx_a100();
    let pl = Placement::Spanning {
        local: 8,
        nodes: 16,
    };
    let small = best(
        &t,
        &c.intra,
        &c.inter,
        Collective::AllReduce,
        65536.0,
        128,
        pl,
    );
    assert_eq!(small.algorithm, Algorithm::Tree, "{small:?}");
    let large = best(&t, &c.intra, &c.inter, Collective::AllReduce, 4e9, 128, pl);
    assert_eq!(large.algorithm, Algorithm::Ring, "{large:?}");
    assert_eq!(large.protocol, Protocol::Simple);
    // Ring/Simple across 16 AMD hosts: 2 x 127 steps, 2 x 15 of them over the network (14 us),
    // the rest at max(3.4, 3 x 2.0) us, all x 1.4 (the ring's plateau); bus = 8 channels, one
    // per NIC, x 25 GB/s = 200 GB/s (under NVLink's 300).
    let lat = 1.4 * (8.4 + (254.0 - 30.0) * 6.0 + 30.0 * 14.0);
    let expect = lat * 1e-6 + 4e9 * 254.0 / (128.0 * 200e9);
    assert!(
        (large.time / expect - 1.0).abs() < 1e-9,
        "{large:?} vs {expect}"
    );
    let ag = best(&t, &c.intra, &c.inter, Collective::AllGather, 4e9, 128, pl);
    assert_eq!(ag.algorithm, Algorithm::Ring);
    assert!(ag.time < large.time * 0.51, "{ag:?}");
    // One rank: nothing to do.
    let one = best(
        &t,
        &c.intra,
        &c.inter,
        Collective::AllReduce,
        4e9,
        1,
        Placement::IntraNode,
    );
    assert_eq!(one.time, 0.0);
}

/// The model is refused where NCCL does not run, `host_cpu` only goes with it, and a cluster
/// file that leaves `collectives` out keeps the alpha-beta model.
#[test]
fn cluster_file_checks() {
    let mut f = ClusterFile::preset("mi300x", 2);
    f.collectives = CollectiveModel::Nccl;
    let e = Cluster::from_file(&f).unwrap_err().to_string();
    assert!(e.contains("NVIDIA"), "{e}");
    let mut f = ClusterFile::preset("h100", 2);
    f.host_cpu = Some(plan::nccl::HostCpu::Amd);
    let e = Cluster::from_file(&f).unwrap_err().to_string();
    assert!(e.contains("host_cpu"), "{e}");
    let f = ClusterFile::from_toml("nodes = 2\ndevice = \"h100\"\n").unwrap();
    assert!(Cluster::from_file(&f).unwrap().nccl.is_none());
    let f = ClusterFile::from_toml(
        "nodes = 2\ndevice = \"h100\"\ncollectives = \"nccl\"\nhost_cpu = \"amd\"\n",
    )
    .unwrap();
    let t = Cluster::from_file(&f).unwrap().nccl.unwrap();
    assert_eq!(t.host_cpu, plan::nccl::HostCpu::Amd);
}
