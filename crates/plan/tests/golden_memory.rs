//! Golden tests: model size, memory per device (ZeRO, activations) and pipeline bubbles.
//! Decimal units (1 GB = 1e9 B) unless a test says otherwise.

use plan::layout::{Recompute, ZeroStage};
use plan::memory::*;
use plan::model::{flops_per_step, model_preset};
use plan::pipeline::*;
use plan::units::*;

fn close(got: f64, want: f64, rel: f64) {
    assert!(
        (got - want).abs() <= rel * want.abs(),
        "got {got}, want {want} (rel {rel})"
    );
}

/// 000 L2327 / Brown et al. 2020: the GPT-3 preset (96 × 12,288) has 174.6e9 parameters (biases
/// ignored); the seeds round to 175e9. Llama 2 70B preset ≈ 69.0e9 (config: 68.98e9).
#[test]
fn presets_parameter_counts() {
    close(model_preset("gpt3-175b").unwrap().params(), 174.6e9, 1e-3);
    close(model_preset("llama2-70b").unwrap().params(), 68.98e9, 2e-3);
    close(model_preset("llama2-7b").unwrap().params(), 6.74e9, 2e-3);
    close(model_preset("llama3-405b").unwrap().params(), 405.8e9, 3e-3);
    let mix = model_preset("mixtral-8x7b").unwrap();
    close(mix.params(), 46.7e9, 3e-3);
    close(mix.active_params(), 12.9e9, 1e-2);
}

/// 000 L1875, L1895-1903 (F17): Adam mixed precision = 2 + 2 + 12 = 16 B/param; 000 L1547 (E2):
/// 80 GB / 16 B = 5e9 params fit in one device.
#[test]
fn seed000_l1875_sixteen_bytes_per_param() {
    assert_eq!(
        state_bytes_per_param(ZeroStage::None, 2.0, 2.0, 12.0, 64),
        16.0
    );
    close(80.0 * GB / 16.0, 5e9, 1e-12);
}

/// 000 Table 5.3, L1939-1953 (E16): with N = 64, ZeRO-1 4.1875, ZeRO-2 2.21875, ZeRO-3 0.25
/// B/param (values computed by the notes, not printed in the seed); limits 4×, 8×, N×.
#[test]
fn seed000_table5_3_zero_stages() {
    let f = |z| state_bytes_per_param(z, 2.0, 2.0, 12.0, 64);
    assert_eq!(f(ZeroStage::Optimizer), 4.1875);
    assert_eq!(f(ZeroStage::Gradients), 2.21875);
    assert_eq!(f(ZeroStage::Parameters), 0.25);
    let big = |z| 16.0 / state_bytes_per_param(z, 2.0, 2.0, 12.0, 1 << 40);
    close(big(ZeroStage::Optimizer), 4.0, 1e-9);
    close(big(ZeroStage::Gradients), 8.0, 1e-9);
}

/// 000 L1885-1927 (E15): Llama-2 7B × 16 B = 112 GB; ZeRO-3 over 64 → 1.75 GB per GPU; 78.25 GB
/// free on an 80 GB A100.
#[test]
fn seed000_l1913_zero3_7b() {
    let per = 7e9 * state_bytes_per_param(ZeroStage::Parameters, 2.0, 2.0, 12.0, 64);
    close(7e9 * 16.0, 112.0 * GB, 1e-12);
    close(per, 1.75 * GB, 1e-12);
    close(80.0 * GB - per, 78.25 * GB, 1e-12);
}

/// 000 L1597 (E3) and part 1 L457 (S23): 175e9 × 2 B = 350 GB → at least ⌈4.375⌉ = 5 H100s.
#[test]
fn seed000_l1597_min_devices_for_weights() {
    assert_eq!(min_devices(175e9 * 2.0, 80.0 * GB), 5);
}

