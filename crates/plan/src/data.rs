//! Data pipeline: read bandwidth, data stall and prefetch depth (000 eqs. 4.1–4.3, F18–F20;
//! 004 eqs. 28.8, 28.9, 28.16).

/// Eq. 4.1: BW_required = N_GPU × η_target × D_batch / T_iteration, with D_batch the bytes of one
/// local batch (000 S60: 256 × 0.8 × 38.4 MB / 0.2 s = 39.32 GB/s).
pub fn required_bandwidth(n_gpu: u64, eta: f64, batch_bytes: f64, t_iter: f64) -> f64 {
    n_gpu as f64 * eta * batch_bytes / t_iter
}

/// Eq. 4.2: data stall % = (T_step − T_compute)/T_step × 100.
pub fn stall_percent(t_step: f64, t_compute: f64) -> f64 {
    (t_step - t_compute) / t_step * 100.0
}

/// Step time without overlap: T_compute + T_io (000 F18).
pub fn step_serial(t_compute: f64, t_io: f64) -> f64 {
    t_compute + t_io
}

/// Step time with pipelining: max(T_compute, T_io) (000 F18).
pub fn step_pipelined(t_compute: f64, t_io: f64) -> f64 {
    t_compute.max(t_io)
}

/// Eq. 4.3: Q_min = ⌈T_io,p99 / T_compute⌉ batches of prefetch (000 S69: 500/200 → 3).
pub fn prefetch_depth(io_p99: f64, t_compute: f64) -> u64 {
    ((io_p99 / t_compute) - 1e-12).ceil().max(1.0) as u64
}

/// Host memory for prefetching: Q × batch bytes × GPUs per node (000 F20, S70: 5 × 40 MB × 8 =
/// 1.6 GB).
pub fn prefetch_memory(q: u64, batch_bytes: f64, gpus_per_node: u64) -> f64 {
    q as f64 * batch_bytes * gpus_per_node as f64
}

/// 004 eq. 28.8: serial per-batch time t_r + t_p + t_h + t_g.
pub fn input_serial(stages: &[f64]) -> f64 {
    stages.iter().sum()
}

/// 004 eq. 28.9: pipelined interval ≥ max of the stages.
pub fn input_pipelined(stages: &[f64]) -> f64 {
    stages.iter().copied().fold(0.0, f64::max)
}

/// 004 eq. 28.16: β_effective ≤ min(β_io, a·q) for a requests/s of q bytes.
pub fn effective_io_bandwidth(beta_io: f64, requests_per_s: f64, bytes_per_request: f64) -> f64 {
    beta_io.min(requests_per_s * bytes_per_request)
}
