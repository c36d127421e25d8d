//! Deadline, energy and cost (004 example 27.3, eqs. 28.26–28.27; 000 F40).

/// Time to train: T = tokens / (devices × tokens/s per device) (004 eq. 28.27: 1.28e12 /
/// (64 × 20,000) = 1e6 s).
pub fn time_to_train(tokens: f64, devices: u64, per_device: f64) -> f64 {
    tokens / (devices as f64 * per_device)
}

/// Devices needed to meet a deadline: the continuous lower bound tokens/(deadline × rate), that
/// bound rounded up, and rounded up again to whole nodes (004 line 389: 61.73 → 62 → 64).
pub fn devices_for_deadline(
    tokens: f64,
    deadline: f64,
    per_device: f64,
    per_node: u64,
) -> (f64, u64, u64) {
    let bound = tokens / (deadline * per_device);
    let whole = (bound - 1e-9).ceil().max(1.0) as u64;
    let nodes = whole.div_ceil(per_node.max(1));
    (bound, whole, nodes * per_node.max(1))
}

/// Facility energy in kWh: (nodes × node kW + other kW) × PUE × hours (004 eq. 28.26 with constant
/// power; example 27.3: (8 × 8 + 20) × 1.2 × 277.78 h = 28,000 kWh).
pub fn energy_kwh(nodes: u64, node_kw: f64, other_kw: f64, pue: f64, hours: f64) -> f64 {
    (nodes as f64 * node_kw + other_kw) * pue * hours
}

/// The cost of a run as 004 example 27.3 splits it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunCost {
    /// Electricity.
    pub electricity: f64,
    /// Depreciation and maintenance (device-hours × rate).
    pub devices: f64,
    /// Sum.
    pub total: f64,
}

/// Electricity (kWh × price) plus device-hours × rate (example 27.3: 22,400 + 88,888.89).
pub fn run_cost(
    kwh: f64,
    price_kwh: f64,
    devices: u64,
    hours: f64,
    per_device_hour: f64,
) -> RunCost {
    let electricity = kwh * price_kwh;
    let dev = devices as f64 * hours * per_device_hour;
    RunCost {
        electricity,
        devices: dev,
        total: electricity + dev,
    }
}

/// Iteration-based cost (000 F40): iterations × s/iteration × GPUs / 3600 × $/GPU-h.
pub fn iteration_cost(iterations: f64, s_per_iter: f64, gpus: u64, per_gpu_hour: f64) -> f64 {
    iterations * s_per_iter * gpus as f64 / 3600.0 * per_gpu_hour
}

/// Serving replicas: ⌈target / (per-replica × load cap)⌉ (004 line 393: 12/(2 × 0.75) → 8).
pub fn replicas(target: f64, per_replica: f64, load_cap: f64) -> u64 {
    (target / (per_replica * load_cap) - 1e-9).ceil().max(1.0) as u64
}

/// Energy of moving `bytes` at `pj_per_bit`: bytes × 8 × pJ/bit, in joules (000 F54, L2067).
/// Multiply by 2 for an all-reduce's data movement (000 L2981).
pub fn transfer_energy_joules(bytes: f64, pj_per_bit: f64) -> f64 {
    bytes * 8.0 * pj_per_bit * 1e-12
}
