//! The kernel model's new inputs: each changes what it should and nothing when omitted.

use plan::cluster::{Cluster, ClusterFile};
use plan::job::{ComputeModel, GradPrecision, Job, JobFile};
use plan::layout::{Layout, Recompute};
use plan::step::evaluate;

fn h100(nodes: u64) -> Cluster {
    Cluster::from_file(&ClusterFile::preset("h100", nodes)).unwrap()
}

fn kernels(model: &str, batch: u64) -> JobFile {
    let mut f = JobFile::preset(model, batch);
    f.training.compute_model = ComputeModel::Kernels;
    f
}

#[test]
fn omitted_fields_keep_the_old_figures() {
    let text = "[model]\npreset = \"llama2-7b\"\n[training]\nglobal_batch = 64\n[layout]\ntp = 8\npp = 1\ndp = 4\n";
    let j = Job::from_file(&JobFile::from_toml(text).unwrap()).unwrap();
    let l = j.layout.clone().unwrap();
    assert_eq!(
        (l.cp, l.uneven_stages, l.tp_overlap, l.embedding_slots),
        (1, false, false, false)
    );
    assert_eq!(j.compute_model, ComputeModel::Roofline);
    assert_eq!(j.pipeline_engine, plan::job::PipelineEngine::Megatron);
    let old = evaluate(
        &Job::from_file(&JobFile::preset("llama2-7b", 64)).unwrap(),
        &h100(4),
        &l,
    )
    .unwrap();
    let new = evaluate(&j, &h100(4), &l).unwrap();
    assert_eq!(old.step, new.step);
    assert_eq!(old.memory, new.memory);
}

#[test]
fn fp32_gradients_are_eighteen_bytes_per_parameter() {
    let mut f = JobFile::preset("llama2-7b", 8);
    f.training.grad_precision = GradPrecision::Fp32;
    let j = Job::from_file(&f).unwrap();
    let e = evaluate(&j, &h100(1), &Layout::new(8, 1, 1)).unwrap();
    let m = &e.memory;
    let per_param = (m.weights + m.grads + m.optimizer) / m.params_local;
    assert!((per_param - 18.0).abs() < 1e-9, "{per_param}");
}

#[test]
fn uneven_stages_are_accepted_only_when_asked() {
    let j = Job::from_file(&kernels("llama2-7b", 64)).unwrap();
    let mut l = Layout::new(1, 3, 8);
    assert!(evaluate(&j, &h100(3), &l).is_err());
    l.uneven_stages = true;
    let e = evaluate(&j, &h100(3), &l).unwrap();
    assert_eq!(l.layers_per_stage(32), 11);
    assert!(e.step.total > 0.0);
}

#[test]
fn sequence_parallel_charges_the_recompute_all_gather() {
    // Kernel model: 5 all-reduce equivalents per layer with SP, 4 without.
    let j = Job::from_file(&kernels("llama2-70b", 64)).unwrap();
    let mut l = Layout::new(8, 1, 8);
    let sp = evaluate(&j, &h100(8), &l).unwrap().step.tp_comm;
    l.sequence_parallel = false;
    let plain = evaluate(&j, &h100(8), &l).unwrap().step.tp_comm;
    assert!((sp / plain - 1.25).abs() < 1e-9, "{sp} {plain}");
}

#[test]
fn causal_flash_attention_is_cheaper_at_long_context() {
    let mut f = kernels("llama3-8b", 16);
    f.model.seq = Some(32768);
    let causal = evaluate(
        &Job::from_file(&f).unwrap(),
        &h100(2),
        &Layout::new(8, 1, 2),
    )
    .unwrap();
    f.training.causal = false;
    let full = evaluate(
        &Job::from_file(&f).unwrap(),
        &h100(2),
        &Layout::new(8, 1, 2),
    )
    .unwrap();
    assert!(full.step.compute > 1.3 * causal.step.compute);
}

#[test]
fn context_parallelism_splits_activations() {
    let j = Job::from_file(&kernels("llama3-8b", 16)).unwrap();
    let mut l = Layout::new(8, 1, 2);
    l.recompute = Recompute::None;
    let one = evaluate(&j, &h100(2), &l).unwrap();
    l.dp = 1;
    l.cp = 2;
    let two = evaluate(&j, &h100(2), &l).unwrap();
    assert!((one.memory.activations / two.memory.activations - 2.0).abs() < 1e-9);
}

/// Issue 30: the 175B / 1,024-GPU layout search stays under a second with the kernel model
/// (about 1 ms in release, `examples/search_bench.rs`; the bound leaves room for debug builds
/// on a loaded machine).
#[test]
fn kernel_model_search_175b_on_1024_gpus_under_a_second() {
    use plan::search::{SearchOptions, search};
    let job = Job::from_file(&kernels("gpt3-175b", 1536)).unwrap();
    let t = std::time::Instant::now();
    let r = search(&job, &h100(128), &SearchOptions::default()).unwrap();
    let took = t.elapsed();
    assert!(r.evaluated > 1000 && !r.top.is_empty(), "{}", r.evaluated);
    assert!(took.as_secs_f64() < 1.0, "{took:?}");
}

