//! [`TpBlocks`]: a run of consecutive blocks on one tensor-parallel rank for one micro-batch,
//! the part of a pipeline chunk that tensor parallelism splits when it runs inside pipeline
//! stages (file 000 "混合并行", "3D 训练循环": PP x TP x DP on one mesh; "Megatron 风格的张量并行").
//!
//! ```text
//! input (N, C, whole) ── TpBlock a ── x(a+1) ── … ── TpBlock b-1 ── output (N, C, whole)
//!                        (4 all-reduces of (N, C) per block over the TP group, F46)
//! ```
//!
//! Every TP rank of a pipeline stage receives the same whole residual from the same-TP-index
//! rank of the previous stage, runs each block on its shard with [`TpBlock`] (the residual
//! after each block's g all-reduce is whole and the same on every rank of the group), and
//! sends the same whole residual on; the backward mirrors it with the gradient. The
//! embeddings and the head are not here: they are whole tensors, replicated over the stage's
//! TP group, and the pipeline runs them with the model crate's own unit kernels.
//!
//! Parameters are addressed in the caller's flat buffers: block `a + i`'s shard (length
//! `shard.local.size`) is `ranges[i]`, wherever the caller keeps it.
use std::ops::Range;

use model::config::{ModelConfig, Positions};
use model::kernels::rope::RopeTable;
use model::layout::Layout;
use model::threads::Threads;

use crate::error::{Result, TrainError};
use crate::tensor::shard::check_len;
use crate::tensor::{BlockComm, TpBlock};

/// Blocks `a..b` of rank `rank` of a `tp`-way group for one micro-batch of `b` sequences of
/// length `t` (N = B·T rows), with the residual stream entering each block and leaving the
/// last, (N, C) each, and the gradient of the residual for the backward.
pub struct TpBlocks {
    blocks: Vec<TpBlock<f32>>,
    /// Block `a + i`'s shard in the caller's parameter and gradient buffers.
    ranges: Vec<Range<usize>>,
    rope: Option<RopeTable<f32>>,
    /// `xs[i]`: the residual entering block `a + i`; `xs[b - a]`: leaving block `b - 1`.
    xs: Vec<Vec<f32>>,
    /// The residual's gradient (N, C): on entry to the backward that of the output, on exit
    /// that of the input.
    dx: Vec<f32>,
    forwarded: bool,
}

impl TpBlocks {
    /// The blocks whose shards lie at `ranges` (one range per block, each of the shard's
    /// length), as rank `rank` of `tp` for `cfg` at batch `b`, length `t`. Refuses what
    /// [`TpBlock::new`] refuses (`tp` not dividing heads, kv_heads or ffn, named) and a range
    /// of another length than the shard.
    pub fn new(
        cfg: &ModelConfig,
        tp: usize,
        rank: usize,
        b: usize,
        t: usize,
        ranges: Vec<Range<usize>>,
    ) -> Result<Self> {
        let whole = Layout::new(cfg);
        let blocks = ranges
            .iter()
            .map(|r| {
                let block = TpBlock::new(cfg, &whole.block, tp, rank, b, t)?;
                check_len("tp block range", r.len(), block.shard.local.size)?;
                Ok(block)
            })
            .collect::<Result<Vec<_>>>()?;
        let rope = match cfg.positions {
            Positions::Rope { theta } => Some(RopeTable::new(cfg.seq_len, cfg.head_dim(), theta)),
            Positions::Learned => None,
        };
        let nc = b * t * cfg.d_model;
        Ok(Self {
            xs: vec![vec![0.0; nc]; blocks.len() + 1],
            dx: vec![0.0; nc],
            forwarded: false,
            blocks,
            ranges,
            rope,
        })
    }

    /// Forward of the blocks from `input` (N, C, whole, the same on every rank of the group)
    /// with the shards in `params`; returns the residual leaving the last block (whole, the
    /// same on every rank). Calls `comm` twice per block.
    pub fn forward<C: BlockComm<f32>>(
        &mut self,
        th: &Threads,
        params: &[f32],
        input: &[f32],
        comm: &mut C,
    ) -> Result<&[f32]> {
        check_len("tp blocks input (N, C)", input.len(), self.dx.len())?;
        self.forwarded = false;
        self.xs[0].copy_from_slice(input);
        for (i, block) in self.blocks.iter_mut().enumerate() {
            let (done, rest) = self.xs.split_at_mut(i + 1);
            let p = &params[self.ranges[i].clone()];
            block.forward(th, p, self.rope.as_ref(), &done[i], &mut rest[0], comm)?;
        }
        self.forwarded = true;
        Ok(&self.xs[self.blocks.len()])
    }

