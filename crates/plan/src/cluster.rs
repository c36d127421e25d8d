//! The cluster input: nodes × devices, a device preset, intra/inter-node links, reliability,
//! power and price. [`ClusterFile`] is the TOML form; [`Cluster`] the validated one.

use crate::error::{PlanError, Result, at_least_one, non_negative, positive};
use crate::hardware::{
    Device, Link, THIS_MACHINE, default_intra, device_preset, link_preset, unmeasured_device,
};
use crate::nccl::{HostCpu, NcclTopo};
use crate::units::{GB, RingFactor, US};
use serde::{Deserialize, Serialize};

/// The largest cluster the planner accepts (2^24 devices), so a search always finishes.
pub const MAX_DEVICES: u64 = 1 << 24;

/// Optional per-field overrides of a device preset (TFLOP/s, GB, TB/s, W).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceOverride {
    /// BF16/FP16 dense peak, TFLOP/s.
    pub bf16_tflops: Option<f64>,
    /// FP8 dense peak, TFLOP/s.
    pub fp8_tflops: Option<f64>,
    /// FP32 peak, TFLOP/s.
    pub fp32_tflops: Option<f64>,
    /// TF32 dense peak, TFLOP/s.
    pub tf32_tflops: Option<f64>,
    /// HBM capacity, GB (decimal).
    pub hbm_gb: Option<f64>,
    /// HBM bandwidth, TB/s.
    pub hbm_tbs: Option<f64>,
    /// Board power, W.
    pub power_w: Option<f64>,
}

/// The cluster as written in TOML. Every field has a default except `nodes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    /// Nodes.
    pub nodes: u64,
    /// Devices per node (the fast NVLink domain).
    #[serde(default = "d_dpn")]
    pub devices_per_node: u64,
    /// Device preset: a100-40, a100-80, h100, h200, b200, mi300x, or "this-machine" (every
    /// number measured, from `flotilla plan --calibrate`).
    #[serde(default = "d_device")]
    pub device: String,
    /// Overrides of the preset's numbers.
    #[serde(default)]
    pub device_override: Option<DeviceOverride>,
    /// Intra-node link preset (default: the device's natural fabric).
    #[serde(default)]
    pub intra: Option<String>,
    /// Inter-node link preset, one port per device (default ib-ndr).
    #[serde(default = "d_inter")]
    pub inter: String,
    /// Override of the intra-node α, µs.
    pub intra_alpha_us: Option<f64>,
    /// Override of the intra-node unidirectional β, GB/s.
    pub intra_bw_gbs: Option<f64>,
    /// Override of the inter-node α, µs.
    pub inter_alpha_us: Option<f64>,
    /// Override of the inter-node unidirectional β per device, GB/s.
    pub inter_bw_gbs: Option<f64>,
    /// Ring factor convention: "exact" (p-1)/p or "approx" 1.
    #[serde(default)]
    pub ring_factor: RingFactor,
    /// Mean time between failures of one device, hours (000 L2863: 50,000 h).
    #[serde(default = "d_mtbf")]
    pub device_mtbf_hours: f64,
    /// Price per device-hour (000 E56 implies $2).
    #[serde(default = "d_price")]
    pub price_per_device_hour: f64,
    /// Node power in kW; default devices × TDP + 2 kW for CPUs, NICs and fans (an assumption).
    pub node_power_kw: Option<f64>,
    /// Network and storage power, kW (004 example 27.3: 20 kW).
    #[serde(default)]
    pub network_storage_kw: f64,
    /// Power usage effectiveness (004 example 27.3: 1.2).
    #[serde(default = "d_pue")]
    pub pue: f64,
    /// Electricity price per kWh.
    #[serde(default = "d_kwh")]
    pub price_per_kwh: f64,
    /// HBM kept back for communication buffers and the allocator, GB (000 Table 4.3: NCCL 2–4 GB).
    #[serde(default = "d_reserve")]
    pub memory_reserve_gb: f64,
    /// Storage write bandwidth free for checkpoints, GB/s (decimal).
    pub storage_write_gbs: Option<f64>,
    /// Storage read bandwidth for restore, GB/s.
    pub storage_read_gbs: Option<f64>,
    /// How all-reduce, reduce-scatter and all-gather are priced: "alpha_beta" (default, one α
    /// per step) or "nccl" (NCCL's own model: LL, LL128 and Simple protocols, ring and tree;
    /// [`crate::nccl`]).
    #[serde(default)]
    pub collectives: CollectiveModel,
    /// The hosts' CPU vendor for `collectives = "nccl"` ("intel" or "amd"; default the
    /// vendor's reference node for the device).
    #[serde(default)]
    pub host_cpu: Option<HostCpu>,
}

