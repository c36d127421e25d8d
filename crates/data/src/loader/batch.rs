//! One rank's rows of a global batch, in the token width the shards store.

use crate::error::{DataError, Result};
use crate::sampler::SampleRef;
use crate::shard::Shard;

/// Token ids of a batch, kept in the shards' width: a row is a straight copy of the mapped
/// bytes, and widening to `u32` happens once, where the consumer wants it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchTokens {
    /// Ids of a vocabulary of at most 65536.
    U16(Vec<u16>),
    /// Larger vocabularies.
    U32(Vec<u32>),
}

impl BatchTokens {
    /// `n` zero ids of `width` bytes each.
    pub(crate) fn zeroed(width: u32, n: usize) -> BatchTokens {
        if width == 2 {
            BatchTokens::U16(vec![0; n])
        } else {
            BatchTokens::U32(vec![0; n])
        }
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        match self {
            BatchTokens::U16(v) => v.len(),
            BatchTokens::U32(v) => v.len(),
        }
    }

    /// Whether there are no ids.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ids `[from, from + out.len())`, widened into `out`.
    fn widen(&self, from: usize, out: &mut [u32]) {
        match self {
            BatchTokens::U16(v) => {
                let n = out.len();
                for (o, &t) in out.iter_mut().zip(&v[from..from + n]) {
                    *o = u32::from(t);
                }
            }
            BatchTokens::U32(v) => out.copy_from_slice(&v[from..from + out.len()]),
        }
    }

    /// Copies `count` ids from `shard` at token `start` into positions `[at, at + count)`.
    pub(crate) fn fill_from(
        &mut self,
        at: usize,
        shard: &Shard,
        start: u64,
        count: usize,
    ) -> Result<()> {
        // A straight byte copy (`memcpy`, which keeps many lines in flight) rather than an
        // element-wise decode: rows are scattered over the shuffle window, and the per-element
        // loop waited on memory 2.2x longer per row (docs/PERFORMANCE.md, data pipeline).
        // Shard ids are little-endian, so on a little-endian target the bytes are the ids.
        let little = cfg!(target_endian = "little");
        match self {
            BatchTokens::U16(v) if shard.info().width == 2 && little => {
                let bytes = shard.token_bytes(start, count)?;
                bytemuck::cast_slice_mut::<u16, u8>(&mut v[at..at + count]).copy_from_slice(bytes);
            }
            BatchTokens::U16(v) if shard.info().width == 2 => {
                let bytes = shard.token_bytes(start, count)?;
                for (o, b) in v[at..at + count].iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = u16::from_le_bytes([b[0], b[1]]);
                }
            }
            BatchTokens::U32(v) if shard.info().width == 4 && little => {
                let bytes = shard.token_bytes(start, count)?;
                bytemuck::cast_slice_mut::<u32, u8>(&mut v[at..at + count]).copy_from_slice(bytes);
            }
            BatchTokens::U32(v) if shard.info().width == 4 => {
                shard.read_tokens(start, &mut v[at..at + count])?;
            }
            _ => {
                return Err(DataError::CorruptShard {
                    path: shard.info().path.clone(),
                    problem: format!(
                        "{}-byte token ids where the mixture's first dataset has another width",
                        shard.info().width
                    ),
                });
            }
        }
        // A shard truncated under the run faulted during the copy: the ids are zeros.
        shard.intact()
    }
}

/// This rank's rows of one global batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Global step (global batches before this one).
    pub step: u64,
    /// Global position of this rank's first row.
    pub position: u64,
    /// Tokens per sequence, T.
    pub seq_len: usize,
    /// `rows x (T + 1)` token ids, row-major.
    pub tokens: BatchTokens,
    /// Where each row came from.
    pub samples: Vec<SampleRef>,
}

impl Batch {
    /// Rows (sequences) in the batch.
    pub fn rows(&self) -> usize {
        self.samples.len()
    }

    /// Row `i`: T + 1 ids, widened to `u32`.
    pub fn row(&self, i: usize) -> Vec<u32> {
        let w = self.seq_len + 1;
        let mut out = vec![0; w];
        self.tokens.widen(i * w, &mut out);
        out
    }

    /// Writes inputs (each row's first T ids) and targets (its last T) as `rows x T` arrays.
    ///
    /// # Errors
    /// [`DataError::SliceLength`] if either slice is not `rows x T` long.
    pub fn split_into(&self, inputs: &mut [u32], targets: &mut [u32]) -> Result<()> {
        let (b, t) = (self.rows(), self.seq_len);
        for (field, got) in [("inputs", inputs.len()), ("targets", targets.len())] {
            if got != b * t {
                return Err(DataError::SliceLength {
                    field,
                    got,
                    expected: b * t,
                    batch: b,
                    seq_len: t,
                });
            }
        }
        for i in 0..b {
            let row = i * (t + 1);
            self.tokens.widen(row, &mut inputs[i * t..(i + 1) * t]);
            self.tokens.widen(row + 1, &mut targets[i * t..(i + 1) * t]);
        }
        Ok(())
    }
}
