//! # flotilla-cost: the alpha-beta cost of each collective algorithm
//!
//! One set of formulas (000 Chapter 6, F3, F15-F16, F59, F66; 004 eqs. 28.10-28.14), shared by
//! the runtime selector (`comm::model`, which prices every candidate algorithm of a call from
//! calibrated link figures and picks the cheapest) and the planner (`plan::collectives`, which
//! prices a layout's collectives from datasheet figures). Each algorithm module of
//! `crates/comm/src/algo` derives its cost at the top of its file; the functions here are those
//! costs, as free functions of plain numbers: no topology, no I/O, no state.
//!
//! A [`Call`] holds what every formula needs (α, β, γ, the bytes n and the ranks p); its
//! methods are the formulas, one per algorithm and operation, each returning seconds (0 for a
//! group of one). n is one rank's buffer for all-reduce, reduce and broadcast, the whole gathered
//! or scattered buffer for reduce-scatter, all-gather and all-to-all.
//!
//! Where the selector and the planner price one algorithm differently, the difference is an
//! explicit parameter rather than a second formula: [`RingFactor`] (the planner may take the
//! ring's (p-1)/p as 1, as the seeds' back-of-envelope numbers do), [`HalvingDoubling`] (the
//! selector charges the measured store-and-forward penalty and the fold of a non-power-of-two
//! group; the planner the textbook formula), [`Egress`] (whether the g ranks of a host share one
//! inter-host link or each has its own NIC), `gamma` and `sharing` (ranks per core). Every
//! formula is evaluated in the order both callers used before they shared it, so each returns,
//! bit for bit, the number its caller computed on its own (the planner's hierarchical
//! all-reduce alone now adds its phases in another order, a difference of rounding).

use serde::{Deserialize, Serialize};

mod hierarchical;
pub use hierarchical::{Egress, Phase, hierarchical_all_reduce};

/// How the ring's bandwidth factor is taken. The exact ring moves (p-1)/p of the message per
/// device per phase (004 eq. 28.12); many back-of-envelope numbers in the seeds use the large-p
/// limit 1 (000 F46 "→ 2·M_act for large t"; 000 L2957 "≈2 × 140/50 = 5.6 s").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RingFactor {
    /// (p-1)/p per phase.
    #[default]
    Exact,
    /// 1 per phase (the p → ∞ limit).
    Approx,
}

impl RingFactor {
    /// The per-phase fraction of the message each device sends: (p-1)/p or 1 (0 for p ≤ 1).
    pub fn per_phase(self, p: u64) -> f64 {
        match self {
            _ if p <= 1 => 0.0,
            RingFactor::Exact => (p - 1) as f64 / p as f64,
            RingFactor::Approx => 1.0,
        }
    }
}

/// (p-1)/p: the share of the buffer each rank sends in one phase of a ring, halving-doubling or
/// direct collective.
fn exact(p: u64) -> f64 {
    RingFactor::Exact.per_phase(p)
}

/// ⌈log2 p⌉ as a float (0 for p ≤ 1): the rounds of a tree, halving-doubling or dissemination.
pub fn log2_ceil(p: u64) -> f64 {
    (p.max(1) as f64).log2().ceil()
}

/// One message of `n` bytes over one link: `α + n/β` (004 eq. 28.10; 000 F3).
pub fn message(alpha: f64, beta: f64, n: f64) -> f64 {
    alpha + n / beta
}

/// One collective call to price: its link, its reduction cost, its bytes and its group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Call {
    /// Seconds per message (α).
    pub alpha: f64,
    /// Bytes per second in one direction (β); for the single-copy algorithms, the single-core
    /// read rate β_r.
    pub beta: f64,
    /// Seconds per reduced byte (γ); 0 leaves the reduction out, as the planner does.
    pub gamma: f64,
    /// Bytes (see the crate documentation for which buffer).
    pub n: f64,
    /// Ranks in the group.
    pub p: u64,
}

