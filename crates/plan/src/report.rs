//! The planner's front door: evaluate a fixed layout or search, lint the result, and render a
//! table (or JSON through serde).

use crate::cluster::Cluster;
use crate::data::required_bandwidth;
use crate::error::Result;
use crate::job::Job;
use crate::lint::{LintConfig, Warning, checkpoint_state_bytes, checkpoint_write_time, lint};
use crate::reliability::{checkpoint_overhead, cluster_mtbf, daly_interval, young_interval};
use crate::search::{SearchOptions, SearchResult, search};
use crate::step::{Evaluation, Term, evaluate};
use crate::units::{GB, fmt_bytes, fmt_time};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// Layout-independent numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Model name.
    pub model: String,
    /// Parameters.
    pub params: f64,
    /// Parameters active per token.
    pub active_params: f64,
    /// Model FLOPs per token.
    pub flops_per_token: f64,
    /// Devices.
    pub devices: u64,
    /// Device name.
    pub device: String,
    /// Tokens per step.
    pub tokens_per_step: f64,
    /// Cluster MTBF, seconds (000 F4b).
    pub cluster_mtbf_s: f64,
    /// Checkpoint bytes (weights + optimizer).
    pub checkpoint_bytes: f64,
    /// Checkpoint pause C, seconds, when known.
    pub checkpoint_write_s: Option<f64>,
    /// Young interval √(2CM), when C is known.
    pub young_s: Option<f64>,
    /// Daly interval, when C is known.
    pub daly_s: Option<f64>,
    /// Overhead C/τ + τ/2M + R/M at the Young interval.
    pub overhead_at_optimum: Option<f64>,
    /// The reliability, checkpoint and memory formulas with their inputs (for `--explain`).
    pub terms: Vec<Term>,
}

/// A full plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Layout-independent numbers.
    pub summary: Summary,
    /// The evaluated layout (the job's, or the search's best).
    pub evaluation: Option<Evaluation>,
    /// The search, when run.
    pub search: Option<SearchResult>,
    /// Linter findings on `evaluation`.
    pub warnings: Vec<Warning>,
    /// Storage bandwidth the data pipeline needs (000 eq. 4.1, η = 1), bytes/s.
    pub data_bandwidth: Option<f64>,
}

/// Plans `job` on `cluster`: evaluates `job.layout` if given and `search` is None; otherwise
/// searches (with default options when `search` is None and there is no layout).
pub fn plan(job: &Job, cluster: &Cluster, search_opts: Option<&SearchOptions>) -> Result<Report> {
    let m = &job.model;
    let mtbf = cluster_mtbf(cluster.device_mtbf_s, cluster.devices());
    let c = checkpoint_write_time(job, cluster);
    let restart = job.checkpoint.as_ref().map_or(0.0, |c| c.restart_s);
    let young = c.map(|c| young_interval(c, mtbf));
    let summary = Summary {
        model: m.name.clone(),
        params: m.params(),
        active_params: m.active_params(),
        flops_per_token: m.flops_per_token(),
        devices: cluster.devices(),
        device: cluster.device.name.clone(),
        tokens_per_step: job.tokens_per_step(),
        cluster_mtbf_s: mtbf,
        checkpoint_bytes: checkpoint_state_bytes(job),
        checkpoint_write_s: c,
        young_s: young,
        daly_s: c.map(|c| daly_interval(c, mtbf)),
        overhead_at_optimum: c
            .zip(young)
            .map(|(c, y)| checkpoint_overhead(y, c, mtbf, restart)),
        terms: Vec::new(),
    };
    let mut summary = summary;
    summary.terms = reliability_terms(job, cluster, &summary, restart);
    let default_opts = SearchOptions::default();
    let (evaluation, search_result) = match (&job.layout, search_opts) {
        (Some(l), None) => (Some(evaluate(job, cluster, l)?), None),
        (_, opts) => {
            let r = search(job, cluster, opts.unwrap_or(&default_opts))?;
            (r.top.first().cloned(), Some(r))
        }
    };
    if let Some(e) = &evaluation {
        summary.terms.extend(memory_terms(job, e));
    }
    let warnings = evaluation
        .as_ref()
        .map(|e| lint(job, cluster, e, &LintConfig::default()))
        .unwrap_or_default();
    let data_bandwidth = match (&job.data, &evaluation) {
        (Some(d), Some(e)) => Some(required_bandwidth(
            e.layout.dp,
            1.0,
            d.bytes_per_sample * (job.global_batch / e.layout.dp) as f64,
            e.step.total,
        )),
        _ => None,
    };
    Ok(Report {
        summary,
        evaluation,
        search: search_result,
        warnings,
        data_bandwidth,
    })
}

fn term(name: &str, formula: String, value: f64, cite: &str) -> Term {
    Term {
        name: name.into(),
        formula,
        value,
        cite: cite.into(),
    }
}

