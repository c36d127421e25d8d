//! The kernel model of one transformer layer (`training.compute_model = "kernels"`): per
//! micro-batch on one device, each GEMM priced from its shape ([`crate::gemm`]), attention as
//! the kernel the run uses, and the memory-bound work (normalisation, activation, residual and
//! dropout, rotary embedding, FP8 casts, softmax) from the bytes it moves.
//!
//! Shapes on one tensor-parallel rank (t = TP, T = b·s/cp tokens, d = h/a, kv = K/V heads):
//!
//! | GEMM | M | N | K |
//! |---|---|---|---|
//! | QKV | T | (h + 2·kv·d)/t (kv·d whole when kv < t) | h |
//! | attention out | T | h | h/t |
//! | MLP in | T | f/t (2f/t gated) | h |
//! | MLP out | T | h | f/t |
//! | LM head (last stage) | T | V/t | h |
//!
//! Each backward runs the input- and weight-gradient GEMMs ([`Gemm::backward`]).

use crate::cluster::Cluster;
use crate::gemm::{Gemm, KernelCurve, gemm_peak, gemm_time, kernel_curve, memory_time};
use crate::hardware::Precision;
use crate::job::{AttentionKernel, Job};
use crate::layout::{Layout, Recompute};
use serde::{Deserialize, Serialize};

/// Seconds of one micro-batch on one device, by part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerTimes {
    /// One layer's forward: GEMMs + attention + memory-bound kernels.
    pub forward: f64,
    /// One layer's backward.
    pub backward: f64,
    /// One layer's recomputation in the backward (0, the attention core, or the forward).
    pub recompute: f64,
    /// One layer's GEMM time, forward + backward (what TP communication can overlap with).
    pub gemm: f64,
    /// One layer's attention-core time, forward + backward (what CP's K/V ring overlaps with).
    pub attention: f64,
    /// One layer's memory-bound time, forward + backward.
    pub memory_bound: f64,
    /// LM head and loss, forward + backward (the last stage only).
    pub head: f64,
}

impl LayerTimes {
    /// One layer, forward + backward + recomputation.
    pub fn layer(&self) -> f64 {
        self.forward + self.backward + self.recompute
    }
}

/// Prices one layer and the head for `job` on `cluster` under layout `l` (module table).
pub fn layer_times(job: &Job, cluster: &Cluster, l: &Layout) -> LayerTimes {
    let m = &job.model;
    let dev = &cluster.device;
    let curve = kernel_curve(dev);
    let (t, cp) = (l.tp.max(1) as f64, l.cp.max(1) as f64);
    let (h, f, v) = (m.hidden as f64, m.ffn as f64, m.vocab as f64);
    let d = m.head_dim() as f64;
    let kv = m.kv_heads as f64;
    let s = m.seq as f64 / cp;
    let tok = l.micro_batch as f64 * s;
    let gated = if m.gated { 2.0 } else { 1.0 };
    // K/V heads: split over TP when there are at least t of them, else replicated (Megatron).
    let kv_rank = (kv / t).max(1.0) * d;
    let q = m.q_width() as f64;
    let mut gemms = vec![
        Gemm::new(tok, q / t + 2.0 * kv_rank, h),
        Gemm::new(tok, h, q / t),
    ];
    if m.experts > 1 {
        // MoE (balanced routing, as the sources force it): the router (T, E, h), then each of
        // the E/ep local experts gets T·k·ep/E of the T·k routed tokens.
        let (e, k, ep) = (m.experts as f64, m.top_k as f64, l.ep.max(1) as f64);
        let per_expert = tok * k * ep / e;
        let local = e / ep;
        gemms.push(Gemm::new(tok, e, h));
        gemms.push(Gemm {
            m: per_expert,
            n: gated * f / t,
            k: h,
            batch: local,
        });
        gemms.push(Gemm {
            m: per_expert,
            n: h,
            k: f / t,
            batch: local,
        });
    } else {
        gemms.push(Gemm::new(tok, gated * f / t, h));
        gemms.push(Gemm::new(tok, h, f / t));
    }
    let fp8 = job.precision == Precision::Fp8;
    let (peak, ceil) = gemm_peak(dev, &curve, job.precision);
    let (bin, bout) = if fp8 { (1.0, 2.0) } else { (2.0, 2.0) };
    let price = |g: Gemm| gemm_time(&curve, peak, ceil, dev.hbm_bw, g, bin, bout);
    let (mut g_fwd, mut g_bwd) = (0.0, 0.0);
    for g in gemms {
        g_fwd += price(g);
        g_bwd += g.backward().into_iter().map(price).sum::<f64>();
    }

    let (a_fwd, a_bwd, a_mem_fwd, a_mem_bwd) =
        attention(job, l, &curve, (dev.bf16, dev.hbm_bw), tok, s, t);
    let (e_fwd, e_bwd) = elementwise_bytes(job, l, tok, t);
    let mem = |bytes: f64| memory_time(&curve, dev.hbm_bw, bytes);
    let forward = g_fwd + a_fwd + mem(e_fwd + a_mem_fwd);
    let backward = g_bwd + a_bwd + mem(e_bwd + a_mem_bwd);
    let recompute = match l.recompute {
        Recompute::None => 0.0,
        Recompute::Selective => a_fwd + mem(a_mem_fwd),
        Recompute::Full => forward,
    };

    // LM head in BF16 (Megatron keeps the output layer out of FP8) and the vocabulary-parallel
    // cross-entropy: logits read and written in FP32 forward and backward (≈ 12 B/element).
    let v_rank = if l.vocab_parallel { v / t } else { v };
    let head_g = Gemm::new(tok, v_rank, h);
    let (bpeak, bceil) = gemm_peak(dev, &curve, Precision::Bf16);
    let hp = |g: Gemm| gemm_time(&curve, bpeak, bceil, dev.hbm_bw, g, 2.0, 2.0);
    let head =
        hp(head_g) + head_g.backward().into_iter().map(hp).sum::<f64>() + mem(12.0 * tok * v_rank);
    LayerTimes {
        forward,
        backward,
        recompute,
        gemm: g_fwd + g_bwd,
        attention: a_fwd + a_bwd,
        memory_bound: mem(e_fwd + e_bwd + a_mem_fwd + a_mem_bwd),
        head,
    }
}

