//! NCCL's own cost model for its all-reduce, reduce-scatter and all-gather
//! (`cluster.collectives = "nccl"`): per protocol (LL, LL128, Simple) and algorithm (ring, and
//! tree for the all-reduce), a latency from fixed per-call and per-step constants and a bus
//! bandwidth scaled per protocol, the fastest pair chosen per message as NCCL's tuner does.
//! Small messages go to LL (a flag in every 8 bytes: low latency, half the bandwidth or less),
//! mid-sized ones to LL128, large ones to Simple; the alpha-beta model has one α per step for
//! all of them.
//!
//! Source: NVIDIA/nccl `src/graph/tuning.cc` at 5067397c (`ncclTunerConstantsDefaults`,
//! `ncclTopoTuneModel`, `ncclTopoGetAlgoTime`): the constants below are that file's defaults.
//! Left out, because they need what the planner does not know: the channel count (the per-channel
//! caps on LL128 and tree bandwidth, `perChMax*Bws`, are taken as not binding), the graph's
//! extra inter-node latency (`latencyInter`, taken as 0), NVLS, CollNet and PAT, and tuner
//! plugins or `NCCL_PROTO`/`NCCL_ALGO` overrides. Bus bandwidth (`nChannels × bw` in
//! NCCL) is the intra-node link's β inside a node; across nodes, where NCCL runs a channel per
//! NIC, the group's ranks per node × the per-device port's β, at most the intra-node β (NCCL
//! takes the intra-node figure outright for two nodes; not copied).

use crate::collectives::Placement;
use crate::error::{PlanError, Result};
use crate::hardware::Link;
use serde::{Deserialize, Serialize};

/// The NCCL protocols.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// Low latency: 8-byte stores carrying 4 bytes of data and a flag.
    Ll,
    /// 128-byte lines carrying 120 bytes of data.
    Ll128,
    /// Plain copies with a fence per chunk.
    Simple,
}

/// The NCCL algorithms modelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Ring.
    Ring,
    /// Double binary tree (all-reduce only).
    Tree,
}

/// The collectives priced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// All-reduce.
    AllReduce,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-gather.
    AllGather,
}

/// GPU generation (NCCL's compute-capability index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Generation {
    /// sm_70.
    Volta,
    /// sm_80.
    Ampere,
    /// sm_90.
    Hopper,
    /// sm_100.
    Blackwell,
}

/// The hosts' CPU vendor (NCCL's multi-node LL bandwidth cap and per-step network overhead).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostCpu {
    /// Intel x86.
    Intel,
    /// AMD x86.
    Amd,
}

/// What NCCL's model needs of a cluster.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NcclTopo {
    /// The GPUs' generation.
    pub generation: Generation,
    /// Whether the GPUs of a node talk over NVLink (else PCIe).
    pub nvlink: bool,
    /// The hosts' CPU.
    pub host_cpu: HostCpu,
}

impl NcclTopo {
    /// The topology for a device preset and an intra-node link preset; `host_cpu` defaults to
    /// the vendor's reference node (DGX A100: AMD EPYC; DGX V100, H100, H200, B200: Intel Xeon).
    /// Refused for devices NCCL does not run on and links it does not know.
    pub fn for_presets(device: &str, intra: &str, host_cpu: Option<HostCpu>) -> Result<NcclTopo> {
        let generation = match device {
            d if d.starts_with("v100") => Generation::Volta,
            d if d.starts_with("a100") => Generation::Ampere,
            d if d.starts_with("h100") || d.starts_with("h200") => Generation::Hopper,
            d if d.starts_with("b200") || d.starts_with("gb200") => Generation::Blackwell,
            d => {
                return Err(PlanError::Invalid {
                    field: "cluster.collectives",
                    value: "nccl".into(),
                    reason: format!("NCCL's model needs an NVIDIA device, not {d:?}"),
                });
            }
        };
        let nvlink = match intra {
            i if i.starts_with("nvlink") => true,
            i if i.starts_with("pcie") => false,
            i => {
                return Err(PlanError::Invalid {
                    field: "cluster.collectives",
                    value: "nccl".into(),
                    reason: format!("NCCL's model knows NVLink and PCIe inside a node, not {i:?}"),
                });
            }
        };
        let host_cpu = host_cpu.unwrap_or(match generation {
            Generation::Ampere => HostCpu::Amd,
            _ => HostCpu::Intel,
        });
        Ok(NcclTopo {
            generation,
            nvlink,
            host_cpu,
        })
    }
}

