//! Scaling: the fleet law, Amdahl with communication, scaling efficiency, critical batch
//! (000 §2.10–2.11, F2, F6, F9, F21–F24, F36–F39).

/// Fleet law (000 F2, "步耗权衡"): T_step(N) = T_compute/N + T_comm + T_sync − T_overlap, with
/// the overlap clamped to [0, T_comm + T_sync].
pub fn fleet_step_time(t_compute: f64, n: u64, t_comm: f64, t_sync: f64, t_overlap: f64) -> f64 {
    let o = t_overlap.clamp(0.0, t_comm + t_sync);
    t_compute / n.max(1) as f64 + t_comm + t_sync - o
}

/// Scaling efficiency η = T_1 / (N·T_N) (000 eq. 5.1, F21).
pub fn scaling_efficiency(t1: f64, n: u64, t_n: f64) -> f64 {
    t1 / (n.max(1) as f64 * t_n)
}

/// Fleet-law form of η, "Amdahl with communication" (000 F22, "含通信的阿姆达尔定律"):
/// η = 1 / (1 + N·(T_comm + T_sync − T_overlap)/T_compute).
pub fn fleet_efficiency(t_compute: f64, n: u64, t_comm: f64, t_sync: f64, t_overlap: f64) -> f64 {
    let exposed = (t_comm + t_sync - t_overlap).max(0.0);
    1.0 / (1.0 + n.max(1) as f64 * exposed / t_compute)
}

/// Amdahl's bound on speedup for serial fraction s: 1/s (000 F9, E4: 30% → 3.33×).
pub fn amdahl_max_speedup(serial: f64) -> f64 {
    1.0 / serial
}

/// Amdahl's speedup on N devices: 1 / (s + (1 − s)/N).
pub fn amdahl_speedup(serial: f64, n: u64) -> f64 {
    1.0 / (serial + (1.0 - serial) / n.max(1) as f64)
}

/// Communication-to-compute ratio ρ = T_comm / (T_compute/N) (000 F6).
pub fn comm_compute_ratio(t_comm: f64, t_compute: f64, n: u64) -> f64 {
    t_comm / (t_compute / n.max(1) as f64)
}

/// Effective fraction of peak = MFU × η (000 F24, E50: 0.5 × 0.5 = 0.25).
pub fn effective_throughput(mfu: f64, eta: f64) -> f64 {
    mfu * eta
}

/// Critical batch from the gradient noise scale: B* ≈ tr(Σ)/‖∇L‖² (000 F36; E23: 1.6e6/100 =
/// 16,000).
pub fn critical_batch(trace_sigma: f64, grad_norm_sq: f64) -> f64 {
    trace_sigma / grad_norm_sq
}

/// Useful data-parallel workers ≈ B*/b (000 F37).
pub fn useful_workers(b_crit: f64, local_batch: f64) -> f64 {
    b_crit / local_batch
}

/// Wall-clock speedup over a baseline (000 F38, Table 5.5): base_iters / (iters·(1 + overhead)).
pub fn wallclock_speedup(base_iters: f64, iters: f64, comm_overhead: f64) -> f64 {
    base_iters / (iters * (1.0 + comm_overhead))
}

/// Sample efficiency (000 F39): (base_iters/N)/actual_iters.
pub fn sample_efficiency(base_iters: f64, n: u64, iters: f64) -> f64 {
    base_iters / n.max(1) as f64 / iters
}

/// Waste fraction under k:1 oversubscription when sync is a share s of the step (000 F10, N22):
/// s(k−1)/(1 + s(k−1)).
pub fn oversubscription_waste(sync_share: f64, k: f64) -> f64 {
    let x = sync_share * (k - 1.0);
    x / (1.0 + x)
}

/// Gradient-accumulation communication overhead: T_AR / (K·T_compute) (000 F65, L1859).
pub fn accumulation_overhead(t_allreduce: f64, k: u64, t_compute: f64) -> f64 {
    t_allreduce / (k.max(1) as f64 * t_compute)
}
