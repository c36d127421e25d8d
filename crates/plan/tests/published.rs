//! The published-runs suite (`tests/published/*.toml`, docs/PLAN.md "Validation"): every case
//! parses and is predicted, the shipped GEMM ceilings are what the fit finds on the fitting
//! half, and the errors stay within what the model achieved when it was fitted.

use plan::validate::{CaseClass, FitParams, cases, fit, render, validate};

#[test]
fn suite_has_fifteen_runs_from_four_sources() {
    let cs = cases().unwrap();
    assert!(cs.len() >= 15, "{}", cs.len());
    let mut groups: Vec<&str> = cs.iter().map(|(_, c)| c.group.as_str()).collect();
    groups.sort();
    groups.dedup();
    assert!(groups.len() >= 4, "{groups:?}");
    for (name, c) in &cs {
        assert!(!c.assumptions.is_empty(), "{name} states no assumptions");
        assert!(c.job.layout.is_some(), "{name} has no layout");
    }
    assert!(cs.iter().any(|(_, c)| c.fit) && cs.iter().any(|(_, c)| !c.fit));
}

#[test]
fn shipped_ceilings_are_the_fit() {
    let f = fit().unwrap();
    let s = FitParams::shipped();
    assert!(
        (f.a100_bf16 - s.a100_bf16).abs() < 1e-9,
        "fit {f:?} shipped {s:?}"
    );
    assert!(
        (f.h100_fp8 - s.h100_fp8).abs() < 1e-9,
        "fit {f:?} shipped {s:?}"
    );
}

#[test]
fn validation_report() {
    let r = validate(FitParams::shipped()).unwrap();
    println!("{}", render(&r));
    assert!(
        r.cases
            .iter()
            .all(|c| c.predicted_s.is_finite() && c.predicted_s > 0.0)
    );
    assert_eq!(
        r.dense_all.n,
        r.cases
            .iter()
            .filter(|c| c.class == CaseClass::Dense)
            .count()
    );
    // Memory per GPU within 5% where a source gives it (issue 30).
    for c in &r.cases {
        if let Some((published, predicted)) = c.memory_gb {
            assert!(
                (predicted / published - 1.0).abs() <= 0.05,
                "{}: {predicted:.1} GB vs {published:.1} GB",
                c.name
            );
        }
    }
    // A regression guard at what the model achieved when fitted (mean 4.1%, max 14.0%), not
    // the bar (mean 3%, max 6%), which this model does not reach: docs/PLAN.md.
    assert!(r.dense_all.mean_abs < 0.045, "{:?}", r.dense_all);
    assert!(r.dense_all.max_abs < 0.150, "{:?}", r.dense_all);
}

#[test]
#[ignore]
fn print_fit() {
    let f = fit().unwrap();
    println!("{f:?}");
    println!("{}", render(&validate(f).unwrap()));
}

#[test]
#[ignore]
fn print_breakdowns() {
    use plan::cluster::Cluster;
    use plan::job::Job;
    for (name, c) in cases().unwrap() {
        let job = Job::from_file(&c.job).unwrap();
        let cl = Cluster::from_file(&c.cluster).unwrap();
        let l = job.layout.clone().unwrap();
        let e = plan::step::evaluate(&job, &cl, &l).unwrap();
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
}

#[test]
#[ignore]
fn print_searches() {
    use plan::cluster::Cluster;
    use plan::job::Job;
    use plan::search::{SearchOptions, search};
    for (name, c) in cases().unwrap() {
        if !(name.starts_with("mtnlg") || name.starts_with("bloom")) {
            continue;
        }
        let mut job = Job::from_file(&c.job).unwrap();
        let cl = Cluster::from_file(&c.cluster).unwrap();
        let published = job.layout.take().unwrap();
        let pe = plan::step::evaluate(&job, &cl, &published).unwrap();
        let r = search(&job, &cl, &SearchOptions { top_k: 8, ..Default::default() }).unwrap();
        println!("{name}: published {:?} -> {:.3} s, mem {:.1} GB", (published.tp, published.pp, published.dp, published.micro_batch, published.recompute, published.zero), pe.step.total, pe.memory.total / 1e9);
        for e in &r.top {
            let l = &e.layout;
            println!("   tp {} pp {} dp {} mb {} v {} {:?} {:?} sp {} -> {:.3} s mem {:.1} GB", l.tp, l.pp, l.dp, l.micro_batch, l.interleave, l.zero, l.recompute, l.sequence_parallel, e.step.total, e.memory.total / 1e9);
            let mut nsp = l.clone();
            nsp.sequence_parallel = false;
            let n = plan::step::evaluate(&job, &cl, &nsp).unwrap();
            println!("      without SP -> {:.3} s mem {:.1} GB", n.step.total, n.memory.total / 1e9);
        }
    }
}
