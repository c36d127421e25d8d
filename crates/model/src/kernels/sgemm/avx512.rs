//! The AVX-512 GEMM: cache blocking, the macro block and the `MR x NR` micro-kernel
//! (design in [`super`]); the packing lives in [`super::pack`].

use super::pack::{pack_a, pack_b};
use crate::real::GemmInit;
use std::arch::x86_64::*;
use std::cell::RefCell;

/// Rows of a micro-tile (broadcast operand).
pub(super) const MR: usize = 14;
/// zmm vectors across a micro-tile's columns.
pub(super) const NV: usize = 2;
/// Columns of a micro-tile.
pub(super) const NR: usize = 16 * NV;
/// k-slice: one A micro-panel (`MR*KC` floats) fits L1 with room for B.
const KC: usize = 512;
/// Columns of C per packed B block: `KC*NC` floats (1 MB) in L2.
const NC: usize = 512;
/// Rows of C per packed A block (`MC*KC` floats, 8.4 MB, from L3). B is
/// packed once per A block, so the cap sits above 2048 rows: a 2048^3
/// product packs B once (with 2016 it packed B twice, 1-2 % of its time).
const MC: usize = 4200;
/// Steps per pass of [`super::pack`]'s blocked packing (panels inner).
pub(super) const PACK_STEPS: usize = 16;
/// How far ahead (floats) the k loop prefetches the B panel.
const PF_B: usize = 8 * NR;

/// A 64-byte aligned chunk so packed panels start on cache lines.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

thread_local! {
    /// Packed A block and packed B block, reused across calls.
    static BUFS: RefCell<(Vec<Line>, Vec<Line>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Grow `v` to at least `floats` floats and return it as a pointer.
fn buf(v: &mut Vec<Line>, floats: usize) -> *mut f32 {
    let lines = floats.div_ceil(16);
    if v.len() < lines {
        v.resize(lines, Line([0.0; 16]));
    }
    v.as_mut_ptr().cast()
}

/// See [`super::sgemm`].
///
/// # Safety
/// As [`super::sgemm`], and the CPU must support AVX-512F.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: *const f32,
    rsa: isize,
    csa: isize,
    b: *const f32,
    rsb: isize,
    csb: isize,
    init: GemmInit<f32>,
    c: *mut f32,
    rsc: isize,
    csc: isize,
) {
    if m == 0 || n == 0 {
        return;
    }
    let (beta, bias) = match init {
        GemmInit::Beta(beta) => (beta, None),
        GemmInit::Bias(bias) => (0.0, Some(bias)),
    };
    if k == 0 || alpha == 0.0 {
        // SAFETY: C is m x n with the given strides (a bias holds n floats).
        unsafe { scale_c(m, n, init.into_beta(m, n, c, rsc, csc), c, rsc, csc) };
        return;
    }
    // Equal blocks no larger than the caps (2048 rows in 2 blocks of
    // 1024, not 2016 + 32), A's rounded to whole micro-panels.
    let mcb = m.div_ceil(m.div_ceil(MC)).next_multiple_of(MR);
    let ncb = n.div_ceil(n.div_ceil(NC)).next_multiple_of(NR);
    let kcb = k.div_ceil(k.div_ceil(KC));
    BUFS.with_borrow_mut(|(abuf, bbuf)| {
        let pa = buf(abuf, m.min(mcb).next_multiple_of(MR) * kcb);
        let pb = buf(bbuf, n.min(ncb).next_multiple_of(NR) * kcb);
        for i0 in (0..m).step_by(mcb) {
            let mc = (m - i0).min(mcb);
            for p0 in (0..k).step_by(kcb) {
                let kc = (k - p0).min(kcb);
                let beta_p = if p0 == 0 { beta } else { 1.0 };
                // The bias enters once, with the first k-slice.
                let bias_p = bias.filter(|_| p0 == 0);
                // SAFETY: the block (i0.., p0..) of A is in bounds; pa
                // holds mc_max * kc_max floats.
                unsafe {
                    pack_a(
                        mc,
                        kc,
                        a.offset(i0 as isize * rsa + p0 as isize * csa),
                        rsa,
                        csa,
                        pa,
                    )
                };
                for j0 in (0..n).step_by(ncb) {
                    let nc = (n - j0).min(ncb);
                    // SAFETY: as above for B and pb.
                    unsafe {
                        pack_b(
                            kc,
                            nc,
                            b.offset(p0 as isize * rsb + j0 as isize * csb),
                            rsb,
                            csb,
                            pb,
                        );
                        let cb = c.offset(i0 as isize * rsc + j0 as isize * csc);
                        let ep = Epilogue {
                            alpha,
                            beta: beta_p,
                            bias: bias_p.map(|b| b.wrapping_add(j0)),
                        };
                        macro_block(mc, nc, kc, ep, pa, pb, cb, rsc, csc);
                    }
                }
            }
        }
    });
}

/// How a tile's sums are stored: `C = alpha * sums + beta * C`, or, with a `bias`,
/// `C = alpha * sums + bias[j]` (`bias` points at the block's or tile's first column).
#[derive(Clone, Copy)]
struct Epilogue {
    alpha: f32,
    beta: f32,
    bias: Option<*const f32>,
}

/// `C = beta * C` (`beta == 0` writes zeros without reading).
unsafe fn scale_c(m: usize, n: usize, beta: f32, c: *mut f32, rsc: isize, csc: isize) {
    for i in 0..m {
        for j in 0..n {
            // SAFETY: (i, j) is inside C.
            unsafe {
                let p = c.offset(i as isize * rsc + j as isize * csc);
                *p = if beta == 0.0 { 0.0 } else { beta * *p };
            }
        }
    }
}

/// All micro-tiles of an `mc x nc` block of C from packed A and B.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn macro_block(
    mc: usize,
    nc: usize,
    kc: usize,
    ep: Epilogue,
    pa: *const f32,
    pb: *const f32,
    c: *mut f32,
    rsc: isize,
    csc: isize,
) {
    for r0 in (0..mc).step_by(MR) {
        let mr = (mc - r0).min(MR);
        // SAFETY: panel r0/MR of pa and s0/NR of pb exist; the tile
        // (r0.., s0..) of size mr x nr is inside C.
        unsafe {
            let ap = pa.add(r0 * kc);
            for s0 in (0..nc).step_by(NR) {
                let nr = (nc - s0).min(NR);
                let bp = pb.add(s0 * kc);
                let ct = c.offset(r0 as isize * rsc + s0 as isize * csc);
                let et = Epilogue {
                    bias: ep.bias.map(|b| b.wrapping_add(s0)),
                    ..ep
                };
                micro(kc, et, ap, bp, ct, rsc, csc, mr, nr);
            }
        }
    }
}

