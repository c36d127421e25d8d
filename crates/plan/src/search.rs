//! Layout search: every TP (inside the node), PP, DP, EP, micro-batch, interleaving, ZeRO stage
//! and recomputation that divides cleanly, filtered by memory, ranked by throughput.
//!
//! With a tie band ([`SearchOptions::tie_band`], e.g. [`MODEL_ERROR_BAND`]) the layouts whose
//! step time is within the band of the fastest are reported as ties ([`SearchResult::tied`])
//! and ordered by memory per GPU, least first: a difference smaller than the model's validated
//! error does not prove one layout faster, and the allocated peak the search fits against runs
//! short of what `nvidia-smi` shows (docs/PLAN-VALIDATION.md, "Layout search against published
//! choices").

use crate::cluster::Cluster;
use crate::error::Result;
use crate::job::Job;
use crate::layout::{Layout, Recompute, ZeroStage};
use crate::pipeline::Schedule;
use crate::step::{Evaluation, evaluate_valid};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What to search and how many to keep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchOptions {
    /// Layouts to keep.
    pub top_k: usize,
    /// Micro-batch sizes to try.
    pub micro_batches: Vec<u64>,
    /// Largest interleaving degree v.
    pub max_interleave: u64,
    /// Allow TP groups larger than a node (000 Q9 says never; off by default).
    pub tp_across_nodes: bool,
    /// Recomputation modes to try (default: none, selective, full). A framework without
    /// selective recomputation (before Korthikanti et al. 2022) is searched with none and full.
    #[serde(default = "all_recompute")]
    pub recompute: Vec<Recompute>,
    /// Whether the layouts use sequence parallelism when tp > 1 (default true; false for a
    /// framework without it).
    #[serde(default = "yes")]
    pub sequence_parallel: bool,
    /// Relative step-time band within which a layout counts as tied with the fastest feasible
    /// one (default 0: strict ranking by throughput, as before this field existed). Ties are
    /// ordered by memory per GPU, least first, then by throughput.
    #[serde(default)]
    pub tie_band: f64,
    /// ZeRO stages to try (default all four). A framework whose optimizer shards only the
    /// optimizer state (DeepSpeed's BF16_Optimizer) is searched with none and optimizer.
    #[serde(default = "all_zero")]
    pub zero: Vec<ZeroStage>,
    /// Also try the pipeline split with the embedding and the head in slots of their own
    /// ([`Layout::embedding_slots`]) where p·v divides L + 2 (default true).
    #[serde(default = "yes")]
    pub embedding_slots: bool,
}

/// Every ZeRO stage.
fn all_zero() -> Vec<ZeroStage> {
    vec![
        ZeroStage::None,
        ZeroStage::Optimizer,
        ZeroStage::Gradients,
        ZeroStage::Parameters,
    ]
}

/// The iteration-time error the planner is validated to on the published suite's dense runs
/// (issue 30's bar on the mean absolute error, 3%; met at 2.89%: docs/PLAN.md, "Validation").
/// Layouts priced closer than this to the fastest are not proven slower by the model.
pub const MODEL_ERROR_BAND: f64 = 0.03;

/// Every recomputation mode.
fn all_recompute() -> Vec<Recompute> {
    vec![Recompute::None, Recompute::Selective, Recompute::Full]
}

/// Serde default `true`.
fn yes() -> bool {
    true
}

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions {
            top_k: 5,
            micro_batches: vec![1, 2, 4, 8],
            max_interleave: 4,
            tp_across_nodes: false,
            recompute: all_recompute(),
            sequence_parallel: true,
            tie_band: 0.0,
            zero: all_zero(),
            embedding_slots: true,
        }
    }
}

/// The outcome of a search.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchResult {
    /// Layouts evaluated.
    pub evaluated: usize,
    /// Layouts that fit in memory.
    pub feasible: usize,
    /// Layouts skipped, by reason.
    pub rejected: BTreeMap<String, usize>,
    /// The best feasible layouts: the ties (see `tied`) least memory first, then the rest
    /// fastest first.
    pub top: Vec<Evaluation>,
    /// Feasible layouts whose step time is within [`SearchOptions::tie_band`] of the fastest
    /// (1 when the band is 0 and the fastest is unique; 0 when none fits).
    #[serde(default)]
    pub tied: usize,
    /// The fastest layout refused for memory, if it beats the best feasible one: the binding
    /// constraint.
    pub binding: Option<Evaluation>,
}

/// Divisors of n in increasing order, O(√n).
fn divisors(n: u64) -> Vec<u64> {
    let (mut lo, mut hi) = (Vec::new(), Vec::new());
    let mut d = 1;
    while d * d <= n {
        if n.is_multiple_of(d) {
            lo.push(d);
            if d != n / d {
                hi.push(n / d);
            }
        }
        d += 1;
    }
    lo.extend(hi.into_iter().rev());
    lo
}

