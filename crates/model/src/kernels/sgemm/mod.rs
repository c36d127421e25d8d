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
//! - A bias row (the linear layer's forward, [`sgemm_init`]) is added in the
//!   first k-slice's epilogue, from two vectors loaded once per tile, so C
//!   is written once and never read (filling C first cost a pass over C and
//!   a read of it: 20-35 ms of a 1.5 s "small" training step).
//!
//! Files: this one holds the entry points and the portable fallback,
//! `avx512` the blocking and the micro-kernel, `pack` the packing.
//!
//! Packing costs `m*k` (A once) plus `k*n*ceil(m/MC)` (B) copies against
//! `2*m*k*n` flops; buffers are thread-local and reused, so steady-state
//! calls do not allocate. The sum order per element is fixed by the
//! blocking (k ascending in `KC` slices), so results are deterministic.
//!
//! Other CPUs (no AVX-512F at run time) use `matrixmultiply::sgemm`.

use crate::real::GemmInit;

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
    // SAFETY: forwarded contract; no bias.
    unsafe {
        sgemm_init(
            m,
            k,
            n,
            alpha,
            a,
            rsa,
            csa,
            b,
            rsb,
            csb,
            GemmInit::Beta(beta),
            c,
            rsc,
            csc,
        )
    }
}

/// `C = alpha * A * B + init` for f32 (`beta * C`, or a bias row added in the first k-slice's
/// epilogue, so C is written once and never read): the f32 `Real::gemm`.
///
/// # Safety
/// As [`sgemm`]; a bias points to `n` floats.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm_init(
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
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked above); contract forwarded.
        unsafe { avx512::sgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, init, c, rsc, csc) };
        return;
    }
    // SAFETY: forwarded contract (a bias is written into C first, then added with beta 1).
    unsafe {
        let beta = init.into_beta(m, n, c, rsc, csc);
        matrixmultiply::sgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod pack;
