//! Step time of one layout: compute on a roofline with an efficiency factor, pipeline bubble,
//! TP/SP collectives per layer, PP send/recv, EP all-to-all, DP all-reduce or ZeRO
//! reduce-scatter/all-gather with overlap, optimizer update; then MFU/HFU, time, cost, energy.
//! Fleet law (000 F2): T_step = T_compute/N + T_comm + T_sync − T_overlap.

use crate::cluster::Cluster;
use crate::collectives::{Placement, all_to_all, cluster_all_reduce, group_link, placement};
use crate::error::Result;
use crate::job::{ComputeModel, Job};
use crate::kernels::layer_times;
use crate::layout::{Layout, Recompute, ZeroStage};
use crate::memory::{MemoryBreakdown, device_memory, params_busiest_stage};
use crate::pipeline::{Schedule, bubble_fraction, bubble_time};
use crate::units::{fmt_bytes, fmt_time};
use serde::{Deserialize, Serialize};

/// One explained quantity: name, formula with its inputs, value, and the seed it comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Term {
    /// Short name ("compute", "tp_comm").
    pub name: String,
    /// The formula with the numbers put in.
    pub formula: String,
    /// The value (seconds for times).
    pub value: f64,
    /// Seed citation.
    pub cite: String,
}

/// Step-time components, seconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepBreakdown {
    /// m micro-batches of compute on one stage (recomputation included).
    pub compute: f64,
    /// Pipeline idle time.
    pub bubble: f64,
    /// Tensor/sequence-parallel collectives (not overlapped).
    pub tp_comm: f64,
    /// Pipeline sends/receives.
    pub pp_comm: f64,
    /// Expert-parallel all-to-all.
    pub ep_comm: f64,
    /// Context-parallel K/V exchange not hidden under attention (kernel model).
    #[serde(default)]
    pub cp_comm: f64,
    /// Data-parallel (or ZeRO) communication before overlap.
    pub dp_comm: f64,
    /// The part of `dp_comm` not hidden under compute.
    pub dp_exposed: f64,
    /// Optimizer update (HBM-bound).
    pub optimizer: f64,
    /// Sum of the exposed parts.
    pub total: f64,
}

/// Everything the planner says about one layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    /// The layout.
    pub layout: Layout,
    /// Micro-batches per step m.
    pub microbatches: u64,
    /// Memory per device.
    pub memory: MemoryBreakdown,
    /// Step time.
    pub step: StepBreakdown,
    /// Pipeline bubble fraction.
    pub bubble_fraction: f64,
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation.
    pub mfu: f64,
    /// Hardware FLOPs utilisation (recomputation counted).
    pub hfu: f64,
    /// Wall time to train `job.tokens`, seconds (0 if tokens = 0).
    pub time_to_train_s: f64,
    /// Device-hour cost of that time.
    pub cost: f64,
    /// Facility energy, kWh.
    pub energy_kwh: f64,
    /// Electricity cost.
    pub energy_cost: f64,
    /// The largest step component, e.g. "compute 71%".
    pub bound: String,
    /// The explained terms.
    pub terms: Vec<Term>,
}

/// Validates `layout` and evaluates it.
pub fn evaluate(job: &Job, cluster: &Cluster, layout: &Layout) -> Result<Evaluation> {
    let m = &job.model;
    layout.validate(
        m.layers,
        m.heads,
        m.kv_heads,
        m.experts,
        job.global_batch,
        cluster.devices(),
    )?;
    job.pipeline_engine.check(layout)?;
    evaluate_valid(job, cluster, layout, true)
}

