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
    assert!(
        (f.h100_bf16 - s.h100_bf16).abs() < 1e-9,
        "fit {f:?} shipped {s:?}"
    );
    assert!(
        (f.flash_half_len - s.flash_half_len).abs() < 1e-9,
        "fit {f:?} shipped {s:?}"
    );
    assert!(
        (f.m_ramp - s.m_ramp).abs() < 1e-9,
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
    // Memory per GPU: the bar, 5% of the published figures. The prediction is what the
    // caching allocator reserves (`MemoryBreakdown::reserved`, what `nvidia-smi` shows);
    // BLOOM's "60 GB" is GiB (docs/PLAN-VALIDATION.md, "Memory per GPU").
    for c in &r.cases {
        if let Some((published, predicted)) = c.memory_gb {
            let err = predicted / published - 1.0;
            assert!(
                err.abs() <= 0.05,
                "{}: {predicted:.1} GB vs {published:.1} GB",
                c.name
            );
        }
    }
    {
        use plan::cluster::Cluster;
        use plan::job::Job;
        let (_, c) = cases()
            .unwrap()
            .into_iter()
            .find(|(n, _)| n.starts_with("bloom"))
            .unwrap();
        let job = Job::from_file(&c.job).unwrap();
        let cl = Cluster::from_file(&c.cluster).unwrap();
        let l = job.layout.clone().unwrap();
        let m = plan::step::evaluate(&job, &cl, &l).unwrap().memory;
        // The 8 GB BF16 cast after the flush is larger than any activation tensor, so it gets
        // a segment of its own: reserved is the total without reuse, 8 GB over the total.
        assert!(m.step_transient > 10.0 * plan::memory::largest_activation_tensor(&job, &l));
        assert_eq!(m.reserved, m.total_without_reuse);
        assert!(m.reserved > m.total + 7e9, "{m:?}");
        // The other reading of the published "60 GB", thousands of MiB, is within the bar too.
        let thousands_of_mib = 60_000.0 * 1_048_576.0;
        assert!((m.reserved / thousands_of_mib - 1.0).abs() <= 0.05, "{m:?}");
    }
    // The bars on the dense runs, met (all 2.89% / 5.58%), and a regression guard on
    // the held-out half at what the model achieves (2.84% / 5.29%): docs/PLAN.md, "Validation".
    assert!(r.dense_all.mean_abs <= 0.03, "{:?}", r.dense_all);
    assert!(r.dense_all.max_abs <= 0.06, "{:?}", r.dense_all);
    assert!(r.dense_held_out.mean_abs < 0.029, "{:?}", r.dense_held_out);
    assert!(r.dense_held_out.max_abs < 0.055, "{:?}", r.dense_held_out);
    // The MLPerf runs (held out, a fifth source) stay within 5.5% (+1.7 ... +5.3% at this fit;
    // within 5% at the fit before the context-parallel merge traffic: docs/PLAN.md, "Validation").
    for c in r.cases.iter().filter(|c| c.group == "mlperf") {
        assert!(
            c.error.abs() < 0.055,
            "{}: {:+.1}%",
            c.name,
            c.error * 100.0
        );
    }
}

