//! The alpha-beta cost model and algorithm selection (NCCL's tuning table, as data).
//!
//! A message of n bytes over a link costs `α + n·β⁻¹` (004 eq. 28.10, 000 F3); reducing n bytes
//! costs `n·γ`. Each algorithm module documents its cost; the formulas themselves live in
//! [`cost`], shared with the planner. [`predict`] evaluates them for a group's topology and
//! [`select`] takes the argmin, recording every candidate so the choice can be printed and
//! explained. α and β are measured per transport when a group is created
//! ([`crate::group`]), and all ranks use the same published figures, so they choose alike.

use crate::algo::Algo;
use crate::frame::OpKind;
use crate::transport::LinkKind;
use std::collections::BTreeMap;

/// Parameters of one kind of link.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LinkParams {
    /// Per-message latency α, seconds.
    pub alpha: f64,
    /// Bandwidth β, bytes per second (one direction).
    pub beta: f64,
}

impl LinkParams {
    /// `α + n/β` (004 eq. 28.10, [`cost::message`]).
    pub fn msg(&self, bytes: f64) -> f64 {
        cost::message(self.alpha, self.beta, bytes)
    }

    /// A collective of `n` bytes over `p` ranks on this link, with reduction cost `gamma`, to
    /// price with the [`cost`] formulas.
    pub fn call(self, gamma: f64, n: f64, p: usize) -> cost::Call {
        cost::Call {
            alpha: self.alpha,
            beta: self.beta,
            gamma,
            n,
            p: p as u64,
        }
    }
}

/// Defaults used when a group is created without calibration: loopback figures of the reference
/// machine (`../shared/peers/results/limits.txt`: TCP 8-byte RTT median 58 µs, one stream
/// 3-5 GB/s; memcpy 12.4 GB/s per thread, of which a ring transfer gets about half, since it
/// copies in and out).
pub const DEFAULT_TCP: LinkParams = LinkParams {
    alpha: 30e-6,
    beta: 3.0e9,
};
/// See [`DEFAULT_TCP`].
pub const DEFAULT_SHM: LinkParams = LinkParams {
    alpha: 5e-6,
    beta: 6.0e9,
};
/// Default reduction cost γ, seconds per byte (f32 sum streams at about 8 GB/s per core when the
/// operands come from memory).
pub const DEFAULT_GAMMA: f64 = 1.0 / 8.0e9;

/// Bandwidth-term factor of algorithms that move whole chunks per step (halving-doubling)
/// against the pipelined ring, whose segments overlap receive, reduce and forward. Measured on
/// the reference machine with 4 ranks on 2 cores at 64 MiB: reduce-scatter over shared memory
/// ring 58 ms vs halving-doubling 67 ms; all-reduce over TCP ring 112-131 ms vs
/// halving-doubling 138-169 ms.
pub const STORE_AND_FORWARD: f64 = 1.25;

/// Largest buffer for which the direct (everyone-to-everyone-at-once) all-reduce,
/// reduce-scatter and all-gather are candidates. Above it their p-1 concurrent streams per rank
/// thrash the shared-memory rings and sockets far beyond what the α-β terms say: measured on the
/// reference machine (4 ranks, 2 cores, 64 MiB reduce-scatter over shared memory): direct
/// 90 ms, ring 58 ms, direct_read 31 ms, while the formula predicted 21 ms for direct.
pub const DIRECT_MAX_BYTES: usize = 256 << 10;

