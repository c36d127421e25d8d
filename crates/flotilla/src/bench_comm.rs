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

use crate::spawn::{NodeSpec, Worker, run_node};
use anyhow::{Context, Result, bail};
use comm::algo::Algo;
use comm::buffer::HostBuffer;
use comm::group::{GroupConfig, OpOptions, ProcessGroup, TransportPolicy};
use comm::{DType, OpKind, ReduceOp};
use std::time::{Duration, Instant};

/// Options of `flotilla bench comm`.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Ranks on this node (processes).
    #[arg(long, default_value_t = 2)]
    pub nproc: usize,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1)]
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
    /// Force an algorithm (ring, tree, double_tree, halving_doubling, direct, pairwise, hierarchical).
    #[arg(long)]
    pub algo: Option<String>,
    /// Transports: auto (shared memory within a host) or tcp.
    #[arg(long, default_value = "auto")]
    pub transport: String,
    /// Seconds of timed iterations per op and size.
    #[arg(long, default_value_t = 0.5)]
    pub target_seconds: f64,
    /// Repeat the whole sweep this many times (iterations of all rounds are pooled).
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Bounds of the iteration count.
    #[arg(long, default_value_t = 3)]
    pub min_iters: usize,
    #[arg(long, default_value_t = 200)]
    pub max_iters: usize,
    /// Print the calibrated alpha and beta per transport.
    #[arg(long)]
    pub calibrate: bool,
    /// JSON lines instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Stop the job if it runs longer than this many seconds.
    #[arg(long, default_value_t = 1800)]
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