/// 000 L1675 (E7): 175B, micro-batch 4, seq 2,048, h = 12,288, a = 96, 96 layers. Korthikanti
/// without recompute: s·b·h·(34 + 5as/h) = 11.48 GB per layer, 1.102 TB total ("≈1.1 TB");
/// full recompute 2·s·b·h × 96 = 19.33 GB ("≈19.3 GB").
#[test]
fn seed000_l1675_activation_memory_175b() {
    let (s, b, h, a) = (2048.0, 4.0, 12288.0, 96.0);
    let none = activation_bytes_per_layer(s, b, h, a, 1.0, false, Recompute::None, 1.0);
    close(none, 11.476e9, 1e-3);
    close(96.0 * none, 1.102e12, 1e-3);
    let full = activation_bytes_per_layer(s, b, h, a, 1.0, false, Recompute::Full, 1.0);
    close(96.0 * full, 19.33e9, 1e-3);
}

/// 000 L2289 (E25), L2295-2309 (E26): 175B on 64 GPUs: weights 350/64 = 5.47 GB; full state
/// 2,800 GB / 64 = 43.75 GB; + the seed's assumed 50 GB of activations = 93.75 GB > 80 GB.
/// (The 50 GB is not derivable; Korthikanti at b = 1 without recompute gives ≈275 GB.)
#[test]
fn seed000_l2295_zero3_175b_does_not_fit() {
    close(175e9 * 2.0 / 64.0, 5.47e9, 1e-3);
    let st = 175e9 * state_bytes_per_param(ZeroStage::Parameters, 2.0, 2.0, 12.0, 64);
    close(st, 43.75 * GB, 1e-12);
    assert!(st + 50.0 * GB > 80.0 * GB);
    let act = 96.0
        * activation_bytes_per_layer(2048.0, 1.0, 12288.0, 96.0, 1.0, false, Recompute::None, 1.0);
    close(act, 275.5e9, 1e-3);
}

/// 000 L2643 (E38): 175B with 10 B/param (2 W + 8 Adam, the seed's simplification): TP8 →
/// 218.75 GB; TP8 × PP16 → 13.67 GB; with 14 B/param → 19.14 GB. 000 L2325 (E27): 350/8 =
/// 43.75 GB of weights.
#[test]
fn seed000_l2643_static_memory_under_3d() {
    close(175e9 * 10.0 / 8.0, 218.75e9, 1e-12);
    close(175e9 * 10.0 / 128.0, 13.67e9, 1e-3);
    close(175e9 * 14.0 / 128.0, 19.14e9, 1e-3);
    close(175e9 * 2.0 / 8.0, 43.75e9, 1e-12);
}

/// 000 L2709 (E44): KV cache 2 × 80 × 8 × 128 × 2 B × 1,024 tokens × 256 seqs = 85.9 GB; dense
/// MHA (64 KV heads) 687.2 GB.
#[test]
fn seed000_l2709_kv_cache() {
    close(kv_cache_bytes(80, 8, 128, 2.0, 1024, 256), 85.899e9, 1e-4);
    close(kv_cache_bytes(80, 64, 128, 2.0, 1024, 256), 687.19e9, 1e-4);
}

/// 000 L2691-2701 (E43): PPO co-location 1,120 + 140 + 26 + 208 = 1,494 GB → ⌈18.7⌉ = 19 GPUs.
#[test]
fn seed000_l2691_rlhf_min_gpus() {
    let total = 70e9 * 16.0 + 70e9 * 2.0 + 13e9 * 2.0 + 13e9 * 16.0;
    close(total, 1494e9, 1e-12);
    assert_eq!(min_devices(total, 80.0 * GB), 19);
}

