//! Megatron tensor parallelism of one block (000 §2.15, F46–F47): TP=1, 2 and 4 ranks (threads)
//! give the unsharded block's output, input gradient and parameter gradients within float
//! summation-order tolerance; repeated runs are bit-identical; each forward+backward makes
//! exactly four all-reduces of an (N, C) activation.
#[path = "support/common.rs"]
mod common;
use comm::group::GroupConfig;
use comm::local::run_threads;
use model::block::{Block, BlockActs, BlockScratch, Dims};
use model::config::{ModelConfig, Positions};
use model::kernels::rope::RopeTable;
use model::layout::Layout;
use model::rng::Rng;
use model::threads::Threads;
use std::sync::Arc;
use train::tensor::{Alone, BlockComm, Counted, TpBlock, TpGroup, TpShard, gather};

const B: usize = 2;
const T: usize = 16;

fn gpt2() -> ModelConfig {
    // 4 heads, C = 64, F = 4C = 256.
    ModelConfig::gpt2(1, 4, 64, T, 32)
}

fn llama() -> ModelConfig {
    // GQA (8 query heads over 4 kv heads), RMSNorm, SwiGLU, rotary positions, no biases.
    ModelConfig::llama(1, 8, 4, 64, 128, T, 32)
}

/// The block's parameters (biases and norm gains perturbed so that every tensor matters), an
/// input and an output gradient.
fn inputs(cfg: &ModelConfig) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let layout = Layout::new(cfg);
    let mut rng = Rng::new(11);
    let mut u = |scale: f64| (rng.normal() * scale) as f32;
    let l = &layout.block;
    let mut p: Vec<f32> = (0..l.size).map(|_| u(0.05)).collect();
    for w in [&l.ln1_w, &l.ln2_w] {
        p[w.clone()].iter_mut().for_each(|x| *x += 1.0);
    }
    let n = B * T * cfg.d_model;
    let x = (0..n).map(|_| u(1.0)).collect();
    let dout = (0..n).map(|_| u(1.0)).collect();
    (p, x, dout)
}

fn rope(cfg: &ModelConfig) -> Option<RopeTable<f32>> {
    match cfg.positions {
        Positions::Rope { theta } => Some(RopeTable::new(cfg.seq_len, cfg.head_dim(), theta)),
        _ => None,
    }
}

/// Output, input gradient and parameter gradients of the model crate's unsharded block.
fn reference(
    cfg: &ModelConfig,
    p: &[f32],
    x: &[f32],
    dout: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let layout = Layout::new(cfg);
    let block = Block::new(cfg, layout.block.clone());
    let d = Dims::new(cfg, B, T);
    let th = Threads::single();
    let rope = rope(cfg);
    let mut acts = vec![0f32; d.block_acts_len()];
    let mut scratch = vec![0f32; d.block_scratch_len()];
    let mut a = BlockActs::carve(&mut acts, &d);
    let mut s = BlockScratch::carve(&mut scratch, &d);
    let mut out = vec![0f32; x.len()];
    block
        .forward(
            &th,
            &d,
            p,
            rope.as_ref(),
            &mut a,
            &mut s,
            x,
            &mut out,
            &mut Alone,
        )
        .unwrap();
    let mut g = vec![0f32; p.len()];
    let mut dx = dout.to_vec();
    block
        .backward(
            &th,
            &d,
            p,
            &mut g,
            rope.as_ref(),
            &a,
            &mut s,
            x,
            &mut dx,
            &mut Alone,
        )
        .unwrap();
    (out, dx, g)
}

/// What one rank returns: output, input gradient, its shard's parameter gradients, and the
/// all-reduce (calls, bytes) after the forward and after the backward.
struct RankOut {
    out: Vec<f32>,
    dx: Vec<f32>,
    g: Vec<f32>,
    fwd: (usize, usize),
    all: (usize, usize),
}