/// Everything the selector knows about a group.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Topology {
    /// Group size.
    pub size: usize,
    /// Number of distinct hosts.
    pub hosts: usize,
    /// Ranks per host if every host has the same count, else None.
    pub ranks_per_host: Option<usize>,
    /// Link kind used between ranks on one host (shm, or tcp when shm is off).
    pub intra: LinkKind,
    /// Measured parameters per link kind.
    pub links: BTreeMap<String, LinkParams>,
    /// Reduction cost, seconds per byte.
    pub gamma: f64,
    /// CPU cores per host (ranks beyond this share cores, and copies slow down in proportion).
    pub cores: usize,
    /// Measured seconds per synchronised round of the whole group (a barrier's time divided by
    /// its ⌈log2 p⌉ rounds): with ranks outnumbering cores this is far above the link's α, and
    /// it bounds every step of every algorithm from below. Zero when not measured.
    pub round: f64,
    /// Per-rank bytes/s over the group's (single-host) links with every rank sending and
    /// receiving at once, measured by a ring all-gather; replaces β/oversubscription when set.
    pub concurrent: Option<f64>,
    /// Seconds per byte of large ops, measured per `op/algorithm` when a single-host group is
    /// created (see `group::calibrate`): the bandwidth part of those predictions, replacing the
    /// formula's β and γ terms, which cannot capture cache and core-sharing effects.
    #[serde(default)]
    pub per_byte: BTreeMap<String, f64>,
    /// Seconds of a [`LATENCY_PROBE_BYTES`] op, measured per `op/algorithm` when a group is
    /// created (see `group::calibrate`): the latency part of those predictions, replacing the
    /// formula's α terms, which price every step at one link's α (or the group round) while a
    /// step's real cost depends on the algorithm's pattern of wake-ups across shared cores.
    #[serde(default)]
    pub latency: BTreeMap<String, f64>,
    /// Bytes/s of short bursts per link kind, where calibration found a link passing them
    /// clearly faster than it sustains (a token-bucket shaper such as `tc tbf`, or a cloud
    /// instance's burst allowance): see [`predict`].
    #[serde(default)]
    pub burst: BTreeMap<String, f64>,
    /// Single-core cross-memory-attach copy rate (bytes/s), when every rank may read its local
    /// peers' memory (the [`Algo::DirectRead`] algorithms); None where it is not permitted.
    pub direct_read: Option<f64>,
}

impl Topology {
    /// Parameters of a link kind (the defaults if it was not measured).
    pub fn params(&self, kind: LinkKind) -> LinkParams {
        self.links.get(kind.name()).copied().unwrap_or(match kind {
            LinkKind::Tcp => DEFAULT_TCP,
            LinkKind::Shm => DEFAULT_SHM,
        })
    }

    /// The link that bounds a flat algorithm: TCP as soon as the group spans hosts.
    pub fn flat(&self) -> LinkParams {
        if self.hosts > 1 {
            self.params(LinkKind::Tcp)
        } else {
            self.params(self.intra)
        }
    }

    /// This topology with every bursting link at its burst rate, when the group spans hosts and
    /// some inter-host link bursts (on one host every byte is CPU work, which does not burst).
    pub fn bursting(&self) -> Option<Topology> {
        if self.hosts < 2 || self.burst.is_empty() {
            return None;
        }
        let mut t = self.clone();
        for (kind, &rate) in &self.burst {
            if let Some(l) = t.links.get_mut(kind) {
                l.beta = l.beta.max(rate);
            }
        }
        Some(t)
    }

    /// Per-rank bytes/s of a link whose two ranks alone move `beta` bytes/s, once every rank is
    /// busy and ranks share cores. On one host every byte is CPU work, so the rate divides by the
    /// oversubscription. Between hosts the wire may be the limit instead: the per-byte cost is
    /// the larger of the link's (1/β) and the CPU's (oversubscription / the CPU's own rate, which
    /// is at least β and at least the host's copy rate, the shared-memory β: a copy in and a copy
    /// out, as a TCP send and receive). Without a shared-memory figure the link is taken as
    /// CPU-bound.
    pub fn shared_rate(&self, beta: f64) -> f64 {
        let ov = self.oversubscription();
        match self.links.get(LinkKind::Shm.name()) {
            Some(cpu) if self.hosts > 1 => beta.min(beta.max(cpu.beta) / ov),
            _ => beta / ov,
        }
    }

    /// Ranks sharing one core on the busiest host (at least 1): every copy, reduction and
    /// socket transfer is CPU work, so per-rank rates divide by this when ranks outnumber cores.
    pub fn oversubscription(&self) -> f64 {
        let per_host = self
            .ranks_per_host
            .unwrap_or(self.size.div_ceil(self.hosts.max(1)));
        (per_host as f64 / self.cores.max(1) as f64).max(1.0)
    }
}

