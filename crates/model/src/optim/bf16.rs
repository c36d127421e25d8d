//! bf16 storage of parameters and gradients with f32 master weights.
//!
//! The model computes in f32 from decoded bf16 parameters
//! ([`Bf16Store::decode_params`]) and hands its f32 gradients back to be
//! rounded to bf16 ([`Bf16Store::store_grads`]). The optimizer step decodes
//! the gradients block by block (no full-size f32 gradient buffer), updates
//! the f32 master weights with AdamW and re-rounds the bf16 parameters.
//! Rounding is to nearest, ties to even, bit-identical to the `half` crate's
//! `bf16::from_f32` ([`to_bf16`]).
use super::adamw::{AdamW, update};
use crate::error::{ModelError, Result};
use crate::threads::{SharedMut, Threads};
use half::bf16;
use std::ops::Range;

/// Gradients decoded to f32 per block inside the optimizer step.
const DECODE_BLOCK: usize = 512;

/// f32 master weights with their bf16 copy and bf16 gradients, all of the
/// same length. Invariant: `params()[i] == bf16::from_f32(master()[i])`.
#[derive(Debug, Clone)]
pub struct Bf16Store {
    master: Vec<f32>,
    params: Vec<bf16>,
    grads: Vec<bf16>,
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(ModelError::Shape {
            what,
            expected,
            got,
        })
    }
}

/// `x` rounded to bf16, to nearest with ties to even; NaN stays NaN (quiet).
/// Bit-identical to `bf16::from_f32`, but branch-free so loops vectorise.
#[inline(always)]
pub fn to_bf16(x: f32) -> bf16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x0040;
    let is_nan = b & 0x7FFF_FFFF > 0x7F80_0000;
    bf16::from_bits(if is_nan { nan } else { rounded } as u16)
}

fn round_into(dst: &mut [bf16], src: &[f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = to_bf16(s);
    }
}

impl Bf16Store {
    /// Take ownership of the f32 master weights; the bf16 parameters are
    /// their rounding and the gradients start at zero.
    pub fn new(master: Vec<f32>) -> Self {
        let mut params = vec![bf16::ZERO; master.len()];
        round_into(&mut params, &master);
        let grads = vec![bf16::ZERO; master.len()];
        Self {
            master,
            params,
            grads,
        }
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.master.len()
    }

    /// Whether there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.master.is_empty()
    }

    /// The f32 master weights (what a checkpoint saves).
    pub fn master(&self) -> &[f32] {
        &self.master
    }

    /// The bf16 parameters.
    pub fn params(&self) -> &[bf16] {
        &self.params
    }

    /// The bf16 gradients last stored.
    pub fn grads(&self) -> &[bf16] {
        &self.grads
    }

    /// Decode the bf16 parameters into `out` (exact) for f32 compute.
    pub fn decode_params(&self, out: &mut [f32]) -> Result<()> {
        check_len("bf16 decoded params", self.len(), out.len())?;
        for (o, p) in out.iter_mut().zip(&self.params) {
            *o = p.to_f32();
        }
        Ok(())
    }

    /// Round the f32 gradients `src` to bf16 and keep them.
    pub fn store_grads(&mut self, src: &[f32]) -> Result<()> {
        check_len("bf16 grads source", self.len(), src.len())?;
        round_into(&mut self.grads, src);
        Ok(())
    }

    /// Decode the bf16 gradients into `out`.
    pub fn decode_grads(&self, out: &mut [f32]) -> Result<()> {
        check_len("bf16 decoded grads", self.len(), out.len())?;
        for (o, g) in out.iter_mut().zip(&self.grads) {
            *o = g.to_f32();
        }
        Ok(())
    }

    /// One AdamW step on the master weights from the stored bf16 gradients
    /// (decoded to f32), then re-round the bf16 parameters. `opt` must have
    /// been built for [`len`](Self::len) parameters; `lr` and `decay` are as
    /// for [`AdamW::step`]. The result equals `AdamW::step` on the master
    /// weights with the decoded gradients.
    pub fn step(
        &mut self,
        th: &Threads,
        opt: &mut AdamW,
        lr: f32,
        decay: &[Range<usize>],
    ) -> Result<()> {
        check_len("bf16 store vs adamw state", opt.len(), self.len())?;
        let grads = &self.grads;
        let out = SharedMut::new(&mut self.params);
        opt.step_with(
            th,
            &mut self.master,
            lr,
            decay,
            |seg, decayed, p, m, v, k| {
                // SAFETY: segments handed to the body are disjoint.
                let out = unsafe { out.slice(seg.clone()) };
                let mut buf = [0.0f32; DECODE_BLOCK];
                let mut off = 0;
                for g in grads[seg].chunks(DECODE_BLOCK) {
                    let n = g.len();
                    for (b, x) in buf.iter_mut().zip(g) {
                        *b = x.to_f32();
                    }
                    let r = off..off + n;
                    update(
                        &mut p[r.clone()],
                        &buf[..n],
                        &mut m[r.clone()],
                        &mut v[r.clone()],
                        k,
                        decayed,
                    );
                    // Re-round while the block is in cache.
                    round_into(&mut out[r.clone()], &p[r]);
                    off += n;
                }
            },
        )
    }

    /// Bytes of the bf16 parameters (for the memory planner).
    pub fn param_bytes(&self) -> usize {
        self.params.len() * std::mem::size_of::<bf16>()
    }

    /// Bytes of the bf16 gradients (for the memory planner).
    pub fn grad_bytes(&self) -> usize {
        self.grads.len() * std::mem::size_of::<bf16>()
    }

    /// Bytes of the f32 master weights (for the memory planner).
    pub fn master_bytes(&self) -> usize {
        self.master.len() * std::mem::size_of::<f32>()
    }
}
