//! Which assignments are kept, and where their rows travel.
//!
//! One forward exchanges, in order (every wait bounded by the group's
//! timeout):
//!
//! 1. **Counts** — an all-gather of each rank's (E + 2) vector: assignments
//!    routed to each expert, its token count, and a config fingerprint
//!    (ranks built with different settings are refused here). Every rank then knows
//!    the (ep, E) count matrix, hence N_global, the capacity and, by prefix
//!    sums over ranks, how many of its own assignments each expert keeps:
//!    `kept[r][e] = min(routed[r][e], max(0, cap − Σ_{s<r} routed[s][e]))`.
//!    This is capacity per expert *globally* in global token order, so a
//!    rank drops before it sends and no dropped row crosses the network.
//! 2. **Dispatch** — an all-to-all-v of token rows. Rank r's send buffer
//!    is expert-major (experts of rank 0 first, since ranks own contiguous
//!    expert ranges), tokens in order inside each expert. Rank q receives,
//!    per source s, its El experts' rows; [`Exchange::perm`] reorders them
//!    expert-major with sources in rank order, i.e. every expert sees its
//!    rows in global token order, exactly as with ep = 1.
//! 3. **Combine** — the inverse: expert outputs back in the receive order,
//!    an all-to-all-v with the counts swapped, and each source finds its
//!    rows in its own send order.
//!
//! Backward repeats 2 and 3 with the gradients (dispatch ↔ combine
//! swapped). Volume (F50): each direction moves Σ kept · C elements per
//! layer, i.e. N·k·C·sizeof(T) with no drops; the (ep−1)/ep off-rank share
//! is F59's all-to-all term.
use super::{MoeConfig, MoeStats};
use crate::error::{ModelError, Result};

/// The collectives expert parallelism needs over the EP group: Megatron's expert dispatch and
/// combine (the all-to-alls) and the small exchanges around them. [`Local`] is the one-rank
/// group; the training crate implements it over a process group.
pub trait ExpertComm<T> {
    /// ep, the group size.
    fn size(&self) -> usize;
    /// This rank.
    fn rank(&self) -> usize;
    /// Concatenate every rank's equal-length `input` into `output` (rank order).
    ///
    /// # Errors
    /// [`ModelError::Comm`] when the collective fails.
    fn all_gather_i64(&mut self, input: &[i64], output: &mut [i64]) -> Result<()>;
    /// Element-wise sum of `buf` over the group, in place.
    ///
    /// # Errors
    /// [`ModelError::Comm`] when the collective fails.
    fn all_reduce_sum(&mut self, buf: &mut [T]) -> Result<()>;
    /// Element-wise sum of `buf` over the group, in place.
    ///
    /// # Errors
    /// [`ModelError::Comm`] when the collective fails.
    fn all_reduce_sum_i64(&mut self, buf: &mut [i64]) -> Result<()>;
    /// `send[j]` elements of `input` go to rank j, `recv[j]` come from it: the dispatch and
    /// the combine.
    ///
    /// # Errors
    /// [`ModelError::Comm`] when the collective fails.
    fn all_to_all_v(
        &mut self,
        input: &[T],
        send: &[usize],
        output: &mut [T],
        recv: &[usize],
    ) -> Result<()>;
}

/// The one-rank group: every collective is a copy.
#[derive(Clone, Copy, Debug, Default)]
pub struct Local;

impl<T: Copy> ExpertComm<T> for Local {
    fn size(&self) -> usize {
        1
    }
    fn rank(&self) -> usize {
        0
    }
    fn all_gather_i64(&mut self, input: &[i64], output: &mut [i64]) -> Result<()> {
        super::check_len("ep all-gather output", input.len(), output.len())?;
        output.copy_from_slice(input);
        Ok(())
    }
    fn all_reduce_sum(&mut self, _buf: &mut [T]) -> Result<()> {
        Ok(())
    }
    fn all_reduce_sum_i64(&mut self, _buf: &mut [i64]) -> Result<()> {
        Ok(())
    }
    fn all_to_all_v(
        &mut self,
        input: &[T],
        _: &[usize],
        output: &mut [T],
        _: &[usize],
    ) -> Result<()> {
        super::check_len("ep all-to-all output", input.len(), output.len())?;
        output.copy_from_slice(input);
        Ok(())
    }
}

