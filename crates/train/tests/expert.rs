//! Expert parallelism (issue 8): the MoE layer's gradients against finite
//! differences, capacity and dropping, and EP = 2 / 4 against EP = 1
//! (forward, backward, a few optimizer steps, bit-identical repeats).
#[path = "support/common.rs"]
mod common;
use comm::group::GroupConfig;
use comm::group::ProcessGroup;
use comm::local::run_threads;
use model::Threads;
use model::config::Activation;
use model::gradcheck::{compare, dot, numeric_grad, rand_vec};
use model::optim::{AdamW, AdamWConfig};
use std::sync::Arc;
use train::expert::dispatch::a2a_bytes_one_way;
use train::expert::{ExpertGroup, Experts, Local, MoeConfig, MoeLayout, MoeStats, Objective};

/// The layer alone on one process (ep = 1): every exchange a copy.
#[derive(Debug)]
struct MoeLayer<T>(Experts<T>);

impl<T: model::Real> MoeLayer<T> {
    fn new(cfg: MoeConfig) -> model::Result<Self> {
        Experts::new(cfg, (1, 0), Objective::Sum).map(Self)
    }
    fn layout(&self) -> &MoeLayout {
        self.0.layout()
    }
    fn forward(&mut self, th: &Threads, p: &[T], x: &[T]) -> model::Result<(Vec<T>, MoeStats)> {
        self.0.forward(&mut Local, th, p, x)
    }
    fn backward(&mut self, th: &Threads, p: &[T], g: &mut [T], dy: &[T]) -> model::Result<Vec<T>> {
        self.0.backward(&mut Local, th, p, g, dy)
    }
}

/// One rank of an EP group's layer (the layer's objective summed over the ranks).
struct EpMoeLayer {
    experts: Experts<f32>,
    group: ProcessGroup,
}

impl EpMoeLayer {
    fn new(cfg: MoeConfig, group: ProcessGroup) -> model::Result<Self> {
        let experts = Experts::new(cfg, (group.size(), group.rank()), Objective::Sum)?;
        Ok(Self { experts, group })
    }
    fn forward(
        &mut self,
        th: &Threads,
        p: &[f32],
        x: &[f32],
    ) -> model::Result<(Vec<f32>, MoeStats)> {
        self.experts
            .forward(&mut ExpertGroup::new(&self.group), th, p, x)
    }
    fn backward(
        &mut self,
        th: &Threads,
        p: &[f32],
        g: &mut [f32],
        dy: &[f32],
    ) -> model::Result<Vec<f32>> {
        self.experts
            .backward(&mut ExpertGroup::new(&self.group), th, p, g, dy)
    }
}

/// The whole layer's buffer from every rank's (rank order): the router from rank 0 (the ranks
/// hold the same), each expert from its owner.
fn gather(cfg: MoeConfig, bufs: &[Vec<f32>]) -> Vec<f32> {
    let mut out = bufs[0].clone();
    for (r, b) in bufs.iter().enumerate() {
        let l = MoeLayout::new(cfg, bufs.len(), r).unwrap();
        for le in 0..l.local_experts() {
            out[l.expert(le)].copy_from_slice(&b[l.expert(le)]);
        }
    }
    out
}

fn cfg(experts: usize, top_k: usize, c: usize, f: usize, cf: f64, aux: f64) -> MoeConfig {
    MoeConfig {
        experts,
        top_k,
        channels: c,
        hidden: f,
        capacity_factor: cf,
        aux_weight: aux,
        activation: Activation::Gelu,
        bias: true,
    }
}

