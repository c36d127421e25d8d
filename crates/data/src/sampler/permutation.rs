//! A keyed pseudorandom permutation of `0..n` that maps any index in O(1).
//!
//! A balanced Feistel network over the smallest even-bit domain `2^(2h) >= n`, with cycle
//! walking: apply the network until the value falls below `n`. Each Feistel round is a bijection,
//! so the network permutes the domain, and walking a cycle from `x < n` to the next value below
//! `n` restricts that permutation to `0..n`. As `2^(2h) < 4n`, a lookup takes under four network
//! evaluations on average. No table is stored, so a shuffle of a billion sequences costs nothing
//! to set up and a resumed run jumps straight to any position (the O(1) resume of issue 4).

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Feistel rounds; four make a strong pseudorandom permutation (Luby-Rackoff).
const ROUNDS: usize = 4;

/// A permutation of `0..n` chosen by a 64-bit key.
#[derive(Clone, Debug)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    mask: u64,
    keys: [u64; ROUNDS],
}

/// Folds `parts` into one 64-bit key (xxh3 of their little-endian bytes).
pub fn derive_key(parts: &[u64]) -> u64 {
    let mut bytes = Vec::with_capacity(parts.len() * 8);
    for p in parts {
        bytes.extend_from_slice(&p.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, 0x464c_4f54_494c_4c41) // "FLOTILLA"
}

impl Permutation {
    /// The permutation of `0..n` for `key`.
    pub fn new(n: u64, key: u64) -> Permutation {
        let bits = if n <= 1 {
            0
        } else {
            64 - (n - 1).leading_zeros()
        };
        let half_bits = bits.div_ceil(2).max(1);
        let mut keys = [0u64; ROUNDS];
        for (r, k) in keys.iter_mut().enumerate() {
            *k = derive_key(&[key, r as u64]);
        }
        Permutation {
            n,
            half_bits,
            mask: (1u64 << half_bits) - 1,
            keys,
        }
    }

    /// The domain size `n`.
    pub fn len(&self) -> u64 {
        self.n
    }

    /// Whether the domain is empty.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The image of `x`; `x` must be below `n`.
    pub fn apply(&self, x: u64) -> u64 {
        debug_assert!(x < self.n, "{x} outside 0..{}", self.n);
        if self.n <= 1 {
            return x;
        }
        let mut y = x;
        loop {
            y = self.network(y);
            if y < self.n {
                return y;
            }
        }
    }

    fn network(&self, x: u64) -> u64 {
        let (mut left, mut right) = (x >> self.half_bits, x & self.mask);
        for &k in &self.keys {
            let f = xxh3_64_with_seed(&right.to_le_bytes(), k) & self.mask;
            (left, right) = (right, left ^ f);
        }
        (left << self.half_bits) | right
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_a_bijection_for_many_sizes() {
        for n in [1u64, 2, 3, 5, 16, 17, 100, 1000, 4097] {
            let p = Permutation::new(n, 42 + n);
            let mut seen = vec![false; n as usize];
            for x in 0..n {
                let y = p.apply(x);
                assert!(!seen[y as usize], "n={n}: {y} hit twice");
                seen[y as usize] = true;
            }
        }
    }

    #[test]
    fn keys_give_different_orders() {
        let a: Vec<u64> = (0..64).map(|x| Permutation::new(64, 1).apply(x)).collect();
        let b: Vec<u64> = (0..64).map(|x| Permutation::new(64, 2).apply(x)).collect();
        assert_ne!(a, b);
        assert_ne!(a, (0..64).collect::<Vec<_>>());
    }
}