/// The pipeline splits to try, as (pp, embedding slots), for each pipeline degree dividing
/// `devices`: (pp, false) where pp divides the layers, (pp, true) where it divides layers + 2
/// into stages of two slots or more and `slots` is set (embedding and head in slots of their
/// own; pp > 1). Also how many degrees neither divides.
fn pipeline_splits(layers: u64, devices: u64, slots: bool) -> (Vec<(u64, bool)>, usize) {
    let mut out = Vec::new();
    let mut undivided = 0;
    for pp in divisors(devices) {
        let even = layers.is_multiple_of(pp);
        let with_slots = slots && pp > 1 && 2 * pp <= layers + 2 && (layers + 2).is_multiple_of(pp);
        if even {
            out.push((pp, false));
        }
        if with_slots {
            out.push((pp, true));
        }
        if !even && !with_slots {
            undivided += 1;
        }
    }
    (out, undivided)
}

/// Searches all layouts of `job` on `cluster`.
pub fn search(job: &Job, cluster: &Cluster, opts: &SearchOptions) -> Result<SearchResult> {
    cluster.device.peak(job.precision)?;
    let m = &job.model;
    let n = cluster.devices();
    let mut rejected: BTreeMap<String, usize> = BTreeMap::new();
    let mut reject = |k: &str| *rejected.entry(k.to_string()).or_default() += 1;
    let mut feasible: Vec<Evaluation> = Vec::new();
    let mut binding: Option<Evaluation> = None;
    let mut evaluated = 0;
    let tp_max = if opts.tp_across_nodes {
        n
    } else {
        cluster.devices_per_node
    };
    for tp in divisors(n).into_iter().filter(|&t| t <= tp_max) {
        if !m.heads.is_multiple_of(tp) || (!m.kv_heads.is_multiple_of(tp) && tp % m.kv_heads != 0) {
            reject("tp does not divide heads");
            continue;
        }
        let (splits, undivided) = pipeline_splits(m.layers, n / tp, opts.embedding_slots);
        for _ in 0..undivided {
            reject("pp does not divide layers");
        }
        for (pp, slots) in splits {
            let dp = n / (tp * pp);
            let eps: Vec<u64> = if m.experts > 1 {
                divisors(dp)
                    .into_iter()
                    .filter(|e| m.experts.is_multiple_of(*e))
                    .collect()
            } else {
                vec![1]
            };
            for &ep in &eps {
                for &mb in &opts.micro_batches {
                    if !job.global_batch.is_multiple_of(dp * mb) {
                        reject("dp x micro_batch does not divide global_batch");
                        continue;
                    }
                    let micro = job.global_batch / (dp * mb);
                    let mut scheds = vec![(Schedule::OneFOneB, 1)];
                    if pp > 1 {
                        let mut v = 2;
                        while v <= opts.max_interleave {
                            let split = if slots { m.layers + 2 } else { m.layers };
                            if split.is_multiple_of(pp * v) && micro.is_multiple_of(pp) {
                                scheds.push((Schedule::Interleaved, v));
                            }
                            v *= 2;
                        }
                    }
                    for &(schedule, interleave) in &scheds {
                        for &zero in &opts.zero {
                            if dp == 1 && zero != ZeroStage::None {
                                continue;
                            }
                            for &recompute in &opts.recompute {
                                let l = Layout {
                                    tp,
                                    pp,
                                    dp,
                                    ep,
                                    micro_batch: mb,
                                    interleave,
                                    schedule,
                                    zero,
                                    recompute,
                                    sequence_parallel: opts.sequence_parallel,
                                    vocab_parallel: true,
                                    embedding_slots: slots,
                                    ..Layout::new(tp, pp, dp)
                                };
                                if job.pipeline_engine.check(&l).is_err() {
                                    reject("the pipeline engine cannot run it");
                                    continue;
                                }
                                let e = evaluate_valid(job, cluster, &l, false)?;
                                evaluated += 1;
                                if e.memory.fits() {
                                    feasible.push(e);
                                } else {
                                    reject("out of memory");
                                    if binding
                                        .as_ref()
                                        .is_none_or(|b| e.tokens_per_s > b.tokens_per_s)
                                    {
                                        binding = Some(e);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    let count = feasible.len();
    feasible.sort_by(|a, b| {
        b.tokens_per_s
            .total_cmp(&a.tokens_per_s)
            .then(a.memory.total.total_cmp(&b.memory.total))
    });
    let fastest = feasible.first().map_or(0.0, |e| e.tokens_per_s);
    // Tokens per second are inversely proportional to the step time: within the band of the
    // fastest step time means at least fastest / (1 + band) tokens per second.
    let floor = fastest / (1.0 + opts.tie_band.max(0.0));
    let tied = feasible
        .iter()
        .take_while(|e| e.tokens_per_s >= floor)
        .count();
    feasible[..tied].sort_by(|a, b| {
        a.memory
            .total
            .total_cmp(&b.memory.total)
            .then(b.tokens_per_s.total_cmp(&a.tokens_per_s))
    });
    feasible.truncate(opts.top_k.max(1));
    // Re-evaluate the kept ones with explanations.
    let top = feasible
        .iter()
        .map(|e| evaluate_valid(job, cluster, &e.layout, true))
        .collect::<Result<Vec<_>>>()?;
    let binding = binding.filter(|b| top.is_empty() || b.tokens_per_s > fastest);
    Ok(SearchResult {
        evaluated,
        feasible: count,
        rejected,
        top,
        tied,
        binding,
    })
}
