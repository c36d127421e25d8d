//! Refusals: every bad input is an error naming the field and, for inconsistencies, the
//! equation with its values. Also: the shipped example inputs parse and plan.

use plan::PlanError;
use plan::cluster::{Cluster, ClusterFile};
use plan::job::{Job, JobFile};
use plan::layout::Layout;
use plan::step::evaluate;

fn cluster(device: &str, nodes: u64) -> Cluster {
    Cluster::from_file(&ClusterFile::preset(device, nodes)).unwrap()
}

fn job(model: &str, batch: u64) -> Job {
    Job::from_file(&JobFile::preset(model, batch)).unwrap()
}

#[test]
fn tp_must_divide_heads() {
    let e = evaluate(
        &job("llama2-7b", 96),
        &cluster("h100", 3),
        &Layout::new(3, 1, 8),
    )
    .unwrap_err();
    assert_eq!(e.to_string(), "layout.tp: tp 3 does not divide heads 32");
}

#[test]
fn layout_product_must_equal_devices() {
    let e = evaluate(
        &job("gpt3-175b", 1024),
        &cluster("h100", 128),
        &Layout::new(2, 4, 64),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "layout: tp x pp x dp = 2 x 4 x 64 = 512 != 1024 devices"
    );
}

#[test]
fn batch_must_split_evenly() {
    let mut l = Layout::new(8, 1, 4);
    l.micro_batch = 3;
    let e = evaluate(&job("llama2-7b", 64), &cluster("h100", 4), &l).unwrap_err();
    assert!(
        e.to_string()
            .contains("dp x micro_batch = 4 x 3 = 12 does not divide global_batch 64"),
        "{e}"
    );
}

#[test]
fn pp_times_interleave_must_divide_layers() {
    let mut l = Layout::new(1, 3, 8);
    l.schedule = plan::pipeline::Schedule::Interleaved;
    l.interleave = 2;
    let e = evaluate(&job("llama2-7b", 64), &cluster("h100", 3), &l).unwrap_err();
    assert!(
        e.to_string()
            .contains("pp x interleave = 3 x 2 = 6 does not divide layers 32"),
        "{e}"
    );
}

