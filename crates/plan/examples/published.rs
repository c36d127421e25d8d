//! The published-runs suite's fit and per-case breakdowns (docs/PLAN.md "Validation"):
//! `cargo run --release -p flotilla-plan --example published`. `flotilla plan --validate`
//! prints the report; this also prints the fitted parameters and, per case, the step's terms
//! and one layer's kernel times, which docs/PLAN.md quotes.

use plan::validate::{cases, fit, render, validate};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let f = fit()?;
    println!("{f:?}");
    println!("{}", render(&validate(f)?));
    breakdowns()
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