/// Predicted seconds for `algo` running `op` over `bytes` (the per-rank buffer of all-reduce,
/// broadcast and reduce; the whole gathered/scattered buffer of all-gather, reduce-scatter and
/// all-to-all), or None if the algorithm does not apply.
///
/// Where this group measured the algorithm's latency ([`Topology::latency`]), that figure stands
/// for the formula's latency part, and the bytes beyond (or short of) the probe's are priced by
/// the bandwidth part. Where a link bursts ([`Topology::burst`]) those bytes go at its burst
/// rate, but no faster on average than the sustained rate: back to back, an op cannot take less
/// than its bytes at the sustained rate, and while its bytes fit the burst it takes its latency
/// plus the bytes at the burst rate, so the prediction is the larger of the two. Without a burst
/// this is the additive `α + n/β` of 004 eq. 28.10.
pub fn predict(op: OpKind, algo: Algo, bytes: usize, t: &Topology) -> Option<f64> {
    estimate(op, algo, bytes, t, true)
}

/// What [`select`] ranks by: [`predict`] without the measured latencies, so that the choice at
/// a given size rests on the α-β formulas (and the measured bandwidths of large ops), not on a
/// small op's timing. Those timings differ by 10-40 % from one group creation to the next, where
/// several algorithms lie close together, and a choice that flipped with them would change the
/// order of a sum, and with it the bits of every run with more than two ranks.
pub fn rank_cost(op: OpKind, algo: Algo, bytes: usize, t: &Topology) -> Option<f64> {
    estimate(op, algo, bytes, t, false)
}

fn estimate(
    op: OpKind,
    algo: Algo,
    bytes: usize,
    t: &Topology,
    measured_latency: bool,
) -> Option<f64> {
    let f = formula(op, algo, bytes, t)?;
    let f0 = formula(op, algo, 0, t)?;
    let measured = match algo {
        // Halving-doubling moves the ring's bytes without its pipelining.
        Algo::HalvingDoubling => t
            .per_byte
            .get(&probe_key(op, Algo::Ring))
            .map(|k| k * STORE_AND_FORWARD),
        _ => t.per_byte.get(&probe_key(op, algo)).copied(),
    };
    // The formula, with the bandwidth part measured on this group where probed: all the
    // selector needs (two formula evaluations per candidate on every op).
    let sustained = measured.map_or(f - f0, |k| bytes as f64 * k);
    let latency = measured_latency
        .then(|| t.latency.get(&probe_key(op, algo)))
        .flatten();
    let Some(&l) = latency else {
        return Some(measured.map_or(f, |k| f0 + bytes as f64 * k));
    };
    // The bandwidth part of the bytes beyond (or short of) the probe's, at the burst rate where
    // a link bursts (the formula's latency part cancels in the difference).
    let beyond_probe = match measured {
        Some(k) => (bytes as f64 - LATENCY_PROBE_BYTES as f64) * k,
        None => {
            let fast = t.bursting();
            let fast = fast.as_ref().unwrap_or(t);
            formula(op, algo, bytes, fast)? - formula(op, algo, LATENCY_PROBE_BYTES, fast)?
        }
    };
    Some((l + beyond_probe).max(sustained))
}

/// Buffer of the latency probes (see [`Topology::latency`]): per rank for all-reduce and
/// broadcast, the gathered or scattered buffer for the others (as [`predict`] counts bytes),
/// rounded down to a multiple of 4p.
pub const LATENCY_PROBE_BYTES: usize = 4096;

/// Key of a measured per-byte cost in [`Topology::per_byte`].
pub fn probe_key(op: OpKind, algo: Algo) -> String {
    format!("{}/{}", op.name(), algo.name())
}