/// Parameters: router at `router_scale`, experts at 0.3.
fn params(cfg: &MoeConfig, seed: u64, router_scale: f64) -> Vec<f64> {
    let l = MoeLayout::new(*cfg, 1, 0).unwrap();
    let mut p = rand_vec(seed, l.len(), 0.3);
    let r = rand_vec(seed ^ 0x5eed, l.router().len(), router_scale);
    p[l.router()].copy_from_slice(&r);
    p
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

// ----------------------------------------------------------------------------
// gradient checks (f64 reference path)

/// `Σ w ⊙ y + aux_weight · aux` of one forward.
fn objective(cfg: &MoeConfig, p: &[f64], x: &[f64], w: &[f64]) -> f64 {
    let mut layer = MoeLayer::<f64>::new(*cfg).unwrap();
    let (y, st) = layer.forward(&Threads::single(), p, x).unwrap();
    dot(&y, w) + cfg.aux_weight * st.aux_loss
}

fn gradcheck(cfg: MoeConfig, n: usize, seed: u64) -> MoeStats {
    let th = Threads::single();
    let p = params(&cfg, seed, 1.0);
    let x = rand_vec(seed + 1, n * cfg.channels, 1.0);
    let w = rand_vec(seed + 2, n * cfg.channels, 1.0);
    let mut layer = MoeLayer::<f64>::new(cfg).unwrap();
    let (_, stats) = layer.forward(&th, &p, &x).unwrap();
    let mut g = vec![0.0; p.len()];
    let dx = layer.backward(&th, &p, &mut g, &w).unwrap();
    let eps = 1e-6;
    let ng = numeric_grad(&p, eps, |q| objective(&cfg, q, &x, &w));
    let l = layer.layout();
    compare(&g[l.router()], &ng[l.router()], 1e-6).assert_below(1e-5, "router grad");
    compare(&g[l.router().end..], &ng[l.router().end..], 1e-6).assert_below(1e-5, "expert grads");
    let nx = numeric_grad(&x, eps, |q| objective(&cfg, &p, q, &w));
    compare(&dx, &nx, 1e-6).assert_below(1e-5, "input grad");
    stats
}

#[test]
fn gradcheck_top1_with_drops() {
    let st = gradcheck(cfg(4, 1, 6, 8, 1.0, 0.1), 12, 11);
    assert!(st.dropped_assignments > 0, "expected drops: {st:?}");
}

#[test]
fn gradcheck_top2_no_drops() {
    let st = gradcheck(cfg(4, 2, 6, 8, 4.0, 0.05), 10, 21);
    assert_eq!(st.dropped_assignments, 0, "{st:?}");
}

#[test]
fn gradcheck_top2_with_drops() {
    let st = gradcheck(cfg(4, 2, 5, 7, 0.75, 0.1), 12, 31);
    assert!(st.dropped_assignments > 0, "expected drops: {st:?}");
}

/// With dy = 0 the objective is the aux loss alone: its gradient reaches the
/// router (through P_e) and nothing else.
#[test]
fn aux_loss_gradient() {
    let th = Threads::single();
    let c = cfg(4, 2, 6, 8, 1.25, 1.0);
    let n = 10;
    let p = params(&c, 41, 1.0);
    let x = rand_vec(42, n * c.channels, 1.0);
    let zero = vec![0.0; n * c.channels];
    let mut layer = MoeLayer::<f64>::new(c).unwrap();
    let (_, st) = layer.forward(&th, &p, &x).unwrap();
    assert!(st.aux_loss > 0.0);
    let mut g = vec![0.0; p.len()];
    let dx = layer.backward(&th, &p, &mut g, &zero).unwrap();
    let ng = numeric_grad(&p, 1e-6, |q| objective(&c, q, &x, &zero));
    let l = layer.layout();
    compare(&g[l.router()], &ng[l.router()], 1e-8).assert_below(1e-6, "aux router grad");
    assert!(g[l.router()].iter().any(|&v| v != 0.0));
    assert!(
        g[l.router().end..].iter().all(|&v| v == 0.0),
        "aux loss reached the experts"
    );
    let nx = numeric_grad(&x, 1e-6, |q| objective(&c, &p, q, &zero));
    compare(&dx, &nx, 1e-8).assert_below(1e-6, "aux input grad");
}

// ----------------------------------------------------------------------------
// capacity, dropping, tie-break, metrics

#[test]
fn capacity_drops_later_tokens_deterministically() {
    let th = Threads::single();
    let (e, c, n) = (4, 4, 8);
    let mc = cfg(e, 1, c, 6, 1.0, 0.0);
    assert_eq!(mc.capacity(n), 2); // ⌈1.0 · 8 · 1 / 4⌉
    let l = MoeLayout::new(mc, 1, 0).unwrap();
    let mut p = params(&mc, 5, 0.0);
    p[l.router()].fill(0.0);
    p[0] = 10.0; // Wg[0, 0]: every token with x[t, 0] > 0 prefers expert 0
    let x: Vec<f64> = (0..n * c)
        .map(|i| {
            if i % c == 0 {
                1.0
            } else {
                0.1 * (i % 7) as f64
            }
        })
        .collect();
    let mut layer = MoeLayer::<f64>::new(mc).unwrap();
    let (y, st) = layer.forward(&th, &p, &x).unwrap();
    assert_eq!(st.routed, vec![8, 0, 0, 0]);
    assert_eq!(st.kept, vec![2, 0, 0, 0]);
    assert_eq!((st.dropped_assignments, st.dropped_tokens), (6, 6));
    assert_eq!(
        (st.max_load(), st.mean_load(), st.load_skew()),
        (8, 2.0, 4.0)
    );
    // Tokens 0 and 1 (first in order) are computed; 2..8 pass as zero.
    assert!(y[..2 * c].iter().all(|&v| v != 0.0));
    assert!(y[2 * c..].iter().all(|&v| v == 0.0));
    let (y2, st2) = layer.forward(&th, &p, &x).unwrap();
    assert_eq!((y2, st2), (y, st));
}

#[test]
fn ties_go_to_the_lowest_expert() {
    let th = Threads::single();
    let (n, c) = (6, 4);
    for k in [1, 2] {
        let mc = cfg(4, k, c, 5, 4.0, 0.0);
        let l = MoeLayout::new(mc, 1, 0).unwrap();
        let mut p = params(&mc, 7, 0.0);
        p[l.router()].fill(0.0); // uniform probabilities
        let x = rand_vec(8, n * c, 1.0);
        let (_, st) = MoeLayer::<f64>::new(mc)
            .unwrap()
            .forward(&th, &p, &x)
            .unwrap();
        let want = if k == 1 {
            vec![6, 0, 0, 0]
        } else {
            vec![6, 6, 0, 0]
        };
        assert_eq!(st.routed, want, "k = {k}");
        // Uniform routing is perfectly balanced in P but not in f: aux = E·Σ f_e/E = 1.
        assert!((st.aux_loss - 1.0).abs() < 1e-12, "{}", st.aux_loss);
    }
}

#[test]
fn bad_settings_are_refused_by_name() {
    let ok = cfg(4, 2, 16, 32, 1.25, 0.01);
    let e = MoeLayout::new(ok, 3, 0).unwrap_err().to_string();
    assert!(
        e.contains("experts") && e.contains("experts % ep == 0"),
        "{e}"
    );
    assert!(e.contains("(4) % ep (3) = 1"), "{e}");
    let e = MoeLayer::<f32>::new(MoeConfig { top_k: 3, ..ok })
        .unwrap_err()
        .to_string();
    assert!(e.contains("top_k"), "{e}");
    let e = MoeLayer::<f32>::new(MoeConfig {
        capacity_factor: 0.0,
        ..ok
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("capacity_factor"), "{e}");
    let mut layer = MoeLayer::<f32>::new(ok).unwrap();
    let th = Threads::single();
    let p = vec![0.0f32; layer.layout().len()];
    let e = layer.forward(&th, &p, &[0.0; 17]).unwrap_err().to_string();
    assert!(e.contains("C = 16"), "{e}");
    let e = layer
        .forward(&th, &p[1..], &[0.0; 16])
        .unwrap_err()
        .to_string();
    assert!(e.contains("moe parameters"), "{e}");
    let mut g = p.clone();
    let e = layer
        .backward(&th, &p, &mut g, &[0.0; 16])
        .unwrap_err()
        .to_string();
    assert!(e.contains("forward"), "{e}");
    // In a 3-rank group the layer refuses 4 experts, naming the field.
    let errs = run_threads(3, GroupConfig::for_training().unwrap(), move |g| {
        Ok(EpMoeLayer::new(ok, g).err().map(|e| e.to_string()))
    })
    .unwrap();
    for r in errs {
        let e = r.unwrap().expect("ep = 3 must be refused for E = 4");
        assert!(e.contains("experts % ep == 0"), "{e}");
    }
}

// ----------------------------------------------------------------------------
// expert parallelism against the single process

const E: usize = 4;
const C: usize = 16;
const F: usize = 32;
const N: usize = 32;
const TOL: f64 = 1e-5;

use common::max_rel_diff as rel;

struct Run {
    /// (N, C) outputs of every step, tokens in global order.
    y: Vec<Vec<f32>>,
    /// (N, C) input gradient of the first step.
    dx: Vec<f32>,
    /// The ep = 1 layout's gradient of the first step.
    g: Vec<f32>,
    /// The ep = 1 layout's parameters after the steps.
    p: Vec<f32>,
    /// Each rank's stats of the first step.
    stats: Vec<MoeStats>,
}

struct Inputs {
    cfg: MoeConfig,
    p: Vec<f32>,
    x: Vec<f32>,
    dy: Vec<f32>,
}

fn inputs(cfg: MoeConfig) -> Inputs {
    Inputs {
        cfg,
        p: f32s(&params(&cfg, 3, 1.0)),
        x: f32s(&rand_vec(4, N * C, 1.0)),
        dy: f32s(&rand_vec(5, N * C, 1.0)),
    }
}

/// What one rank returns: outputs per step, dx and grads of step 1, final
/// params, step-1 stats.
type RankOut = (Vec<Vec<f32>>, Vec<f32>, Vec<f32>, Vec<f32>, MoeStats);

/// A layer's forward: (params, x) -> (y, stats).
type FwdFn<'a> = dyn FnMut(&[f32], &[f32]) -> model::Result<(Vec<f32>, MoeStats)> + 'a;
/// A layer's backward: (params, grads, dy) -> dx.
type BwdFn<'a> = dyn FnMut(&[f32], &mut [f32], &[f32]) -> model::Result<Vec<f32>> + 'a;

/// `steps` AdamW steps of `Σ dy ⊙ y + aux_weight · aux` on this rank's slice.
fn rank_steps(
    layer_fwd: &mut FwdFn<'_>,
    layer_bwd: &mut BwdFn<'_>,
    mut p: Vec<f32>,
    x: &[f32],
    dy: &[f32],
    steps: usize,
) -> model::Result<RankOut> {
    let th = Threads::single();
    let cfg = AdamWConfig::default();
    let mut opt = AdamW::new(cfg, p.len())?;
    let (mut ys, mut first) = (Vec::new(), None);
    for _ in 0..steps {
        let (y, st) = layer_fwd(&p, x)?;
        let mut g = vec![0.0f32; p.len()];
        let dx = layer_bwd(&p, &mut g, dy)?;
        let all = 0..p.len();
        opt.step(&th, &mut p, &g, 1e-2, std::slice::from_ref(&all))?;
        ys.push(y);
        first.get_or_insert((dx, g, st));
    }
    let (dx, g, st) = first.unwrap_or_default();
    Ok((ys, dx, g, p, st))
}

fn run_ep(inp: &Arc<Inputs>, ep: usize, steps: usize) -> Run {
    let cuts: Vec<usize> = (0..=ep).map(|r| r * N / ep).collect();
    run_ep_cuts(inp, &cuts, steps)
}

/// Rank r of `cuts.len() - 1` holds tokens `cuts[r]..cuts[r + 1]`.
fn run_ep_cuts(inp: &Arc<Inputs>, cuts: &[usize], steps: usize) -> Run {
    let ep = cuts.len() - 1;
    let cuts = cuts.to_vec();
    let outs: Vec<RankOut> = if ep == 1 {
        let th = Threads::single();
        let layer = std::cell::RefCell::new(MoeLayer::<f32>::new(inp.cfg).unwrap());
        vec![
            rank_steps(
                &mut |p, x| layer.borrow_mut().forward(&th, p, x),
                &mut |p, g, dy| layer.borrow_mut().backward(&th, p, g, dy),
                inp.p.clone(),
                &inp.x,
                &inp.dy,
                steps,
            )
            .unwrap(),
        ]
    } else {
        let inp = inp.clone();
        run_threads(ep, GroupConfig::for_training().unwrap(), move |g| {
            let r = g.rank();
            let th = Threads::single();
            let rows = cuts[r] * C..cuts[r + 1] * C;
            let layer = EpMoeLayer::new(inp.cfg, g).map(std::cell::RefCell::new);
            Ok(layer.and_then(|layer| {
                let p = inp.p.clone();
                rank_steps(
                    &mut |p, x| layer.borrow_mut().forward(&th, p, x),
                    &mut |p, gr, dy| layer.borrow_mut().backward(&th, p, gr, dy),
                    p,
                    &inp.x[rows.clone()],
                    &inp.dy[rows.clone()],
                    steps,
                )
            }))
        })
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect()
    };
    let cat = |f: &dyn Fn(&RankOut) -> &Vec<f32>| -> Vec<f32> {
        outs.iter().flat_map(|o| f(o).iter().copied()).collect()
    };
    let y = (0..steps)
        .map(|s| outs.iter().flat_map(|o| o.0[s].iter().copied()).collect())
        .collect();
    let gs: Vec<Vec<f32>> = outs.iter().map(|o| o.2.clone()).collect();
    let ps: Vec<Vec<f32>> = outs.iter().map(|o| o.3.clone()).collect();
    Run {
        y,
        dx: cat(&|o| &o.1),
        g: gather(inp.cfg, &gs),
        p: gather(inp.cfg, &ps),
        stats: outs.into_iter().map(|o| o.4).collect(),
    }
}

fn check_ep_matches(cfg: MoeConfig, steps: usize) {
    let inp = Arc::new(inputs(cfg));
    let one = run_ep(&inp, 1, steps);
    assert!(
        one.stats[0].dropped_assignments > 0,
        "test wants drops: {:?}",
        one.stats[0]
    );
    for ep in [2, 4] {
        let r = run_ep(&inp, ep, steps);
        for s in 0..steps {
            let e = rel(&r.y[s], &one.y[s]);
            assert!(e < TOL, "ep {ep} step {s}: y differs by {e:e}");
        }
        let e = rel(&r.dx, &one.dx);
        assert!(e < TOL, "ep {ep}: dx differs by {e:e}");
        let l = MoeLayout::new(cfg, 1, 0).unwrap();
        let e = rel(&r.g[l.router()], &one.g[l.router()]);
        assert!(e < TOL, "ep {ep}: router grad differs by {e:e}");
        let e = rel(&r.g[l.router().end..], &one.g[l.router().end..]);
        assert!(e < TOL, "ep {ep}: expert grads differ by {e:e}");
        let e = rel(&r.p, &one.p);
        assert!(
            e < TOL,
            "ep {ep}: params after {steps} steps differ by {e:e}"
        );
        eprintln!(
            "ep {ep} k {}: rel diff y {:.1e}, dx {:.1e}, grads {:.1e}, params after {steps} steps {e:.1e}",
            cfg.top_k,
            rel(&r.y[0], &one.y[0]),
            rel(&r.dx, &one.dx),
            rel(&r.g, &one.g),
        );
        for st in &r.stats {
            let o = &one.stats[0];
            assert_eq!(
                (
                    &st.routed,
                    &st.kept,
                    st.dropped_assignments,
                    st.dropped_tokens,
                    st.capacity
                ),
                (
                    &o.routed,
                    &o.kept,
                    o.dropped_assignments,
                    o.dropped_tokens,
                    o.capacity
                ),
                "ep {ep}: routing metrics"
            );
            assert!((st.aux_loss - o.aux_loss).abs() < 1e-6);
        }
        // Repeated runs are bit-identical.
        let again = run_ep(&inp, ep, steps);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&again.p), bits(&r.p), "ep {ep}: repeat differs");
        assert_eq!(bits(&again.dx), bits(&r.dx), "ep {ep}: repeat differs");
        assert_eq!(bits(&again.y[steps - 1]), bits(&r.y[steps - 1]));
    }
}

