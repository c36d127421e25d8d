//! `flotilla plan`: the analytical planner (`flotilla-plan`). Evaluates a job's layout on a
//! cluster, or searches all layouts, and prints a table (`--explain`: every formula with its
//! inputs; `--json`: the whole report).
//!
//! ```text
//! flotilla plan examples/plan/gpt3-175b.toml --cluster examples/plan/h100-1024.toml --search
//! flotilla plan --model llama2-70b --device h100 --nodes 64 --top 10
//! flotilla plan examples/plan/llama2-70b.toml --nodes 64 --sweep-nodes 32,64,128,256
//! flotilla plan --calibrate --out this-machine.toml   # then --cluster this-machine.toml
//! flotilla plan --validate                            # the published-runs suite
//! ```

use std::path::PathBuf;

use crate::flag_range::{MAX_THREADS, positive_f64, positive_u64, usize_in};

use anyhow::{Context, Result, bail};
use plan::cluster::{Cluster, ClusterFile};
use plan::job::{Job, JobFile, ModelFile};
use plan::report::{plan, render};
use plan::search::SearchOptions;
use plan::sweep::{render_sweep, sweep};

/// Options of `flotilla plan`.
#[derive(clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    /// Job TOML: [model], [training], optional [layout], [checkpoint], [data]
    /// (see examples/plan/). Without it, give --model.
    #[arg(value_name = "JOB.toml")]
    job: Option<PathBuf>,
    /// Cluster TOML (nodes, device, links, MTBF, power, price). Without it, give --nodes.
    #[arg(long, value_name = "CLUSTER.toml")]
    cluster: Option<PathBuf>,
    /// Model preset (gpt3-175b, llama2-7b/13b/70b, llama3-8b/70b/405b, mixtral-8x7b,
    /// mt-nlg-530b, gpt-1t); overrides the job file's model.
    #[arg(long)]
    model: Option<String>,
    /// Device preset (a100-40, a100-80, h100, h200, b200, mi300x); overrides the cluster file.
    #[arg(long)]
    device: Option<String>,
    /// Nodes; overrides the cluster file.
    #[arg(long, value_parser = positive_u64())]
    nodes: Option<u64>,
    /// Devices per node; overrides the cluster file.
    #[arg(long, value_parser = positive_u64())]
    devices_per_node: Option<u64>,
    /// Inter-node link preset (ib-hdr, ib-ndr, ib-xdr, roce-100, roce-400, ...).
    #[arg(long)]
    inter: Option<String>,
    /// How collectives are priced: alpha-beta (one α per step) or nccl (NCCL's own model: LL,
    /// LL128 and Simple protocols, ring and tree); overrides the cluster file.
    #[arg(long, value_parser = ["alpha-beta", "nccl"])]
    collectives: Option<String>,
    /// Global batch in sequences (default without a job file: 1024).
    #[arg(long, value_parser = positive_u64())]
    global_batch: Option<u64>,
    /// Tokens to train (for time, cost and energy).
    #[arg(long, value_parser = positive_f64)]
    tokens: Option<f64>,
    /// Search all layouts instead of evaluating the job's [layout] (implied when it has none).
    #[arg(long)]
    search: bool,
    /// Layouts to list from the search.
    #[arg(long, value_name = "K", default_value_t = 5)]
    top: usize,
    /// Let the search put tensor parallelism across nodes (000 Q9 advises against it).
    #[arg(long)]
    tp_across_nodes: bool,
    /// Count layouts priced within PCT percent of the fastest as ties, listed by memory per
    /// GPU, least first (the model is validated to 3% on published runs: `--tie-band 3`; a
    /// faster layout inside that band is not proven faster; docs/PLAN-VALIDATION.md). Default 0: strict
    /// ranking by throughput.
    #[arg(long, value_name = "PCT", default_value_t = 0.0, value_parser = tie_band)]
    tie_band: f64,
    /// Search each of these node counts and print the best layout, time, cost and whether it
    /// meets `deadline_days` (e.g. `--sweep-nodes 16,32,64,128`).
    #[arg(long, value_delimiter = ',', value_name = "N,N,...", value_parser = positive_u64())]
    sweep_nodes: Vec<u64>,
    /// Show every formula with its inputs and the seed section it comes from.
    #[arg(long)]
    explain: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Predict every published run of the suite (crates/plan/tests/published) and print
    /// published vs predicted iteration time, the error and the means.
    #[arg(long)]
    validate: bool,
    /// Measure this machine (GEMM FLOP/s, copy bandwidth, shared-memory and TCP alpha/beta)
    /// and write it as a cluster file whose device is "this-machine".
    #[arg(long)]
    pub calibrate: bool,
    /// Threads per rank for --calibrate (ranks = cores / threads).
    #[arg(
        long,
        default_value_t = 1,
        requires = "calibrate",
        value_parser = usize_in(1, MAX_THREADS)
    )]
    threads: usize,
    /// Where --calibrate writes the cluster file (default: standard output).
    #[arg(long, value_name = "CLUSTER.toml", requires = "calibrate")]
    out: Option<PathBuf>,
}

