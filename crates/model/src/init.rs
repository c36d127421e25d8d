//! Parameter initialisation from a seed (the GPT-2 scheme).
//!
//! Linear weights and embeddings ~ N(0, 0.02); the two projections that
//! write into the residual stream ~ N(0, 0.02 / sqrt(2 L)); biases 0; norm
//! gains 1. Values are drawn in layout order from one SplitMix64 stream, so
//! the same seed and config give bit-identical parameters.
use crate::config::ModelConfig;
use crate::layout::{Layout, ParamKind};
use crate::real::Real;
use crate::rng::Rng;

/// Standard deviation of the GPT-2 init.
pub const INIT_STD: f64 = 0.02;

/// Fill `params` (length `layout.total`) from `seed`.
pub fn init_params<T: Real>(cfg: &ModelConfig, layout: &Layout, seed: u64, params: &mut [T]) {
    let mut rng = Rng::new(seed);
    let resid_std = INIT_STD / (2.0 * cfg.layers as f64).sqrt();
    for e in &layout.entries {
        let dst = &mut params[e.range()];
        match e.kind {
            ParamKind::Embedding | ParamKind::Matrix => dst
                .iter_mut()
                .for_each(|x| *x = T::of(rng.normal() * INIT_STD)),
            ParamKind::ResidualMatrix => dst
                .iter_mut()
                .for_each(|x| *x = T::of(rng.normal() * resid_std)),
            ParamKind::Bias | ParamKind::NormBias => dst.fill(T::zero()),
            ParamKind::NormWeight => dst.fill(T::one()),
        }
    }
}