/// How the planner prices collectives ([`ClusterFile::collectives`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveModel {
    /// α + n/β per step (000 Chapter 6).
    #[default]
    AlphaBeta,
    /// NCCL's tuning model ([`crate::nccl`]).
    Nccl,
}

fn d_dpn() -> u64 {
    8
}
fn d_device() -> String {
    "h100".into()
}
fn d_inter() -> String {
    "ib-ndr".into()
}
fn d_mtbf() -> f64 {
    50_000.0
}
fn d_price() -> f64 {
    2.0
}
fn d_pue() -> f64 {
    1.2
}
fn d_kwh() -> f64 {
    0.10
}
fn d_reserve() -> f64 {
    3.0
}

impl ClusterFile {
    /// A cluster of `nodes` nodes of a device preset, every other field at its default.
    pub fn preset(device: &str, nodes: u64) -> ClusterFile {
        ClusterFile {
            nodes,
            devices_per_node: d_dpn(),
            device: device.into(),
            device_override: None,
            intra: None,
            inter: d_inter(),
            intra_alpha_us: None,
            intra_bw_gbs: None,
            inter_alpha_us: None,
            inter_bw_gbs: None,
            ring_factor: RingFactor::Exact,
            device_mtbf_hours: d_mtbf(),
            price_per_device_hour: d_price(),
            node_power_kw: None,
            network_storage_kw: 0.0,
            pue: d_pue(),
            price_per_kwh: d_kwh(),
            memory_reserve_gb: d_reserve(),
            storage_write_gbs: None,
            storage_read_gbs: None,
            collectives: CollectiveModel::AlphaBeta,
            host_cpu: None,
        }
    }

    /// Parses TOML text.
    pub fn from_toml(text: &str) -> Result<ClusterFile> {
        toml::from_str(text).map_err(|e| PlanError::Parse {
            what: "cluster TOML".into(),
            message: e.to_string(),
        })
    }
}

/// A validated cluster (SI units).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// Nodes.
    pub nodes: u64,
    /// Devices per node.
    pub devices_per_node: u64,
    /// The device.
    pub device: Device,
    /// Intra-node link.
    pub intra: Link,
    /// Inter-node link (per device).
    pub inter: Link,
    /// Ring factor convention.
    pub ring: RingFactor,
    /// Device MTBF, seconds.
    pub device_mtbf_s: f64,
    /// Price per device-hour.
    pub price_per_device_hour: f64,
    /// Node power, W.
    pub node_power_w: f64,
    /// Network and storage power, W.
    pub network_storage_w: f64,
    /// PUE.
    pub pue: f64,
    /// Price per kWh.
    pub price_per_kwh: f64,
    /// Reserved HBM per device, bytes.
    pub memory_reserve: f64,
    /// Free storage write bandwidth, bytes/s.
    pub storage_write: Option<f64>,
    /// Storage read bandwidth, bytes/s.
    pub storage_read: Option<f64>,
    /// NCCL's model of the collectives, with `collectives = "nccl"`; else alpha-beta.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nccl: Option<NcclTopo>,
}

