//! `flotilla bench comm`: collective bandwidth and latency, in the manner of nccl-tests.
//!
//! Method (the same as `../shared/peers/gloo_allreduce_bench.py`, so figures compare): per op
//! and size, warm-up calls, then an iteration count chosen by rank 0 to fill `--target-seconds`;
//! every timed iteration starts after a barrier and its time is the maximum over ranks; the
//! reported time is the median. `size` is the per-rank buffer for all-reduce, broadcast and
//! reduce, the gathered output for all-gather, the input for reduce-scatter and the per-rank
//! buffer for all-to-all. `algbw = size / time`; `busbw = algbw x` 2(W-1)/W (all-reduce),
//! (W-1)/W (all-gather, reduce-scatter, all-to-all) or 1 (broadcast, reduce). Beside each
//! measurement: the alpha-beta model's prediction for the algorithm that ran.

use crate::flag_range::{MAX_NPROC, positive_u64, positive_usize, seconds, usize_in};
use crate::spawn::{NodeSpec, Worker, run_node};
use anyhow::{Context, Result, bail};
use comm::algo::Algo;
use comm::group::{GroupConfig, ProcessGroup, TransportPolicy};
use comm::{DType, OpKind};
use std::time::Duration;

/// Options of `flotilla bench comm`.
#[derive(clap::Args, Debug, Clone)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    /// Ranks on this node (processes).
    #[arg(long, default_value_t = 2, value_parser = usize_in(1, MAX_NPROC))]
    pub nproc: usize,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1, value_parser = positive_usize())]
    pub nnodes: usize,
    /// This node's index.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Rendezvous address (node 0 hosts the store there).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub rdzv: std::net::SocketAddr,
    /// Ops: all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "all_reduce,all_gather,reduce_scatter,broadcast"
    )]
    pub ops: Vec<String>,
    /// Explicit sizes (e.g. 4K,64K,1M,64M); overrides --min-bytes/--max-bytes.
    #[arg(long, value_delimiter = ',')]
    pub sizes: Vec<String>,
    /// Smallest size of the sweep.
    #[arg(long, default_value = "8")]
    pub min_bytes: String,
    /// Largest size of the sweep.
    #[arg(long, default_value = "64M")]
    pub max_bytes: String,
    /// Multiply the size by this between steps.
    #[arg(long, default_value_t = 8)]
    pub step_factor: usize,
    /// Element type.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Force an algorithm (ring, tree, double_tree, halving_doubling, direct, pairwise, hierarchical, direct_read).
    #[arg(long)]
    pub algo: Option<String>,
    /// Transports: auto (shared memory within a host) or tcp.
    #[arg(long, default_value = "auto")]
    pub transport: String,
    /// Seconds of timed iterations per op and size.
    #[arg(long, default_value_t = 0.5, value_parser = seconds)]
    pub target_seconds: f64,
    /// Repeat the whole sweep this many times (iterations of all rounds are pooled).
    #[arg(long, default_value_t = 1, value_parser = positive_usize())]
    pub rounds: usize,
    /// Bounds of the iteration count.
    #[arg(long, default_value_t = 3, value_parser = positive_usize())]
    pub min_iters: usize,
    #[arg(long, default_value_t = 200, value_parser = positive_usize())]
    pub max_iters: usize,
    /// Print the calibrated alpha and beta per transport.
    #[arg(long)]
    pub calibrate: bool,
    /// JSON lines instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Stop the job if it runs longer than this many seconds.
    #[arg(long, default_value_t = 1800, value_parser = positive_u64())]
    pub job_timeout_s: u64,
    /// After the warm-up of each op and size, verify one call's result against the closed form
    /// (costs a buffer refill, one call and a comparison per op and size).
    #[arg(long)]
    pub check: bool,
}

/// Parses `4K`, `64M`, `1G`, `512` (binary multiples).
pub fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: usize = num
        .parse()
        .with_context(|| format!("size '{s}' is not a number with an optional K/M/G suffix"))?;
    n.checked_mul(mul)
        .with_context(|| format!("size '{s}' overflows"))
}

