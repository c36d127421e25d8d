//! Small sampling helpers over a [`ChaCha8Rng`], so the crate needs only `rand_chacha`.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};

/// ChaCha stream used for token streams, so they never replay the table-building stream.
const STREAM_ID: u64 = 1;

/// A generator seeded from `seed` (ChaCha stream 0).
pub(crate) fn table_rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// A generator seeded from `seed` on a separate ChaCha stream from [`table_rng`].
pub(crate) fn stream_rng(seed: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(STREAM_ID);
    rng
}

/// Uniform `f64` in `[0, 1)` with 53 random bits.
pub(crate) fn unit_f64(rng: &mut ChaCha8Rng) -> f64 {
    // The top 53 bits fill an f64 mantissa exactly; 2^-53 scales them into [0, 1).
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Uniform integer in `0..n`, unbiased (Lemire's multiply-shift with rejection).
///
/// Returns 0 when `n == 0`, so callers need not special-case empty ranges.
pub(crate) fn below(rng: &mut ChaCha8Rng, n: u64) -> u64 {
    if n == 0 {
        return 0;
    }
    // Values of the low product word below `threshold` would over-represent some outputs.
    let threshold = n.wrapping_neg() % n;
    loop {
        let m = u128::from(rng.next_u64()) * u128::from(n);
        if (m as u64) >= threshold {
            return (m >> 64) as u64;
        }
    }
}