/// The documented cost formula of `algo` for `op` (see each algorithm module), priced by
/// [`cost`] with this group's links: the flat link (TCP once the group spans hosts) at its
/// shared per-rank rate, each step at least the group round, the reduction slowed by core
/// sharing.
pub fn formula(op: OpKind, algo: Algo, bytes: usize, t: &Topology) -> Option<f64> {
    if !algo.serves(op) {
        return None;
    }
    let p = t.size;
    if p <= 1 {
        return Some(0.0);
    }
    let n = bytes as f64;
    let ov = t.oversubscription();
    let mut l = t.flat();
    l.beta = match t.concurrent {
        Some(b) if t.hosts == 1 => b,
        _ => t.shared_rate(l.beta),
    };
    // A step of a collective needs every rank scheduled, so its latency is at least the
    // measured per-round time of the whole group (see `Topology::round`).
    l.alpha = l.alpha.max(t.round);
    let c = l.call(t.gamma * ov, n, p);
    use OpKind::*;
    Some(match (op, algo) {
        // 004 eq. 28.11/28.12 plus the reduction term; the ring reduce (reduce-scatter, then a
        // gather to the root) has the all-reduce's steps and bytes.
        (AllReduce | Reduce, Algo::Ring) => c.ring_all_reduce(EXACT),
        (ReduceScatter, Algo::Ring) => c.ring_reduce_scatter(EXACT),
        (AllGather, Algo::Ring) => c.ring_all_gather(EXACT),
        (Broadcast, Algo::Ring) => c.ring_broadcast(crate::algo::ring::BCAST_SEGMENT_BYTES as f64),
        // Rabenseifner: same bytes as the ring in ⌊lg p⌋ + ⌈lg p⌉ steps; a non-power of two
        // folds the first 2r ranks in (a message of n, one of n/p back). Not pipelined: each
        // step's chunk is received whole before it is reduced and forwarded.
        (AllReduce, Algo::HalvingDoubling) => c.halving_doubling_all_reduce(HD),
        (ReduceScatter, Algo::HalvingDoubling) => c.halving_doubling_reduce_scatter(HD),
        (AllGather, Algo::HalvingDoubling) => c.halving_doubling_all_gather(HD),
        // 004 eq. 28.13: unchunked binomial reduce + broadcast.
        (AllReduce, Algo::Tree) => c.tree_all_reduce(),
        (Reduce, Algo::Tree) => c.tree_reduce(),
        (Broadcast, Algo::Tree) => c.tree_broadcast(),
        // Two trees carrying n/2 each, concurrently, pipelined in s segments per half.
        (AllReduce, Algo::DoubleTree) => {
            let seg = crate::algo::double_tree::DOUBLE_TREE_SEGMENT_BYTES as f64;
            c.double_tree_all_reduce(seg)
        }
        // Direct: every rank sends its whole buffer (all-reduce) or one chunk (others) to every
        // other rank at once; the sender's link serialises p-1 messages.
        (AllReduce | ReduceScatter | AllGather, Algo::Direct) if bytes > DIRECT_MAX_BYTES => {
            return None;
        }
        (AllReduce, Algo::Direct) => c.direct_all_reduce(),
        (ReduceScatter, Algo::Direct) => c.direct_reduce_scatter(),
        (AllGather | AllToAll, Algo::Direct) => c.direct_all_gather(),
        (AllToAll, Algo::Pairwise) => c.pairwise_all_to_all(EXACT),
        (Barrier, Algo::Direct) => c.dissemination_barrier(),
        // Single copy within one host (see algo::direct_read for the derivation).
        (AllReduce | ReduceScatter | AllGather | Broadcast, Algo::DirectRead) => {
            let br = t.direct_read?;
            if t.hosts != 1 {
                return None;
            }
            let alpha = t.params(LinkKind::Shm).alpha.max(t.round);
            // A measured (concurrent, per-rank) read rate already includes core sharing; the
            // single-core default does not.
            let dov = if t.concurrent.is_some() { 1.0 } else { ov };
            let c = cost::Call {
                alpha,
                beta: br,
                ..c
            };
            match op {
                AllReduce => c.direct_read_all_reduce(dov),
                ReduceScatter => c.direct_read_reduce_scatter(dov),
                AllGather => c.direct_read_all_gather(dov),
                _ => c.direct_read_broadcast(dov),
            }
        }
        (AllReduce, Algo::Hierarchical) => hierarchical(n, t)?,
        _ => return None,
    })
}

/// The ring fraction the runtime always prices: (p-1)/p.
const EXACT: cost::RingFactor = cost::RingFactor::Exact;

/// Halving-doubling as it runs here: the measured store-and-forward penalty, and the fold of a
/// non-power-of-two group.
const HD: cost::HalvingDoubling = cost::HalvingDoubling {
    store_and_forward: STORE_AND_FORWARD,
    fold: true,
};