/// The protocols in NCCL's order (LL, LL128, Simple), the index into the tables.
const PROTOCOLS: [Protocol; 3] = [Protocol::Ll, Protocol::Ll128, Protocol::Simple];

/// `baseLatencies`, µs: ring and tree, per protocol.
const BASE_RING: [f64; 3] = [6.6, 14.0, 8.4];
const BASE_TREE: [f64; 3] = [6.8, 14.0, 8.4];
/// `hwLatencies`, µs per step: NVLink, PCIe and network, ring and tree.
const NVLINK_RING: [f64; 3] = [0.6, 1.9, 3.4];
const NVLINK_TREE: [f64; 3] = [0.6, 1.25, 4.0];
const PCI_RING: [f64; 3] = [1.0, 2.5, 5.7];
const PCI_TREE: [f64; 3] = [1.0, 1.9, 4.0];
const NET_RING: [f64; 3] = [2.7, 4.0, 14.0];
const NET_TREE: [f64; 3] = [5.0, 8.5, 14.0];
/// `treeCorrectionFactor`: tree bandwidth × this by ⌊log2(bytes/64)⌋, per protocol.
const TREE_CORRECTION: [[f64; 24]; 3] = [
    [
        1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.7, 0.7, 0.7, 0.7, 0.6, 0.5, 0.4, 0.4, 0.5, 0.6, 0.7, 0.8,
        0.9, 1.0, 1.0, 1.0, 1.0, 1.0,
    ],
    [
        1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.8, 0.8, 0.7, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.8, 0.9,
        0.9, 0.9, 0.9, 1.0, 1.0, 1.0,
    ],
    [
        0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.8, 0.7, 0.6, 0.6, 0.5, 0.5, 0.5, 0.5, 0.6, 0.7, 0.8,
        0.7, 0.7, 0.8, 0.9, 0.9, 0.9,
    ],
];

/// `llMaxBws`, GB/s: the LL protocol's bandwidth cap. One node: by GPU generation; several:
/// by host CPU and node count (2, or more).
fn ll_max_bw(t: &NcclTopo, nodes: u64) -> f64 {
    let gbs = match (nodes, t.host_cpu) {
        (1, _) => match t.generation {
            Generation::Volta => 39.0,
            Generation::Ampere => 87.7,
            Generation::Hopper => 141.0,
            Generation::Blackwell => 282.0,
        },
        (2, HostCpu::Intel) => 39.0,
        (_, HostCpu::Intel) => 20.4,
        (2, HostCpu::Amd) => 22.5,
        (_, HostCpu::Amd) => 19.0,
    };
    gbs * 1e9
}

/// One choice and its time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// Algorithm.
    pub algorithm: Algorithm,
    /// Protocol.
    pub protocol: Protocol,
    /// Seconds.
    pub time: f64,
}

/// The fastest (algorithm, protocol) for `coll` of `m` bytes (the full buffer: the all-reduce's
/// vector, the all-gather's output, the reduce-scatter's input) over `size` ranks placed as `pl`.
/// 0 s for one rank.
pub fn best(
    t: &NcclTopo,
    intra: &Link,
    inter: &Link,
    coll: Collective,
    m: f64,
    size: u64,
    pl: Placement,
) -> Choice {
    let none = Choice {
        algorithm: Algorithm::Ring,
        protocol: Protocol::Simple,
        time: 0.0,
    };
    if size <= 1 {
        return none;
    }
    let (nodes, bus) = match pl {
        Placement::IntraNode => (1, intra.beta),
        Placement::Spanning { local, nodes } => (
            nodes.max(1),
            (local.max(1) as f64 * inter.beta).min(intra.beta),
        ),
    };
    let algorithms: &[Algorithm] = match coll {
        Collective::AllReduce => &[Algorithm::Ring, Algorithm::Tree],
        Collective::ReduceScatter | Collective::AllGather => &[Algorithm::Ring],
    };
    let mut out: Option<Choice> = None;
    for (i, &protocol) in PROTOCOLS.iter().enumerate() {
        if protocol == Protocol::Ll128 && !t.nvlink {
            // LL128 is enabled only where the GPUs of a node share NVLink (`typeIntra <=
            // PATH_NVB`).
            continue;
        }
        for &algorithm in algorithms {
            let time = match algorithm {
                Algorithm::Ring => ring(t, coll, i, m, size, nodes, bus),
                Algorithm::Tree => tree(t, i, m, size, nodes, bus),
            };
            if out.is_none_or(|c| time < c.time) {
                out = Some(Choice {
                    algorithm,
                    protocol,
                    time,
                });
            }
        }
    }
    out.unwrap_or(none)
}

