//! The published-runs suite's fit and per-case breakdowns (docs/PLAN.md "Validation"):
//! `cargo run --release -p flotilla-plan --example published`. `flotilla plan --validate`
//! prints the report; this also prints the fitted parameters and, per case, the step's terms
//! and one layer's kernel times, which docs/PLAN.md and docs/PLAN-VALIDATION.md quote.

use plan::validate::{FitParams, cases, fit, render, run_case, validate};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let f = fit()?;
    println!("{f:?}");
    println!("{}", render(&validate(f)?));
    breakdowns()?;
    nccl_beside()?;
    bigscience_memory()
}

/// The suite priced with NCCL's collective model (`cluster.collectives = "nccl"`) beside the
/// alpha-beta model it was fitted with: each case's error under both.
fn nccl_beside() -> Result<(), Box<dyn std::error::Error>> {
    use plan::cluster::CollectiveModel;
    let p = FitParams::shipped();
    let (mut sum, mut max, mut n) = (0.0_f64, 0.0_f64, 0);
    for (name, c) in cases()? {
        let base = run_case(&name, &c, p)?;
        let mut cn = c.clone();
        cn.cluster.collectives = CollectiveModel::Nccl;
        let r = match run_case(&name, &cn, p) {
            Ok(r) => r,
            Err(e) => {
                println!("nccl {name:<28} not priced: {e}");
                continue;
            }
        };
        println!(
            "nccl {name:<28} alpha-beta {:+6.2}%  nccl {:+6.2}%  (tp {:.3} -> {:.3} s, dp {:.3} -> {:.3} s)",
            base.error * 100.0,
            r.error * 100.0,
            base.step.tp_comm,
            r.step.tp_comm,
            base.step.dp_comm,
            r.step.dp_comm
        );
        if r.class == plan::validate::CaseClass::Dense {
            sum += r.error.abs();
            max = max.max(r.error.abs());
            n += 1;
        }
    }
    println!(
        "nccl dense n = {n}: mean |error| {:.2}%, max {:.2}%",
        100.0 * sum / n as f64,
        100.0 * max
    );
    Ok(())
}

/// BLOOM's shape at the layouts BigScience measured with `nvidia-smi` on their first node (the
/// first pipeline stage: DeepSpeed numbers ranks TP fastest, then DP, then PP) on 2022-02-28,
/// with the BF16 optimizer and the `type:transformer|embedding` partition
/// (bigscience-workshop/bigscience `train/tr11-176B-ml/chronicles-prequel.md`, "Rebalancing
/// layers", NHIDDEN=14336, NLAYERS=70): (tp, dp, micro-batch, heads, GB, seconds per
/// iteration at global batch 2048). The "GB" are GiB read from `nvidia-smi`.
const BIGSCIENCE_MEMORY: [(u64, u64, u64, u64, f64, f64); 5] = [
    (8, 4, 2, 64, 40.0, 121.63),
    (4, 8, 2, 64, 59.0, 102.03),
    (4, 8, 2, 112, 59.0, 104.50),
    (4, 8, 2, 128, 60.0, 105.89),
    (4, 8, 4, 64, 73.0, 102.27),
];

/// Memory per GPU of the BLOOM case at the layouts of [`BIGSCIENCE_MEMORY`], term by term.
fn bigscience_memory() -> Result<(), Box<dyn std::error::Error>> {
    use plan::cluster::Cluster;
    use plan::job::Job;
    let Some((_, c)) = cases()?.into_iter().find(|(n, _)| n.starts_with("bloom")) else {
        return Ok(());
    };
    let gb = 1e9;
    for (tp, dp, micro_batch, heads, gib, seconds) in BIGSCIENCE_MEMORY {
        let published = gib * plan::units::GIB / gb;
        let mut file = c.job.clone();
        file.model.heads = Some(heads);
        file.model.kv_heads = Some(heads);
        let job = Job::from_file(&file)?;
        let cl = Cluster::from_file(&c.cluster)?;
        let Some(mut l) = job.layout.clone() else {
            continue;
        };
        (l.tp, l.dp, l.micro_batch) = (tp, dp, micro_batch);
        let e = plan::step::evaluate(&job, &cl, &l)?;
        let m = e.memory;
        println!(
            "bloom tp {tp} dp {dp} mbs {micro_batch} heads {heads:3}: {:6.2} s vs {seconds} ({:+.1}%); reserved {:5.1} GB vs {gib} GiB = {published:.1} GB ({:+.1}%) = weights {:.1} + grads {:.1} + optimizer {:.1} + activations {:.1} + reserve {:.1} + context {:.2} + after the flush {:.1}; allocated peak {:5.1} GB ({:+.1}%)",
            e.step.total,
            (e.step.total / seconds - 1.0) * 100.0,
            m.reserved / gb,
            (m.reserved / gb / published - 1.0) * 100.0,
            m.weights / gb,
            m.grads / gb,
            m.optimizer / gb,
            m.activations / gb,
            m.reserve / gb,
            m.context / gb,
            m.step_transient / gb,
            m.total / gb,
            (m.total / gb / published - 1.0) * 100.0,
        );
    }
    Ok(())
}

/// Every case's step terms and one layer's kernel times.
fn breakdowns() -> Result<(), Box<dyn std::error::Error>> {
    use plan::cluster::Cluster;
    use plan::job::Job;
    for (name, c) in cases()? {
        let job = Job::from_file(&c.job)?;
        let cl = Cluster::from_file(&c.cluster)?;
        let Some(l) = job.layout.clone() else {
            continue;
        };
        let e = plan::step::evaluate(&job, &cl, &l)?;
        let k = plan::kernels::layer_times(&job, &cl, &l);
        let s = &e.step;
        println!(
            "{name:<26} tot {:7.3} comp {:7.3} bub {:6.3} tp {:6.3} pp {:6.3} cp {:6.3} dp {:6.3}/{:6.3} opt {:6.3} | layer f {:.2e} b {:.2e} r {:.2e} gemm {:.2e} attn {:.2e} mem {:.2e} head {:.2e} m {}",
            s.total,
            s.compute,
            s.bubble,
            s.tp_comm,
            s.pp_comm,
            s.cp_comm,
            s.dp_exposed,
            s.dp_comm,
            s.optimizer,
            k.forward,
            k.backward,
            k.recompute,
            k.gemm,
            k.attention,
            k.memory_bound,
            k.head,
            e.microbatches
        );
    }
    Ok(())
}