    /// Backward of the last [`forward`](Self::forward) (same `params`) from `dout`, the
    /// gradient of the output residual (N, C, whole); the shards' gradients accumulate (`+=`)
    /// into `grads` at the same ranges. Returns the gradient of the input residual (whole, the
    /// same on every rank). Calls `comm` twice per block.
    pub fn backward<C: BlockComm<f32>>(
        &mut self,
        th: &Threads,
        params: &[f32],
        grads: &mut [f32],
        dout: &[f32],
        comm: &mut C,
    ) -> Result<&[f32]> {
        check_len(
            "tp blocks output gradient (N, C)",
            dout.len(),
            self.dx.len(),
        )?;
        if !self.forwarded {
            return Err(TrainError::Config {
                field: "tp blocks",
                value: "backward".into(),
                reason: "backward needs a completed forward first".into(),
            });
        }
        self.forwarded = false;
        self.dx.copy_from_slice(dout);
        for (i, block) in self.blocks.iter_mut().enumerate().rev() {
            let r = self.ranges[i].clone();
            block.backward(
                th,
                &params[r.clone()],
                &mut grads[r],
                self.rope.as_ref(),
                &self.xs[i],
                &mut self.dx,
                comm,
            )?;
        }
        Ok(&self.dx)
    }

    /// The residual leaving the last block after the last [`forward`](Self::forward).
    pub fn output(&self) -> &[f32] {
        &self.xs[self.blocks.len()]
    }

    /// The gradient of the input residual after the last [`backward`](Self::backward).
    pub fn input_grad(&self) -> &[f32] {
        &self.dx
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Alone;
    use model::init::init_params;
    use model::layout::Unit;
    use model::model::Model;

    /// At tp = 1, the blocks between the model's own embedding and head units give the
    /// model's loss and block gradients up to float summation order.
    #[test]
    fn tp1_blocks_between_the_models_units_match_the_model() {
        let cfg = ModelConfig::gpt2(2, 4, 32, 8, 16);
        let th = Threads::single();
        let (b, t) = (2, 8);
        let layout = Layout::new(&cfg);
        let mut params = vec![0f32; layout.total];
        init_params(&cfg, &layout, 3, &mut params);
        let n = b * t;
        let tokens: Vec<u32> = (0..n).map(|i| (i * 5 % cfg.vocab) as u32).collect();
        let targets: Vec<u32> = (0..n).map(|i| ((i * 3 + 1) % cfg.vocab) as u32).collect();
        let mut whole = Model::<f32>::new(&cfg, b, t, false).unwrap();
        let want = whole
            .forward(&th, &params, &tokens, Some(&targets))
            .unwrap();
        let mut g_want = vec![0f32; layout.total];
        whole.backward(&th, &params, &mut g_want).unwrap();

        let mut m = Model::<f32>::new(&cfg, b, t, false).unwrap();
        let mut blocks = TpBlocks::new(&cfg, 1, 0, b, t, layout.blocks.clone()).unwrap();
        let mut g = vec![0f32; layout.total];
        m.begin_at(Unit::Embed, None, Some(&tokens), None).unwrap();
        m.forward_unit(&th, &params, Unit::Embed).unwrap();
        let x = m.unit_output(Unit::Embed).unwrap().to_vec();
        let out = blocks
            .forward(&th, &params, &x, &mut Alone)
            .unwrap()
            .to_vec();
        m.begin_at(Unit::Head, Some(&out), None, Some(&targets))
            .unwrap();
        m.forward_unit(&th, &params, Unit::Head).unwrap();
        let got = m.loss().unwrap();
        let want = want.unwrap();
        assert!((got - want).abs() < 1e-5 * want, "loss {got} vs {want}");
        m.begin_backward_at(Unit::Head, None).unwrap();
        m.backward_unit(&th, &params, &mut g, Unit::Head).unwrap();
        let dout = m.input_grad().to_vec();
        blocks
            .backward(&th, &params, &mut g, &dout, &mut Alone)
            .unwrap();
        let r = layout.blocks[0].start..layout.blocks[1].end;
        let scale = g_want[r.clone()].iter().fold(0f32, |a, &x| a.max(x.abs()));
        let diff = g[r.clone()]
            .iter()
            .zip(&g_want[r])
            .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        assert!(diff <= 1e-5 * scale, "block gradients differ by {diff}");
        // A second backward needs another forward.
        let again = blocks.backward(&th, &params, &mut g, &dout, &mut Alone);
        assert!(again.is_err());
    }
}
