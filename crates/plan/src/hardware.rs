//! Device and interconnect presets. Numbers are vendor datasheet figures, dense (no structured
//! sparsity), per device; capacities are the vendor's nominal decimal gigabytes. Bandwidths are
//! unidirectional per device (see [`crate::units`]).

use crate::error::{PlanError, Result, non_negative, positive};
use crate::units::{GB, TB, TFLOPS, US};
use serde::{Deserialize, Serialize};

/// Numeric precision of the matmuls (and, through [`Precision::bytes`], of weights/gradients).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// FP32 everywhere.
    Fp32,
    /// TF32 tensor cores, FP32 storage.
    Tf32,
    /// FP16 mixed precision.
    Fp16,
    /// BF16 mixed precision (the default).
    #[default]
    Bf16,
    /// FP8 matmuls (000 Table 5.6), BF16 weights and gradients.
    Fp8,
}

impl Precision {
    /// Bytes of one stored weight or gradient element: 4 for FP32/TF32, 2 otherwise.
    pub fn bytes(self) -> f64 {
        match self {
            Precision::Fp32 | Precision::Tf32 => 4.0,
            _ => 2.0,
        }
    }
    /// True when an FP32 master copy is kept (mixed precision, 000 F17).
    pub fn mixed(self) -> bool {
        !matches!(self, Precision::Fp32 | Precision::Tf32)
    }
}

/// One accelerator: peak dense FLOP/s per precision, HBM capacity and bandwidth, board power.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Device {
    /// Preset name or "custom".
    pub name: String,
    /// FP32 (non-tensor) peak, FLOP/s.
    pub fp32: f64,
    /// TF32 dense tensor peak, FLOP/s.
    pub tf32: f64,
    /// FP16/BF16 dense tensor peak, FLOP/s.
    pub bf16: f64,
    /// FP8 dense tensor peak, FLOP/s; 0 when unsupported.
    pub fp8: f64,
    /// HBM capacity, bytes (vendor nominal, decimal).
    pub hbm_bytes: f64,
    /// HBM bandwidth, bytes/s.
    pub hbm_bw: f64,
    /// Board power (TDP), watts.
    pub power_w: f64,
    /// Kernel-efficiency curve replacing the preset's ([`crate::gemm::kernel_curve`]); set by
    /// the fit (`plan::validate::fit`), absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<crate::gemm::KernelCurve>,
}

impl Device {
    /// The peak FLOP/s for `p`, refused (with the precision named) where the device has none.
    pub fn peak(&self, p: Precision) -> Result<f64> {
        let v = match p {
            Precision::Fp32 => self.fp32,
            Precision::Tf32 => self.tf32,
            Precision::Fp16 | Precision::Bf16 => self.bf16,
            Precision::Fp8 => self.fp8,
        };
        if v > 0.0 {
            Ok(v)
        } else {
            Err(PlanError::Inconsistent {
                field: "precision",
                equation: format!("device {} has no {p:?} tensor peak", self.name),
            })
        }
    }

    /// Checks every field is a positive finite number (FP8 may be 0 = unsupported).
    pub fn validate(&self) -> Result<()> {
        positive("device.fp32", self.fp32)?;
        positive("device.tf32", self.tf32)?;
        positive("device.bf16", self.bf16)?;
        non_negative("device.fp8", self.fp8)?;
        positive("device.hbm_bytes", self.hbm_bytes)?;
        positive("device.hbm_bw", self.hbm_bw)?;
        non_negative("device.power_w", self.power_w)?;
        Ok(())
    }
}

/// Device preset names accepted by [`device_preset`].
pub const DEVICE_PRESETS: &[&str] = &["a100-40", "a100-80", "h100", "h200", "b200", "mi300x"];

/// The device whose numbers are all measured: `flotilla plan --calibrate` writes them into the
/// cluster file's `device_override`; until then every field is 0 and validation names the
/// first one missing.
pub const THIS_MACHINE: &str = "this-machine";

/// [`THIS_MACHINE`] before its numbers are filled in.
pub fn unmeasured_device() -> Device {
    Device {
        name: THIS_MACHINE.into(),
        fp32: 0.0,
        tf32: 0.0,
        bf16: 0.0,
        fp8: 0.0,
        hbm_bytes: 0.0,
        hbm_bw: 0.0,
        power_w: 0.0,
        kernel: None,
    }
}

