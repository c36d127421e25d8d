//! Shape-aware kernel pricing: a GEMM from its M, N, K and dtype against one device's curve
//! (tile and wave quantisation, a K ramp, a memory-bound floor), and memory-bound kernels from
//! the bytes they move.
//!
//! A GEMM C(M×N) = A(M×K)·B(K×N) is cut into ⌈M/t_m⌉·⌈N/t_n⌉ output tiles, one per SM at a
//! time; the last wave runs partly empty (wave quantisation) and edge tiles compute padding
//! (tile quantisation). Its time is the roofline of 004 eq. 28.2 with that efficiency:
//!
//! ```text
//! t = max( 2·M·N·K / (R · e_max · q_tile · q_wave · K/(K + k_ramp) · M/(M + m_ramp)),
//!          (M·K + K·N)·bytes_in + M·N·bytes_out) / (B_mem · e_mem) )
//! q_tile = M·N / (⌈M/t_m⌉·t_m · ⌈N/t_n⌉·t_n)      q_wave = tiles / (⌈tiles/SMs⌉ · SMs)
//! ```
//!
//! The M ramp is the part of a GEMM's time that does not shrink with M: 2·m_ramp·N·K FLOPs'
//! worth per call, a fixed cost per element of the N×K operand (for the forward and input-
//! gradient GEMMs, the weights), which tile and wave quantisation do not give. It is the
//! model's answer to runs that go faster per token at a larger micro-batch (BigScience's
//! tr11-176B README: "MBS=2 performs the fastest in this setup"; NeMo 24.07's GPT-3 175B at
//! micro-batch 2 against 1); its length is fitted (`plan::validate::fit`).
//!
//! The library picks the tile shape that runs fastest, so the cost is the minimum over the
//! device's tile shapes (cuBLAS heuristics do the same; NVIDIA, "Matrix Multiplication
//! Background User's Guide", sections "Tile quantization" and "Wave quantization").

use crate::hardware::{Device, Precision};
use serde::{Deserialize, Serialize};

/// One device's kernel-efficiency data: the numbers [`gemm_time`] and [`memory_time`] use.
/// Origins are given on [`kernel_curve`]; the two GEMM ceilings are the model's fitted
/// parameters (`plan::validate::fit`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KernelCurve {
    /// Streaming multiprocessors (compute units) that tiles are spread over.
    pub sms: u64,
    /// Largest fraction of the BF16/FP16 tensor peak a large GEMM reaches.
    pub gemm_bf16: f64,
    /// Largest fraction of the FP8 tensor peak a large GEMM reaches.
    pub gemm_fp8: f64,
    /// Fraction of the BF16 peak the fused (flash) attention kernel reaches, forward and
    /// backward together.
    pub flash_attention: f64,
    /// Fraction of HBM bandwidth that streaming (element-wise, normalisation) kernels reach.
    pub memory: f64,
    /// K at which a tile's main loop reaches half its speed (pipeline fill and epilogue):
    /// efficiency × K/(K + k_ramp).
    pub k_ramp: f64,
    /// Query/key block length at which a flash-attention call reaches half its efficiency:
    /// efficiency × L/(L + flash_half_len), L the sequence length of one call (s, or s/(2·cp)
    /// under load-balanced context parallelism).
    #[serde(default)]
    pub flash_half_len: f64,
    /// M at which a GEMM reaches half its speed for the part of its time that does not shrink
    /// with M: efficiency × M/(M + m_ramp). Absent in older curves: 0, no ramp.
    #[serde(default)]
    pub m_ramp: f64,
}

/// Output-tile shapes (M × N) the GEMM library chooses from: CUTLASS/cuBLAS's large tensor-core
/// tiles for Ampere and Hopper (128×256, 256×128, 128×128).
pub const TILES: [(f64, f64); 3] = [(128.0, 256.0), (256.0, 128.0), (128.0, 128.0)];