/// Qwen 3 style heads wider than h/a: Q and O are h × (a·d), K and V h × (kv·d); omitting
/// `head_dim` keeps h/a.
#[test]
fn head_dim_sets_the_attention_width() {
    let text = "[model]\nlayers = 48\nhidden = 2048\nheads = 32\nkv_heads = 4\nhead_dim = 128\nffn = 768\nvocab = 151936\nseq = 4096\n[training]\nglobal_batch = 8\n";
    let j = Job::from_file(&JobFile::from_toml(text).unwrap()).unwrap();
    let (h, q, kv) = (2048.0, 32.0 * 128.0, 4.0 * 128.0);
    assert_eq!(j.model.attn_params_per_layer(), 2.0 * h * q + 2.0 * h * kv);
    let mut f = JobFile::preset("llama2-7b", 8);
    f.model.head_dim = None;
    let j = Job::from_file(&f).unwrap();
    assert_eq!(j.model.head_dim(), 128);
    assert_eq!(j.model.attn_params_per_layer(), 4.0 * 4096.0 * 4096.0);
}

#[test]
fn zero3_prefetch_hides_each_microbatch_under_its_own_compute() {
    use plan::layout::ZeroStage;
    let j = Job::from_file(&kernels("llama2-7b", 64)).unwrap();
    let mut l = Layout::new(1, 1, 8);
    l.zero = ZeroStage::Parameters;
    let e = evaluate(&j, &h100(1), &l).unwrap();
    let s = &e.step;
    let m = e.microbatches as f64;
    assert!(m > 1.0);
    let per_mb = s.dp_comm / m;
    let t_mb = s.compute / m;
    assert!(per_mb < t_mb, "NVLink traffic fits under compute");
    // Only the first micro-batch's share is exposed, at the default overlap (75% hidden).
    let expect = per_mb - (j.dp_overlap * per_mb).min(t_mb);
    assert!(
        (s.dp_exposed - expect).abs() < 1e-12,
        "{} vs {expect}",
        s.dp_exposed
    );
    // The whole-step rule would expose m times as much.
    assert!(s.dp_exposed < (1.0 - j.dp_overlap) * s.dp_comm / 2.0);
    // One micro-batch: the whole-step rule, unchanged.
    let j1 = Job::from_file(&kernels("llama2-7b", 8)).unwrap();
    let e1 = evaluate(&j1, &h100(1), &l).unwrap();
    assert_eq!(e1.microbatches, 1);
    let d = &e1.step;
    assert!(
        (d.dp_exposed - (d.dp_comm - (j1.dp_overlap * d.dp_comm).min(d.compute))).abs() < 1e-12
    );
}

#[test]
fn interleaved_sends_hide_under_the_next_chunk() {
    use plan::pipeline::Schedule;
    let j = Job::from_file(&kernels("llama2-70b", 64)).unwrap();
    let mut l = Layout::new(8, 4, 1);
    let one_f = evaluate(&j, &h100(4), &l).unwrap();
    assert!(one_f.step.pp_comm > 0.0, "1F1B sends block");
    l.schedule = Schedule::Interleaved;
    l.interleave = 2;
    let inter = evaluate(&j, &h100(4), &l).unwrap();
    // A send is shorter than a 10-layer chunk: only the 2(p·v − 1) fill and drain sends stay,
    // where 1F1B charges two per micro-batch (one send = 1F1B total / (2·m)).
    let send = one_f.step.pp_comm / (2.0 * one_f.microbatches as f64);
    let fill_drain = 2.0 * (4.0 * 2.0 - 1.0) * send;
    assert!(
        (inter.step.pp_comm - fill_drain).abs() < 1e-12,
        "{}",
        inter.step.pp_comm
    );
    assert!(inter.step.pp_comm < one_f.step.pp_comm);
    // The roofline model keeps charging every send.
    let r = Job::from_file(&JobFile::preset("llama2-70b", 64)).unwrap();
    assert!(evaluate(&r, &h100(4), &l).unwrap().step.pp_comm > 0.0);
}