/// Entry point: in the launching process, spawn the workers; in a worker, run the sweep.
pub fn run(a: Args) -> Result<()> {
    // Validate everything before starting processes.
    let ops: Vec<OpKind> = a.ops.iter().map(|o| op_kind(o)).collect::<Result<_>>()?;
    let sizes = sizes(&a)?;
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

fn bus_factor(op: OpKind, w: usize) -> f64 {
    let wf = w as f64;
    match op {
        OpKind::AllReduce => 2.0 * (wf - 1.0) / wf,
        OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => (wf - 1.0) / wf,
        _ => 1.0,
    }
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
            println!(
                "# calibrated {kind}: alpha {:.2} us, beta {:.3} GB/s (n* = alpha*beta = {:.0} B)",
                p.alpha * 1e6,
                p.beta / 1e9,
                p.alpha * p.beta
            );
        }
        println!(
            "# reduction gamma: {:.3} GB/s; group round {:.2} us; direct read {}; hosts {}, ranks {}, cores {}",
            1.0 / t.gamma / 1e9,
            t.round * 1e6,
            t.direct_read
                .map_or("off".to_string(), |b| format!("{:.3} GB/s", b / 1e9)),
            t.hosts,
            t.size,
            t.cores
        );
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
                let (times, algo_name) = measure(g, a, op, size, dtype, algo)?;
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
        busbw_gbps: algbw * bus_factor(op, w),
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

/// Buffers for one op and size.
///
/// Large buffers are huge-page aligned and advised ([`HostBuffer`]), as numpy (the MPI peer's
/// buffers) does for large arrays.
struct Bufs {
    a: HostBuffer,
    b: HostBuffer,
}

fn buffers(op: OpKind, size: usize, w: usize, esz: usize, rank: usize) -> Bufs {
    // Whole elements; all-gather / reduce-scatter / all-to-all need a multiple of W elements.
    let per = |n: usize| (n / esz / w) * esz;
    let (a, b) = match op {
        OpKind::AllGather => (per(size), per(size) * w),
        OpKind::ReduceScatter => (per(size) * w, per(size)),
        OpKind::AllToAll => (per(size) * w, per(size) * w),
        _ => (size / esz * esz, 0),
    };
    let mut av = HostBuffer::zeroed(a);
    // Small integers in every element's low byte: valid for every dtype and no overflow.
    for (i, e) in av.chunks_exact_mut(esz).enumerate() {
        e[0] = ((rank + i) % 7) as u8;
    }
    Bufs {
        a: av,
        b: HostBuffer::zeroed(b),
    }
}

fn call(
    g: &ProcessGroup,
    op: OpKind,
    bufs: &mut Bufs,
    dtype: DType,
    opts: &OpOptions,
) -> comm::Result<()> {
    let w = g.size();
    match op {
        OpKind::AllReduce => g.all_reduce_bytes(&mut bufs.a, dtype, ReduceOp::Sum, opts),
        OpKind::Broadcast => g.broadcast_bytes(&mut bufs.a, dtype, 0, opts),
        OpKind::Reduce => g.reduce_bytes(&mut bufs.a, dtype, 0, ReduceOp::Sum, opts),
        OpKind::AllGather => {
            let counts = vec![bufs.a.len() / dtype.size(); w];
            g.all_gather_bytes(&bufs.a, &mut bufs.b, &counts, dtype, opts)
        }
        OpKind::ReduceScatter => {
            g.reduce_scatter_bytes(&bufs.a, &mut bufs.b, dtype, ReduceOp::Sum, opts)
        }
        OpKind::AllToAll => {
            // Moved as u8 blocks: all-to-all does not look at the element type.
            let counts = vec![bufs.a.len() / w; w];
            let Bufs { a, b } = bufs;
            g.all_to_all_v_with(&a[..], &counts, &mut b[..], &counts, opts)
        }
        _ => unreachable!("validated in op_kind"),
    }
}

/// Times one op and size; returns per-iteration times (max over ranks) and the algorithm used.
fn measure(
    g: &ProcessGroup,
    a: &Args,
    op: OpKind,
    size: usize,
    dtype: DType,
    algo: Option<Algo>,
) -> Result<(Vec<f64>, &'static str)> {
    let mut bufs = buffers(op, size, g.size(), dtype.size(), g.rank());
    let opts = OpOptions {
        algo,
        timeout: None,
    };
    // Warm-up: five calls; the last one's time sizes the run.
    let mut warm = 0.0;
    for _ in 0..5 {
        g.barrier()?;
        let t0 = Instant::now();
        call(g, op, &mut bufs, dtype, &opts)?;
        warm = t0.elapsed().as_secs_f64();
    }
    let algo_name = g.last_selection().map_or("-", |s| s.algo.name());
    if a.check {
        check_once(g, op, size, dtype, &opts)?;
    }
    let mut iters =
        [((a.target_seconds / warm.max(1e-7)) as i64)
            .clamp(a.min_iters as i64, a.max_iters as i64)];
    g.broadcast(&mut iters, 0)?;
    let n = iters[0] as usize;
    let mut times = vec![0f64; n];
    for t in times.iter_mut() {
        g.barrier()?;
        let t0 = Instant::now();
        call(g, op, &mut bufs, dtype, &opts)?;
        *t = t0.elapsed().as_secs_f64();
    }
    g.all_reduce(&mut times, ReduceOp::Max)?;
    Ok((times, algo_name))
}

/// `--check`: refills the buffers, runs one call and compares this rank's result with the closed
/// form of [`buffers`] (element i of rank r holds (r+i)%7 in its low byte). Every rank learns
/// which ranks saw a wrong result, so all of them fail together with the same message.
fn check_once(
    g: &ProcessGroup,
    op: OpKind,
    size: usize,
    dtype: DType,
    opts: &OpOptions,
) -> Result<()> {
    let (w, rank) = (g.size(), g.rank());
    let mut bufs = buffers(op, size, w, dtype.size(), rank);
    call(g, op, &mut bufs, dtype, opts)?;
    let bad = verify(op, &bufs, w, rank, dtype);
    // First bad element index per rank (-1: correct), known to every rank.
    let mut first_bad = vec![-1i64; w];
    if let Some(b) = &bad {
        first_bad[rank] = b.index as i64;
    }
    g.all_reduce(&mut first_bad, ReduceOp::Max)?;
    let wrong: Vec<usize> = (0..w).filter(|&r| first_bad[r] >= 0).collect();
    if let Some(b) = bad {
        bail!(
            "--check: {} of {size} B ({}, algo {}) is wrong on rank {rank}: first bad element index {} \
             (expected {}, got {}; {} of {} elements wrong; wrong ranks {wrong:?})",
            op.name(),
            dtype.name(),
            g.last_selection().map_or("-", |s| s.algo.name()),
            b.index,
            b.expected,
            b.actual,
            b.wrong,
            b.total,
        );
    }
    if !wrong.is_empty() {
        bail!(
            "--check: {} of {size} B ({}) is wrong on rank(s) {wrong:?} (first bad element indices {:?}); \
             rank {rank} is correct",
            op.name(),
            dtype.name(),
            wrong.iter().map(|&r| first_bad[r]).collect::<Vec<_>>()
        );
    }
    Ok(())
}

/// The first wrong element of a checked result.
struct Mismatch {
    index: usize,
    expected: String,
    actual: String,
    wrong: usize,
    total: usize,
}

/// The value `buffers` puts in element `i` of rank `r` (as an integer in the low bytes).
fn input_val(r: usize, i: usize) -> u64 {
    ((r + i) % 7) as u64
}

/// Compares `out` (elements of `dtype`) with `want(i)`, the expected element i as the integer in
/// its low bytes. Integer dtypes compare bytes; float dtypes compare values (the integer is the
/// bit pattern of a small denormal, and sums of such denormals are exact).
fn compare(out: &[u8], dtype: DType, want: impl Fn(usize) -> u64) -> Option<Mismatch> {
    let esz = dtype.size();
    let total = out.len() / esz;
    let mut first: Option<(usize, u64, u64)> = None;
    let mut wrong = 0;
    for i in 0..total {
        let mut raw = [0u8; 8];
        raw[..esz].copy_from_slice(&out[i * esz..(i + 1) * esz]);
        let got = u64::from_le_bytes(raw);
        let exp = want(i);
        let ok = match dtype {
            DType::F32 | DType::F64 | DType::BF16 | DType::F16 => {
                float_value(dtype, got) == float_value(dtype, exp)
            }
            _ => got == exp,
        };
        if !ok {
            wrong += 1;
            if first.is_none() {
                first = Some((i, exp, got));
            }
        }
    }
    first.map(|(index, exp, got)| {
        let show = |bits: u64| match dtype {
            DType::F32 | DType::F64 | DType::BF16 | DType::F16 => {
                format!("{:e} (bits {bits:#x})", float_value(dtype, bits))
            }
            _ => format!("{bits:#x}"),
        };
        Mismatch {
            index,
            expected: show(exp),
            actual: show(got),
            wrong,
            total,
        }
    })
}

/// The value of a float element from its bit pattern.
fn float_value(dtype: DType, bits: u64) -> f64 {
    match dtype {
        DType::F32 => f32::from_bits(bits as u32) as f64,
        DType::F64 => f64::from_bits(bits),
        DType::BF16 => f32::from_bits((bits as u32) << 16) as f64,
        DType::F16 => {
            let (sign, exp, man) = ((bits >> 15) & 1, (bits >> 10) & 0x1f, bits & 0x3ff);
            let mag = match exp {
                0 => man as f64 * 2f64.powi(-24),
                31 if man == 0 => f64::INFINITY,
                31 => f64::NAN,
                e => (1.0 + man as f64 / 1024.0) * 2f64.powi(e as i32 - 15),
            };
            if sign == 1 { -mag } else { mag }
        }
        _ => bits as f64,
    }
}

/// Checks this rank's result of `op` on the buffers of [`buffers`].
fn verify(op: OpKind, bufs: &Bufs, w: usize, rank: usize, dtype: DType) -> Option<Mismatch> {
    let esz = dtype.size();
    let sum = |i: usize| (0..w).map(|r| input_val(r, i)).sum::<u64>();
    match op {
        OpKind::AllReduce => compare(&bufs.a, dtype, sum),
        OpKind::Reduce if rank == 0 => compare(&bufs.a, dtype, sum),
        // Other ranks' buffers are left unchanged.
        OpKind::Reduce => compare(&bufs.a, dtype, |i| input_val(rank, i)),
        OpKind::Broadcast => compare(&bufs.a, dtype, |i| input_val(0, i)),
        OpKind::AllGather => {
            // Block s of the output is rank s's input.
            let per = bufs.a.len() / esz;
            compare(&bufs.b, dtype, |i| {
                input_val(i / per.max(1), i % per.max(1))
            })
        }
        OpKind::ReduceScatter => {
            // This rank's output is block `rank` of the element-wise sum of the inputs.
            let per = bufs.b.len() / esz;
            compare(&bufs.b, dtype, |i| sum(rank * per + i))
        }
        OpKind::AllToAll => {
            // Block s of the output is block `rank` of rank s's input (moved as bytes).
            let blk = bufs.b.len() / w / esz;
            compare(&bufs.b, dtype, |i| {
                let (s, k) = (i / blk.max(1), i % blk.max(1));
                input_val(s, rank * blk + k)
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Element-wise sum of `dtype` buffers computed with the type's own arithmetic (independent
    /// of `verify`'s integer closed form).
    fn add(dtype: DType, acc: &mut [u8], src: &[u8]) {
        let esz = dtype.size();
        for (a, s) in acc.chunks_exact_mut(esz).zip(src.chunks_exact(esz)) {
            match dtype {
                DType::F32 => {
                    let x = f32::from_le_bytes(a.try_into().unwrap())
                        + f32::from_le_bytes(s.try_into().unwrap());
                    a.copy_from_slice(&x.to_le_bytes());
                }
                DType::F64 => {
                    let x = f64::from_le_bytes(a.try_into().unwrap())
                        + f64::from_le_bytes(s.try_into().unwrap());
                    a.copy_from_slice(&x.to_le_bytes());
                }
                DType::BF16 => {
                    let f =
                        |b: &[u8]| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
                    let x = f(a) + f(s);
                    a.copy_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes());
                }
                _ => {
                    let mut x = [0u8; 8];
                    let mut y = [0u8; 8];
                    x[..esz].copy_from_slice(a);
                    y[..esz].copy_from_slice(s);
                    let z = u64::from_le_bytes(x).wrapping_add(u64::from_le_bytes(y));
                    a.copy_from_slice(&z.to_le_bytes()[..esz]);
                }
            }
        }
    }

    /// What each rank's buffers hold after `op`, computed naively.
    fn simulate(op: OpKind, size: usize, w: usize, dtype: DType) -> Vec<Bufs> {
        let esz = dtype.size();
        let mut b: Vec<Bufs> = (0..w).map(|r| buffers(op, size, w, esz, r)).collect();
        let total = |b: &[Bufs]| {
            let mut s = b[0].a.clone();
            for x in &b[1..] {
                add(dtype, &mut s, &x.a);
            }
            s
        };
        match op {
            OpKind::AllReduce => {
                let s = total(&b);
                b.iter_mut().for_each(|x| x.a = s.clone());
            }
            OpKind::Reduce => b[0].a = total(&b),
            OpKind::Broadcast => {
                let s = b[0].a.clone();
                b.iter_mut().for_each(|x| x.a = s.clone());
            }
            OpKind::AllGather => {
                let s: Vec<u8> = b.iter().flat_map(|x| x.a.to_vec()).collect();
                b.iter_mut().for_each(|x| x.b = HostBuffer::from(&s[..]));
            }
            OpKind::ReduceScatter => {
                let s = total(&b);
                let per = b[0].b.len();
                for (r, x) in b.iter_mut().enumerate() {
                    x.b = HostBuffer::from(&s[r * per..(r + 1) * per]);
                }
            }
            OpKind::AllToAll => {
                let blk = b[0].a.len() / w;
                let ins: Vec<Vec<u8>> = b.iter().map(|x| x.a.to_vec()).collect();
                for (r, x) in b.iter_mut().enumerate() {
                    let v: Vec<u8> = (0..w)
                        .flat_map(|s| ins[s][r * blk..(r + 1) * blk].to_vec())
                        .collect();
                    x.b = HostBuffer::from(&v[..]);
                }
            }
            _ => unreachable!(),
        }
        b
    }

    const OPS: [OpKind; 6] = [
        OpKind::AllReduce,
        OpKind::Reduce,
        OpKind::Broadcast,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::AllToAll,
    ];

    #[test]
    fn verify_accepts_correct_results() {
        for op in OPS {
            for w in 1..=5 {
                for dtype in [
                    DType::F32,
                    DType::F64,
                    DType::BF16,
                    DType::I32,
                    DType::I64,
                    DType::U8,
                ] {
                    for size in [0, 8, 1000, 4096, 12345] {
                        for (r, b) in simulate(op, size, w, dtype).iter().enumerate() {
                            if let Some(m) = verify(op, b, w, r, dtype) {
                                panic!(
                                    "{} w={w} {} size={size} rank {r}: index {} expected {} got {}",
                                    op.name(),
                                    dtype.name(),
                                    m.index,
                                    m.expected,
                                    m.actual
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn verify_names_the_first_bad_element() {
        for op in OPS {
            for dtype in [DType::F32, DType::I32, DType::F16] {
                let w = 3;
                let mut b = buffers(op, 4096, w, dtype.size(), 0);
                // Fake a result: the expected one (from verify's own closed form) is not needed;
                // any wrong byte at element 7 must be reported there (and nothing earlier).
                let mut good = simulate_or_input(op, w, dtype);
                let out = if good.b.is_empty() {
                    &mut good.a
                } else {
                    &mut good.b
                };
                out[7 * dtype.size()] ^= 0x40;
                b.a = good.a;
                b.b = good.b;
                let m = verify(op, &b, w, 0, dtype).expect("corruption detected");
                assert_eq!(m.index, 7, "{} {}", op.name(), dtype.name());
                assert_eq!(m.wrong, 1);
            }
        }
    }

    /// Rank 0's correct result (f16 has no simulator: its inputs are small enough that every
    /// op's f16 result equals the u16 one bit for bit).
    fn simulate_or_input(op: OpKind, w: usize, dtype: DType) -> Bufs {
        let sim = if dtype == DType::F16 {
            DType::I32
        } else {
            dtype
        };
        let b = simulate(op, 4096, w, sim).swap_remove(0);
        if dtype != DType::F16 {
            return b;
        }
        // Re-pack i32 elements as u16 (the values are below 2^11: exact f16 denormal bits).
        let pack = |v: &[u8]| -> Vec<u8> {
            v.chunks_exact(4)
                .flat_map(|c| (u32::from_le_bytes(c.try_into().unwrap()) as u16).to_le_bytes())
                .collect()
        };
        let copy = |v: Vec<u8>| {
            let mut h = HostBuffer::zeroed(v.len());
            h.copy_from_slice(&v);
            h
        };
        Bufs {
            a: copy(pack(&b.a)),
            b: copy(pack(&b.b)),
        }
    }
}