/// 004 E10 / 000 F66: intra-host reduce-scatter and all-gather on g ranks (single-copy reads
/// where permitted, else rings) and an inter-host ring all-reduce of each rank's n/g shard. The
/// g shards of a host leave through the same host link ([`cost::Egress::PerHost`]), so that
/// link carries 2(h-1)/h·n bytes, not 2(h-1)/h·n/g. Pipelined ([`crate::algo::hier_pipeline`])
/// where single-copy reads serve a host of several ranks and the buffer spans two segments.
fn hierarchical(n: f64, t: &Topology) -> Option<f64> {
    let gsz = t.ranks_per_host?;
    if t.hosts < 2 || gsz < 1 {
        return None;
    }
    let ov = t.oversubscription();
    let (li, mut lo) = (t.params(t.intra), t.params(LinkKind::Tcp));
    // Intra-host steps involve only the host's ranks: the group round (which crosses hosts)
    // bounds the inter-host steps only.
    lo.alpha = lo.alpha.max(t.round);
    let host = li.call(t.gamma, n, gsz);
    let intra = match t.direct_read {
        Some(br) => cost::Call { beta: br, ..host }.hierarchical_direct_read_phase(ov),
        None => host.hierarchical_ring_phase(ov, EXACT),
    };
    let across = lo.call(t.gamma * ov, n, t.hosts);
    let inter = across.hierarchical_inter_phase(gsz as u64, cost::Egress::PerHost, EXACT);
    let seg = crate::algo::hier_pipeline::SEGMENT_BYTES as f64;
    let segments = (t.direct_read.is_some() && gsz > 1 && n >= 2.0 * seg).then(|| (n / seg).ceil());
    Some(cost::hierarchical_all_reduce(intra, inter, segments))
}

/// One candidate the selector weighed.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Candidate {
    pub algo: Algo,
    /// The best estimate of its time ([`predict`]).
    pub predicted_s: f64,
    /// What the selector ranked it by ([`rank_cost`]).
    pub ranked_s: f64,
}

/// The algorithm chosen for one call, and why.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Selection {
    pub op: OpKind,
    pub bytes: usize,
    pub algo: Algo,
    /// Predicted seconds of the chosen algorithm (None if it has no formula).
    pub predicted_s: Option<f64>,
    /// `forced` (by the call, config or env) or `model`.
    pub source: &'static str,
    /// Every applicable candidate with its prediction, in the selector's order (least
    /// [`rank_cost`] first).
    pub candidates: Vec<Candidate>,
}

impl std::fmt::Display for Selection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} B: {} ({})",
            self.op.name(),
            self.bytes,
            self.algo.name(),
            self.source
        )?;
        for c in &self.candidates {
            write!(f, " {}={:.1}us", c.algo.name(), c.predicted_s * 1e6)?;
        }
        Ok(())
    }
}

impl serde::Serialize for OpKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// The algorithm an op runs: `forced` if given, else the applicable one of least [`rank_cost`]
/// (the first in [`Algo::ALL`] among equals). What every op calls, so it prices each candidate
/// once and keeps nothing; [`select`] explains the same choice.
pub fn choose(op: OpKind, bytes: usize, t: &Topology, forced: Option<Algo>) -> Algo {
    forced.unwrap_or_else(|| {
        Algo::ALL
            .into_iter()
            .filter_map(|a| Some((a, rank_cost(op, a, bytes, t)?)))
            .fold(None, |best: Option<(Algo, f64)>, c| match best {
                Some(b) if b.1.total_cmp(&c.1).is_le() => Some(b),
                _ => Some(c),
            })
            .map_or(Algo::Direct, |b| b.0)
    })
}

/// The choice of [`choose`] with every candidate's prediction and rank, unless `forced` names
/// the algorithm.
pub fn select(op: OpKind, bytes: usize, t: &Topology, forced: Option<Algo>) -> Selection {
    let mut candidates: Vec<Candidate> = Algo::ALL
        .into_iter()
        .filter_map(|a| {
            Some(Candidate {
                algo: a,
                predicted_s: predict(op, a, bytes, t)?,
                ranked_s: rank_cost(op, a, bytes, t)?,
            })
        })
        .collect();
    // A stable sort keeps the first of equals in `Algo::ALL` order first: [`choose`]'s rule.
    candidates.sort_by(|a, b| a.ranked_s.total_cmp(&b.ranked_s));
    let algo = forced.unwrap_or_else(|| candidates.first().map_or(Algo::Direct, |c| c.algo));
    let source = if forced.is_some() { "forced" } else { "model" };
    let predicted_s = candidates
        .iter()
        .find(|c| c.algo == algo)
        .map(|c| c.predicted_s);
    Selection {
        op,
        bytes,
        algo,
        predicted_s,
        source,
        candidates,
    }
}

#[cfg(test)]
mod tests;