impl Call {
    /// This call without the reduction term (the collectives that only copy).
    fn copy_only(self) -> Call {
        Call { gamma: 0.0, ..self }
    }

    /// `formula` of this call's α, β, γ, n and p for a group of two or more; nothing (0) for a
    /// group of one.
    fn priced<T: Default>(self, formula: impl FnOnce(f64, f64, f64, f64, u64) -> T) -> T {
        let Call {
            alpha,
            beta,
            gamma,
            n,
            p,
        } = self;
        if p <= 1 {
            return T::default();
        }
        formula(alpha, beta, gamma, n, p)
    }

    /// Ring reduce-scatter: p-1 steps, each rank sending f·n in all and reducing what it
    /// receives: `(p-1)·α + f·n/β + f·n·γ`, f = [`RingFactor::per_phase`] (004 eq. 28.11;
    /// 000 F59, Table 6.4).
    pub fn ring_reduce_scatter(self, rf: RingFactor) -> f64 {
        self.priced(|alpha, beta, gamma, n, p| {
            let f = rf.per_phase(p);
            (p - 1) as f64 * alpha + f * n / beta + f * n * gamma
        })
    }

    /// Ring all-gather of a result of n bytes: the reduce-scatter's steps and bytes without the
    /// reduction, `(p-1)·α + f·n/β` (000 F59).
    pub fn ring_all_gather(self, rf: RingFactor) -> f64 {
        self.copy_only().ring_reduce_scatter(rf)
    }

    /// Ring all-reduce (reduce-scatter, then all-gather): `2(p-1)·α + 2f·n/β + f·n·γ`
    /// (004 eq. 28.12; 000 F16). 004 eq. 28.14: p = 8, m = 256 MiB, α = 5 µs, β = 25 GiB/s →
    /// 0.01757 s. The ring reduce (a reduce-scatter, then the root gathers the chunks) has the
    /// same steps and bytes, and this cost.
    pub fn ring_all_reduce(self, rf: RingFactor) -> f64 {
        self.priced(|alpha, beta, gamma, n, p| {
            let f = rf.per_phase(p);
            2.0 * (p - 1) as f64 * alpha + 2.0 * f * n / beta + f * n * gamma
        })
    }

    /// Pipelined chain broadcast in s = ⌈n / `segment_bytes`⌉ segments (at least 1):
    /// `(s + p - 2)·(α + n/s·β⁻¹)` (004 eq. 28.10 per step).
    pub fn ring_broadcast(self, segment_bytes: f64) -> f64 {
        self.priced(|alpha, beta, _, n, p| {
            let s = (n / segment_bytes).ceil().max(1.0);
            (s + p as f64 - 2.0) * message(alpha, beta, n / s)
        })
    }

    /// Pairwise all-to-all, n bytes per rank in all: p-1 rounds of one message to each peer,
    /// the ring all-gather's steps and bytes, `(p-1)·α + f·n/β` (000 F59: "(N-1)/N·M per
    /// worker").
    pub fn pairwise_all_to_all(self, rf: RingFactor) -> f64 {
        self.ring_all_gather(rf)
    }

    /// Unchunked binomial-tree reduce: `⌈log2 p⌉·(α + n/β + n·γ)` (004 eq. 28.13, one half).
    pub fn tree_reduce(self) -> f64 {
        self.priced(|alpha, beta, gamma, n, p| log2_ceil(p) * (alpha + n / beta + n * gamma))
    }

    /// Unchunked binomial-tree broadcast: the reduce without the reduction,
    /// `⌈log2 p⌉·(α + n/β)` (004 eq. 28.13, one half).
    pub fn tree_broadcast(self) -> f64 {
        self.copy_only().tree_reduce()
    }

    /// Unchunked binomial-tree all-reduce (reduce, then broadcast):
    /// `2⌈log2 p⌉·(α + n/β) + ⌈log2 p⌉·n·γ` (004 eq. 28.13).
    pub fn tree_all_reduce(self) -> f64 {
        self.priced(|alpha, beta, gamma, n, p| {
            let lg = log2_ceil(p);
            2.0 * lg * (alpha + n / beta) + lg * n * gamma
        })
    }

