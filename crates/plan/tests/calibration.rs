//! Calibration against published end-to-end numbers (not seed examples). Narayanan et al. 2021
//! ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21,
//! §5.1) estimate, from measured per-GPU throughput on Selene (DGX A100 80 GB, 8 × HDR 200 Gb/s
//! per node, full recomputation, seq 2,048):
//! - GPT-3 175B, 300B tokens, 1,024 GPUs, batch 1,536, 140 TFLOP/s/GPU → 34 days;
//! - 1T (128 × 25,600), 450B tokens, 3,072 GPUs (TP 8, PP 64), batch 3,072, 163 TFLOP/s → 84 days.
//!
//! With the default efficiency factor (0.6 of peak on the matmuls) the planner gives 30.4 and
//! 86.8 days (−10.5%, +3.3%). Calculon (Isaev et al. 2023) reports 3.65% mean / 8.87% worst error
//! on iteration time; the planner is not calibrated to that level: the test only pins ±15%.

use plan::cluster::{Cluster, ClusterFile};
use plan::job::{Job, JobFile};
use plan::layout::{Layout, Recompute};
use plan::step::evaluate;
use plan::units::DAY;

fn days(model: &str, batch: u64, tokens: f64, nodes: u64, tp: u64, pp: u64) -> f64 {
    let mut jf = JobFile::preset(model, batch);
    jf.training.tokens = tokens;
    let job = Job::from_file(&jf).unwrap();
    let mut cf = ClusterFile::preset("a100-80", nodes);
    cf.inter = "ib-hdr".into();
    let c = Cluster::from_file(&cf).unwrap();
    let mut l = Layout::new(tp, pp, nodes * 8 / (tp * pp));
    l.recompute = Recompute::Full;
    evaluate(&job, &c, &l).unwrap().time_to_train_s / DAY
}

#[test]
fn megatron_sc21_gpt3_175b_34_days() {
    let d = days("gpt3-175b", 1536, 300e9, 128, 8, 8);
    assert!((d / 34.0 - 1.0).abs() < 0.15, "{d} days vs 34");
}

#[test]
fn megatron_sc21_1t_84_days() {
    let d = days("gpt-1t", 3072, 450e9, 384, 8, 64);
    assert!((d / 84.0 - 1.0).abs() < 0.15, "{d} days vs 84");
}