#[test]
fn negative_bandwidth_is_refused() {
    let mut f = ClusterFile::preset("h100", 4);
    f.inter_bw_gbs = Some(-50.0);
    let e = Cluster::from_file(&f).unwrap_err();
    assert!(
        matches!(
            e,
            PlanError::Invalid {
                field: "cluster.inter_bw_gbs",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn unknown_presets_are_refused_with_the_known_list() {
    let e = Cluster::from_file(&ClusterFile::preset("h900", 4)).unwrap_err();
    assert!(matches!(
        e,
        PlanError::UnknownPreset {
            field: "cluster.device",
            ..
        }
    ));
    assert!(e.to_string().contains("h100"));
    let e = Job::from_file(&JobFile::preset("gpt5", 8)).unwrap_err();
    assert!(matches!(
        e,
        PlanError::UnknownPreset {
            field: "model.preset",
            ..
        }
    ));
    let mut f = ClusterFile::preset("h100", 4);
    f.inter = "ib-qdr".into();
    assert!(matches!(
        Cluster::from_file(&f).unwrap_err(),
        PlanError::UnknownPreset {
            field: "cluster.inter",
            ..
        }
    ));
}

#[test]
fn fp8_on_a100_is_refused() {
    let mut f = JobFile::preset("llama2-7b", 64);
    f.training.precision = plan::hardware::Precision::Fp8;
    let j = Job::from_file(&f).unwrap();
    let e = evaluate(&j, &cluster("a100-80", 1), &Layout::new(8, 1, 1)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "precision: device a100-80 has no Fp8 tensor peak"
    );
}

#[test]
fn toml_errors_name_the_problem() {
    let e = JobFile::from_toml(
        "[model]\npreset = \"llama2-7b\"\n[training]\nglobal_batch = 8\nbogus = 1\n",
    )
    .unwrap_err();
    assert!(
        matches!(e, PlanError::Parse { .. }) && e.to_string().contains("bogus"),
        "{e}"
    );
    let e = JobFile::from_toml(
        "[model]\npreset = \"llama2-7b\"\n[training]\nglobal_batch = 8\n[layout]\ntp = 1\npp = 1\ndp = 1\nzero = 5\n",
    )
    .unwrap_err();
    assert!(e.to_string().contains("zero stage 5"), "{e}");
}

#[test]
fn custom_model_needs_its_shape() {
    let f = JobFile::from_toml(
        "[model]\nlayers = 2\nheads = 4\nvocab = 10\nseq = 8\n[training]\nglobal_batch = 8\n",
    )
    .unwrap();
    let e = Job::from_file(&f).unwrap_err();
    assert!(
        matches!(
            e,
            PlanError::Invalid {
                field: "model.hidden",
                ..
            }
        ),
        "{e}"
    );
    let f = JobFile::from_toml(
        "[model]\nlayers = 2\nhidden = 30\nheads = 4\nvocab = 10\nseq = 8\n[training]\nglobal_batch = 8\n",
    )
    .unwrap();
    assert_eq!(
        Job::from_file(&f).unwrap_err().to_string(),
        "model.heads: hidden 30 is not a multiple of heads 4"
    );
}

#[test]
fn out_of_range_numbers_are_refused() {
    let mut f = JobFile::preset("llama2-7b", 8);
    f.training.efficiency = 1.5;
    assert!(matches!(
        Job::from_file(&f).unwrap_err(),
        PlanError::Invalid {
            field: "training.efficiency",
            ..
        }
    ));
    let mut c = ClusterFile::preset("h100", 1);
    c.pue = 0.9;
    assert!(matches!(
        Cluster::from_file(&c).unwrap_err(),
        PlanError::Invalid {
            field: "cluster.pue",
            ..
        }
    ));
    let c = ClusterFile::preset("h100", 0);
    assert!(matches!(
        Cluster::from_file(&c).unwrap_err(),
        PlanError::Invalid {
            field: "cluster.nodes",
            ..
        }
    ));
}

#[test]
fn ep_must_divide_experts_and_dp() {
    let mut l = Layout::new(8, 1, 4);
    l.ep = 3;
    let e = evaluate(&job("mixtral-8x7b", 64), &cluster("h100", 4), &l).unwrap_err();
    assert!(
        e.to_string()
            .contains("ep 3 must divide experts 8 and dp 4"),
        "{e}"
    );
}

#[test]
fn shipped_examples_parse_and_plan() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/plan");
    let read = |n: &str| std::fs::read_to_string(format!("{dir}/{n}")).unwrap();
    let big =
        Cluster::from_file(&ClusterFile::from_toml(&read("h100-1024.toml")).unwrap()).unwrap();
    assert_eq!(big.devices(), 1024);
    for c in ["a100-64.toml", "example-27-3.toml"] {
        Cluster::from_file(&ClusterFile::from_toml(&read(c)).unwrap()).unwrap();
    }
    for j in [
        "gpt3-175b.toml",
        "llama2-70b.toml",
        "mixtral-8x7b.toml",
        "custom-moe.toml",
    ] {
        let job = Job::from_file(&JobFile::from_toml(&read(j)).unwrap()).unwrap();
        let r = plan::report::plan(&job, &big, None).unwrap();
        assert!(r.evaluation.is_some(), "{j}");
        serde_json::to_string(&r).unwrap();
    }
}

/// No input in a grid of small and degenerate layouts panics: each is evaluated or refused.
#[test]
fn degenerate_layouts_never_panic() {
    let j = job("llama2-7b", 64);
    let c = cluster("h100", 2);
    for tp in 0..=5 {
        for pp in 0..=5 {
            for dp in 0..=17 {
                let mut l = Layout::new(tp, pp, dp);
                for mb in [0, 1, 3] {
                    l.micro_batch = mb;
                    let _ = evaluate(&j, &c, &l);
                }
            }
        }
    }
    let mut huge = ClusterFile::preset("h100", u64::MAX);
    assert!(Cluster::from_file(&huge).is_err());
    huge.nodes = 1 << 21;
    let big = Cluster::from_file(&huge).unwrap();
    let r = plan::search::search(&j, &big, &plan::search::SearchOptions::default()).unwrap();
    assert!(r.top.is_empty() || r.top[0].memory.fits());
}

#[test]
fn absurd_batch_and_token_counts_are_refused_by_field() {
    let e = Job::from_file(&JobFile::preset("llama2-7b", u64::MAX)).unwrap_err();
    assert!(e.to_string().starts_with("training.global_batch = "), "{e}");
    let mut f = JobFile::preset("llama2-7b", 1024);
    f.training.tokens = 1e300;
    let e = Job::from_file(&f).unwrap_err();
    assert!(
        e.to_string().contains("training.tokens") && e.to_string().contains("<= 1e18"),
        "{e}"
    );
    f.training.tokens = 15e12;
    assert!(Job::from_file(&f).is_ok());
}
