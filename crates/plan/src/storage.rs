//! Checkpoint storage: state size, write windows, storms and restore bounds (000 part 1 F33–F35;
//! 004 example 27.2, eqs. 28.17–28.22).

/// Checkpoint bytes: params × bytes per parameter (000 S03: 175e9 × (2 + 8) = 1,750 GB; S61:
/// 70e9 × 16 = 1,120 GB).
pub fn checkpoint_bytes(params: f64, bytes_per_param: f64) -> f64 {
    params * bytes_per_param
}

/// Token read rate r_t = devices × tokens/s per device (004 eq. 28.17: 64 × 20,000 = 1.28e6).
pub fn token_rate(devices: u64, per_device: f64) -> f64 {
    devices as f64 * per_device
}

/// Long-run average write bandwidth = size / interval (004 eq. 28.19: 2 TiB / 1,800 s = 1.138
/// GiB/s).
pub fn average_write_bandwidth(bytes: f64, interval: f64) -> f64 {
    bytes / interval
}

/// Bandwidth needed to persist within a window = size / window (004 eq. 28.20: 17.067 GiB/s).
pub fn window_bandwidth(bytes: f64, window: f64) -> f64 {
    bytes / window
}

/// Shortest write time with `free` bandwidth = size / free (004 eq. 28.21: 128 s > 120 s).
pub fn min_write_time(bytes: f64, free: f64) -> f64 {
    bytes / free
}

/// Whether the window is feasible, with the shortest write time.
pub fn window_feasible(bytes: f64, free: f64, window: f64) -> (bool, f64) {
    let t = min_write_time(bytes, free);
    (t <= window, t)
}

/// Pipelined restore lower bound: max over stages of size / stage bandwidth (004 eq. 28.22:
/// max(2048/32, 2048/16, 2048/24) = 128 s).
pub fn restore_lower_bound(bytes: f64, stage_bw: &[f64]) -> f64 {
    stage_bw.iter().map(|b| bytes / b).fold(0.0, f64::max)
}

/// Fully serial restore: the sum over stages (004 line 272: 277.33 s).
pub fn restore_serial(bytes: f64, stage_bw: &[f64]) -> f64 {
    stage_bw.iter().map(|b| bytes / b).sum()
}

/// Checkpoint storm: R replicas each writing `per_replica` bytes through `bw` (000 part 1 F33,
/// S61: 1,024 × 1,120 GB / 100 GB/s = 11,468.8 s; ZeRO-3 writes one copy: 11.2 s).
pub fn storm_time(replicas: u64, per_replica: f64, bw: f64) -> f64 {
    replicas as f64 * per_replica / bw
}

/// Checkpoints over a run and their volume (000 part 1 F35, S04: 30 days every 10 min → 4,320 ×
/// 1.75 TB = 7.56 PB).
pub fn checkpoint_count_and_volume(duration: f64, interval: f64, bytes: f64) -> (u64, f64) {
    let n = (duration / interval + 1e-9).floor() as u64;
    (n, n as f64 * bytes)
}
