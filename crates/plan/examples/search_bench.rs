//! Times the layout search for GPT-3 175B on 1,024 H100s (128 nodes × 8) and prints the top
//! layouts. Run: `cargo run --release -p flotilla-plan --example search_bench`.

use plan::cluster::{Cluster, ClusterFile};
use plan::job::{Job, JobFile};
use plan::report::{Report, render};
use plan::search::{SearchOptions, search};
use std::time::Instant;

fn main() -> Result<(), plan::PlanError> {
    let mut jf = JobFile::preset("gpt3-175b", 1536);
    jf.training.tokens = 300e9;
    let job = Job::from_file(&jf)?;
    let cluster = Cluster::from_file(&ClusterFile::preset("h100", 128))?;
    let opts = SearchOptions::default();
    let runs = 5;
    let mut best = f64::INFINITY;
    let mut result = None;
    for _ in 0..runs {
        let t = Instant::now();
        let r = search(&job, &cluster, &opts)?;
        best = best.min(t.elapsed().as_secs_f64());
        result = Some(r);
    }
    let Some(r) = result else { return Ok(()) };
    println!(
        "search 175B on 1024 H100: {} layouts, {} feasible, best of {runs}: {:.1} ms",
        r.evaluated,
        r.feasible,
        best * 1e3
    );
    // The same search priced with the kernel model (docs/PLAN.md, "The kernel model").
    let mut kf = jf.clone();
    kf.training.compute_model = plan::job::ComputeModel::Kernels;
    let kjob = Job::from_file(&kf)?;
    let mut kbest = f64::INFINITY;
    for _ in 0..runs {
        let t = Instant::now();
        let r = search(&kjob, &cluster, &opts)?;
        kbest = kbest.min(t.elapsed().as_secs_f64());
        let _ = r;
    }
    println!(
        "search 175B on 1024 H100 with the kernel model: best of {runs}: {:.1} ms",
        kbest * 1e3
    );
    let report = plan::report::plan(&job, &cluster, Some(&opts))?;
    let _: &Report = &report;
    println!("{}", render(&report, true));
    Ok(())
}