/// F50 (000 L2519): bytes one all-to-all direction moves for `tokens`
/// tokens of width `c` each routed to `k` experts with none dropped,
/// `tokens · k · c · elem_bytes` (the seed's B·S·d_model·2 for k = 1 in
/// FP16); dispatch and combine together move twice this per layer and
/// pass, of which F59's (ep − 1)/ep share leaves the ranks under uniform
/// routing.
pub fn a2a_bytes_one_way(tokens: usize, k: usize, c: usize, elem_bytes: usize) -> usize {
    tokens * k * c * elem_bytes
}

/// Slots per rank in the step-1 all-gather: E counts, N, the config fingerprint.
pub fn count_slots(cfg: &MoeConfig) -> usize {
    cfg.experts + 2
}

/// A hash of every [`MoeConfig`] field, so ranks built with different
/// settings fail in step 1 instead of exchanging mismatched rows.
fn fingerprint(cfg: &MoeConfig) -> i64 {
    let fields = [
        cfg.experts as u64,
        cfg.top_k as u64,
        cfg.channels as u64,
        cfg.hidden as u64,
        cfg.capacity_factor.to_bits(),
        cfg.aux_weight.to_bits(),
        cfg.activation as u64,
        u64::from(cfg.bias),
    ];
    // FNV-1a over the fields' bytes.
    let h = fields
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    h as i64
}

/// Rank-local vector for step 1 ([`count_slots`] long): assignments routed
/// to each expert (E), the token count N, the config fingerprint.
/// choice: (N, k).
pub fn local_counts(cfg: &MoeConfig, choice: &[usize], n: usize) -> Vec<i64> {
    let e = cfg.experts;
    let mut c = vec![0i64; count_slots(cfg)];
    for &i in &choice[..n * cfg.top_k] {
        c[i] += 1;
    }
    c[e] = n as i64;
    c[e + 1] = fingerprint(cfg);
    c
}

/// One forward's routing plan on one rank: what it sends, what it
/// receives, and how received rows map to its experts.
#[derive(Clone, Debug, Default)]
pub struct Exchange {
    /// Assignments `t·k + j` this rank sends, in send order (expert-major,
    /// token order within an expert).
    pub send: Vec<usize>,
    /// (ep) rows sent to each rank.
    pub send_rows: Vec<usize>,
    /// (ep) rows received from each rank.
    pub recv_rows: Vec<usize>,
    /// (R) expert-major row i is received row `perm[i]`.
    pub perm: Vec<usize>,
    /// (El) rows of each local expert (consecutive in expert-major order).
    pub expert_rows: Vec<usize>,
    /// Global routing metrics (`dropped_tokens` still rank-local, byte
    /// counts not yet filled).
    pub stats: MoeStats,
}

