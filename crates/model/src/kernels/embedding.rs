//! Token (and optional learned position) embeddings, forward and backward.
//!
//! The forward is row-wise. The backward scatters rows of `dout` into the
//! tables; to stay parallel and deterministic each task owns a contiguous
//! range of channels and scans all rows in order, so every gradient
//! element is summed in row order: the result is bit-identical for any
//! thread count.
//!
//! Cost: forward one gather of C per row; backward one read of `dout` and
//! a read-modify-write of the touched table rows.
//!
//! Buffers may be longer than their shapes (only the prefix is used);
//! shorter ones panic with an index error.
use crate::kernels::residual::{PAR_MIN_ELEMS, par_rows};
use crate::real::Real;
use crate::threads::{SharedMut, Threads, part_range};

/// Embedding forward: `out[i] = wte[tokens[i]] + wpe[i % T]` (no `wpe`
/// term when `wpe` is None, e.g. with RoPE).
///
/// out: (N, C), tokens: (N) ids below V (validated by the caller),
/// wte: (V, C), wpe: (maxT, C) with maxT >= T, or None.
#[allow(clippy::too_many_arguments)]
pub fn embed_fwd<T: Real>(
    th: &Threads,
    out: &mut [T],
    tokens: &[u32],
    wte: &[T],
    wpe: Option<&[T]>,
    n: usize,
    t: usize,
    c: usize,
) {
    if n == 0 || c == 0 {
        return;
    }
    let tokens = &tokens[..n];
    par_rows(th, &mut out[..n * c], c, |first, block| {
        for (i, (y, &tok)) in block.chunks_exact_mut(c).zip(&tokens[first..]).enumerate() {
            let tok = tok as usize;
            debug_assert!(
                (tok + 1) * c <= wte.len(),
                "token id {tok} outside the embedding table"
            );
            let e = &wte[tok * c..(tok + 1) * c];
            match wpe {
                Some(wpe) => {
                    let pos = (first + i) % t;
                    let p = &wpe[pos * c..(pos + 1) * c];
                    for ((o, &a), &b) in y.iter_mut().zip(e).zip(p) {
                        *o = a + b;
                    }
                }
                None => y.copy_from_slice(e),
            }
        }
    });
}

/// Embedding backward, accumulating: `dwte[tokens[i]] += dout[i]` and
/// `dwpe[i % T] += dout[i]` for every row i, in row order.
///
/// dwte: (V, C), dwpe: (maxT, C) or None, dout: (N, C), tokens: (N).
#[allow(clippy::too_many_arguments)]
pub fn embed_bwd<T: Real>(
    th: &Threads,
    dwte: &mut [T],
    dwpe: Option<&mut [T]>,
    dout: &[T],
    tokens: &[u32],
    n: usize,
    t: usize,
    c: usize,
) {
    if n == 0 || c == 0 {
        return;
    }
    let (dout, tokens) = (&dout[..n * c], &tokens[..n]);
    // Channel ranges in whole groups of 16 (a 64-byte cache line of f32, so
    // parts do not share lines when C is a multiple of 16), enough work each.
    const GROUP: usize = 16;
    let groups = c.div_ceil(GROUP);
    let parts = th.n().min(groups).min(n * c / PAR_MIN_ELEMS).max(1);
    let swte = SharedMut::new(dwte);
    let swpe = dwpe.map(SharedMut::new);
    th.run(parts, |p| {
        let g = part_range(groups, parts, p);
        let cr = g.start * GROUP..(g.end * GROUP).min(c);
        for (i, (dy, &tok)) in dout.chunks_exact(c).zip(tokens).enumerate() {
            let dy = &dy[cr.clone()];
            let tok = tok as usize;
            debug_assert!(
                (tok + 1) * c <= swte.len(),
                "token id {tok} outside the embedding table"
            );
            // SAFETY: every part touches only its own channel range `cr`
            // of each table row, so live slices of different parts never
            // overlap; within a part one slice is live at a time.
            let e = unsafe { swte.slice(tok * c + cr.start..tok * c + cr.end) };
            for (a, &g) in e.iter_mut().zip(dy) {
                *a += g;
            }
            if let Some(swpe) = &swpe {
                let pos = i % t;
                // SAFETY: as above.
                let e = unsafe { swpe.slice(pos * c + cr.start..pos * c + cr.end) };
                for (a, &g) in e.iter_mut().zip(dy) {
                    *a += g;
                }
            }
        }
    });
}