/// Part 1 Table 4.3 (L463-481, S24): 175B per GPU: weights 8-way 43.75 GB, optimizer 1,400/2,048
/// = 0.684 GB, grads 350/2,048 = 0.171 GB. The seed's percentages divide by 80 GiB (85.9 GB):
/// 56.6 GB → 65.9%.
#[test]
fn seed000_part1_table4_3_hbm_budget() {
    close(350.0 * GB / 8.0, 43.75 * GB, 1e-12);
    close(1400.0 * GB / 2048.0, 0.684 * GB, 1e-3);
    close(350.0 * GB / 2048.0, 0.171 * GB, 1e-2);
    let low = 43.75 + 0.684 + 10.0 + 0.171 + 2.0;
    close(low * GB / (80.0 * GIB), 0.659, 1e-3);
}

/// 000 L2353, L2357, L2371, L2409, L2647 (E29-E31, E39): (p-1)/(m+p-1): p=8 m=32 → 17.95%;
/// p=16 m=16 → 48.39%; p=4 m=8 → 27.27%; p=16 m=32 → 31.91%; zero-bubble → 0.
#[test]
fn seed000_l2357_bubble_fractions() {
    let f = |p, m| bubble_fraction(Schedule::OneFOneB, p, m, 1);
    close(f(8, 32), 0.179487, 1e-5);
    close(f(16, 16), 0.483871, 1e-5);
    close(f(4, 8), 0.272727, 1e-5);
    close(f(16, 32), 0.319149, 1e-5);
    assert_eq!(bubble_fraction(Schedule::ZeroBubble, 4, 8, 1), 0.0);
    // Interleaving divides the bubble time by v.
    close(
        bubble_fraction(Schedule::Interleaved, 8, 32, 2),
        7.0 / 71.0,
        1e-12,
    );
}

/// 000 L2603 (E36 config C): the seed writes (p-1)/m = 3/32 = 9.4%, inconsistent with its own
/// (p-1)/(m+p-1) = 3/35 = 8.57% elsewhere; we keep both and use the exact one.
#[test]
fn seed000_l2603_bubble_approximation_flag() {
    close(bubble_ratio_approx(4, 32), 0.09375, 1e-12);
    close(
        bubble_fraction(Schedule::OneFOneB, 4, 32, 1),
        0.085714,
        1e-5,
    );
}

/// Derived from 000 E29/E30 (not stated in the seed): 1F1B with p = 8 reaches a 10% bubble at
/// m = 63 (7/70 exactly; strictly below 10% needs 64, 9.86%) and 5% at m = 133 (7/140).
#[test]
fn seed000_l2371_microbatches_for_target_bubble() {
    assert_eq!(min_microbatches_for_bubble(8, 0.10), 63);
    assert!(bubble_fraction(Schedule::OneFOneB, 8, 64, 1) < 0.10);
    assert_eq!(min_microbatches_for_bubble(8, 0.05), 133);
}

/// 000 L2327 (E28), L2353 (E29): stage hand-off b·s·h·2 B: 4 × 2,048 × 12,288 × 2 = 201.3 MB;
/// 8,192 × 2,048 × 2 = 33,554,432 B = 32 MiB (the seed's "≈32 MB" is binary).
#[test]
fn seed000_l2327_pipeline_handoff() {
    close(4.0 * 2048.0 * 12288.0 * 2.0, 201.3e6, 1e-3);
    assert_eq!(8192.0 * 2048.0 * 2.0, 32.0 * MIB);
}

/// 000 L2009 (E18): O_step = 6 × 175e9 × 2e6 tokens = 2.1e18 FLOPs.
#[test]
fn seed000_l2009_flops_per_step() {
    close(flops_per_step(175e9, 2e6), 2.1e18, 1e-12);
}

/// 000 L2519 (E34): MoE dispatch B·S·d·2 = 4 × 2,048 × 4,096 × 2 = 67.1 MB one way, 134 MB round
/// trip.
#[test]
fn seed000_l2519_moe_dispatch_volume() {
    let one = 4.0 * 2048.0 * 4096.0 * 2.0;
    close(one, 67.1e6, 1e-3);
    close(2.0 * one, 134.2e6, 1e-3);
}