fn run_rank<C: BlockComm<f32>>(
    cfg: &ModelConfig,
    tp: usize,
    rank: usize,
    comm: C,
    (p, x, dout): &(Vec<f32>, Vec<f32>, Vec<f32>),
) -> train::error::Result<RankOut> {
    let layout = Layout::new(cfg);
    let mut blk = TpBlock::<f32>::new(cfg, &layout.block, tp, rank, B, T)?;
    let ps = blk.shard.shard_vec(p)?;
    let th = Threads::single();
    let rope = rope(cfg);
    let mut comm = Counted::new(comm);
    let mut out = vec![0f32; x.len()];
    blk.forward(&th, &ps, rope.as_ref(), x, &mut out, &mut comm)?;
    let fwd = (comm.calls, comm.bytes);
    let mut g = vec![0f32; ps.len()];
    let mut dx = dout.clone();
    blk.backward(&th, &ps, &mut g, rope.as_ref(), x, &mut dx, &mut comm)?;
    Ok(RankOut {
        out,
        dx,
        g,
        fwd,
        all: (comm.calls, comm.bytes),
    })
}

/// `tp` ranks (threads) run the block on the same input.
fn run_tp(cfg: &ModelConfig, tp: usize) -> Vec<RankOut> {
    if tp == 1 {
        return vec![run_rank(cfg, 1, 0, Alone, &inputs(cfg)).unwrap()];
    }
    let data = Arc::new(inputs(cfg));
    let cfg = cfg.clone();
    run_threads(tp, GroupConfig::for_training().unwrap(), move |g| {
        let rank = g.rank();
        Ok(run_rank(&cfg, tp, rank, TpGroup::new(&g), &data))
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap().unwrap())
    .collect()
}

use common::max_rel_diff as rel;

const TOL: f64 = 1e-5;

fn check_matches_unsharded(cfg: &ModelConfig, tp: usize) {
    let (p, x, dout) = inputs(cfg);
    let (out, dx, g) = reference(cfg, &p, &x, &dout);
    let ranks = run_tp(cfg, tp);
    assert_eq!(ranks.len(), tp);
    for (r, o) in ranks.iter().enumerate() {
        let e = rel(&o.out, &out);
        assert!(e < TOL, "tp {tp} rank {r}: output differs by {e:e}");
        let e = rel(&o.dx, &dx);
        assert!(e < TOL, "tp {tp} rank {r}: dx differs by {e:e}");
    }
    let layout = Layout::new(cfg);
    let plans: Vec<TpShard> = (0..tp)
        .map(|r| TpShard::new(cfg, &layout.block, tp, r, B, T).unwrap())
        .collect();
    let shards: Vec<&[f32]> = ranks.iter().map(|o| o.g.as_slice()).collect();
    let gathered = gather(&plans, &shards).unwrap();
    if tp == 1 {
        // One rank runs the same kernels in the same order as the unsharded block.
        assert_eq!(ranks[0].out, out, "tp 1 output");
        assert_eq!(ranks[0].dx, dx, "tp 1 dx");
        assert_eq!(gathered, g, "tp 1 grads");
    }
    let l = &layout.block;
    let tensors = [
        ("ln1_w", Some(l.ln1_w.clone())),
        ("ln1_b", l.ln1_b.clone()),
        ("qkv_w", Some(l.qkv_w.clone())),
        ("qkv_b", l.qkv_b.clone()),
        ("proj_w", Some(l.proj_w.clone())),
        ("proj_b", l.proj_b.clone()),
        ("ln2_w", Some(l.ln2_w.clone())),
        ("ln2_b", l.ln2_b.clone()),
        ("fc_w", Some(l.fc_w.clone())),
        ("fc_b", l.fc_b.clone()),
        ("fcp_w", Some(l.fcp_w.clone())),
        ("fcp_b", l.fcp_b.clone()),
    ];
    for (name, range) in tensors {
        if let Some(range) = range {
            let e = rel(&gathered[range.clone()], &g[range]);
            assert!(e < TOL, "tp {tp}: grad {name} differs by {e:e}");
        }
    }
    // Replicated tensors' gradients agree on every rank.
    for (r, (plan, o)) in plans.iter().zip(&ranks).enumerate() {
        let ll = &plan.local;
        for range in [Some(ll.ln1_w.clone()), ll.ln1_b.clone(), ll.proj_b.clone()]
            .into_iter()
            .chain([Some(ll.ln2_w.clone()), ll.ln2_b.clone(), ll.fcp_b.clone()])
            .flatten()
        {
            let e = rel(&o.g[range.clone()], &ranks[0].g[range]);
            assert!(
                e < TOL,
                "tp {tp} rank {r}: replicated grad differs by {e:e}"
            );
        }
    }
}

#[test]
fn gpt2_block_tp1_tp2_tp4_match_unsharded() {
    for tp in [1, 2, 4] {
        check_matches_unsharded(&gpt2(), tp);
    }
}

#[test]
fn llama_gqa_block_tp1_tp2_tp4_match_unsharded() {
    for tp in [1, 2, 4] {
        check_matches_unsharded(&llama(), tp);
    }
}

#[test]
fn repeated_tp_runs_are_bit_identical() {
    for cfg in [gpt2(), llama()] {
        let a = run_tp(&cfg, 2);
        let b = run_tp(&cfg, 2);
        for (x, y) in a.iter().zip(&b) {
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&x.out), bits(&y.out));
            assert_eq!(bits(&x.dx), bits(&y.dx));
            assert_eq!(bits(&x.g), bits(&y.g));
        }
    }
}