/// A device preset by name. Sources (dense figures, i.e. half the "with sparsity" numbers):
/// - A100 SXM: NVIDIA A100 datasheet (2021): FP32 19.5, TF32 156, BF16 312 TFLOP/s; 40 GB at
///   1,555 GB/s, 80 GB at 2,039 GB/s; 400 W.
/// - H100 SXM5: NVIDIA H100 datasheet: FP32 67, TF32 494.7, BF16 989.4, FP8 1,978.9 TFLOP/s;
///   80 GB HBM3 at 3.35 TB/s (also 000 S02); 700 W. 000 E18 uses FP8 1,979 TFLOP/s.
/// - H200 SXM: NVIDIA H200 datasheet: H100 compute, 141 GB HBM3e at 4.8 TB/s; 700 W.
/// - B200: NVIDIA HGX B200 datasheet (8-GPU totals ÷ 8): FP32 75, TF32 1,100, BF16 2,250, FP8
///   4,500 TFLOP/s; 180 GB HBM3e at 8 TB/s; 1,000 W.
/// - MI300X: AMD Instinct MI300X datasheet: FP32 163.4, TF32 653.7, BF16 1,307.4, FP8 2,614.9
///   TFLOP/s; 192 GB HBM3 at 5.3 TB/s; 750 W.
pub fn device_preset(name: &str) -> Result<Device> {
    let d = |fp32: f64, tf32: f64, bf16: f64, fp8: f64, hbm: f64, bw: f64, w: f64| Device {
        name: name.to_ascii_lowercase(),
        fp32: fp32 * TFLOPS,
        tf32: tf32 * TFLOPS,
        bf16: bf16 * TFLOPS,
        fp8: fp8 * TFLOPS,
        hbm_bytes: hbm * GB,
        hbm_bw: bw * TB,
        power_w: w,
        kernel: None,
    };
    Ok(match name.to_ascii_lowercase().as_str() {
        "a100-40" | "a100-40gb" => d(19.5, 156.0, 312.0, 0.0, 40.0, 1.555, 400.0),
        "a100-80" | "a100" | "a100-80gb" => d(19.5, 156.0, 312.0, 0.0, 80.0, 2.039, 400.0),
        "h100" | "h100-sxm" => d(67.0, 494.7, 989.4, 1978.9, 80.0, 3.35, 700.0),
        "h200" => d(67.0, 494.7, 989.4, 1978.9, 141.0, 4.8, 700.0),
        "b200" => d(75.0, 1100.0, 2250.0, 4500.0, 180.0, 8.0, 1000.0),
        "mi300x" => d(163.4, 653.7, 1307.4, 2614.9, 192.0, 5.3, 750.0),
        _ => {
            return Err(PlanError::UnknownPreset {
                field: "cluster.device",
                name: name.into(),
                known: DEVICE_PRESETS.join(", "),
            });
        }
    })
}

/// A link in the alpha-beta model (000 F3, 004 eq. 28.10): t(n) = α + n/β.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Start-up latency α, seconds.
    pub alpha: f64,
    /// Unidirectional bandwidth β per device, bytes/s.
    pub beta: f64,
}

impl Link {
    /// A link from α in seconds and β in bytes/s, both validated (`field` names the input).
    pub fn new(field: &'static str, alpha: f64, beta: f64) -> Result<Link> {
        non_negative(field, alpha)?;
        positive(field, beta)?;
        Ok(Link { alpha, beta })
    }
    /// One message: α + n/β (004 eq. 28.10).
    pub fn msg_time(&self, bytes: f64) -> f64 {
        ::cost::message(self.alpha, self.beta, bytes)
    }
    /// Critical message size n* = α·β below which latency dominates (000 F55, 004 line 178).
    pub fn critical_size(&self) -> f64 {
        self.alpha * self.beta
    }
}

/// Link preset names accepted by [`link_preset`].
pub const LINK_PRESETS: &[&str] = &[
    "nvlink3", "nvlink4", "nvlink5", "xgmi", "pcie4", "pcie5", "ib-hdr", "ib-ndr", "ib-xdr",
    "roce-100", "roce-400",
];

/// A link preset: unidirectional per-device β and the median effective α.
/// - NVLink 3/4/5: 600/900/1,800 GB/s bidirectional per GPU (NVIDIA A100/H100/B200 datasheets;
///   000 E40 for NVLink 5) → 300/450/900 GB/s; α = 1.5 µs (000 Table 6.2, NVLink 4 row median).
/// - xGMI (MI300X Infinity Fabric): 896 GB/s bidirectional peer aggregate (AMD datasheet) → 448.
/// - PCIe Gen4/Gen5 x16: 32/64 GB/s per direction (000 S26); α = 3.5 µs (000 Table 6.2).
/// - InfiniBand HDR/NDR/XDR: 200/400/800 Gb/s = 25/50/100 GB/s per port, one port per device;
///   α = 3.5/2/2 µs (000 Table 6.2 medians; XDR assumed equal to NDR).
/// - RoCE 100/400 GbE: 12.5/50 GB/s; α = 7.5 µs (000 Table 6.2, 100 GbE row median).
pub fn link_preset(field: &'static str, name: &str) -> Result<Link> {
    let l = |alpha_us: f64, beta_gbs: f64| Link {
        alpha: alpha_us * US,
        beta: beta_gbs * GB,
    };
    Ok(match name.to_ascii_lowercase().as_str() {
        "nvlink3" => l(1.5, 300.0),
        "nvlink4" | "nvlink" => l(1.5, 450.0),
        "nvlink5" => l(1.5, 900.0),
        "xgmi" | "infinity-fabric" => l(1.5, 448.0),
        "pcie4" => l(3.5, 32.0),
        "pcie5" | "pcie" => l(3.5, 64.0),
        "ib-hdr" | "hdr" => l(3.5, 25.0),
        "ib-ndr" | "ndr" => l(2.0, 50.0),
        "ib-xdr" | "xdr" => l(2.0, 100.0),
        "roce-100" => l(7.5, 12.5),
        "roce-400" | "roce" => l(7.5, 50.0),
        _ => {
            return Err(PlanError::UnknownPreset {
                field,
                name: name.into(),
                known: LINK_PRESETS.join(", "),
            });
        }
    })
}

/// The natural intra-node fabric for a device preset (used when the cluster does not say).
pub fn default_intra(device: &str) -> &'static str {
    match device.to_ascii_lowercase().as_str() {
        "a100-40" | "a100-80" | "a100" | "a100-40gb" | "a100-80gb" => "nvlink3",
        "b200" => "nvlink5",
        "mi300x" => "xgmi",
        _ => "nvlink4",
    }
}