#[test]
fn ep_top1_matches_single_process() {
    check_ep_matches(cfg(E, 1, C, F, 1.0, 0.01), 3);
}

#[test]
fn ep_top2_matches_single_process() {
    check_ep_matches(cfg(E, 2, C, F, 1.0, 0.05), 3);
}

/// F50 (000 L2519): one direction moves B·S·d·bytes; dispatch + combine
/// double it. With top-k and no drops every token row travels k times.
#[test]
fn all_to_all_volume_matches_f50() {
    let size = std::mem::size_of::<f32>();
    for k in [1, 2] {
        let inp = Arc::new(inputs(cfg(E, k, C, F, 8.0, 0.01)));
        for ep in [1, 2, 4] {
            let r = run_ep(&inp, ep, 1);
            let total: usize = r.stats.iter().map(|s| s.a2a_bytes).sum();
            let off: usize = r.stats.iter().map(|s| s.a2a_bytes_off_rank).sum();
            assert_eq!(r.stats[0].dropped_assignments, 0);
            assert_eq!(total, 2 * a2a_bytes_one_way(N, k, C, size), "ep {ep} k {k}");
            assert_eq!(total, 2 * N * k * C * size);
            if ep == 1 {
                assert_eq!(off, 0);
            } else {
                assert!(
                    off > 0 && off < total,
                    "ep {ep} k {k}: off-rank {off} of {total}"
                );
            }
        }
        // With drops only kept rows travel.
        let inp = Arc::new(inputs(cfg(E, k, C, F, 0.5, 0.01)));
        let r = run_ep(&inp, 2, 1);
        let kept: usize = r.stats[0].kept.iter().sum();
        let total: usize = r.stats.iter().map(|s| s.a2a_bytes).sum();
        assert_eq!(total, 2 * kept * C * size);
        assert!(kept < N * k);
    }
}

