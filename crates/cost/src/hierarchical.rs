//! Hierarchical all-reduce over `local` ranks on each of `nodes` hosts (000 F66, L3163;
//! 004 E10): reduce-scatter inside each host, an all-reduce of each rank's shard across hosts,
//! all-gather inside each host. Priced as two [`Phase`]s, the intra-host pair and the inter-host
//! all-reduce ([`Call`]'s `hierarchical_*_phase` methods), each split into its latency and
//! bandwidth parts, so that the pipelined variant (which pays each phase's latency once per
//! segment) is the same formula as the serial one.

use crate::{Call, RingFactor, log2_ceil};

/// One phase of a composed collective: the part paid per pass (latencies) and the part
/// proportional to the bytes (transfers and reductions), in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Phase {
    /// Seconds of latency (α terms) of one pass.
    pub latency: f64,
    /// Seconds of bandwidth and reduction (β and γ terms) of the whole buffer.
    pub bandwidth: f64,
}

/// What each host's inter-host link carries: the difference between the planner's and the
/// selector's hierarchical all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Egress {
    /// Every device has its own inter-node port (a DGX: one NIC per GPU, the planner's β is per
    /// device): each carries its own shard, 2(h-1)/h·n/g bytes.
    PerDevice,
    /// The g ranks of a host share one link (the selector's β is the host's): the g shards
    /// leave through it together, 2(h-1)/h·n bytes.
    PerHost,
}

impl Call {
    /// The intra-host phase by rings over the host's p ranks: a ring reduce-scatter and a ring
    /// all-gather of n bytes, latency `2(p-1)·α`, bandwidth `s·(2f·n/β + f·n·γ)`, f from `rf`,
    /// s the ranks `sharing` a core (1 where each rank has its own).
    pub fn hierarchical_ring_phase(self, sharing: f64, rf: RingFactor) -> Phase {
        self.priced(|alpha, beta, gamma, n, p| {
            let f = rf.per_phase(p);
            Phase {
                latency: 2.0 * (p - 1) as f64 * alpha,
                bandwidth: sharing * (2.0 * f * n / beta + f * n * gamma),
            }
        })
    }

    /// The intra-host phase by single-copy reads over the host's p ranks (`process_vm_readv`,
    /// β the single-core read rate β_r): latency `(2 + 2⌈log2 p⌉)·α`, bandwidth
    /// `s·(p-1)/p·n·(2/β_r + γ)`.
    pub fn hierarchical_direct_read_phase(self, sharing: f64) -> Phase {
        self.priced(|alpha, beta, gamma, n, p| Phase {
            latency: (2.0 + 2.0 * log2_ceil(p)) * alpha,
            bandwidth: sharing * (p - 1) as f64 / p as f64 * n * (2.0 / beta + gamma),
        })
    }

    /// The inter-host phase over p hosts of `local` ranks each: a ring all-reduce of each
    /// rank's n/g shard (g = `local`), latency `2(p-1)·α`, bandwidth `2f·w/β + f·(n/g)·γ`, f
    /// from `rf`, w the bytes on each link ([`Egress`]: n/g per device, n per host).
    pub fn hierarchical_inter_phase(self, local: u64, egress: Egress, rf: RingFactor) -> Phase {
        self.priced(|alpha, beta, gamma, n, p| {
            let g = local.max(1) as f64;
            let wire = match egress {
                Egress::PerDevice => n / g,
                Egress::PerHost => n,
            };
            let f = rf.per_phase(p);
            Phase {
                latency: 2.0 * (p - 1) as f64 * alpha,
                bandwidth: 2.0 * f * wire / beta + f * n / g * gamma,
            }
        })
    }
}

/// Hierarchical all-reduce of its `intra` and `inter` phases (000 F66; 004 E10). Run one after
/// the other (`segments` None): `intra + inter`. Pipelined over k `segments` (the intra-host
/// and inter-host phases at once on two threads, each paying its latency once per segment; only
/// the first segment's reduce-scatter and the last one's all-gather stay exposed):
/// `max(k·intra.latency + intra.bandwidth, k·inter.latency + inter.bandwidth) + intra.latency +
/// intra.bandwidth/k`. 000 E65 (140 GB on 16 × 8, NVLink 450 GB/s, IB 50 GB/s, α_inter = 5 µs,
/// per-device NICs): ≈ 1,200.8 ms.
pub fn hierarchical_all_reduce(intra: Phase, inter: Phase, segments: Option<f64>) -> f64 {
    match segments {
        Some(k) => {
            let i = k * intra.latency + intra.bandwidth;
            let o = k * inter.latency + inter.bandwidth;
            i.max(o) + intra.latency + intra.bandwidth / k
        }
        None => intra.latency + intra.bandwidth + inter.latency + inter.bandwidth,
    }
}