fn op_kind(name: &str) -> Result<OpKind> {
    let k = OpKind::ALL.into_iter().find(|k| k.name() == name);
    match k {
        Some(
            k @ (OpKind::AllReduce
            | OpKind::AllGather
            | OpKind::ReduceScatter
            | OpKind::Broadcast
            | OpKind::Reduce
            | OpKind::AllToAll),
        ) => Ok(k),
        _ => bail!(
            "unknown op '{name}' (expected all_reduce, all_gather, reduce_scatter, broadcast, reduce or all_to_all)"
        ),
    }
}

fn sizes(a: &Args) -> Result<Vec<usize>> {
    if !a.sizes.is_empty() {
        return a.sizes.iter().map(|s| parse_size(s)).collect();
    }
    let (lo, hi) = (parse_size(&a.min_bytes)?, parse_size(&a.max_bytes)?);
    if lo == 0 || hi < lo || a.step_factor < 2 {
        bail!("need 0 < --min-bytes <= --max-bytes and --step-factor >= 2");
    }
    let mut v = Vec::new();
    let mut s = lo;
    while s < hi {
        v.push(s);
        s = s.saturating_mul(a.step_factor);
    }
    v.push(hi);
    Ok(v)
}

/// Refuses sizes whose buffers cannot fit in this machine's memory, in the launching process
/// before any rank starts (a refused allocation aborts a rank): each of the `nproc` local ranks
/// holds an op's input and output (up to twice the size, for all-to-all) and the algorithms'
/// scratch (up to the size again).
fn check_memory(sizes: &[usize], nproc: usize) -> Result<()> {
    let biggest = sizes.iter().copied().max().unwrap_or(0) as u64;
    Ok(model::memory::check_fits(
        &format!("{nproc} local ranks with 3 buffers of {biggest} bytes each"),
        (nproc as u64).saturating_mul(3).saturating_mul(biggest),
        model::memory::available_bytes(),
        "give smaller --sizes (or --max-bytes), or fewer --nproc",
    )?)
}

/// Entry point: in the launching process, spawn the workers; in a worker, run the sweep.
pub fn run(a: Args) -> Result<()> {
    // Validate everything before starting processes.
    let ops: Vec<OpKind> = a.ops.iter().map(|o| op_kind(o)).collect::<Result<_>>()?;
    let sizes = sizes(&a)?;
    if a.min_iters > a.max_iters {
        bail!(
            "--min-iters {} exceeds --max-iters {}",
            a.min_iters,
            a.max_iters
        );
    }
    let dtype = DType::parse(&a.dtype)?;
    let algo = a
        .algo
        .as_deref()
        .map(|s| Algo::parse(s).with_context(|| format!("unknown algorithm '{s}'")))
        .transpose()?;
    let transport = match a.transport.as_str() {
        "auto" | "shm" => TransportPolicy::Auto,
        "tcp" => TransportPolicy::TcpOnly,
        t => bail!("unknown transport '{t}' (expected auto or tcp)"),
    };
    match Worker::from_env()? {
        None => {
            check_memory(&sizes, a.nproc)?;
            let spec = NodeSpec {
                nproc: a.nproc,
                nnodes: a.nnodes,
                node_rank: a.node_rank,
                rdzv: a.rdzv,
                job_timeout: Duration::from_secs(a.job_timeout_s),
            };
            let args: Vec<String> = std::env::args().skip(1).collect();
            run_node(&spec, &args)
        }
        Some(w) => {
            let mut cfg = GroupConfig::from_env()?;
            cfg.transport = transport;
            let g = ProcessGroup::new(&w.rdv, "world", w.rank, w.world, cfg)?;
            sweep(&g, &a, &ops, &sizes, dtype, algo)
        }
    }
}

/// One measured row.
#[derive(serde::Serialize)]
struct Row {
    op: &'static str,
    world: usize,
    size_bytes: usize,
    count: usize,
    dtype: &'static str,
    algo: &'static str,
    time_us: f64,
    min_us: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
    predicted_us: Option<f64>,
    model_error_pct: Option<f64>,
    iters: usize,
}

