//! The layout search and the linter.

use plan::cluster::{Cluster, ClusterFile};
use plan::job::{CheckpointSpec, DataSpec, Job, JobFile};
use plan::layout::{Layout, ZeroStage};
use plan::lint::{LintConfig, lint};
use plan::search::{SearchOptions, search};
use plan::step::evaluate;

fn cluster(device: &str, nodes: u64) -> Cluster {
    Cluster::from_file(&ClusterFile::preset(device, nodes)).unwrap()
}

fn codes(job: &Job, c: &Cluster, l: &Layout) -> Vec<String> {
    let e = evaluate(job, c, l).unwrap();
    lint(job, c, &e, &LintConfig::default())
        .into_iter()
        .map(|w| w.code)
        .collect()
}

#[test]
fn search_175b_on_1024_gpus_finds_feasible_fast_layouts() {
    let job = Job::from_file(&JobFile::preset("gpt3-175b", 1536)).unwrap();
    let c = cluster("h100", 128);
    let r = search(&job, &c, &SearchOptions::default()).unwrap();
    assert!(r.evaluated > 1000, "{}", r.evaluated);
    assert_eq!(r.top.len(), 5);
    for w in r.top.windows(2) {
        assert!(w[0].tokens_per_s >= w[1].tokens_per_s);
    }
    for e in &r.top {
        assert!(e.memory.fits());
        assert!(e.layout.tp <= 8);
        assert!(e.mfu > 0.3 && e.mfu < 0.6, "mfu {}", e.mfu);
        assert!(!e.terms.is_empty());
    }
    // Pure DP of 175B cannot fit (000 L2295): 16 B/param × 175e9 = 2.8 TB per replica.
    let job2k = Job::from_file(&JobFile::preset("gpt3-175b", 2048)).unwrap();
    let dp_only = evaluate(&job2k, &c, &Layout::new(1, 1, 1024)).unwrap();
    assert!(!dp_only.memory.fits());
}

/// A tie band reports the layouts priced within it of the fastest as ties and orders them by
/// memory per GPU (least first), the rest by throughput; band 0 (the default) is the strict
/// ranking.
#[test]
fn search_tie_band_orders_ties_by_memory() {
    use plan::search::MODEL_ERROR_BAND;
    let job = Job::from_file(&JobFile::preset("gpt3-175b", 1536)).unwrap();
    let c = cluster("h100", 128);
    let strict = search(&job, &c, &SearchOptions::default()).unwrap();
    let opts = SearchOptions {
        top_k: 50,
        tie_band: MODEL_ERROR_BAND,
        ..SearchOptions::default()
    };
    let r = search(&job, &c, &opts).unwrap();
    let fastest = strict.top[0].step.total;
    assert!(
        r.tied >= 1 && r.tied >= strict.tied,
        "{} {}",
        r.tied,
        strict.tied
    );
    let ties = &r.top[..r.tied.min(r.top.len())];
    for e in ties {
        assert!(e.step.total <= fastest * (1.0 + MODEL_ERROR_BAND) * (1.0 + 1e-12));
    }
    for w in ties.windows(2) {
        assert!(w[0].memory.total <= w[1].memory.total);
    }
    for w in r.top[ties.len()..].windows(2) {
        assert!(w[0].tokens_per_s >= w[1].tokens_per_s);
    }
    // The first tie never needs more memory than the strict pick.
    assert!(r.top[0].memory.total <= strict.top[0].memory.total);
}

