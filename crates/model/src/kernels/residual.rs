//! Residual connections: elementwise add (forward) and accumulate
//! (backward, where the residual stream's gradient flows into both
//! branches), plus the small parallel-split and reduction helpers the other
//! elementwise and row-wise kernels share.
//!
//! Cost: one read per input and one write per output element; these
//! kernels are memory-bound, so work is split over contiguous ranges of at
//! least [`PAR_MIN_ELEMS`] elements (smaller inputs run on the caller).
use crate::real::Real;
use crate::threads::{SharedMut, Threads};

/// Fewest elements a parallel task touches: below this the fork/join cost
/// of the pool (microseconds) exceeds the work, so the kernel runs on the
/// calling thread.
pub const PAR_MIN_ELEMS: usize = 1 << 14;

/// Rows of `row_len` elements per task so that each task touches at least
/// [`PAR_MIN_ELEMS`] elements (at least 1).
#[inline]
pub(crate) fn min_rows(row_len: usize) -> usize {
    PAR_MIN_ELEMS.div_ceil(row_len.max(1))
}

/// Split `data` (rows of `row_len`, a trailing partial row ignored) into
/// contiguous row blocks of at least [`min_rows`]`(row_len)` rows, at most
/// one per thread, and run `f(first_row, block)` on each in parallel.
/// The split depends only on the thread count and the size.
pub(crate) fn par_rows<T: Send, F>(th: &Threads, data: &mut [T], row_len: usize, f: F)
where
    F: Fn(usize, &mut [T]) + Sync + Send,
{
    if row_len == 0 {
        return;
    }
    let rows = data.len() / row_len;
    let shared = SharedMut::new(data);
    th.ranges(rows, min_rows(row_len), |r| {
        // SAFETY: the row ranges handed out by `ranges` are disjoint and
        // lie inside `data`, which outlives this call.
        let block = unsafe { shared.slice(r.start * row_len..r.end * row_len) };
        f(r.start, block)
    });
}

/// Lanes of the vectorisable reductions: independent accumulators, so
/// the loop runs as several vector add chains (4 x 8 f32 on AVX2/AVX-512).
const LANES: usize = 32;

/// `Σ f(x_i)` with [`LANES`] independent accumulators (so the compiler can
/// vectorise it), combined pairwise; the order depends only on `x.len()`.
#[inline(always)]
pub(crate) fn sum_map<T: Real>(x: &[T], f: impl Fn(T) -> T) -> T {
    let mut acc = [T::zero(); LANES];
    let chunks = x.chunks_exact(LANES);
    let rem = chunks.remainder();
    for ch in chunks {
        for (a, &v) in acc.iter_mut().zip(ch) {
            *a += f(v);
        }
    }
    let mut s = reduce_lanes(acc);
    for &v in rem {
        s += f(v);
    }
    s
}

/// `Σ f(a_i, b_i)` over the common length, vectorisable like [`sum_map`].
#[inline(always)]
pub(crate) fn sum_map2<T: Real>(a: &[T], b: &[T], f: impl Fn(T, T) -> T) -> T {
    let len = a.len().min(b.len());
    let (a, b) = (&a[..len], &b[..len]);
    let mut acc = [T::zero(); LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (xa, xb) in ca.zip(cb) {
        for ((s, &va), &vb) in acc.iter_mut().zip(xa).zip(xb) {
            *s += f(va, vb);
        }
    }
    let mut s = reduce_lanes(acc);
    for (&va, &vb) in ra.iter().zip(rb) {
        s += f(va, vb);
    }
    s
}

/// `Σ f(a_i, b_i, c_i)` over the common length, vectorisable like
/// [`sum_map`].
#[inline(always)]
pub(crate) fn sum_map3<T: Real>(a: &[T], b: &[T], c: &[T], f: impl Fn(T, T, T) -> T) -> T {
    let len = a.len().min(b.len()).min(c.len());
    let (a, b, c) = (&a[..len], &b[..len], &c[..len]);
    let mut acc = [T::zero(); LANES];
    let (ca, cb, cc) = (
        a.chunks_exact(LANES),
        b.chunks_exact(LANES),
        c.chunks_exact(LANES),
    );
    let (ra, rb, rc) = (ca.remainder(), cb.remainder(), cc.remainder());
    for ((xa, xb), xc) in ca.zip(cb).zip(cc) {
        for (((s, &va), &vb), &vc) in acc.iter_mut().zip(xa).zip(xb).zip(xc) {
            *s += f(va, vb, vc);
        }
    }
    let mut s = reduce_lanes(acc);
    for ((&va, &vb), &vc) in ra.iter().zip(rb).zip(rc) {
        s += f(va, vb, vc);
    }
    s
}

/// The largest element (`-inf` for an empty slice), vectorisable.
#[inline(always)]
pub(crate) fn max_of<T: Real>(x: &[T]) -> T {
    let mut acc = [T::neg_infinity(); LANES];
    let chunks = x.chunks_exact(LANES);
    let rem = chunks.remainder();
    for ch in chunks {
        for (a, &v) in acc.iter_mut().zip(ch) {
            *a = if v > *a { v } else { *a };
        }
    }
    let mut m = acc
        .iter()
        .fold(T::neg_infinity(), |m, &v| if v > m { v } else { m });
    for &v in rem {
        m = if v > m { v } else { m };
    }
    m
}

/// Pairwise sum of the lanes in a fixed order. Kept out of line: inlined
/// next to the accumulation loop it makes LLVM vectorise that loop only
/// two lanes wide.
#[inline(never)]
fn reduce_lanes<T: Real>(acc: [T; LANES]) -> T {
    let mut a16 = [T::zero(); 16];
    for (i, a) in a16.iter_mut().enumerate() {
        *a = acc[i] + acc[i + 16];
    }
    let mut a8 = [T::zero(); 8];
    for (i, a) in a8.iter_mut().enumerate() {
        *a = a16[i] + a16[i + 8];
    }
    let mut a4 = [T::zero(); 4];
    for (i, a) in a4.iter_mut().enumerate() {
        *a = a8[i] + a8[i + 4];
    }
    (a4[0] + a4[2]) + (a4[1] + a4[3])
}

/// Residual forward: `out = a + b`, elementwise.
///
/// out, a, b: any equal length (typically (N, C)).
///
/// # Panics
/// If the lengths differ.
pub fn add_fwd<T: Real>(th: &Threads, out: &mut [T], a: &[T], b: &[T]) {
    assert!(
        a.len() == out.len() && b.len() == out.len(),
        "add_fwd lengths: out {}, a {}, b {}",
        out.len(),
        a.len(),
        b.len()
    );
    par_rows(th, out, 1, |first, block| {
        let end = first + block.len();
        for ((o, &x), &y) in block.iter_mut().zip(&a[first..end]).zip(&b[first..end]) {
            *o = x + y;
        }
    });
}

/// Residual backward (and in-place add): `acc += x`, elementwise.
///
/// acc, x: any equal length (typically (N, C)).
///
/// # Panics
/// If the lengths differ.
pub fn add_acc<T: Real>(th: &Threads, acc: &mut [T], x: &[T]) {
    assert_eq!(acc.len(), x.len(), "add_acc lengths");
    par_rows(th, acc, 1, |first, block| {
        let src = &x[first..first + block.len()];
        for (o, &v) in block.iter_mut().zip(src) {
            *o += v;
        }
    });
}