/// Vocabulary-parallel against replicated embeddings (Megatron's default vs Flotilla's TP
/// engine today). Llama 2 7B (untied, V = 32,000, h = 4,096, 32 layers), TP 4, PP 1: vocabulary
/// parallel holds (32 · dense + 2·V·h)/4 parameters per device; replicated,
/// 32 · dense/4 + 2·V·h, i.e. 3/4 · 2·V·h = 196.6M more.
#[test]
fn replicated_embedding_counts_the_embedding_whole() {
    use plan::job::{Job, JobFile};
    use plan::layout::Layout;
    let job = Job::from_file(&JobFile::preset("llama2-7b", 64)).unwrap();
    let m = &job.model;
    let vp = Layout::new(4, 1, 1);
    let rep = Layout {
        vocab_parallel: false,
        ..Layout::new(4, 1, 1)
    };
    let (dense_vp, _) = params_per_device(&job, &vp);
    let (dense_rep, _) = params_per_device(&job, &rep);
    let emb = 2.0 * 32_000.0 * 4_096.0;
    close(m.embedding_params(), emb, 1e-12);
    close(
        dense_vp,
        (32.0 * m.dense_params_per_layer() + emb) / 4.0,
        1e-12,
    );
    close(
        dense_rep,
        32.0 * m.dense_params_per_layer() / 4.0 + emb,
        1e-12,
    );
    close(dense_rep - dense_vp, 0.75 * emb, 1e-9);
    // Without tensor parallelism the two are the same.
    let one = Layout {
        vocab_parallel: false,
        ..Layout::new(1, 1, 1)
    };
    close(
        params_per_device(&job, &one).0,
        params_per_device(&job, &Layout::new(1, 1, 1)).0,
        1e-12,
    );
    // Step time: a replicated head adds its 6·V·h per token times (1 - 1/t) to each device's
    // compute (V·h counted once for the head: 32,000 x 4,096 x 6 x (1 - 1/4) = 589.8 MFLOP).
    let cluster =
        plan::cluster::Cluster::from_file(&plan::cluster::ClusterFile::preset("h100", 1)).unwrap();
    let with_dp = |l: Layout| Layout { dp: 2, ..l };
    let e_vp = plan::step::evaluate(&job, &cluster, &with_dp(vp)).unwrap();
    let e_rep = plan::step::evaluate(&job, &cluster, &with_dp(rep)).unwrap();
    let flops_tok = m.flops_per_token() / 4.0;
    let ratio = e_rep.step.compute / e_vp.step.compute;
    close(
        ratio,
        (flops_tok + 0.75 * 6.0 * 32_000.0 * 4_096.0) / flops_tok,
        1e-9,
    );
}

/// The slowest pipeline stage sets the pace: the last one computes its L/p blocks and the
/// whole LM head. Llama 2 7B on one H100 node, PP 2 against PP 1 (same micro-batches): per
/// micro-batch the stage does (F − 6·V·h)/2 + 6·V·h of the F FLOPs per token of the whole
/// model, not F/2.
#[test]
fn the_last_stage_carries_the_head() {
    use plan::cluster::{Cluster, ClusterFile};
    use plan::job::{Job, JobFile};
    use plan::layout::Layout;
    let job = Job::from_file(&JobFile::preset("llama2-7b", 8)).unwrap();
    let cluster = Cluster::from_file(&ClusterFile::preset("h100", 1)).unwrap();
    let one = plan::step::evaluate(&job, &cluster, &Layout::new(1, 1, 8)).unwrap();
    let two = plan::step::evaluate(&job, &cluster, &Layout::new(1, 2, 4)).unwrap();
    let f = job.model.flops_per_token();
    let head = 6.0 * 32_000.0 * 4_096.0;
    let per_mb = |e: &plan::step::Evaluation| e.step.compute / e.microbatches as f64;
    close(
        per_mb(&two) / per_mb(&one),
        ((f - head) / 2.0 + head) / f,
        1e-9,
    );
}