    /// Double binary tree all-reduce (NCCL's trees): two trees carrying n/2 each, at once,
    /// pipelined in s = ⌈(n/2) / `segment_bytes`⌉ segments per half (at least 1):
    /// `(s + 2⌈log2 p⌉ - 1)·(α + 2n/s·β⁻¹ + 1.5·n/s·γ)` (004 eq. 28.10 per round).
    pub fn double_tree_all_reduce(self, segment_bytes: f64) -> f64 {
        self.priced(|alpha, beta, gamma, n, p| {
            let s = (n / 2.0 / segment_bytes).ceil().max(1.0);
            (s + 2.0 * log2_ceil(p) - 1.0) * (alpha + 2.0 * n / s / beta + 1.5 * n / s * gamma)
        })
    }

    /// The fold of a non-power-of-two group, where `hd` prices it: `2α + (n + n/p)/β + n·γ`.
    fn fold(self, hd: HalvingDoubling) -> Option<f64> {
        self.priced(|alpha, beta, gamma, n, p| {
            (hd.fold && !p.is_power_of_two())
                .then(|| message(alpha, beta, n) + message(alpha, beta, n / p as f64) + n * gamma)
        })
    }

    /// Halving-doubling reduce-scatter (recursive halving): `⌈log2 p⌉·α + s·f·n/β + f·n·γ`,
    /// f = (p-1)/p, s = [`HalvingDoubling::store_and_forward`], plus the fold where priced
    /// (004 eqs. 28.10-28.12).
    pub fn halving_doubling_reduce_scatter(self, hd: HalvingDoubling) -> f64 {
        self.priced(|alpha, beta, gamma, n, p| {
            let f = exact(p);
            let fold = self.fold(hd).unwrap_or(0.0);
            log2_ceil(p) * alpha + hd.store_and_forward * f * n / beta + f * n * gamma + fold
        })
    }

    /// Halving-doubling all-gather (recursive doubling; Bruck's dissemination for other p,
    /// which needs no fold): `⌈log2 p⌉·α + s·f·n/β`.
    pub fn halving_doubling_all_gather(self, hd: HalvingDoubling) -> f64 {
        let no_fold = HalvingDoubling { fold: false, ..hd };
        self.copy_only().halving_doubling_reduce_scatter(no_fold)
    }

    /// Halving-doubling all-reduce (Rabenseifner): the ring's bytes in 2⌈log2 p⌉ steps,
    /// `2⌈log2 p⌉·α + s·2f·n/β + f·n·γ`; with the fold priced, a non-power of two takes one
    /// step fewer plus the fold (Thakur et al. 2005; 004 eqs. 28.10-28.12).
    pub fn halving_doubling_all_reduce(self, hd: HalvingDoubling) -> f64 {
        self.priced(|alpha, beta, gamma, n, p| {
            let lg = log2_ceil(p);
            let (steps, fold) = match self.fold(hd) {
                Some(fold) => (2.0 * lg - 1.0, fold),
                None => (2.0 * lg, 0.0),
            };
            let f = exact(p);
            steps * alpha + hd.store_and_forward * 2.0 * f * n / beta + f * n * gamma + fold
        })
    }

    /// Direct all-reduce: every rank sends its whole buffer to the p-1 others at once and
    /// reduces the p contributions, one step: `α + (p-1)·n/β + (p-1)·n·γ` (004 eqs.
    /// 28.10-28.12).
    pub fn direct_all_reduce(self) -> f64 {
        self.priced(|alpha, beta, gamma, n, p| {
            alpha + (p - 1) as f64 * n / beta + (p - 1) as f64 * n * gamma
        })
    }