/// Per-step latency inside a node, µs, with the network's per-step overhead when the ring
/// leaves the node (`getNetOverhead`: 1 µs on Intel hosts, 2 on AMD; ×3 for Simple).
fn intra_step(t: &NcclTopo, p: usize, nodes: u64, ring: bool) -> f64 {
    let hw = match (t.nvlink, ring) {
        (true, true) => NVLINK_RING[p],
        (true, false) => NVLINK_TREE[p],
        (false, true) => PCI_RING[p],
        (false, false) => PCI_TREE[p],
    };
    if nodes > 1 && ring {
        let overhead = match t.host_cpu {
            HostCpu::Intel => 1.0,
            HostCpu::Amd => 2.0,
        } * if p == 2 { 3.0 } else { 1.0 };
        hw.max(overhead)
    } else {
        hw
    }
}

/// Ring: latency base + (steps − inter steps)·intra + inter steps·network (per step, the tree's
/// network figure with one rank per node); bus bandwidth ×0.5 capped for LL, ×0.92 for LL128;
/// algorithm bandwidth = bus × ranks / steps; Simple all-reduce across nodes pays the ring's
/// plateau (latency ×1.4, ×1.9 on Volta).
fn ring(t: &NcclTopo, coll: Collective, p: usize, m: f64, n: u64, nodes: u64, bus: f64) -> f64 {
    let (steps, inter_steps) = match coll {
        Collective::AllReduce => (2 * (n - 1), 2 * nodes.saturating_sub(1)),
        Collective::ReduceScatter | Collective::AllGather => (n - 1, nodes.saturating_sub(1)),
    };
    let per_node = n / nodes;
    let net = if per_node <= 1 {
        NET_TREE[p]
    } else {
        NET_RING[p]
    };
    let mut lat = BASE_RING[p]
        + (steps - inter_steps) as f64 * intra_step(t, p, nodes, true)
        + inter_steps as f64 * net;
    if p == 2 && nodes > 1 && coll == Collective::AllReduce {
        lat *= if t.generation == Generation::Volta {
            1.9
        } else {
            1.4
        };
    }
    let bus = match p {
        0 => (bus * 0.5).min(ll_max_bw(t, nodes)),
        1 => bus * 0.92,
        _ => bus,
    };
    let alg = bus * n as f64 / steps as f64;
    lat * 1e-6 + m / alg
}

/// Tree all-reduce: latency base + 2·((ranks per node − 1)·intra + ⌊log2 nodes⌋·network); bus
/// bandwidth ×0.92, then ÷3.8 capped for LL, ×7/9 (one node) or ×120/128 for LL128, times the
/// size correction; algorithm bandwidth = bus / 2.
fn tree(t: &NcclTopo, p: usize, m: f64, n: u64, nodes: u64, bus: f64) -> f64 {
    let per_node = n / nodes;
    let lat = BASE_TREE[p]
        + 2.0
            * ((per_node.saturating_sub(1)) as f64 * intra_step(t, p, nodes, false)
                + (nodes.max(1).ilog2()) as f64 * NET_TREE[p]);
    let mut bus = bus * 0.92;
    bus = match p {
        0 => (bus / 3.8).min(ll_max_bw(t, nodes)),
        1 => bus * if nodes == 1 { 7.0 / 9.0 } else { 120.0 / 128.0 },
        _ => bus,
    };
    let chunks = (m as u64) >> 6;
    if chunks > 0 {
        let log = chunks.ilog2() as usize;
        if log < 24 {
            bus *= TREE_CORRECTION[p][log];
        }
    }
    lat * 1e-6 + m / (bus * 0.5)
}