#[test]
fn search_moe_tries_expert_parallelism() {
    let job = Job::from_file(&JobFile::preset("mixtral-8x7b", 256)).unwrap();
    let r = search(
        &job,
        &cluster("h100", 8),
        &SearchOptions {
            top_k: 50,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.top.iter().any(|e| e.layout.ep > 1));
    assert!(r.top.iter().all(|e| e.memory.fits()));
}

#[test]
fn search_reports_the_binding_constraint() {
    let job = Job::from_file(&JobFile::preset("llama2-70b", 512)).unwrap();
    let r = search(&job, &cluster("a100-40", 8), &SearchOptions::default()).unwrap();
    assert!(r.rejected.get("out of memory").copied().unwrap_or(0) > 0);
    if let (Some(b), Some(t)) = (&r.binding, r.top.first()) {
        assert!(!b.memory.fits() && b.tokens_per_s > t.tokens_per_s);
    }
}

/// 000 Q9: TP across nodes; 000 Q8: bubble above 10%.
#[test]
fn lint_tp_across_nodes_and_bubble() {
    let job = Job::from_file(&JobFile::preset("gpt3-175b", 64)).unwrap();
    let c = cluster("h100", 128);
    let mut l = Layout::new(16, 16, 4);
    l.recompute = plan::layout::Recompute::Full;
    let got = codes(&job, &c, &l);
    assert!(got.contains(&"tp-across-nodes".to_string()), "{got:?}");
    assert!(got.contains(&"pipeline-bubble".to_string()), "{got:?}");
}

/// 000 P6: ZeRO where plain DP fits; 000 P4: batch above critical.
#[test]
fn lint_zero_not_needed_and_critical_batch() {
    let mut f = JobFile::preset("llama2-7b", 256);
    f.training.critical_batch = Some(128.0);
    let job = Job::from_file(&f).unwrap();
    let c = cluster("h200", 4);
    let mut l = Layout::new(8, 1, 4);
    l.zero = ZeroStage::Optimizer;
    l.recompute = plan::layout::Recompute::Selective;
    let got = codes(&job, &c, &l);
    assert!(got.contains(&"zero-not-needed".to_string()), "{got:?}");
    assert!(got.contains(&"batch-above-critical".to_string()), "{got:?}");
}

/// 000 P10 (interval far from Young's), 004 eq. 28.21 (window infeasible), 000 eq. 4.3 (prefetch
/// depth below the P99 bound), out-of-memory.
#[test]
fn lint_checkpoint_storage_prefetch_memory() {
    let mut f = JobFile::preset("gpt3-175b", 1024);
    f.checkpoint = Some(CheckpointSpec {
        interval_s: Some(8.0 * 3600.0),
        write_s: Some(300.0),
        window_s: Some(60.0),
        restart_s: 0.0,
    });
    f.data = Some(DataSpec {
        bytes_per_sample: 8192.0,
        io_p99_s: 100.0,
        prefetch_depth: 1,
    });
    let job = Job::from_file(&f).unwrap();
    let mut cf = ClusterFile::preset("h100", 128);
    cf.storage_write_gbs = Some(10.0);
    let c = Cluster::from_file(&cf).unwrap();
    let got = codes(&job, &c, &Layout::new(1, 1, 1024));
    for want in [
        "checkpoint-interval",
        "storage-window",
        "prefetch-depth",
        "out-of-memory",
    ] {
        assert!(
            got.contains(&want.to_string()),
            "{want} missing from {got:?}"
        );
    }
}

/// A sane layout on a sane cluster is quiet on the layout checks.
#[test]
fn lint_quiet_on_a_good_layout() {
    let job = Job::from_file(&JobFile::preset("gpt3-175b", 1536)).unwrap();
    let c = cluster("h100", 128);
    let r = search(&job, &c, &SearchOptions::default()).unwrap();
    let best = &r.top[0];
    let got: Vec<String> = lint(&job, &c, best, &LintConfig::default())
        .into_iter()
        .map(|w| w.code)
        .collect();
    assert!(got.is_empty(), "{got:?}");
}

/// Benchmark, not a timed assertion: `cargo test -p flotilla-plan --release -- --ignored
/// --nocapture search_timing`. See also `examples/search_bench.rs`.
#[test]
#[ignore]
fn search_timing() {
    let job = Job::from_file(&JobFile::preset("gpt3-175b", 1536)).unwrap();
    let c = cluster("h100", 128);
    let t = std::time::Instant::now();
    let r = search(&job, &c, &SearchOptions::default()).unwrap();
    println!(
        "175B on 1,024 GPUs: {} layouts in {:?}",
        r.evaluated,
        t.elapsed()
    );
}

/// 004 example 27.3's question at planner level: the cheapest cluster size that meets a deadline.
#[test]
fn sweep_finds_cheapest_size_meeting_deadline() {
    let mut f = JobFile::preset("llama2-7b", 512);
    f.training.tokens = 1e11;
    f.training.deadline_days = Some(10.0);
    let job = Job::from_file(&f).unwrap();
    let c = cluster("h100", 1);
    let pts = plan::sweep::sweep(&job, &c, &[1, 2, 4, 8, 16], &SearchOptions::default()).unwrap();
    assert_eq!(pts.len(), 5);
    let times: Vec<f64> = pts
        .iter()
        .map(|p| p.best.as_ref().unwrap().time_to_train_s)
        .collect();
    assert!(times.windows(2).all(|w| w[1] < w[0]), "{times:?}");
    let best = plan::sweep::cheapest(&pts).unwrap();
    assert!(best.meets_deadline);
    assert!(!pts[0].meets_deadline);
    assert!(plan::sweep::render_sweep(&pts).contains("cheapest"));
}

#[test]
fn explain_shows_reliability_checkpoint_and_memory_formulas_with_their_inputs() {
    let mut jf = JobFile::preset("gpt3-175b", 1536);
    jf.checkpoint = Some(CheckpointSpec {
        interval_s: None,
        write_s: Some(300.0),
        window_s: None,
        restart_s: 600.0,
    });
    let job = Job::from_file(&jf).unwrap();
    let c = cluster("h100", 128);
    let r = plan::report::plan(&job, &c, None).unwrap();
    let names: Vec<&str> = r.summary.terms.iter().map(|t| t.name.as_str()).collect();
    for n in [
        "mtbf",
        "ckpt_size",
        "young",
        "daly",
        "overhead",
        "mem_state",
        "mem_act",
    ] {
        assert!(names.contains(&n), "{n} missing from {names:?}");
    }
    // 000 E56: 50,000 h / 1,024 devices = 48.83 h; Young's interval sqrt(2 x 300 s x M).
    let mtbf = &r.summary.terms[0];
    assert!((mtbf.value / 3600.0 - 48.828).abs() < 0.01, "{mtbf:?}");
    let young = r.summary.terms.iter().find(|t| t.name == "young").unwrap();
    assert!((young.value - (2.0 * 300.0 * mtbf.value).sqrt()).abs() < 1e-6);
    let text = plan::report::render(&r, true);
    assert!(
        text.contains("tau* = sqrt(2 C M)") && text.contains("[000 F4b]"),
        "{text}"
    );
    assert!(!plan::report::render(&r, false).contains("tau* = sqrt"));
}
