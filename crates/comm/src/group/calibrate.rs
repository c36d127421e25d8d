//! Measuring α and β per transport when a group is created (well under a second).
//!
//! For each transport the group uses, one pair of ranks ping-pongs messages of 8 B, 64 KiB and
//! 1 MiB; the one-way times (half the median round trip) are fitted to `t(n) = α + n/β` by least
//! squares (004 eq. 28.10). Rank 0 also times its reduction kernel (γ). The results go through
//! the store, so every rank selects algorithms from the same numbers.

use super::config::{GroupConfig, TransportPolicy};
use super::core::OpOptions;
use super::core::ProcessGroup;
use crate::algo::{Algo, Ctx};
use crate::buffer::HostBuffer;
use crate::dtype::{DType, ReduceOp, reduce_into};
use crate::engine::{OpCtx, Xfer};
use crate::error::{CommError, OpDesc, Result};
use crate::frame::OpKind;
use crate::model::{DEFAULT_GAMMA, LATENCY_PROBE_BYTES, LinkParams, Topology};

/// Default single-core cross-memory-attach copy rate, bytes/s (memcpy of 256 MiB on one core of
/// the reference machine: 12.4 GB/s, `../shared/peers/results/limits.txt`).
const DEFAULT_DIRECT_READ: f64 = 12.4e9;

/// What rank 0 measures of its host and publishes for everyone.
#[derive(serde::Serialize, serde::Deserialize)]
struct HostCalibration {
    gamma: f64,
    cores: usize,
    direct_read: Option<f64>,
}
use crate::transport::LinkKind;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Message sizes and round trips of the ping-pong: 16 KiB x 10 stays inside any burst
/// allowance worth the name (tbf's needs a bucket of at least rate/HZ, 500 KB at 1 Gbit/s and
/// HZ 250), so its slope from 8 B is the burst rate ([`burst_rate`]).
const PINGPONG: [(usize, usize); 4] = [(8, 30), (16 << 10, 10), (64 << 10, 8), (4 << 20, 3)];

/// The kind of link between group ranks `a` and `b`, from information every rank has.
pub fn kind_between(a: usize, b: usize, host_of: &[usize], cfg: &GroupConfig) -> LinkKind {
    if cfg.transport == TransportPolicy::Auto && host_of[a] == host_of[b] {
        LinkKind::Shm
    } else {
        LinkKind::Tcp
    }
}

/// The topology with default link parameters (before, or without, calibration).
pub fn topology(host_of: &[usize], size: usize, direct_read: bool, cfg: &GroupConfig) -> Topology {
    let hosts = host_of.iter().max().map_or(1, |m| m + 1);
    let mut per_host = vec![0usize; hosts];
    host_of.iter().for_each(|&h| per_host[h] += 1);
    let ranks_per_host = per_host
        .iter()
        .all(|&c| c == per_host[0])
        .then_some(per_host[0]);
    Topology {
        size,
        hosts,
        ranks_per_host,
        intra: if cfg.transport == TransportPolicy::Auto {
            LinkKind::Shm
        } else {
            LinkKind::Tcp
        },
        links: BTreeMap::new(),
        gamma: DEFAULT_GAMMA,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        direct_read: direct_read.then_some(DEFAULT_DIRECT_READ),
        round: 0.0,
        concurrent: None,
        per_byte: BTreeMap::new(),
        latency: BTreeMap::new(),
        burst: BTreeMap::new(),
    }
}

/// The pair that measures `kind`, if any pair of ranks uses it.
fn probe_pair(kind: LinkKind, host_of: &[usize], cfg: &GroupConfig) -> Option<(usize, usize)> {
    let n = host_of.len();
    (0..n)
        .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
        .find(|&(a, b)| kind_between(a, b, host_of, cfg) == kind)
}

/// α and β from (bytes, one-way seconds) points sorted by size: α is the smallest message's
/// time, β the slope between the two largest. A least-squares line is wrong here: on a
/// rate-limited link the first burst goes at wire speed, the curve is not straight, and the
/// fitted intercept goes negative.
pub fn fit(points: &[(f64, f64)]) -> LinkParams {
    let alpha = points.first().map_or(1e-6, |p| p.1).max(1e-7);
    let beta = match points {
        [.., (n1, t1), (n2, t2)] if n2 > n1 && t2 > t1 => (n2 - n1) / (t2 - t1),
        [.., (n, t)] if *t > alpha => n / (t - alpha),
        _ => 1e9,
    };
    LinkParams { alpha, beta }
}