/// One `MR x NR` tile: `C[..mr, ..nr] = alpha * Apanel * Bpanel + beta * C`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn micro(
    kc: usize,
    ep: Epilogue,
    ap: *const f32,
    bp: *const f32,
    c: *mut f32,
    rsc: isize,
    csc: isize,
    mr: usize,
    nr: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    // Pull the C tile towards L1 while the k loop runs, so the
    // epilogue's loads and stores do not stall on memory.
    if csc == 1 {
        for i in 0..mr {
            for v in 0..NV {
                // SAFETY: prefetch never faults; the address is in C's tile.
                unsafe {
                    _mm_prefetch::<_MM_HINT_T0>(c.offset(i as isize * rsc).add(16 * v).cast())
                };
            }
        }
    }
    // SAFETY: ap holds MR*kc floats, bp NR*kc floats (64-byte aligned);
    // the B prefetch address may run past the panel (wrapping_add; prefetch never faults).
    unsafe {
        let (mut ap, mut bp) = (ap, bp);
        // One k step: NV loads of B, MR broadcasts of A, MR*NV FMAs.
        let step = |acc: &mut [[__m512; NV]; MR], ap: *const f32, bp: *const f32| {
            let mut bv = [_mm512_setzero_ps(); NV];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = _mm512_load_ps(bp.add(16 * v));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*ap.add(i));
                for v in 0..NV {
                    row[v] = _mm512_fmadd_ps(av, bv[v], row[v]);
                }
            }
        };
        // Unrolled by 4 to cut loop overhead; B prefetched PF_B ahead.
        for _ in 0..kc / 4 {
            for u in 0..4 {
                _mm_prefetch::<_MM_HINT_T0>(bp.wrapping_add(PF_B + u * NR).cast());
                _mm_prefetch::<_MM_HINT_T0>(bp.wrapping_add(PF_B + u * NR + 16).cast());
                step(&mut acc, ap.add(u * MR), bp.add(u * NR));
            }
            ap = ap.add(4 * MR);
            bp = bp.add(4 * NR);
        }
        for _ in 0..kc % 4 {
            step(&mut acc, ap, bp);
            ap = ap.add(MR);
            bp = bp.add(NR);
        }
    }
    let Epilogue { alpha, beta, bias } = ep;
    let va = _mm512_set1_ps(alpha);
    let vb = _mm512_set1_ps(beta);
    // Columns j.. < nr of one vector of the tile.
    let lanes = |j: usize| -> __mmask16 {
        if nr - j >= 16 {
            0xffff
        } else {
            (1u16 << (nr - j)) - 1
        }
    };
    // The bias of the tile's columns (zeros past nr), loaded once for all its rows.
    let mut bv = [_mm512_setzero_ps(); NV];
    if let Some(bias) = bias {
        for (v, x) in bv.iter_mut().enumerate().take(nr.div_ceil(16)) {
            // SAFETY: the masked lanes are the tile's columns, inside the bias row.
            *x = unsafe { _mm512_maskz_loadu_ps(lanes(16 * v), bias.add(16 * v)) };
        }
    }
    // alpha * sums, then plus the bias or plus beta * C (`c_of` loads C only when needed).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn finish(
        x: __m512,
        va: __m512,
        vb: __m512,
        add: Option<__m512>,
        beta: f32,
        c_of: impl FnOnce() -> __m512,
    ) -> __m512 {
        let ax = _mm512_mul_ps(va, x);
        match add {
            Some(b) => _mm512_add_ps(ax, b),
            None if beta == 0.0 => ax,
            None => _mm512_fmadd_ps(vb, c_of(), ax),
        }
    }
    let add = |v: usize| bias.map(|_| bv[v]);
    if csc == 1 && mr == MR && nr == NR {
        for (i, row) in acc.iter().enumerate() {
            for (v, &x) in row.iter().enumerate() {
                // SAFETY: the full tile is inside C.
                unsafe {
                    let p = c.offset(i as isize * rsc).add(16 * v);
                    _mm512_storeu_ps(p, finish(x, va, vb, add(v), beta, || _mm512_loadu_ps(p)));
                }
            }
        }
    } else if csc == 1 {
        for (i, row) in acc.iter().enumerate().take(mr) {
            for (v, &x) in row.iter().enumerate() {
                let j = 16 * v;
                if j >= nr {
                    break;
                }
                let mask = lanes(j);
                // SAFETY: the masked lanes are columns j.. < nr of row i of the tile.
                unsafe {
                    let p = c.offset(i as isize * rsc).add(j);
                    let r = finish(x, va, vb, add(v), beta, || _mm512_maskz_loadu_ps(mask, p));
                    _mm512_mask_storeu_ps(p, mask, r);
                }
            }
        }
    } else {
        let mut tile = [[0.0f32; NR]; MR];
        for (t, row) in tile.iter_mut().zip(&acc) {
            for (v, &x) in row.iter().enumerate() {
                // SAFETY: 16 floats at t[16 v..] are in the row.
                unsafe { _mm512_storeu_ps(t.as_mut_ptr().add(16 * v), _mm512_mul_ps(va, x)) };
            }
        }
        for (i, t) in tile.iter().enumerate().take(mr) {
            for (j, &x) in t.iter().enumerate().take(nr) {
                // SAFETY: (i, j) is inside the tile of C, j inside the bias row.
                unsafe {
                    let p = c.offset(i as isize * rsc + j as isize * csc);
                    *p = if let Some(bias) = bias {
                        x + *bias.add(j)
                    } else if beta == 0.0 {
                        x
                    } else {
                        x + beta * *p
                    };
                }
            }
        }
    }
}
