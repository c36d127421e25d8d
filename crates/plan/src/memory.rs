//! Memory per device: model state by ZeRO stage and TP/PP/DP/EP sharding, activations by
//! Korthikanti et al.'s per-layer formula, micro-batches in flight per schedule.

use crate::cluster::Cluster;
use crate::hardware::Device;
use crate::job::{AttentionKernel, ComputeModel, Job, PipelineEngine};
use crate::layout::{Layout, Recompute, ZeroStage};
use crate::pipeline::in_flight;
use serde::{Deserialize, Serialize};

/// Model-state bytes per parameter on one device for ZeRO `stage` over `n` data-parallel ranks,
/// with w weight bytes, g gradient bytes and K optimizer bytes (000 §ZeRO, F19, Table 5.3):
/// stage 0: w+g+K; 1: w+g+K/n; 2: w+(g+K)/n; 3: (w+g+K)/n. With w = g = 2, K = 12 these are the
/// seeds' 2+2+K, 2+2+K/N, 2+(2+K)/N, (2+2+K)/N (000 E15: 7B, N = 64 → 0.25 B/param = 1.75 GB).
pub fn state_bytes_per_param(stage: ZeroStage, w: f64, g: f64, k: f64, n: u64) -> f64 {
    let n = n.max(1) as f64;
    match stage {
        ZeroStage::None => w + g + k,
        ZeroStage::Optimizer => w + g + k / n,
        ZeroStage::Gradients => w + (g + k) / n,
        ZeroStage::Parameters => (w + g + k) / n,
    }
}

/// Activation bytes of one transformer layer for one micro-batch (Korthikanti et al. 2022,
/// "Reducing Activation Recomputation in Large Transformer Models", eqs. 1–4; 000 E7 uses it):
/// - no TP: s·b·h·(34 + 5·a·s/h)
/// - TP t, no SP: s·b·h·(10 + 24/t + 5·a·s/(h·t))
/// - TP t with SP: s·b·h·(34 + 5·a·s/h)/t
/// - selective recompute drops the 5as/h term; full recompute keeps only the layer input 2·s·b·h
///   (divided by t with SP).
///
/// Constants assume 2-byte activations; `scale` rescales (2 for FP32 activations).
#[allow(clippy::too_many_arguments)]
pub fn activation_bytes_per_layer(
    s: f64,
    b: f64,
    h: f64,
    a: f64,
    t: f64,
    sp: bool,
    recompute: Recompute,
    scale: f64,
) -> f64 {
    let sbh = s * b * h;
    let attn = 5.0 * a * s / h;
    let bytes = match (recompute, sp) {
        (Recompute::Full, true) => 2.0 * sbh / t,
        (Recompute::Full, false) => 2.0 * sbh,
        (Recompute::Selective, true) => 34.0 * sbh / t,
        (Recompute::Selective, false) => sbh * (10.0 + 24.0 / t),
        (Recompute::None, true) => sbh * (34.0 + attn) / t,
        (Recompute::None, false) => sbh * (10.0 + 24.0 / t + attn / t),
    };
    bytes * scale
}

/// Where one device's HBM goes, bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    /// Parameters held by this device (after TP, PP and EP sharding, before ZeRO).
    pub params_local: f64,
    /// Weights.
    pub weights: f64,
    /// Gradients.
    pub grads: f64,
    /// Optimizer state.
    pub optimizer: f64,
    /// Activations at the peak of the schedule (first stage).
    pub activations: f64,
    /// Reserved (communication buffers, allocator).
    pub reserve: f64,
    /// The CUDA context and the framework's loaded kernels ([`CUDA_CONTEXT_BYTES`]; kernel
    /// model only, else 0).
    #[serde(default)]
    pub context: f64,
    /// The largest buffer the step allocates after the pipeline has flushed (activations
    /// freed): the cast copy of the gradients for the reduction ([`Job::grad_comm_cast_bytes`]).
    /// The total counts the larger of this and the activations.
    #[serde(default)]
    pub step_transient: f64,
    /// Sum.
    pub total: f64,
    /// The total if the caching allocator can reuse none of the activations' cached blocks for
    /// the step transient: activations and transient added rather than the larger taken.
    /// PyTorch's caching allocator (`c10/cuda/CUDACachingAllocator.cpp`, header comment) splits
    /// and merges blocks only inside the segment it obtained from one `cudaMalloc`, serves a
    /// request from the smallest cached block that fits or else a new segment, and gives
    /// segments back only when a `cudaMalloc` fails; a transient larger than every cached
    /// activation segment therefore gets a segment of its own, and what `nvidia-smi` shows
    /// lies between `total` (all reused) and this (none reused). Equal to `total` when there is
    /// no transient.
    #[serde(default)]
    pub total_without_reuse: f64,
    /// What the caching allocator holds at its high-water mark, plus the context and reserve:
    /// the figure `nvidia-smi` shows (and `torch.cuda.max_memory_reserved` less the context
    /// and NCCL). A segment is one `cudaMalloc` of one request's size (requests of 10 MiB and
    /// more are rounded up to 2 MiB, `get_allocation_size`), blocks merge only inside their
    /// segment, and cached segments are kept until a `cudaMalloc` fails: so a step transient
    /// larger than the largest activation tensor ([`largest_activation_tensor`]) can be served
    /// by no freed activation block and gets a segment of its own the first time it is
    /// requested, and the pipeline's later activations, served by their own cached segments,
    /// leave it whole. Then this is [`MemoryBreakdown::total_without_reuse`]; else
    /// [`MemoryBreakdown::total`]. A lower bound: fragmentation of the activation segments
    /// adds to it. [`MemoryBreakdown::fits`] tests `total`, because before an out-of-memory
    /// error the allocator frees its cached segments and retries.
    #[serde(default)]
    pub reserved: f64,
    /// Device HBM.
    pub capacity: f64,
}

