//! "This machine" as a cluster file for the planner (`flotilla plan --calibrate`, and every
//! run's plan beside actual), from what it measures here: the GEMM kernel's FLOP/s per rank, the memory copy bandwidth, and the α and β
//! of shared memory and of TCP over loopback between two ranks (the group's own ping-pong
//! calibration, 004 eq. 28.10).

use crate::error::{Context, Result};
use comm::group::{GroupConfig, TransportPolicy};
use comm::transport::LinkKind;
use plan::cluster::{ClusterFile, DeviceOverride};
use plan::hardware::THIS_MACHINE;
use std::time::Instant;

/// Bytes of the buffer the copy bandwidth is measured on (well past the caches).
const COPY_BYTES: usize = 256 << 20;

/// What one calibration measured.
#[derive(Debug, Clone, Copy)]
pub struct Calibration {
    /// Ranks the machine is split into (cores / threads per rank).
    pub ranks: u64,
    /// Threads per rank.
    pub threads: usize,
    /// GEMM FLOP/s of one rank (2048^3 f32, median of 5).
    pub gemm_flops: f64,
    /// Copy bandwidth of one core, bytes/s (read + write counted once each).
    pub copy_bw: f64,
    /// Memory of the machine, bytes.
    pub ram: f64,
    /// Shared memory α (s) and β (bytes/s).
    pub shm: (f64, f64),
    /// TCP over loopback α (s) and β (bytes/s).
    pub tcp: (f64, f64),
}

/// Measures this machine with `threads` per rank.
pub fn measure(threads: usize) -> Result<Calibration> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let th = model::Threads::new(threads)?;
    let gemm_flops = crate::metrics::gemm_gflops(&th, 2048, 5) * 1e9;
    let copy_bw = copy_bandwidth();
    let shm = link(TransportPolicy::Auto, LinkKind::Shm)?;
    let tcp = link(TransportPolicy::TcpOnly, LinkKind::Tcp)?;
    Ok(Calibration {
        ranks: (cores / threads.max(1)).max(1) as u64,
        threads,
        gemm_flops,
        copy_bw,
        ram: ram_bytes().unwrap_or(0.0),
        shm,
        tcp,
    })
}

/// A calibration from what a run already measured (its GEMM peak per rank and its group's
/// links), with the copy bandwidth and memory of this machine measured now (a few ms).
pub fn for_run(
    ranks: u64,
    threads: usize,
    gemm_flops: f64,
    shm: (f64, f64),
    tcp: (f64, f64),
) -> Calibration {
    Calibration {
        ranks,
        threads,
        gemm_flops,
        copy_bw: copy_bandwidth(),
        ram: ram_bytes().unwrap_or(0.0),
        shm,
        tcp,
    }
}

/// Best of three copies of [`COPY_BYTES`]: bytes moved (read + written) per second.
fn copy_bandwidth() -> f64 {
    let src = vec![1u8; COPY_BYTES];
    let mut dst = vec![0u8; COPY_BYTES];
    let best = (0..3)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    2.0 * COPY_BYTES as f64 / best
}

/// α and β of `kind` between two ranks (threads of this process) under `policy`.
fn link(policy: TransportPolicy, kind: LinkKind) -> Result<(f64, f64)> {
    let cfg = GroupConfig {
        transport: policy,
        ..GroupConfig::default()
    };
    let what = || format!("calibrating {}", kind.name());
    let out = comm::local::run_threads(2, cfg, move |g| Ok(g.topology().params(kind))).ctx(what)?;
    match out.into_iter().next() {
        Some(p) => {
            let p = p.ctx(what)?;
            Ok((p.alpha, p.beta))
        }
        None => Err(crate::TrainError::Config {
            field: "calibration",
            value: kind.name().into(),
            reason: "no rank returned its link figures".into(),
        }),
    }
}

/// Total memory from /proc/meminfo.
fn ram_bytes() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: f64 = text
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024.0)
}

/// The cluster file of one node of `c.ranks` "devices" (ranks), every device number measured.
pub fn cluster_file(c: &Calibration) -> ClusterFile {
    let tflops = c.gemm_flops / 1e12;
    let mut f = ClusterFile::preset(THIS_MACHINE, 1);
    f.devices_per_node = c.ranks;
    f.device_override = Some(DeviceOverride {
        bf16_tflops: Some(tflops),
        fp8_tflops: Some(0.0),
        fp32_tflops: Some(tflops),
        tf32_tflops: Some(tflops),
        hbm_gb: Some(c.ram / c.ranks as f64 / 1e9),
        hbm_tbs: Some(c.copy_bw / 1e12),
        power_w: Some(0.0),
    });
    f.intra = Some("pcie4".into());
    f.intra_alpha_us = Some(c.shm.0 * 1e6);
    f.intra_bw_gbs = Some(c.shm.1 / 1e9);
    f.inter_alpha_us = Some(c.tcp.0 * 1e6);
    f.inter_bw_gbs = Some(c.tcp.1 / 1e9);
    f.memory_reserve_gb = 0.0;
    f.node_power_kw = None;
    f
}