/// Cluster MTBF, checkpoint size and, when the pause C is known, Young, Daly and the overhead.
fn reliability_terms(job: &Job, cluster: &Cluster, s: &Summary, restart: f64) -> Vec<Term> {
    let hours = cluster.device_mtbf_s / 3600.0;
    let mut t = vec![
        term(
            "mtbf",
            format!(
                "M = M_device / N = {hours:.0} h / {} = {}",
                s.devices,
                fmt_time(s.cluster_mtbf_s)
            ),
            s.cluster_mtbf_s,
            "000 F4b",
        ),
        term(
            "ckpt_size",
            format!(
                "P x (w + k) = {:.3e} x ({} + {}) B = {}",
                job.model.params(),
                job.precision.bytes(),
                job.optimizer_bytes,
                fmt_bytes(s.checkpoint_bytes)
            ),
            s.checkpoint_bytes,
            "000 S03",
        ),
    ];
    if let (Some(c), Some(y), Some(d), Some(w)) = (
        s.checkpoint_write_s,
        s.young_s,
        s.daly_s,
        s.overhead_at_optimum,
    ) {
        let m = s.cluster_mtbf_s;
        t.push(term(
            "young",
            format!(
                "tau* = sqrt(2 C M) = sqrt(2 x {} x {}) = {}",
                fmt_time(c),
                fmt_time(m),
                fmt_time(y)
            ),
            y,
            "000 F4, 004 eq. 28.24",
        ));
        t.push(term(
            "daly",
            format!(
                "sqrt(2CM) [1 + sqrt(C/2M)/3 + (C/2M)/9] - C = {}",
                fmt_time(d)
            ),
            d,
            "Daly 2006 eq. 37",
        ));
        t.push(term(
            "overhead",
            format!(
                "C/tau + tau/2M + R/M = {} / {} + {} / (2 x {}) + {} / {} = {:.2}%",
                fmt_time(c),
                fmt_time(y),
                fmt_time(y),
                fmt_time(m),
                fmt_time(restart),
                fmt_time(m),
                w * 100.0
            ),
            w,
            "004 eq. 28.23, 000 F4c",
        ));
    }
    t
}

/// Where the evaluated layout's memory per device comes from.
fn memory_terms(job: &Job, e: &Evaluation) -> Vec<Term> {
    let mm = &e.memory;
    let l = &e.layout;
    vec![
        term(
            "mem_state",
            format!(
                "P_local = {:.3e} (tp {}, pp {}, ep {}); ZeRO-{} over dp {}: weights {} + grads {} + optimizer {} (w = g = {} B, k = {} B)",
                mm.params_local,
                l.tp,
                l.pp,
                l.ep,
                l.zero as u8,
                l.dp,
                fmt_bytes(mm.weights),
                fmt_bytes(mm.grads),
                fmt_bytes(mm.optimizer),
                job.precision.bytes(),
                job.optimizer_bytes
            ),
            mm.weights + mm.grads + mm.optimizer,
            "000 ZeRO: 2+2+K, 2+2+K/N, 2+(2+K)/N, (2+2+K)/N",
        ),
        term(
            "mem_act",
            format!(
                "per layer s b h (34 + 5 a s / h) (/ t with SP; selective drops 5 a s / h, full keeps 2 s b h), {:?} recomputation, x layers per stage x micro-batches in flight on stage 0 = {}",
                l.recompute,
                fmt_bytes(mm.activations)
            ),
            mm.activations,
            "000 §2.21; Korthikanti et al. 2022",
        ),
    ]
}

fn layout_cell(e: &Evaluation) -> String {
    let l = &e.layout;
    let mut s = format!("tp{} pp{} dp{}", l.tp, l.pp, l.dp);
    if l.ep > 1 {
        let _ = write!(s, " ep{}", l.ep);
    }
    if l.cp > 1 {
        let _ = write!(s, " cp{}", l.cp);
    }
    let _ = write!(s, " mb{} m{}", l.micro_batch, e.microbatches);
    if l.interleave > 1 {
        let _ = write!(s, " v{}", l.interleave);
    }
    let _ = write!(s, " z{} {:?}", l.zero as u8, l.recompute);
    s.to_lowercase()
}