/// The kernel curve of a device preset.
///
/// - SM counts are the vendors' whitepaper figures: A100 108 SMs (NVIDIA A100 Tensor Core GPU
///   Architecture whitepaper), H100 SXM5 and H200 132 SMs (NVIDIA H100 Tensor Core GPU
///   Architecture whitepaper), B200 148, MI300X 304 compute units (AMD CDNA 3 whitepaper).
/// - `gemm_bf16` (A100) and `gemm_fp8` (H100) are fitted on the fitting half of the published
///   suite (`crates/plan/tests/published/`, see docs/PLAN.md "Validation"); the H100 BF16
///   ceiling is the same fraction of its peak as the A100 BF16 one. Devices without suite cases take the H100
///   values (an assumption).
/// - `flash_attention`: FlashAttention-2 (Dao 2023, §4) reports 50–73% of the A100's peak
///   forward and lower backward; we take 0.55 of the BF16 peak for forward + backward on every
///   device (an assumption; no suite case isolates it).
/// - `memory`: 0.8 of the HBM bandwidth for streaming kernels (an assumption: STREAM-style copies
///   reach 80–90% of the datasheet figure on A100/H100).
/// - `flash_half_len`: fitted with the ceilings (one value for every device).
/// - `m_ramp`: fitted with the ceilings (one value for every device; module doc).
/// - `k_ramp`: 64 (one 64-deep K-slice of the main loop lost to pipeline fill and the epilogue;
///   an assumption from the CUTLASS tile structure).
pub fn kernel_curve(device: &Device) -> KernelCurve {
    if let Some(k) = device.kernel {
        return k;
    }
    let name = device.name.as_str();
    let (sms, bf16, fp8) = if name.starts_with("a100") {
        (108, FIT_A100_BF16, FIT_H100_FP8)
    } else if name == "b200" {
        (148, FIT_H100_BF16, FIT_H100_FP8)
    } else if name == "mi300x" {
        (304, FIT_H100_BF16, FIT_H100_FP8)
    } else {
        (132, FIT_H100_BF16, FIT_H100_FP8)
    };
    KernelCurve {
        sms,
        gemm_bf16: bf16,
        gemm_fp8: fp8,
        flash_attention: FLASH_ATTENTION_EFF,
        memory: MEMORY_EFF,
        k_ramp: K_RAMP,
        flash_half_len: FIT_FLASH_HALF_LEN,
        m_ramp: FIT_M_RAMP,
    }
}

/// Fitted: A100 BF16 GEMM ceiling (fraction of 312 TFLOP/s), `plan::validate::fit` on the
/// fitting half of the suite (3 A100 cases). See [`kernel_curve`].
pub const FIT_A100_BF16: f64 = 0.68;
/// H100 BF16 GEMM ceiling (fraction of 989.4 TFLOP/s): the same fraction of the BF16 peak as
/// the fitted A100 one (`plan::validate::fit` ties them). In the suite's FP8 runs only the LM
/// head runs BF16 GEMMs, too little to pin a ceiling of its own. See [`kernel_curve`].
pub const FIT_H100_BF16: f64 = FIT_A100_BF16;
/// Fitted: H100 FP8 GEMM ceiling (fraction of 1,978.9 TFLOP/s), `plan::validate::fit` on the
/// fitting half of the suite (8 H100 cases). See [`kernel_curve`].
pub const FIT_H100_FP8: f64 = 0.545;
/// Flash-attention efficiency (assumption, FlashAttention-2 §4; see [`kernel_curve`]).
pub const FLASH_ATTENTION_EFF: f64 = 0.55;
/// Streaming-kernel fraction of HBM bandwidth (assumption; see [`kernel_curve`]).
pub const MEMORY_EFF: f64 = 0.8;
/// Fitted: flash-attention half-efficiency length (tokens), every device. See [`kernel_curve`].
pub const FIT_FLASH_HALF_LEN: f64 = 1216.0;
/// Fitted: the GEMM M ramp (rows), every device. See [`kernel_curve`] and the module doc.
pub const FIT_M_RAMP: f64 = 576.0;
/// K ramp of a GEMM tile (assumption; see [`kernel_curve`]).
pub const K_RAMP: f64 = 64.0;

/// A (batched) GEMM: `batch` independent products of (M×K)·(K×N).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    /// Rows of the output.
    pub m: f64,
    /// Columns of the output.
    pub n: f64,
    /// Reduction depth.
    pub k: f64,
    /// Independent products (attention heads × sequences for the unfused attention scores).
    pub batch: f64,
}

impl Gemm {
    /// One GEMM of M×N×K.
    pub fn new(m: f64, n: f64, k: f64) -> Gemm {
        Gemm {
            m,
            n,
            k,
            batch: 1.0,
        }
    }
    /// FLOPs: 2·M·N·K per product.
    pub fn flops(&self) -> f64 {
        2.0 * self.m * self.n * self.k * self.batch
    }
    /// The two backward GEMMs of this forward GEMM: the input gradient (M×N)·(N×K) and the
    /// weight gradient (K×M)·(M×N).
    pub fn backward(&self) -> [Gemm; 2] {
        [
            Gemm {
                m: self.m,
                n: self.k,
                k: self.n,
                batch: self.batch,
            },
            Gemm {
                m: self.k,
                n: self.n,
                k: self.m,
                batch: self.batch,
            },
        ]
    }
}