impl MemoryBreakdown {
    /// True when the total fits in HBM.
    pub fn fits(&self) -> bool {
        self.total <= self.capacity
    }
}

/// Parameters on the first pipeline stage of one device: (its blocks' dense params + the larger
/// embedding matrix when p > 1, both when p = 1) / t, plus expert params / (t·ep). The first
/// stage holds [`Layout::first_stage_layers`] blocks: L/p, one fewer with embedding slots
/// (where the embedding takes a block's slot). Without a vocabulary-parallel embedding
/// ([`Layout::vocab_parallel`] false) the embedding matrices are whole on every TP rank:
/// blocks · dense / t + embedding.
pub fn params_per_device(job: &Job, l: &Layout) -> (f64, f64) {
    let m = &job.model;
    let layers_per_stage = l.first_stage_layers(m.layers) as f64;
    let emb = m.vocab as f64 * m.hidden as f64;
    let emb_stage = if l.pp <= 1 { m.embedding_params() } else { emb };
    let emb_split = if l.vocab_parallel { l.tp as f64 } else { 1.0 };
    let dense = layers_per_stage * m.dense_params_per_layer() / l.tp as f64 + emb_stage / emb_split;
    let expert = layers_per_stage * m.expert_params_per_layer() / (l.tp * l.ep.max(1)) as f64;
    (dense, expert)
}

/// Parameters on the pipeline stage that holds the most: the first stage's
/// ([`params_per_device`]), or with embedding slots and p > 2 a middle stage's full
/// [`Layout::layers_per_stage`] blocks where those outweigh the first stage's blocks and
/// embedding. The data-parallel reduction of every stage runs at once, so this stage's sets
/// its time.
pub fn params_busiest_stage(job: &Job, l: &Layout) -> (f64, f64) {
    let (dense, expert) = params_per_device(job, l);
    if !(l.embedding_slots && l.pp > 2) {
        return (dense, expert);
    }
    let m = &job.model;
    let blocks = l.layers_per_stage(m.layers) as f64;
    let mid_dense = blocks * m.dense_params_per_layer() / l.tp as f64;
    let mid_expert = blocks * m.expert_params_per_layer() / (l.tp * l.ep.max(1)) as f64;
    if mid_dense + mid_expert > dense + expert {
        (mid_dense, mid_expert)
    } else {
        (dense, expert)
    }
}