/// The attention core of one layer on one rank: (forward compute, backward compute, forward
/// bytes, backward bytes).
///
/// - Flash: forward 4·b·s_q·s_k·h/t FLOPs (QKᵀ and PV), halved when causal (the kernel skips
///   the masked blocks; with context parallelism each rank's s/cp queries see on average half
///   of the s keys, load-balanced as Megatron-Core does); backward 2.5× the forward (five
///   GEMM-shaped products to two; Dao 2023, §3.1). At the device's flash efficiency of the BF16
///   peak (attention runs in BF16 even in FP8 runs).
/// - Unfused: the two batched GEMMs (s×s×d and s×d×s per head, the full square computed and
///   masked after) and the softmax, mask and dropout over b·(a/t)·s² scores: forward 9 B per
///   score (2 in, 2 out, softmax; dropout 2 in, 2 out, 1 mask), backward 11 B.
fn attention(
    job: &Job,
    l: &Layout,
    curve: &KernelCurve,
    (bf16_peak, hbm): (f64, f64),
    tok: f64,
    s_local: f64,
    t: f64,
) -> (f64, f64, f64, f64) {
    let m = &job.model;
    let b = l.micro_batch as f64;
    let s_full = m.seq as f64;
    let heads = m.heads as f64 / t;
    let d = m.head_dim() as f64;
    match job.attention {
        AttentionKernel::Flash => {
            let causal = if job.causal { 0.5 } else { 1.0 };
            let fwd_flops = 4.0 * tok * s_full * heads * d * causal;
            // Peak is the BF16 one whatever the GEMM precision.
            // Load-balanced context parallelism runs each rank's attention as calls on blocks of
            // s/(2·cp) queries and keys.
            let len = if l.cp > 1 {
                s_full / (2.0 * l.cp as f64)
            } else {
                s_full
            };
            let ramp = len / (len + curve.flash_half_len);
            let rate = bf16_peak * curve.flash_attention * ramp;
            let (merge_fwd, merge_bwd) = cp_merge_bytes(job, l, tok, t);
            (
                fwd_flops / rate,
                2.5 * fwd_flops / rate,
                merge_fwd,
                merge_bwd,
            )
        }
        AttentionKernel::Unfused => {
            let batch = b * heads;
            let qk = Gemm {
                m: s_local,
                n: s_full,
                k: d,
                batch,
            };
            let pv = Gemm {
                m: s_local,
                n: d,
                k: s_full,
                batch,
            };
            let p = |g: Gemm| gemm_time(curve, bf16_peak, curve.gemm_bf16, hbm, g, 2.0, 2.0);
            let fwd = p(qk) + p(pv);
            let bwd: f64 = qk.backward().into_iter().chain(pv.backward()).map(p).sum();
            let scores = batch * s_local * s_full;
            (fwd, bwd, 9.0 * scores, 11.0 * scores)
        }
    }
}

