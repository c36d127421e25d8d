//! Flotilla's own activation memory per layer: what its engine keeps for the backward of one
//! transformer block (`model::block::BlockActs` plus the block's output), beside the published
//! formula it replaces for this engine ([`crate::memory::activation_bytes_per_layer`],
//! Korthikanti et al. 2022).
//!
//! The published constants count 2-byte activations, dropout masks and (without recompute)
//! the attention scores. Flotilla's engine keeps its activations in its compute type (f32, 4
//! bytes), runs flash attention (per query only the log-sum-exp, no s×s scores) and has no
//! dropout. Per layer, with `n = s·b` rows, width `h`, `H` heads of size `d`, `K` key/value
//! heads, feed-forward width `F` (`Fin = 2F` gated, else `F`) and TP degree `t`:
//!
//! ```text
//! rows·(4h + 4)                                   ln1, res2, ln2, the block output; 4 norm statistics
//!   + n·((H + 2K)·d + H·d + Fin + F)/t            qkv, attention output, fc output, activation
//!   + n·H/t                                        attention log-sum-exps
//! ```
//!
//! with `rows = n` without sequence parallelism and `rows = n/t` with it (000 L3239: the norms,
//! residuals and block outputs split by rows over the TP group). For GPT-2 shapes (K = H,
//! F = 4h) that is `sbh·(4 + 12/t)` elements without SP and `sbh·16/t` with it, against the
//! published `sbh·(10 + 24/t)` and `sbh·34/t` bytes once the attention scores are left out.

/// One block's shape for [`engine_activation_bytes_per_layer`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockShape {
    /// Width h (d_model).
    pub h: usize,
    /// Attention heads H.
    pub heads: usize,
    /// Key/value heads K.
    pub kv_heads: usize,
    /// Feed-forward width F.
    pub ffn: usize,
    /// Whether the first feed-forward linear is gated (SwiGLU: Fin = 2F).
    pub gated: bool,
}

/// Bytes Flotilla's engine keeps for one layer's backward, one micro-batch of `b` sequences of
/// `s` tokens, at TP degree `t` (dividing the heads and F), with sequence parallelism when
/// `sp`, each element `bytes` wide (4 for f32). See the module doc for the formula.
pub fn engine_activation_bytes_per_layer(
    shape: BlockShape,
    (s, b): (usize, usize),
    t: usize,
    sp: bool,
    bytes: usize,
) -> f64 {
    let (n, h, t) = (s * b, shape.h, t.max(1));
    let d = h / shape.heads.max(1);
    let rows = if sp { n / t } else { n };
    let fin = if shape.gated {
        2 * shape.ffn
    } else {
        shape.ffn
    };
    let split = (shape.heads + 2 * shape.kv_heads) * d + shape.heads * d + fin + shape.ffn;
    let elements = rows * (4 * h + 4) + n * split / t + n * shape.heads / t;
    (elements * bytes) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2 shapes: sbh·(4 + 12/t) elements without SP, sbh·16/t with it, up to the norm
    /// statistics and log-sum-exps.
    #[test]
    fn gpt2_shapes_follow_the_closed_form() {
        let shape = BlockShape {
            h: 1024,
            heads: 16,
            kv_heads: 16,
            ffn: 4096,
            gated: false,
        };
        let (s, b, t) = (2048, 1, 4);
        let sbh = (s * b * shape.h) as f64;
        let no_sp = engine_activation_bytes_per_layer(shape, (s, b), t, false, 1);
        let sp = engine_activation_bytes_per_layer(shape, (s, b), t, true, 1);
        assert!(
            (no_sp / sbh - (4.0 + 12.0 / t as f64)).abs() < 0.01,
            "{}",
            no_sp / sbh
        );
        assert!((sp / sbh - 16.0 / t as f64).abs() < 0.01, "{}", sp / sbh);
    }
}