/// The memory of one device of `layout` (000 §2.21; the first pipeline stage is the peak).
/// ZeRO shards dense state over dp·cp and expert state over dp/ep; context parallelism splits
/// the sequence (activations ÷ cp).
pub fn device_memory(job: &Job, cluster: &Cluster, l: &Layout) -> MemoryBreakdown {
    let m = &job.model;
    let (w, g, k) = (job.precision.bytes(), job.grad_bytes(), job.optimizer_bytes);
    let (dense, expert) = params_per_device(job, l);
    let n_dense = l.dp * l.cp.max(1);
    let n_expert = (l.dp / l.ep.max(1)).max(1);
    let per = |stage_bytes: &dyn Fn(u64) -> (f64, f64, f64)| {
        let (a, b, c) = stage_bytes(n_dense);
        let (x, y, z) = stage_bytes(n_expert);
        (
            dense * a + expert * x,
            dense * b + expert * y,
            dense * c + expert * z,
        )
    };
    let shard = |n: u64| {
        let nf = n.max(1) as f64;
        match l.zero {
            ZeroStage::None => (w, g, k),
            ZeroStage::Optimizer => (w, g, k / nf),
            ZeroStage::Gradients => (w, g / nf, k / nf),
            ZeroStage::Parameters => (w / nf, g / nf, k / nf),
        }
    };
    let (weights, grads, optimizer) = per(&shard);
    let scale = job.precision.bytes() / 2.0;
    let layer = |recompute| {
        activation_bytes_per_layer(
            m.seq as f64 / l.cp.max(1) as f64,
            l.micro_batch as f64,
            m.hidden as f64,
            m.heads as f64,
            l.tp as f64,
            l.sequence_parallel && l.tp > 1,
            recompute,
            scale,
        )
    };
    // A flash-attention kernel never stores the s×s scores: without recomputation the layer
    // keeps what selective recomputation keeps (Dao et al. 2022; Korthikanti et al. eq. 2
    // without the 5as/h term). Only under the kernel model, so a job that omits
    // `compute_model` keeps its old figure.
    let stored = match (l.recompute, job.compute_model, job.attention) {
        (Recompute::None, ComputeModel::Kernels, AttentionKernel::Flash) => Recompute::Selective,
        (r, _, _) => r,
    };
    let per_layer = layer(stored);
    let mb = l.microbatches(job.global_batch);
    let layers_per_stage = l.first_stage_layers(m.layers) as f64;
    let flight = in_flight(l.schedule, l.pp, mb, l.interleave);
    let mut activations = per_layer * layers_per_stage * flight;
    if l.recompute == Recompute::Full {
        // The layer being recomputed needs its full activations once.
        activations += layer(Recompute::None);
    }
    let kernels = job.compute_model == ComputeModel::Kernels;
    let (context, step_transient) = if kernels {
        let (per_microbatch, once) = runtime_activation_bytes(job, l);
        let (engine_per_microbatch, engine_once) = pipeline_engine_bytes(job, l);
        activations += (per_microbatch + engine_per_microbatch) * flight + once + engine_once;
        (
            cuda_context_bytes(&cluster.device),
            job.grad_comm_cast_bytes() * (dense + expert),
        )
    } else {
        (0.0, 0.0)
    };
    let reserve = cluster.memory_reserve;
    let static_bytes = weights + grads + optimizer + reserve + context;
    let total = static_bytes + activations.max(step_transient);
    let total_without_reuse = static_bytes + activations + step_transient;
    let own_segment = step_transient > largest_activation_tensor(job, l);
    MemoryBreakdown {
        params_local: dense + expert,
        weights,
        grads,
        optimizer,
        activations,
        reserve,
        context,
        step_transient,
        total,
        total_without_reuse,
        reserved: if own_segment {
            total_without_reuse
        } else {
            total
        },
        capacity: cluster.device.hbm_bytes,
    }
}

/// The largest single activation tensor one micro-batch allocates on a stage, bytes: the
/// largest of the hidden state s·b·h (whole: the TP all-gather's output with SP), the fused
/// QKV output s·b·(a + 2·kv)·d/t, the MLP's first GEMM output s·b·f/t (2·f/t gated) and, with
/// unfused attention, the score matrix a·s²·b/t; in the activation precision. The caching
/// allocator's largest cached activation segment is no larger ([`MemoryBreakdown::reserved`]).
pub fn largest_activation_tensor(job: &Job, l: &Layout) -> f64 {
    let m = &job.model;
    let s = m.seq as f64 / l.cp.max(1) as f64;
    let b = l.micro_batch as f64;
    let t = l.tp.max(1) as f64;
    let d = m.head_dim() as f64;
    let hidden = s * b * m.hidden as f64;
    let qkv = s * b * (m.heads + 2 * m.kv_heads) as f64 * d / t;
    let mlp = s * b * m.ffn as f64 * if m.gated { 2.0 } else { 1.0 } / t;
    let scores = match job.attention {
        AttentionKernel::Unfused => m.heads as f64 * s * s * b / t,
        AttentionKernel::Flash => 0.0,
    };
    job.precision.bytes() * hidden.max(qkv).max(mlp).max(scores)
}

/// The CUDA context and the kernels the framework loads, as `nvidia-smi` counts them on top
/// of what the allocator holds: 1,271 MiB, measured by BigScience on Jean Zay's V100 32 GB
/// partition with their Megatron-DeepSpeed stack ("also need to take into account the cuda
/// kernels (1271MiB)", tr11-176B-ml `chronicles-prequel.md`, "104B topology / memory usage");
/// taken as the same on devices without a measurement of their own.
pub const CUDA_CONTEXT_BYTES: f64 = 1271.0 * 1024.0 * 1024.0;

/// The same on an A100: 1,573 MiB, measured by BigScience on an A100 40 GB with
/// `torch.ones(1).cuda()` and `nvidia-smi` ("40GB A100 takes 1573MiB for cuda kernels
/// (probably about the same for 80GB? may be a bit larger)", `chronicles-prequel.md`,
/// "Possible topologies for 200B"). A lower bound for a training process, which also loads
/// the cuBLAS and fused kernels it calls.
pub const A100_CUDA_CONTEXT_BYTES: f64 = 1573.0 * 1024.0 * 1024.0;

