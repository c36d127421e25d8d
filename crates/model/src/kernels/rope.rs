//! Rotary position embeddings (RoPE), Hugging Face Llama's "rotate_half"
//! convention: a head vector `x` of dim D is split into halves
//! `x1 = x[..D/2]`, `x2 = x[D/2..]`, and pair `i` is rotated by the angle
//! `pos * theta^(-2i/D)`:
//! `x1' = x1 cos - x2 sin`, `x2' = x2 cos + x1 sin`.
//!
//! Applied in place to the query and key heads of the fused qkv activation;
//! the backward applies the transposed (inverse) rotation to the gradient.
//! Row-wise, so bit-identical for any thread count.
//!
//! Cost: 6 flops per rotated pair, one read and write of the q and k parts.
//!
//! Buffers may be longer than their shapes (only the prefix is used);
//! shorter ones panic with an index error.
use crate::kernels::residual::par_rows;
use crate::real::Real;
use crate::threads::Threads;

/// Precomputed cos/sin tables for positions `0..max_t`.
#[derive(Clone, Debug)]
pub struct RopeTable<T> {
    cos: Vec<T>,
    sin: Vec<T>,
    max_t: usize,
    half: usize,
}

impl<T: Real> RopeTable<T> {
    /// Tables of shape (max_t, D/2): `cos[pos][i] = cos(pos * theta^(-2i/D))`
    /// and likewise `sin`, computed in f64 then rounded to `T`.
    ///
    /// # Panics
    /// If `d` is odd.
    pub fn new(max_t: usize, d: usize, theta: f64) -> Self {
        assert!(d.is_multiple_of(2), "RoPE head dim must be even, got {d}");
        let half = d / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| theta.powf(-((2 * i) as f64) / d as f64))
            .collect();
        let mut cos = Vec::with_capacity(max_t * half);
        let mut sin = Vec::with_capacity(max_t * half);
        for pos in 0..max_t {
            for &f in &inv_freq {
                let (s, c) = (pos as f64 * f).sin_cos();
                cos.push(T::of(c));
                sin.push(T::of(s));
            }
        }
        Self {
            cos,
            sin,
            max_t,
            half,
        }
    }

    /// The longest sequence the table covers.
    pub fn max_t(&self) -> usize {
        self.max_t
    }

    /// The head dim D it was built for.
    pub fn head_dim(&self) -> usize {
        2 * self.half
    }

    /// The D/2 cosines for position `pos` (panics if `pos >= max_t`).
    pub fn cos_at(&self, pos: usize) -> &[T] {
        &self.cos[pos * self.half..(pos + 1) * self.half]
    }

    /// The D/2 sines for position `pos` (panics if `pos >= max_t`).
    pub fn sin_at(&self, pos: usize) -> &[T] {
        &self.sin[pos * self.half..(pos + 1) * self.half]
    }
}

/// RoPE forward, in place on the query and key heads of `qkv`.
///
/// qkv: (N, (H + 2K) * D), N = B*T, each row `[q heads (H*D) | k heads
/// (K*D) | v heads (K*D)]`; the row's position is `row % T`. The first
/// H + K heads are rotated, the V heads are left alone.
///
/// # Panics
/// If `t > table.max_t()` or `d != table.head_dim()`.
#[allow(clippy::too_many_arguments)]
pub fn rope_fwd<T: Real>(
    th: &Threads,
    qkv: &mut [T],
    table: &RopeTable<T>,
    b: usize,
    t: usize,
    h: usize,
    k: usize,
    d: usize,
) {
    rope_apply(th, qkv, table, b, t, h, k, d, false);
}

/// RoPE backward, in place on the q and k parts of the gradient `dqkv`
/// (same layout as [`rope_fwd`]'s `qkv`): the transposed rotation
/// `dx1 = dy1 cos + dy2 sin`, `dx2 = dy2 cos - dy1 sin`. The V part passes
/// through unchanged.
#[allow(clippy::too_many_arguments)]
pub fn rope_bwd<T: Real>(
    th: &Threads,
    dqkv: &mut [T],
    table: &RopeTable<T>,
    b: usize,
    t: usize,
    h: usize,
    k: usize,
    d: usize,
) {
    rope_apply(th, dqkv, table, b, t, h, k, d, true);
}

#[allow(clippy::too_many_arguments)]
fn rope_apply<T: Real>(
    th: &Threads,
    x: &mut [T],
    table: &RopeTable<T>,
    b: usize,
    t: usize,
    h: usize,
    k: usize,
    d: usize,
    transpose: bool,
) {
    assert!(
        t <= table.max_t,
        "RoPE: sequence length {t} exceeds the table's {}",
        table.max_t
    );
    assert_eq!(
        d,
        table.head_dim(),
        "RoPE: head dim differs from the table's"
    );
    let n = b * t;
    let row_len = (h + 2 * k) * d;
    if n == 0 || row_len == 0 {
        return;
    }
    let half = d / 2;
    let rotated = (h + k) * d;
    par_rows(th, &mut x[..n * row_len], row_len, |first, block| {
        for (i, row) in block.chunks_exact_mut(row_len).enumerate() {
            let pos = (first + i) % t;
            let (cos, sin) = (table.cos_at(pos), table.sin_at(pos));
            for head in row[..rotated].chunks_exact_mut(d) {
                let (x1, x2) = head.split_at_mut(half);
                if transpose {
                    for (((a, b), &c), &s) in x1.iter_mut().zip(x2.iter_mut()).zip(cos).zip(sin) {
                        let (u, v) = (*a, *b);
                        *a = u * c + v * s;
                        *b = v * c - u * s;
                    }
                } else {
                    for (((a, b), &c), &s) in x1.iter_mut().zip(x2.iter_mut()).zip(cos).zip(sin) {
                        let (u, v) = (*a, *b);
                        *a = u * c - v * s;
                        *b = v * c + u * s;
                    }
                }
            }
        }
    });
}
