//! The seeds' fallacies and pitfalls as warnings with the numbers that trigger them (000 §6
//! "谬误与陷阱" P1–P10 and the pitfall boxes Q1–Q23; 004 §28 pitfalls).

use crate::cluster::Cluster;
use crate::data::prefetch_depth;
use crate::job::Job;
use crate::layout::ZeroStage;
use crate::memory::device_memory;
use crate::reliability::{checkpoint_overhead, cluster_mtbf, young_interval};
use crate::step::Evaluation;
use crate::storage::min_write_time;
use crate::units::{GB, fmt_time};
use serde::{Deserialize, Serialize};

/// One finding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Warning {
    /// Stable code ("tp-across-nodes").
    pub code: String,
    /// The finding with its numbers.
    pub message: String,
    /// Seed citation.
    pub cite: String,
}

/// Thresholds (defaults from the seeds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LintConfig {
    /// Largest acceptable bubble fraction (000 Q8: 10–20%).
    pub max_bubble: f64,
    /// Largest acceptable ratio of the checkpoint overhead to its optimum (000 P10).
    pub max_ckpt_overhead_ratio: f64,
    /// Largest acceptable exposed-communication share of the step (000 P1).
    pub max_exposed_comm: f64,
}

impl Default for LintConfig {
    fn default() -> Self {
        LintConfig {
            max_bubble: 0.10,
            max_ckpt_overhead_ratio: 1.5,
            max_exposed_comm: 0.30,
        }
    }
}

/// Checkpoint pause C: the job's `write_s`, else state bytes (weights + optimizer) / storage
/// write bandwidth; None when neither is known.
pub fn checkpoint_write_time(job: &Job, cluster: &Cluster) -> Option<f64> {
    let c = job.checkpoint.as_ref()?;
    c.write_s.or_else(|| {
        cluster
            .storage_write
            .map(|bw| checkpoint_state_bytes(job) / bw)
    })
}

/// Bytes of one checkpoint: params × (w + K) (000 part 1 S03 counts weights and optimizer).
pub fn checkpoint_state_bytes(job: &Job) -> f64 {
    job.model.params() * (job.precision.bytes() + job.optimizer_bytes)
}