/// MT-NLG (Smith et al. 2022 §2.2-2.4) states why it chose its layout: tensor slicing inside
/// the node, pipelining across nodes, degrees that fit 530B with activation checkpointing.
/// Searched with the options its framework had (no sequence parallelism, no selective
/// recomputation), the fastest priced layout is the published one at 2,800 GPUs; at 2,240 and
/// 3,360 it is PP 7 x DP 40 and PP 21 x DP 20 (full recomputation, TP 8), 1.0% and 1.2% faster
/// than the published layout: less than the model's validated error, so not a proof. With the
/// tie band at that error ([`plan::search::MODEL_ERROR_BAND`]) the search reports those layouts
/// as ties and orders them by memory per GPU, and picks the published layout at all three
/// sizes (docs/PLAN-VALIDATION.md, "Layout search against published choices").
#[test]
fn mtnlg_search_with_its_framework_picks_the_published_layout() {
    use plan::cluster::Cluster;
    use plan::job::Job;
    use plan::layout::Recompute;
    use plan::search::{MODEL_ERROR_BAND, SearchOptions, search};
    let strict = SearchOptions {
        top_k: 3,
        recompute: vec![Recompute::None, Recompute::Full],
        sequence_parallel: false,
        ..Default::default()
    };
    let banded = SearchOptions {
        tie_band: MODEL_ERROR_BAND,
        ..strict.clone()
    };
    for (name, c) in cases().unwrap() {
        if !name.starts_with("mtnlg") {
            continue;
        }
        let mut job = Job::from_file(&c.job).unwrap();
        let cl = Cluster::from_file(&c.cluster).unwrap();
        let p = job.layout.take().unwrap();
        let key = |l: &plan::layout::Layout| (l.tp, l.pp, l.dp, l.micro_batch, l.recompute, l.zero);
        // Strict ranking: the fastest priced layout, and the published one within 2% of it.
        let r = search(&job, &cl, &strict).unwrap();
        let fastest = &r.top[0];
        let expect_fastest = match name.as_str() {
            "mtnlg-530b-2240" => (8, 7, 40, 1, Recompute::Full, p.zero),
            "mtnlg-530b-3360" => (8, 21, 20, 1, Recompute::Full, p.zero),
            _ => key(&p),
        };
        assert_eq!(key(&fastest.layout), expect_fastest, "{name}");
        assert_eq!(r.tied, 1, "{name}");
        let published = r
            .top
            .iter()
            .find(|e| key(&e.layout) == key(&p))
            .unwrap_or_else(|| panic!("{name}: published layout not in the top three"));
        let margin = published.step.total / fastest.step.total - 1.0;
        assert!(margin < 0.02, "{name}: {margin}");
        // Within the model's error band: the published layout is a tie and, with the least
        // memory of the ties, comes first.
        let b = search(&job, &cl, &banded).unwrap();
        assert_eq!(key(&b.top[0].layout), key(&p), "{name}");
        assert!(b.tied >= 2, "{name}: {} tied", b.tied);
        assert!(
            b.top[0].step.total <= fastest.step.total * (1.0 + MODEL_ERROR_BAND),
            "{name}"
        );
        // With today's options the same TP is kept and full recomputation is dropped.
        let modern = search(&job, &cl, &SearchOptions::default()).unwrap();
        assert_eq!(modern.top[0].layout.tp, 8, "{name}");
        assert_ne!(modern.top[0].layout.recompute, Recompute::Full, "{name}");
    }
}

/// BigScience published its layout search (`chronicles-prequel.md`, "Choosing the fastest 3D
/// Topology" and "Rebalancing layers": TP 4/8 × PP 4–12, micro-batch 1–8, all with DeepSpeed
/// activation checkpointing, picked by measured seconds per iteration). Searched with what its
/// stack runs (DeepSpeed's pipeline engine: no interleaving, ZeRO ≤ 1; no sequence parallelism;
/// full recomputation, as BigScience ran every candidate) the strict ranking picks the
/// published TP 4 × PP 12 × DP 8, micro-batch 2, with the embedding and head in slots of their
/// own (72 slots on 12 stages). Allowing no recomputation, the planner prices TP 8 × PP 12 ×
/// DP 4 without it 14.5% faster at 68.6 GB allocated (72.6 reserved) of 80: the margin is
/// beyond the model's error, the memory is not (docs/PLAN-VALIDATION.md, "Layout search against
/// published choices").
#[test]
fn bloom_search_with_its_framework_picks_the_published_layout() {
    use plan::cluster::Cluster;
    use plan::job::Job;
    use plan::layout::Recompute;
    use plan::search::{SearchOptions, search};
    let (_, c) = cases()
        .unwrap()
        .into_iter()
        .find(|(n, _)| n.starts_with("bloom"))
        .unwrap();
    let mut job = Job::from_file(&c.job).unwrap();
    let cl = Cluster::from_file(&c.cluster).unwrap();
    let p = job.layout.take().unwrap();
    let key = |l: &plan::layout::Layout| {
        (
            l.tp,
            l.pp,
            l.dp,
            l.micro_batch,
            l.recompute,
            l.zero,
            l.embedding_slots,
        )
    };
    let opts = SearchOptions {
        recompute: vec![Recompute::Full],
        sequence_parallel: false,
        ..Default::default()
    };
    let r = search(&job, &cl, &opts).unwrap();
    assert_eq!(key(&r.top[0].layout), key(&p), "{:?}", r.top[0].layout);
    assert!(r.rejected.contains_key("the pipeline engine cannot run it"));
    for e in &r.top {
        assert_eq!(e.layout.interleave, 1);
    }
    let free = search(
        &job,
        &cl,
        &SearchOptions {
            recompute: vec![Recompute::None, Recompute::Full],
            ..opts
        },
    )
    .unwrap();
    let best = &free.top[0];
    assert_eq!(best.layout.recompute, Recompute::None);
    assert!(best.step.total < 0.9 * r.top[0].step.total);
    assert!(best.memory.total < best.memory.capacity);
}