/// BigScience tr11-176B README: with `type:transformer|embedding`, 70 layers + embedding + head
/// on 12 stages is "pp rank 0: [embed | 5 transformer blocks]", "pp rank 1: [6 transformer
/// blocks]": the first stage holds one block fewer than the slots per stage, and its parameters
/// are those 5 blocks and the embedding.
#[test]
fn embedding_slots_give_the_first_stage_one_block_fewer() {
    use plan::memory::{params_busiest_stage, params_per_device};
    let mut f = kernels("gpt3-175b", 1536);
    f.model.layers = Some(70);
    let j = Job::from_file(&f).unwrap();
    let mut l = Layout::new(4, 12, 8);
    l.embedding_slots = true;
    assert_eq!((l.layers_per_stage(70), l.first_stage_layers(70)), (6, 5));
    let m = &j.model;
    let emb = m.vocab as f64 * m.hidden as f64;
    let expect = (5.0 * m.dense_params_per_layer() + emb) / 4.0;
    let (first, _) = params_per_device(&j, &l);
    assert!((first / expect - 1.0).abs() < 1e-12, "{first} vs {expect}");
    // The busiest stage is a middle one (6 blocks) when a block outweighs the embedding.
    let (busiest, _) = params_busiest_stage(&j, &l);
    let six = 6.0 * m.dense_params_per_layer() / 4.0;
    assert!((busiest - first.max(six)).abs() < 1.0, "{busiest}");
    // Without embedding slots nothing changes.
    l.embedding_slots = false;
    l.pp = 10;
    assert_eq!(l.first_stage_layers(70), l.layers_per_stage(70));
}

/// DeepSpeed 0.6-0.7 reduces the BF16 optimizer's FP32 gradients cast to BF16: half the bytes
/// on the wire, and a 2-byte-per-parameter cast copy after the flush. Omitted, the FP32 copy is
/// reduced as before.
#[test]
fn gradients_reduced_in_the_weights_precision() {
    use plan::job::GradCommPrecision;
    let mut f = kernels("llama2-70b", 256);
    f.training.grad_precision = GradPrecision::ParamAndFp32;
    let fp32 = Job::from_file(&f).unwrap();
    assert_eq!(fp32.grad_comm_precision, GradCommPrecision::Grad);
    assert_eq!(fp32.grad_comm_bytes(), 4.0);
    f.training.grad_comm_precision = GradCommPrecision::Param;
    let bf16 = Job::from_file(&f).unwrap();
    assert_eq!(bf16.grad_comm_bytes(), 2.0);
    let mut l = Layout::new(8, 4, 8);
    l.recompute = Recompute::Full;
    let a = evaluate(&fp32, &h100(32), &l).unwrap();
    let b = evaluate(&bf16, &h100(32), &l).unwrap();
    let ratio = b.step.dp_comm / a.step.dp_comm;
    assert!((0.45..0.55).contains(&ratio), "{ratio}");
    assert_eq!(a.memory.step_transient, 0.0);
    assert!((b.memory.step_transient / b.memory.params_local - 2.0).abs() < 1e-12);
    // What the caching allocator reserves: without a transient, the total; with a cast copy
    // larger than every activation tensor, a segment of its own on top of the activations.
    assert_eq!(a.memory.reserved, a.memory.total);
    assert_eq!(b.memory.reserved, b.memory.total_without_reuse);
    assert!(b.memory.reserved > b.memory.total, "{:?}", b.memory);
}

/// A cast copy no larger than the largest activation tensor fits in a cached activation block:
/// reserved is the total. A tiny model at a long sequence with unfused attention has a score
/// matrix larger than its whole parameter count in BF16.
#[test]
fn a_small_cast_reuses_an_activation_segment() {
    use plan::job::GradCommPrecision;
    use plan::memory::largest_activation_tensor;
    let mut f = kernels("llama2-7b", 8);
    f.model.layers = Some(2);
    f.model.hidden = Some(256);
    f.model.heads = Some(4);
    f.model.kv_heads = Some(4);
    f.model.ffn = Some(1024);
    f.model.vocab = Some(1024);
    f.model.seq = Some(8192);
    f.training.attention = plan::job::AttentionKernel::Unfused;
    f.training.grad_precision = GradPrecision::ParamAndFp32;
    f.training.grad_comm_precision = GradCommPrecision::Param;
    let j = Job::from_file(&f).unwrap();
    let l = Layout::new(1, 1, 8);
    let m = evaluate(&j, &h100(1), &l).unwrap().memory;
    // 4 heads x 8192^2 x 2 bytes = 537 MB of scores against ~2.2M parameters.
    assert!(largest_activation_tensor(&j, &l) > m.step_transient);
    assert!(m.step_transient > 0.0);
    assert_eq!(m.reserved, m.total);
}