impl Cluster {
    /// Resolves presets and overrides and validates every number.
    pub fn from_file(f: &ClusterFile) -> Result<Cluster> {
        at_least_one("cluster.nodes", f.nodes)?;
        at_least_one("cluster.devices_per_node", f.devices_per_node)?;
        if f.nodes.saturating_mul(f.devices_per_node) > MAX_DEVICES {
            return Err(PlanError::Invalid {
                field: "cluster.nodes",
                value: f.nodes.to_string(),
                reason: format!(
                    "nodes x devices_per_node = {} x {} exceeds {MAX_DEVICES} devices",
                    f.nodes, f.devices_per_node
                ),
            });
        }
        let measured = f.device == THIS_MACHINE;
        let mut device = if measured {
            unmeasured_device()
        } else {
            device_preset(&f.device)?
        };
        if let Some(o) = &f.device_override {
            let set = |dst: &mut f64, v: Option<f64>, k: f64| {
                if let Some(v) = v {
                    *dst = v * k;
                }
            };
            set(&mut device.bf16, o.bf16_tflops, 1e12);
            set(&mut device.fp8, o.fp8_tflops, 1e12);
            set(&mut device.fp32, o.fp32_tflops, 1e12);
            set(&mut device.tf32, o.tf32_tflops, 1e12);
            set(&mut device.hbm_bytes, o.hbm_gb, GB);
            set(&mut device.hbm_bw, o.hbm_tbs, 1e12);
            set(&mut device.power_w, o.power_w, 1.0);
            if !measured {
                device.name = format!("{} (overridden)", device.name);
            }
        }
        device.validate().map_err(|e| match (measured, e) {
            (true, PlanError::Invalid { field, .. }) => PlanError::Invalid {
                field,
                value: "missing".into(),
                reason: "device \"this-machine\" takes every number from [device_override]: \
                         write the file with `flotilla plan --calibrate`"
                    .into(),
            },
            (_, e) => e,
        })?;
        let intra_name = match (&f.intra, measured) {
            (Some(i), _) => i.clone(),
            (None, true) => "pcie4".into(),
            (None, false) => default_intra(&f.device).into(),
        };
        let mut intra = link_preset("cluster.intra", &intra_name)?;
        let mut inter = link_preset("cluster.inter", &f.inter)?;
        if let Some(a) = f.intra_alpha_us {
            intra.alpha = non_negative("cluster.intra_alpha_us", a)? * US;
        }
        if let Some(b) = f.intra_bw_gbs {
            intra.beta = positive("cluster.intra_bw_gbs", b)? * GB;
        }
        if let Some(a) = f.inter_alpha_us {
            inter.alpha = non_negative("cluster.inter_alpha_us", a)? * US;
        }
        if let Some(b) = f.inter_bw_gbs {
            inter.beta = positive("cluster.inter_bw_gbs", b)? * GB;
        }
        let node_power_w = match f.node_power_kw {
            Some(kw) => positive("cluster.node_power_kw", kw)? * 1e3,
            None => f.devices_per_node as f64 * device.power_w + 2_000.0,
        };
        if f.pue < 1.0 || !f.pue.is_finite() {
            return Err(PlanError::Invalid {
                field: "cluster.pue",
                value: f.pue.to_string(),
                reason: "PUE = facility / IT energy is >= 1".into(),
            });
        }
        let reserve = non_negative("cluster.memory_reserve_gb", f.memory_reserve_gb)? * GB;
        if reserve >= device.hbm_bytes {
            return Err(PlanError::Inconsistent {
                field: "cluster.memory_reserve_gb",
                equation: format!(
                    "reserve {} GB >= HBM {} GB",
                    f.memory_reserve_gb,
                    device.hbm_bytes / GB
                ),
            });
        }
        let nccl = match (f.collectives, f.host_cpu) {
            (CollectiveModel::Nccl, cpu) => {
                Some(NcclTopo::for_presets(&f.device, &intra_name, cpu)?)
            }
            (CollectiveModel::AlphaBeta, Some(cpu)) => {
                return Err(PlanError::Invalid {
                    field: "cluster.host_cpu",
                    value: format!("{cpu:?}").to_lowercase(),
                    reason: "host_cpu is used only by collectives = \"nccl\"".into(),
                });
            }
            (CollectiveModel::AlphaBeta, None) => None,
        };
        let opt = |field, v: Option<f64>| -> Result<Option<f64>> {
            v.map(|x| positive(field, x).map(|x| x * GB)).transpose()
        };
        Ok(Cluster {
            nodes: f.nodes,
            devices_per_node: f.devices_per_node,
            device,
            intra,
            inter,
            ring: f.ring_factor,
            device_mtbf_s: positive("cluster.device_mtbf_hours", f.device_mtbf_hours)? * 3600.0,
            price_per_device_hour: non_negative(
                "cluster.price_per_device_hour",
                f.price_per_device_hour,
            )?,
            node_power_w,
            network_storage_w: non_negative("cluster.network_storage_kw", f.network_storage_kw)?
                * 1e3,
            pue: f.pue,
            price_per_kwh: non_negative("cluster.price_per_kwh", f.price_per_kwh)?,
            memory_reserve: reserve,
            storage_write: opt("cluster.storage_write_gbs", f.storage_write_gbs)?,
            storage_read: opt("cluster.storage_read_gbs", f.storage_read_gbs)?,
            nccl,
        })
    }

    /// All devices: nodes × devices per node.
    pub fn devices(&self) -> u64 {
        self.nodes.saturating_mul(self.devices_per_node)
    }
}
