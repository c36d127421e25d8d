//! Packing of A and B into the micro-kernel's panels (AVX-512; layouts in [`super`]).

use super::avx512::{MR, NR, NV, PACK_STEPS};
use std::arch::x86_64::*;

/// Pack `A(mc x kc)` into `MR`-row panels: panel `r`, step `p` holds
/// `A[r*MR .. r*MR+MR, p]` contiguously; rows past `mc` are zero.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_a(
    mc: usize,
    kc: usize,
    a: *const f32,
    rsa: isize,
    csa: isize,
    pa: *mut f32,
) {
    if rsa == 1 {
        // SAFETY: forwarded contract.
        unsafe { pack_contiguous::<MR>(mc, kc, a, csa, pa) };
        return;
    }
    let mut dst = pa;
    for r0 in (0..mc).step_by(MR) {
        let mr = (mc - r0).min(MR);
        // SAFETY: reads stay in the mc x kc block, writes in MR*kc per panel.
        unsafe {
            let ar = a.offset(r0 as isize * rsa);
            if csa == 1 {
                // Row-major A: 16 steps of the panel at a time,
                // transposed in registers (rows past mr come out zero).
                for p0 in (0..kc).step_by(16) {
                    let steps = (kc - p0).min(16);
                    transpose_block(ar.add(p0), rsa, mr, steps, dst.add(p0 * MR), MR, MR);
                }
            } else {
                // General strides: p outer so the reads are MR
                // sequential streams and the writes contiguous.
                for p in 0..kc {
                    let (src, d) = (ar.offset(p as isize * csa), dst.add(p * MR));
                    for i in 0..MR {
                        *d.add(i) = if i < mr {
                            *src.offset(i as isize * rsa)
                        } else {
                            0.0
                        };
                    }
                }
            }
            dst = dst.add(MR * kc);
        }
    }
}

/// Packs a block whose panel steps are contiguous in the source: panel `q`, step `p` gets
/// the `W` floats at `src + q*W + p*stride` (zeros past `len`), stored at
/// `dst + q*W*kc + p*W`. Serves a column-major A (`W = MR`, the weight gradient's
/// transposed `dout`) and a row-major B (`W = NR`).
///
/// Blocks of [`PACK_STEPS`] steps outer, panels inner: the block's source rows are read
/// front to back side by side, each line serving the neighbouring panels while it is in
/// L1. Panel by panel instead, each step read a piece of a row a whole source row away
/// from the last (often a multiple of 4 KiB, so the rows shared L1 sets and no hardware
/// prefetcher followed), and the next panel read the same lines again.
#[target_feature(enable = "avx512f")]
unsafe fn pack_contiguous<const W: usize>(
    len: usize,
    kc: usize,
    src: *const f32,
    stride: isize,
    dst: *mut f32,
) {
    const { assert!(W <= 32) };
    let lanes = |n: usize| -> __mmask16 { ((1u32 << n.min(16)) - 1) as __mmask16 };
    let vectors = W.div_ceil(16);
    let store: [__mmask16; 2] = std::array::from_fn(|v| lanes(W.saturating_sub(16 * v)));
    for p0 in (0..kc).step_by(PACK_STEPS) {
        let steps = p0..(p0 + PACK_STEPS).min(kc);
        for (panel, j0) in (0..len).step_by(W).enumerate() {
            // Lanes past `len` load as zero and are stored as zero.
            let width = (len - j0).min(W);
            let load: [__mmask16; 2] = std::array::from_fn(|v| lanes(width.saturating_sub(16 * v)));
            // SAFETY: reads are the masked lanes, elements j0.. < len of rows p < kc;
            // writes stay in the panel's W*kc floats.
            unsafe {
                let (s, d) = (src.add(j0), dst.add(panel * W * kc));
                for p in steps.clone() {
                    let row = s.offset(p as isize * stride);
                    for v in 0..vectors {
                        let x = _mm512_maskz_loadu_ps(load[v], row.wrapping_add(16 * v));
                        _mm512_mask_storeu_ps(d.add(p * W + 16 * v), store[v], x);
                    }
                }
            }
        }
    }
}

/// Pack `B(kc x nc)` into `NR`-column panels: panel `s`, step `p` holds
/// `B[p, s*NR .. s*NR+NR]` contiguously; columns past `nc` are zero.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_b(
    kc: usize,
    nc: usize,
    b: *const f32,
    rsb: isize,
    csb: isize,
    pb: *mut f32,
) {
    if csb == 1 {
        // SAFETY: forwarded contract.
        unsafe { pack_contiguous::<NR>(nc, kc, b, rsb, pb) };
        return;
    }
    let mut dst = pb;
    for s0 in (0..nc).step_by(NR) {
        let nr = (nc - s0).min(NR);
        // SAFETY: reads stay in the kc x nc block, writes in NR*kc per panel.
        unsafe {
            let bs = b.offset(s0 as isize * csb);
            if rsb == 1 {
                // Transposed B (column-major): each half-panel of 16
                // columns, 16 steps at a time, transposed in registers
                // (columns past nr come out zero).
                for h in 0..NV {
                    let cols = nr.saturating_sub(16 * h).min(16);
                    let src = bs.wrapping_offset((16 * h) as isize * csb);
                    for p0 in (0..kc).step_by(16) {
                        let steps = (kc - p0).min(16);
                        let d = dst.add(p0 * NR + 16 * h);
                        transpose_block(src.wrapping_add(p0), csb, cols, steps, d, NR, 16);
                    }
                }
            } else {
                // General strides: p outer, NR sequential column streams.
                for p in 0..kc {
                    let (src, d) = (bs.offset(p as isize * rsb), dst.add(p * NR));
                    for j in 0..NR {
                        *d.add(j) = if j < nr {
                            *src.offset(j as isize * csb)
                        } else {
                            0.0
                        };
                    }
                }
            }
            dst = dst.add(NR * kc);
        }
    }
}

/// Transpose `rows` (at most 16) source rows `stride` apart, `steps`
/// (at most 16) contiguous floats each: step `q` of the output, at
/// `dst + q * dst_stride`, gets `src[r * stride + q]` in lane `r`.
/// `lanes` (at least `rows`, at most 16) lanes are written per step,
/// zeros past `rows`; `src` is not read when `rows` is 0.
///
/// Cost: `rows` masked loads, 64 in-register shuffles (the 16x16
/// unpack / shuffle / lane-permute network), `steps` masked stores,
/// against `rows * steps` scalar loads and stores element by element.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_block(
    src: *const f32,
    stride: isize,
    rows: usize,
    steps: usize,
    dst: *mut f32,
    dst_stride: usize,
    lanes: usize,
) {
    let mask = |n: usize| -> __mmask16 { ((1u32 << n) - 1) as __mmask16 };
    let mut r = [_mm512_setzero_ps(); 16];
    for (i, x) in r.iter_mut().enumerate().take(rows) {
        // SAFETY: row i holds `steps` floats from src + i*stride.
        *x = unsafe { _mm512_maskz_loadu_ps(mask(steps), src.offset(i as isize * stride)) };
    }
    let out = crate::kernels::vmath::avx512::transpose16(&r);
    for (q, &x) in out.iter().enumerate().take(steps) {
        // SAFETY: the caller's dst holds `lanes` floats at each step.
        unsafe { _mm512_mask_storeu_ps(dst.add(q * dst_stride), mask(lanes), x) };
    }
}
