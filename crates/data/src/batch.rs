//! Random (input, target) windows from a token buffer, for next-token training.
//!
//! Shapes: `B` = batch, `T` = seq_len. A batch is `B` windows of `T + 1` consecutive tokens, each
//! starting at a uniformly random offset; inputs are the first `T` tokens of each window and
//! targets the last `T`, so `targets[b*T + t] == inputs[b*T + t + 1]` within a row.

use rand_chacha::ChaCha8Rng;

use crate::error::{DataError, Result};
use crate::rng::{below, stream_rng};

/// Seeded sampler of training windows over an owned token buffer.
#[derive(Debug, Clone)]
pub struct TokenWindows {
    tokens: Vec<u32>,
    seq_len: usize,
    rng: ChaCha8Rng,
}

impl TokenWindows {
    /// Samples windows of `seq_len` from `tokens`; the same `seed` yields the same batches.
    ///
    /// # Errors
    /// [`DataError::InvalidArgument`] if `seq_len == 0`; [`DataError::BufferTooShort`] if
    /// `tokens` holds fewer than `seq_len + 1` tokens.
    pub fn new(tokens: Vec<u32>, seq_len: usize, seed: u64) -> Result<Self> {
        if seq_len == 0 {
            return Err(DataError::InvalidArgument {
                field: "seq_len",
                value: 0,
                requirement: "must be at least 1".into(),
            });
        }
        let needed = seq_len.saturating_add(1);
        if tokens.len() < needed {
            return Err(DataError::BufferTooShort {
                len: tokens.len(),
                seq_len,
                needed,
            });
        }
        Ok(TokenWindows {
            tokens,
            seq_len,
            rng: stream_rng(seed),
        })
    }

    /// Sequence length `T`.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The token buffer.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Gives the token buffer back.
    pub fn into_tokens(self) -> Vec<u32> {
        self.tokens
    }

    /// Fills `inputs` and `targets`, each (B, T) row-major, with `batch` random windows.
    ///
    /// # Errors
    /// [`DataError::SliceLength`] naming `inputs` or `targets` if its length is not
    /// `batch * seq_len` (nothing is written then).
    pub fn next_batch(
        &mut self,
        batch: usize,
        inputs: &mut [u32],
        targets: &mut [u32],
    ) -> Result<()> {
        let t = self.seq_len;
        let expected = batch.checked_mul(t);
        for (field, got) in [("inputs", inputs.len()), ("targets", targets.len())] {
            if expected != Some(got) {
                return Err(DataError::SliceLength {
                    field,
                    got,
                    expected: expected.unwrap_or(usize::MAX),
                    batch,
                    seq_len: t,
                });
            }
        }
        // Valid starts are 0..=len - (T + 1); new() guarantees len >= T + 1.
        let starts = (self.tokens.len() - t) as u64;
        for (inp, tgt) in inputs.chunks_exact_mut(t).zip(targets.chunks_exact_mut(t)) {
            let s = below(&mut self.rng, starts) as usize;
            inp.copy_from_slice(&self.tokens[s..s + t]);
            tgt.copy_from_slice(&self.tokens[s + 1..s + 1 + t]);
        }
        Ok(())
    }
}

/// Checks that every id in `tokens` is below `vocab`.
///
/// # Errors
/// [`DataError::TokenOutOfRange`] naming the first offending id and its position.
pub fn validate_ids(tokens: &[u32], vocab: usize) -> Result<()> {
    match tokens.iter().position(|&id| id as usize >= vocab) {
        Some(position) => Err(DataError::TokenOutOfRange {
            id: tokens[position],
            position,
            vocab,
        }),
        None => Ok(()),
    }
}
