//! Single-threaded f32 GEMM, `C = alpha * A(m x k) * B(k x n) + beta * C`,
//! GotoBLAS/BLIS style with an AVX-512 micro-kernel (the f32 `Real::gemm`).
//!
//! Why: `matrixmultiply::sgemm` peaks near 80 GFLOP/s per core on Sapphire
//! Rapids, about half of what the two 512-bit FMA ports allow (OpenBLAS
//! ~150). The missing half is register blocking and cache blocking tuned for
//! AVX-512, which is what this file adds.
//!
//! Design (the BLIS Skylake-X sgemm blocking, transposed because our C is
//! row-major and vectors run along C's rows):
//! - micro-kernel: an `MR x NR` tile of C (`MR` = 14 rows, `NR` = 32 = two
//!   zmm) lives in 28 zmm accumulators over a whole `KC` slice; each k step
//!   loads two B vectors and does `MR` broadcast-FMAs per vector, so loads
//!   stay well under the FMA rate.
//! - `A` is packed once per (`MC` rows, `KC`) block into `MR`-row panels
//!   (`p`-major, `MR` values per step; rows past `m` are zero). The current
//!   A micro-panel (`MR * KC * 4` B = 28 KB of the 48 KB L1) sits in L1 while the kernel
//!   sweeps the B panels.
//! - `B` is packed per (`KC`, `NC`) block into `NR`-column panels (64-byte
//!   aligned, columns past `n` zero); the block (`KC * NC * 4` B = 1 MB)
//!   stays in L2 and is reused by all `MC / MR` A micro-panels.
//! - Edges are computed as full tiles over the zero padding and only the
//!   valid part is written (masked stores when C is row-major, a scratch
//!   tile otherwise). `beta == 0` never reads C.
//!
//! Packing costs `m*k` (A once) plus `k*n*ceil(m/MC)` (B) copies against
//! `2*m*k*n` flops; buffers are thread-local and reused, so steady-state
//! calls do not allocate. The sum order per element is fixed by the
//! blocking (k ascending in `KC` slices), so results are deterministic.
//!
//! Other CPUs (no AVX-512F at run time) use `matrixmultiply::sgemm`.

/// `C = alpha * A * B + beta * C` for f32 with arbitrary strides.
///
/// # Safety
/// The pointers and strides must describe valid regions of the given
/// shapes; C may not alias A or B. With `beta == 0` C is only written.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm(
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
    beta: f32,
    c: *mut f32,
    rsc: isize,
    csc: isize,
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked above); contract forwarded.
        unsafe { avx512::sgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) };
        return;
    }
    // SAFETY: forwarded contract.
    unsafe { matrixmultiply::sgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::cell::RefCell;

    /// Rows of a micro-tile (broadcast operand).
    pub(super) const MR: usize = 14;
    /// zmm vectors across a micro-tile's columns.
    const NV: usize = 2;
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
    /// Steps per pass of [`pack_contiguous`] (panels inner).
    const PACK_STEPS: usize = 16;
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
        beta: f32,
        c: *mut f32,
        rsc: isize,
        csc: isize,
    ) {
        if m == 0 || n == 0 {
            return;
        }
        if k == 0 || alpha == 0.0 {
            // SAFETY: C is m x n with the given strides.
            unsafe { scale_c(m, n, beta, c, rsc, csc) };
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
                            macro_block(mc, nc, kc, alpha, pa, pb, beta_p, cb, rsc, csc);
                        }
                    }
                }
            }
        });
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

    /// Pack `A(mc x kc)` into `MR`-row panels: panel `r`, step `p` holds
    /// `A[r*MR .. r*MR+MR, p]` contiguously; rows past `mc` are zero.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_a(mc: usize, kc: usize, a: *const f32, rsa: isize, csa: isize, pa: *mut f32) {
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
                let load: [__mmask16; 2] =
                    std::array::from_fn(|v| lanes(width.saturating_sub(16 * v)));
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
    unsafe fn pack_b(kc: usize, nc: usize, b: *const f32, rsb: isize, csb: isize, pb: *mut f32) {
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

    /// All micro-tiles of an `mc x nc` block of C from packed A and B.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn macro_block(
        mc: usize,
        nc: usize,
        kc: usize,
        alpha: f32,
        pa: *const f32,
        pb: *const f32,
        beta: f32,
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
                    micro(kc, alpha, ap, bp, beta, ct, rsc, csc, mr, nr);
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
        alpha: f32,
        ap: *const f32,
        bp: *const f32,
        beta: f32,
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
        let va = _mm512_set1_ps(alpha);
        let vb = _mm512_set1_ps(beta);
        if csc == 1 && mr == MR && nr == NR {
            for (i, row) in acc.iter().enumerate() {
                for (v, &x) in row.iter().enumerate() {
                    // SAFETY: the full tile is inside C.
                    unsafe {
                        let p = c.offset(i as isize * rsc).add(16 * v);
                        let r = if beta == 0.0 {
                            _mm512_mul_ps(va, x)
                        } else {
                            _mm512_fmadd_ps(vb, _mm512_loadu_ps(p), _mm512_mul_ps(va, x))
                        };
                        _mm512_storeu_ps(p, r);
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
                    let mask: __mmask16 = if nr - j >= 16 {
                        0xffff
                    } else {
                        (1u16 << (nr - j)) - 1
                    };
                    // SAFETY: the masked lanes are columns j.. < nr of row i of the tile.
                    unsafe {
                        let p = c.offset(i as isize * rsc).add(j);
                        let r = if beta == 0.0 {
                            _mm512_mul_ps(va, x)
                        } else {
                            _mm512_fmadd_ps(
                                vb,
                                _mm512_maskz_loadu_ps(mask, p),
                                _mm512_mul_ps(va, x),
                            )
                        };
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
                    // SAFETY: (i, j) is inside the tile of C.
                    unsafe {
                        let p = c.offset(i as isize * rsc + j as isize * csc);
                        *p = if beta == 0.0 { x } else { x + beta * *p };
                    }
                }
            }
        }
    }
}