/// Runs every check against an evaluated layout.
pub fn lint(job: &Job, cluster: &Cluster, e: &Evaluation, cfg: &LintConfig) -> Vec<Warning> {
    let mut w = Vec::new();
    let mut warn = |code: &str, message: String, cite: &str| {
        w.push(Warning {
            code: code.into(),
            message,
            cite: cite.into(),
        })
    };
    let l = &e.layout;
    let dpn = cluster.devices_per_node;
    if !e.memory.fits() {
        warn(
            "out-of-memory",
            format!(
                "needs {:.1} GB per device (weights {:.1} + grads {:.1} + optimizer {:.1} + activations {:.1} + reserve {:.1}{}) > HBM {:.1} GB",
                e.memory.total / GB,
                e.memory.weights / GB,
                e.memory.grads / GB,
                e.memory.optimizer / GB,
                e.memory.activations.max(e.memory.step_transient) / GB,
                e.memory.reserve / GB,
                if e.memory.context > 0.0 {
                    format!(" + context {:.1}", e.memory.context / GB)
                } else {
                    String::new()
                },
                e.memory.capacity / GB
            ),
            "000 §2.21, Q22-Q23",
        );
    }
    if l.tp > dpn {
        warn(
            "tp-across-nodes",
            format!(
                "tp {} > {dpn} devices per node: the per-layer collectives cross the inter-node link ({:.0} GB/s vs {:.0} GB/s intra-node)",
                l.tp,
                cluster.inter.beta / GB,
                cluster.intra.beta / GB
            ),
            "000 Q9, Q13, P5",
        );
    }
    if e.bubble_fraction > cfg.max_bubble {
        let need = crate::pipeline::min_microbatches_for_bubble(l.pp, cfg.max_bubble);
        warn(
            "pipeline-bubble",
            format!(
                "bubble {:.1}% = (p-1)/(v*m+p-1) with p={}, m={}, v={} exceeds {:.0}%; 1F1B needs m >= {need}",
                e.bubble_fraction * 100.0,
                l.pp,
                e.microbatches,
                l.interleave,
                cfg.max_bubble * 100.0
            ),
            "000 Q8, F41",
        );
    }
    if let Some(bc) = job.critical_batch
        && job.global_batch as f64 > bc
    {
        warn(
            "batch-above-critical",
            format!(
                "global batch {} > critical batch B* {bc}: extra devices buy throughput, not progress (useful workers <= B*/b)",
                job.global_batch
            ),
            "000 P4, Q6, F36-F37",
        );
    }
    if l.zero != ZeroStage::None {
        let plain = device_memory(
            job,
            cluster,
            &crate::layout::Layout {
                zero: ZeroStage::None,
                ..l.clone()
            },
        );
        if plain.fits() {
            warn(
                "zero-not-needed",
                format!(
                    "ZeRO-{} is on but plain DP fits ({:.1} GB <= {:.1} GB); sharding costs {} of communication per step",
                    l.zero as u8,
                    plain.total / GB,
                    plain.capacity / GB,
                    fmt_time(e.step.dp_comm)
                ),
                "000 P6 (7B: DDP 145 vs FSDP 118 samples/s)",
            );
        }
    }
    let exposed = e.step.tp_comm + e.step.pp_comm + e.step.ep_comm + e.step.dp_exposed;
    if exposed / e.step.total > cfg.max_exposed_comm {
        warn(
            "communication-bound",
            format!(
                "exposed communication is {:.0}% of the step: scaling is far from linear",
                100.0 * exposed / e.step.total
            ),
            "000 P1, P8, F22",
        );
    }
    let m = cluster_mtbf(cluster.device_mtbf_s, cluster.devices());
    if let (Some(ck), Some(c)) = (&job.checkpoint, checkpoint_write_time(job, cluster)) {
        let opt = young_interval(c, m);
        let w_opt = checkpoint_overhead(opt, c, m, ck.restart_s);
        if let Some(tau) = ck.interval_s {
            let w_tau = checkpoint_overhead(tau, c, m, ck.restart_s);
            if w_tau > cfg.max_ckpt_overhead_ratio * w_opt {
                warn(
                    "checkpoint-interval",
                    format!(
                        "interval {} costs {:.1}% vs {:.1}% at the Young optimum sqrt(2CM) = {} (C = {}, M = {})",
                        fmt_time(tau),
                        w_tau * 100.0,
                        w_opt * 100.0,
                        fmt_time(opt),
                        fmt_time(c),
                        fmt_time(m)
                    ),
                    "000 P10, 004 eqs. 28.23-28.24",
                );
            }
        }
        if let (Some(win), Some(bw)) = (ck.window_s, cluster.storage_write) {
            let t = min_write_time(checkpoint_state_bytes(job), bw);
            if t > win {
                warn(
                    "storage-window",
                    format!(
                        "checkpoint of {:.0} GB needs {} at {:.1} GB/s free > window {}",
                        checkpoint_state_bytes(job) / GB,
                        fmt_time(t),
                        bw / GB,
                        fmt_time(win)
                    ),
                    "004 eq. 28.21",
                );
            }
        }
    }
    if let Some(d) = &job.data {
        let q = prefetch_depth(d.io_p99_s, e.step.total);
        if d.prefetch_depth < q {
            warn(
                "prefetch-depth",
                format!(
                    "prefetch depth {} < ceil(P99 {} / step {}) = {q}",
                    d.prefetch_depth,
                    fmt_time(d.io_p99_s),
                    fmt_time(e.step.total)
                ),
                "000 eq. 4.3",
            );
        }
    }
    if let Some(dl) = job.deadline_s
        && e.time_to_train_s > dl
    {
        warn(
            "deadline",
            format!(
                "time to train {} > deadline {}",
                fmt_time(e.time_to_train_s),
                fmt_time(dl)
            ),
            "004 example 27.3",
        );
    }
    w
}