/// Renders a readable report; `explain` adds every formula with its inputs.
pub fn render(r: &Report, explain: bool) -> String {
    let s = &r.summary;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "model {}: {:.1}B params ({:.1}B active), {:.3e} FLOP/token; {} x {}; {:.0} tokens/step",
        s.model,
        s.params / 1e9,
        s.active_params / 1e9,
        s.flops_per_token,
        s.devices,
        s.device,
        s.tokens_per_step
    );
    let _ = writeln!(
        o,
        "cluster MTBF {} (000 F4b); checkpoint {}",
        fmt_time(s.cluster_mtbf_s),
        fmt_bytes(s.checkpoint_bytes)
    );
    if let (Some(c), Some(y), Some(d), Some(w)) = (
        s.checkpoint_write_s,
        s.young_s,
        s.daly_s,
        s.overhead_at_optimum,
    ) {
        let _ = writeln!(
            o,
            "checkpoint pause {}: Young {} / Daly {}, overhead {:.2}% (004 eqs. 28.23-28.24)",
            fmt_time(c),
            fmt_time(y),
            fmt_time(d),
            w * 100.0
        );
    }
    if let Some(sr) = &r.search {
        let _ = writeln!(
            o,
            "search: {} layouts evaluated, {} fit; skipped {:?}",
            sr.evaluated, sr.feasible, sr.rejected
        );
        if sr.top.is_empty() {
            let _ = writeln!(
                o,
                "no layout fits this job on this cluster: {} evaluated, {} within memory \
                 (the layouts skipped and why are in the line above)",
                sr.evaluated, sr.feasible
            );
        } else {
            let shown = sr.tied.min(sr.top.len());
            if shown > 1 {
                let _ = writeln!(
                    o,
                    "the first {shown} are tied: priced within the tie band of the fastest, \
                     listed by memory per GPU"
                );
            }
            let _ = writeln!(
                o,
                "\n{:<4} {:<44} {:>12} {:>6} {:>10} {:>9} {:>8} {:<16}",
                "rank", "layout", "tokens/s", "MFU", "step", "mem GB", "bubble", "bound"
            );
        }
        for (i, e) in sr.top.iter().enumerate() {
            let _ = writeln!(
                o,
                "{:<4} {:<44} {:>12.0} {:>5.1}% {:>10} {:>9.1} {:>7.1}% {:<16}",
                i + 1,
                layout_cell(e),
                e.tokens_per_s,
                e.mfu * 100.0,
                fmt_time(e.step.total),
                e.memory.total / GB,
                e.bubble_fraction * 100.0,
                e.bound
            );
        }
        if let Some(b) = &sr.binding {
            let _ = writeln!(
                o,
                "binding constraint: memory; {} would give {:.0} tokens/s but needs {:.1} GB > {:.1} GB",
                layout_cell(b),
                b.tokens_per_s,
                b.memory.total / GB,
                b.memory.capacity / GB
            );
        }
    }
    if let Some(e) = &r.evaluation {
        let st = &e.step;
        let _ = writeln!(o, "\nlayout {}", layout_cell(e));
        let _ = writeln!(
            o,
            "step {} = compute {} + bubble {} + tp {} + pp {} + ep {}{} + dp {} (of {}) + optimizer {}",
            fmt_time(st.total),
            fmt_time(st.compute),
            fmt_time(st.bubble),
            fmt_time(st.tp_comm),
            fmt_time(st.pp_comm),
            fmt_time(st.ep_comm),
            if e.layout.cp > 1 {
                format!(" + cp {}", fmt_time(st.cp_comm))
            } else {
                String::new()
            },
            fmt_time(st.dp_exposed),
            fmt_time(st.dp_comm),
            fmt_time(st.optimizer)
        );
        let mm = &e.memory;
        let _ = writeln!(
            o,
            "memory/device {:.1} GB of {:.1}: weights {:.1} grads {:.1} optimizer {:.1} activations {:.1} reserve {:.1}{}",
            mm.total / GB,
            mm.capacity / GB,
            mm.weights / GB,
            mm.grads / GB,
            mm.optimizer / GB,
            mm.activations / GB,
            mm.reserve / GB,
            runtime_memory(mm)
        );
        let _ = writeln!(
            o,
            "throughput {:.0} tokens/s, MFU {:.1}%, HFU {:.1}%",
            e.tokens_per_s,
            e.mfu * 100.0,
            e.hfu * 100.0
        );
        if e.time_to_train_s > 0.0 {
            let _ = writeln!(
                o,
                "time to train {}, {:.0} device-hour cost, {:.0} kWh ({:.0} electricity)",
                fmt_time(e.time_to_train_s),
                e.cost,
                e.energy_kwh,
                e.energy_cost
            );
        }
        if explain {
            let _ = writeln!(o, "\nformulas:");
            for t in e.terms.iter().chain(&s.terms) {
                let _ = writeln!(o, "  {:<10} {}   [{}]", t.name, t.formula, t.cite);
            }
        }
    }
    if let Some(bw) = r.data_bandwidth {
        let _ = writeln!(
            o,
            "data read bandwidth {:.3} GB/s (000 eq. 4.1, eta = 1)",
            bw / GB
        );
    }
    if !r.warnings.is_empty() {
        let _ = writeln!(o, "\nwarnings:");
        for w in &r.warnings {
            let _ = writeln!(o, "  [{}] {} ({})", w.code, w.message, w.cite);
        }
    }
    o
}

/// The kernel model's runtime memory terms for the text report (empty under the roofline
/// model, so its output is unchanged): the CUDA context, when it is what the total counts the
/// cast copy held after the pipeline flush, and what the caching allocator reserves where it
/// exceeds the total ([`crate::memory::MemoryBreakdown::reserved`]).
fn runtime_memory(mm: &crate::memory::MemoryBreakdown) -> String {
    let mut out = String::new();
    if mm.context > 0.0 {
        out += &format!(" context {:.1}", mm.context / GB);
    }
    if mm.step_transient > mm.activations {
        out += &format!(
            " (after the flush {:.1} instead of the activations)",
            mm.step_transient / GB
        );
    }
    if mm.reserved > mm.total {
        out += &format!(
            "; nvidia-smi shows ~{:.1} GB (the cast after the flush gets a segment of its own)",
            mm.reserved / GB
        );
    }
    out
}