/// The rate of short bursts, from the slope between the two smallest ping-pong points, if it is
/// clearly (1.5x) above the sustained β of [`fit`]; None on a link that sends everything at one
/// rate.
pub fn burst_rate(points: &[(f64, f64)], sustained: &LinkParams) -> Option<f64> {
    match points {
        [(n0, t0), (n1, t1), ..] if n1 > n0 && t1 > t0 => {
            let rate = (n1 - n0) / (t1 - t0);
            (rate > 1.5 * sustained.beta).then_some(rate)
        }
        _ => None,
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Measures and publishes (or waits for) the group's link parameters.
pub(crate) fn calibrate(g: &ProcessGroup) -> Result<Topology> {
    let inner = &g.inner;
    let mut topo = inner.topo.clone();
    let deadline = inner.cfg.connect_timeout;
    let key = |what: &str| format!("{}/calib/{what}", inner.prefix);
    let mut kinds = Vec::new();
    for kind in [LinkKind::Shm, LinkKind::Tcp] {
        let Some((a, b)) = probe_pair(kind, &inner.host_of, &inner.cfg) else {
            continue;
        };
        kinds.push(kind);
        if inner.rank == a || inner.rank == b {
            let peer = if inner.rank == a { b } else { a };
            let points = pingpong(g, peer, inner.rank == a)?;
            if inner.rank == a {
                let p = fit(&points);
                let fitted = (p, burst_rate(&points, &p));
                inner.store.set(
                    &key(kind.name()),
                    &serde_json::to_vec(&fitted).expect("serialises"),
                )?;
            }
        }
    }
    if inner.rank == 0 {
        let hc = HostCalibration {
            gamma: measure_gamma(),
            cores: topo.cores,
            direct_read: topo.direct_read.map(|_| measure_direct_read()),
        };
        inner
            .store
            .set(&key("host"), &serde_json::to_vec(&hc).expect("serialises"))?;
    }
    for kind in kinds {
        let v = inner.store.wait_one(&key(kind.name()), deadline)?;
        let (p, burst): (LinkParams, Option<f64>) = serde_json::from_slice(&v)
            .map_err(|e| CommError::Store(format!("calibration of {}: {e}", kind.name())))?;
        topo.links.insert(kind.name().to_string(), p);
        if let Some(rate) = burst {
            topo.burst.insert(kind.name().to_string(), rate);
        }
    }
    let v = inner.store.wait_one(&key("host"), deadline)?;
    let hc: HostCalibration = serde_json::from_slice(&v)
        .map_err(|e| CommError::Store(format!("host calibration: {e}")))?;
    topo.gamma = hc.gamma;
    topo.cores = hc.cores;
    topo.direct_read = hc.direct_read;
    topo.round = measure_round(g)?;
    // Every later op (the probes below included) spins as the measured round says.
    if inner.cfg.spin.is_none() {
        inner.set_spin(super::config::auto_spin(topo.round));
    }
    if topo.hosts == 1 && g.size() > 1 {
        topo.per_byte = measure_per_byte(g, &topo)?;
        // The all-gather probes also give the per-rank bandwidth with every rank moving data
        // at once (what a collective sees when ranks share cores, and what a two-rank ping-pong
        // cannot show): each rank receives (p-1)/p of the gathered bytes.
        let frac = (g.size() - 1) as f64 / g.size() as f64;
        let rate = |algo| {
            topo.per_byte
                .get(&crate::model::probe_key(OpKind::AllGather, algo))
                .map(|k| frac / k)
        };
        topo.concurrent = rate(Algo::Ring);
        if topo.direct_read.is_some() {
            topo.direct_read = rate(Algo::DirectRead).or(topo.direct_read);
        }
    }
    topo.latency = measure_latency(g, &topo)?;
    Ok(topo)
}

/// The ops whose latency part is measured when a group is created: every collective that
/// `flotilla bench comm` times and whose formula prices steps at a link's α.
const LATENCY_PROBED: [OpKind; 4] = [
    OpKind::AllReduce,
    OpKind::ReduceScatter,
    OpKind::AllGather,
    OpKind::Broadcast,
];

/// Times a [`LATENCY_PROBE_BYTES`] op with every algorithm that applies, for each op of
/// [`LATENCY_PROBED`] (median of [`LATENCY_SAMPLES`] after [`LATENCY_WARM`], timed as
/// `flotilla bench comm` times an op: [`ProcessGroup::timed_calls`]); rank 0's figures are
/// broadcast so every rank selects alike. What a small op costs is mostly waiting for peers to be
/// scheduled, which no link α shows once ranks share cores: on 2 netns hosts x 2 ranks (tbf
/// 1 Gbit/s), the formula said 20 us for a direct 8-byte all-reduce that took 55-74; on one
/// host (4 ranks, 2 cores) it said 6.5 us for a 4 KiB all-gather that took 10.8.
fn measure_latency(g: &ProcessGroup, topo: &Topology) -> Result<BTreeMap<String, f64>> {
    // The largest multiple of 4p bytes within the probe size, so that every rank holds as many
    // f32 of the gathered or scattered buffer.
    let unit = 4 * g.size();
    let n = (LATENCY_PROBE_BYTES / unit).max(1) * unit;
    let mut a = HostBuffer::zeroed(n);
    let mut b = HostBuffer::zeroed(n);
    let mut keys = Vec::new();
    let mut medians = Vec::new();
    for op in LATENCY_PROBED {
        for algo in Algo::ALL {
            if crate::model::formula(op, algo, n, topo).is_none() {
                continue;
            }
            let opts = OpOptions {
                algo: Some(algo),
                timeout: None,
            };
            let mut call = || run_probe(g, op, &mut a, &mut b, &opts);
            g.timed_calls(LATENCY_WARM, &mut call)?;
            medians.push(median(&mut g.timed_calls(LATENCY_SAMPLES, &mut call)?));
            keys.push(crate::model::probe_key(op, algo));
        }
    }
    g.broadcast(&mut medians, 0)?;
    Ok(keys.into_iter().zip(medians).collect())
}

/// Runs `op` once as a probe over the whole of `a` (the per-rank buffer of all-reduce and
/// broadcast, the scattered input of reduce-scatter, the gathered output of all-gather, whose
/// input is `a`'s first 1/p), writing `b`. `a.len()` must be a multiple of 4p (f32 elements,
/// the same count on every rank).
fn run_probe(
    g: &ProcessGroup,
    op: OpKind,
    a: &mut [u8],
    b: &mut [u8],
    opts: &OpOptions,
) -> Result<()> {
    let (n, p) = (a.len(), g.size());
    match op {
        OpKind::AllReduce => g.all_reduce_bytes(a, DType::F32, ReduceOp::Sum, opts),
        OpKind::ReduceScatter => {
            g.reduce_scatter_bytes(a, &mut b[..n / p], DType::F32, ReduceOp::Sum, opts)
        }
        OpKind::AllGather => g.all_gather_bytes(
            &a[..n / p],
            &mut b[..n],
            &vec![n / p / 4; p],
            DType::F32,
            opts,
        ),
        OpKind::Broadcast => g.broadcast_bytes(a, DType::F32, 0, opts),
        other => Err(CommError::InvalidArgument(format!(
            "{} is not a calibration probe",
            other.name()
        ))),
    }
}

impl ProcessGroup {
    /// Runs `call` `n` times and returns each call's time as benchmarks count it (nccl-tests,
    /// `flotilla bench comm`): every call starts after a barrier, and its time is the maximum over
    /// the group's ranks (the slowest rank's view of the op). Collective: every rank must call it
    /// with the same `n`.
    pub fn timed_calls(&self, n: usize, call: &mut dyn FnMut() -> Result<()>) -> Result<Vec<f64>> {
        let mut times = vec![0f64; n];
        for t in times.iter_mut() {
            self.barrier()?;
            let t0 = Instant::now();
            call()?;
            *t = t0.elapsed().as_secs_f64();
        }
        self.all_reduce(&mut times, ReduceOp::Max)?;
        Ok(times)
    }
}

/// Warm-up calls and timed calls of each latency probe.
const LATENCY_WARM: usize = 5;
/// See [`LATENCY_WARM`].
const LATENCY_SAMPLES: usize = 30;

/// Buffer of the per-algorithm probes (per rank for all-reduce, gathered/scattered for the
/// others).
const PER_BYTE_PROBE_BYTES: usize = 16 << 20;

/// The bandwidth-bound candidates whose cost per byte is measured on a single host, where
/// [`worth_probing`] says so. (Halving-doubling is priced from the ring's figure, see
/// `model::STORE_AND_FORWARD`; why the double tree is measured: `algo::double_tree`.)
const PROBED: [(OpKind, Algo); 7] = [
    (OpKind::AllReduce, Algo::Ring),
    (OpKind::AllReduce, Algo::DoubleTree),
    (OpKind::AllReduce, Algo::DirectRead),
    (OpKind::ReduceScatter, Algo::Ring),
    (OpKind::ReduceScatter, Algo::DirectRead),
    (OpKind::AllGather, Algo::Ring),
    (OpKind::AllGather, Algo::DirectRead),
];

/// Times each probed (op, algorithm) at [`PER_BYTE_PROBE_BYTES`] (best of two after a warm-up)
/// and turns it into seconds per byte beyond the formula's latency part. Rank 0's figures are
/// broadcast so every rank selects alike. A whole `flotilla bench comm --nproc 4 --sizes 8` job
/// (spawn, connect, calibrate, one op) takes 0.2 s with shared memory and 0.3-0.4 s over TCP on
/// 2 cores.
fn measure_per_byte(g: &ProcessGroup, topo: &Topology) -> Result<BTreeMap<String, f64>> {
    let p = g.size();
    let n = PER_BYTE_PROBE_BYTES / 4 / p * 4 * p;
    let mut a = HostBuffer::zeroed(n);
    let mut b = HostBuffer::zeroed(n);
    let mut out = BTreeMap::new();
    for (op, algo) in PROBED {
        if !worth_probing(algo, topo) {
            continue;
        }
        let opts = OpOptions {
            algo: Some(algo),
            timeout: None,
        };
        // Best of two timed calls after a warm-up: the minimum is the least noisy estimate
        // of what the algorithm can do on a shared machine.
        let mut t = [f64::INFINITY];
        for i in 0..3 {
            let t0 = Instant::now();
            run_probe(g, op, &mut a, &mut b, &opts)?;
            if i > 0 {
                t[0] = t[0].min(t0.elapsed().as_secs_f64());
            }
        }
        g.broadcast(&mut t, 0)?;
        let latency = crate::model::formula(op, algo, 0, topo).unwrap_or(0.0);
        out.insert(
            crate::model::probe_key(op, algo),
            ((t[0] - latency) / n as f64).max(1e-13),
        );
    }
    Ok(out)
}

/// Whether probing `algo` can change a choice on this host: the single-copy reads need
/// cross-memory attach, and the double tree only beats the ring where local ranks talk over
/// TCP (over shared memory, 4 ranks at 16 MiB, it ran 15.3 ms against the ring's 8.4 and
/// `direct_read`'s 4.6), so shared-memory groups skip its probe at start-up.
fn worth_probing(algo: Algo, topo: &Topology) -> bool {
    match algo {
        Algo::DirectRead => topo.direct_read.is_some(),
        Algo::DoubleTree => topo.intra == LinkKind::Tcp,
        _ => true,
    }
}

/// Seconds per synchronised round of the whole group: the median of 60 barriers (after 5 to
/// warm up) divided by their ⌈log2 p⌉ rounds, as rank 0 measured it (every rank uses rank 0's
/// figure, so selections agree). Sixty samples keep one scheduler hiccup from moving it: with
/// twenty it varied 14-43 us between runs on the reference VM.
fn measure_round(g: &ProcessGroup) -> Result<f64> {
    const WARM: usize = 5;
    const SAMPLES: usize = 60;
    let rounds = (g.size() as f64).log2().ceil().max(1.0);
    let mut times = Vec::with_capacity(SAMPLES);
    for i in 0..WARM + SAMPLES {
        let t0 = Instant::now();
        g.barrier()?;
        if i >= WARM {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let mut r = [median(&mut times) / rounds];
    g.broadcast(&mut r, 0)?;
    Ok(r[0])
}

/// Ping-pong with `peer`; the initiator returns (bytes, one-way seconds) medians per size.
fn pingpong(g: &ProcessGroup, peer: usize, initiator: bool) -> Result<Vec<(f64, f64)>> {
    let inner = &g.inner;
    let mut core = inner.core.lock().unwrap_or_else(|p| p.into_inner());
    let desc = OpDesc {
        group: inner.name.clone(),
        kind: OpKind::Calibrate.name(),
        seq: 0,
        bytes: 0,
        algo: "pingpong",
    };
    let op = OpCtx::new(
        desc,
        OpKind::Calibrate,
        DType::U8,
        0,
        inner.id,
        inner.generation,
        inner.rank,
        inner.size,
        inner.cfg.connect_timeout,
    );
    let mut ctx = Ctx {
        links: core.links.as_mut_slice(),
        op,
    };
    ctx.op.spin = inner.spin();
    let mut buf = vec![0u8; PINGPONG.iter().map(|p| p.0).max().unwrap_or(0)];
    let mut points = Vec::new();
    for (bytes, reps) in PINGPONG {
        let mut rtts = Vec::with_capacity(reps);
        for i in 0..=reps {
            let t0 = Instant::now();
            if initiator {
                ctx.exchange(&mut [Xfer::Send {
                    peer,
                    data: &buf[..bytes],
                }])?;
                ctx.exchange(&mut [Xfer::Recv {
                    peer,
                    buf: &mut buf[..bytes],
                }])?;
            } else {
                ctx.exchange(&mut [Xfer::Recv {
                    peer,
                    buf: &mut buf[..bytes],
                }])?;
                ctx.exchange(&mut [Xfer::Send {
                    peer,
                    data: &buf[..bytes],
                }])?;
            }
            if i > 0 {
                rtts.push(t0.elapsed().as_secs_f64()); // the first round trip warms up
            }
        }
        points.push((bytes as f64, median(&mut rtts) / 2.0));
    }
    Ok(points)
}

/// Seconds per byte of an f32 sum of two 1 MiB buffers (best of 5).
fn measure_gamma() -> f64 {
    let n = 1 << 20;
    let mut a = vec![1u8; n];
    let b = vec![2u8; n];
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        reduce_into(DType::F32, ReduceOp::Sum, &mut a, &b);
        best = best.min(t0.elapsed());
    }
    std::hint::black_box(&a);
    best.as_secs_f64() / n as f64
}

/// Bytes per second of a 4 MiB cross-memory-attach read of this process's own memory (best of
/// 3): the per-core copy rate of the single-copy algorithms.
fn measure_direct_read() -> f64 {
    let n = 4 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let pid = std::process::id() as i32;
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let t0 = Instant::now();
        if crate::algo::direct_read::read_remote(pid, src.as_ptr() as usize, &mut dst).is_err() {
            return DEFAULT_DIRECT_READ;
        }
        best = best.min(t0.elapsed());
    }
    n as f64 / best.as_secs_f64().max(1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_alpha_beta() {
        let truth = LinkParams {
            alpha: 20e-6,
            beta: 2e9,
        };
        let pts: Vec<(f64, f64)> = [8.0, 65536.0, 1048576.0]
            .iter()
            .map(|&n| (n, truth.msg(n)))
            .collect();
        let p = fit(&pts);
        assert!(
            (p.alpha - 20e-6).abs() < 1e-8 && (p.beta - 2e9).abs() < 1e3,
            "{p:?}"
        );
        // A token-bucket link: the first 256 KB at wire speed, then 125 MB/s. The slope between
        // the two largest probes recovers the sustained rate.
        let tbf = |n: f64| 50e-6 + n.min(262144.0) / 3e9 + (n - 262144.0).max(0.0) / 125e6;
        let p = fit(&[
            (8.0, tbf(8.0)),
            (65536.0, tbf(65536.0)),
            (4194304.0, tbf(4194304.0)),
        ]);
        assert!((p.beta - 125e6).abs() / 125e6 < 0.1, "{p:?}");
    }

    #[test]
    fn burst_rate_is_found_on_a_token_bucket_link_only() {
        let at = |f: &dyn Fn(f64) -> f64| -> Vec<(f64, f64)> {
            PINGPONG
                .iter()
                .map(|&(n, _)| (n as f64, f(n as f64)))
                .collect()
        };
        // tbf: the bucket's 256 KB at 2 GB/s, then 125 MB/s.
        let tbf = |n: f64| 7e-6 + n.min(262144.0) / 2e9 + (n - 262144.0).max(0.0) / 125e6;
        let pts = at(&tbf);
        let p = fit(&pts);
        let b = burst_rate(&pts, &p).expect("bursts");
        assert!((b - 2e9).abs() / 2e9 < 0.01, "{b}");
        // A plain link: one rate for every size.
        let wire = |n: f64| 7e-6 + n / 125e6;
        let pts = at(&wire);
        assert_eq!(burst_rate(&pts, &fit(&pts)), None);
    }

    #[test]
    fn probe_pairs_follow_hosts() {
        let cfg = GroupConfig::default();
        assert_eq!(probe_pair(LinkKind::Shm, &[0, 1, 1, 0], &cfg), Some((0, 3)));
        assert_eq!(probe_pair(LinkKind::Tcp, &[0, 0, 1, 1], &cfg), Some((0, 2)));
        assert_eq!(probe_pair(LinkKind::Tcp, &[0, 0], &cfg), None);
    }
}
