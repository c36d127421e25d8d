//! Roofline and occupancy (004 eqs. 28.1–28.7).

/// Which resource limits resident blocks per SM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OccupancyLimit {
    /// The architectural block limit.
    Arch,
    /// Registers.
    Registers,
    /// Shared memory.
    SharedMemory,
    /// Resident threads.
    Threads,
}

/// Eq. 28.1: n_block ≤ min(n_arch, ⌊R_SM/(r·t)⌋, ⌊H_SM/h⌋, ⌊T_SM/t⌋) (the shared-memory term is
/// dropped when h = 0). Returns the bound and every limit that attains it.
pub fn blocks_per_sm(
    n_arch: u64,
    regs_sm: u64,
    regs_thread: u64,
    threads_block: u64,
    smem_sm: u64,
    smem_block: u64,
    threads_sm: u64,
) -> (u64, Vec<OccupancyLimit>) {
    let mut lims = vec![
        (OccupancyLimit::Arch, n_arch),
        (
            OccupancyLimit::Registers,
            regs_sm / (regs_thread * threads_block).max(1),
        ),
        (OccupancyLimit::Threads, threads_sm / threads_block.max(1)),
    ];
    if let Some(n) = smem_sm.checked_div(smem_block) {
        lims.push((OccupancyLimit::SharedMemory, n));
    }
    let n = lims.iter().map(|l| l.1).min().unwrap_or(0);
    (
        n,
        lims.into_iter().filter(|l| l.1 == n).map(|l| l.0).collect(),
    )
}

/// Occupancy = active warps / max warps (004 line 42), warps of 32 threads.
pub fn occupancy(blocks: u64, threads_block: u64, threads_sm: u64) -> f64 {
    (blocks * threads_block.div_ceil(32)) as f64 / (threads_sm / 32) as f64
}

/// Eq. 28.2: t ≥ max(F/R_peak, Q/β_mem).
pub fn roofline_time(flops: f64, bytes: f64, peak: f64, mem_bw: f64) -> f64 {
    (flops / peak).max(bytes / mem_bw)
}

/// Eq. 28.2: attainable R = min(R_peak, I·β_mem).
pub fn attainable(intensity: f64, peak: f64, mem_bw: f64) -> f64 {
    peak.min(intensity * mem_bw)
}

/// Eq. 28.3: ridge point I* = R_peak/β_mem.
pub fn ridge_point(peak: f64, mem_bw: f64) -> f64 {
    peak / mem_bw
}

/// Eq. 28.4: I_ideal = 2Bdn / (s(Bd + dn + Bn)) for Y = XW, X ∈ R^{B×d}, W ∈ R^{d×n}.
pub fn gemm_intensity(b: f64, d: f64, n: f64, s: f64) -> f64 {
    2.0 * b * d * n / (s * (b * d + d * n + b * n))
}

/// Smallest batch B with `gemm_intensity(B, d, n, s) ≥ target` (exercise 28.2: d = n = 4096, s =
/// 2, target 50 → 52); None if the limit 2dn/(s(d+n)) never reaches it.
pub fn min_batch_for_intensity(d: f64, n: f64, s: f64, target: f64) -> Option<u64> {
    if 2.0 * d * n / (s * (d + n)) <= target {
        return None;
    }
    // I(B) ≥ T  ⇔  B ≥ T·s·d·n / (2dn − T·s·(d + n)); the ceiling is nudged for rounding.
    let b = target * s * d * n / (2.0 * d * n - target * s * (d + n));
    let mut b = b.ceil().max(1.0) as u64;
    while b > 1 && gemm_intensity((b - 1) as f64, d, n, s) >= target {
        b -= 1;
    }
    while gemm_intensity(b as f64, d, n, s) < target {
        b += 1;
    }
    Some(b)
}