/// The kernel model's runtime memory: the CUDA context (1,271 MiB), the embedding dropout mask
/// (s·b·h bytes) per micro-batch in flight on the first stage and, with an embedding norm, its
/// input (2·s·b·h); the roofline model keeps its figure.
#[test]
fn kernel_memory_adds_the_context_and_the_embedding_stage() {
    use plan::memory::CUDA_CONTEXT_BYTES;
    let roof = Job::from_file(&JobFile::preset("llama2-7b", 64)).unwrap();
    let mut f = kernels("llama2-7b", 64);
    let kern = Job::from_file(&f).unwrap();
    let mut l = Layout::new(8, 4, 2);
    l.sequence_parallel = false;
    l.recompute = Recompute::Full;
    let cl = h100(8);
    let (r, k) = (
        evaluate(&roof, &cl, &l).unwrap().memory,
        evaluate(&kern, &cl, &l).unwrap().memory,
    );
    assert_eq!(r.context, 0.0);
    assert_eq!(k.context, CUDA_CONTEXT_BYTES);
    let sbh = 4096.0 * 4096.0;
    let flight = 4.0; // 1F1B: p micro-batches in flight on the first stage
    assert!((k.activations - r.activations - sbh * flight).abs() < 1.0);
    f.model.embedding_norm = Some(true);
    let normed = evaluate(&Job::from_file(&f).unwrap(), &cl, &l)
        .unwrap()
        .memory;
    assert!((normed.activations - k.activations - 2.0 * sbh * flight).abs() < 1.0);
}

/// The A100 presets carry BigScience's A100 context (1,573 MiB); DeepSpeed's pipeline engine
/// adds, on the first stage, the TP-partitioned stage output per micro-batch in flight
/// (2·s·b·h/t) and, once, the rebuilt full output and gradient with the received partition
/// (2·2·s·b·h + 2·s·b·h/t); nothing with one stage or with Megatron's engine (the default).
#[test]
fn a100_context_and_deepspeed_pipeline_buffers() {
    use plan::job::PipelineEngine;
    use plan::memory::{A100_CUDA_CONTEXT_BYTES, CUDA_CONTEXT_BYTES};
    let mut f = kernels("llama2-7b", 64);
    let megatron = Job::from_file(&f).unwrap();
    assert_eq!(megatron.pipeline_engine, PipelineEngine::Megatron);
    f.training.pipeline_engine = PipelineEngine::Deepspeed;
    let deepspeed = Job::from_file(&f).unwrap();
    let mut l = Layout::new(8, 4, 2);
    l.sequence_parallel = false;
    l.recompute = Recompute::Full;
    let a100 = Cluster::from_file(&ClusterFile::preset("a100-80", 8)).unwrap();
    let (m, d) = (
        evaluate(&megatron, &a100, &l).unwrap().memory,
        evaluate(&deepspeed, &a100, &l).unwrap().memory,
    );
    assert_eq!(m.context, A100_CUDA_CONTEXT_BYTES);
    assert_eq!(
        evaluate(&megatron, &h100(8), &l).unwrap().memory.context,
        CUDA_CONTEXT_BYTES
    );
    let o = 2.0 * 4096.0 * 4096.0; // 2·s·b·h: s = 4,096, b = 1, h = 4,096
    let (t, flight) = (8.0, 4.0);
    let extra = o / t * flight + 2.0 * o + o / t;
    assert!((d.activations - m.activations - extra).abs() < 1.0);
    let one_stage = Layout::new(8, 1, 8);
    assert_eq!(
        evaluate(&megatron, &a100, &one_stage)
            .unwrap()
            .memory
            .activations,
        evaluate(&deepspeed, &a100, &one_stage)
            .unwrap()
            .memory
            .activations
    );
}

/// DeepSpeed's pipeline engine has no interleaved schedule and refuses ZeRO-2/3 with more than
/// one stage: such a layout is refused with the reason; Megatron's schedules run it.
#[test]
fn deepspeed_pipeline_engine_refuses_what_it_cannot_run() {
    use plan::job::PipelineEngine;
    use plan::layout::ZeroStage;
    use plan::pipeline::Schedule;
    let mut f = kernels("llama2-70b", 256);
    f.training.pipeline_engine = PipelineEngine::Deepspeed;
    let j = Job::from_file(&f).unwrap();
    let mut l = Layout::new(8, 4, 8);
    l.zero = ZeroStage::Optimizer;
    assert!(evaluate(&j, &h100(32), &l).is_ok());
    l.schedule = Schedule::Interleaved;
    l.interleave = 2;
    let e = evaluate(&j, &h100(32), &l).unwrap_err().to_string();
    assert!(e.contains("no interleaved schedule"), "{e}");
    l.schedule = Schedule::OneFOneB;
    l.interleave = 1;
    l.zero = ZeroStage::Gradients;
    let e = evaluate(&j, &h100(32), &l).unwrap_err().to_string();
    assert!(e.contains("zero 2") && e.contains("pp 4"), "{e}");
    f.training.pipeline_engine = PipelineEngine::Megatron;
    assert!(evaluate(&Job::from_file(&f).unwrap(), &h100(32), &l).is_ok());
}