impl Exchange {
    /// The plan of `rank` from the all-gathered counts `all` ((ep, E + 2),
    /// see [`local_counts`]) and its own choices (N, k); refuses counts
    /// from a rank whose config differs from this one's.
    pub fn plan(
        cfg: &MoeConfig,
        all: &[i64],
        rank: usize,
        choice: &[usize],
        n: usize,
    ) -> Result<Self> {
        let (e, k, w) = (cfg.experts, cfg.top_k, count_slots(cfg));
        let ep = all.len() / w;
        let el = e / ep.max(1);
        if let Some(r) = (0..ep).find(|&r| all[r * w + e + 1] != fingerprint(cfg)) {
            return Err(ModelError::Config {
                field: "moe config",
                value: format!("rank {r} of the EP group"),
                reason: format!(
                    "differs from rank {rank}'s {cfg:?}; every rank must build the layer with the same settings"
                ),
            });
        }
        let at = |r: usize, i: usize| all[r * w + i].max(0) as usize;
        let n_global: usize = (0..ep).map(|r| at(r, e)).sum();
        let cap = cfg.capacity(n_global);
        // kept[r][i]: rank r's first kept[r][i] assignments to expert i survive.
        let mut kept = vec![0usize; ep * e];
        let mut routed = vec![0usize; e];
        for i in 0..e {
            let mut before = 0usize;
            for r in 0..ep {
                let c = at(r, i);
                kept[r * e + i] = c.min(cap.saturating_sub(before));
                before += c;
            }
            routed[i] = before;
        }
        let kept_global: Vec<usize> = (0..e)
            .map(|i| (0..ep).map(|r| kept[r * e + i]).sum())
            .collect();

        // Send list: expert-major, token order inside, first kept[rank][i] of each.
        let mut per_expert: Vec<Vec<usize>> = vec![Vec::new(); e];
        for (a, &i) in choice[..n * k].iter().enumerate() {
            if per_expert[i].len() < kept[rank * e + i] {
                per_expert[i].push(a);
            }
        }
        let mut dropped_tokens = 0;
        for t in 0..n {
            let any = (0..k).any(|j| {
                let i = choice[t * k + j];
                per_expert[i].binary_search(&(t * k + j)).is_ok()
            });
            dropped_tokens += usize::from(!any);
        }
        let send_rows: Vec<usize> = (0..ep)
            .map(|q| (q * el..(q + 1) * el).map(|i| per_expert[i].len()).sum())
            .collect();
        let send: Vec<usize> = per_expert.into_iter().flatten().collect();

        // Receive side: from source s come its kept rows for my experts.
        let mine = rank * el..(rank + 1) * el;
        let recv_rows: Vec<usize> = (0..ep)
            .map(|s| mine.clone().map(|i| kept[s * e + i]).sum())
            .collect();
        // Offset of (source s, local expert le) in the receive buffer.
        let mut off = vec![0usize; ep * el];
        let mut o = 0;
        for s in 0..ep {
            for le in 0..el {
                off[s * el + le] = o;
                o += kept[s * e + mine.start + le];
            }
        }
        let mut perm = Vec::with_capacity(o);
        let mut expert_rows = vec![0usize; el];
        for le in 0..el {
            for s in 0..ep {
                let cnt = kept[s * e + mine.start + le];
                perm.extend(off[s * el + le]..off[s * el + le] + cnt);
                expert_rows[le] += cnt;
            }
        }
        let dropped_assignments = routed.iter().sum::<usize>() - kept_global.iter().sum::<usize>();
        let stats = MoeStats {
            tokens: n_global,
            capacity: cap,
            routed,
            kept: kept_global,
            dropped_assignments,
            dropped_tokens,
            ..MoeStats::default()
        };
        Ok(Self {
            send,
            send_rows,
            recv_rows,
            perm,
            expert_rows,
            stats,
        })
    }
}

/// Row gather: `out[i] = src[idx[i]]`, rows of `c` elements.
///
/// out: (len(idx), C), src: (rows, C).
pub fn gather_rows<T: Copy>(out: &mut [T], src: &[T], idx: &[usize], c: usize) {
    for (o, &r) in out.chunks_exact_mut(c).zip(idx) {
        o.copy_from_slice(&src[r * c..(r + 1) * c]);
    }
}

/// Row scatter (the inverse permutation): `out[idx[i]] = src[i]`.
///
/// out: (rows, C), src: (len(idx), C).
pub fn scatter_rows<T: Copy>(out: &mut [T], src: &[T], idx: &[usize], c: usize) {
    for (s, &r) in src.chunks_exact(c).zip(idx) {
        out[r * c..(r + 1) * c].copy_from_slice(s);
    }
}