/// F46–F47: two all-reduces of M_act = N·C·4 bytes forward, two backward, per block.
#[test]
fn four_all_reduces_of_n_by_c_per_block() {
    let cfg = gpt2();
    let m_act = B * T * cfg.d_model * std::mem::size_of::<f32>();
    for tp in [2, 4] {
        for o in run_tp(&cfg, tp) {
            assert_eq!(o.fwd, (2, 2 * m_act), "tp {tp} forward");
            assert_eq!(o.all, (4, 4 * m_act), "tp {tp} forward + backward");
        }
    }
}

#[test]
fn tp_not_dividing_heads_is_refused() {
    let cfg = gpt2();
    let layout = Layout::new(&cfg);
    let e = TpBlock::<f32>::new(&cfg, &layout.block, 3, 0, B, T)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("heads (4) % tp (3) = 1"), "{e}");
    let cfg = llama();
    let layout = Layout::new(&cfg);
    let e = TpBlock::<f32>::new(&cfg, &layout.block, 8, 0, B, T)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("kv_heads (4) % tp (8) = 4"), "{e}");
}

#[test]
fn bad_buffers_are_refused_not_panicked() {
    let cfg = gpt2();
    let layout = Layout::new(&cfg);
    let mut blk = TpBlock::<f32>::new(&cfg, &layout.block, 2, 0, B, T).unwrap();
    let th = Threads::single();
    let p = vec![0f32; blk.shard.local.size];
    let x = vec![0f32; B * T * cfg.d_model];
    let mut out = vec![0f32; x.len()];
    assert!(
        blk.forward(&th, &p[1..], None, &x, &mut out, &mut Alone)
            .is_err()
    );
    assert!(
        blk.forward(&th, &p, None, &x[1..], &mut out, &mut Alone)
            .is_err()
    );
    let mut g = p.clone();
    // Backward before any forward.
    assert!(
        blk.backward(&th, &p, &mut g, None, &x, &mut out, &mut Alone)
            .is_err()
    );
}

/// Forwards the first two all-reduces (the g operators) and drops the backward ones (the f
/// operators), to show the f operators are needed.
struct NoBackwardReduce<C> {
    inner: C,
    calls: usize,
}

impl<C: BlockComm<f32>> BlockComm<f32> for NoBackwardReduce<C> {
    fn splits(&self) -> bool {
        self.inner.splits()
    }

    fn sum(&mut self, buf: &mut [f32]) -> Result<(), model::ModelError> {
        self.calls += 1;
        if self.calls <= 2 {
            self.inner.sum(buf)
        } else {
            Ok(())
        }
    }
}

#[test]
fn without_the_f_all_reduces_dx_is_wrong() {
    let cfg = gpt2();
    let data = inputs(&cfg);
    let (out, dx, _) = reference(&cfg, &data.0, &data.1, &data.2);
    let data = Arc::new(data);
    let c2 = cfg.clone();
    let ranks = run_threads(2, GroupConfig::for_training().unwrap(), move |g| {
        let rank = g.rank();
        let comm = NoBackwardReduce {
            inner: TpGroup::new(&g),
            calls: 0,
        };
        Ok(run_rank(&c2, 2, rank, comm, &data))
    })
    .unwrap();
    for r in ranks {
        let o = r.unwrap().unwrap();
        assert!(rel(&o.out, &out) < TOL);
        let e = rel(&o.dx, &dx);
        assert!(
            e > 1e-3,
            "dx should be a partial sum, differs by only {e:e}"
        );
    }
}