/// The CUDA context on `device`: [`A100_CUDA_CONTEXT_BYTES`] on the A100 presets,
/// [`CUDA_CONTEXT_BYTES`] elsewhere.
pub fn cuda_context_bytes(device: &Device) -> f64 {
    if device.name.starts_with("a100") {
        A100_CUDA_CONTEXT_BYTES
    } else {
        CUDA_CONTEXT_BYTES
    }
}

/// What DeepSpeed's pipeline engine holds on a stage that is not the last (`PipelineEngine`,
/// `deepspeed/runtime/pipe/engine.py`), as (bytes per micro-batch in flight, bytes held once
/// during the backward), with `o` the stage output's bytes (2·s·b·h in BF16, ÷ t with SP):
/// - `_exec_forward_pass` partitions the output over the TP group (`PartitionedTensor`), frees
///   the full tensor (`first_output.data = torch.zeros(1)`) and keeps the partition in
///   `pipe_buffers['outputs']` until that micro-batch's backward: o/t per micro-batch;
/// - `_exec_backward_pass` rebuilds the full output (`part_output.full()`) and the full
///   received gradient (`part_grad.full()`) for `backward`, beside the received partition
///   (`grad_layer`): 2·o + o/t, once.
///
/// Megatron-LM's schedules keep nothing comparable (the output is deallocated after the send
/// and the received gradient is consumed by the backward); 0 for them and for p = 1.
fn pipeline_engine_bytes(job: &Job, l: &Layout) -> (f64, f64) {
    if job.pipeline_engine != PipelineEngine::Deepspeed || l.pp <= 1 {
        return (0.0, 0.0);
    }
    let m = &job.model;
    let s = m.seq as f64 / l.cp.max(1) as f64;
    let sp = if l.sequence_parallel && l.tp > 1 {
        l.tp as f64
    } else {
        1.0
    };
    let o = job.precision.bytes() * s * l.micro_batch as f64 * m.hidden as f64 / sp;
    let t = l.tp.max(1) as f64;
    (o / t, 2.0 * o + o / t)
}

/// The kernel model's additions to Korthikanti's per-layer formula, as (bytes the first stage
/// keeps per micro-batch in flight outside the transformer blocks, bytes held once):
/// - the embedding dropout's mask, s·b·h bytes (÷ t with SP): Korthikanti et al. 2022 §4.3
///   (method only), "the dropout in the input embeddings";
/// - with [`crate::model::ModelShape::embedding_norm`], the embedding layer norm's input,
///   2·s·b·h bytes (÷ t with SP): the norm keeps it for its backward and it sits outside the
///   recomputed blocks (Megatron-DeepSpeed `GPTModelPipe` checkpoints only the transformer
///   layers);
/// - unfused attention: the backward of the score matrix holds two score-sized BF16 buffers
///   at once (the gradient of the dropout output and the dropout backward's result; the fused
///   softmax backward then works in place), 4·a·s²·b/t bytes, once (not per micro-batch).
fn runtime_activation_bytes(job: &Job, l: &Layout) -> (f64, f64) {
    let m = &job.model;
    let s = m.seq as f64 / l.cp.max(1) as f64;
    let sbh = s * l.micro_batch as f64 * m.hidden as f64;
    let split = if l.sequence_parallel && l.tp > 1 {
        l.tp as f64
    } else {
        1.0
    };
    let act = job.precision.bytes() / 2.0;
    let norm = if m.embedding_norm { 2.0 * act } else { 0.0 };
    let per_microbatch = sbh * (1.0 + norm) / split;
    let score_grads = match job.attention {
        AttentionKernel::Unfused => {
            4.0 * act * m.heads as f64 * s * s * l.micro_batch as f64 / l.tp as f64
        }
        AttentionKernel::Flash => 0.0,
    };
    (per_microbatch, score_grads)
}

/// Minimum devices to hold `bytes` at `per_device` each: ⌈bytes / per_device⌉ (000 E3, S23:
/// 350 GB / 80 GB → 5).
pub fn min_devices(bytes: f64, per_device: f64) -> u64 {
    (bytes / per_device - 1e-12).ceil().max(1.0) as u64
}

/// KV-cache bytes: 2 (K and V) × layers × kv_heads × head_dim × bytes × tokens × sequences
/// (000 F51, E44: 70B, 1,024 tokens × 256 sequences → 85.9 GB).
pub fn kv_cache_bytes(
    layers: u64,
    kv_heads: u64,
    head_dim: u64,
    bytes: f64,
    tokens: u64,
    seqs: u64,
) -> f64 {
    2.0 * (layers * kv_heads * head_dim) as f64 * bytes * (tokens * seqs) as f64
}