fn sweep(
    g: &ProcessGroup,
    a: &Args,
    ops: &[OpKind],
    sizes: &[usize],
    dtype: DType,
    algo: Option<Algo>,
) -> Result<()> {
    let lead = g.rank() == 0;
    if lead && a.calibrate {
        let t = g.topology();
        for (kind, p) in &t.links {
            let burst = t.burst.get(kind).map_or(String::new(), |b| {
                format!("; bursts at {:.3} GB/s", b / 1e9)
            });
            println!(
                "# calibrated {kind}: alpha {:.2} us, beta {:.3} GB/s (n* = alpha*beta = {:.0} B){burst}",
                p.alpha * 1e6,
                p.beta / 1e9,
                p.alpha * p.beta
            );
        }
        println!(
            "# reduction gamma: {:.3} GB/s; group round {:.2} us (spin {} us); direct read {}; hosts {}, ranks {}, cores {}",
            1.0 / t.gamma / 1e9,
            t.round * 1e6,
            g.spin().as_micros(),
            t.direct_read
                .map_or("off".to_string(), |b| format!("{:.3} GB/s", b / 1e9)),
            t.hosts,
            t.size,
            t.cores
        );
        if !t.latency.is_empty() {
            let probes: Vec<String> = t
                .latency
                .iter()
                .map(|(k, s)| format!("{k} {:.1}", s * 1e6))
                .collect();
            println!(
                "# latency probes ({} B, median us): {}",
                comm::model::LATENCY_PROBE_BYTES,
                probes.join(", ")
            );
        }
    }
    if lead && !a.json {
        println!(
            "{:<15} {:>3} {:>11} {:>10} {:<5} {:<17} {:>11} {:>11} {:>8} {:>8} {:>11} {:>7}",
            "op",
            "W",
            "size_B",
            "count",
            "dtype",
            "algo",
            "time_us",
            "min_us",
            "algbw",
            "busbw",
            "pred_us",
            "err%"
        );
    }
    let mut rows: Vec<(usize, usize, Vec<f64>, &'static str)> = Vec::new();
    for round in 0..a.rounds {
        let mut i = 0;
        for &op in ops {
            for &size in sizes {
                let how = comm::bench::Timing {
                    check: a.check,
                    target_seconds: a.target_seconds,
                    iters: (a.min_iters, a.max_iters),
                };
                let (times, algo_name) = comm::bench::measure(g, op, size, dtype, algo, &how)?;
                if round == 0 {
                    rows.push((
                        ops.iter().position(|o| *o == op).unwrap_or(0),
                        size,
                        times,
                        algo_name,
                    ));
                } else {
                    rows[i].2.extend(times);
                }
                if a.rounds == 1 && lead {
                    print_row(g, a, op, size, dtype, &rows[i].2, algo_name);
                }
                i += 1;
            }
        }
    }
    if a.rounds > 1 && lead {
        for (oi, size, times, algo_name) in &rows {
            print_row(g, a, ops[*oi], *size, dtype, times, algo_name);
        }
    }
    g.barrier()?;
    Ok(())
}

fn print_row(
    g: &ProcessGroup,
    a: &Args,
    op: OpKind,
    size: usize,
    dtype: DType,
    times: &[f64],
    algo_name: &'static str,
) {
    let mut t = times.to_vec();
    t.sort_by(f64::total_cmp);
    let med = t[t.len() / 2];
    let min = t[0];
    let algbw = size as f64 / med / 1e9;
    let w = g.size();
    let sel = g.explain(op, size);
    let predicted = sel
        .candidates
        .iter()
        .find(|c| c.algo.name() == algo_name)
        .map(|c| c.predicted_s);
    let row = Row {
        op: op.name(),
        world: w,
        size_bytes: size,
        count: size / dtype.size(),
        dtype: dtype.name(),
        algo: algo_name,
        time_us: med * 1e6,
        min_us: min * 1e6,
        algbw_gbps: algbw,
        busbw_gbps: algbw * comm::bench::bus_factor(op, w),
        predicted_us: predicted.map(|p| p * 1e6),
        model_error_pct: predicted.map(|p| (med - p) / p * 100.0),
        iters: t.len(),
    };
    if a.json {
        println!("{}", serde_json::to_string(&row).expect("row serialises"));
    } else {
        println!(
            "{:<15} {:>3} {:>11} {:>10} {:<5} {:<17} {:>11.1} {:>11.1} {:>8.3} {:>8.3} {:>11} {:>7}",
            row.op,
            row.world,
            row.size_bytes,
            row.count,
            row.dtype,
            row.algo,
            row.time_us,
            row.min_us,
            row.algbw_gbps,
            row.busbw_gbps,
            row.predicted_us.map_or("-".into(), |p| format!("{p:.1}")),
            row.model_error_pct
                .map_or("-".into(), |e| format!("{e:+.0}")),
        );
    }
}