/// Evaluates a layout already validated; fails only on an unsupported precision.
pub(crate) fn evaluate_valid(
    job: &Job,
    cluster: &Cluster,
    l: &Layout,
    explain: bool,
) -> Result<Evaluation> {
    let m = &job.model;
    let peak = cluster.device.peak(job.precision)?;
    let memory = device_memory(job, cluster, l);
    let mut terms = Vec::new();
    let mut term = |name: &str, formula: &dyn Fn() -> String, value: f64, cite: &str| {
        if explain {
            terms.push(Term {
                name: name.into(),
                formula: formula(),
                value,
                cite: cite.into(),
            })
        }
    };
    let (s, h) = (m.seq as f64, m.hidden as f64);
    let b = l.micro_batch as f64;
    let mb = l.microbatches(job.global_batch);
    let layers_stage = l.layers_per_stage(m.layers) as f64;
    let cp = l.cp.max(1) as f64;
    let kernels =
        (job.compute_model == ComputeModel::Kernels).then(|| layer_times(job, cluster, l));
    let act = job.precision.bytes();
    let dpn = cluster.devices_per_node;

    // Compute: roofline max(F/(R·eff), Q/β_mem) per micro-batch (004 eq. 28.2).
    let extra = match l.recompute {
        Recompute::None => 0.0,
        Recompute::Selective => m.attention_flops_per_token() / 3.0,
        Recompute::Full => 2.0 * m.active_params() + m.attention_flops_per_token() / 3.0,
    };
    let model_flops_tok = m.flops_per_token();
    let hw_flops_tok = model_flops_tok + extra;
    // The slowest pipeline stage sets the pace: the last one computes its L/p blocks and the
    // whole LM head (6·V·h per token), which the others do not share. A replicated head (no
    // vocabulary parallelism) is computed whole by every TP rank of that stage.
    let head_tok = 6.0 * (m.vocab * m.hidden) as f64;
    let head_split = if l.vocab_parallel { l.tp as f64 } else { 1.0 };
    let f_tok = (hw_flops_tok - head_tok) / (l.tp * l.pp) as f64 + head_tok / head_split;
    let f_dev = f_tok * b * s;
    let q_dev = 3.0 * memory.params_local * job.precision.bytes();
    let t_flop = f_dev / (peak * job.efficiency);
    let t_mem = q_dev / cluster.device.hbm_bw;
    let t_mb = match &kernels {
        Some(k) => l.slowest_stage(m.layers, k.layer(), k.head),
        None => t_flop.max(t_mem),
    };
    let compute = mb as f64 * t_mb;
    match &kernels {
        Some(k) => term(
            "compute",
            &|| {
                format!(
                    "m x (L_stage x (fwd + bwd + recompute) + head) = {mb} x ({layers_stage} x ({} + {} + {}) + {}) = {} [GEMM {}, attention {}, memory-bound {} per layer]",
                    fmt_time(k.forward),
                    fmt_time(k.backward),
                    fmt_time(k.recompute),
                    fmt_time(k.head),
                    fmt_time(compute),
                    fmt_time(k.gemm),
                    fmt_time(k.attention),
                    fmt_time(k.memory_bound)
                )
            },
            compute,
            "kernels: GEMM tile/wave quantisation, flash attention, bytes/bandwidth (docs/PLAN.md)",
        ),
        None => term(
            "compute",
            &|| {
                format!(
                    "m x max(F/(R*eff), Q/B_mem) = {mb} x max({f_dev:.3e}/({peak:.3e}*{}), {}/{:.3e}) = {}",
                    job.efficiency,
                    fmt_bytes(q_dev),
                    cluster.device.hbm_bw,
                    fmt_time(compute)
                )
            },
            compute,
            "000 F23 (6N), 004 eq. 28.2",
        ),
    }
    let bf = bubble_fraction(l.schedule, l.pp, mb, l.interleave);
    let bubble = bubble_time(l.schedule, l.pp, mb, l.interleave, t_mb);
    term(
        "bubble",
        &|| {
            format!(
                "(p-1)/(v*m+p-1) = {:.2}% of step ({:?}, p={}, m={mb}, v={}) = {}",
                bf * 100.0,
                l.schedule,
                l.pp,
                l.interleave,
                fmt_time(bubble)
            )
        },
        bubble,
        "000 F41",
    );

    // TP/SP: 4 all-reduces (or AG+RS pairs) of s·b·h per layer per micro-batch, 6 with full
    // recomputation (000 F46–F47).
    let tp_pl = placement(l.tp, 1, dpn);
    let tp_msg = s * b * h * act / cp;
    let sp = l.sequence_parallel && l.tp > 1;
    // Under the kernel model sequence parallelism's backward also re-gathers the two
    // all-gathered inputs for the weight gradients (Megatron does not keep them; Korthikanti
    // et al. §4.2.2): two all-gathers = one all-reduce more per layer.
    let n_tp = match (l.recompute == Recompute::Full, kernels.is_some() && sp) {
        (true, true) => 7.0,
        (false, true) => 5.0,
        (true, false) => 6.0,
        (false, false) => 4.0,
    };
    let t_tp1 = cluster_all_reduce(cluster, tp_msg, l.tp, tp_pl);
    let tp_layer = match (&kernels, l.tp_overlap) {
        (Some(k), true) => (n_tp * t_tp1 - k.gemm).max(0.0),
        _ => n_tp * t_tp1,
    };
    let tp_comm = mb as f64 * layers_stage * tp_layer;
    term(
        "tp_comm",
        &|| {
            format!(
                "m x L/p x {n_tp} x AR({}, t={}) = {mb} x {layers_stage} x {n_tp} x {} = {}{}{}",
                fmt_bytes(tp_msg),
                l.tp,
                fmt_time(t_tp1),
                fmt_time(tp_comm),
                if tp_pl == Placement::IntraNode {
                    ""
                } else {
                    " [crosses nodes]"
                },
                match (&kernels, l.tp_overlap) {
                    (Some(k), true) => format!(
                        " [overlapped: per layer max(0, comm - GEMM {})]",
                        fmt_time(k.gemm)
                    ),
                    _ => String::new(),
                }
            )
        },
        tp_comm,
        "000 F46-F47, 004 eq. 28.12",
    );

    // PP: one activation send forward and one gradient back per micro-batch and virtual stage;
    // s·b·h·bytes/t per device with scatter-gather (000 F42).
    let pp_link = group_link(&cluster.intra, &cluster.inter, placement(l.pp, l.tp, dpn));
    let pp_msg = s * b * h * act / (l.tp as f64 * cp);
    // Under the kernel model the interleaved schedule overlaps each send/receive with the
    // next model chunk's compute (Megatron-Core's overlap_p2p_comm, on by default for
    // interleaving: Megatron-LM `--no-overlap-p2p-communication` turns it off): only what
    // exceeds one chunk's forward (or backward) stays exposed. The fill and the drain have no
    // compute to hide under: the first micro-batch's activations cross all p·v − 1 virtual
    // stage boundaries before the last stage starts its backward, and the last gradients
    // cross them back (Megatron-Core's warm-up and cool-down phases), so 2(p·v − 1) sends sit
    // on the critical path. 1F1B sends block (all 2·m·v charged).
    let pp_msg_t = pp_link.msg_time(pp_msg);
    let pp_comm = match &kernels {
        _ if l.pp <= 1 => 0.0,
        Some(k) if l.schedule == Schedule::Interleaved => {
            let chunk = l.layers_per_stage(m.layers) as f64 / l.interleave.max(1) as f64;
            let fill_drain = 2.0 * ((l.pp * l.interleave) as f64 - 1.0) * pp_msg_t;
            fill_drain
                + (mb * l.interleave) as f64
                    * ((pp_msg_t - chunk * k.forward).max(0.0)
                        + (pp_msg_t - chunk * k.backward).max(0.0))
        }
        _ => 2.0 * (mb * l.interleave) as f64 * pp_msg_t,
    };
    term(
        "pp_comm",
        &|| {
            format!(
                "2 x m x v x (a + n/B), n = s*b*h*bytes/t = {} -> {}{}",
                fmt_bytes(pp_msg),
                fmt_time(pp_comm),
                if kernels.is_some() && l.schedule == Schedule::Interleaved {
                    " [overlapped: 2(p*v-1) fill/drain sends + each send beyond the next chunk's compute]"
                } else {
                    ""
                }
            )
        },
        pp_comm,
        "000 F42, 004 eq. 28.10",
    );

    // EP: dispatch + combine, forward + backward, per MoE layer per micro-batch (000 F50).
    let ep_comm = if m.experts > 1 && l.ep > 1 {
        let pl = placement(l.ep, l.tp * l.pp, dpn);
        let link = group_link(&cluster.intra, &cluster.inter, pl);
        let msg = s * b * h * act * m.top_k as f64 / l.tp as f64;
        mb as f64 * layers_stage * 4.0 * all_to_all(&link, msg, l.ep, cluster.ring)
    } else {
        0.0
    };
    term(
        "ep_comm",
        &|| {
            format!(
                "m x L/p x 4 x A2A(s*b*h*k*bytes/t, ep={}) = {}",
                l.ep,
                fmt_time(ep_comm)
            )
        },
        ep_comm,
        "000 F50, F59",
    );

    // CP: each rank's K and V (b·s/cp·2·kv·d/t elements) go round the cp ring, (cp-1) hops
    // forward and, with their gradients, 3(cp-1) in the backward; hidden under the attention
    // core the ring overlaps with (Megatron-Core context parallelism). Kernel model only.
    let cp_comm = match &kernels {
        Some(k) if l.cp > 1 => {
            let pl = placement(l.cp, l.tp, dpn);
            let link = group_link(&cluster.intra, &cluster.inter, pl);
            let kv_rank = (m.kv_heads as f64 / l.tp as f64).max(1.0) * m.head_dim() as f64;
            let chunk = b * s / cp * 2.0 * kv_rank * act;
            let ring = 4.0 * (cp - 1.0) * link.msg_time(chunk);
            mb as f64 * layers_stage * (ring - k.attention).max(0.0)
        }
        _ => 0.0,
    };
    if kernels.is_some() {
        term(
            "cp_comm",
            &|| {
                format!(
                    "m x L/p x max(4(cp-1) x (a + KV/B) - attention, 0), cp = {} = {}",
                    l.cp,
                    fmt_time(cp_comm)
                )
            },
            cp_comm,
            "Megatron-Core context parallelism; 004 eq. 28.10",
        );
    }

    // DP: gradient all-reduce (2 half-units), ZeRO-2 m reduce-scatters + 1 all-gather, ZeRO-3
    // 2m all-gathers + m reduce-scatters (000 F20: FSDP ≈ 3 units vs DDP 2 at m = 1).
    let (dense, expert) = params_busiest_stage(job, l);
    let g = job.grad_comm_bytes();
    let units = match l.zero {
        ZeroStage::None | ZeroStage::Optimizer => 2.0,
        ZeroStage::Gradients => mb as f64 + 1.0,
        ZeroStage::Parameters => 3.0 * mb as f64,
    };
    let stride = l.tp * l.pp;
    let half_ar = |bytes: f64, size: u64, stride: u64| {
        cluster_all_reduce(cluster, bytes, size, placement(size, stride, dpn)) / 2.0
    };
    let ep = l.ep.max(1);
    let dp_comm = units
        * (half_ar(dense * g, l.dp * l.cp.max(1), stride)
            + half_ar(expert * g, l.dp / ep, stride * ep));
    // ZeRO-3 under the kernel model: its traffic comes per micro-batch (units = 3m), and each
    // micro-batch's gathers and reduce-scatters are prefetched under that micro-batch's own
    // layers (PyTorch FSDP and Megatron-FSDP forward/backward prefetch: Zhao et al. 2023,
    // "PyTorch FSDP", §3.3). Only the first micro-batch's share pays the default overlap
    // rule; the other m-1 expose only what exceeds their compute. Other stages, and the
    // roofline model, keep one overlap of the whole step's traffic.
    let dp_exposed = if kernels.is_some() && l.zero == ZeroStage::Parameters && mb > 1 {
        let per_mb = dp_comm / mb as f64;
        per_mb - (job.dp_overlap * per_mb).min(t_mb) + (mb - 1) as f64 * (per_mb - t_mb).max(0.0)
    } else {
        dp_comm - (job.dp_overlap * dp_comm).min(compute)
    };
    let overlap = dp_comm - dp_exposed;
    term(
        "dp_comm",
        &|| {
            format!(
                "{units} x AR/2({}, d={}) - min({} x comm, compute) = {} - {} = {}",
                fmt_bytes(dense * g),
                l.dp,
                job.dp_overlap,
                fmt_time(dp_comm),
                fmt_time(overlap),
                fmt_time(dp_exposed)
            )
        },
        dp_exposed,
        "000 F15, F20; 004 eq. 28.15",
    );
    // Under the kernel model an FP8 run also casts its local weights to FP8 once per step
    // (Transformer Engine casts and transposes them on the first micro-batch and reuses the
    // copies for the rest: `Linear.forward(is_first_microbatch)`, TE user guide "FP8 weight
    // caching"): read 2 B, write the FP8 copy and its transpose, 4 B per parameter.
    let weight_cast = match &kernels {
        Some(_) if job.precision == crate::hardware::Precision::Fp8 => {
            let curve = crate::gemm::kernel_curve(&cluster.device);
            crate::gemm::memory_time(&curve, cluster.device.hbm_bw, 4.0 * memory.params_local)
        }
        _ => 0.0,
    };
    let optimizer = 2.0 * (memory.weights + memory.grads + memory.optimizer)
        / cluster.device.hbm_bw
        + weight_cast;
    term(
        "optimizer",
        &|| {
            if weight_cast > 0.0 {
                format!(
                    "2 x state bytes / B_mem + FP8 weight cast 4 B x params / (e_mem B_mem) = {}",
                    fmt_time(optimizer)
                )
            } else {
                format!("2 x state bytes / B_mem = {}", fmt_time(optimizer))
            }
        },
        optimizer,
        "004 eq. 28.2",
    );

    let total = compute + bubble + tp_comm + pp_comm + ep_comm + cp_comm + dp_exposed + optimizer;
    let step = StepBreakdown {
        compute,
        bubble,
        tp_comm,
        pp_comm,
        ep_comm,
        cp_comm,
        dp_comm,
        dp_exposed,
        optimizer,
        total,
    };
    let tokens_step = job.tokens_per_step();
    let tokens_per_s = tokens_step / total;
    let n = cluster.devices() as f64;
    let mfu = model_flops_tok * tokens_step / (total * n * peak);
    let hfu = hw_flops_tok * tokens_step / (total * n * peak);
    term(
        "mfu",
        &|| {
            format!(
                "6N_active+12Lhs per token x tokens / (T x N x R) = {:.1}%",
                mfu * 100.0
            )
        },
        mfu,
        "000 E42, F24",
    );
    let time = if job.tokens > 0.0 {
        job.tokens / tokens_per_s
    } else {
        0.0
    };
    let hours = time / 3600.0;
    let cost = n * hours * cluster.price_per_device_hour;
    let it_w = cluster.nodes as f64 * cluster.node_power_w + cluster.network_storage_w;
    let energy_kwh = it_w * cluster.pue * hours / 1e3;
    let energy_cost = energy_kwh * cluster.price_per_kwh;
    let parts = [
        ("compute", compute),
        ("bubble", bubble),
        ("tp_comm", tp_comm),
        ("pp_comm", pp_comm),
        ("ep_comm", ep_comm),
        ("cp_comm", cp_comm),
        ("dp_comm", dp_exposed),
        ("optimizer", optimizer),
    ];
    let (bn, bv) = parts.iter().fold(
        ("compute", 0.0),
        |a, &(k, v)| if v > a.1 { (k, v) } else { a },
    );
    Ok(Evaluation {
        layout: l.clone(),
        microbatches: mb,
        memory,
        step,
        bubble_fraction: bf,
        tokens_per_s,
        mfu,
        hfu,
        time_to_train_s: time,
        cost,
        energy_kwh,
        energy_cost,
        bound: format!("{bn} {:.0}%", 100.0 * bv / total),
        terms,
    })
}