/// E34 (000 L2519): E = 64 experts on 64 GPUs, B = 4, S = 2048,
/// d_model = 4096, FP16, top-1: 67 MB one way, about 134 MB per block.
#[test]
fn f50_worked_example() {
    let one_way = a2a_bytes_one_way(4 * 2048, 1, 4096, 2);
    assert_eq!(one_way, 67_108_864);
    assert_eq!(2 * one_way, 134_217_728);
}

/// Ranks may hold different numbers of tokens (one none at all): capacity
/// and token order are global, so the result is still the single process's.
#[test]
fn ep_uneven_slices_match_single_process() {
    let inp = Arc::new(inputs(cfg(E, 2, C, F, 1.0, 0.05)));
    let one = run_ep(&inp, 1, 2);
    for cuts in [vec![0, 0, N], vec![0, 5, 20, 20, N]] {
        let r = run_ep_cuts(&inp, &cuts, 2);
        for (what, a, b) in [
            ("y", &r.y[1], &one.y[1]),
            ("dx", &r.dx, &one.dx),
            ("grads", &r.g, &one.g),
            ("params", &r.p, &one.p),
        ] {
            let e = rel(a, b);
            assert!(e < TOL, "cuts {cuts:?}: {what} differs by {e:e}");
        }
        assert_eq!(r.stats[0].kept, one.stats[0].kept);
    }
}

/// Ranks built with different settings fail together at the counts
/// exchange, naming the odd rank, instead of exchanging mismatched rows.
#[test]
fn mismatched_rank_configs_are_refused() {
    let base = cfg(E, 2, C, F, 1.0, 0.01);
    let outs = run_threads(2, GroupConfig::for_training().unwrap(), move |g| {
        let r = g.rank();
        let mc = MoeConfig {
            capacity_factor: if r == 1 { 1.5 } else { 1.0 },
            ..base
        };
        let th = Threads::single();
        let res = EpMoeLayer::new(mc, g).and_then(|mut layer| {
            let p = vec![0.01f32; layer.experts.layout().len()];
            layer.forward(&th, &p, &[0.5; 4 * C])
        });
        Ok(res.err().map(|e| e.to_string()))
    })
    .unwrap();
    for (r, o) in outs.into_iter().enumerate() {
        let e = o.unwrap().expect("mismatched configs must be refused");
        assert!(
            e.contains("moe config") && e.contains("rank"),
            "rank {r}: {e}"
        );
    }
}
