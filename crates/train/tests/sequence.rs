//! Megatron sequence parallelism (000 L3239) in the one block and model: the activation
//! memory it saves, measured from the engine's arena against the planner's term for this
//! engine and the published formula's ratio, and the collectives it puts in place of each
//! tensor-parallel all-reduce.
use std::sync::{Arc, Mutex};

use comm::group::GroupConfig;
use comm::local::run_threads;
use model::block::BlockComm;
use model::config::ModelConfig;
use model::model::Model;
use model::threads::Threads;
use plan::engine_memory::{BlockShape, engine_activation_bytes_per_layer};
use plan::layout::Recompute;
use plan::memory::activation_bytes_per_layer;
use train::tensor::TpGroup;

const B: usize = 2;
const T: usize = 32;

fn gpt2() -> ModelConfig {
    ModelConfig::gpt2(2, 4, 64, T, 96)
}

fn shape(cfg: &ModelConfig) -> BlockShape {
    BlockShape {
        h: cfg.d_model,
        heads: cfg.heads,
        kv_heads: cfg.kv_heads,
        ffn: cfg.ffn,
        gated: false,
    }
}

/// Activation memory per layer on a TP2 rank, with and without `--sp`: measured from the
/// engine's arena, within 10% of the planner's term for this engine (f32, flash attention, no
/// dropout); the with/without ratio within 10% of the published formula's (flash attention
/// keeps no attention scores: the formula without its 5as/h term).
#[test]
fn sequence_parallel_activations_match_the_planner() {
    let cfg = gpt2();
    let tp = 2;
    let measured = |sp: bool| {
        Model::<f32>::split(&cfg, B, T, vec![false; cfg.layers], (tp, sp))
            .unwrap()
            .layer_activation_bytes() as f64
    };
    let (plain, sp) = (measured(false), measured(true));
    for (m, on) in [(plain, false), (sp, true)] {
        let p = engine_activation_bytes_per_layer(shape(&cfg), (T, B), tp, on, 4);
        assert!(
            (m - p).abs() <= 0.1 * p,
            "sp {on}: measured {m} B vs planner {p} B"
        );
    }
    let (s, b, h, a) = (T as f64, B as f64, cfg.d_model as f64, cfg.heads as f64);
    let published =
        |on: bool| activation_bytes_per_layer(s, b, h, a, 2.0, on, Recompute::Selective, 2.0);
    let (ours, theirs) = (sp / plain, published(true) / published(false));
    assert!(
        (ours - theirs).abs() <= 0.1 * theirs,
        "with/without ratio {ours:.3} vs the formula's {theirs:.3}"
    );
    println!(
        "tp 2: {plain} B without sp, {sp} B with (ratio {ours:.3}); published ratio {theirs:.3}"
    );
}

/// One collective: its kind and its buffer's elements.
type Op = (&'static str, usize);
/// What a block's collectives were.
type Ops = Arc<Mutex<Vec<Op>>>;

/// A [`BlockComm`] that records every collective before running it.
struct Recording<'a> {
    inner: TpGroup<'a>,
    ops: Ops,
}

impl Recording<'_> {
    fn note(&self, kind: &'static str, len: usize) {
        self.ops.lock().unwrap().push((kind, len));
    }
}

impl BlockComm<f32> for Recording<'_> {
    fn splits(&self) -> bool {
        true
    }

    fn sum(&mut self, buf: &mut [f32]) -> model::Result<()> {
        self.note("sum", buf.len());
        self.inner.sum(buf)
    }

    fn sequence(&self) -> bool {
        BlockComm::<f32>::sequence(&self.inner)
    }

    fn part(&self) -> (usize, usize) {
        BlockComm::<f32>::part(&self.inner)
    }

    fn gather(&mut self, rows: &[f32], whole: &mut [f32]) -> model::Result<()> {
        self.note("all-gather", whole.len());
        self.inner.gather(rows, whole)
    }

    fn scatter(&mut self, whole: &mut [f32], rows: &mut [f32]) -> model::Result<()> {
        self.note("reduce-scatter", whole.len());
        self.inner.scatter(whole, rows)
    }
}

/// One forward and backward of a TP2 model on two threads; rank 0's collectives, forward and
/// backward apart.
fn collectives(sp: bool) -> (Vec<Op>, Vec<Op>) {
    let cfg = gpt2();
    let out = run_threads(2, GroupConfig::for_training().unwrap(), move |g| {
        let mut m = Model::<f32>::split(&cfg, B, T, vec![false; cfg.layers], (2, sp)).unwrap();
        let p = vec![0.01f32; m.layout().total];
        let mut grads = vec![0f32; p.len()];
        let tokens: Vec<u32> = (0..B * T).map(|i| (i % 96) as u32).collect();
        let ops: Ops = Arc::default();
        let mut group = TpGroup::new(&g);
        group.sequence = sp;
        let mut comm = Recording {
            inner: group,
            ops: ops.clone(),
        };
        let th = Threads::single();
        m.forward_with(&th, &p, &tokens, Some(&tokens), &mut comm)
            .unwrap();
        let forward = ops.lock().unwrap().len();
        m.backward_hooked_with(&th, &p, &mut grads, &mut |_, _| {}, &mut comm)
            .unwrap();
        let all = ops.lock().unwrap().clone();
        Ok((all[..forward].to_vec(), all[forward..].to_vec()))
    })
    .unwrap();
    out.into_iter().next().unwrap().unwrap()
}

/// 000 L3239: with sequence parallelism each block's two forward all-reduces of (N, C) become
/// an all-gather before each column-parallel linear and a reduce-scatter after each
/// row-parallel one (the same bytes on the wire), and no (N, C) all-reduce is left; without
/// it, two all-reduces per block forward and two backward.
#[test]
fn an_all_gather_and_reduce_scatter_pair_replaces_each_all_reduce() {
    let cfg = gpt2();
    let nc = B * T * cfg.d_model;
    let (fwd, bwd) = collectives(false);
    assert_eq!(fwd, vec![("sum", nc); 2 * cfg.layers]);
    assert_eq!(bwd, vec![("sum", nc); 2 * cfg.layers]);
    let (fwd, bwd) = collectives(true);
    let mut want = Vec::new();
    for _ in 0..cfg.layers {
        want.extend([("all-gather", nc), ("reduce-scatter", nc)]);
        want.extend([("all-gather", nc), ("reduce-scatter", nc)]);
    }
    // The embedding keeps its rows locally; the head gathers the final norm's rows.
    want.push(("all-gather", nc));
    assert_eq!(fwd, want);
    assert!(
        bwd.iter().all(|&(k, n)| k != "sum" || n == 2 * cfg.d_model),
        "only the norms' partial weight gradients (2C) are summed: {bwd:?}"
    );
    assert!(!bwd.iter().any(|&(k, n)| k == "sum" && n == nc), "{bwd:?}");
}
