//! Sampling text from a trained model.
use crate::error::{ModelError, Result};
use crate::model::Model;
use crate::rng::Rng;
use crate::threads::Threads;

/// How the next token is drawn.
#[derive(Clone, Copy, Debug)]
pub struct SampleConfig {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f64,
    /// Keep only the `top_k` most likely tokens (0 keeps all).
    pub top_k: usize,
    /// Seed of the sampling stream.
    pub seed: u64,
    /// Only ids below this are drawn (a tokenizer smaller than the model's
    /// vocabulary); `None` allows every id.
    pub vocab_limit: Option<usize>,
}

/// Extend `prompt` by `new_tokens` tokens sampled from `model` (built with
/// batch 1). The context is the last `T` tokens; a shorter context is padded
/// after its end, which causal attention never looks at.
pub fn generate(
    th: &Threads,
    model: &mut Model<f32>,
    params: &[f32],
    prompt: &[u32],
    new_tokens: usize,
    sc: &SampleConfig,
) -> Result<Vec<u32>> {
    let d = model.dims().clone();
    if d.b != 1 {
        return Err(ModelError::Config {
            field: "batch",
            value: d.b.to_string(),
            reason: "generation runs batch 1".into(),
        });
    }
    if prompt.is_empty() {
        return Err(ModelError::Config {
            field: "prompt",
            value: "\"\"".into(),
            reason: "need at least one token".into(),
        });
    }
    if !(sc.temperature.is_finite() && sc.temperature >= 0.0) {
        return Err(ModelError::Config {
            field: "temperature",
            value: sc.temperature.to_string(),
            reason: "must be finite and >= 0".into(),
        });
    }
    let mut rng = Rng::new(sc.seed);
    let mut out = prompt.to_vec();
    let mut ctx = vec![0u32; d.t];
    for _ in 0..new_tokens {
        let start = out.len().saturating_sub(d.t);
        let window = &out[start..];
        ctx[..window.len()].copy_from_slice(window);
        ctx[window.len()..].fill(0);
        model.forward(th, params, &ctx, None)?;
        let limit = sc.vocab_limit.unwrap_or(d.v).clamp(1, d.v);
        let row = &model.logits()[(window.len() - 1) * d.v..(window.len() - 1) * d.v + limit];
        out.push(pick(row, sc, &mut rng));
    }
    Ok(out)
}

/// Draw one token id from a row of logits.
fn pick(logits: &[f32], sc: &SampleConfig, rng: &mut Rng) -> u32 {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    if sc.temperature == 0.0 {
        return idx[0];
    }
    let keep = if sc.top_k == 0 {
        idx.len()
    } else {
        sc.top_k.min(idx.len())
    };
    let top = logits[idx[0] as usize] as f64;
    let w: Vec<f64> = idx[..keep]
        .iter()
        .map(|&i| ((logits[i as usize] as f64 - top) / sc.temperature).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut u = rng.uniform() * total;
    for (i, wi) in w.iter().enumerate() {
        if u < *wi {
            return idx[i];
        }
        u -= wi;
    }
    idx[keep - 1]
}