/// Bytes context parallelism's ring attention moves outside the attention kernels per layer
/// and micro-batch on one rank, (forward, backward), with 2-byte activations, as Transformer
/// Engine's `AttnFuncWithCPAndKVP2P` does them (TE 1.8, `attention.py`): the K/V pair is
/// concatenated into the first send buffer (`torch.cat`, 4 B per K/V element); the output is
/// zeroed (2 B per output element) and each of the cp steps merges its partial output into it
/// (`flash_attn_fwd_out_correction`: read the step's output and the accumulator, write the
/// accumulator, 6 B); in the backward each step adds its partial dQ into the dQ buffer and its
/// partial dK, dV into the buffer sent on (`dq.add_`, `dkv.add_`: 6 B per element). Forward
/// (6·cp + 2)·T·q/t + 4·T·2·kv, backward 6·cp·T·(q/t + 2·kv) with T = b·s/cp tokens and kv
/// the K/V width on the rank. TE 2.x merges the forward in FP32 (10 B per step, 6 for the
/// final cast), which this count leaves out.
fn cp_merge_bytes(job: &Job, l: &Layout, tok: f64, t: f64) -> (f64, f64) {
    if l.cp <= 1 {
        return (0.0, 0.0);
    }
    let m = &job.model;
    let cp = l.cp as f64;
    let q = m.q_width() as f64 / t;
    let kv = 2.0 * (m.kv_heads as f64 / t).max(1.0) * m.head_dim() as f64;
    let fwd = (6.0 * cp + 2.0) * tok * q + 4.0 * tok * kv;
    let bwd = 6.0 * cp * tok * (q + kv);
    (fwd, bwd)
}

/// Bytes the memory-bound kernels of one layer move per micro-batch on one rank, (forward,
/// backward), with 2-byte activations. Norm, residual and dropout run on T/t tokens under
/// sequence parallelism, on T otherwise; the activation function on T tokens × f/t.
///
/// | kernel | forward B/element | backward B/element |
/// |---|---|---|
/// | 2 × LayerNorm/RMSNorm (h) | 4 (read, write) | 8 (x, dy in; dx out; stats) |
/// | 2 × bias-dropout-residual (h) | 7 (2 in, 1 out, ½ mask ×2) | 5 |
/// | GeLU (f/t) / SwiGLU (2f/t in, f/t out) | 4 / 6 | 6 / 10 |
/// | rotary on Q, K (gated models) | 4 | 4 |
/// | FP8 casts of the four GEMM inputs (FP8 runs) | 3 | 3 (the output gradients) |
/// | MoE dispatch and combine copies (T·k tokens × h, in and out) | 8 | 8 |
fn elementwise_bytes(job: &Job, l: &Layout, tok: f64, t: f64) -> (f64, f64) {
    let m = &job.model;
    let (h, f) = (m.hidden as f64, m.ffn as f64);
    let sp_tok = if l.sequence_parallel && l.tp > 1 {
        tok / t
    } else {
        tok
    };
    let experts = if m.experts > 1 { m.top_k as f64 } else { 1.0 };
    let norm = 2.0 * h * sp_tok;
    let resid = 2.0 * h * sp_tok;
    let act = tok * f / t * experts;
    let (act_f, act_b) = if m.gated { (6.0, 10.0) } else { (4.0, 6.0) };
    let q = m.q_width() as f64;
    let kv = (m.kv_heads as f64 / t).max(1.0) * m.head_dim() as f64;
    let rope = if m.gated { tok * (q / t + kv) } else { 0.0 };
    let cast = if job.precision == Precision::Fp8 {
        tok * (h + q / t + experts * (h + f / t))
    } else {
        0.0
    };
    let dispatch = if m.experts > 1 {
        tok * experts * h
    } else {
        0.0
    };
    let fwd = 4.0 * norm + 7.0 * resid + act_f * act + 4.0 * rope + 3.0 * cast + 8.0 * dispatch;
    let bwd = 8.0 * norm + 5.0 * resid + act_b * act + 4.0 * rope + 3.0 * cast + 8.0 * dispatch;
    (fwd, bwd)
}