    /// Direct reduce-scatter: member m receives chunk m from everyone at once, one step:
    /// `α + f·n/β + f·n·γ`, f = (p-1)/p.
    pub fn direct_reduce_scatter(self) -> f64 {
        self.priced(|alpha, beta, gamma, n, p| {
            let f = exact(p);
            alpha + f * n / beta + f * n * gamma
        })
    }

    /// Direct all-gather, or all-to-all, in one step: `α + f·n/β`, f = (p-1)/p.
    pub fn direct_all_gather(self) -> f64 {
        self.copy_only().direct_reduce_scatter()
    }

    /// Dissemination barrier (Hensgen-Finkel-Manber): ⌈log2 p⌉ rounds of empty messages,
    /// `⌈log2 p⌉·α`.
    pub fn dissemination_barrier(self) -> f64 {
        log2_ceil(self.p) * self.alpha
    }

    /// Single-copy all-reduce within one host (every rank reads its peers' buffers in place,
    /// `process_vm_readv`, β the single-core read rate β_r):
    /// `(2 + 2⌈log2 p⌉)·α + f·n·(2s/β_r + γ)`, s the ranks `sharing` a core (1 where β_r was
    /// measured with every rank busy).
    pub fn direct_read_all_reduce(self, sharing: f64) -> f64 {
        self.priced(|alpha, beta, gamma, n, p| {
            (2.0 + 2.0 * log2_ceil(p)) * alpha + exact(p) * n * (2.0 * sharing / beta + gamma)
        })
    }

    /// Single-copy reduce-scatter within one host (n the input):
    /// `(1 + ⌈log2 p⌉)·α + f·n·(s/β_r + γ) + s·n/p/β_r` (see [`Call::direct_read_all_reduce`]).
    pub fn direct_read_reduce_scatter(self, sharing: f64) -> f64 {
        self.priced(|alpha, beta, gamma, n, p| {
            (1.0 + log2_ceil(p)) * alpha
                + exact(p) * n * (sharing / beta + gamma)
                + sharing * n / p as f64 / beta
        })
    }

    /// Single-copy all-gather within one host (n the output): `(1 + ⌈log2 p⌉)·α + s·f·n/β_r`
    /// (see [`Call::direct_read_all_reduce`]).
    pub fn direct_read_all_gather(self, sharing: f64) -> f64 {
        self.priced(|alpha, beta, _, n, p| {
            (1.0 + log2_ceil(p)) * alpha + sharing * exact(p) * n / beta
        })
    }

    /// Single-copy broadcast within one host: `(1 + ⌈log2 p⌉)·α + s·n/β_r` (see
    /// [`Call::direct_read_all_reduce`]).
    pub fn direct_read_broadcast(self, sharing: f64) -> f64 {
        self.priced(|alpha, beta, _, n, p| (1.0 + log2_ceil(p)) * alpha + sharing * n / beta)
    }
}

/// How a halving-doubling (Rabenseifner) collective is priced beyond its textbook formula.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HalvingDoubling {
    /// Factor on the bandwidth term: each step's chunk is received whole before it is reduced
    /// and forwarded, where the pipelined ring overlaps them (1 for the textbook formula; the
    /// selector's is measured, `comm::model::STORE_AND_FORWARD`).
    pub store_and_forward: f64,
    /// Whether a non-power-of-two group pays MPICH's fold, as the implementation runs it: the
    /// all-reduce takes 2⌈log2 p⌉ - 1 steps plus a message of n, one of n/p back and the
    /// reduction of n. Without it every p is priced as a power of two in ⌈log2 p⌉ rounds each
    /// way.
    pub fold: bool,
}

impl HalvingDoubling {
    /// Thakur et al. 2005 (gloo `docs/algorithms.md` "2·lg(P) steps, 2·S bytes"): no penalty,
    /// no fold. The planner's pricing.
    pub const TEXTBOOK: HalvingDoubling = HalvingDoubling {
        store_and_forward: 1.0,
        fold: false,
    };
}

#[cfg(test)]
mod tests;