/// The GEMM ceiling and peak for `p` on `device` (FP32/TF32 use the BF16 ceiling of their own
/// peak).
pub fn gemm_peak(device: &Device, curve: &KernelCurve, p: Precision) -> (f64, f64) {
    match p {
        Precision::Fp8 if device.fp8 > 0.0 => (device.fp8, curve.gemm_fp8),
        Precision::Fp32 => (device.fp32, curve.gemm_bf16),
        Precision::Tf32 => (device.tf32, curve.gemm_bf16),
        _ => (device.bf16, curve.gemm_bf16),
    }
}

/// Seconds for `g` at `peak` FLOP/s with ceiling `ceiling`, reading inputs of `bytes_in` and
/// writing outputs of `bytes_out` bytes per element (see the module formula).
pub fn gemm_time(
    curve: &KernelCurve,
    peak: f64,
    ceiling: f64,
    hbm_bw: f64,
    g: Gemm,
    bytes_in: f64,
    bytes_out: f64,
) -> f64 {
    if g.m <= 0.0 || g.n <= 0.0 || g.k <= 0.0 || g.batch <= 0.0 {
        return 0.0;
    }
    let sms = curve.sms.max(1) as f64;
    let k_eff = g.k / (g.k + curve.k_ramp);
    let m_eff = g.m / (g.m + curve.m_ramp.max(0.0));
    let quant = TILES
        .iter()
        .map(|&(tm, tn)| {
            let (gm, gn) = ((g.m / tm).ceil(), (g.n / tn).ceil());
            let tiles = gm * gn * g.batch;
            let q_tile = g.m * g.n / (gm * tm * gn * tn);
            let q_wave = tiles / ((tiles / sms).ceil() * sms);
            q_tile * q_wave
        })
        .fold(0.0, f64::max);
    let t_flop = g.flops() / (peak * ceiling * quant * k_eff * m_eff);
    let bytes = g.batch * ((g.m * g.k + g.k * g.n) * bytes_in + g.m * g.n * bytes_out);
    t_flop.max(memory_time(curve, hbm_bw, bytes))
}

/// Seconds for a streaming kernel that moves `bytes` through HBM: bytes / (B_mem · e_mem)
/// (004 eq. 28.2, the bandwidth side of the roofline).
pub fn memory_time(curve: &KernelCurve, hbm_bw: f64, bytes: f64) -> f64 {
    bytes / (hbm_bw * curve.memory)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hardware::device_preset;

    fn h100() -> (Device, KernelCurve) {
        let d = device_preset("h100").expect("preset");
        let c = kernel_curve(&d);
        (d, c)
    }

    #[test]
    fn large_square_gemm_runs_near_the_ceiling() {
        let (d, c) = h100();
        let g = Gemm::new(16384.0, 16384.0, 16384.0);
        let t = gemm_time(&c, d.bf16, c.gemm_bf16, d.hbm_bw, g, 2.0, 2.0);
        let eff = g.flops() / (t * d.bf16);
        assert!(eff > 0.95 * c.gemm_bf16 && eff <= c.gemm_bf16, "{eff}");
    }

    #[test]
    fn one_tile_too_many_costs_a_wave() {
        // 132 SMs: 132 tiles of 128×128 make one wave; 133 need two.
        let (d, c) = h100();
        let full = gemm_time(
            &c,
            d.bf16,
            0.7,
            d.hbm_bw,
            Gemm::new(128.0 * 12.0, 128.0 * 11.0, 8192.0),
            2.0,
            2.0,
        );
        let over = gemm_time(
            &c,
            d.bf16,
            0.7,
            d.hbm_bw,
            Gemm::new(128.0 * 12.0 + 1.0, 128.0 * 11.0, 8192.0),
            2.0,
            2.0,
        );
        assert!(over > 1.5 * full, "{full} {over}");
    }

    #[test]
    fn skinny_gemm_is_memory_bound() {
        let (d, c) = h100();
        let g = Gemm::new(8.0, 8192.0, 8192.0);
        let t = gemm_time(&c, d.bf16, c.gemm_bf16, d.hbm_bw, g, 2.0, 2.0);
        let weights = 8192.0 * 8192.0 * 2.0;
        assert!(t >= weights / d.hbm_bw, "{t}");
    }

    #[test]
    fn backward_has_the_forward_flops_twice() {
        let g = Gemm::new(4096.0, 12288.0, 1536.0);
        let [a, b] = g.backward();
        assert_eq!(a.flops() + b.flops(), 2.0 * g.flops());
        assert_eq!((b.m, b.n, b.k), (1536.0, 12288.0, 4096.0));
    }
}