/// Runs `flotilla plan`.
pub fn run(a: Args) -> Result<()> {
    if a.calibrate {
        let text = render_calibration(&train::planner::calibrate::measure(a.threads)?)?;
        match &a.out {
            Some(p) => {
                std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?;
                eprintln!("# wrote {}", p.display());
            }
            None => print!("{text}"),
        }
        return Ok(());
    }
    if a.validate {
        let r = plan::validate::validate(plan::validate::FitParams::shipped())?;
        match a.json {
            true => println!("{}", serde_json::to_string_pretty(&r)?),
            false => print!("{}", plan::validate::render(&r)),
        }
        return Ok(());
    }
    let mut jf = match (&a.job, &a.model) {
        (Some(p), _) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            JobFile::from_toml(&text).with_context(|| format!("in {}", p.display()))?
        }
        (None, Some(m)) => JobFile::preset(m, 1024),
        (None, None) => bail!("give a JOB.toml or --model PRESET"),
    };
    if let (Some(_), Some(m)) = (&a.job, &a.model) {
        jf.model = ModelFile {
            preset: Some(m.clone()),
            ..ModelFile::default()
        };
    }
    if let Some(b) = a.global_batch {
        jf.training.global_batch = b;
    }
    if let Some(t) = a.tokens {
        jf.training.tokens = t;
    }
    let mut cf = match (&a.cluster, a.nodes) {
        (Some(p), _) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            ClusterFile::from_toml(&text).with_context(|| format!("in {}", p.display()))?
        }
        (None, Some(n)) => ClusterFile::preset(a.device.as_deref().unwrap_or("h100"), n),
        (None, None) => bail!("give --cluster CLUSTER.toml or --nodes N"),
    };
    if let Some(d) = &a.device {
        cf.device = d.clone();
    }
    if let Some(n) = a.nodes {
        cf.nodes = n;
    }
    if let Some(n) = a.devices_per_node {
        cf.devices_per_node = n;
    }
    if let Some(i) = &a.inter {
        cf.inter = i.clone();
    }
    if let Some(c) = &a.collectives {
        cf.collectives = match c.as_str() {
            "nccl" => plan::cluster::CollectiveModel::Nccl,
            _ => plan::cluster::CollectiveModel::AlphaBeta,
        };
    }
    let job = Job::from_file(&jf)?;
    let cluster = Cluster::from_file(&cf)?;
    let opts = SearchOptions {
        top_k: a.top.max(1),
        tp_across_nodes: a.tp_across_nodes,
        tie_band: a.tie_band / 100.0,
        ..SearchOptions::default()
    };
    if !a.sweep_nodes.is_empty() {
        let points = sweep(&job, &cluster, &a.sweep_nodes, &opts)?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&points)?);
        } else {
            print!("{}", render_sweep(&points));
        }
        return Ok(());
    }
    let report = plan(
        &job,
        &cluster,
        (a.search || job.layout.is_none()).then_some(&opts),
    )?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report, a.explain));
    }
    if let Some(sr) = report.search.as_ref().filter(|sr| sr.top.is_empty()) {
        bail!(
            "no layout fits: {} evaluated, {} within memory; skipped {:?}",
            sr.evaluated,
            sr.feasible,
            sr.rejected
        );
    }
    Ok(())
}

/// `flotilla plan --calibrate`'s output: the TOML text, with a header saying what was measured
/// and how.
fn render_calibration(c: &train::planner::calibrate::Calibration) -> Result<String> {
    let body = toml::to_string(&train::planner::calibrate::cluster_file(c))
        .context("writing the cluster TOML")?;
    Ok(format!(
        "# this machine, measured by `flotilla plan --calibrate` ({} rank(s) of {} thread(s)):\n\
         # GEMM 2048^3 f32 {:.1} GFLOP/s per rank (as every precision: the CPU kernels compute in f32);\n\
         # memory copy {:.2} GB/s per core (as HBM bandwidth); RAM {:.1} GB split over the ranks;\n\
         # intra = shared memory between two ranks: alpha {:.2} us, beta {:.2} GB/s;\n\
         # inter = TCP over loopback (a stand-in for a network): alpha {:.2} us, beta {:.2} GB/s.\n\
         # Power and prices are not measured (0 W; the defaults).\n{body}",
        c.ranks,
        c.threads,
        c.gemm_flops / 1e9,
        c.copy_bw / 1e9,
        c.ram / 1e9,
        c.shm.0 * 1e6,
        c.shm.1 / 1e9,
        c.tcp.0 * 1e6,
        c.tcp.1 / 1e9,
    ))
}

/// `--tie-band`: a percentage in [0, 50].
fn tie_band(s: &str) -> std::result::Result<f64, String> {
    crate::flag_range::number_in(s, 0.0, 50.0, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use plan::cluster::Cluster;
    use plan::cluster::ClusterFile;
    use plan::hardware::THIS_MACHINE;
    use train::planner::calibrate::Calibration;

    #[test]
    fn a_calibration_becomes_a_cluster_the_planner_accepts() {
        let c = Calibration {
            ranks: 2,
            threads: 1,
            gemm_flops: 150e9,
            copy_bw: 10e9,
            ram: 24e9,
            shm: (3e-6, 6e9),
            tcp: (20e-6, 2e9),
        };
        let text = render_calibration(&c).unwrap();
        let f = ClusterFile::from_toml(&text).unwrap();
        let cl = Cluster::from_file(&f).unwrap();
        assert_eq!(cl.device.name, "this-machine");
        assert_eq!(cl.devices(), 2);
        assert!((cl.device.fp32 - 150e9).abs() < 1.0, "{}", cl.device.fp32);
        assert!((cl.device.hbm_bw - 10e9).abs() < 1.0);
        assert!((cl.intra.alpha - 3e-6).abs() < 1e-12 && (cl.intra.beta - 6e9).abs() < 1.0);
        assert!((cl.inter.beta - 2e9).abs() < 1.0);
        // Without the measured numbers the device is refused, naming the field and the fix.
        let bare = ClusterFile::preset(THIS_MACHINE, 1);
        let e = Cluster::from_file(&bare).unwrap_err().to_string();
        assert!(
            e.contains("device.fp32") && e.contains("--calibrate"),
            "{e}"
        );
    }
}
